"""The start-up reward check: known outcomes through the real evaluator.

A reward that is always -1 (a sandbox that cannot start, a desktop whose
evaluator reads nothing, a game engine that never says 'won') or always +1
trains nothing, and it is usually found days later in a flat curve. Before
epoch 1 the loop plays each of the setting's `reward_cases()`
(base.RewardCase: a known pass and a known fail at least) along the path
rollouts take: `make_episode`, `reset`, `step` on each action until the
episode ends. A known pass that does not end +1, a known fail that does not
end -1, or an episode that raises stops the run with one line naming the
setting and the case. `config.loop.check_rewards=False` skips it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rla_jax.envs import base

_SHOWN_CHARS = 200  # of the last observation, in the message


class RewardCheckFailed(RuntimeError):
  """A known outcome came out wrong: the setting's evaluator is broken."""


def check(env: Any, setting: str) -> tuple[int, float]:
  """Plays every reward case of `env`; (cases played, seconds).

  Raises RewardCheckFailed naming `setting` and the case that failed.
  """
  start = time.perf_counter()
  hook = getattr(env, 'reward_cases', None)
  try:
    cases = list(hook()) if hook else []
  except Exception as e:  # pylint: disable=broad-except
    raise RewardCheckFailed(
        f'reward check: setting {setting!r} could not make its known cases: '
        f'{type(e).__name__}: {_clip(str(e))}') from e
  if not cases:
    logging.warning('setting %r has no known reward cases here: its rewards '
                    'are not checked before training', setting)
    return 0, 0.0
  if {case.passes for case in cases} != {True, False}:
    raise RewardCheckFailed(
        f'setting {setting!r}: reward_cases() must hold a known pass and a '
        f'known fail; it gave {[(c.name, c.passes) for c in cases]}')
  for case in cases:
    _check_case(env, setting, case)
  return len(cases), time.perf_counter() - start


def _check_case(env: Any, setting: str, case: base.RewardCase):
  kind = 'pass' if case.passes else 'fail'
  where = f'setting {setting!r}, case {case.name!r} (a known {kind})'
  hint = ('; the evaluator is broken (set --config.loop.check_rewards=False '
          'to train anyway)')
  try:
    outcome, observation = _play(env, case)
  except Exception as e:  # pylint: disable=broad-except
    raise RewardCheckFailed(
        f'reward check: {where} raised {type(e).__name__}: '
        f'{_clip(str(e))}{hint}') from e
  if outcome is None:
    raise RewardCheckFailed(
        f'reward check: {where} did not end after its {len(case.actions)} '
        f'actions (last observation: {_clip(observation)!r}){hint}')
  if outcome != (1.0 if case.passes else -1.0):
    raise RewardCheckFailed(
        f'reward check: {where} scored {outcome:+g} (last observation: '
        f'{_clip(observation)!r}){hint}')


def _play(env: Any, case: base.RewardCase) -> tuple[float | None, str]:
  """(the outcome, or None if the episode did not end; last observation)."""
  episode = env.make_episode(case.spec, 0, len(case.actions))
  try:
    observation = episode.reset()
    for action in case.actions:
      observation, done, outcome = episode.step(action)
      if done:
        return outcome, observation
    return None, observation
  finally:
    episode.close()


def _clip(text: Any) -> str:
  text = ' '.join(str(text).split())
  return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + '...'
