"""The memory plan and the GPU check run end to end at a tiny size on CPU;
the sampler benchmark's bandwidth fraction counts what it should; both
benchmarks' --profile name the stages."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *flags):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'benchmarks', script), *flags],
      capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
      check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


@pytest.mark.slow
def test_memory_plan_tiny():
  out = _run('memory_plan.py', '--tiny')
  # One row per program, each with the per-device numbers and headroom.
  rows = [line for line in out.splitlines() if line.startswith('tiny ')]
  assert [r.split()[3:5] for r in rows] == [
      ['policy', 'step'], ['rm', 'step'], ['policy', 'sampler'],
      ['rm', 'sampler']], out
  assert "'embed': 'fsdp'" in out and "{'data': 1, 'fsdp': 2, 'tensor': 2}" in out
  for row in rows:
    args, total = float(row.split()[5]), float(row.split()[10])
    assert 0 < args <= total, row
  worst = float(re.search(r'worst_headroom=([\d.]+)', out).group(1))
  assert 0.5 < worst < 1.0


@pytest.mark.slow
def test_gpu_check_tiny_on_cpu():
  out = _run('gpu_check.py', '--tiny')
  assert re.search(r'tiny decode: batch 4, .* tok/s.*host [\d.]+ ms per '
                   r'call', out), out
  assert re.search(r'tiny train: 2 x 64 tokens, .* tok/s.*host [\d.]+ ms per '
                   r'step', out), out
  assert 'gpu_check decode_bw_fraction=nan train_mfu=nan' in out  # no peaks


def test_sampler_bandwidth_fraction_counts_weights_and_cache(monkeypatch):
  """benchmarks/sampler.py's bandwidth_frac: every weight and each row's
  cache at the mean length, read once per step, over the copy rate."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      'sampler_bench', os.path.join(ROOT, 'benchmarks', 'sampler.py'))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  config = transformer.ModelConfig('qwen2', 128, 64, 96, 2, 4, 2, 16,
                                   tie_word_embeddings=True)
  model = transformer.create(config)
  # float32: the tied embedding 128x64; per layer q 64x64, k and v 64x32,
  # o 64x64, gate, up and down 64x96, two norms; the final norm.
  weights = 4 * (128 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64
                                 + 3 * 64 * 96 + 2 * 64) + 64)
  # k and v, 2 layers, 2 kv heads, head_dim 16, 3 rows, 10.5 slots
  cache = 4 * 2 * 2 * 2 * 16 * 3 * 10.5
  monkeypatch.setattr(bench, 'copy_bandwidth', lambda: 1e6)
  frac = bench.bandwidth_fraction(model, 3, 10.5, 1000.0)
  assert frac == pytest.approx((weights + cache) / 1e6)


def _stage_ms(out, stage):
  m = re.search(rf'^  {re.escape(stage)} +([\d.]+) ms', out, re.M)
  assert m, (stage, out)
  return float(m.group(1))


@pytest.mark.slow
def test_train_step_profile_names_the_stages():
  out = _run('train_step.py', '--rounds=1', '--steps_per_round=1',
             '--profile')
  for stage in ('LM head and loss', 'MLP', 'attention core',
                'attention projections', 'optimizer and clipping'):
    assert _stage_ms(out, stage) > 0, stage
  assert 'longest instructions:' in out
  assert re.search(r'^ratio_vs_torch=[\d.]+$', out, re.M), out


@pytest.mark.slow
def test_sampler_profile_splits_prefill_and_decode_stages():
  out = _run('sampler.py', '--rounds=1', '--batch=2', '--new=8',
             '--skip-sessions', '--profile')
  assert _stage_ms(out, 'prefill and set-up') > 0
  for stage in ('attention over the cache', 'MLP', 'LM head',
                'q/k/v/o projections'):
    m = re.search(rf'^  decode: {re.escape(stage)}, ([\d.]+) ms a step +'
                  r'([\d.]+) ms', out, re.M)
    assert m and float(m.group(2)) > 0, (stage, out)
    assert float(m.group(1)) == pytest.approx(float(m.group(2)) / 8,
                                              abs=0.01), m.group(0)
  assert re.search(r'ratio_vs_transformers=[\d.]+ bandwidth_frac=[\d.]+',
                   out), out
