"""The start-up reward check (reward_check.py): known outcomes of every
setting through its real evaluator, and a sabotaged evaluator stopping a run
before epoch 1 with one line that names the setting and the case.

OSWorld's cases need a desktop: tests/envs/osworld_desktop_test.py.
"""

import importlib
import os
import subprocess
import sys

import pytest

from rla_jax import reward_check
from rla_jax.envs import base
from rla_jax.envs import tiny
from rla_jax.envs.coding import sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _Episode:

  def __init__(self, outcomes, error=None):
    self.outcomes, self.error, self.closed = list(outcomes), error, False

  def reset(self):
    return 'start'

  def step(self, action):
    if self.error:
      raise self.error
    outcome = self.outcomes.pop(0)
    return f'after {action}', outcome is not None, outcome

  def close(self):
    self.closed = True


class _Env:
  """Plays each case's `spec['outcomes']`, one per step."""

  def __init__(self, cases, error=None):
    self.cases, self.error, self.episodes = cases, error, []

  def reward_cases(self):
    if isinstance(self.cases, Exception):
      raise self.cases
    return self.cases

  def make_episode(self, spec, seed, max_turns):
    assert seed == 0 and max_turns == len(spec['outcomes'])
    self.episodes.append(_Episode(spec['outcomes'], self.error))
    return self.episodes[-1]


def _case(name, outcomes, passes):
  return base.RewardCase(name, {'outcomes': outcomes},
                         tuple('a' * len(outcomes)), passes)


RIGHT = [_case('wins', [None, 1.0], True), _case('loses', [-1.0], False)]


def test_right_outcomes_pass_and_every_episode_is_closed():
  env = _Env(RIGHT)
  assert reward_check.check(env, 'toy')[0] == 2
  assert [e.closed for e in env.episodes] == [True, True]


@pytest.mark.parametrize('cases,error,expected', [
    ([_case('wins', [-1.0], True), RIGHT[1]], None,
     "setting 'toy', case 'wins' (a known pass) scored -1"),
    ([RIGHT[0], _case('loses', [1.0], False)], None,
     "setting 'toy', case 'loses' (a known fail) scored +1"),
    ([_case('wins', [None, None], True), RIGHT[1]], None,
     "case 'wins' (a known pass) did not end after its 2 actions"),
    (RIGHT, OSError('the desktop died'),
     "case 'wins' (a known pass) raised OSError: the desktop died"),
    (ValueError('no game'), None,
     "setting 'toy' could not make its known cases: ValueError: no game"),
    (RIGHT[:1], None, 'must hold a known pass and a known fail'),
])
def test_a_wrong_outcome_names_the_setting_and_case(cases, error, expected):
  env = _Env(cases, error)
  with pytest.raises(reward_check.RewardCheckFailed) as raised:
    reward_check.check(env, 'toy')
  assert expected in str(raised.value)
  assert '\n' not in str(raised.value)
  assert all(e.closed for e in env.episodes)


def test_a_setting_without_cases_is_warned_about(caplog):
  assert reward_check.check(object(), 'toy') == (0, 0.0)
  assert reward_check.check(_Env([]), 'toy') == (0, 0.0)
  assert 'rewards are not checked' in caplog.text


def _env(config_name, arg, tmp_path):
  config = importlib.import_module(f'configs.{config_name}').get_config(arg)
  module = importlib.import_module(f'rla_jax.envs.{config.env.name}')
  return config.env.name, module.from_config(config.env, str(tmp_path))


@pytest.mark.parametrize('config_name,arg', [
    ('tiny', 'full'), ('default', 'full'), ('alfworld', 'smoke'),
    pytest.param('coding', 'smoke', marks=pytest.mark.skipif(
        not sandbox.available(), reason='needs bubblewrap'))])
def test_every_settings_known_outcomes_hold(config_name, arg, tmp_path):
  name, env = _env(config_name, arg, tmp_path)
  try:
    cases, seconds = reward_check.check(env, name)
  finally:
    if hasattr(env, 'close'):
      env.close()
  assert cases >= 2 and seconds < 60


def test_a_sandbox_that_fails_everything_is_caught(monkeypatch, tmp_path):
  def broken(program, tests, *args, **kwargs):
    del program, args, kwargs
    return [sandbox.Result(sandbox.ERROR, 'cannot start') for _ in tests]
  monkeypatch.setattr(sandbox, 'run', broken)
  name, env = _env('coding', 'smoke', tmp_path)
  with pytest.raises(reward_check.RewardCheckFailed,
                     match="setting 'coding', case 'stdin/stdout: a right "
                           r"program' \(a known pass\) scored -1"):
    reward_check.check(env, name)


def test_an_evaluator_that_passes_everything_is_caught(monkeypatch, tmp_path):
  def always_won(self, action):
    del action
    self.turn += 1
    return 'the lock opens.', True, 1.0
  monkeypatch.setattr(tiny.LockEpisode, 'step', always_won)
  name, env = _env('tiny', 'full', tmp_path)
  with pytest.raises(reward_check.RewardCheckFailed,
                     match="case 'a symbol that opens nothing' .a known "
                           'fail. scored [+]1'):
    reward_check.check(env, name)


def _main(flags, workdir):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
       '--config.loop.num_epochs=0', '--config.eval.every=0',
       '--config.loop.compilation_cache_dir=', *flags,
       f'--workdir={workdir}'],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
      check=False)


@pytest.mark.slow
def test_a_sabotaged_run_stops_before_epoch_1_with_one_line(tmp_path):
  # The tiny setting's test hook: episodes of these task ids raise in step().
  broken = ["--config.env.fail_task_ids=('reward-check',)"]
  proc = _main(broken, tmp_path / 'run')
  assert proc.returncode == 1, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and 'Traceback' not in proc.stderr, proc.stderr
  assert lines[0].startswith("error: reward check: setting 'tiny', case "
                             "'the dials opened in order' (a known pass) "
                             'raised RuntimeError'), lines[0]
  assert 'check_rewards=False' in lines[0]
  assert not (tmp_path / 'run').exists()  # nothing half-made is left
  # The switch turns the check off: the same run starts and finishes.
  proc = _main([*broken, '--config.loop.check_rewards=False'],
               tmp_path / 'run')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'reward check' not in proc.stdout
  proc = _main([], tmp_path / 'other')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "reward check: 2 known outcomes of 'tiny' right in" in proc.stdout
