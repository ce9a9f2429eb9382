"""configs/coding.py:smoke end to end: sandbox, unit-test RM, rewrites, resume.

Random tiny models never write a program that runs, so the in-process runs
put an oracle behind the environment's parsers: the models' own sampled
tokens are what is trained (their log-probs stay consistent), but the
program a response "means" is the reference solution for some rollouts and
a wrong one for others, and the RM's answers "mean" correct or wrong tests.
Everything after parsing (sandbox, RM test execution, rewards, training,
curator, checkpoints) is the real code. A subprocess run of the unpatched
smoke config checks the command users run.
"""

import collections
import os
import shutil
import subprocess
import sys

import pytest

from rla_jax import curator
from rla_jax import loop
from rla_jax.envs.coding import data as coding_data
from rla_jax.envs.coding import environment as coding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from configs import coding as coding_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

needs_bwrap = pytest.mark.skipif(shutil.which('bwrap') is None,
                                 reason='bubblewrap is not installed')
GROUP = 4  # rollouts per task in :smoke


class Oracle:
  """What the responses mean: per task, how many of its G programs solve it.

  Task i of the pool (by id order) gets 4, 2 or 0 correct programs of 4 by
  i % 3, so some groups trigger harder rewrites, some easier ones, and some
  train the policy; the RM's tests alternate between a GT test and one with
  a wrong output.
  """

  def __init__(self):
    self.specs = {}  # question -> spec
    self.seen = collections.Counter()
    self.rm_specs = []
    self.rm_calls = 0

  def parse_action(self, response, observation):
    del response
    spec = self.specs[observation]
    k = self.seen[observation] % GROUP
    self.seen[observation] += 1
    index = int(spec['root_id'].rsplit('-', 1)[1])
    solved = (GROUP, GROUP // 2, 0)[index % 3]
    return (coding_data.reference_program(spec) if k < solved
            else 'print("wrong")\n')

  def make_episode(self, original):
    def make_episode(env, spec, seed, max_turns=1):
      self.specs[spec['question']] = spec
      return original(env, spec, seed, max_turns)
    return make_episode

  def rm_messages(self, original):
    def rm_messages(env, spec):
      self.rm_specs.append(spec)
      return original(env, spec)
    return rm_messages

  def parse_judgment(self, text, num_samples):
    del text
    spec = self.rm_specs[self.rm_calls // num_samples]
    j = self.rm_calls % num_samples
    self.rm_calls += 1
    if self.rm_calls == len(self.rm_specs) * num_samples:
      self.rm_specs, self.rm_calls = [], 0
    stdin, expected = spec['tests'][j % len(spec['tests'])]
    return stdin, expected if j % 2 == 0 else expected + '7'


def _run(workdir, num_epochs, monkeypatch):
  config = coding_config.get_config('smoke')
  config.loop.num_epochs = num_epochs
  config.rollout.num_tasks = config.env.num_train  # every pattern, each epoch
  oracle = Oracle()
  cls = coding.CodingEnv
  monkeypatch.setattr(cls, 'make_episode', oracle.make_episode(
      cls.make_episode))
  monkeypatch.setattr(cls, 'parse_action',
                      lambda env, text, obs: oracle.parse_action(text, obs))
  monkeypatch.setattr(cls, 'rm_messages', oracle.rm_messages(cls.rm_messages))
  m = config.judge.num_samples
  monkeypatch.setattr(cls, 'parse_judgment',
                      lambda env, text: oracle.parse_judgment(text, m))
  return loop.run(config, workdir)


@pytest.mark.slow
@needs_bwrap
def test_two_epochs_train_both_models_rewrite_and_resume(tmp_path,
                                                          monkeypatch):
  workdir = str(tmp_path)
  first = _run(workdir, 1, monkeypatch)
  assert first['rollout/code'] == pytest.approx(first['rollout/accuracy'])
  assert first['rollout/sandbox_ok'] > 0
  assert first['rollout/sandbox_wrong_answer'] > 0
  assert first['policy/examples'] > 0 and first['policy/steps'] > 0
  assert first['rm/examples'] > 0 and first['rm/steps'] > 0
  # Half the RM tests are GT tests (correct), half have a wrong output.
  assert 0 < first['rm/ut_accuracy'] < 1
  assert first['curator/requested'] >= 1
  assert first['curator/triggered_harder'] >= 1
  assert first['curator/triggered_easier'] >= 1
  assert 'eval/builtin/code' in first
  assert 'eval/builtin/rm_ut_accuracy' in first
  last = _run(workdir, 2, monkeypatch)  # resumes from epoch 1
  assert last['policy/examples'] > 0
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  decided = [e for t in pool for e in t.history]
  assert decided and all(e['epoch'] == 2 for e in decided)
  assert {e['reason'] for e in decided} <= {'accepted', 'rejected'}


@pytest.mark.slow
@needs_bwrap
def test_smoke_command_runs(tmp_path):
  env = dict(os.environ, XLA_FLAGS='')
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', '--config=configs/coding.py:smoke',
       f'--workdir={tmp_path}'], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'epoch 1 |' in proc.stdout
