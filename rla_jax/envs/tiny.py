"""A built-in toy task family that exercises the whole loop in seconds.

Each task is a lock with `stages` dials. Every turn the agent names one
symbol; the dial of the current stage opens when `ord(symbol) % modulus`
equals that stage's secret residue. The episode is won when all dials are
open within `max_turns` turns. A uniformly random agent opens a dial with
probability 1/modulus, so difficulty moves predictably with both knobs and
even a random tiny model produces a spread of task accuracies; that is what
lets rewrites and their acceptance happen in a one-minute run.

The environment LLM's completion chooses the rewrite: a `\\boxed{m,s}` that
moves in the asked direction is used as is; otherwise the first character of
the completion picks which knob moves one notch (a toy stand-in for a real
LLM's proposal, so a random model still yields valid candidates). Such a
notch is the setting's generator, not the LLM: its spec is marked
base.FALLBACK_KEY = 'notch' and the curator counts it as a fallback rewrite.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

from rla_jax import boxed
from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base
from rla_jax.envs import word_tokenizer


def _residue(spec: dict[str, Any], stage: int) -> int:
  digest = hashlib.sha256(f'{spec["seed"]}:{stage}'.encode()).digest()
  return digest[0] % spec['modulus']


def success_probability(modulus: int, stages: int, turns: int) -> float:
  """P(a uniformly random agent opens `stages` dials within `turns` turns)."""
  p = 1.0 / modulus
  miss = sum(math.comb(turns, k) * p**k * (1 - p)**(turns - k)
             for k in range(min(stages, turns + 1)))
  return 1.0 - miss


class LockEpisode:
  """One play-through of a lock task.

  `info['step_labels']` says per step whether it opened a dial (+1) or not
  (-1): the true process labels of this toy task.
  """

  def __init__(self, spec: dict[str, Any], max_turns: int):
    self.spec = spec
    self.max_turns = max_turns
    self.stage = 0
    self.turn = 0
    self.info = {'step_labels': []}

  def _prompt(self) -> str:
    return (f'dial {self.stage + 1} of {self.spec["stages"]}, '
            f'{self.max_turns - self.turn} turns left.')

  def reset(self) -> str:
    return 'a lock. ' + self._prompt()

  def step(self, action: str) -> tuple[str, bool, float | None]:
    if self.turn >= self.max_turns:
      raise RuntimeError('step() after the episode ended')
    self.turn += 1
    symbol = action[:1]
    opened = bool(symbol) and (
        ord(symbol) % self.spec['modulus'] == _residue(self.spec, self.stage))
    if opened:
      self.stage += 1
    self.info['step_labels'].append(1 if opened else -1)
    if self.stage == self.spec['stages']:
      return 'the lock opens.', True, 1.0
    if self.turn == self.max_turns:
      return 'out of turns.', True, -1.0
    verdict = 'click! ' if opened else 'nothing. '
    return verdict + self._prompt(), False, None

  def close(self) -> None:
    pass


class TinyEnv:
  """The lock task family (see module docstring)."""

  def __init__(self, *, num_train: int, num_eval: int, max_turns: int,
               modulus_range: Sequence[int], stages_range: Sequence[int],
               max_modulus: int, seed: int, fail_task_ids: Sequence[str] = ()):
    self.max_turns = max_turns
    self.max_modulus = max_modulus
    self._modulus_range = tuple(modulus_range)
    self._stages_range = tuple(stages_range)
    self._seed = seed
    self._counts = {'train': num_train, 'eval': num_eval}
    self._fail_task_ids = set(fail_task_ids)  # tests: these raise in step()

  def tasks(self, split: str) -> list[dict[str, Any]]:
    specs = []
    for i in range(self._counts[split]):
      h = hashlib.sha256(f'{self._seed}:{split}:{i}'.encode()).digest()
      lo_m, hi_m = self._modulus_range
      lo_s, hi_s = self._stages_range
      specs.append({'id': f'{split}{i:04d}', 'seed': int(h[0]) * 256 + h[1],
                    'modulus': lo_m + h[2] % (hi_m - lo_m + 1),
                    'stages': lo_s + h[3] % (hi_s - lo_s + 1)})
    return specs

  def make_episode(self, spec: dict[str, Any], seed: int,
                   max_turns: int) -> LockEpisode:
    del seed  # the lock is deterministic; randomness comes from the policy
    if spec['id'] in self._fail_task_ids:
      return _BrokenEpisode()
    return LockEpisode(spec, max_turns)

  def policy_messages(self, spec, turns, observation):
    lines = [f'{obs} you said: {act[:1]!r}\n' for obs, act in turns]
    text = (truncation.cuttable(''.join(lines)) + observation +
            '\nname one symbol.')
    return [{'role': 'user', 'content': text}]

  def parse_action(self, response: str, observation: str) -> str:
    del observation
    return response.strip()[:1]

  def judge_messages(self, spec, policy_prompt, response, next_observation):
    del spec
    text = (f'{policy_prompt[-200:]}\nagent: {response[:8]!r}\n'
            f'result: {next_observation}\nscore the move: 1 good, -1 bad.')
    return [{'role': 'user', 'content': text},
            {'role': 'assistant', 'content': '\\boxed{'}]

  def describe(self, spec: dict[str, Any]) -> str:
    return (f'lock with {spec["stages"]} dials, modulus {spec["modulus"]}, '
            f'{self.max_turns} turns')

  def difficulty(self, spec: dict[str, Any]) -> float:
    """1 - P(success) of a uniformly random agent."""
    return 1.0 - success_probability(spec['modulus'], spec['stages'],
                                     self.max_turns)

  def reward_cases(self) -> list[base.RewardCase]:
    """A two-dial lock opened dial by dial, and tried with a symbol that
    opens no dial."""
    spec = {'id': 'reward-check', 'seed': 1, 'modulus': 3, 'stages': 2}
    symbols = [chr(c) for c in range(ord('a'), ord('a') + spec['modulus'])]
    opening = tuple(next(s for s in symbols if ord(s) % spec['modulus'] ==
                         _residue(spec, stage))
                    for stage in range(spec['stages']))
    wrong = next(s for s in symbols
                 if ord(s) % spec['modulus'] != _residue(spec, 0))
    return [base.RewardCase('the dials opened in order', spec, opening, True),
            base.RewardCase('a symbol that opens nothing', spec,
                            (wrong,) * spec['stages'], False)]

  def _valid(self, spec, modulus, stages, direction) -> bool:
    if not (1 <= modulus <= self.max_modulus and 1 <= stages <= self.max_turns):
      return False
    change = self.difficulty({**spec, 'modulus': modulus, 'stages': stages}) - (
        self.difficulty(spec))
    return change > 0 if direction == structs.HARDER else change < 0

  def rewrite(self, request: base.RewriteRequest, generate, attempts):
    """Moves the active lock one notch (rewrites compound from it)."""
    spec, direction = request.spec, request.direction
    step = 1 if direction == structs.HARDER else -1
    prompt = (f'make this task {direction}: {self.describe(spec)}; the agent '
              f'won {request.acc_old:.0%} of its tries.\nfailures:\n' +
              truncation.cuttable(
                  ''.join(f'- {c}\n' for c in request.critiques)) +
              'answer \\boxed{modulus,stages}.')
    completions = generate([f'{prompt} (attempt {i + 1}/{attempts})'
                            for i in range(attempts)])
    for text in completions:
      answer = boxed.last_boxed(text) or ''
      numbers = [int(n) for n in re.findall(r'\d+', answer)]
      fallback = not (len(numbers) == 2 and
                      self._valid(spec, *numbers, direction))
      if not fallback:
        modulus, stages = numbers
      else:
        request.rejected.append('invalid_answer')
        knob = 'modulus' if (ord(text[:1] or 'a') % 2) else 'stages'
        moved = {**spec, knob: spec[knob] + step}
        if not self._valid(spec, moved['modulus'], moved['stages'], direction):
          other = 'stages' if knob == 'modulus' else 'modulus'
          moved = {**spec, other: spec[other] + step}
        modulus, stages = moved['modulus'], moved['stages']
      if self._valid(spec, modulus, stages, direction):
        version = spec.get('version', 0) + 1
        root = spec.get('root_id', spec['id'])
        new = {**spec, 'id': f'{root}.v{version}', 'root_id': root,
               'version': version, 'modulus': modulus, 'stages': stages}
        new.pop(base.FALLBACK_KEY, None)
        if fallback:
          new[base.FALLBACK_KEY] = 'notch'
        return new
    raise base.RewriteRejected(
        f'{spec["id"]}: no {direction} setting within bounds '
        f'(modulus <= {self.max_modulus}, stages <= {self.max_turns})',
        reason='out_of_bounds')


class _BrokenEpisode:
  """Simulates an environment crash (used to test `error` trajectories)."""

  def reset(self) -> str:
    return 'a lock that will break.'

  def step(self, action: str):
    raise RuntimeError(f'simulated environment failure on {action!r}')

  def close(self) -> None:
    pass


def from_config(env_config, workdir: str) -> TinyEnv:
  del workdir
  return TinyEnv(num_train=env_config.num_train, num_eval=env_config.num_eval,
                 max_turns=env_config.max_turns,
                 modulus_range=env_config.modulus_range,
                 stages_range=env_config.stages_range,
                 max_modulus=env_config.max_modulus, seed=env_config.seed,
                 fail_task_ids=env_config.fail_task_ids)


def make_tokenizer(stage_texts: Sequence[str] = ()):
  """Tokenizer of random models: character level, so it covers every text
  the stages add (`stage_texts`) without listing them."""
  del stage_texts
  return word_tokenizer.make_tokenizer()
