"""Coding setting: parsing, rewards, data, episodes, rollouts and rewrites."""

import base64
from concurrent import futures
import json
import logging
import os
import pickle
import sys
import types
import zlib

import ml_collections
import numpy as np
import pytest

from rla_jax import chat
from rla_jax import curator
from rla_jax import feedback
from rla_jax import rollout
from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs.coding import data as coding_data
from rla_jax.envs.coding import environment as coding
from rla_jax.envs.coding import rewrite as coding_rewrite
from rla_jax.envs.coding import sandbox

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
from configs import coding as coding_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

needs_bwrap = pytest.mark.skipif(
    not sandbox.available(),
    reason='bubblewrap is not installed (apt-get install -y bubblewrap)')
ADD = 'a, b = map(int, input().split())\nprint(a + b)\n'
ADD_SPEC = {'id': 'add', 'root_id': 'add', 'version': 0, 'source': 'test',
            'question': 'Print the sum of two integers a and b.',
            'tests': [['1 2', '3'], ['5 5', '10'], ['-1 1', '0']],
            'time_limit_s': 1.0}


def _env(**overrides):
  config = coding_config.get_config('smoke').env
  config.update(overrides)
  return coding.from_config(config, '/tmp')


# Parsing the policy's and the RM's answers.


def test_extract_program_takes_the_last_python_block():
  text = ('Idea.\n```python\nprint(1)\n```\nBetter:\n```Python3\nprint(2)\n'
          '```\nOutput:\n```\n2\n```')
  assert coding.extract_program(text) == 'print(2)\n'
  assert coding.extract_program('```\nprint(3)\n```') == 'print(3)\n'
  assert coding.extract_program('```python\nprint(4)') == 'print(4)'  # cut off
  assert coding.extract_program('no code here') == ''
  env = _env()
  assert env.parse_action('print(5)\n```', '') == 'print(5)\n'  # after prefix


def test_parse_unit_test_rules():
  answer = ('Let me think. **Test Input:** ```\n1 2\n``` draft...\n'
            '**Test Input:**\n```text\n3 4\r\n\n```\n**Test Output:**\n'
            '```\n7\n```\n**Explanation:** 3 + 4 = 7')
  assert coding.parse_unit_test(answer) == ('3 4', '7')
  plain = '**Test Input:**\n5 6\n**Test Output:**\n11\n**Explanation:** sum'
  assert coding.parse_unit_test(plain) == ('5 6', '11')
  outside = '**test input**:\n```\n2\n3\n```\n**Test Output** :\n```\n5\n```'
  assert coding.parse_unit_test(outside) == ('2\n3', '5')  # colon after **
  assert coding.parse_unit_test('**Test Input:**\n```\n1\n```') is None
  assert coding.parse_unit_test('**Test Output:**\n```\n1\n```') is None
  assert coding.parse_unit_test('**Test Input:**\n```\n```\n**Test Output:**'
                                '\n```\n1\n```') is None
  assert coding.parse_unit_test('') is None
  env = _env()
  assert env.parse_judgment('9\n```\n**Test Output:**\n```\n9\n```') == (
      '9', '9')  # the smoke config's judge prefix opens the input block


def test_parse_unit_test_ignores_prose_about_tests():
  # Issue 32.1: the explanation's prose once parsed as a later marker pair.
  answer = ('I sum the numbers.\n**Test Input:**\n```\n3\n1 2 3\n```\n'
            '**Test Output:**\n```\n6\n```\n**Explanation:** the sum of the '
            'test input numbers 1+2+3 gives the test output 6.')
  assert coding.parse_unit_test(answer) == ('3\n1 2 3', '6')
  for prose in ('The test input: 1 2. The test output: 3.',
                'Test Input:\n```\n1 2\n```\nTest Output:\n```\n3\n```',
                '*Test Input:*\n```\n1 2\n```\n*Test Output:*\n```\n3\n```',
                '**Test Input**\n```\n1 2\n```\n**Test Output**\n```\n3\n```'):
    assert coding.parse_unit_test(prose) is None, prose
  # Prose before the real markers, in the reasoning, is no marker either.
  draft = ('Test input: 5 5, test output: 10.\n' + answer)
  assert coding.parse_unit_test(draft) == ('3\n1 2 3', '6')


# Rewards against hand-computed tables (RLANYTHING.md 5.6-5.7).

CORRECT = [True, True, False, False]
PASSES = [[1, 1, 1, 1, 1],  # program 0 (correct)
          [1, 1, 0, 1, 1],  # program 1 (correct)
          [0, 1, 1, 1, 1],  # program 2
          [0, 0, 1, 1, 1]]  # program 3
VALID = [True, True, True, True, False]  # test 4 did not parse


def test_rm_rewards_mixed_task():
  # u0 correct, catches both wrong programs: 2; u1 correct, catches one: 1;
  # u2 wrong (program 1 fails it), lets two through: -2; u3 correct, catches
  # none: 0; u4 invalid: fails everyone, lets none through: 0.
  r = feedback.rm_rewards(CORRECT, PASSES, VALID)
  np.testing.assert_array_equal(r, [2, 1, -2, 0, 0])


def test_rm_rewards_all_correct_and_none_correct():
  r = feedback.rm_rewards([True, True], [[1, 1, 1], [1, 0, 1]],
                        [True, True, False])
  np.testing.assert_array_equal(r, [1, -1, -1])  # C- empty: +-1
  assert feedback.rm_rewards([False, False], [[1, 1], [1, 1]],
                           [True, True]) is None  # C+ empty: skipped
  # An empty test is an invalid one, whatever the programs printed.
  r = feedback.rm_rewards([True, False], [[1, 1], [1, 0]], [False, True])
  np.testing.assert_array_equal(r, [0, 1])


def test_ut_metrics_and_aggregate():
  mixed = feedback.ut_metrics(CORRECT, PASSES, VALID)
  assert mixed == {'ut_correct': 3, 'ut_total': 5, 'detect': 1,
                   'detect_total': 5}
  all_ok = feedback.ut_metrics([True, True], [[1, 1, 1], [1, 0, 1]],
                             [True, True, False])
  assert all_ok == {'ut_correct': 1, 'ut_total': 3, 'detect': 0,
                    'detect_total': 0}
  none_ok = feedback.ut_metrics([False], [[1]], [True])
  assert none_ok['ut_total'] == 0 and none_ok['detect_total'] == 0
  agg = feedback.aggregate_ut_metrics([mixed, all_ok, none_ok])
  assert agg == {'rm/ut_accuracy': 4 / 8, 'rm/detect': 1 / 5}
  assert np.isnan(feedback.aggregate_ut_metrics([none_ok])['rm/detect'])


def test_policy_rewards_gt_and_integrated():
  gt = [1.0, 1.0, 0.5, 0.25]
  np.testing.assert_array_equal(feedback.policy_rewards(gt), gt)
  # K = valid tests that both correct programs pass = {u0, u1, u3}.
  r = feedback.policy_rewards(gt, PASSES, VALID, mode='integrated', lam=0.5)
  np.testing.assert_allclose(r, [1.5, 1.5, 0.5 + 0.5 * 2 / 3,
                                 0.25 + 0.5 * 1 / 3])
  # No correct program: every valid test counts.
  r = feedback.policy_rewards([0.5, 0.0], [[1, 0, 1], [1, 1, 1]],
                            [True, True, False], mode='integrated')
  np.testing.assert_allclose(r, [1.0, 1.0])
  r = feedback.policy_rewards([0.5, 0.0], [[1], [0]], [False],
                            mode='integrated')
  np.testing.assert_allclose(r, [0.5, 0.0])  # no usable test: the GT ratio
  with pytest.raises(ValueError):
    feedback.policy_rewards(gt, mode='mixed')
  with pytest.raises(ValueError):
    feedback.policy_rewards(gt, mode='integrated')


@needs_bwrap
def test_run_unit_tests_programs_by_tests():
  programs = [ADD, 'print(0)', '', 'a, b = map(int, input().split())\n'
              'print(a - b)\n']
  tests = [('1 2', '3'), ('2 2', '4'), None, ('0 0', '0')]
  passes, statuses = coding.run_unit_tests(
      programs, tests, 1.0, limits=sandbox.Limits(), workers=2)
  np.testing.assert_array_equal(passes, [[1, 1, 0, 1], [0, 0, 0, 1],
                                         [0, 0, 0, 0], [0, 0, 0, 1]])
  assert statuses[2] == [coding.NO_PROGRAM] * 4
  assert statuses[0][2] == sandbox.INVALID_TEST
  assert statuses[1][0] == sandbox.WRONG_ANSWER


# Data.


def _write(path, records):
  with open(path, 'w') as f:
    for record in records:
      f.write((record if isinstance(record, str) else json.dumps(record))
              + '\n')
  return str(path)


def test_load_codecontests_field_variants(tmp_path):
  path = _write(tmp_path / 'cc.jsonl', [
      {'name': 'p1', 'description': 'Add.', 'public_tests': {
          'input': ['1 2\n'], 'output': ['3\n']},
       'private_tests': {'input': ['1 2\n', '2 2\n'], 'output': ['3\n', '4\n']},
       'generated_tests': {'input': [], 'output': []},
       'time_limit': {'seconds': 2, 'nanos': 500000000}, 'difficulty': 7},
      {'question': 'Echo.', 'test_input': ['a'], 'test_output': ['a'],
       'test_time_limit': 4},
      {'problem_id': 9, 'question': 'Apps.', 'difficulty': 'hard',
       'input_output': json.dumps({'inputs': ['x'], 'outputs': ['y']})},
      {'question': 'Pairs.', 'tests': [['1', '1'], {'input': '2',
                                                    'output': '2'}]},
      {'question': 'No tests.'},
  ])
  specs = coding_data.load_codecontests(path, time_limit_s=1.0)
  assert [s['id'] for s in specs] == ['p1', 'cc-2', '9', 'cc-4']
  assert specs[0]['tests'] == [['1 2\n', '3\n'], ['2 2\n', '4\n']]
  assert specs[0]['time_limit_s'] == 2.5 and specs[0]['difficulty'] == 7.0
  assert specs[1]['time_limit_s'] == 4.0
  assert specs[2]['tests'] == [['x', 'y']] and specs[2]['difficulty'] == 3.0
  assert specs[3]['tests'] == [['1', '1'], ['2', '2']]
  capped = coding_data.load_codecontests(path, time_limit_s=1.0, max_tests=1)
  assert len(capped[0]['tests']) == 1


def test_loaders_name_file_and_line_on_errors(tmp_path):
  bad = [('{"question": "q", "tests": [["1", "1"]]}\nnot json\n', ':2: not'),
         ('[1, 2]\n', ':1: expected a JSON object'),
         ('{"tests": [["1", "1"]]}\n', ':1: no problem statement'),
         ('{"question": "q", "test_input": ["1"], "test_output": []}\n',
          ':1: malformed tests'),
         ('{"question": "q", "tests": [["1", "1"]], "time_limit": -1}\n',
          ':1: bad time limit'),
         ('{"question": "q"}\n', 'no problem with stdin/stdout tests')]
  for i, (text, message) in enumerate(bad):
    path = tmp_path / f'bad{i}.jsonl'
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
      coding_data.load_codecontests(str(path), time_limit_s=1.0)
    assert str(path) in str(e.value)


def test_load_livebench_formats(tmp_path):
  cases = [{'input': '1\n', 'output': '2\n', 'testtype': 'stdin'},
           {'input': 'f(1)', 'output': '2', 'testtype': 'functional'}]
  packed = base64.b64encode(zlib.compress(json.dumps(
      [{'input': '3\n', 'output': '4\n', 'testtype': 'stdin'}]).encode()))
  pickled = base64.b64encode(zlib.compress(pickle.dumps([]))).decode()
  path = _write(tmp_path / 'lcb.jsonl', [
      {'question_id': 'q1', 'question_title': 'Inc', 'question_content':
       'Add one.', 'public_test_cases': json.dumps(cases),
       'private_test_cases': packed.decode()},
      {'question_id': 'q2', 'question_content': 'LeetCode only.',
       'public_test_cases': json.dumps(cases[1:])},
  ])
  specs = coding_data.load_livebench(path, time_limit_s=2.0)
  assert [s['id'] for s in specs] == ['q1']
  assert specs[0]['question'].startswith('Inc\n\nAdd one.')
  assert specs[0]['tests'] == [['1\n', '2\n'], ['3\n', '4\n']]
  unsafe = _write(tmp_path / 'pickle.jsonl', [
      {'question_id': 'q3', 'question_content': 'x',
       'private_test_cases': pickled}])
  with pytest.raises(ValueError, match='pickle'):
    coding_data.load_livebench(unsafe, time_limit_s=2.0)


def test_builtin_problems_are_deterministic_and_levels_scale():
  kwargs = dict(seed=3, num_tests=6, levels=(1, 5), time_limit_s=2.0)
  first = coding_data.builtin_tasks('train', 10, **kwargs)
  assert first == coding_data.builtin_tasks('train', 10, **kwargs)
  assert first != coding_data.builtin_tasks('eval', 10, **kwargs)
  assert {s['kind'] for s in first} == set(coding_data.KINDS)
  assert [s['level'] for s in first] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
  for kind in coding_data.KINDS:
    sizes = [max(len(t[0]) for t in coding_data.builtin_problem(
        kind, level, 's', spec_id='x', num_tests=6, time_limit_s=2.0)['tests'])
             for level in (1, 5)]
    assert sizes[1] > sizes[0], kind  # a higher level, larger inputs
  with pytest.raises(ValueError):
    coding_data.builtin_problem('list_ops', 6, 's', spec_id='x', num_tests=2,
                                time_limit_s=1.0)


@needs_bwrap
def test_builtin_references_pass_in_the_sandbox():
  specs = [coding_data.builtin_problem(kind, level, f'r{level}', spec_id='x',
                                       num_tests=6, time_limit_s=2.0)
           for kind in coding_data.KINDS for level in range(1, 6)]
  jobs = [(coding_data.reference_program(s), coding_data.gt_tests(s),
           s['time_limit_s']) for s in specs]
  for spec, results in zip(specs, sandbox.run_many(jobs)):
    assert all(r.passed for r in results), (spec['kind'], spec['level'],
                                            results)


@needs_bwrap
def test_all_humaneval_solutions_pass_and_a_broken_one_fails():
  specs = coding_data.load_humaneval(time_limit_s=10.0)
  assert len(specs) == 164
  jobs = [(coding_data.program_for(s, s['canonical_solution']),
           coding_data.gt_tests(s), s['time_limit_s']) for s in specs]
  results = sandbox.run_many(jobs)
  failed = [s['id'] for s, rs in zip(specs, results)
            if not all(r.passed for r in rs)]
  assert not failed, failed
  first = specs[0]
  broken = coding_data.program_for(first, '    return False\n')
  result, = sandbox.run(broken, coding_data.gt_tests(first), 10.0)
  assert result.status == 'wrong_answer'
  full = ('from typing import List\n\ndef has_close_elements(numbers: '
          'List[float], threshold: float) -> bool:\n  return any(abs(a - b) '
          '< threshold for i, a in enumerate(numbers) for b in '
          'numbers[i + 1:])\n')
  result, = sandbox.run(coding_data.program_for(first, full),
                        coding_data.gt_tests(first), 10.0)
  assert result.passed  # a chat answer that rewrites the whole function


# Episodes and rollouts.


@needs_bwrap
def test_episode_runs_the_gt_tests():
  env = _env()
  episode = env.make_episode(ADD_SPEC, 0, 1)
  assert episode.reset() == ADD_SPEC['question']
  obs, done, outcome = episode.step(ADD)
  assert (done, outcome) == (True, 1.0) and obs.startswith('passed 3/3')
  assert episode.info == {'gt_passed': [True] * 3, 'gt_status': ['ok'] * 3,
                          'program': ADD, 'gt_ratio': 1.0}
  with pytest.raises(RuntimeError):
    episode.step(ADD)
  episode = env.make_episode(ADD_SPEC, 0, 1)
  episode.reset()
  _, _, outcome = episode.step('print(3)')
  assert outcome == -1.0 and episode.info['gt_passed'] == [True, False, False]
  episode = env.make_episode(ADD_SPEC, 0, 1)
  episode.reset()
  assert episode.step('')[2] == -1.0
  assert episode.info['gt_status'] == [coding.NO_PROGRAM] * 3


def _fake_policy(answers):
  def policy(messages_batch, seed):
    del seed
    return [chat.Completion(prompt=m[0]['content'], prompt_tokens=[1],
                            text=answers(i), tokens=[1], logprobs=[0.0],
                            finish_reason='stop')
            for i, m in enumerate(messages_batch)]
  return policy


@needs_bwrap
def test_rollout_through_the_coding_env():
  env = _env(answer_prefix='')
  specs = env.tasks('train')[:2]
  refs = {s['id']: coding_data.reference_program(s) for s in specs}
  tasks = [(s['id'], s, 'active') for s in specs]

  def answers(i):  # rows are task-major: even rollouts solve it
    spec = specs[i // 4]
    return (f'Plan.\n```python\n{refs[spec["id"]]}```' if i % 2 == 0 else
            '```python\nprint("no idea")\n```')

  with futures.ThreadPoolExecutor(4) as pool:
    trajs = rollout.run(env, tasks, group_size=4, policy=_fake_policy(answers),
                        pool=pool, seed=0, max_turns=env.max_turns)
  assert [t.outcome for t in trajs] == [1.0, -1.0] * 4
  assert all(t.status == structs.OK and len(t.steps) == 1 for t in trajs)
  assert trajs[0].info['program'] == refs[specs[0]['id']]
  assert all(len(t.info['gt_passed']) == len(t.spec['tests']) for t in trajs)
  counts = coding.sandbox_counts(trajs)
  assert counts['sandbox/ok'] == sum(len(s['tests']) for s in specs) * 2


def test_sandbox_failure_marks_the_trajectory_error(monkeypatch):
  def broken(*args, **kwargs):
    raise sandbox.SandboxError('bwrap: setting up uid map: Permission denied')
  monkeypatch.setattr(coding.sandbox, 'run', broken)
  env = _env(answer_prefix='')
  with futures.ThreadPoolExecutor(2) as pool:
    trajs = rollout.run(env, [('add', ADD_SPEC, 'active')], group_size=2,
                        policy=_fake_policy(lambda i: f'```python\n{ADD}```'),
                        pool=pool, seed=0, max_turns=1)
  assert [t.status for t in trajs] == [structs.ERROR] * 2
  assert 'SandboxError' in trajs[0].error


def test_prompts_and_descriptions():
  env = _env(answer_prefix='')
  train = env.policy_messages(ADD_SPEC, [], '')
  assert ADD_SPEC['question'] in train[0]['content']
  assert 'input()' in train[0]['content']
  assert coding.EVAL_NOTE not in train[0]['content']
  evaluation = env.policy_messages({**ADD_SPEC, 'split': 'eval'}, [], '')
  assert coding.EVAL_NOTE in evaluation[0]['content']
  assert all(s['split'] == 'builtin' for s in env.tasks('builtin'))
  assert len(env.tasks('humaneval')) == 3  # num_eval of :smoke
  with pytest.raises(ValueError, match='eval_files.livebench is not set'):
    env.tasks('livebench')
  with pytest.raises(ValueError, match='unknown coding split'):
    env.tasks('apps')
  rm = env.rm_messages(ADD_SPEC)
  assert ADD_SPEC['question'] in rm[0]['content']
  assert '**Test Input:**' in rm[0]['content']
  assert env.judge_messages(ADD_SPEC, 'p', 'r', 'o') == rm
  assert 'with 3 tests' in env.describe(ADD_SPEC)
  assert env.difficulty({'level': 3}) == 3.0
  assert env.difficulty(ADD_SPEC) == 0.0
  human = {**ADD_SPEC, 'prompt': 'def f():\n', 'check': 'assert True'}
  assert 'def f():' in env.policy_messages(human, [], '')[0]['content']
  assert not env.supports_unit_tests(human)


def test_configs_build():
  paper = coding_config.get_config()
  assert (paper.rollout.num_tasks, paper.rollout.group_size,
          paper.judge.num_samples) == (64, 32, 16)
  assert paper.rollout.sampling.temperature == 1.0
  assert paper.eval.sampling.temperature == 0.0
  assert paper.curator.rewrite_attempts == 3
  assert paper.optim.policy.learning_rate == 1e-6
  assert coding_config.get_config('smoke,policy').curator.enabled is False
  assert coding_config.get_config('outcome_only').feedback.lam == 0.0
  with pytest.raises(ValueError):
    coding_config.get_config('smoke,nonsense')


# Rewrites.


def _request(direction=structs.HARDER, programs=(ADD,), judgments=()):
  trajs = []
  for i, program in enumerate(programs):
    traj = structs.Trajectory(task_id='add', source='active', rollout=i,
                              spec=ADD_SPEC)
    traj.info = {'gt_passed': [True, True, program == ADD],
                 'program': program}
    trajs.append(traj)
  return base.RewriteRequest(spec=ADD_SPEC, root=ADD_SPEC,
                             direction=direction, acc_old=0.9,
                             critiques=['forgot negatives'],
                             trajectories=trajs, judgments=judgments)


def _proposal(inputs, outputs, **extra):
  return json.dumps({'question': 'Print a + b for two integers, |a|, |b| <= '
                     '10^18.', 'test_method': 'stdio', 'test_time_limit': 4,
                     'test_input': inputs, 'test_output': outputs, **extra})


GOOD = _proposal(['1 2', '10 20', '-5 5', '7 8'], ['3', '30', '0', '15'])


def test_rewrite_prompt_shows_pass_rates_and_rm_tests():
  judgments = [types.SimpleNamespace(info={'test': ['2 3', '5'],
                                           'passed': [True, False]}),
               types.SimpleNamespace(info={'test': None, 'passed': None}),
               types.SimpleNamespace(info={'test': ['9' * 200, '1'],
                                           'passed': [False, False]})]
  request = _request(programs=(ADD, 'print(0)'), judgments=judgments)
  prompt = coding_rewrite.rewrite_prompt(request, _env().config.rewrite)
  assert '"pass_rate": 1.0' in prompt and '"pass_rate": 0.5' in prompt
  assert '"input": "2 3", "output": "5", "pass_rate": 0.5' in prompt
  assert '(1 long tests not shown)' in prompt
  assert 'forgot negatives' in prompt and 'HARDER' in prompt
  assert coding_rewrite.gt_pass_rates(ADD_SPEC, request.trajectories) == [
      1.0, 1.0, 0.5]
  assert 'Current version' not in prompt
  v1 = {**ADD_SPEC, 'id': 'add.v1-abc', 'question': 'Sum of three.'}
  prompt = coding_rewrite.rewrite_prompt(
      base.RewriteRequest(spec=v1, root=ADD_SPEC, direction=structs.EASIER,
                          acc_old=0.1, critiques=[], trajectories=[],
                          judgments=[]), _env().config.rewrite)
  assert 'Current version' in prompt and 'Sum of three.' in prompt
  assert ADD_SPEC['question'] in prompt and 'EASIER' in prompt


@needs_bwrap
@pytest.mark.parametrize('answer, reason', [
    ('{"question": "x", "test_input": [', 'malformed JSON'),
    ('["a list"]', 'not an object'),
    ('Sure! Here it is.', 'no JSON object'),
    (_proposal(['1 2'], ['3'], question=''), 'no question'),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3']), '4 test inputs but 3'),
    (_proposal(['1', '2', '3'], ['1', '2', '3']), 'need at least 4'),
    (_proposal(['1', '1', '2', '3'], ['1', '1', '2', '3']), 'need at least 4'),
    (_proposal(['1', '2', '1 ', '3'], ['1', '2', '5', '3']),
     'contradictory tests: tests 1 and 3 have the same input but different '
     'outputs'),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3', '4'],
               test_method='functional'), 'not "stdio"'),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3', '4'],
               test_time_limit=100), 'test_time_limit'),
    (_proposal(['1', '2', '3', 'x' * 5000], ['1', '2', '3', '4']),
     'over 4000 characters'),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3', '']), 'empty output'),
])
def test_rewrite_rejections_give_reasons(answer, reason, caplog):
  env = _env()
  with caplog.at_level(logging.INFO):
    with pytest.raises(base.RewriteRejected, match=reason):
      env.rewrite(_request(), lambda prompts: [answer] * len(prompts), 2)
  assert reason.split()[0] in caplog.text


@needs_bwrap
def test_rewrite_accepts_the_first_valid_proposal():
  env = _env()
  answers = ['not json', f'```json\n{GOOD}\n```']
  new = env.rewrite(_request(), lambda prompts: answers[:len(prompts)], 2)
  assert new['consistency'] == 'consistent'
  assert new['root_id'] == 'add' and new['version'] == 1
  assert new['id'].startswith('add.v1-') and new['parent_id'] == 'add'
  assert new['tests'][0] == ['1 2', '3'] and new['time_limit_s'] == 4.0
  assert env.difficulty(new) == 1.0
  changed = _proposal(['3 4', '2 3', '2 2', '0 5'], ['12', '6', '4', '0'])
  new = env.rewrite(_request(), lambda prompts: [changed] * len(prompts), 1)
  assert new['consistency'] == 'unverified'  # a*b: the old solver is no help
  new = env.rewrite(_request(programs=('print(0)',)),
                    lambda prompts: [GOOD] * len(prompts), 1)
  assert new['consistency'] == 'no witnesses'


MOD_SUM = _proposal(  # the sum mod 1e9+7 with values up to 1e18
    ['1 2', '10 20', '-5 5', '1000000000000000000 1000000000000000000'],
    ['3', '30', '0', '98'])


@needs_bwrap
def test_generalising_rewrite_passes_the_consistency_check():
  # Issue 32.3: the old solver (a + b) matches 3 of these 4 correct tests;
  # that is a rule change, not a contradiction.
  env = _env()
  rc = env.config.rewrite
  request = _request()
  candidate = coding_rewrite.parse_proposal(MOD_SUM, ADD_SPEC, structs.HARDER,
                                            rc)
  assert coding_rewrite.check_consistency(
      candidate, ADD_SPEC, request.trajectories, rc,
      env.limits) == 'unverified'
  new = env.rewrite(request, lambda prompts: [MOD_SUM] * len(prompts), 1)
  assert new['tests'][3][1] == '98' and new['consistency'] == 'unverified'


# a*b: old test 1 ('1 2' -> 3) now answers 2, so the old solver fails it.
PRODUCT = _proposal(['1 2', '10 20', '-5 5', '7 8'], ['2', '200', '-25', '56'])


@pytest.mark.parametrize('checked', [True, False])
def test_harder_rewrite_that_changes_an_old_answer_is_rejected(checked):
  # Issue 32.3: a witness (ADD) fails a new test on an old test's input. The
  # check needs no sandbox; the curator counts it under its own reason.
  env = _env()
  env.config.rewrite.consistency_check = checked
  candidate = coding_rewrite.parse_proposal(PRODUCT, ADD_SPEC, structs.HARDER,
                                            env.config.rewrite)
  with pytest.raises(base.RewriteRejected,
                     match=f'^{coding_rewrite.CHANGED_ANSWER}: test 1 has the '
                           'input of old test 1') as e:
    coding_rewrite.check_consistency(candidate, ADD_SPEC,
                                     _request().trajectories,
                                     env.config.rewrite, env.limits)
  assert e.value.reason == coding_rewrite.CHANGED_OLD_ANSWER
  pool = curator.build_pool([ADD_SPEC])
  config = ml_collections.ConfigDict(dict(
      alpha_low=0.2, alpha_high=0.8, rewrite_attempts=2, critiques=False,
      easier_strict=True, pending_max_tries=2))
  pool, stats = curator.request_rewrites(
      pool, env, _request().trajectories, [], {('add', 'active'): 1.0},
      lambda prompts: [PRODUCT] * len(prompts), 1, config)
  assert stats['curator/rejected_changed_old_answer'] == 2
  assert stats['curator/rewrite_rejected'] == 1 and pool[0].pending is None


def test_easier_rewrite_may_change_an_old_answer():
  # An easier rewrite may drop a rule; its acceptance judges it.
  env = _env()
  env.config.rewrite.consistency_check = False
  new = env.rewrite(_request(direction=structs.EASIER),
                    lambda prompts: [PRODUCT] * len(prompts), 1)
  assert new['tests'][0] == ['1 2', '2'] and new['consistency'] == 'not checked'


def test_same_input_two_outputs_is_a_contradiction():
  env = _env()
  rc = env.config.rewrite
  clash = coding_rewrite.parse_proposal(
      _proposal(['1 2', '10 20', '-5 5', ' 1  2\n'], ['3', '30', '0', '4']),
      ADD_SPEC, structs.HARDER, rc)
  assert len(clash['tests']) == 4  # parsing leaves the clash to the check
  for checked in (True, False):  # no sandbox needed; on even when off
    rc.consistency_check = checked
    with pytest.raises(base.RewriteRejected,
                       match=f'^{coding_rewrite.CONTRADICTION}: tests 1 and 4 '):
      coding_rewrite.check_consistency(clash, ADD_SPEC, [], rc, env.limits)
  assert coding_rewrite.contradiction([['1', '2'], ['1\n', '2\n']]) is None


def test_rewrite_falls_back_to_a_builtin_level(caplog):
  env = _env()
  spec = env.tasks('train')[0]
  request = base.RewriteRequest(spec=spec, root=spec, direction=structs.EASIER,
                                acc_old=0.0, critiques=[], trajectories=[],
                                judgments=[])
  with caplog.at_level(logging.INFO):
    new = env.rewrite(request, lambda prompts: ['?'] * len(prompts), 2)
  assert new['rewrite'] == 'knob' and new['level'] == spec['level'] - 1
  assert new['kind'] == spec['kind'] and new['root_id'] == spec['id']
  assert len(new['rejected_proposals']) == 2
  assert 'all 2 proposals rejected' in caplog.text
  # Marked as the generator's (issue 32.5), with the LLM's rejections listed.
  assert new[base.FALLBACK_KEY] == coding_rewrite.KNOB
  assert request.rejected == [coding_rewrite.NO_JSON] * 2
  bottom = {**spec, 'level': 1}
  request = base.RewriteRequest(spec=bottom, root=bottom,
                                direction=structs.EASIER, acc_old=0.0,
                                critiques=[], trajectories=[], judgments=[])
  with pytest.raises(base.RewriteRejected, match='no valid proposal'):
    env.rewrite(request, lambda prompts: ['?'] * len(prompts), 1)
  assert request.rejected == [coding_rewrite.NO_JSON]
  human = {**ADD_SPEC, 'check': 'assert True'}
  with pytest.raises(base.RewriteRejected, match='assert-style') as e:
    env.rewrite(base.RewriteRequest(spec=human, root=human,
                                    direction=structs.EASIER, acc_old=0.0,
                                    critiques=[], trajectories=[],
                                    judgments=[]), lambda p: [], 1)
  assert e.value.reason == coding_rewrite.ASSERT_STYLE


def test_fallback_rewrite_is_counted_as_the_fallbacks():
  # Issue 32.5 end to end: the curator counts the knob rewrite of a built-in
  # problem as created and accepted by the fallback, never by the LLM.
  env = _env()
  spec = env.tasks('train')[0]
  pool = curator.build_pool([spec])
  config = ml_collections.ConfigDict(dict(
      alpha_low=0.2, alpha_high=0.8, rewrite_attempts=2, critiques=False,
      easier_strict=True, pending_max_tries=2))
  pool, stats = curator.request_rewrites(
      pool, env, [], [], {(spec['id'], 'active'): 0.0},
      lambda prompts: ['no JSON here'] * len(prompts), 1, config)
  assert stats['curator/created'] == 0
  assert stats['curator/created_fallback'] == 1
  assert stats['curator/rejected_no_json'] == 2
  pending = pool[0].pending
  assert pending.origin == structs.FALLBACK
  assert base.FALLBACK_KEY not in pending.spec
  assert pending.spec['level'] == spec['level'] - 1
  pool, events, stats = curator.judge_pending(
      pool, {(spec['id'], 'pending'): 0.5}, 2, config)
  assert events[0]['accepted'] and events[0]['origin'] == structs.FALLBACK
  assert stats['curator/accepted'] == 0
  assert stats['curator/accepted_fallback'] == 1


@pytest.mark.parametrize('answer, key', [
    ('{"question": "x", "test_input": [', coding_rewrite.MALFORMED_JSON),
    ('["a list"]', coding_rewrite.NO_JSON),
    ('Sure! Here it is.', coding_rewrite.NO_JSON),
    (_proposal(['1 2'], ['3'], question=''), coding_rewrite.INVALID_FIELDS),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3']),
     coding_rewrite.INVALID_FIELDS),
    (_proposal(['1', '2', '3'], ['1', '2', '3']),
     coding_rewrite.TOO_FEW_TESTS),
    (_proposal(['1', '2', '1 ', '3'], ['1', '2', '5', '3']),
     coding_rewrite.CONTRADICTORY_TESTS),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3', '4'],
               test_time_limit=100), coding_rewrite.INVALID_FIELDS),
    (_proposal(['1', '2', '3', '4'], ['1', '2', '3', '']),
     coding_rewrite.INVALID_FIELDS),
])
def test_rejected_proposals_give_reason_keys(answer, key):
  # Issue 32.3 follow-up: each rejected proposal's key reaches the curator
  # (curator/rejected_<key>); no sandbox needed with the witness run off.
  env = _env()
  env.config.rewrite.consistency_check = False
  request = _request()
  with pytest.raises(base.RewriteRejected):
    env.rewrite(request, lambda prompts: [answer] * len(prompts), 2)
  assert request.rejected == [key, key]
