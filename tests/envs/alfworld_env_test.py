"""ALFWorld setting: generated games, the official layout, play, prompts."""

from concurrent import futures
import json
import os
import shutil

import ml_collections
import pytest

from configs import alfworld as alfworld_config
from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base
from rla_jax.envs.alfworld import environment as alfworld
from rla_jax.envs.alfworld import games
from rla_jax.envs.alfworld import play
from rla_jax.envs.alfworld import prompts

pytest.importorskip('alfworld')
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')
SMALL = dict(num_train=6, num_eval=2, max_receptacles=6, distractors=(1, 2))
OBS = play.render('-= Welcome =-\nYour task is to: put a egg in fridge.',
                  ['go to fridge 1', 'go to sinkbasin 1', 'inventory', 'look',
                   'open drawer 1'])


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  """Six generated games, one per task type, built once."""
  env = alfworld.AlfWorldEnv(str(tmp_path_factory.mktemp('games')), **SMALL)
  for spec in env.tasks('train'):
    env.game(spec)
  return env


def walkthrough(env, spec):
  with open(env.game(spec)['path']) as f:
    return json.load(f)['walkthrough']


def play_out(env, spec, commands, max_turns=40, labels='planner'):
  episode = play.Episode(env.game(spec)['path'], 'x', max_turns, labels)
  first = episode.reset()
  results = [episode.step(c) for c in commands]
  episode.close()
  return first, results, episode.info


def test_tasks_mix_types_and_hold_out_scenes(env):
  train = env.tasks('train')
  assert [s['game']['task_type'] for s in train] == list(games.TASK_TYPES)
  assert train == alfworld.AlfWorldEnv('unused', **SMALL).tasks('train')
  seen, unseen = env.tasks('valid_seen'), env.tasks('valid_unseen')
  ids = [s['id'] for s in train + seen + unseen]
  assert len(set(ids)) == len(ids) and len(seen) == len(unseen) == 2
  json.dumps(train + seen + unseen)
  assert {s['game']['scene'] for s in train + seen} <= set(
      games.scene_numbers('train'))
  assert {s['game']['scene'] for s in unseen} <= set(
      games.scene_numbers('valid_unseen'))
  assert not set(games.scene_numbers('train')) & set(
      games.scene_numbers('valid_unseen'))
  with pytest.raises(ValueError, match='unknown split'):
    env.tasks('eval')


def test_held_out_objects_are_only_goals_of_valid_unseen(tmp_path):
  held = ('Apple', 'Book', 'CellPhone', 'Egg', 'Mug', 'Pillow', 'Potato',
          'SoapBar', 'Towel', 'KeyChain', 'Cloth', 'Bowl')
  env = alfworld.AlfWorldEnv(str(tmp_path), heldout_objects=held,
                             num_train=12, num_eval=6)
  goal = lambda s: env.content(s)[1]['pddl_params']['object_target']
  assert all(goal(s) not in held for s in env.tasks('train'))
  assert all(goal(s) in held for s in env.tasks('valid_unseen'))


@pytest.mark.parametrize('index', range(6))
def test_expert_plan_wins_each_task_type(env, index):
  spec = env.tasks('train')[index]
  plan = walkthrough(env, spec)
  first, results, info = play_out(env, spec, plan)
  assert 'Your task is to: ' in first and env.info(spec)['sentence'] in first
  # Done exactly at the winning step (the episode is cut there).
  assert [r[1:] for r in results] == [(False, None)] * (len(plan) - 1) + [
      (True, 1.0)]
  assert info['step_labels'] == [1] * len(plan)  # the expert's own actions
  assert info['won_at'] == len(plan) - 1


@pytest.mark.parametrize('index', range(6))
def test_handcoded_expert_wins_each_task_type(env, index):
  spec = env.tasks('train')[index]
  episode = play.Episode(env.game(spec)['path'], 'x', 60, 'handcoded')
  episode.reset()
  outcome, steps = None, 0
  while outcome is None:
    _, _, outcome = episode.step(episode.expert_action)
    steps += 1
  episode.close()
  assert outcome == 1.0, (spec, steps)
  assert set(episode.info['step_labels']) == {1}


def test_wrong_actions_lose(env):
  spec = env.tasks('train')[0]
  _, results, info = play_out(env, spec, ['look'] * 4, max_turns=4)
  assert [r[1:] for r in results] == [(False, None)] * 3 + [(True, -1.0)]
  assert info['step_labels'] == [-1] * 4 and info['won_at'] is None
  # Unknown commands do nothing (what 'noop' executes).
  _, results, info = play_out(env, spec, [prompts.NOOP], max_turns=3)
  assert results[0][0].startswith('Nothing happens.')
  assert info['step_labels'] == [-1]


def test_an_action_that_undoes_progress_is_not_labelled_progress(env):
  spec = env.tasks('train')[0]  # pick_and_place_simple
  plan = walkthrough(env, spec)
  take = next(i for i, c in enumerate(plan) if c.startswith('take '))
  obj, source = plan[take][len('take '):].split(' from ')
  undo = f'move {obj} to {source}'
  commands = plan[:take + 1] + [undo] + plan[take:]
  _, results, info = play_out(env, spec, commands)
  assert results[-1][1:] == (True, 1.0)
  labels = info['step_labels']
  assert labels[:take + 1] == [1] * (take + 1)
  assert labels[take + 1] == -1  # putting the object back
  assert labels[take + 2:] == [1] * (len(plan) - take)


def test_a_folder_in_the_official_layout_loads_and_plays(env, tmp_path):
  # The generated games are written in ALFWorld's layout; copy some there.
  data = tmp_path / 'alfworld_data'
  source = os.path.join(env.game_dir, 'json_2.1.1', 'train')
  shutil.copytree(source, data / 'json_2.1.1' / 'train')
  broken = data / 'json_2.1.1' / 'train' / 'pick_and_place_simple-X-None-Y-1'
  shutil.copytree(os.path.dirname(env.game(env.tasks('train')[0])['trial']),
                  broken)
  for trial in broken.iterdir():
    game = json.loads((trial / games.GAME_FILE).read_text())
    (trial / games.GAME_FILE).write_text(json.dumps(dict(game,
                                                         solvable=False)))
  folder = alfworld.AlfWorldEnv(str(tmp_path / 'cache'), data_dir=str(data))
  specs = folder.tasks('train')
  assert len(specs) == 6  # the unsolvable copy is skipped, as ALFWorld does
  assert all(s['game']['trial'].startswith('train/') for s in specs)
  assert folder.tasks('valid_seen') == []
  for spec in specs:
    assert folder.info(spec)['task_type'] in games.TASK_TYPES
    plan = walkthrough(folder, spec)
    episode = folder.make_episode(spec, seed=0, max_turns=40)
    episode.reset()
    results = [episode.step(c) for c in plan]
    episode.close()
    assert results[-1][1:] == (True, 1.0)
  # ALFWorld's own loader accepts the folder too.
  tw_env = pytest.importorskip('alfworld.agents.environment.alfred_tw_env')
  loader = tw_env.AlfredTWEnv({
      'env': {'goal_desc_human_anns_prob': 0, 'task_types': [1, 2, 3, 4, 5,
                                                             6]},
      'dataset': {'data_path': str(data / 'json_2.1.1' / 'train'),
                  'num_train_games': -1}}, train_eval='train')
  assert loader.num_games == 6


def test_games_are_cached_and_deterministic(env, tmp_path):
  spec = env.tasks('train')[2]
  again = alfworld.AlfWorldEnv(env.game_dir, **SMALL)
  assert again.game(spec) == env.game(spec)
  assert again.gen_seconds == []  # read from the cache, not rebuilt
  params = spec['game']
  one = games.generate(params['task_type'], params['scene'], params['seed'],
                       distractors=params['distractors'],
                       max_receptacles=params['max_receptacles'])
  assert one == env.content(spec)
  # A cache that was deleted is rebuilt from the spec.
  fresh = alfworld.AlfWorldEnv(str(tmp_path), **SMALL)
  assert walkthrough(fresh, spec) == walkthrough(env, spec)
  assert len(fresh.gen_seconds) == 1


def test_policy_prompt_as_the_authors(env):
  messages = env.policy_messages({}, [(OBS, 'go to sinkbasin 1')] * 2, OBS)
  assert [m['role'] for m in messages] == ['system', 'user']
  assert messages[0]['content'] == 'You are a helpful assistant.'
  content = messages[1]['content']
  assert content.startswith(prompts.GUIDE + '\n\n' + truncation.CUT_BEGIN +
                            'observation: ')
  history = content[content.index(truncation.CUT_BEGIN):
                    content.index(truncation.CUT_END)]
  assert history.count('you took action: go to sinkbasin 1\n') == 2
  assert 'Admissible actions' not in content  # only the numbered list
  current = content[content.index(truncation.CUT_END):]
  assert current.startswith(truncation.CUT_END + 'observation: -= Welcome')
  assert content.endswith(prompts.CHOOSE + '\n0) go to fridge 1\n'
                          '1) go to sinkbasin 1\n2) inventory\n3) look\n'
                          '4) open drawer 1\n')
  prefixed = alfworld.AlfWorldEnv('x', answer_prefix='\\boxed{', max_history=1)
  messages = prefixed.policy_messages({}, [(OBS, 'look'), (OBS, 'inventory')],
                                      OBS)
  assert messages[-1] == {'role': 'assistant', 'content': '\\boxed{'}
  assert 'you took action: look' not in messages[1]['content']
  assert 'you took action: inventory' in messages[1]['content']


@pytest.mark.parametrize('text,want', [
    ('I go to the fridge. \\boxed{0}', (0, prompts.OK)),
    ('\\boxed{4}', (4, prompts.OK)),
    ('\\boxed{12}', (4, prompts.CLAMPED)),  # out of range: the last one
    ('\\boxed{-1}', (0, prompts.CLAMPED)),
    ('\\boxed{1} or rather \\boxed{3}', (3, prompts.OK)),  # the last box
    ('\\boxed{action 2, not 3}', (2, prompts.OK)),  # its first integer
    ('\\boxed{\\text{2}}', (2, prompts.OK)),
    ('I choose 3', (0, prompts.MISSING)),  # no box: candidate 0
    ('\\boxed{3', (0, prompts.MISSING)),  # never closed
    ('\\boxed{fridge}', (0, prompts.MISSING)),
    ('', (0, prompts.MISSING)),
])
def test_parse_index_as_the_authors(text, want):
  assert prompts.parse_index(text, 5) == want


def test_parse_action_with_prefix_and_noop():
  env = alfworld.AlfWorldEnv('x', answer_prefix='\\boxed{')
  assert env.parse_action('1}', OBS) == 'go to sinkbasin 1'
  assert env.parse_action('\\boxed{3}', OBS) == 'look'
  assert env.parse_action_checked('9}', OBS) == ('open drawer 1',
                                                  prompts.CLAMPED)
  assert env.parse_action_checked('x', OBS) == ('go to fridge 1',
                                                 prompts.MISSING)
  noop = alfworld.AlfWorldEnv('x', on_unparseable='noop')
  assert noop.parse_action('no idea', OBS) == prompts.NOOP
  assert noop.parse_action('\\boxed{9}', OBS) == 'open drawer 1'
  with pytest.raises(ValueError, match='on_unparseable'):
    alfworld.AlfWorldEnv('x', on_unparseable='skip')


def test_judge_prompt_as_the_authors(env):
  tok = alfworld.make_tokenizer()
  from rla_jax import chat  # pylint: disable=g-import-not-at-top
  policy_prompt = chat.render(tok, env.policy_messages(
      {}, [(OBS, 'look')], OBS) + [{'role': 'assistant',
                                    'content': 'The best is \\boxed{'}])
  judge = alfworld.AlfWorldEnv('x', answer_prefix='The best is \\boxed{',
                               judge_prefix='Score: \\boxed{')
  messages = judge.judge_messages({}, policy_prompt, '1}',
                                  play.render('You arrive at sinkbasin 1.',
                                              ['look']))
  assert [m['role'] for m in messages] == ['system', 'user', 'assistant']
  content = messages[1]['content']
  assert content.startswith(prompts.JUDGE + "Agent's prompt:\n" +
                            prompts.GUIDE)
  assert '<|' not in content  # no chat markup of the policy's prompt
  assert "Agent's response:\nThe best is \\boxed{1}\n\n" in content
  assert content.endswith('Next observation after this action:\n'
                          'You arrive at sinkbasin 1.\n')
  assert messages[2]['content'] == 'Score: \\boxed{'
  assert prompts.policy_content(policy_prompt)[1] == play.split(OBS)[1]


def test_metrics_and_curator_hooks(env):
  spec = env.tasks('train')[1]
  assert env.describe(spec).startswith(env.info(spec)['sentence'] + ' (')
  assert 'look_at_obj_in_light task in FloorPlan' in env.describe(spec)
  assert env.difficulty(spec) > 3  # looking in light: 3 stages + search
  obs = play.render('o', ['a', 'b'])
  text = alfworld.make_tokenizer().apply_chat_template(
      env.policy_messages(spec, [], obs), tokenize=False)

  def traj(outcome, response, task_type):
    step = structs.Step(prompt=text, prompt_tokens=[], response=response,
                        response_tokens=[], logprobs=[], action='a',
                        observation='', finish_reason='stop')
    return structs.Trajectory(task_id='t', source='active', rollout=0,
                              spec=spec, steps=[step], outcome=outcome,
                              info={'task_type': task_type})

  out = env.metrics([traj(1.0, '\\boxed{1}', 'look_at_obj_in_light'),
                     traj(-1.0, '\\boxed{5}', 'look_at_obj_in_light'),
                     traj(-1.0, 'hm', 'pick_two_obj_and_place')])
  assert out['success_look_at_obj_in_light'] == 0.5
  assert out['success_pick_two_obj_and_place'] == 0.0
  assert out['action_missing_frac'] == pytest.approx(1 / 3)
  assert out['action_clamped_frac'] == pytest.approx(1 / 3)


def test_concurrent_episodes(env):
  specs = env.tasks('train') * 2

  def run(spec):
    return play_out(env, spec, walkthrough(env, spec))[1][-1][1:]

  with futures.ThreadPoolExecutor(4) as pool:
    assert list(pool.map(run, specs)) == [(True, 1.0)] * len(specs)


def test_from_config(tmp_path):
  env_config = alfworld_config.env_section()
  env = alfworld.from_config(env_config, str(tmp_path))
  assert env.game_dir == str(tmp_path / 'alfworld_games')
  assert env.max_turns == 40 and env.step_labels == 'planner'
  env_config = ml_collections.ConfigDict(dict(env_config, game_dir='/shared',
                                              step_labels='none'))
  env = alfworld.from_config(env_config, 'x')
  assert env.game_dir == '/shared' and env.step_labels == 'none'


def _official_copy(env, tmp_path):
  data = tmp_path / 'alfworld_data'
  shutil.copytree(os.path.join(env.game_dir, 'json_2.1.1', 'train'),
                  data / 'json_2.1.1' / 'train')
  trials = sorted((data / 'json_2.1.1' / 'train').glob('*/*'))
  return data, trials


def test_damaged_trials_are_reported_and_too_many_refuse_the_split(
    env, tmp_path, caplog):
  data, trials = _official_copy(env, tmp_path)
  assert len(trials) == 6
  # One damaged trial of 6: reported (named) and skipped.
  (trials[0] / games.TRAJ_FILE).write_text('[1, 2]')
  folder = alfworld.AlfWorldEnv(str(tmp_path / 'cache'), data_dir=str(data),
                                max_damaged_frac=0.2)
  with caplog.at_level('WARNING'):
    assert len(folder.tasks('train')) == 5
  name = os.path.relpath(trials[0], data / 'json_2.1.1')
  assert f'1 of 6 trials of train are damaged and skipped: {name} ' \
         f'(traj_data.json is not a JSON object)' in caplog.text
  assert len(folder.tasks('train')) == 5  # read once: the same list again
  # A truncated game file is damaged too; 2 of 6 is over the limit (a run
  # reads the folder when it starts).
  text = (trials[1] / games.GAME_FILE).read_text()
  (trials[1] / games.GAME_FILE).write_text(text[:len(text) // 2])
  folder = alfworld.AlfWorldEnv(str(tmp_path / 'cache'), data_dir=str(data),
                                max_damaged_frac=0.2)
  with pytest.raises(base.DataError, match=(
      r'2 of 6 trials of train are damaged, more than '
      r'env.max_damaged_frac=0.2: .*JSONDecodeError')):
    folder.tasks('train')
