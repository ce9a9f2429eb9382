"""Playing ALFWorld games: TextWorld's PDDL engine, episodes, step labels.

A game file is played by TextWorld's `PddlEnv` (fast-downward) behind
ALFWorld's name demangler, exactly as ALFWorld's text environment does:
admissible commands, `won`, and optionally the planner's plan from the
current state (`policy_commands`) or the facts ALFWorld's handcoded expert
reads. Two facts about the engine shape this module:

- fast-downward's translator edits module globals, its shared library is
  loaded and freed through ctypes, and TextWorld parses its grammar with a
  shared tatsu parser at every step; none of it is thread-safe, so making
  and closing an engine, loading a game, resetting and stepping all take
  `LOCK` (the work is GIL-bound Python anyway; a library loaded while
  another thread translated a game crashed the process).
- every `PddlEnv` loads its own copy of the planner's shared library, and
  a copy must never be unloaded (see `Engines`), so engines are pooled and
  reused, and one that already holds a game skips reloading it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import json
import threading
from typing import Any

LOCK = threading.RLock()
# Planner action costs of alfred.pddl (heat/cool/clean/toggle cost 5).
_COSTLY = ('heat ', 'cool ', 'clean ', 'use ', 'slice ')
LABELS = ('planner', 'handcoded', 'none')
ACTIONS_HEADER = 'Admissible actions:'


def plan_cost(plan: Sequence[str]) -> int:
  """Cost of a plan under alfred.pddl's action costs."""
  return sum(5 if c.startswith(_COSTLY) else 1 for c in plan)


def render(text: str, commands: Sequence[str]) -> str:
  """An observation: the game's text, then the numbered admissible actions."""
  if not commands:
    return text
  listed = '\n'.join(f'{i}) {c}' for i, c in enumerate(commands))
  return f'{text}\n\n{ACTIONS_HEADER}\n{listed}'


def split(observation: str) -> tuple[str, list[str]]:
  """Inverse of render: (text, admissible commands)."""
  text, sep, rest = observation.rpartition(f'\n\n{ACTIONS_HEADER}\n')
  if not sep:
    return observation, []
  commands = []
  for line in rest.split('\n'):
    number, paren, command = line.partition(') ')
    if not paren or number != str(len(commands)):
      break
    commands.append(command)
  return text, commands


def _textworld():
  """(textworld, PddlEnv, alfworld's TextWorld wrappers), imported late."""
  # pylint: disable=g-import-not-at-top
  try:
    import textworld
    from textworld.envs import pddl
    from alfworld.agents.environment import alfred_tw_env
  except ImportError as e:
    raise ImportError('The ALFWorld setting needs `pip install alfworld` (or '
                      'the `alfworld` extra of rla_jax).') from e
  return textworld, pddl.PddlEnv, alfred_tw_env


class Engines:
  """A pool of loaded PddlEnv engines, per kind of requested information.

  `acquire(path, kind)` prefers an idle engine that already holds `path`.
  Engines are never closed: every copy of the planner's library registers
  its plugins in one registry that all copies share (a GNU-unique C++
  static), so unloading a copy (`fast_downward.close_lib`) leaves entries
  pointing into unmapped code, and the next copy that is loaded crashes the
  process. The pool grows to the largest number of episodes played at once.
  """

  def __init__(self):
    self._idle: dict[str, collections.OrderedDict] = collections.defaultdict(
        collections.OrderedDict)  # kind -> {id(engine): (path, engine)}
    self._lock = threading.Lock()
    self.created = 0

  def acquire(self, path: str, kind: str):
    with self._lock:
      idle = self._idle[kind]
      key = next((k for k, (p, _) in idle.items() if p == path), None)
      if key is None and idle:
        key = next(iter(idle))
      held_path, engine = idle.pop(key) if key is not None else (None, None)
    if engine is None:
      engine = self._make(kind)
    if held_path != path:
      try:
        with LOCK:
          engine.load(path)
      except BaseException:
        self.release(None, kind, engine)  # it loads the next game fine
        raise
    return engine

  def release(self, path: str | None, kind: str, engine) -> None:
    with self._lock:
      self._idle[kind][id(engine)] = (path, engine)

  def _make(self, kind: str):
    textworld, pddl_env, alfred = _textworld()
    infos = textworld.EnvInfos(admissible_commands=True, won=True,
                               facts=kind == 'handcoded',
                               policy_commands=kind == 'planner')
    with LOCK:  # PddlEnv() loads the planner's library (not thread-safe)
      self.created += 1
      return alfred.AlfredDemangler(pddl_env(infos), shuffle=False)


ENGINES = Engines()


class Episode:
  """One play-through of a game file; ends (lost) after `max_turns` turns.

  `info['step_labels']`: per step, +1 if the action lies on an expert plan
  from the state it was taken in, else -1. With labels='planner' that is a
  cost-optimal plan of fast-downward (the action lowers the remaining plan
  cost, or wins); with 'handcoded' it is ALFWorld's handcoded expert's next
  action (which explores the way an agent that does not see inside closed
  receptacles must); 'none' records no labels. `info['task_type']` and
  `info['won_at']` (the winning step) describe the episode.
  """

  def __init__(self, path: str, task_type: str, max_turns: int,
               labels: str = 'planner', engines: Engines = ENGINES):
    if labels not in LABELS:
      raise ValueError(f'labels={labels!r}: one of {LABELS}')
    self._path = path
    self._max_turns, self._labels, self._engines = max_turns, labels, engines
    self._engine = None
    self._turn = 0
    self._done = False
    self._cost = None
    self._expert = None
    self._suggestion = None
    self.info: dict[str, Any] = {'step_labels': [], 'task_type': task_type}

  def reset(self) -> str:
    self.close()
    self._engine = self._engines.acquire(self._path, self._labels)
    with LOCK:
      state = self._engine.reset()
    self._turn, self._done = 0, False
    self.info = {'step_labels': [], 'task_type': self.info['task_type'],
                 'won_at': None}
    if self._labels == 'planner':
      self._cost = self._remaining(state)
    elif self._labels == 'handcoded':
      from alfworld.agents import expert  # pylint: disable=g-import-not-at-top
      self._expert = expert.HandCodedTWAgent(max_steps=10_000)
      self._expert.reset(self._path)  # reads the trial's traj_data.json
      self._expert.observe(state['feedback'])
      self._suggestion = 'look'  # ALFWorld's expert always starts so
    return render(state['feedback'], state['admissible_commands'])

  def step(self, action: str) -> tuple[str, bool, float | None]:
    if self._engine is None or self._done:
      raise RuntimeError('step() before reset() or after the episode ended')
    with LOCK:
      state, _, _ = self._engine.step(action)
    self._turn += 1
    won = bool(state['won'])
    self._label(state, action, won)
    if won:
      self.info['won_at'] = self._turn - 1
    if won or self._turn >= self._max_turns:
      self._done = True
      return state['feedback'], True, 1.0 if won else -1.0
    return render(state['feedback'], state['admissible_commands']), False, None

  @property
  def expert_action(self) -> str | None:
    """The handcoded expert's next action (labels='handcoded'), else None."""
    return self._suggestion

  def _remaining(self, state) -> float:
    plan = state['policy_commands']
    return plan_cost(plan) if plan or state['won'] else float('inf')

  def _label(self, state, action: str, won: bool) -> None:
    if self._labels == 'planner':
      cost = self._remaining(state)
      self.info['step_labels'].append(1 if won or cost < self._cost else -1)
      self._cost = cost
    elif self._labels == 'handcoded':
      self.info['step_labels'].append(1 if action == self._suggestion else -1)
      # The wheel's grammar says 'move X to Y' where its expert's inventory
      # tracking expects ALFWorld's older 'put X in/on Y'.
      said = action
      if action.startswith('move ') and ' to ' in action:
        said = 'put ' + ' in/on '.join(action[5:].split(' to ', 1))
      try:
        with LOCK:
          suggestion = self._expert.act(state, 0, won, said)
      except Exception:  # pylint: disable=broad-except
        # The heuristic expert gives up in states it does not model; as in
        # ALFWorld's wrapper, its plan is then 'look'.
        suggestion = 'look'
      self._suggestion = (suggestion if suggestion in
                          state['admissible_commands'] else 'look')

  def close(self) -> None:
    if self._engine is not None:
      self._engines.release(self._path, self._labels, self._engine)
      self._engine = None


def solve(path: str, engines: Engines = ENGINES) -> tuple[list[str], str]:
  """(the planner's plan, '') if the game loads and the plan wins it.

  Else ([], why): unsolvable (the translator proves the goal unreachable, or
  the planner finds no plan), 'won at the start', the game does not load,
  or the plan replayed through the engine does not win.
  """
  try:
    engine = engines.acquire(path, 'planner')
  except Exception as e:  # pylint: disable=broad-except
    return [], _load_failure(path, e)
  try:
    with LOCK:
      state = engine.reset()
      if state['won']:
        return [], 'won at the start'
      plan = list(state['policy_commands'] or ())
      if not plan:
        return [], 'unsolvable (the planner found no plan)'
      for command in plan:
        state, _, _ = engine.step(command)
    return (plan, '') if state['won'] else ([], 'the plan does not win')
  finally:
    engines.release(path, 'planner', engine)


def _load_failure(path: str, error: Exception) -> str:
  """Why a game does not load.

  fast-downward's translator turns a goal it proves unreachable (no relaxed
  plan, a goal that violates a mutex) into a dummy task over a `dummy(val1)`
  atom, which TextWorld's engine then fails to load.
  """
  import fast_downward  # pylint: disable=g-import-not-at-top
  try:
    with open(path, encoding='utf-8') as f:
      game = json.load(f)
    with LOCK:
      _, sas = fast_downward.pddl2sas(game['pddl_domain'],
                                      game['pddl_problem'])
  except Exception:  # pylint: disable=broad-except
    sas = ''
  if 'dummy(val1)' in sas:
    return 'unsolvable (the translator proves the goal unreachable)'
  return f'does not load ({type(error).__name__}: {error})'
