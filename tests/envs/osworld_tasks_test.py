"""OSWorld task files in OSWorld's own format, for provider 'vm' (issue 32.2).

The authors' tasks (an OSWorld task JSON with evaluators keyed by name,
`task_template` and `current_task`) load for OSWorld's DesktopEnv, which
resets and scores the evaluator `current_task` names; local desktops refuse
them with one line.
"""

import copy
import json

import pytest

from configs import osworld as osworld_config
from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs.osworld import desktops
from rla_jax.envs.osworld import environment as osworld
from rla_jax.envs.osworld import task_formats
from tests.envs.osworld_test import FakeDesktopEnv
from tests.envs.osworld_test import call
from tests.envs.osworld_test import fake_desktop_env

XLSX = '/home/user/Sales.xlsx'
CACHE = 'https://example.org/cache/sales'


def save_steps():
  """An evaluator's postconfig: save the sheet before it is read."""
  return [{'type': 'activate_window',
           'parameters': {'window_name': 'Sales.xlsx - LibreOffice Calc',
                          'strict': True}},
          {'type': 'execute', 'parameters': {'command': [
              'python', '-c',
              'import pyautogui; pyautogui.hotkey("ctrl", "s")']}},
          {'type': 'sleep', 'parameters': {'seconds': 0.5}}]


def authors_task():
  """An authors'-format task: two evaluators, OSWorld's set-up steps."""
  template = {
      'compare': 'Fill the blank cells of B1:E30 with the value above.',
      'totals': 'Add a row "Total" under the table.',
  }
  return {
      'id': '01b269ae-sales',
      'snapshot': 'libreoffice_calc',
      'instruction': template['compare'],
      'source': 'https://example.org',
      'config': [
          {'type': 'download', 'parameters': {'files': [
              {'url': f'{CACHE}/Sales.xlsx', 'path': XLSX}]}},
          {'type': 'open', 'parameters': {'path': XLSX}},
          {'type': 'launch', 'parameters': {'command': ['nautilus']}},
      ],
      'related_apps': ['libreoffice calc'],
      'evaluators': {
          'compare': {
              'postconfig': save_steps(),
              'func': 'compare_table',
              'result': {'type': 'vm_file', 'path': XLSX,
                         'dest': 'Sales.xlsx'},
              'expected': {'type': 'cloud_file',
                           'path': f'{CACHE}/Sales_gold.xlsx',
                           'dest': 'Sales_gold.xlsx'},
              'options': {'rules': [{'type': 'sheet_data', 'sheet_idx0': 0,
                                     'sheet_idx1': 'EI0'}]},
          },
          'totals': {
              'postconfig': save_steps(),
              'func': ['compare_table', 'check_include_exclude'],
              'conj': 'and',
              'result': [{'type': 'vm_file', 'path': XLSX, 'dest': 'S.xlsx'},
                         {'type': 'vm_command_line',
                          'command': ['ls', '/home/user']}],
              'expected': [{'type': 'cloud_file',
                            'path': f'{CACHE}/Sales_total.xlsx',
                            'dest': 'Sales_total.xlsx'},
                           {'type': 'rule',
                            'rules': {'include': ['Sales.xlsx'],
                                      'exclude': []}}],
              'options': [{}, None],
          },
      },
      'task_template': template,
      'current_task': {'compare': template['compare']},
  }


def write(tmp_path, spec):
  (tmp_path / 'task.json').write_text(json.dumps(spec))
  return str(tmp_path)


def refusal(tmp_path, spec, provider):
  """The one-line DataError that loading `spec` for `provider` raises."""
  with pytest.raises(base.DataError) as raised:
    osworld.load_tasks(write(tmp_path, spec), provider)
  message = str(raised.value)
  assert '\n' not in message and message.startswith(
      str(tmp_path / 'task.json') + ': ')
  return message[len(str(tmp_path / 'task.json')) + 2:]


def test_authors_task_loads_for_vm_and_is_refused_locally(tmp_path):
  spec = authors_task()
  [loaded] = osworld.load_tasks(write(tmp_path, spec), 'vm')
  assert loaded['evaluators'] == spec['evaluators']
  assert loaded['config'] == spec['config']
  assert osworld.evaluator_name(loaded) == 'compare'
  assert refusal(tmp_path, spec, 'local') == (
      'evaluators.compare: an OSWorld metric evaluator (getters "result" / '
      '"expected"): its task needs config.env.provider=\'vm\'')


def test_local_desktops_refuse_osworld_tasks_and_set_up_steps(tmp_path):
  plain = {'id': 'p', 'instruction': 'Do it.', 'evaluator': {
      'func': 'exact_match', 'result': {'type': 'vm_command_line',
                                        'command': 'ls'},
      'expected': {'type': 'rule', 'rules': {'expected': 'x'}}}}
  assert refusal(tmp_path, plain, 'local') == (
      'an OSWorld task ("evaluator", no "evaluators"): needs '
      'config.env.provider=\'vm\'')
  local = next(t for t in osworld.load_tasks(osworld.TASK_DIR, 'local')
               if t['id'] == 'xterm-rename-file')
  local['config'].insert(0, {'type': 'download', 'parameters': {}})
  assert refusal(tmp_path, local, 'local') == (
      'config[0]: \'download\' is an OSWorld set-up step: its task needs '
      'config.env.provider=\'vm\'')


def test_osworld_benchmark_task_still_loads_for_vm(tmp_path):
  plain = {'id': 'p', 'instruction': 'Do it.', 'config': [
      {'type': 'chrome_open_tabs', 'parameters': {'urls_to_open': ['x']}}],
           'evaluator': {'func': 'infeasible'}}
  [loaded] = osworld.load_tasks(write(tmp_path, plain), 'vm')
  assert loaded['current_task'] == {'default': 'Do it.'}
  assert desktops.vm_task(loaded)['evaluator'] == {'func': 'infeasible'}


def test_authors_released_evaluator_list_is_read_as_evaluators(tmp_path):
  """Their files carry the original `evaluator` and `evaluator_list`."""
  spec = authors_task()
  spec['evaluator_list'] = spec.pop('evaluators')
  spec['evaluator'] = copy.deepcopy(spec['evaluator_list']['compare'])
  [loaded] = osworld.load_tasks(write(tmp_path, spec), 'vm')
  assert 'evaluator_list' not in loaded
  assert loaded['evaluators'] == spec['evaluator_list']
  switched = osworld.OSWorldEnv._derive(loaded, 'totals', 'Add totals.')
  assert desktops.vm_task(switched)['evaluator'] == (
      spec['evaluator_list']['totals'])
  spec['evaluators'] = spec['evaluator_list']
  assert refusal(tmp_path, spec, 'vm') == (
      'both "evaluators" and "evaluator_list" (the same map, by the '
      'authors\' name): keep one')


def _set(path, value):
  """A change to the authors' task: the key at `path` set to `value`."""
  def change(spec):
    *keys, last = path
    for key in keys:
      spec = spec[key]
    spec[last] = value
  return change


def _drop(path):
  def change(spec):
    *keys, last = path
    for key in keys:
      spec = spec[key]
    del spec[last]
  return change


OPEN = ('config', 1)
COMPARE = ('evaluators', 'compare')
TOTALS = ('evaluators', 'totals')


@pytest.mark.parametrize('change, message', [
    (_drop(COMPARE + ('result', 'type')),
     'evaluators.compare.result: needs a string "type" (a getter object); '
     "got {'path': '/home/user/Sales.xlsx', 'dest': 'Sales.xlsx'}"),
    (_set(COMPARE + ('expected',), 'cloud_file'),
     'evaluators.compare.expected: needs a string "type" (a getter object); '
     "got 'cloud_file'"),
    (_drop(COMPARE + ('result',)),
     'evaluators.compare: needs a getter "result" (only \'infeasible\' has '
     'none)'),
    (_set(COMPARE + ('func',), ['compare_table', 7]),
     "evaluators.compare.func: a metric name or a non-empty list of them; "
     "got ['compare_table', 7]"),
    (_set(COMPARE + ('options',), ['rules']),
     "evaluators.compare.options: an object of the metric's options; got "
     "['rules']"),
    (_set(TOTALS + ('result',), {'type': 'vm_file'}),
     'evaluators.totals.result: a list of 2 (one per "func" metric); got '
     "{'type': 'vm_file'}"),
    (_set(TOTALS + ('expected', 1), {'rules': {}}),
     'evaluators.totals.expected[1]: needs a string "type" (a getter '
     "object); got {'rules': {}}"),
    (_set(TOTALS + ('conj',), 'xor'),
     "evaluators.totals.conj: one of ('and', 'or'); got 'xor'"),
    (_set(TOTALS + ('postconfig', 0, 'type'), 'press_keys'),
     'evaluators.totals.postconfig[0]: a step is an object with "type" one '
     "of OSWorld's " + str(task_formats.SETUP_STEPS) + '; got '),
    (_set(COMPARE + ('postconfig',), {'type': 'sleep'}),
     "evaluators.compare.postconfig: a list of set-up steps; got {'type': "
     "'sleep'}"),
    (_set(COMPARE, 'compare_table'),
     'evaluators.compare: an OSWorld evaluator is an object with "func"; '
     "got 'compare_table'"),
    (_drop(OPEN + ('parameters',)),
     'config[1]: needs an object "parameters" (the arguments of '
     '_open_setup)'),
    (_set(OPEN + ('type',), 'open_file'),
     'config[1]: a step is an object with "type" one of OSWorld\'s '),
    (_set(('config',), {'type': 'open'}),
     "config: a list of set-up steps; got {'type': 'open'}"),
])
def test_a_malformed_vm_task_is_named_in_one_line(tmp_path, change, message):
  spec = authors_task()
  change(spec)
  assert refusal(tmp_path, spec, 'vm').startswith(message)


def test_a_malformed_benchmark_evaluator_is_named(tmp_path):
  plain = {'id': 'p', 'instruction': 'Do it.',
           'evaluator': {'func': 'exact_match', 'result': {'command': 'ls'}}}
  assert refusal(tmp_path, plain, 'vm').startswith(
      'evaluator.result: needs a string "type"')


def test_vm_runs_and_scores_the_evaluator_a_rewrite_switched_to(
    monkeypatch, tmp_path):
  """from_config -> load -> rewrite to the second key -> DesktopEnv."""
  fake_desktop_env(monkeypatch)
  config = osworld_config.get_config()
  config.env.update(provider='vm', task_dir=write(tmp_path, authors_task()),
                    max_desktops=1, settle_s=0.0)
  env = osworld.from_config(config.env, str(tmp_path))
  [spec] = env.tasks('train')
  request = base.RewriteRequest(spec=spec, root=spec,
                                direction=structs.EASIER, acc_old=0.0,
                                critiques=[], trajectories=[], judgments=[])
  switched = env.rewrite(request, lambda texts: [
      '{"totals": "Add a row Total under the table."}'] * len(texts),
                         attempts=1)
  totals = spec['evaluators']['totals']
  task = desktops.vm_task(switched)
  assert (task['evaluator'], task['instruction']) == (
      totals, 'Add a row Total under the table.')
  assert task['config'] == spec['config']
  episode = env.make_episode(switched, 0, max_turns=2)
  episode.reset()
  fake = FakeDesktopEnv.instances[-1]
  assert fake.tasks == [task]
  _, done, outcome = episode.step(env.parse_action(
      call('terminate', status='success'), None))
  assert (done, outcome) == (True, -1.0)  # the fake fails an idle agent
  assert fake.scored == [totals]
  assert episode.desktop.evaluate(switched, 'compare') is False
  assert fake.scored[-1] == spec['evaluators']['compare']
  episode.close()
  env.close()
