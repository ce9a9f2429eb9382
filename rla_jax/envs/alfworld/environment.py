"""ALFWorld setting (RLANYTHING.md 3): the paper's text-game benchmark.

Games come from a user's ALFWorld data folder in the official layout
(`env.data_dir`: json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/),
or, offline, are generated from the alfworld package's own scenes
(games.py; ALFWorld-STYLE games, not the benchmark's). valid_seen
is the in-distribution split, valid_unseen the out-of-distribution one
(held-out scenes, optionally held-out object types). Games are played by
TextWorld's PDDL engine with admissible commands (play.py).

Prompts are the authors': the policy sees the history of observations and
actions and the numbered admissible actions and answers an index in
\\boxed{} (3.3); the judge sees the policy's prompt, its response and the
next observation (3.4). A won episode ends at the winning step. Rewrites
(3.7, rewrite.py) swap the goal's two types of the slot's root game;
a candidate becomes pending only if its constraints hold, it loads and the
planner solves it.

Spec: {'id', 'root_id', 'game': {...}} with 'game' either {'trial': path
under json_2.1.1} (a folder game) or the generation parameters {'split',
'task_type', 'scene', 'seed', 'distractors', 'max_receptacles'}; a rewrite
adds 'goal' ({'obj', 'recep'} or {'toggle', 'obj'}) and 'version'. The game
files of generated games and rewrites are rebuilt from the spec when absent.
"""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import numpy as np

from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base
from rla_jax.envs.alfworld import games
from rla_jax.envs.alfworld import play
from rla_jax.envs.alfworld import prompts
from rla_jax.envs.alfworld import rewrite as rewriting

_STAGES = {'pick_and_place_simple': 2, 'look_at_obj_in_light': 3,
           'pick_two_obj_and_place': 4}  # the rest (clean/heat/cool): 4
_GEN_VERSION = 1  # bump when generation changes (cache keys)


def _key(data: dict[str, Any]) -> str:
  return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()


class AlfWorldEnv:
  """The ALFWorld setting (see the module docstring and base.py)."""

  def __init__(self, game_dir: str, *, data_dir: str = '',
               max_turns: int = 40, num_train: int = 16, num_eval: int = 8,
               seed: int = 0, task_types: Sequence[str] = games.TASK_TYPES,
               distractors: tuple[int, int] = (2, 6),
               max_receptacles: int = 0, heldout_objects: Sequence[str] = (),
               step_labels: str = 'planner', on_unparseable: str = 'first',
               max_history: int | None = None, answer_prefix: str = '',
               judge_prefix: str = '', max_critiques: int = 8,
               max_damaged_frac: float = 0.02):
    """Args (config keys of the ALFWorld setting, configs/alfworld.py).

      game_dir: cache of generated games and rewrites (official layout).
      data_dir: an ALFWorld data folder (json_2.1.1/...); '' generates games.
      max_turns: policy turns of a training episode (the paper: 40).
      num_train, num_eval: tasks per split (folder: 0 = all of it).
      seed: base seed of the generated task lists.
      task_types: task types of generated games (round robin).
      distractors: inclusive range of other object types per generated game.
      max_receptacles: receptacles kept per generated game (0 = the scene's).
      heldout_objects: object types only valid_unseen's goals use.
      step_labels: 'planner' | 'handcoded' | 'none' (play.Episode).
      on_unparseable: 'first' (the authors: candidate 0) | 'noop'.
      max_history: earlier turns shown to the policy (None: all, the
        authors).
      answer_prefix, judge_prefix: pre-fill the policy's / RM's answer.
      max_critiques: failure summaries shown in a rewrite prompt.
      max_damaged_frac: a data_dir split with a larger fraction of damaged
        trials (files that do not read) is refused; fewer are reported and
        skipped.
    """
    if on_unparseable not in prompts.ON_UNPARSEABLE:
      raise ValueError(f'on_unparseable={on_unparseable!r}: one of '
                       f'{prompts.ON_UNPARSEABLE}')
    if step_labels not in play.LABELS:
      raise ValueError(f'step_labels={step_labels!r}: one of {play.LABELS}')
    self.game_dir, self.data_dir = game_dir, data_dir
    self.max_turns = max_turns
    self.num_train, self.num_eval, self.seed = num_train, num_eval, seed
    self.task_types = tuple(task_types)
    self.distractors = tuple(distractors)
    self.max_receptacles = max_receptacles
    self.heldout = tuple(heldout_objects)
    self.step_labels, self.on_unparseable = step_labels, on_unparseable
    self.max_history = max_history
    self.answer_prefix, self.judge_prefix = answer_prefix, judge_prefix
    self.max_critiques = max_critiques
    self.max_damaged_frac = max_damaged_frac
    self._trial_lists: dict[str, list[str]] = {}  # data_dir split -> trials
    self._lock = threading.Lock()
    self._games: dict[str, dict[str, Any]] = {}  # built game files
    self._infos: dict[str, dict[str, Any]] = {}  # cheap facts (difficulty)
    self._key_locks: dict[str, threading.Lock] = {}
    self.gen_seconds: list[float] = []  # time to build + verify each game

  # Tasks and games.

  def tasks(self, split: str) -> list[dict[str, Any]]:
    if split not in games.SPLITS:
      raise ValueError(f'unknown split {split!r}; choose from {games.SPLITS}')
    count = self.num_train if split == 'train' else self.num_eval
    if self.data_dir:
      trials = self._trials(split)
      trials = trials[:count] if count else trials
      return [{'id': t, 'root_id': t, 'game': {'trial': t}} for t in trials]
    rng = np.random.default_rng([self.seed, games.SPLITS.index(split)])
    specs = []
    for i in range(count):
      task_type = self.task_types[i % len(self.task_types)]
      params = self._feasible(split, task_type, rng)
      spec_id = f'alfworld-{split}-{i:04d}'
      specs.append({'id': spec_id, 'root_id': spec_id, 'game': params})
    return specs

  def _trials(self, split: str) -> list[str]:
    """The split's readable trials, read once per run; damaged ones are
    reported, and too many refuse the split (base.DataError naming them)."""
    if split not in self._trial_lists:
      self._trial_lists[split] = self._scan(split)
    return self._trial_lists[split]

  def _scan(self, split: str) -> list[str]:
    trials, damaged = games.find_trials(self.data_dir, split)
    if not damaged:
      return trials
    total = len(trials) + len(damaged)
    listed = '; '.join(f'{w} ({why})' for w, why in damaged[:3]) + (
        f'; and {len(damaged) - 3} more' if len(damaged) > 3 else '')
    what = (f'{self.data_dir}: {len(damaged)} of {total} trials of {split} '
            f'are damaged')
    if len(damaged) > self.max_damaged_frac * total:
      raise base.DataError(f'{what}, more than env.max_damaged_frac='
                           f'{self.max_damaged_frac}: {listed}')
    logging.warning('%s and skipped: %s', what, listed)
    return trials

  def _feasible(self, split, task_type, rng) -> dict[str, Any]:
    """Generation parameters of a game the scene can host (cheap to test)."""
    scenes = [s for s in games.scene_numbers(split)
              if games.task_fits_scene(task_type, s)]
    lo, hi = self.distractors
    for _ in range(200):
      params = {'split': split, 'task_type': task_type,
                'scene': int(scenes[int(rng.integers(len(scenes)))]),
                'seed': int(rng.integers(2**31)),
                'distractors': int(rng.integers(lo, hi + 1)),
                'max_receptacles': self.max_receptacles}
      try:
        self._generate(params)
        return params
      except games.GenerationError:
        continue
    raise games.GenerationError(f'no {split} scene hosts {task_type}')

  def _generate(self, params: dict[str, Any]) -> tuple[dict, dict]:
    split = params['split']
    heldout = self.heldout
    return games.generate(
        params['task_type'], params['scene'], params['seed'],
        distractors=params['distractors'],
        max_receptacles=params['max_receptacles'],
        excluded=() if split == 'valid_unseen' else heldout,
        only=heldout if split == 'valid_unseen' else ())

  def json_root(self) -> str:
    """The json_2.1.1 folder of the data directory."""
    nested = os.path.join(self.data_dir, 'json_2.1.1')
    return nested if os.path.isdir(nested) else self.data_dir

  def content(self, spec: dict[str, Any]) -> tuple[dict, dict]:
    """(game.tw-pddl, traj_data) of a spec, in memory (no planner, no files).

    Generated games are regenerated (milliseconds); a rewrite substitutes its
    goal into the base game.
    """
    ref, goal = spec['game'], spec.get('goal')
    if 'trial' in ref:
      game, traj = games.read_trial(os.path.join(self.json_root(),
                                                 ref['trial']))
    else:
      game, traj = self._generate(ref)
    if goal:
      old = dict(zip(self._roles(traj['task_type']),
                     self.goal_tokens(traj['task_type'],
                                       game['pddl_problem'])))
      game, traj = games.substitute_goal(game, traj, old, goal)
    return game, traj

  def info(self, spec: dict[str, Any]) -> dict[str, Any]:
    """Cheap facts of a spec's game: task type, sentence, scene, difficulty."""
    key = _key({'game': spec['game'], 'goal': spec.get('goal')})
    with self._lock:
      if key in self._infos:
        return self._infos[key]
    game, traj = self.content(spec)
    task_type = traj['task_type']
    info = {'task_type': task_type, 'sentence': games.task_sentence(game),
            'scene': traj.get('scene', {}).get('floor_plan', ''),
            'difficulty': self._difficulty(task_type, game['pddl_problem'])}
    with self._lock:
      self._infos[key] = info
    return info

  def game(self, spec: dict[str, Any]) -> dict[str, Any]:
    """{'path', 'task_type'} of a spec's game file, built if needed.

    Generated games and rewrites are written in the official layout under
    game_dir and solved by the planner before first use (then marked
    solvable); thread-safe, one build per game. Raises GenerationError.
    """
    key = _key({'game': spec['game'], 'goal': spec.get('goal')})
    with self._lock:
      if key in self._games:
        return self._games[key]
      key_lock = self._key_locks.setdefault(key, threading.Lock())
    with key_lock:
      with self._lock:
        if key in self._games:
          return self._games[key]
      ref, goal = spec['game'], spec.get('goal')
      if 'trial' in ref and not goal:
        trial = os.path.join(self.json_root(), ref['trial'])
        task_type = games.read_trial(trial)[1]['task_type']
      else:
        game, traj = self.content(spec)
        task_type = traj['task_type']
        kind = 'rewrites' if goal else ref['split']
        build = _key({'game': ref, 'goal': goal, 'version': _GEN_VERSION})
        trial = os.path.join(self.game_dir, 'json_2.1.1', kind,
                             self._task_folder(traj), f'trial_{build[:16]}')
        if not os.path.exists(os.path.join(trial, 'meta.json')):
          self._build(trial, game, traj)
      meta = {'path': os.path.join(trial, games.GAME_FILE), 'trial': trial,
              'task_type': task_type}
      with self._lock:
        self._games[key] = meta
    return meta

  @staticmethod
  def _task_folder(traj) -> str:
    p = traj['pddl_params']
    second = p['parent_target'] or p['toggle_target']
    scene = traj['scene'].get('scene_num', traj['scene'].get('floor_plan'))
    return f'{traj["task_type"]}-{p["object_target"]}-None-{second}-{scene}'

  def _build(self, trial: str, game: dict, traj: dict) -> None:
    """Writes a game, lets the planner solve it, then marks it solvable."""
    start = time.perf_counter()
    games.write_trial(trial, game, traj)
    plan, why = play.solve(os.path.join(trial, games.GAME_FILE))
    if why:  # as the authors delete candidates that fail their check
      shutil.rmtree(trial, ignore_errors=True)
      raise games.GenerationError(f'{trial}: {why}', reason=why)
    game = dict(game, solvable=True, walkthrough=plan)
    # Per process: on a multi-host run every process may build the same
    # game into the shared folder at once.
    tmp = os.path.join(trial, f'.{games.GAME_FILE}.{os.getpid()}.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(game, f)
    os.replace(tmp, os.path.join(trial, games.GAME_FILE))
    seconds = time.perf_counter() - start
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump({'walkthrough': plan, 'build_s': round(seconds, 3)}, f)
    os.replace(tmp, os.path.join(trial, 'meta.json'))  # marks it built
    self.gen_seconds.append(seconds)

  @staticmethod
  def _roles(task_type: str) -> tuple[str, str]:
    """The goal's two slots in answer order."""
    if task_type == 'look_at_obj_in_light':
      return ('toggle', 'obj')
    return ('obj', 'recep')

  @staticmethod
  def goal_tokens(task_type: str, problem: str) -> tuple[str, str]:
    """The goal's two types in answer order (see _roles)."""
    objs, receps = games.goal_types(problem)
    if task_type == 'look_at_obj_in_light':
      return objs[0], objs[1]
    return objs[0], receps[0]

  def make_episode(self, spec: dict[str, Any], seed: int,
                   max_turns: int) -> play.Episode:
    del seed  # the games are deterministic; the policy samples
    meta = self.game(spec)
    return play.Episode(meta['path'], meta['task_type'], max_turns,
                        self.step_labels)

  # Prompts and parsing.

  def policy_messages(self, spec: dict[str, Any],
                      turns: Sequence[tuple[str, str]],
                      observation: str) -> list[dict[str, str]]:
    del spec  # the first observation states the task
    text, commands = play.split(observation)
    shown = list(turns)
    if self.max_history is not None:
      shown = shown[len(shown) - self.max_history:] if self.max_history else []
    history = ''.join(f'observation: {play.split(o)[0]}\n'
                      f'you took action: {a}\n' for o, a in shown)
    # The history may lose its oldest tokens when the prompt is too long.
    trajectory = truncation.cuttable(history) + f'observation: {text}'
    messages = [{'role': 'system', 'content': prompts.SYSTEM},
                {'role': 'user', 'content':
                 f'{prompts.GUIDE}\n\n{trajectory}\n\n'
                 f'{prompts.options(commands)}'}]
    return messages + self._prefilled(self.answer_prefix)

  def turn_messages(self, spec: dict[str, Any], observation: str,
                    first: bool) -> list[dict[str, str]]:
    """What one turn adds to a chat held in a KV session (chat.Turn).

    The first turn carries the authors' guide; every turn the observation
    and the numbered admissible actions; earlier answers stay in the chat
    as assistant turns.
    """
    del spec
    text, commands = play.split(observation)
    body = f'observation: {text}\n\n{prompts.options(commands)}'
    if first:
      messages = [{'role': 'system', 'content': prompts.SYSTEM},
                  {'role': 'user', 'content': f'{prompts.GUIDE}\n\n{body}'}]
    else:
      messages = [{'role': 'user', 'content': body}]
    return messages + self._prefilled(self.answer_prefix)

  @staticmethod
  def _prefilled(prefix: str) -> list[dict[str, str]]:
    return [{'role': 'assistant', 'content': prefix}] if prefix else []

  def _full(self, response: str, prefix: str) -> str:
    return response if response.startswith(prefix) else prefix + response

  def parse_action_checked(self, response: str,
                           observation: str) -> tuple[str, str]:
    """(action, status): status OK, CLAMPED or MISSING (prompts.py)."""
    commands = play.split(observation)[1] or ['look']
    index, status = prompts.parse_index(
        self._full(response, self.answer_prefix), len(commands))
    if status == prompts.MISSING and self.on_unparseable == 'noop':
      return prompts.NOOP, status
    return commands[index], status

  def parse_action(self, response: str, observation: str) -> str:
    return self.parse_action_checked(response, observation)[0]

  def judge_messages(self, spec: dict[str, Any], policy_prompt: str,
                     response: str,
                     next_observation: str) -> list[dict[str, str]]:
    del spec
    agent_prompt, _ = prompts.policy_content(policy_prompt)
    content = (f"{prompts.JUDGE}Agent's prompt:\n{agent_prompt}\n\n"
               f"Agent's response:\n"
               f"{self._full(response, self.answer_prefix)}\n\n"
               f"Next observation after this action:\n"
               f"{play.split(next_observation)[0]}\n")
    return [{'role': 'system', 'content': prompts.SYSTEM},
            {'role': 'user', 'content': content}] + self._prefilled(
                self.judge_prefix)

  # Curator hooks.

  def describe(self, spec: dict[str, Any]) -> str:
    info = self.info(spec)
    return (f'{info["sentence"]} (ALFWorld {info["task_type"]} task in '
            f'{info["scene"] or "a house"})')

  def difficulty(self, spec: dict[str, Any]) -> float:
    return self.info(spec)['difficulty']

  def _difficulty(self, task_type: str, problem: str) -> float:
    """Stages of the task type + receptacles to search per target object.

    Stages: 2 for pick-and-place, 3 for looking in light, 4 for the others;
    search: receptacles whose type can hold the goal's object, divided by
    how many instances of it there are.
    """
    view = rewriting.scene(problem)
    roles = dict(zip(self._roles(task_type),
                     self.goal_tokens(task_type, problem)))
    obj = roles['obj']
    homes = sum(len(ids) for rtype, ids in view.receptacles.items()
                if (rtype, obj) in view.can_contain)
    return _STAGES.get(task_type, 4) + homes / max(
        len(view.objects.get(obj, ())), 1)

  def rewrite(self, request: base.RewriteRequest, generate: base.GenerateFn,
              attempts: int) -> dict[str, Any]:
    """The first of `attempts` proposals that passes every check (3.7).

    Built from the slot's root game, as the authors do. A proposal must
    parse, satisfy rewriting.check, load, and be solved by the planner.
    """
    root, direction = request.root, request.direction
    if direction not in (structs.HARDER, structs.EASIER):
      raise ValueError(f'unknown direction {direction!r}')
    game, traj = self.content({'game': root['game']})
    task_type, problem = traj['task_type'], game['pddl_problem']
    tokens = self.goal_tokens(task_type, problem)
    old = dict(zip(self._roles(task_type), tokens))
    view = rewriting.scene(problem)
    critiques = list(request.critiques)[:self.max_critiques]
    text = rewriting.prompt(problem, task_type, direction, request.acc_old,
                            critiques, tokens)
    completions = generate([f'{text}\n\n(Attempt {i}/{attempts})\n'
                            for i in range(1, attempts + 1)])
    known = sorted(set(games.all_types()) | set(view.objects) |
                   set(view.receptacles))
    reasons, tried = [], []
    for completion in completions:
      proposal = rewriting.parse_tokens(completion, known)
      if proposal is None:
        reasons.append('unparseable')
        continue
      roles = rewriting.assign(task_type, proposal, view)
      reason = rewriting.check(task_type, roles, old, view, self.heldout)
      if reason is None and roles == request.spec.get('goal'):
        reason = 'same goal'  # as the active version's
      if reason is None and roles in tried:
        reason = 'already failed'
      if reason is None:
        tried.append(roles)
        candidate = self._derive(request.spec, root, roles)
        reason = self._smoke_test(candidate)
        if reason is None:
          return candidate
      reasons.append(reason)
    summary = '; '.join(f'{reasons.count(r)}x {r}' for r in dict.fromkeys(
        reasons)) or 'no completions'
    raise base.RewriteRejected(
        f'{direction} rewrite of {root["id"]} ({old}): no valid proposal in '
        f'{len(completions)} completions ({summary})')

  def _derive(self, spec, root, roles) -> dict[str, Any]:
    root_id = spec.get('root_id', spec['id'])
    version = int(spec.get('version', 0)) + 1
    derived = {'root_id': root_id, 'version': version, 'game': root['game'],
               'goal': dict(roles)}
    derived['id'] = f'{root_id}.v{version}-{_key(derived)[:6]}'
    return derived

  def reward_cases(self) -> list[base.RewardCase]:
    """The first training game played by the planner's plan, and one turn
    of 'look' (which wins no task)."""
    spec = self.tasks('train')[0]
    plan, why = play.solve(self.game(spec)['path'])
    if not plan:
      raise games.GenerationError(f'{spec["id"]}: {why}')
    return [base.RewardCase("the planner's plan", spec, tuple(plan), True),
            base.RewardCase("one turn of 'look'", spec, ('look',), False)]

  def _smoke_test(self, spec: dict[str, Any]) -> str | None:
    """None if the candidate loads and the planner solves it."""
    try:
      self.game(spec)
    except games.GenerationError as e:
      return e.reason
    return None

  def metrics(self, trajectories) -> dict[str, float]:
    """Win rate per task type and how the policy's answers parsed."""
    ok = [t for t in trajectories if t.status == structs.OK]
    out = {}
    for task_type in games.TASK_TYPES:
      mine = [t.outcome > 0 for t in ok
              if t.info.get('task_type') == task_type]
      if mine:
        out[f'success_{task_type}'] = float(np.mean(mine))
    statuses = []
    for t in ok:
      for step in t.steps:
        _, commands = prompts.policy_content(step.prompt)
        statuses.append(prompts.parse_index(
            self._full(step.response, self.answer_prefix),
            max(len(commands), 1))[1])
    if statuses:
      for status in (prompts.MISSING, prompts.CLAMPED):
        out[f'action_{status}_frac'] = statuses.count(status) / len(statuses)
    return out


def from_config(env_config, workdir: str) -> AlfWorldEnv:
  """The setting of `config.env` (name 'alfworld').

  `env_config.game_dir` may name a cache shared between runs; '' keeps the
  games in '<workdir>/alfworld_games'.
  """
  return AlfWorldEnv(
      env_config.game_dir or os.path.join(workdir, 'alfworld_games'),
      data_dir=env_config.data_dir, max_turns=env_config.max_turns,
      num_train=env_config.num_train, num_eval=env_config.num_eval,
      seed=env_config.seed, task_types=tuple(env_config.task_types),
      distractors=tuple(env_config.distractors),
      max_receptacles=env_config.max_receptacles,
      heldout_objects=tuple(env_config.heldout_objects),
      step_labels=env_config.step_labels,
      on_unparseable=env_config.on_unparseable,
      max_history=env_config.max_history,
      answer_prefix=env_config.answer_prefix,
      judge_prefix=env_config.judge_prefix,
      max_critiques=env_config.max_critiques,
      max_damaged_frac=env_config.max_damaged_frac)


make_tokenizer = prompts.make_tokenizer  # random models (the loop)
