"""TextWorld setting: games, episodes, prompts, parsing and rewrites."""

from concurrent import futures
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base
from rla_jax.envs.textworld import environment as tw
from rla_jax.envs.textworld import text as twtext
from conftest import fake_generate  # pylint: disable=g-bad-import-order

try:
  import textworld  # pylint: disable=unused-import
  HAVE_TEXTWORLD = True
except ImportError:
  HAVE_TEXTWORLD = False
# jericho's "not fully supported" warning is expected for TextWorld games.
pytestmark = pytest.mark.filterwarnings('ignore:Game .* is not fully supported')
needs_textworld = pytest.mark.skipif(
    not HAVE_TEXTWORLD,
    reason='textworld is not installed (pip install textworld)')

EASY = {'id': 'easy', 'root_id': 'easy', 'seed': 7, 'nb_rooms': 1,
        'nb_objects': 2, 'quest_length': 1}
TWO = {'id': 'two', 'root_id': 'two', 'seed': 3, 'nb_rooms': 2,
       'nb_objects': 3, 'quest_length': 2}
OBS = twtext.render_observation('-= Kitchen =-\nA fridge.',
                            ['go north', 'look', 'take apple',
                             'take apple from fridge'])


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  return tw.TextWorldEnv(str(tmp_path_factory.mktemp('games')), max_turns=4)


def request(spec, direction, critiques=(), acc=0.5):
  return base.RewriteRequest(spec=spec, root=spec, direction=direction,
                             acc_old=acc, critiques=list(critiques),
                             trajectories=[], judgments=[])


# Pure helpers (no textworld needed).


def test_observation_round_trip():
  text, commands = twtext.split_observation(OBS)
  assert text == '-= Kitchen =-\nA fridge.'
  assert commands == ['go north', 'look', 'take apple',
                      'take apple from fridge']
  assert twtext.split_observation('no list here') == ('no list here', [])


@pytest.mark.parametrize('text,want', [
    ('The best action is \\boxed{3}', ('take apple', True)),
    ('I think 1. \\boxed{1} no wait \\boxed{2}}', ('look', True)),
    ('The best action is \\boxed{4', ('take apple from fridge', True)),
    ('\\boxed{action 1}', ('go north', True)),
    ('The best action is \\boxed{take apple from fridge}',
     ('take apple from fridge', True)),
    ('I will go north now.', ('go north', True)),
    ('Go north, then LOOK', ('look', True)),
    ('\\boxed{9} is out of range', ('go north', False)),
    ('\\boxed{ Take Apple. }', ('take apple', True)),
    ('overlooking everything', ('go north', False)),
    ('', ('go north', False)),
])
def test_choose(text, want):
  assert twtext.choose(text, twtext.split_observation(OBS)[1]) == want


def test_choose_prefers_an_exact_action_text_over_its_digits():
  commands = ['look', 'open safe', 'take type 3 keycard']
  assert twtext.choose('\\boxed{take type 3 keycard}', commands) == (
      'take type 3 keycard', True)
  assert twtext.choose('\\boxed{3}', commands) == ('take type 3 keycard', True)
  assert twtext.choose('\\boxed{2}', commands) == ('open safe', True)


def test_parse_action_adds_the_answer_prefix(tmp_path):
  env = tw.TextWorldEnv(str(tmp_path))
  assert env.parse_action('3}. Taking the apple.', OBS) == 'take apple'
  assert env.parse_action('The best action is \\boxed{2}', OBS) == 'look'
  assert env.parse_action_checked('hmm', OBS) == ('go north', False)
  assert env.parse_action_checked('look around', OBS) == ('look', True)


def test_parse_knobs_and_checks(tmp_path):
  env = tw.TextWorldEnv(str(tmp_path), max_knobs=(6, 12, 6))
  assert twtext.parse_knobs('so \\boxed{2, 4, 3}') == (2, 4, 3)
  assert twtext.parse_knobs('\\boxed{rooms=2, objects=4, quest_length=3}') == (
      2, 4, 3)
  assert twtext.parse_knobs('\\boxed{2, 4}') is None
  assert twtext.parse_knobs('I pick (2, 4, 3).') == (2, 4, 3)  # box dropped
  assert twtext.parse_knobs('1,2,3,4,5') is None
  assert twtext.parse_knobs('no numbers') is None
  assert env.check_knobs((2, 4, 2), (2, 5, 3), structs.HARDER) is None
  assert env.check_knobs((2, 4, 2), (1, 5, 3), structs.HARDER) == (
      'wrong direction')
  assert env.check_knobs((2, 4, 2), (2, 4, 2), structs.HARDER) == (
      'wrong direction')
  assert env.check_knobs((2, 4, 2), (2, 4, 1), structs.EASIER) is None
  assert env.check_knobs((2, 4, 2), (2, 4, 7), structs.HARDER) == (
      'out of bounds')
  assert env.check_knobs((1, 1, 1), (1, 0, 1), structs.EASIER) == (
      'out of bounds')


def test_tasks_are_deterministic_and_mixed(tmp_path):
  env = tw.TextWorldEnv(str(tmp_path), num_train=12, num_eval=6,
                        quest_length=(1, 3), nb_rooms=(1, 2))
  train, again = env.tasks('train'), env.tasks('train')
  assert train == again
  assert len(train) == 12 and len(env.tasks('eval')) == 6
  assert len({s['id'] for s in train + env.tasks('eval')}) == 18
  assert sorted({s['quest_length'] for s in train}) == [1, 2, 3]
  assert all(1 <= s['nb_rooms'] <= 2 for s in train)
  assert {s['seed'] for s in train}.isdisjoint(
      {s['seed'] for s in env.tasks('eval')})
  json.dumps(train)  # JSON-able
  with pytest.raises(ValueError):
    env.tasks('test')
  with pytest.raises(ValueError):
    tw.TextWorldEnv(str(tmp_path), answer_format='json')
  assert env.difficulty(TWO) > env.difficulty(EASY)


def test_clean_text_drops_status_line_and_menu():
  raw = ('\nYou unlock the box.\n\n\n\n      *** The End ***\n\nWould you '
         'like to RESTART, RESTORE a saved game?\n>      -= Room =-0/3')
  assert twtext.clean_text(raw) == 'You unlock the box.\n\n*** The End ***'


def test_clean_text_drops_textworld_filler():
  assert twtext.clean_text('Welcome to TextWorld! Rest the bug on the pan.') == (
      'Rest the bug on the pan.')
  assert twtext.clean_text(
      'You see a dresser. Wow, isn\'t TextWorld just the best? It is open.'
  ) == 'You see a dresser. It is open.'


@needs_textworld
def test_judge_messages(env):
  policy_prompt = ('<|im_start|>user\nTask: take the apple.\n\nYour actions '
                   'so far: look; go north\n\nCurrent observation:\n'
                   f'{OBS}\n\nChoose the action that brings you closest to '
                   'the task and write it.<|im_end|>\n'
                   '<|im_start|>assistant\nThe best action is \\boxed{')
  messages = env.judge_messages(EASY, policy_prompt, 'take apple}',
                                'You take the apple.\n\nAdmissible actions:'
                                '\n1. look')
  assert [m['role'] for m in messages] == ['system', 'user', 'assistant']
  content = messages[1]['content']
  objective = twtext.clean_text(env.game(EASY)['objective'])
  assert content.startswith(f'Task: {objective}\n')  # from the spec's game
  assert 'Your actions so far: look; go north\n' in content
  assert 'Observation:\n-= Kitchen =-\nA fridge.\n' in content
  assert 'Admissible actions' not in content  # lists are left out
  assert "Agent's answer" not in content  # it says no more than the action
  assert 'Executed action: take apple\n' in content
  assert 'Next observation:\nYou take the apple.\n' in content
  assert '\\boxed{1}' in content and '\\boxed{-1}' in content
  assert messages[2]['content'] == 'Score: \\boxed{'
  messages = env.judge_messages(EASY, policy_prompt, 'no idea', 'Huh?')
  assert 'the first one was executed' in messages[1]['content']
  # Reasoning before the box is shown to the RM (clipped in the middle).
  thought = 'The apple is in the fridge, so ' + 'x' * 900
  content = env.judge_messages(EASY, policy_prompt,
                               f'{thought} \\boxed{{take apple}}',
                               'ok')[1]['content']
  answer = content[content.index("Agent's answer: "):].split('\n')[0]
  assert 'The apple is in the fridge' in answer and ' ... ' in answer
  assert len(answer) < 650
  env.judge_prefix = ''
  try:
    assert len(env.judge_messages(EASY, policy_prompt, '3}', 'ok')) == 2
  finally:
    env.judge_prefix = 'Score: \\boxed{'


def test_from_config(tmp_path):
  env_config = ml_collections.ConfigDict(dict(
      name='textworld', game_dir='', max_turns=6, num_train=4, num_eval=2,
      seed=1, nb_rooms=(1, 2), nb_objects=(2, 4), quest_length=(1, 2),
      max_knobs=(5, 10, 5), max_history=3, history='actions',
      answer_format='text',
      answer_prefix='A: \\boxed{',
      judge_prefix='', rewrite_prefix='', max_critiques=4, gen_tries=2))
  env = tw.from_config(env_config, str(tmp_path))
  assert env.game_dir == str(tmp_path / 'games')
  assert env.max_turns == 6 and len(env.tasks('train')) == 4
  assert env.max_knobs == (5, 10, 5) and env.answer_prefix == 'A: \\boxed{'
  assert env.history == 'actions'
  with pytest.raises(ValueError, match='history'):
    tw.TextWorldEnv(str(tmp_path), history='all')
  assert env.answer_format == 'text'
  env_config.game_dir = str(tmp_path / 'shared')
  assert tw.from_config(env_config, 'x').game_dir == str(tmp_path / 'shared')


# Games and episodes (need textworld).


@needs_textworld
def test_generation_is_deterministic_and_cached(env, tmp_path):
  meta = env.game(EASY)
  assert os.path.exists(meta['path'])
  assert len(meta['walkthrough']) == EASY['quest_length']
  assert meta['objective']
  assert env.game(dict(EASY, id='other id')) is meta  # key ignores the id
  # A fresh env on the same cache reads the game without generating it.
  cached = tw.TextWorldEnv(env.game_dir)
  cached._generate = None  # pylint: disable=protected-access
  assert cached.game(EASY)['walkthrough'] == meta['walkthrough']
  # Another process (other hash seed, empty cache) makes the same game.
  code = ('import json, sys; from rla_jax.envs import textworld as tw; '
          f'm = tw.TextWorldEnv(sys.argv[1]).game({EASY!r}); '
          'print(json.dumps(m))')
  out = subprocess.run(
      [sys.executable, '-c', code, str(tmp_path)], check=True,
      capture_output=True, text=True,
      env=dict(os.environ, PYTHONHASHSEED='123')).stdout
  other = json.loads(out.strip().splitlines()[-1])
  assert other['walkthrough'] == meta['walkthrough']
  assert other['objective'] == meta['objective']
  with open(meta['path'], 'rb') as f, open(other['path'], 'rb') as g:
    assert f.read() == g.read()
  assert not [n for n in os.listdir(env.game_dir) if n.startswith('.')]


@needs_textworld
def test_walkthrough_wins(env):
  episode = env.make_episode(TWO, seed=0, max_turns=env.max_turns)
  obs = episode.reset()
  commands = twtext.split_observation(obs)[1]
  walkthrough = env.game(TWO)['walkthrough']
  assert len(walkthrough) == 2 and walkthrough[0] in commands
  results = [episode.step(c) for c in walkthrough]
  episode.close()
  assert [r[1:] for r in results] == [(False, None), (True, 1.0)]
  assert episode.info['step_labels'] == [1, 1]  # the expert's own actions
  assert 'The End' in results[-1][0]
  with pytest.raises(RuntimeError):
    episode.step('look')


@needs_textworld
def test_out_of_turns_loses(env):
  episode = env.make_episode(TWO, seed=0, max_turns=env.max_turns)
  episode.reset()
  results = [episode.step('look') for _ in range(env.max_turns)]
  episode.close()
  assert episode.info['step_labels'] == [-1] * env.max_turns  # no progress
  assert [r[1:] for r in results[:-1]] == [(False, None)] * 3
  assert results[-1][1:] == (True, -1.0)
  # Undoing progress is not progress: drop the key the quest needs.
  episode = env.make_episode(TWO, seed=0, max_turns=5)
  episode.reset()
  for command in ('take latchkey', 'drop latchkey', 'take latchkey',
                  'unlock safe with latchkey'):
    episode.step(command)
  episode.close()
  assert episode.info['step_labels'] == [1, -1, 1, 1]
  # Evaluation may give episodes another turn budget.
  episode = env.make_episode(TWO, seed=0, max_turns=2)
  episode.reset()
  assert [episode.step('look')[1] for _ in range(2)] == [False, True]
  episode.close()


@needs_textworld
def test_policy_messages(env):
  episode = env.make_episode(TWO, seed=0, max_turns=env.max_turns)
  first = episode.reset()
  action = env.game(TWO)['walkthrough'][0]
  second, _, _ = episode.step(action)
  episode.close()
  messages = env.policy_messages(TWO, [(first, action)], second)
  assert [m['role'] for m in messages] == ['system', 'user', 'assistant']
  assert messages[2]['content'] == 'The best action is \\boxed{'
  assert 'text adventure game' in messages[0]['content']
  content = messages[1]['content']
  assert twtext.clean_text(env.game(TWO)['objective']) in content
  assert f'Action: {action}' in content
  assert content.count(twtext.split_observation(first)[0]) == 1  # history text
  assert content.count('Admissible actions:') == 1  # only the current list
  # The history is the part a too-long prompt may lose; the task, the
  # current observation and the instruction are not.
  history = content[content.index(truncation.CUT_BEGIN):
                    content.index(truncation.CUT_END)]
  assert f'Action: {action}' in history and 'Task:' not in history
  assert 'Current observation' not in history
  for i, command in enumerate(twtext.split_observation(second)[1], 1):
    assert f'{i}. {command}' in content
  assert 'chosen action inside \\boxed{}, exactly as listed' in content
  assert 'for example' not in content  # SmolLM2 copies example answers
  env.answer_format = 'index'
  content = env.policy_messages(TWO, [], second)[1]['content']
  assert 'number of the chosen action in \\boxed{}' in content
  env.answer_format = 'text'
  env.max_history = 0
  assert 'Previous steps' not in env.policy_messages(
      TWO, [(first, action)], second)[1]['content']
  # history='actions': one line of the earlier actions, no observations.
  env.max_history, env.history = 4, 'actions'
  content = env.policy_messages(TWO, [(first, action), (second, 'look')],
                                second)[1]['content']
  assert f'Your actions so far: {action}; look\n' in truncation.plain(content)
  assert 'Observation:' not in content
  assert content.count(twtext.split_observation(first)[0]) == 0
  env.history = 'observations'
  # What the policy answers in that prompt maps back to an admissible action.
  assert env.parse_action('1}', second) == twtext.split_observation(second)[1][0]


@needs_textworld
def test_rewrite_accepts_first_valid_proposal(env):
  generate, prompts = fake_generate([
      'no numbers here', '\\boxed{1, 1, 1}', '\\boxed{2, 3, 9}',
      'Longer quest: \\boxed{2, 3, 3}', '\\boxed{3, 4, 4}'])
  critiques = ['The agent kept looking around.', 'It never opened the door.']
  new = env.rewrite(request(TWO, structs.HARDER, critiques, acc=0.875),
                    generate, attempts=5)
  assert tw.knobs(new) == (2, 3, 3)
  assert new['root_id'] == 'two' and new['version'] == 1
  assert new['id'].startswith('two.v1-') and new['seed'] == TWO['seed']
  assert env.game(new)['walkthrough']  # smoke-tested and cached
  assert len(prompts) == 5
  for i, prompt in enumerate(prompts, 1):
    assert prompt.rstrip().endswith(f'(Attempt {i}/5)')
    assert all(c in prompt for c in critiques)
    assert 'HARDER' in prompt and '88%' in prompt
    assert '2 rooms, 3 objects, quest_length 2' in prompt
    assert 'written as \\boxed{2, 3, 2}' in prompt


@needs_textworld
def test_rewrite_easier_with_prefix(env):
  env.rewrite_prefix = 'New numbers: \\boxed{'
  generate, prompts = fake_generate(['1, 3, 1}'])
  try:
    new = env.rewrite(request(TWO, structs.EASIER), generate, attempts=1)
  finally:
    env.rewrite_prefix = ''
  assert tw.knobs(new) == (1, 3, 1)
  assert prompts[0].endswith('(Attempt 1/1)\nNew numbers: \\boxed{')
  assert 'EASIER' in prompts[0] and '(none)' in prompts[0]


@needs_textworld
def test_rewrite_rejects_invalid_proposals(env):
  generate, prompts = fake_generate(
      ['\\boxed{1, 2, 1}', '\\boxed{2, 3, 2}', 'nothing', '\\boxed{7, 3, 2}'])
  with pytest.raises(base.RewriteRejected, match='wrong direction'):
    env.rewrite(request(TWO, structs.HARDER, ['It got lost.']), generate,
                attempts=4)
  assert all('It got lost.' in p for p in prompts)
  with pytest.raises(base.RewriteRejected, match='no completions'):
    env.rewrite(request(TWO, structs.EASIER), fake_generate([])[0],
                attempts=2)


@needs_textworld
def test_concurrent_episodes(env):
  specs = [EASY, TWO] * 3

  def play(spec):
    episode = env.make_episode(spec, seed=0, max_turns=env.max_turns)
    try:
      episode.reset()
      outcome = None
      for command in env.game(spec)['walkthrough']:
        _, done, outcome = episode.step(command)
      return done, outcome
    finally:
      episode.close()

  with futures.ThreadPoolExecutor(4) as pool:
    assert list(pool.map(play, specs)) == [(True, 1.0)] * len(specs)
