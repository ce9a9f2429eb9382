"""The generative reward model: a step judge or a unit-test writer.

Agents (RLANYTHING.md 2.4, 3.4): for every step of every finished trajectory
the RM is sampled m times with the shared sampler, from the RM's own
parameters; each answer's last \\boxed{} gives the score S in {-1, 0, +1}
(0 when unparseable). Coding (5.4): each task version gets m unit tests,
run on every program of the task.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from rla_jax import chat
from rla_jax import distributed
from rla_jax import structs
from rla_jax.boxed import last_boxed

# Dash-like characters that a model may write for a minus sign.
_MINUS = str.maketrans({
    '\u2010': '-',  # hyphen
    '\u2011': '-',  # non-breaking hyphen
    '\u2012': '-',  # figure dash
    '\u2013': '-',  # en dash
    '\u2014': '-',  # em dash
    '\u2212': '-',  # minus sign
    '\ufe63': '-',  # small hyphen-minus
    '\uff0d': '-',  # fullwidth hyphen-minus
    '\uff0b': '+',  # fullwidth plus
})
_FRACTION = re.compile(r'\d\s*/\s*\d|\\[dt]?frac\b')
# A sign separated from its digit by spaces or LaTeX spacing (`- 1`, `-\,1`,
# `+~1`) is still that digit's sign.
_SPACED_SIGN = re.compile(r'([+-])(?:\s|~|\\[,;:! ]|\\q?quad\b)+(?=\d)')
_NUMBER = re.compile(r'[+-]?\d+(?:\.\d+)?')


def parse_score(text: str) -> int | None:
  """The step score S in {-1, +1} from a judge answer, None if unparseable.

  Rules (authors' parser, RLANYTHING.md 3.4), on the last box's content with
  dash variants mapped to '-', a spaced sign joined to its digit ('- 1',
  '-\\,1' -> '-1') and whitespace stripped:
    '1' or '+1' -> +1; '-1' -> -1;
    a fraction (a/b, \\frac) -> None;
    otherwise, if exactly one number inside equals +-1 -> that number;
    else None. No box -> None.
  Callers use S = 0, parsed = False for None.
  """
  content = last_boxed(text)
  if content is None:
    return None
  content = _SPACED_SIGN.sub(r'\1', content.translate(_MINUS)).strip()
  if content in ('1', '+1'):
    return 1
  if content == '-1':
    return -1
  if _FRACTION.search(content):
    return None
  units = [v for v in map(float, _NUMBER.findall(content)) if abs(v) == 1.0]
  if len(units) == 1:
    return int(units[0])
  return None


def score(rm_model, tokenizer, env, trajectories, *, mode: str,
          num_samples: int, sampling, seed: int, mesh=None, rules=None
          ) -> list[structs.Judgment]:
  """m RM samples per judged unit of the non-error trajectories, one batch.

  mode 'steps' (config.feedback.mode): each step of each trajectory is judged
  (env.judge_messages), scores parsed by `parse_score`. 'unit_tests': each
  task version (group)
  gets m unit tests from the RM (env.rm_messages, env.parse_judgment), each
  then run on every program of the group (env.execute); see `_run_tests`.
  """
  if mode not in structs.FEEDBACK_MODES:
    raise ValueError(f'config.feedback.mode={mode!r}: one of '
                     f'{structs.FEEDBACK_MODES}')
  steps = mode == structs.STEPS
  ok = [t for t in trajectories if t.status == structs.OK]
  if steps:
    requests = [(t, k, env.judge_messages(t.spec, s.prompt, s.response,
                                          s.observation))
                for t in ok for k, s in enumerate(t.steps)]
  else:
    for method in ('rm_messages', 'parse_judgment', 'supports_unit_tests',
                   'execute'):
      if not hasattr(env, method):
        raise ValueError(f'config.feedback.mode={mode!r} needs an environment '
                         f'that writes unit tests; {type(env).__name__} has '
                         f'no {method}()')
    groups = _groups(ok)
    requests = [(trajs[0], structs.TASK_LEVEL, env.rm_messages(trajs[0].spec))
                for trajs in groups.values()
                if env.supports_unit_tests(trajs[0].spec)]
  completions = chat.complete(rm_model, tokenizer, [m for *_, m in requests],
                              sampling=sampling, num_samples=num_samples,
                              seed=seed, mesh=mesh, rules=rules)
  judgments = []
  for (traj, k, msgs), samples in zip(requests, completions):
    prefix = msgs[-1]['content'] if msgs[-1]['role'] == 'assistant' else ''
    for j, c in enumerate(samples):
      if steps:
        s, info = parse_score(prefix + c.text), {}
      else:
        test = env.parse_judgment(prefix + c.text)
        s, info = (None if test is None else 1), {
            'test': None if test is None else list(test)}
      judgments.append(structs.Judgment(
          task_id=traj.task_id, source=traj.source,
          rollout=traj.rollout if steps else structs.TASK_LEVEL,
          step=k, sample=j, prompt=c.prompt, prompt_tokens=c.prompt_tokens,
          response=c.text, response_tokens=c.tokens, logprobs=c.logprobs,
          score=0 if s is None else s, parsed=s is not None,
          prompt_cut=c.prompt_cut, images=c.images, info=info))
  if not steps:
    _run_tests(env, groups, judgments)
  return judgments


def _groups(trajectories):
  groups = {}
  for traj in trajectories:
    groups.setdefault(traj.group, []).append(traj)
  return groups


def _run_tests(env, groups, judgments):
  """Runs every RM test of a group on each of its programs (in place).

  Sets info['rollouts'] (rollout ids, the order of the programs) and
  info['passed'] (one bool per program; unparseable tests fail all). When
  the environment fails to run them (the sandbox broke), 'passed' stays
  None and the group's RM judgments are not trained on.
  """
  by_group = {}
  for j in judgments:
    by_group.setdefault(j.group, []).append(j)
  results = {}  # group index -> passes_PxU; each process runs its share
  for i, (group, tests) in enumerate(by_group.items()):
    if not distributed.owns(i):
      continue
    trajs = groups[group]
    programs = [t.info.get('program', '') for t in trajs]
    try:
      results[i] = np.asarray(env.execute(trajs[0].spec, programs,
                                          [j.info['test'] for j in tests]))
    except Exception:  # pylint: disable=broad-exception-caught
      logging.exception('running the RM tests of %s failed', group)
      results[i] = None
  results = distributed.gather_owned(results)
  for i, (group, tests) in enumerate(by_group.items()):
    passes_PxU = results[i]
    for u, j in enumerate(tests):
      j.info['rollouts'] = [t.rollout for t in groups[group]]
      j.info['passed'] = (None if passes_PxU is None else
                          [bool(x) for x in passes_PxU[:, u]])
