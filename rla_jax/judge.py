"""The generative reward model as a step judge (RLANYTHING.md 2.4, 3.4).

For every step of every finished trajectory the RM is sampled m times with
the shared sampler, from the RM's own parameters; each answer's last
\\boxed{} gives the score S in {-1, 0, +1} (0 when unparseable).
"""

from __future__ import annotations

import re

from rla_jax import chat
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


def score(rm_model, tokenizer, env, trajectories, *, num_samples: int,
          sampling, seed: int, mesh=None, rules=None
          ) -> list[structs.Judgment]:
  """m judgments for each step of each non-error trajectory, in one batch."""
  requests, messages = [], []
  for traj in trajectories:
    if traj.status != structs.OK:
      continue
    for k, step in enumerate(traj.steps):
      requests.append((traj, k))
      messages.append(env.judge_messages(traj.spec, step.prompt, step.response,
                                         step.observation))
  completions = chat.complete(rm_model, tokenizer, messages, sampling=sampling,
                              num_samples=num_samples, seed=seed, mesh=mesh,
                              rules=rules)
  judgments = []
  for (traj, k), msgs, samples in zip(requests, messages, completions):
    prefix = msgs[-1]['content'] if msgs[-1]['role'] == 'assistant' else ''
    for j, c in enumerate(samples):
      s = parse_score(prefix + c.text)
      judgments.append(structs.Judgment(
          task_id=traj.task_id, source=traj.source, rollout=traj.rollout,
          step=k, sample=j, prompt=c.prompt, prompt_tokens=c.prompt_tokens,
          response=c.text, response_tokens=c.tokens, logprobs=c.logprobs,
          score=0 if s is None else s, parsed=s is not None,
          prompt_cut=c.prompt_cut))
  return judgments
