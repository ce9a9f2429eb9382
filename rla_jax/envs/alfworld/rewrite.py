"""ALFWorld task rewriting (RLANYTHING.md 3.7): prompt, proposals, checks.

The environment LLM sees a digest of the root game's PDDL `:init` facts, the
critiques of failed rollouts, the direction and the measured accuracy, and
answers with two type tokens, `\\boxed{TOKEN_A,TOKEN_B}`, that replace the
goal's two types. Unlike the authors, who only warn, every constraint is
enforced here (`check`): the types exist in the scene, canContain holds, the
object has the capability the task needs, pick-two has two instances, the
goal changes. The environment then builds the game and lets the planner
solve it (alfworld.py). No alfworld import: pure text and set logic.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Sequence
import dataclasses
import re

from rla_jax import boxed
from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs.alfworld import games

# How the facts of each predicate read in the digest (authors' wording).
EXPLAIN = {
    'receptacleAtLocation': 'receptacle r is at location l',
    'objectAtLocation': 'object o is at location l',
    'atLocation': 'agent is at location l',
    'inReceptacle': 'object o is in/on receptacle r',
    'inReceptacleObject': 'object inner is inside object outer',
    'openable': 'receptacle can be opened',
    'opened': 'receptacle is currently open',
    'pickupable': 'object can be picked up by the agent',
    'isReceptacleObject': 'object can itself receive other objects',
    'cleanable': 'object can be cleaned in a sink',
    'heatable': 'object can be heated in a microwave',
    'coolable': 'object can be cooled in a fridge',
    'toggleable': 'object has an on/off state',
    'isOn': 'object is currently on',
    'sliceable': 'object can be sliced',
}
_TYPED = ('objectType', 'receptacleType', 'canContain')
FRAMEWORK = {
    'pick_and_place_simple': (
        'place an object type into/on a receptacle type.',
        'place an object of type **{a}** into/on a receptacle of type **{b}**.',
        'pair must satisfy `canContain(REC_TYPE, OBJ_TYPE)`.'),
    'pick_clean_then_place_in_recep': (
        '**clean** an object type and place it into/on a receptacle type.',
        'clean type **{a}** then place into/on type **{b}**.',
        'OBJ must be cleanable; canContain(REC,OBJ).'),
    'pick_heat_then_place_in_recep': (
        '**heat** an object type and place it into/on a receptacle type.',
        'heat type **{a}** then place into/on type **{b}**.',
        'OBJ must be heatable; canContain(REC,OBJ).'),
    'pick_cool_then_place_in_recep': (
        '**cool** an object type and place it into/on a receptacle type.',
        'cool type **{a}** then place into/on type **{b}**.',
        'OBJ must be coolable; canContain(REC,OBJ).'),
    'pick_two_obj_and_place': (
        'place **two distinct objects** (same type) into/on a receptacle '
        'type.',
        'place two objects of type **{a}** into/on type **{b}**.',
        '>=2 instances of OBJ_TYPE; canContain(REC,OBJ).'),
    'look_at_obj_in_light': (
        "a light object type is present at the agent's location; the agent "
        '**holds** an object type.',
        'a **toggleable and toggled** light object of type **{a}** is '
        'present; agent **holds** type **{b}**.',
        'LIGHT must have `toggleable`; HOLD should have `pickupable` '
        'instance in INIT.'),
}


@dataclasses.dataclass(frozen=True)
class Scene:
  """What the root game's :init says, by type (types without 'Type')."""

  objects: dict[str, list[str]]  # object type -> instance ids
  receptacles: dict[str, list[str]]  # receptacle type -> instance ids
  can_contain: frozenset[tuple[str, str]]  # (receptacle type, object type)
  capable: dict[str, frozenset[str]]  # capability -> object types with one


def scene(problem: str) -> Scene:
  """The type-level view of a problem's :init facts."""
  objects, receptacles = collections.defaultdict(list), collections.defaultdict(
      list)
  pairs, holders = set(), collections.defaultdict(set)
  facts = games.facts(problem)
  otype = {}
  for pred, args in facts:
    if pred == 'objectType' and len(args) == 2:
      otype[args[0]] = _strip(args[1])
      objects[_strip(args[1])].append(args[0])
    elif pred == 'receptacleType' and len(args) == 2:
      receptacles[_strip(args[1])].append(args[0])
    elif pred == 'canContain' and len(args) == 2:
      pairs.add((_strip(args[0]), _strip(args[1])))
  for pred, args in facts:
    if len(args) == 1 and args[0] in otype:
      holders[pred].add(otype[args[0]])
  return Scene(dict(objects), dict(receptacles), frozenset(pairs),
               {k: frozenset(v) for k, v in holders.items()})


def _strip(type_name: str) -> str:
  return type_name[:-4] if type_name.endswith('Type') else type_name


def digest(problem: str) -> str:
  """An English digest of the :init facts (the authors' sections).

  Instances get short aliases (apple1, cabinet3, loc7). The relation lists
  are the cuttable part: a too-long prompt loses them before the types.
  """
  facts = games.facts(problem)
  view = scene(problem)
  names = {a for p, args in facts for a in args if a.startswith('loc_bar_')}
  names |= {i for ids in (*view.objects.values(), *view.receptacles.values())
            for i in ids}
  alias = _aliases(names)
  lines = ['### Object classes (otype) \u2192 instances \u2014 types \u2192 '
           'concrete objects']
  lines += [f'- {t}Type: ' + ', '.join(sorted(alias[i] for i in ids))
            for t, ids in sorted(view.objects.items())] or ['- (none)']
  lines += ['', '### Receptacle classes (rtype) \u2192 instances \u2014 '
            'types \u2192 concrete receptacles']
  lines += [f'- {t}Type: ' + ', '.join(sorted(alias[i] for i in ids))
            for t, ids in sorted(view.receptacles.items())] or ['- (none)']
  lines += ['', '### canContain (class \u2192 class) \u2014 receptacle-class '
            'can contain object-class',
            ', '.join(f'({r}Type, {o}Type)'
                      for r, o in sorted(view.can_contain)) or '(none)']
  groups = collections.defaultdict(set)
  for pred, args in facts:
    if pred not in _TYPED:
      groups[pred].add(tuple(alias.get(a, a) for a in args))
  relations = []
  for pred in sorted(groups, key=lambda p: (p not in EXPLAIN, p)):
    values = sorted(groups[pred])
    shown = ', '.join(v[0] if len(v) == 1 else '(' + ', '.join(v) + ')'
                      for v in values)
    relations += ['', f'### {pred} \u2014 '
                  f'{EXPLAIN.get(pred, "other instantiated facts")}', shown]
  locations = sorted({alias[a] for p, args in facts for a in args
                      if a.startswith('loc_bar_')})
  head = '\n'.join(lines)
  return (f'{head}\n\n### Locations \u2014 list of location aliases\n' +
          truncation.cuttable(', '.join(locations) + '\n' +
                              '\n'.join(relations)))


def _aliases(names) -> dict[str, str]:
  """Instance id -> type name + running number (apple1), loc ids -> loc1."""
  buckets = collections.defaultdict(list)
  for name in sorted(names):
    base = 'loc' if name.startswith('loc_bar_') else name.split('_bar_')[0]
    buckets[base.lower()].append(name)
  return {n: f'{b}{i}' for b, ns in buckets.items()
          for i, n in enumerate(ns, 1)}


def prompt(problem: str, task_type: str, direction: str, acc: float,
           critiques: Sequence[str], old: Sequence[str]) -> str:
  """The environment LLM's rewrite prompt, without the attempt suffix.

  `old` holds the goal's two types in the answer's order (object, receptacle;
  look_at_obj_in_light: lamp, held object).
  """
  lines = ['Review the following details about an interactive environment. '
           'A related task will follow.', digest(problem), '', '---']
  shown = [c.strip() for c in critiques if c and c.strip()]
  if shown:
    lines.append('### Failure summaries from recent rollouts (failed '
                 'rollouts only)')
    lines.append(truncation.cuttable('\n'.join(
        f'- Rollout {i}: {c}' for i, c in enumerate(shown))))
    lines.append('')
  word = direction.upper()
  lines += [
      f'### Your job is to propose a new goal that makes the task **{word}**.',
      f'- The parent rollout accuracy (prev_acc) is {acc}.',
      '- The new goal must be different from the original and follow the '
      'instructions.',
      '- The overall framework of the goal cannot be changed; you may only '
      'modify two tokens within this framework.',
      'Represent the new goal by outputting two tokens, placed inside '
      '\\boxed{} and separated by a comma, e.g., \\boxed{TOKEN_A,TOKEN_B}.',
      'You need to think step by step then provide final result in '
      '\\boxed{}.', '',
      f'### Difficulty goal: **{word}** (prev_acc={acc})']
  if direction == structs.HARDER:
    lines += ['- Prefer types with *fewer* available instances (rarer) while '
              'keeping constraints satisfied.',
              '- Prefer combinations likely requiring more search/steps, but '
              'still solvable in this environment.']
  else:
    lines += ['- Prefer types with *more* available instances (more common) '
              'while keeping constraints satisfied.',
              '- Prefer combinations likely easier to find/complete, but '
              'still valid.']
  framework, original, constraint = FRAMEWORK[task_type]
  a, b = (f'{t}Type' for t in old)
  roles = ('<LIGHT_OBJ_TYPE> <HOLD_OBJ_TYPE>' if
           task_type == 'look_at_obj_in_light' else '<OBJ_TYPE> <REC_TYPE>')
  lines += [f'**Overall Framework**: {framework}',
            f'**Original goal**: {original.format(a=a, b=b)}',
            f'The final output example is \\boxed{{{a}, {b}}}',
            f'**Design instruction**: Output exactly **two tokens** \u2014 '
            f'`{roles}`.',
            f'- Constraints: {constraint}']
  return '\n'.join(lines)


def parse_tokens(text: str, known: Sequence[str]) -> tuple[str, str] | None:
  """Two type names from an answer, mapped onto `known` types; else None.

  The last \\boxed{} is read as the authors do (a Python list/tuple, or
  comma-separated), and also when the tokens are separated by spaces, 'and'
  or semicolons, carry a 'Type' suffix, another case or a plural s. Without
  a box, the last line naming two known types is used.
  """
  lookup = {_key(t): t for t in known}
  content = boxed.last_boxed(text)
  if content is None:
    for line in reversed([l for l in text.splitlines() if l.strip()]):
      found = _types_in(line, lookup)
      if len(found) >= 2:
        return found[0], found[1]
    return None
  content = content.replace('\uff0c', ',').replace('\u3001', ',').strip()
  content = re.sub(r'^[\[\(\{<\s]+|[\]\)\}>\s]+$', '', content)
  try:
    value = ast.literal_eval(content)
    parts = [str(v) for v in value] if isinstance(value, (list, tuple)) else []
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    parts = []
  if len(parts) < 2:
    parts = [p for p in re.split(r'\s*(?:,|;|\band\b|\s)\s*', content) if p]
  mapped = [lookup.get(_key(p.strip('\'"`*.'))) for p in parts]
  if len(mapped) >= 2 and mapped[0] and mapped[1]:
    return mapped[0], mapped[1]
  found = _types_in(content, lookup)
  return (found[0], found[1]) if len(found) >= 2 else None


def _key(token: str) -> str:
  key = re.sub(r'[\s_\-]', '', token).lower()
  key = key[:-4] if key.endswith('type') else key
  return key


def _types_in(text: str, lookup: dict[str, str]) -> list[str]:
  """Known types named in `text`, in order (words joined as in CounterTop)."""
  words = re.findall(r'[A-Za-z]+', text)
  found, i = [], 0
  while i < len(words):
    for width in (3, 2, 1):
      key = _key(''.join(words[i:i + width]))
      hit = lookup.get(key) or (lookup.get(key[:-1]) if key.endswith('s')
                                else None)
      if hit:
        found.append(hit)
        i += width
        break
    else:
      i += 1
  return found


def assign(task_type: str, tokens: tuple[str, str], view: Scene
           ) -> dict[str, str]:
  """Roles of two proposed types: {'obj', 'recep'} or {'toggle', 'obj'}.

  As the authors do, a pair that only satisfies canContain when swapped is
  swapped (and a light named second is moved first).
  """
  a, b = tokens
  if task_type == 'look_at_obj_in_light':
    if a not in games.LAMPS and b in games.LAMPS:
      a, b = b, a
    return {'toggle': a, 'obj': b}
  if (b, a) not in view.can_contain and (a, b) in view.can_contain:
    a, b = b, a
  return {'obj': a, 'recep': b}


def check(task_type: str, roles: dict[str, str], old: dict[str, str],
          view: Scene, heldout: Sequence[str] = ()) -> str | None:
  """Why `roles` is not a valid goal for this scene (None if it is)."""
  if roles == old:
    return 'same goal'
  obj = roles['obj']
  if obj not in view.objects:
    return f'no {obj} in the scene'
  if obj in heldout:
    return f'{obj} is held out for evaluation'
  if obj not in view.capable.get('pickupable', ()):
    return f'{obj} cannot be picked up'
  if task_type == 'look_at_obj_in_light':
    lamp = roles['toggle']
    if lamp not in view.objects:
      return f'no {lamp} in the scene'
    if lamp not in view.capable.get('toggleable', ()):
      return f'{lamp} is not toggleable'
    return None
  recep = roles['recep']
  if recep not in view.receptacles:
    return f'no {recep} in the scene'
  if (recep, obj) not in view.can_contain:
    return f'canContain({recep}, {obj}) does not hold'
  need = games.CAPABILITY.get(task_type)
  if need and obj not in view.capable.get(need, ()):
    return f'{obj} is not {need}'
  if task_type == 'pick_two_obj_and_place' and len(view.objects[obj]) < 2:
    return f'fewer than two {obj}'
  return None
