"""TextWorld setting: generated text games whose size the curator rewrites.

A task spec is a JSON-able dict of generation knobs (seed, nb_rooms,
nb_objects, quest_length). Its game is generated in-process, compiled once and
cached on disk, so rollouts of one task and resumed runs reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any
import warnings

import numpy as np

from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base
from rla_jax.envs.textworld import text as twtext

KNOBS = ('nb_rooms', 'nb_objects', 'quest_length')
# Bump when generation changes, so cached games of the old scheme are not used.
_GEN_VERSION = 1
# TextWorld parses its logic and grammar files with a tatsu parser that is
# not thread-safe (concurrent textworld.start raised IndexError/FailedToken
# in tatsu), so generation, compilation and loading take this lock; stepping
# a loaded game does not.
_TEXTWORLD_LOCK = threading.RLock()
_INSTRUCTIONS = {
    'index': 'give the number of the chosen action in \\boxed{}.',
    'text': 'write the chosen action inside \\boxed{}, exactly as listed.',
}
HISTORIES = ('observations', 'actions')
_POLICY_SYSTEM = ('You are playing a text adventure game. Complete the task in '
                  'as few actions as possible.')
_JUDGE_SYSTEM = ('You judge one step of an AI agent playing a text adventure '
                 'game.')
# Markers of the policy prompt, which judge_messages reads back.
_ACTIONS_SO_FAR = 'Your actions so far: '
_CURRENT = 'Current observation:\n'
_ASK = 'Choose the action that brings you closest to the task and '
_JUDGE_ANSWER_CHARS = 600  # an agent's reasoning shown to the RM


def _clip(text: str, max_chars: int) -> str:
  """At most max_chars characters, the middle replaced by ' ... '."""
  if len(text) <= max_chars:
    return text
  half = (max_chars - 5) // 2
  return f'{text[:half]} ... {text[len(text) - half:]}'


class GenerationError(RuntimeError):
  """TextWorld could not make a game from a spec."""


def _textworld():
  try:
    import textworld.generator  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('The TextWorld setting needs `pip install textworld` '
                      '(or the `textworld` extra of rla_jax).') from e
  return textworld


def knobs(spec: dict[str, Any]) -> tuple[int, int, int]:
  """(nb_rooms, nb_objects, quest_length) of a spec."""
  return tuple(int(spec[k]) for k in KNOBS)


def game_key(spec: dict[str, Any]) -> str:
  """Cache key: a hash of what determines the game (not the id)."""
  data = dict(zip(KNOBS, knobs(spec)), seed=int(spec['seed']),
              version=_GEN_VERSION)
  return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()


class TextWorldEpisode:
  """One play-through of a compiled game; owns its own TextWorld env.

  `info['step_labels']`: +1 for a step that wins or shortens TextWorld's
  winning plan from the state it was taken in (the game's own planner,
  `policy_commands`), else -1; the RM's process accuracy is measured on them.
  """

  def __init__(self, path: str, max_turns: int):
    self._path = path
    self._max_turns = max_turns
    self._env = None
    self._turn = 0
    self._done = False
    self._plan_len = 0
    self.info = {'step_labels': []}

  def reset(self) -> str:
    textworld = _textworld()
    infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True,
                               objective=True, description=True,
                               feedback=True, policy_commands=True)
    self.close()
    with _TEXTWORLD_LOCK:
      self._env = textworld.start(self._path, request_infos=infos)
      state = self._env.reset()
    self._turn, self._done = 0, False
    self._plan_len = len(state.policy_commands or ())
    self.info = {'step_labels': []}
    return twtext.render_observation(twtext.clean_text(state.description),
                              state.admissible_commands)

  def step(self, action: str) -> tuple[str, bool, float | None]:
    if self._env is None or self._done:
      raise RuntimeError('step() before reset() or after the episode ended')
    state, _, _ = self._env.step(action)
    self._turn += 1
    plan_len = len(state.policy_commands or ())
    progressed = state.won or plan_len < self._plan_len
    self.info['step_labels'].append(1 if progressed else -1)
    self._plan_len = plan_len
    text = twtext.clean_text(state.feedback)
    if state.won or state.lost or self._turn >= self._max_turns:
      self._done = True
      return text, True, 1.0 if state.won else -1.0
    observation = twtext.render_observation(text, state.admissible_commands)
    return observation, False, None

  def close(self) -> None:
    if self._env is not None:
      self._env.close()
      self._env = None


class TextWorldEnv:
  """Generated TextWorld games (see the module docstring and base.py).

  Specs: {'id', 'root_id', 'seed', 'nb_rooms', 'nb_objects', 'quest_length'},
  optionally 'version' (rewrite depth). Rewrites compound from the active
  version (its knobs are the starting point); the prompt shows the measured
  win rate.
  """

  def __init__(self, game_dir: str, *, max_turns: int = 8,
               num_train: int = 16, num_eval: int = 8, seed: int = 0,
               nb_rooms: tuple[int, int] = (1, 3),
               nb_objects: tuple[int, int] = (2, 6),
               quest_length: tuple[int, int] = (1, 3),
               max_knobs: tuple[int, int, int] = (6, 12, 6),
               max_history: int | None = 4, history: str = 'observations',
               answer_format: str = 'text',
               answer_prefix: str = 'The best action is \\boxed{',
               judge_prefix: str = 'Score: \\boxed{',
               rewrite_prefix: str = '',
               max_critiques: int = 8, gen_tries: int = 4):
    """Args (config keys of the TextWorld setting).

      game_dir: cache of compiled games, e.g. '<workdir>/games'.
      max_turns: policy turns per episode; out of turns counts as a loss.
      num_train, num_eval: number of tasks per split.
      seed: base seed of the task lists (game seeds derive from it).
      nb_rooms, nb_objects, quest_length: inclusive ranges of the tasks()
        knobs; quest lengths are spread evenly to mix difficulties.
      max_knobs: upper bounds (rooms, objects, quest_length) for rewrites; the
        lower bound is 1. Keep quests <= 15 and rooms <= 20 on 2 cores.
      max_history: earlier turns shown to the policy (None: all).
      history: how they are shown: 'observations' (each earlier observation's
        text and the action taken) or 'actions' (only the actions, one line;
        a fraction of the tokens).
      answer_format: 'index' (the authors': the action's number in \\boxed{})
        or 'text' (the action's text in \\boxed{}; SmolLM2-135M ranks the
        right action higher this way). The parser accepts both.
      answer_prefix, judge_prefix: the assistant turn is pre-filled with these
        ('' for none); small models need them to answer in format.
      rewrite_prefix: appended to rewrite prompts, completions continue it.
      max_critiques: failure summaries shown in a rewrite prompt.
      gen_tries: seeds tried per spec until the walkthrough length equals
        quest_length (else the closest one is kept).
    """
    self.game_dir = game_dir
    self.max_turns = max_turns
    self.num_train, self.num_eval, self.seed = num_train, num_eval, seed
    self.ranges = (tuple(nb_rooms), tuple(nb_objects), tuple(quest_length))
    self.max_knobs = tuple(max_knobs)
    self.max_history = max_history
    if history not in HISTORIES:
      raise ValueError(f'history={history!r}: one of {HISTORIES}')
    self.history = history
    if answer_format not in _INSTRUCTIONS:
      raise ValueError(f'answer_format must be one of {list(_INSTRUCTIONS)}')
    self.answer_format = answer_format
    self.answer_prefix = answer_prefix
    self.judge_prefix = judge_prefix
    self.rewrite_prefix = rewrite_prefix
    self.max_critiques = max_critiques
    self.gen_tries = gen_tries
    # jericho warns once per game file that TextWorld games lack its
    # score/move tables; we read won/lost from TextWorld instead.
    warnings.filterwarnings('ignore', message=r'Game .* is not fully supported',
                            module='jericho')
    self._lock = threading.Lock()  # guards the two dicts below
    self._games: dict[str, dict[str, Any]] = {}
    self._key_locks: dict[str, threading.Lock] = {}

  # Tasks and games.

  def tasks(self, split: str) -> list[dict[str, Any]]:
    if split not in ('train', 'eval'):
      raise ValueError(f'unknown split {split!r}')
    count = self.num_train if split == 'train' else self.num_eval
    rng = np.random.default_rng([self.seed, int(split == 'eval')])
    (r0, r1), (o0, o1), (q0, q1) = self.ranges
    specs = []
    for i in range(count):
      spec_id = f'tw-{split}-{i:03d}'
      quest = q0 + (i * (q1 - q0 + 1)) // max(count, 1)
      specs.append({
          'id': spec_id, 'root_id': spec_id,
          'seed': int(rng.integers(2**31)),
          'nb_rooms': int(rng.integers(r0, r1 + 1)),
          'nb_objects': int(rng.integers(o0, o1 + 1)),
          'quest_length': quest,
      })
    return specs

  def game(self, spec: dict[str, Any]) -> dict[str, Any]:
    """Metadata of the spec's compiled game (path, objective, walkthrough).

    Generates and compiles it on first use; thread-safe (one generation per
    game; compilation of different games overlaps); raises GenerationError.
    """
    key = game_key(spec)
    with self._lock:
      if key in self._games:
        return self._games[key]
      key_lock = self._key_locks.setdefault(key, threading.Lock())
    with key_lock:
      with self._lock:
        if key in self._games:
          return self._games[key]
      meta_file = os.path.join(self.game_dir, key + '.meta.json')
      if not os.path.exists(meta_file):
        self._generate(spec, key)
      with open(meta_file, encoding='utf-8') as f:
        meta = json.load(f)
      meta['path'] = os.path.join(self.game_dir, key + '.z8')
      with self._lock:
        self._games[key] = meta
    return meta

  def _generate(self, spec: dict[str, Any], key: str) -> None:
    """Makes and compiles the game of `spec` into the cache (atomically)."""
    textworld = _textworld()
    rooms, objects, quest = knobs(spec)
    start = time.perf_counter()
    best, errors = None, []
    for attempt in range(self.gen_tries):
      options = textworld.GameOptions()
      options.nb_rooms, options.nb_objects = rooms, objects
      options.quest_length = quest
      options.seeds = (int(spec['seed']) + 1_000_003 * attempt) % 2**32
      try:
        with _TEXTWORLD_LOCK:
          game = textworld.generator.make_game(options)
          walkthrough = game.walkthrough or []
      except Exception as e:  # pylint: disable=broad-except
        errors.append(f'{type(e).__name__}: {e}')
        continue
      if walkthrough and (best is None or abs(len(walkthrough) - quest) <
                          abs(len(best[2]) - quest)):
        best = (attempt, game, walkthrough, options)
      if len(walkthrough) == quest:
        break
    if best is None:
      raise GenerationError(f'no game with a walkthrough for knobs '
                            f'{(rooms, objects, quest)}: {errors[:2]}')
    attempt, game, walkthrough, options = best
    os.makedirs(self.game_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{key[:8]}-', dir=self.game_dir)
    try:
      options.path = os.path.join(tmp, 'game.z8')
      try:
        with _TEXTWORLD_LOCK:
          textworld.generator.compile_game(game, options)
      except Exception as e:  # pylint: disable=broad-except
        raise GenerationError(f'compile failed: {e}') from e
      for ext in ('.z8', '.json'):
        os.replace(os.path.join(tmp, 'game' + ext),
                   os.path.join(self.game_dir, key + ext))
      meta = dict(zip(KNOBS, (rooms, objects, quest)), seed=spec['seed'],
                  attempt=attempt, objective=game.objective,
                  walkthrough=list(walkthrough),
                  gen_s=round(time.perf_counter() - start, 3),
                  textworld=textworld.__version__)
      with open(os.path.join(tmp, 'meta.json'), 'w', encoding='utf-8') as f:
        json.dump(meta, f)
      os.replace(os.path.join(tmp, 'meta.json'),
                 os.path.join(self.game_dir, key + '.meta.json'))
    finally:
      shutil.rmtree(tmp, ignore_errors=True)

  def make_episode(self, spec: dict[str, Any], seed: int,
                   max_turns: int) -> TextWorldEpisode:
    del seed  # TextWorld games are deterministic; the policy samples.
    return TextWorldEpisode(self.game(spec)['path'], max_turns)

  # Prompts and parsing.

  def policy_messages(self, spec: dict[str, Any],
                      turns: Sequence[tuple[str, str]],
                      observation: str) -> list[dict[str, str]]:
    lines = [f'Task: {twtext.clean_text(self.game(spec)["objective"])}', '']
    shown = list(turns)
    if self.max_history is not None:
      shown = shown[len(shown) - self.max_history:] if self.max_history else []
    if shown and self.history == 'actions':
      lines += [truncation.cuttable(_ACTIONS_SO_FAR + '; '.join(
          action for _, action in shown)), '']
    elif shown:
      lines.append('Previous steps:')
      if len(shown) < len(turns):
        lines.append(f'({len(turns) - len(shown)} earlier steps omitted)')
      # The history may lose its oldest tokens when the prompt is too long.
      lines.append(truncation.cuttable('\n'.join(
          f'Observation: {twtext.split_observation(old_observation)[0]}\n'
          f'Action: {action}' for old_observation, action in shown)))
      lines.append('')
    lines.append(f'{_CURRENT}{observation}')
    lines.append('')
    # No example answer: SmolLM2-135M copies an example's number.
    lines.append(f'{_ASK}{_INSTRUCTIONS[self.answer_format]}')
    messages = [{'role': 'system', 'content': _POLICY_SYSTEM},
                {'role': 'user', 'content': '\n'.join(lines)}]
    if self.answer_prefix:
      messages.append({'role': 'assistant', 'content': self.answer_prefix})
    return messages

  def _with_prefix(self, response: str, prefix: str) -> str:
    return response if response.startswith(prefix) else prefix + response

  def parse_action_checked(self, response: str,
                           observation: str) -> tuple[str, bool]:
    """(action, ok): ok is False when the first action was used as fallback.

    `response` may be the continuation of the answer prefix or include it.
    """
    text = self._with_prefix(response, self.answer_prefix)
    return twtext.choose(text, twtext.split_observation(observation)[1])

  def parse_action(self, response: str, observation: str) -> str:
    return self.parse_action_checked(response, observation)[0]

  def judge_messages(self, spec: dict[str, Any], policy_prompt: str,
                     response: str,
                     next_observation: str) -> list[dict[str, str]]:
    """The step as the RM sees it: task, actions so far, the observation
    (without its action list), the executed action and what followed.

    The agent's answer is shown only when it says more than the action
    (reasoning to judge); the executed action notes a fallback.
    """
    prompt = truncation.plain(twtext.strip_chat_markup(policy_prompt))
    current = prompt.rpartition(_CURRENT)[2].rpartition(_ASK)[0]
    text, commands = twtext.split_observation(current.strip())
    full = self._with_prefix(response, self.answer_prefix).strip()
    action, ok = twtext.choose(full, commands)
    executed = action if ok else (f'{action} (the answer named no listed '
                                  'action, so the first one was executed)')
    lines = [f'Task: {twtext.clean_text(self.game(spec)["objective"])}', '']
    so_far = prompt.rpartition(_ACTIONS_SO_FAR)
    if so_far[1]:
      lines += [_ACTIONS_SO_FAR + so_far[2].partition('\n')[0], '']
    lines += ['Observation:', text.strip(), '']
    reasoning = full[:full.rfind('\\boxed{')].strip() if (
        '\\boxed{' in full) else full
    prefix_head = self.answer_prefix.partition('\\boxed{')[0].strip()
    if reasoning and reasoning != prefix_head:
      lines += [f"Agent's answer: {_clip(full, _JUDGE_ANSWER_CHARS)}", '']
    lines += [f'Executed action: {executed}', '',
              'Next observation:',
              twtext.split_observation(next_observation)[0].strip(), '',
              'Score +1 if the action completes the task, makes progress '
              'towards it or explores usefully; score -1 if it is useless, '
              'repeats itself or does not follow from the observation. Give '
              'the score in \\boxed{}: \\boxed{1} or \\boxed{-1}.']
    messages = [{'role': 'system', 'content': _JUDGE_SYSTEM},
                {'role': 'user', 'content': '\n'.join(lines)}]
    if self.judge_prefix:
      messages.append({'role': 'assistant', 'content': self.judge_prefix})
    return messages

  # Curator hooks.

  def describe(self, spec: dict[str, Any]) -> str:
    rooms, objects, quest = knobs(spec)
    objective = twtext.clean_text(self.game(spec)['objective'])
    return (f'A TextWorld game with {rooms} rooms, {objects} objects and a '
            f'{quest}-step quest. Objective: {objective}')

  def difficulty(self, spec: dict[str, Any]) -> float:
    """Mostly quest_length (actions to win), plus room and object counts.

    quest_length + 0.2 per extra room (navigation) + 0.05 per object
    (distractor commands), so the quest dominates and ties are broken by size.
    """
    rooms, objects, quest = knobs(spec)
    return quest + 0.2 * (rooms - 1) + 0.05 * objects

  def rewrite_prompt(self, spec: dict[str, Any], direction: str,
                     critiques: Sequence[str], acc: float) -> str:
    """The environment LLM's prompt, without the attempt suffix."""
    rooms, objects, quest = knobs(spec)
    max_rooms, max_objects, max_quest = self.max_knobs
    lines = [
        'You design text adventure games that train an AI agent. A game is '
        'set by three numbers: rooms (1 to {}), objects (1 to {}) and '
        'quest_length (1 to {}, the number of actions needed to win).'.format(
            max_rooms, max_objects, max_quest), '',
        f'Current game: {rooms} rooms, {objects} objects, quest_length '
        f'{quest}, written as \\boxed{{{rooms}, {objects}, {quest}}}.',
        f'Its objective: {twtext.clean_text(self.game(spec)["objective"])}',
    ]
    lines.append(f'The agent won {acc:.0%} of its attempts.')
    lines += ['', 'Why the agent failed (critic summaries):']
    shown = [c.strip() for c in critiques if c and c.strip()]
    shown = shown[:self.max_critiques]
    lines += [truncation.cuttable('\n'.join(
        f'{i}. {c}' for i, c in enumerate(shown, 1)))] if shown else ['(none)']
    if direction == structs.HARDER:
      goal = ('HARDER: no number may go down and at least one must go up (a '
              'longer quest, more rooms to explore, more distracting objects).')
    else:
      goal = ('EASIER: no number may go up and at least one must go down (a '
              'shorter quest, fewer rooms, fewer objects).')
    lines += ['', f'Make the game {goal} Prefer small changes; quest_length '
              'matters most. Use the critic summaries to choose what to '
              'change.', '',
              'Answer with the new numbers as \\boxed{rooms, objects, '
              'quest_length}.']
    return '\n'.join(lines)

  def check_knobs(self, old: tuple[int, int, int], new: tuple[int, int, int],
                  direction: str) -> str | None:
    """Why `new` is not a valid rewrite of `old` (None if it is)."""
    if any(not 1 <= n <= hi for n, hi in zip(new, self.max_knobs)):
      return 'out of bounds'
    if direction == structs.HARDER:
      moved = all(n >= o for n, o in zip(new, old)) and new != old
    else:
      moved = all(n <= o for n, o in zip(new, old)) and new != old
    return None if moved else 'wrong direction'

  def rewrite(self, request: base.RewriteRequest, generate: base.GenerateFn,
              attempts: int) -> dict[str, Any]:
    """First proposal that moves the knobs the right way and plays to a win.

    Starts from the active version (rewrites compound), as the authors'
    coding setting does; the root is the lineage's `root_id`.
    """
    spec, direction = request.spec, request.direction
    if direction not in (structs.HARDER, structs.EASIER):
      raise ValueError(f'unknown direction {direction!r}')
    prompt = self.rewrite_prompt(spec, direction, request.critiques,
                                 request.acc_old)
    prompts = [f'{prompt}\n(Attempt {i}/{attempts})\n{self.rewrite_prefix}'
               for i in range(1, attempts + 1)]
    completions = generate(prompts)
    old = knobs(spec)
    reasons, tried = [], set()
    for completion in completions:
      text = completion
      if twtext.last_boxed(text) is None:
        text = self.rewrite_prefix + completion
      new = twtext.parse_knobs(text)
      reason = 'unparseable' if new is None else self.check_knobs(
          old, new, direction)
      if reason is None and new in tried:
        reason = 'already failed'
      if reason is None:
        tried.add(new)
        candidate = self._derive(spec, new)
        reason = self._smoke_test(candidate)
        if reason is None:
          return candidate
      reasons.append(reason)
    summary = ', '.join(f'{reasons.count(r)} {r}' for r in dict.fromkeys(
        reasons)) or 'no completions'
    raise base.RewriteRejected(
        f'{direction} rewrite of {spec["id"]} {old}: no valid proposal in '
        f'{len(completions)} completions ({summary})')

  def _derive(self, spec: dict[str, Any],
              new: tuple[int, int, int]) -> dict[str, Any]:
    root_id = spec.get('root_id', spec['id'])
    version = int(spec.get('version', 0)) + 1
    derived = dict(zip(KNOBS, new), seed=spec['seed'], root_id=root_id,
                   version=version)
    derived['id'] = f'{root_id}.v{version}-{game_key(derived)[:6]}'
    return derived

  def reward_cases(self) -> list[base.RewardCase]:
    """The first training game played by its walkthrough, and one turn of
    'look' (which wins no quest)."""
    spec = self.tasks('train')[0]
    walkthrough = tuple(self.game(spec)['walkthrough'])
    return [base.RewardCase('the walkthrough', spec, walkthrough, True),
            base.RewardCase("one turn of 'look'", spec, ('look',), False)]

  def _smoke_test(self, spec: dict[str, Any]) -> str | None:
    """None if the game generates, loads and its walkthrough wins."""
    try:
      walkthrough = self.game(spec)['walkthrough']
      episode = TextWorldEpisode(self.game(spec)['path'], len(walkthrough) + 1)
      try:
        episode.reset()
        outcome = None
        for command in walkthrough:
          _, done, outcome = episode.step(command)
          if done:
            break
      finally:
        episode.close()
    except Exception as e:  # pylint: disable=broad-except
      return f'generation failed ({type(e).__name__})'
    return None if outcome == 1.0 else 'walkthrough does not win'


def from_config(env_config, workdir: str) -> TextWorldEnv:
  """The setting of `config.env` (name 'textworld').

  `env_config.game_dir` may name a cache shared between runs; '' keeps the
  games in '<workdir>/games'.
  """
  return TextWorldEnv(
      env_config.game_dir or os.path.join(workdir, 'games'),
      max_turns=env_config.max_turns, num_train=env_config.num_train,
      num_eval=env_config.num_eval, seed=env_config.seed,
      nb_rooms=tuple(env_config.nb_rooms),
      nb_objects=tuple(env_config.nb_objects),
      quest_length=tuple(env_config.quest_length),
      max_knobs=tuple(env_config.max_knobs),
      max_history=env_config.max_history, history=env_config.history,
      answer_format=env_config.answer_format,
      answer_prefix=env_config.answer_prefix,
      judge_prefix=env_config.judge_prefix,
      rewrite_prefix=env_config.rewrite_prefix,
      max_critiques=env_config.max_critiques, gen_tries=env_config.gen_tries)
