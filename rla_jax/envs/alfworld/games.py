"""ALFWorld games: the official folder layout, offline synthesis, goal edits.

ALFWorld's own games (`json_2.1.1/<split>/<task>/<trial>/` holding
`game.tw-pddl` and `traj_data.json`) come from a download that does not work
offline. The `alfworld` wheel ships what they are made of: the PDDL domain and
the text grammar, the AI2-THOR scene layouts (receptacles with their poses,
object types per scene), the canContain table, the object capabilities and
the goal library of the six task types. `generate` builds games from those
the way ALFWorld's `augment_pddl_states.py` writes a problem: a scene's
receptacles at their locations, objects placed only where canContain allows,
capabilities per object type, and the task's goal from the goal library.

These are ALFWorld-STYLE games, not the benchmark's 3,553 train / 134 eval
games: same engine, domain, grammar, scenes and task types, but our own
object placements, so numbers on them are not comparable with the paper's.
No alfworld import at module level: the folder reader and the PDDL text
helpers work without it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
import functools
import json
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

TASK_TYPES = ('pick_and_place_simple', 'look_at_obj_in_light',
              'pick_clean_then_place_in_recep',
              'pick_heat_then_place_in_recep',
              'pick_cool_then_place_in_recep', 'pick_two_obj_and_place')
# The official splits: valid_seen shares train's scenes (in-distribution),
# valid_unseen holds scenes never trained on (out-of-distribution).
SPLITS = ('train', 'valid_seen', 'valid_unseen')
# The appliance a task type needs, and the capability its object needs.
APPLIANCE = {'pick_clean_then_place_in_recep': 'SinkBasin',
             'pick_heat_then_place_in_recep': 'Microwave',
             'pick_cool_then_place_in_recep': 'Fridge'}
CAPABILITY = {'pick_clean_then_place_in_recep': 'cleanable',
              'pick_heat_then_place_in_recep': 'heatable',
              'pick_cool_then_place_in_recep': 'coolable'}
LAMPS = ('DeskLamp', 'FloorLamp')
# Receptacles an agent can carry: objects of the game, not places.
MOVABLE = frozenset({'Bowl', 'Box', 'Cup', 'Mug', 'Plate', 'Pan', 'Pot'})
# Receptacles a lamp stands in or next to (ToggleObject needs inReceptacle).
_LAMP_HOSTS = ('Desk', 'SideTable', 'Dresser', 'Shelf', 'CoffeeTable',
               'DiningTable', 'TVStand', 'Sofa', 'ArmChair', 'Bed')
_MANGLE = (('-', '_minus_'), ('|', '_bar_'), ('+', '_plus_'), ('.', '_dot_'),
           (',', '_comma_'))
_TASK_RULE = re.compile(r'("rhs": "Your task is to: )([^"]*?)(\.")')
_FACT = re.compile(r'\(\s*([^\s()]+)([^()]*)\)')
GAME_FILE, TRAJ_FILE = 'game.tw-pddl', 'traj_data.json'


class GenerationError(RuntimeError):
  """A game cannot be made: the scene cannot host the task, or the game
  does not load or has no solution (`reason` says which, without paths)."""

  def __init__(self, message: str, reason: str = ''):
    super().__init__(message)
    self.reason = reason or message


def alfworld_modules():
  """(constants, goal_library) of the alfworld package."""
  try:
    from alfworld.gen import constants  # pylint: disable=g-import-not-at-top
    from alfworld.gen import goal_library  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('The ALFWorld setting needs `pip install alfworld` (or '
                      'the `alfworld` extra of rla_jax).') from e
  return constants, goal_library


def package_file(*parts: str) -> str:
  """A file shipped in the alfworld wheel (domain, grammar, layouts)."""
  import alfworld  # pylint: disable=g-import-not-at-top
  return os.path.join(os.path.dirname(alfworld.__file__), *parts)


def mangle(name: str) -> str:
  """ALFWorld's PDDL-safe spelling of an AI2-THOR id."""
  for old, new in _MANGLE:
    name = name.replace(old, new)
  return name


# Tables derived from the package (canContain, capabilities, scenes).


@functools.lru_cache(maxsize=None)
def can_contain() -> dict[str, frozenset[str]]:
  """Receptacle type -> object types it can hold (canContain)."""
  constants, _ = alfworld_modules()
  return {r: frozenset(o for o in objs if not o.endswith('Sliced'))
          for r, objs in constants.VAL_RECEPTACLE_OBJECTS.items()}


@functools.lru_cache(maxsize=None)
def capabilities() -> dict[str, frozenset[str]]:
  """Capability ('cleanable', ...) -> object types that have it."""
  constants, _ = alfworld_modules()
  return {name.lower(): frozenset(objs)
          for name, objs in constants.VAL_ACTION_OBJECTS.items()}


@functools.lru_cache(maxsize=None)
def pickupable() -> frozenset[str]:
  """Object types that go into receptacles (so an agent can carry them)."""
  return frozenset().union(*can_contain().values())


@functools.lru_cache(maxsize=None)
def all_types() -> tuple[str, ...]:
  """Every ALFWorld object and receptacle type name."""
  constants, _ = alfworld_modules()
  return tuple(sorted(set(constants.OBJECTS) | set(can_contain()) |
                      set(LAMPS)))


def scene_numbers(split: str) -> list[int]:
  """AI2-THOR floor plans of a split (ALFRED's train / held-out scenes)."""
  constants, _ = alfworld_modules()
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; choose from {SPLITS}')
  if split == 'valid_unseen':
    return list(constants.TEST_SCENE_NUMBERS)
  return list(constants.TRAIN_SCENE_NUMBERS)


def scene_kind(scene: int) -> str:
  constants, _ = alfworld_modules()
  for kind, numbers in constants.SCENE_TYPE.items():
    if scene in numbers:
      return kind
  raise ValueError(f'no scene type for FloorPlan{scene}')


def task_fits_scene(task_type: str, scene: int) -> bool:
  """Whether ALFRED poses this task type in this kind of room."""
  constants, _ = alfworld_modules()
  return scene_kind(scene) in constants.GOALS_VALID[task_type]


@functools.lru_cache(maxsize=256)
def load_scene(scene: int) -> tuple[list[tuple[str, str, str]], list[str]]:
  """([(receptacle id, type, location)], object types) of a floor plan.

  Receptacles and poses come from `FloorPlan<n>-openable.json` (a pose is the
  agent's grid position, rotation and horizon in front of it); static
  receptacle types listed in `-objects.json` without a pose get one instance
  at a location of their own, so bathrooms keep their toilet.
  """
  layouts = package_file('gen', 'layouts')
  with open(os.path.join(layouts, f'FloorPlan{scene}-openable.json')) as f:
    poses = json.load(f)
  with open(os.path.join(layouts, f'FloorPlan{scene}-objects.json')) as f:
    object_types = sorted(set(json.load(f)))
  receptacles = []
  for rid in sorted(poses):
    rtype = rid.split('|')[0]
    if rid.endswith('Basin'):
      rtype = rid.split('|')[-1]
    if rtype not in can_contain() or rtype in MOVABLE:
      continue
    x, z, rotation, horizon = poses[rid]
    location = (f'loc|{round(x / 0.25)}|{round(z / 0.25)}|'
                f'{round(rotation) // 90}|{round(horizon)}')
    receptacles.append((rid, rtype, location))
  have = {r[1] for r in receptacles}
  for k, rtype in enumerate(t for t in object_types if t in can_contain()
                            and t not in have and t not in MOVABLE):
    receptacles.append((f'{rtype}|+0{k % 10}.50|+00.00|-0{k // 10}.50',
                        rtype, f'loc|{40 + k}|{40 + k}|0|30'))
  return receptacles, object_types


# Goals and task text.


def goal_pddl(task_type: str, obj: str, recep: str = '',
              toggle: str = '') -> str:
  """The (:goal ...) block of a task from ALFWorld's goal library."""
  _, goal_library = alfworld_modules()
  template = goal_library.gdict[task_type]['pddl']
  text = template.format(obj=obj, recep=recep, toggle=toggle)
  return block(text.replace(' # ', ' - ').replace('#', '-'), 'goal')


def task_text(task_type: str, obj: str, recep: str = '', toggle: str = '',
              choice: int = 0) -> str:
  """The task sentence ("put a egg in microwave"), ALFWorld's templates."""
  _, goal_library = alfworld_modules()
  templates = goal_library.gdict[task_type]['templates']
  return templates[choice % len(templates)].format(
      obj=obj.lower(), recep=recep.lower(), toggle=toggle.lower())


def task_sentence(game: dict[str, Any]) -> str:
  """The task sentence a game's grammar tells the agent ('' if none)."""
  match = _TASK_RULE.search(game['grammar'])
  return match.group(2) if match else ''


def block(text: str, head: str) -> str:
  """The balanced `(:head ...)` block of a PDDL text ('' if absent)."""
  start = text.find(f'(:{head}')
  if start < 0:
    return ''
  depth = 0
  for i in range(start, len(text)):
    depth += {'(': 1, ')': -1}.get(text[i], 0)
    if depth == 0:
      return text[start:i + 1]
  return ''


def facts(problem: str) -> list[tuple[str, list[str]]]:
  """(predicate, args) of every fact in a problem's :init."""
  init = block(problem, 'init')
  return [(m.group(1), m.group(2).split()) for m in _FACT.finditer(init)
          if m.group(1) != ':init']


def goal_types(problem: str) -> tuple[list[str], list[str]]:
  """(object types, receptacle types) named by the goal, in order, no 'Type'.

  look_at_obj_in_light names (lamp, held object); the others (object,).
  """
  goal = block(problem, 'goal')
  objs = re.findall(r'\(\s*objectType\s+\S+\s+(\w+?)Type\s*\)', goal)
  receps = re.findall(r'\(\s*receptacleType\s+\S+\s+(\w+?)Type\s*\)', goal)
  unique = lambda xs: list(dict.fromkeys(xs))
  return unique(objs), unique(receps)


def substitute_goal(game: dict[str, Any], traj: dict[str, Any],
                    old: dict[str, str], new: dict[str, str]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
  """The game with the goal's type tokens `old` replaced by `new`.

  `old`/`new` map roles ('obj', 'recep', 'toggle') to types. The goal block
  is edited in place; the grammar's task sentence and traj_data's
  pddl_params follow, so the agent is told the new task and ALFWorld's
  handcoded expert pursues it (the authors' rewrite kept the old sentence).
  """
  problem = game['pddl_problem']
  goal = block(problem, 'goal')
  edited = goal
  for role, old_type in old.items():
    pattern = r'\b%sType\b' % re.escape(old_type)
    edited = re.sub(pattern, f'\x00{role}\x00', edited)
  for role, new_type in new.items():
    edited = edited.replace(f'\x00{role}\x00', f'{new_type}Type')
  task_type = traj['task_type']
  params = dict(traj['pddl_params'])
  params.update({'object_target': new.get('obj', params['object_target']),
                 'parent_target': new.get('recep', params['parent_target']),
                 'toggle_target': new.get('toggle', params['toggle_target'])})
  sentence = task_text(task_type, params['object_target'],
                       params['parent_target'], params['toggle_target'])
  grammar, count = _TASK_RULE.subn(
      lambda m: m.group(1) + sentence + m.group(3), game['grammar'])
  if count != 1:
    raise ValueError('the grammar has no single "Your task is to:" rule')
  game = dict(game, pddl_problem=problem.replace(goal, edited),
              grammar=grammar, solvable=None, walkthrough=None)
  return game, dict(traj, pddl_params=params)


# Synthesis.


def generate(task_type: str, scene: int, seed: int, *, distractors: int = 4,
             max_receptacles: int = 0, excluded: Iterable[str] = (),
             only: Iterable[str] = ()) -> tuple[dict, dict]:
  """(game.tw-pddl dict, traj_data dict) of one synthesised game.

  Args:
    task_type: one of TASK_TYPES.
    scene: AI2-THOR floor plan number (a room with poses in the wheel).
    seed: all random choices derive from (seed, scene, task type).
    distractors: other object types placed (1-2 instances each).
    max_receptacles: keep at most this many of the scene's receptacles (the
      ones the task needs first); 0 keeps all. Fewer receptacles mean fewer
      admissible actions and shorter prompts.
    excluded: object types never used as the task's object (held out).
    only: if given, the task's object is one of these (the OOD split).

  Raises GenerationError when the scene cannot host the task.
  """
  if task_type not in TASK_TYPES:
    raise ValueError(f'unknown task type {task_type!r}')
  rng = np.random.default_rng([seed, scene, TASK_TYPES.index(task_type)])
  receptacles, scene_types = load_scene(scene)
  by_type = collections.defaultdict(list)
  for r in receptacles:
    by_type[r[1]].append(r)
  obj, second = _pick_targets(task_type, scene_types, by_type, set(excluded),
                              set(only), rng)
  look = task_type == 'look_at_obj_in_light'
  keep = _keep_receptacles(task_type, obj, second, by_type, max_receptacles,
                           rng)
  placed = _place_objects(task_type, obj, second, scene_types, keep,
                          distractors, rng)
  recep, toggle = ('', second) if look else (second, '')
  problem = _problem_text(task_type, keep, placed, obj, recep, toggle, rng)
  domain, grammar = _logic()
  sentence = task_text(task_type, obj, recep, toggle,
                       choice=int(rng.integers(2)))
  game = {'pddl_domain': domain,
          'grammar': grammar.replace('UNKNOWN GOAL', sentence),
          'pddl_problem': problem, 'solvable': None, 'walkthrough': None}
  traj = {'task_type': task_type,
          'scene': {'floor_plan': f'FloorPlan{scene}', 'scene_num': scene},
          'pddl_params': {'object_target': obj, 'parent_target': recep,
                          'toggle_target': toggle, 'mrecep_target': '',
                          'object_sliced': False},
          'rla_jax': {'seed': seed, 'distractors': distractors,
                      'max_receptacles': max_receptacles}}
  return game, traj


@functools.lru_cache(maxsize=1)
def _logic() -> tuple[str, str]:
  """(alfred.pddl, alfred.twl2): the domain and grammar every game ships."""
  with open(package_file('data', 'alfred.pddl')) as f:
    domain = f.read()
  with open(package_file('data', 'alfred.twl2')) as f:
    return domain, f.read()


def _choice(rng, items: Sequence[Any]) -> Any:
  return items[int(rng.integers(len(items)))]


def _pick_targets(task_type, scene_types, by_type, excluded, only, rng):
  """(object type, receptacle type or lamp type) the scene can host."""
  objects = [t for t in scene_types if t in pickupable() and t not in excluded
             and (not only or t in only)]
  cap = CAPABILITY.get(task_type)
  if cap:
    objects = [t for t in objects if t in capabilities()[cap]]
  appliance = APPLIANCE.get(task_type)
  if appliance and appliance not in by_type:
    raise GenerationError(f'no {appliance} in this scene')
  if task_type == 'look_at_obj_in_light':
    lamps = [t for t in LAMPS if t in scene_types]
    hosts = [t for t in _LAMP_HOSTS if t in by_type]
    if not lamps or not hosts:
      raise GenerationError('no lamp (or nothing to stand it on) here')
    objects = [t for t in objects if _homes(t, by_type)]
    if not objects:
      raise GenerationError('no object to look at in this scene')
    return _choice(rng, objects), _choice(rng, lamps)
  pairs = []
  for o in objects:
    for r in by_type:
      # The object must also start somewhere that is not the goal.
      if (o in can_contain()[r] and r != appliance
          and set(_homes(o, by_type)) - {r}):
        pairs.append((o, r))
  if not pairs:
    raise GenerationError(f'no object/receptacle pair for {task_type}')
  return _choice(rng, pairs)


def _homes(otype: str, by_type) -> list[str]:
  """Receptacle types present that can hold `otype`."""
  return sorted(r for r in by_type if otype in can_contain()[r])


def _keep_receptacles(task_type, obj, second, by_type, limit, rng):
  """Receptacles of the game: the ones the task needs, then random others."""
  every = sorted(r for rs in by_type.values() for r in rs)
  if not limit or limit >= len(every):
    return every
  look = task_type == 'look_at_obj_in_light'
  need_types = [t for t in (APPLIANCE.get(task_type),
                            None if look else second) if t]
  if look:
    need_types.append(_choice(rng, [t for t in _LAMP_HOSTS if t in by_type]))
  starts = [t for t in _homes(obj, by_type) if t not in need_types]
  if starts:
    need_types.append(_choice(rng, starts))
  keep = [_choice(rng, by_type[t]) for t in dict.fromkeys(need_types)]
  rest = [r for r in every if r not in keep]
  order = rng.permutation(len(rest))
  keep += [rest[i] for i in order[:max(0, limit - len(keep))]]
  return sorted(keep)


def _place_objects(task_type, obj, second, scene_types, keep, distractors,
                   rng):
  """[(object id, type, receptacle id)]: targets, lamp and distractors."""
  kept_types = {r[1] for r in keep}
  look = task_type == 'look_at_obj_in_light'
  goal_recep = None if look else second
  placed, counts = [], collections.Counter()

  def put(otype, hosts):
    host = _choice(rng, hosts)
    counts[otype] += 1
    x, y = rng.uniform(-3, 3, size=2)
    oid = f'{otype}|{x:+06.2f}|{0.5 + 0.1 * counts[otype]:+06.2f}|{y:+06.2f}'
    placed.append((oid, otype, host[0]))

  hosts = [r for r in keep if obj in can_contain()[r[1]] and r[1] != goal_recep
           and r[1] != APPLIANCE.get(task_type)]
  if not hosts:
    raise GenerationError(f'nowhere to put the {obj}')
  low = 2 if task_type == 'pick_two_obj_and_place' else 1
  for _ in range(int(rng.integers(low, 4))):
    put(obj, hosts)
  if look:
    put(second, [r for r in keep if r[1] in _LAMP_HOSTS])
  others = [t for t in scene_types if t in pickupable() and t != obj
            and any(t in can_contain()[k] for k in kept_types)]
  chosen = rng.permutation(len(others))[:distractors]
  for i in sorted(chosen):
    otype = others[i]
    for _ in range(int(rng.integers(1, 3))):
      put(otype, [r for r in keep if otype in can_contain()[r[1]]])
  return placed


def _problem_text(task_type, keep, placed, obj, recep, toggle, rng) -> str:
  """The PDDL problem, laid out as ALFWorld's game files are."""
  constants, _ = alfworld_modules()
  rtypes = sorted(set(can_contain()) - MOVABLE)
  otypes = sorted((set(constants.OBJECTS) | set(LAMPS)) - set(rtypes))
  locations = sorted({r[2] for r in keep})
  start = locations[0]
  while start in locations:  # the agent starts in the middle of the room
    x, z = rng.integers(-12, 12, size=2)
    start = f'loc|{x}|{z}|{int(rng.integers(4))}|30'
  caps = capabilities()
  init = [f'(receptacleType {mangle(r[0])} {r[1]}Type)' for r in keep]
  init += [f'(objectType {mangle(o[0])} {o[1]}Type)' for o in placed]
  kept_types = sorted({r[1] for r in keep})
  placed_types = sorted({o[1] for o in placed})
  init += [f'(canContain {r}Type {o}Type)' for r in kept_types
           for o in placed_types if o in can_contain()[r]]
  init += [f'(pickupable {mangle(o[0])})' for o in placed
           if o[1] in pickupable()]
  init += [f'(isReceptacleObject {mangle(o[0])})' for o in placed
           if o[1] in can_contain()]
  init += [f'(openable {mangle(r[0])})' for r in keep
           if r[1] in constants.OPENABLE_CLASS_LIST]
  init.append(f'(atLocation agent1 {mangle(start)})')
  for cap in ('cleanable', 'heatable', 'coolable', 'toggleable', 'sliceable'):
    init += [f'({cap} {mangle(o[0])})' for o in placed if o[1] in caps[cap]]
  where = {r[0]: r[2] for r in keep}
  init += [f'(inReceptacle {mangle(o[0])} {mangle(o[2])})' for o in placed]
  init += [f'(receptacleAtLocation {mangle(r[0])} {mangle(r[2])})'
           for r in keep]
  init += [f'(objectAtLocation {mangle(o[0])} {mangle(where[o[2]])})'
           for o in placed]
  objects = (['agent1 - agent'] + [f'{t}Type - otype' for t in otypes] +
             [f'{t}Type - rtype' for t in rtypes] +
             [f'{mangle(o[0])} - object' for o in sorted(placed)] +
             [f'{mangle(r[0])} - receptacle' for r in keep] +
             [f'{mangle(l)} - location' for l in locations + [start]])
  indent = '\n        '
  return (f'(define (problem plan_rla_{task_type})\n(:domain alfred)\n'
          f'(:objects{indent}{indent.join(objects)}\n        )\n'
          f'(:init{indent}{indent.join(init)}\n        )\n'
          f'{goal_pddl(task_type, obj, recep, toggle)}\n)\n')


# Files.


def write_trial(trial_dir: str, game: dict, traj: dict) -> None:
  """Writes game.tw-pddl + traj_data.json into `trial_dir` atomically."""
  parent = os.path.dirname(trial_dir.rstrip(os.sep))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix='.trial-', dir=parent)
  try:
    with open(os.path.join(tmp, GAME_FILE), 'w', encoding='utf-8') as f:
      json.dump(game, f)
    with open(os.path.join(tmp, TRAJ_FILE), 'w', encoding='utf-8') as f:
      json.dump(traj, f, indent=1)
    if os.path.isdir(trial_dir):  # another writer won the race: same content
      return
    os.replace(tmp, trial_dir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def read_trial(trial_dir: str) -> tuple[dict, dict]:
  with open(os.path.join(trial_dir, GAME_FILE), encoding='utf-8') as f:
    game = json.load(f)
  with open(os.path.join(trial_dir, TRAJ_FILE), encoding='utf-8') as f:
    traj = json.load(f)
  return game, traj


def find_trials(data_dir: str,
                split: str) -> tuple[list[str], list[tuple[str, str]]]:
  """(trial folders, damaged trials) of a split in ALFWorld's layout.

  `data_dir` holds `json_2.1.1/<split>/...` (or is the json_2.1.1 folder);
  folders are relative to it. Skipped as ALFWorld's own loader skips them:
  movable-receptacle and sliced tasks, task types outside TASK_TYPES, games
  not marked solvable. Damaged: (folder, what is wrong) for a trial whose
  files do not read as JSON objects.
  """
  root = data_dir
  if os.path.isdir(os.path.join(data_dir, 'json_2.1.1')):
    root = os.path.join(data_dir, 'json_2.1.1')
  base = os.path.join(root, split)
  found, damaged = [], []
  for folder, _, files in os.walk(base):
    if TRAJ_FILE not in files or GAME_FILE not in files:
      continue
    if 'movable' in folder or 'Sliced' in folder:
      continue
    where = os.path.relpath(folder, root)
    try:
      game, traj = read_trial(folder)
    except (OSError, ValueError) as e:
      damaged.append((where, f'{type(e).__name__}: {e}'))
      continue
    wrong = [name for name, data in ((GAME_FILE, game), (TRAJ_FILE, traj))
             if not isinstance(data, dict)]
    if wrong:
      damaged.append((where, f'{wrong[0]} is not a JSON object'))
    elif traj.get('task_type') in TASK_TYPES and game.get('solvable'):
      found.append(where)
  return sorted(found), sorted(damaged)
