"""benchmarks/step_profile.py: the time split, the stacks read from a
compiled module, a profiled run's stages (both benchmarks' --profile run in
benchmarks_test.py)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))

import step_profile  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def test_attribute_splits_overlaps_and_counts_gaps_as_host():
  # a: 0-10 us, b: 5-15 us (overlap 5-10 shared), idle 15-20, c: 20-30.
  spans = [('a', 0.0, 10.0), ('b', 5.0, 15.0), ('c', 20.0, 30.0)]
  got = step_profile.attribute(spans, 0.0, 32.0)
  want = {'a': 7.5e-6, 'b': 7.5e-6, 'c': 10e-6, step_profile.HOST: 7e-6}
  assert set(got) == set(want)
  for name, seconds in want.items():
    assert got[name] == pytest.approx(seconds), name


def _score_part(x_NxN):
  return jnp.exp(x_NxN @ x_NxN)


def _sum_part(y_NxN):
  # A sort: XLA fuses it with nothing, so each part is its own instruction.
  return jnp.sort(y_NxN, axis=0)[-1]


def _program(x_NxN):
  return _sum_part(_score_part(x_NxN))


def _compiled(n=256):
  x = jnp.ones((n, n), jnp.float32) / n
  compiled = jax.jit(_program).lower(x).compile()
  return compiled, x


def test_stacks_name_the_python_functions_of_each_instruction():
  compiled, _ = _compiled()
  found = step_profile.stacks(compiled.as_text())
  dots = [stack for opcode, stack in found.values()
          if opcode in ('dot', 'fusion') and stack
          and stack[0].endswith(':_score_part')]
  assert dots, found
  # Innermost first, the callers after it, with their files.
  assert dots[0][1].endswith('step_profile_test.py:_program'), dots[0]


def test_run_splits_a_program_into_its_stages():
  compiled, x = _compiled(512)
  fn = jax.jit(_program)
  jax.block_until_ready(fn(x))
  classify = step_profile.by_frames(
      (('scores', ('_score_part',)), ('sums', ('_sum_part',))), 'other')
  stages, wall, longest = step_profile.run(
      lambda: jax.block_until_ready(fn(x)), compiled.as_text(), classify)
  assert stages['scores'] > 0 and stages['sums'] > 0, stages
  assert set(stages) <= {'scores', 'sums', 'other', step_profile.HOST}
  assert sum(stages.values()) == pytest.approx(wall, rel=0.05)
  assert longest and all(stage in stages for _, stage, _, _ in longest)
  assert 'scores' in step_profile.table(stages, wall, longest)


def test_run_refuses_a_module_that_is_not_the_program_that_ran():
  other = jax.jit(lambda a: jnp.sin(a) * 3).lower(jnp.ones(4)).compile()
  _, x = _compiled()
  fn = jax.jit(_program)
  jax.block_until_ready(fn(x))
  with pytest.raises(RuntimeError, match='not the program that ran'):
    step_profile.run(lambda: jax.block_until_ready(fn(x)), other.as_text(),
                     lambda stack: 'all')
