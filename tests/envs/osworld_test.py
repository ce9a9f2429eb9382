"""OSWorld setting without a desktop: actions, retries, prompts, rewrites."""

from concurrent import futures
import io
import json
import os
import pickle
import sys
import types

import ml_collections
import pytest
from PIL import Image

from configs import osworld as osworld_config
from rla_jax import chat
from rla_jax import rollout
from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs.osworld import desktop
from rla_jax.envs.osworld import desktops
from rla_jax.envs.osworld import environment as osworld
from rla_jax.envs.osworld import evaluators
from rla_jax.envs.osworld import prompts


def call(action, **args):
  body = json.dumps({'name': 'computer_use',
                     'arguments': {'action': action, **args}})
  return f'I look.\nAction: do it.\n<tool_call>\n{body}\n</tool_call>'


def png(color, size=(64, 40)):
  out = io.BytesIO()
  Image.new('RGB', size, color).save(out, format='PNG')
  return out.getvalue()


def make_env(pool=None, **overrides):
  options = dict(max_turns=4, max_images=3, parse_retries=5,
                 retry_temperature=0.2, settle_s=0.0, image_max_pixels=0,
                 observation_chars=100, answer_prefix='', judge_prefix='',
                 max_critiques=2, max_instruction_chars=120,
                 history='canonical')
  options.update(overrides)
  return osworld.OSWorldEnv(osworld.load_tasks(osworld.TASK_DIR), pool=pool,
                            **options)


def test_task_set_covers_three_apps_with_evaluator_variants():
  tasks = osworld.load_tasks(osworld.TASK_DIR)
  assert len(tasks) >= 12
  apps = {app for t in tasks for app in t['related_apps']}
  assert apps == {'mousepad', 'zenity', 'xterm'}
  assert sum(len(t['evaluators']) >= 2 for t in tasks) >= 6
  for t in tasks:
    assert osworld.evaluator_name(t) in t['evaluators']


def test_bad_task_file_names_the_file(tmp_path):
  spec = osworld.load_tasks(osworld.TASK_DIR)[0]
  spec['evaluators']['exact'] = {'func': 'file_text', 'path': '~/x'}
  (tmp_path / 'broken.json').write_text(json.dumps(spec))
  with pytest.raises(ValueError, match=r'broken\.json.*lacks \[\'text\'\]'):
    osworld.load_tasks(str(tmp_path))
  (tmp_path / 'broken.json').write_text('{not json')
  with pytest.raises(ValueError, match=r'broken\.json: not JSON'):
    osworld.load_tasks(str(tmp_path))


@pytest.mark.parametrize('change, message', [
    (lambda s: s.update(config=['xterm']),
     r'config\[0\]: a step is an object with "type" one of'),
    (lambda s: s.update(config={'type': 'sleep'}), r'"config" is a list'),
    (lambda s: s['config'].append({'type': 'launch', 'parameters': {}}),
     r'config\[\d\]: launch needs a "command" \(a string or a list of '
     r'strings\); got None'),
    (lambda s: s['config'].append({'type': 'sleep',
                                   'parameters': {'seconds': 'two'}}),
     r'config\[\d\]: "seconds" is a number in \[0, 600\]; got \'two\''),
    (lambda s: s['config'].append({'type': 'execute', 'parameters': {
        'command': 'ls', 'shell': 'yes'}}),
     r'config\[\d\]: "shell" is true or false'),
    (lambda s: s['evaluators'].update(moved={'func': 'file_exists',
                                             'path': 3, 'exists': True}),
     r'evaluators\.moved: evaluator \'file_exists\': "path" must be str; '
     r'got 3'),
    (lambda s: s.update(network='yes'), r'"network" \(whether the task\'s '
     r'apps may reach the network; default false\) is true or false'),
])
def test_a_bad_task_step_is_named_at_load_time(tmp_path, change, message):
  spec = [t for t in osworld.load_tasks(osworld.TASK_DIR)
          if t['id'] == 'xterm-rename-file'][0]
  change(spec)
  (tmp_path / 'broken.json').write_text(json.dumps(spec))
  with pytest.raises(base.DataError, match=r'broken\.json: ' + message):
    osworld.load_tasks(str(tmp_path))


@pytest.mark.parametrize('response, reason', [
    ('no call at all', 'no <tool_call>'),
    ('<tool_call>{"name": computer_use}</tool_call>', 'not JSON'),
    ('<tool_call>{"name": "computer_use", "arguments": {</tool_call>',
     'unknown action None'),
    ('<tool_call>{"name": "browser", "arguments": {}}</tool_call>',
     'not {"name": "computer_use"'),
    (call('fly', coordinate=[1, 2]), "unknown action 'fly'"),
    (call('left_click'), "lacks \\['coordinate'\\]"),
    (call('left_click', coordinate=[1000, 5]), 'outside 0..999'),
    (call('left_click', coordinate=[-1, 5]), 'outside 0..999'),
    (call('left_click', coordinate=[5]), 'is not \\[x, y\\]'),
    (call('left_click', coordinate=[True, 5]), 'is not \\[x, y\\]'),
    (call('type', text=''), 'non-empty'),
    (call('key', keys=[]), 'list of key names'),
    (call('terminate', status='maybe'), 'success'),
])
def test_malformed_calls_are_unparseable_with_an_invalid_fallback(
    response, reason):
  env = make_env()
  with pytest.raises(base.Unparseable, match=reason) as info:
    env.parse_action(response, '')
  assert info.value.fallback.startswith(osworld.INVALID)


def test_actions_become_pyautogui_on_the_screen():
  env = make_env()
  action = env.parse_action(call('left_click', coordinate=[999, 0]), '')
  assert action.startswith('Action: do it.\n<tool_call>')
  assert prompts.arguments(action) == {'action': 'left_click',
                                       'coordinate': [999, 0]}
  code = lambda **a: prompts.pyautogui_code(a, 1920, 1080)  # noqa: E731
  assert code(action='left_click', coordinate=[999, 999]) == (
      "pyautogui.click(1919, 1079, button='left')")
  assert code(action='double_click', coordinate=[0, 0]) == (
      'pyautogui.doubleClick(0, 0)')
  assert code(action='key', keys=['ctrl', 's']) == (
      "pyautogui.hotkey('ctrl', 's')")
  assert code(action='type', text='a\nb') == (
      "pyautogui.write('a', interval=0.01); pyautogui.press(\"enter\"); "
      "pyautogui.write('b', interval=0.01)")
  assert code(action='terminate', status='success') == ''
  # An answer cut inside its call still parses (the prefix + coordinates).
  env = make_env(answer_prefix='<tool_call>\n{"name": "computer_use", '
                 '"arguments": {"action": "left_click", "coordinate": [')
  for answer in ('12, 40]}}', '12, 40]'):  # closed, or cut at ']'
    assert prompts.arguments(env.parse_action(answer, '')) == {
        'action': 'left_click', 'coordinate': [12, 40]}


class ScriptedEnv:
  """Episodes that record actions; answers parse when they say 'ok'."""

  max_turns = 2
  parse_retries = 2
  retry_temperature = 0.3

  def __init__(self):
    self.executed = []

  def make_episode(self, spec, seed, max_turns):
    env = self

    class Episode:
      def reset(self):
        return 'start'

      def step(self, action):
        env.executed.append(action)
        return 'next', True, -1.0

      def close(self):
        pass
    return Episode()

  def policy_messages(self, spec, turns, observation):
    return [{'role': 'user', 'content': spec['id']}]

  def parse_action(self, response, observation):
    if response != 'ok':
      raise base.Unparseable('not ok', f'INVALID {response}')
    return 'act'


def scripted_policy(answers, calls):
  def policy(messages, seed, min_temperature=0.0):
    calls.append((len(messages), min_temperature))
    return [chat.Completion(prompt='p', prompt_tokens=[1], text=answers[
        m[0]['content']].pop(0), tokens=[2], logprobs=[0.0],
                            finish_reason='stop') for m in messages]
  return policy


def test_rollout_retries_unparseable_turns_then_records_invalid():
  env, calls = ScriptedEnv(), []
  answers = {'a': ['bad', 'ok'], 'b': ['bad', 'bad', 'bad'], 'c': ['ok']}
  with futures.ThreadPoolExecutor(2) as pool:
    trajs = rollout.run(env, [(i, {'id': i}, 'active') for i in 'abc'],
                        group_size=1, policy=scripted_policy(answers, calls),
                        pool=pool, seed=0, max_turns=2)
  # First all three, then a and b again, then b alone; retries at >= 0.3.
  assert calls == [(3, 0.0), (2, 0.3), (1, 0.3)]
  steps = {t.task_id: t.steps[0] for t in trajs}
  assert (steps['a'].action, steps['a'].retries) == ('act', 1)
  assert (steps['b'].action, steps['b'].retries) == ('INVALID bad', 2)
  assert (steps['c'].action, steps['c'].retries) == ('act', 0)
  assert all(t.status == structs.OK for t in trajs)  # not an env error
  assert sorted(env.executed) == ['INVALID bad', 'act', 'act']


def test_observation_pickles_with_its_images():
  obs = base.Observation('after step 1', (b'png-now', b'png-before'))
  back = pickle.loads(pickle.dumps(obs))
  assert back == 'after step 1' and back.images == obs.images
  assert f'{back}' == 'after step 1'  # text consumers see text


def test_policy_prompt_keeps_three_screenshots_and_every_action():
  env = make_env()
  spec = env.tasks('train')[0]
  turns = [(base.Observation(f'o{k}', (png((k, 0, 0)),)), f'action {k}')
           for k in range(4)]
  now = base.Observation('now', (png((9, 9, 9)),))
  messages = env.policy_messages(spec, turns, now)
  images = chat.images_of(messages)
  assert len(images) == 3
  assert [i.getpixel((0, 0)) for i in images] == [(2, 0, 0), (3, 0, 0),
                                                  (9, 9, 9)]
  assert messages[0]['content'] == prompts.SYSTEM
  assert [m['content'] for m in messages if m['role'] == 'assistant'] == [
      'action 2', 'action 3']
  text = messages[-1]['content'][-1]['text']
  assert osworld.instruction(spec) in text
  assert 'Step 1: action 0' in text and 'Step 4: action 3' in text


def test_judge_sees_the_screenshot_before_and_after():
  env = make_env(judge_prefix='\\boxed{')
  spec = env.tasks('train')[0]
  policy_prompt = 'x\n' + prompts.INSTRUCTION.format(
      instruction='i', history='Step 1: clicked')
  after = base.Observation('after', (png((1, 1, 1)), png((2, 2, 2))))
  messages = env.judge_messages(spec, policy_prompt, 'my response', after)
  parts = messages[1]['content']
  images = [p['image'].getpixel((0, 0)) for p in parts
            if p['type'] == 'image']
  assert images == [(2, 2, 2), (1, 1, 1)]  # before, then after
  text = ''.join(p.get('text', '') for p in parts)
  assert 'Step 1: clicked' in text and 'my response' in text
  assert osworld.instruction(spec) in text and '\\boxed{}' in text
  assert messages[-1] == {'role': 'assistant', 'content': '\\boxed{'}


def request(spec, critiques=('clicked the wrong button',)):
  return base.RewriteRequest(spec=spec, root=spec, direction=structs.EASIER,
                             acc_old=0.0, critiques=list(critiques),
                             trajectories=[], judgments=[])


def test_rewrite_switches_evaluator_and_rejects_bad_proposals():
  env = make_env()
  spec = next(t for t in env.tasks('train') if t['id'] == 'zenity-entry-name')
  seen = []

  def generate(proposals):
    def answer(texts):
      seen.extend(texts)
      return proposals
    return answer

  ok = env.rewrite(request(spec), generate([
      'no json here', '{"nope": "x"}',
      json.dumps(spec['current_task']),  # unchanged
      'sure: {"any": "Type any name, then click OK."}']), attempts=4)
  assert ok['current_task'] == {'any': 'Type any name, then click OK.'}
  assert ok['instruction'] == 'Type any name, then click OK.'
  assert ok['root_id'] == spec['id'] and ok['id'] != spec['id']
  assert ok['evaluators'] == spec['evaluators']
  assert 'clicked the wrong button' in seen[0]  # critiques are in (B8)
  with pytest.raises(base.RewriteRejected,
                     match=r'1x no valid one-key JSON object; 1x unchanged'):
    env.rewrite(request(spec), generate([
        '{"exact": "' + 'x' * 500 + '"}',  # too long
        json.dumps(spec['current_task'])]), attempts=2)


def test_observation_screenshots_are_shrunk():
  big = png((5, 5, 5), size=(640, 400))
  small = Image.open(io.BytesIO(osworld._shrink(big, 160 * 100)))
  assert small.size[0] * small.size[1] <= 160 * 100
  assert osworld._shrink(big, 0) is big


def test_screen_text_names_windows_and_fields():
  xml = ('<desktop-frame><application name="zenity"><dialog name="Profile">'
         '<text st:editable="true" xmlns:st="s">Ada</text></dialog>'
         '</application></desktop-frame>')
  assert osworld._screen_text(xml, 100) == 'windows: Profile | text: Ada'
  assert osworld._screen_text('<broken', 100) == ''


class FakeDesktopEnv:
  """desktop_env.DesktopEnv's surface, as the 'vm' provider uses it."""

  instances = []

  def __init__(self, **kwargs):
    self.kwargs, self.tasks, self.closed = kwargs, [], False
    self.controller = types.SimpleNamespace(
        get_screenshot=lambda: png((7, 7, 7)),
        get_accessibility_tree=lambda: '<desktop-frame/>',
        execute_python_command=self.execute,
        get_vm_screen_size=lambda: {'width': 1920, 'height': 1080})
    self.executed, self.evaluator, self.scored = [], None, []
    FakeDesktopEnv.instances.append(self)

  def reset(self, task_config):
    self.tasks.append(task_config)
    self._set_evaluator_info(task_config)

  def _set_evaluator_info(self, task_config):
    self.evaluator = task_config['evaluator']

  def execute(self, code):
    self.executed.append(code)
    return {'status': 'success', 'output': '', 'error': '', 'returncode': 0}

  def evaluate(self):
    self.scored.append(self.evaluator)
    return 1.0 if self.executed else 0.0

  def close(self):
    self.closed = True


def fake_desktop_env(monkeypatch):
  module = types.ModuleType('desktop_env.desktop_env')
  module.DesktopEnv = FakeDesktopEnv
  monkeypatch.setitem(sys.modules, 'desktop_env',
                      types.ModuleType('desktop_env'))
  monkeypatch.setitem(sys.modules, 'desktop_env.desktop_env', module)


@pytest.mark.parametrize('history', osworld.HISTORIES)
def test_vm_provider_drives_desktop_env(monkeypatch, history):
  fake_desktop_env(monkeypatch)
  config = osworld_config.get_config('full')
  pool = desktops.Pool(desktops.vm_factory(config.env), 2, 5.0)
  env = make_env(pool=pool, history=history)
  spec = env.tasks('train')[0]
  episode = env.make_episode(spec, 0, max_turns=2)
  first = episode.reset()
  assert first.images and len(first.images) == 1
  obs, done, outcome = episode.step(
      env.parse_action(call('left_click', coordinate=[500, 500]), first))
  assert (done, outcome) == (False, None) and len(obs.images) == 2
  obs, done, outcome = episode.step(
      env.parse_action(call('terminate', status='success'), obs))
  assert (done, outcome) == (True, 1.0)
  vm = FakeDesktopEnv.instances[-1]
  assert vm.executed == ["pyautogui.click(960, 540, button='left')"]
  assert vm.tasks[0]['instruction'] == osworld.instruction(spec)
  assert vm.kwargs['provider_name'] == 'docker'
  episode.close()
  pool.close()
  assert vm.closed


def test_vm_resets_and_scores_the_evaluator_current_task_names(monkeypatch):
  """A rewrite that switches to another evaluator key (issue 32.2)."""
  fake_desktop_env(monkeypatch)
  pool = desktops.Pool(desktops.vm_factory(osworld_config.get_config().env),
                       1, 5.0)
  spec = next(t for t in osworld.load_tasks(osworld.TASK_DIR)
              if len(t['evaluators']) >= 2)
  first, second = list(spec['evaluators'])[:2]
  assert spec['evaluators'][first] != spec['evaluators'][second]
  spec = osworld.OSWorldEnv._derive(spec, second, 'Do the second thing.')
  vm = pool.acquire()
  vm.start_task(spec)
  fake = FakeDesktopEnv.instances[-1]
  assert fake.tasks[-1]['evaluator'] == spec['evaluators'][second]
  assert fake.tasks[-1]['instruction'] == 'Do the second thing.'
  assert not {'evaluators', 'task_template', 'current_task'} & set(
      fake.tasks[-1])
  vm.evaluate(spec, osworld.evaluator_name(spec))
  assert fake.scored == [spec['evaluators'][second]]
  vm.evaluate(spec, first)  # another key: DesktopEnv is pointed at it
  assert fake.scored[-1] == spec['evaluators'][first]
  plain = {'id': 'p', 'instruction': 'i', 'evaluator': {'func': 'x'},
           'current_task': {'default': 'i'}, 'task_template': {'default': 'i'}}
  vm.start_task(plain)  # an OSWorld task of one evaluator keeps its own
  assert fake.tasks[-1]['evaluator'] == {'func': 'x'}
  pool.close()


class FakeClient:
  """desktop.Client.execute with one canned answer."""

  def __init__(self, answer):
    self.answer = answer

  def execute(self, command, shell=False, timeout=None):
    del command, shell, timeout
    return self.answer


def test_command_output_that_could_not_run_is_a_desktop_error():
  """Not the agent's failure: the trajectory is an environment error."""
  check = {'func': 'command_output', 'command': 'cat ~/x', 'text': 'hi'}
  for answer in ({'status': 'error', 'output': '', 'error': 'no such shell',
                  'returncode': None},
                 {'status': 'error', 'output': '', 'error': '',
                  'message': 'command timed out after 30 s and was killed',
                  'returncode': -9}):
    with pytest.raises(desktop.DesktopError, match='could not run'):
      evaluators.evaluate(FakeClient(answer), check)
  ran = {'status': 'success', 'error': 'cat: ~/x: missing', 'returncode': 1}
  assert not evaluators.evaluate(FakeClient(dict(ran, output='')), check)
  assert evaluators.evaluate(FakeClient(dict(ran, output='hi\n')), check)


def test_history_switch_shows_full_responses_or_canonical_actions():
  """'full': the agent's earlier responses as assistant turns (the
  authors'); 'canonical' (the default): the actions they parsed to."""
  assert osworld_config.get_config().env.history == 'canonical'
  assert osworld_config.get_config('smoke').env.history == 'canonical'
  now = base.Observation('now', (png((9, 9, 9)),))
  responses = [f'I think {k}.\n' + call('left_click', coordinate=[k, k])
               for k in range(3)]
  shown = {}
  for history in osworld.HISTORIES:
    env = make_env(history=history)
    spec = env.tasks('train')[0]
    turns = [(now, env.parse_action(r, now)) for r in responses]
    messages = env.policy_messages(spec, turns, now)
    shown[history] = [m['content'] for m in messages
                      if m['role'] == 'assistant']
    text = messages[-1]['content'][-1]['text']
    assert ('Step 3: do it. {"action": "left_click", "coordinate": [2, 2]}'
            in text)  # the text list of actions is compact either way
  assert shown['full'] == responses[1:]
  assert shown['canonical'] == [
      prompts.canonical('do it.', {'action': 'left_click',
                                   'coordinate': [k, k]}) for k in (1, 2)]
  with pytest.raises(ValueError, match='history'):
    make_env(history='thoughts')


def test_judge_sees_the_answer_prefix():
  """The RM reads the whole answer, prefix included, as AlfWorld's."""
  prefix = 'Action: click.\n<tool_call>\n{"name": "computer_use", '
  env = make_env(answer_prefix=prefix)
  after = base.Observation('after', (png((1, 1, 1)), png((2, 2, 2))))
  rest = '"arguments": {"action": "left_click", "coordinate": [1, 2]}}'
  messages = env.judge_messages(env.tasks('train')[0], '', rest, after)
  text = ''.join(p.get('text', '') for p in messages[1]['content'])
  assert prefix + rest in text
  messages = env.judge_messages(env.tasks('train')[0], '', prefix + rest,
                                after)  # a response that repeats it
  text = ''.join(p.get('text', '') for p in messages[1]['content'])
  assert prefix + rest in text and prefix + prefix not in text


def test_smoke_config_validates():
  config = osworld_config.get_config('smoke,policy')
  assert config.env.name == 'osworld' and not config.loop.train_rm
  assert config.policy.random.model_type == 'qwen3_vl'
  assert os.path.isdir(osworld.TASK_DIR)
  assert isinstance(config.env.vm, ml_collections.ConfigDict)


def test_history_is_compact_and_the_judge_sees_a_clipped_answer():
  action = prompts.canonical('Click OK.', {'action': 'left_click',
                                           'coordinate': [1, 2]})
  assert prompts.history([action, 'INVALID ACTION: no call']) == (
      'Step 1: Click OK. {"action": "left_click", "coordinate": [1, 2]}\n'
      'Step 2: INVALID ACTION: no call')
  assert prompts.clip_middle('a' * 10 + 'b' * 10, 10) == (
      'aaaaa\n[... 10 characters ...]\nbbbbb')
  env = make_env(judge_response_chars=40)
  after = base.Observation('after', (png((1, 1, 1)), png((2, 2, 2))))
  messages = env.judge_messages(env.tasks('train')[0], '', 'x' * 500 +
                                'the action', after)
  text = ''.join(p.get('text', '') for p in messages[1]['content'])
  assert 'the action' in text and 'x' * 30 not in text
