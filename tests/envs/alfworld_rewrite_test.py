"""ALFWorld rewrites (RLANYTHING.md 3.7): proposals, checks, the planner."""

import json
import os
import re
import shutil

import pytest

from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs.alfworld import environment as alfworld
from rla_jax.envs.alfworld import games
from rla_jax.envs.alfworld import play
from rla_jax.envs.alfworld import rewrite as rewriting
from conftest import fake_generate  # pylint: disable=g-bad-import-order

pytest.importorskip('alfworld')
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')
SMALL = dict(num_train=6, num_eval=1, max_receptacles=6, distractors=(1, 2))
KNOWN = ('Apple', 'CounterTop', 'DeskLamp', 'Book', 'SinkBasin', 'Mug')


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  return alfworld.AlfWorldEnv(str(tmp_path_factory.mktemp('games')), **SMALL)


def spec_of(env, task_type):
  return next(s for s in env.tasks('train')
              if s['game']['task_type'] == task_type)


def view_of(env, spec):
  return rewriting.scene(env.content(spec)[0]['pddl_problem'])


def request(spec, direction, acc=0.875, critiques=(), root=None):
  return base.RewriteRequest(spec=spec, root=root or spec, direction=direction,
                             acc_old=acc, critiques=list(critiques),
                             trajectories=[], judgments=[])


def valid_pairs(env, spec):
  """(object, receptacle) goals that pass every check, and are not won at
  the start (no instance of the object already in such a receptacle)."""
  view = view_of(env, spec)
  task_type = spec['game']['task_type']
  old = dict(zip(('obj', 'recep'), env.goal_tokens(
      task_type, env.content(spec)[0]['pddl_problem'])))
  problem = env.content(spec)[0]['pddl_problem']
  where = {args[0]: args[1] for p, args in games.facts(problem)
           if p == 'inReceptacle'}
  rtype = {i: t for t, ids in view.receptacles.items() for i in ids}
  pairs = []
  for recep, obj in sorted(view.can_contain):
    roles = {'obj': obj, 'recep': recep}
    starts = {rtype[where[i]] for i in view.objects[obj]}
    if rewriting.check(task_type, roles, old, view) is None and (
        recep not in starts):
      pairs.append((obj, recep))
  return pairs


@pytest.mark.parametrize('text,want', [
    ('so \\boxed{Apple,CounterTop}', ('Apple', 'CounterTop')),
    ('\\boxed{AppleType, CounterTopType}', ('Apple', 'CounterTop')),
    ("\\boxed{['apple', 'countertop']}", ('Apple', 'CounterTop')),
    ('\\boxed{(Mug; SinkBasin)}', ('Mug', 'SinkBasin')),
    ('\\boxed{Apple CounterTop}', ('Apple', 'CounterTop')),  # no comma
    ('\\boxed{apples and counter top}', ('Apple', 'CounterTop')),
    ('\\boxed{Book\uff0cDeskLamp}', ('Book', 'DeskLamp')),  # fullwidth comma
    ('Think... I will use:\nDeskLamp, Book', ('DeskLamp', 'Book')),  # no box
    ('\\boxed{Apple}', None),
    ('\\boxed{Banana, Table}', None),  # not in the scene
    ('\\boxed{}', None),
    ('no proposal at all', None),
    ('', None),
])
def test_parse_tokens_reads_malformed_answers(text, want):
  assert rewriting.parse_tokens(text, KNOWN) == want


def test_assign_swaps_as_the_authors_and_check_enforces(env):
  spec = spec_of(env, 'pick_heat_then_place_in_recep')
  view = view_of(env, spec)
  obj, recep = valid_pairs(env, spec)[0]
  task_type = 'pick_heat_then_place_in_recep'
  # The pair only fits canContain swapped: it is swapped.
  assert rewriting.assign(task_type, (recep, obj), view) == {
      'obj': obj, 'recep': recep}
  old = {'obj': 'Nothing', 'recep': 'Nowhere'}
  check = lambda o, r: rewriting.check(task_type, {'obj': o, 'recep': r},
                                       old, view)
  assert check(obj, recep) is None
  assert check(obj, obj) == f'no {obj} in the scene'
  assert check('Banana', recep) == 'no Banana in the scene'
  unheatable = next((o for o in view.objects
                     if o not in view.capable.get('heatable', ())), None)
  if unheatable:
    homes = [r for r, o in view.can_contain if o == unheatable]
    assert check(unheatable, homes[0]) == f'{unheatable} is not heatable'
  no_home = next(r for r in view.receptacles if (r, obj) not in
                 view.can_contain)
  assert check(obj, no_home) == f'canContain({no_home}, {obj}) does not hold'
  assert rewriting.check(task_type, old, old, view) == 'same goal'
  assert rewriting.check(task_type, {'obj': obj, 'recep': recep}, old, view,
                         heldout=(obj,)) == f'{obj} is held out for evaluation'
  two = spec_of(env, 'pick_two_obj_and_place')
  two_view = view_of(env, two)
  single = [o for o, ids in two_view.objects.items() if len(ids) == 1
            and o in two_view.capable['pickupable']]
  for o in single:
    r = next(r for r, x in two_view.can_contain if x == o)
    assert rewriting.check('pick_two_obj_and_place', {'obj': o, 'recep': r},
                           old, two_view) == f'fewer than two {o}'
  look = spec_of(env, 'look_at_obj_in_light')
  look_view = view_of(env, look)
  lamp = next(t for t in games.LAMPS if t in look_view.objects)
  held = next(iter(look_view.capable['pickupable']))
  assert rewriting.assign('look_at_obj_in_light', (held, lamp),
                          look_view) == {'toggle': lamp, 'obj': held}
  assert rewriting.check('look_at_obj_in_light', {'toggle': held,
                                                  'obj': held}, old,
                         look_view) == f'{held} is not toggleable'


def test_prompt_has_the_digest_critiques_direction_and_accuracy(env):
  spec = spec_of(env, 'pick_and_place_simple')
  problem = env.content(spec)[0]['pddl_problem']
  old = env.goal_tokens('pick_and_place_simple', problem)
  text = rewriting.prompt(problem, 'pick_and_place_simple', structs.HARDER,
                          0.875, ['It looped.', '', 'It never opened it.'],
                          old)
  assert text.startswith('Review the following details about an interactive '
                         'environment.')
  for section in ('### Object classes (otype)', '### Receptacle classes',
                  '### canContain', '### Locations', '### inReceptacle',
                  '### receptacleAtLocation'):
    assert section in text
  assert '- Rollout 0: It looped.\n- Rollout 1: It never opened it.' in text
  assert 'makes the task **HARDER**' in text and 'prev_acc) is 0.875' in text
  assert f'\\boxed{{{old[0]}Type, {old[1]}Type}}' in text
  assert 'Prefer types with *fewer* available instances' in text
  assert '_bar_' not in text  # instances appear by alias (apple1)
  easier = rewriting.prompt(problem, 'pick_and_place_simple', structs.EASIER,
                            0.125, [], old)
  assert '**EASIER**' in easier and '*more* available instances' in easier
  assert 'Failure summaries' not in easier


def test_first_valid_attempt_becomes_the_rewrite(env):
  spec = spec_of(env, 'pick_and_place_simple')
  (obj, recep), (obj2, recep2) = valid_pairs(env, spec)[:2]
  active = dict(spec, id=spec['id'] + '.v1-abc', version=1,
                goal={'obj': obj2, 'recep': recep2})
  generate, prompts = fake_generate([
      'I am not sure.', '\\boxed{Banana, Table}', f'\\boxed{{{obj},{obj}}}',
      f'Harder: \\boxed{{{recep}, {obj}}}', f'\\boxed{{{obj2}, {recep2}}}'])
  new = env.rewrite(request(active, structs.HARDER, root=spec,
                            critiques=['It looped.']), generate, attempts=5)
  assert new['goal'] == {'obj': obj, 'recep': recep}  # swapped, 4th answer
  assert new['game'] == spec['game']  # built from the root, as the authors
  assert new['root_id'] == spec['id'] and new['version'] == 2
  assert new['id'].startswith(spec['id'] + '.v2-')
  assert len(prompts) == 5
  for i, prompt in enumerate(prompts, 1):
    assert prompt.endswith(f'\n\n(Attempt {i}/5)\n')
    assert 'It looped.' in prompt
  # The pending game loads, says its new task, and its planned path wins.
  sentence = env.info(new)['sentence']
  assert obj.lower() in sentence and recep.lower() in sentence
  trial = env.game(new)['trial']
  game, traj = games.read_trial(trial)
  assert game['solvable'] and traj['pddl_params']['object_target'] == obj
  episode = env.make_episode(new, seed=0, max_turns=40)
  assert f'Your task is to: {sentence}.' in episode.reset()
  for command in game['walkthrough']:
    _, done, outcome = episode.step(command)
  episode.close()
  assert (done, outcome) == (True, 1.0)


def test_easier_look_rewrite_keeps_the_framework(env):
  spec = spec_of(env, 'look_at_obj_in_light')
  view = view_of(env, spec)
  lamp = next(t for t in games.LAMPS if t in view.objects)
  old_obj = env.content(spec)[1]['pddl_params']['object_target']
  held = next(o for o in sorted(view.capable['pickupable']) if o != old_obj)
  generate, prompts = fake_generate([f'\\boxed{{{held}, {lamp}}}'])
  new = env.rewrite(request(spec, structs.EASIER, acc=0.0), generate,
                    attempts=1)
  assert new['goal'] == {'toggle': lamp, 'obj': held}
  assert '**EASIER**' in prompts[0]
  goal = games.block(env.content(new)[0]['pddl_problem'], 'goal')
  assert f'{held}Type' in goal and f'{lamp}Type' in goal
  assert f'{old_obj}Type' not in goal


def test_invalid_proposals_are_rejected_with_reasons(env):
  spec = spec_of(env, 'pick_cool_then_place_in_recep')
  view = view_of(env, spec)
  absent = next(t for t in ('Apple', 'Book', 'Pillow', 'Candle')
                if t not in view.objects)
  generate, _ = fake_generate(['nothing', f'\\boxed{{{absent}, Fridge}}',
                               '\\boxed{Banana, Fridge}'])
  with pytest.raises(base.RewriteRejected,
                     match=rf'2x unparseable; 1x no {absent} in the scene'):
    env.rewrite(request(spec, structs.HARDER), generate, attempts=3)
  with pytest.raises(base.RewriteRejected, match='no completions'):
    env.rewrite(request(spec, structs.EASIER), fake_generate([])[0],
                attempts=2)
  with pytest.raises(ValueError, match='unknown direction'):
    env.rewrite(request(spec, 'sideways'), generate, attempts=1)


def test_a_goal_won_at_the_start_is_rejected(env):
  spec = spec_of(env, 'pick_and_place_simple')
  problem = env.content(spec)[0]['pddl_problem']
  view = view_of(env, spec)
  where = {args[0]: args[1] for p, args in games.facts(problem)
           if p == 'inReceptacle'}
  rtype = {i: t for t, ids in view.receptacles.items() for i in ids}
  old = env.content(spec)[1]['pddl_params']['object_target']
  obj = next(o for o in view.objects if o != old)
  recep = rtype[where[view.objects[obj][0]]]
  generate, _ = fake_generate([f'\\boxed{{{obj}, {recep}}}'])
  with pytest.raises(base.RewriteRejected, match='won at the start'):
    env.rewrite(request(spec, structs.EASIER, acc=0.0), generate, attempts=1)


def test_an_unsolvable_candidate_is_rejected_by_the_planner(env, tmp_path):
  # A folder game where no potato is both heatable and pickupable: every
  # type-level constraint holds (a potato can be heated, a potato can be
  # carried), only the planning stage finds that no plan exists.
  spec = spec_of(env, 'pick_heat_then_place_in_recep')
  game, traj = games.read_trial(env.game(spec)['trial'])
  problem = game['pddl_problem']
  obj = traj['pddl_params']['object_target']
  view = rewriting.scene(problem)
  recep = next(r for r, o in sorted(view.can_contain) if o == obj and
               r != traj['pddl_params']['parent_target'] and
               r != 'Microwave')
  first = view.objects[obj][0]
  host = next(a[1] for p, a in games.facts(problem)
              if p == 'inReceptacle' and a[0] == first)
  place = next(a[1] for p, a in games.facts(problem)
               if p == 'receptacleAtLocation' and a[0] == host)
  for other in view.objects[obj]:  # none of them can be carried ...
    problem = problem.replace(f'(pickupable {other})\n', '')
  extra = f'{obj}_bar__plus_09_dot_00'  # ... but this cold one can
  problem = problem.replace('agent1 - agent', f'agent1 - agent\n{extra} - '
                            'object').replace('(:init', (
                                f'(:init\n(objectType {extra} {obj}Type)\n'
                                f'(pickupable {extra})\n'
                                f'(inReceptacle {extra} {host})\n'
                                f'(objectAtLocation {extra} {place})'))
  data = tmp_path / 'json_2.1.1' / 'train' / 'pick_heat_then_place_in_recep-x'
  games.write_trial(str(data / 'trial_1'), dict(game, pddl_problem=problem,
                                                solvable=True), traj)
  folder = alfworld.AlfWorldEnv(str(tmp_path / 'cache'), data_dir=str(tmp_path))
  root = folder.tasks('train')[0]
  generate, _ = fake_generate([f'\\boxed{{{obj}, {recep}}}'])
  with pytest.raises(base.RewriteRejected,
                     match=r'unsolvable \(the translator proves the goal '
                     r'unreachable\)'):
    folder.rewrite(request(root, structs.HARDER), generate, attempts=1)
  kept = [f for _, _, files in os.walk(tmp_path / 'cache') for f in files]
  assert kept == []  # the failed candidate is not kept
  # The engine that failed to load it went back to the pool: unloading a
  # planner library (as the pool once did) crashed the next one loaded.
  fresh = play.Engines()
  engines = [fresh.acquire(env.game(spec)['path'], 'planner')
             for _ in range(2)]
  with play.LOCK:
    assert all(e.reset()['policy_commands'] for e in engines)
  assert fresh.created == 2


def test_rewrites_resolve_again_after_a_restart(env, tmp_path):
  spec = spec_of(env, 'pick_clean_then_place_in_recep')
  obj, recep = valid_pairs(env, spec)[0]
  new = env.rewrite(request(spec, structs.HARDER),
                    fake_generate([f'\\boxed{{{obj}, {recep}}}'])[0],
                    attempts=1)
  json.dumps(new)  # lives in the pool JSONL and checkpoints
  # A resumed run (new process, same or empty cache) finds the same game.
  same = alfworld.AlfWorldEnv(env.game_dir, **SMALL)
  assert same.game(new) == env.game(new) and not same.gen_seconds
  empty = str(tmp_path / 'empty')
  rebuilt = alfworld.AlfWorldEnv(empty, **SMALL)
  with open(rebuilt.game(new)['path']) as f, open(env.game(new)['path']) as g:
    assert json.load(f)['pddl_problem'] == json.load(g)['pddl_problem']
  shutil.rmtree(empty)
  episode = play.Episode(env.game(new)['path'], 'x', 2)
  assert 'clean' in episode.reset()
  episode.close()
