"""A workdir started again: a complete run says so, another experiment is
refused.

The finished run is a `rla_jax.main` subprocess on one CPU device (configs/
tiny.py, one epoch); each test works on a copy of it (mtimes kept, as the
completeness check compares the last checkpoint's files).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from rla_jax import loop
from rla_jax import resume
from rla_jax import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _main(workdir, *flags):
  env = dict(os.environ, XLA_FLAGS='')  # one CPU device, like a user's
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
       f'--workdir={workdir}', '--config.loop.num_epochs=1', *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  return proc, time.perf_counter() - start


def _config(**loop_keys):
  config = tiny.get_config()
  config.loop.num_epochs = 1
  config.loop.update(loop_keys)
  return config


def _listing(workdir):
  """Every file under `workdir` with its size, mtime and content hash."""
  found = {}
  for root, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, workdir)] = (
            os.path.getsize(path), os.stat(path).st_mtime_ns, hash(f.read()))
  return found


def _last_eval(workdir):
  with open(os.path.join(workdir, 'tb', 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  row = [r for r in rows if 'eval/eval/accuracy' in r][-1]
  return row['step'], row['eval/eval/accuracy']


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('finished') / 'run')
  proc, seconds = _main(workdir)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  print(f'one tiny epoch through main in {seconds:.1f} s')
  return workdir


@pytest.fixture
def copy(finished, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(finished, workdir)  # copy2: mtimes kept
  return workdir


@pytest.fixture
def no_setup(monkeypatch):
  def setup(*args):
    raise AssertionError(f'runtime.setup{args} called: a model was loaded')

  monkeypatch.setattr(runtime, 'setup', setup)


def test_a_new_config_matches_the_config_json_a_run_writes():
  # Tuples become lists through JSON, and 0-limits are resolved by set-up.
  config = _config()
  assert runtime.config_changes(runtime.as_json(config), _config()) == []
  written = json.loads(config.to_json_best_effort())
  assert isinstance(written['rollout']['sampling']['stop_strings'], list)
  del written['curator']['alpha_low']  # a key the code added since
  assert runtime.config_changes(written, _config()) == []
  zero = _config()  # 0 = the judge sampler's 256, as set-up writes it
  zero.train.reward_model.max_prompt_len = 0
  assert runtime.config_changes(written, zero) == []
  changed = _config(num_epochs=5, env_threads=1, allow_config_change=True)
  changed.mesh.fsdp = 1
  changed.eval.every = 0
  changed.train.policy.micro_batch_size = 2
  assert runtime.config_changes(written, changed) == []
  changed = tiny.get_config('policy')
  changed.optim.policy.learning_rate = 0.5
  assert runtime.config_changes(written, changed) == [
      ('curator.enabled', True, False), ('loop.train_rm', True, False),
      ('optim.policy.learning_rate', 1e-3, 0.5)]


@pytest.mark.slow
def test_a_complete_run_started_again_says_so_without_loading(copy, no_setup,
                                                              capsys):
  before = _listing(copy)
  start = time.perf_counter()
  values = loop.run(_config(), copy)
  seconds = time.perf_counter() - start
  out = capsys.readouterr().out
  print(out, f'the complete path took {seconds:.2f} s in-process')
  epoch, accuracy = _last_eval(copy)
  assert f'{copy}: the run is complete (1 epoch trained); nothing to do' in out
  assert (f'last evaluation (epoch {epoch}): eval/eval/accuracy='
          f'{accuracy:.3f}') in out
  assert values['eval/eval/accuracy'] == accuracy
  assert seconds < 5
  # Nothing changed in the workdir (the lock file is written and cleared).
  after = _listing(copy)
  assert {k: v for k, v in after.items() if k != 'run.lock'} == {
      k: v for k, v in before.items() if k != 'run.lock'}
  with open(os.path.join(copy, 'run.lock')) as f:
    assert f.read() == ''


@pytest.mark.slow
def test_the_complete_command_is_fast(copy):
  proc, seconds = _main(copy)
  print(f'main on a complete run: {seconds:.1f} s\n{proc.stdout}')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'the run is complete (1 epoch trained)' in proc.stdout
  assert 'last evaluation (epoch 1): eval/eval/accuracy=' in proc.stdout
  assert 'resumed from' not in proc.stdout
  assert seconds < 20  # imports and devices only (~5 s on a busy 2-core box)


@pytest.mark.slow
def test_a_damaged_last_checkpoint_is_not_complete(copy):
  config = _config()
  complete = resume.complete
  assert complete(config, copy)['epoch'] == 1
  with open(os.path.join(copy, 'checkpoints', '1', 'policy', '_sharding'),
            'a') as f:
    f.write(' ')
  assert complete(config, copy) is None  # a resume finds the damage
  shutil.rmtree(os.path.join(copy, 'checkpoints', '1'))
  assert complete(config, copy) is None


@pytest.mark.slow
def test_another_experiment_is_refused_naming_the_keys(copy):
  before = _listing(copy)
  proc, _ = _main(copy, '--config.feedback.lam=0.5',
                  '--config.loop.train_rm=False', '--config.seed=7')
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0] == (
      f'error: {copy} was run with another config: feedback.lam (1.0 -> 0.5), '
      'loop.train_rm (true -> false), seed (0 -> 7); resume with the config '
      f'in {copy}/config.json, use a new --workdir, or allow the change with '
      '--config.loop.allow_config_change=True'), lines[0]
  assert _listing(copy) == before  # nothing written, no lock taken


@pytest.mark.slow
def test_allow_config_change_accepts_another_experiment(copy, no_setup,
                                                        capsys):
  config = _config(allow_config_change=True)
  config.feedback.lam = 0.5
  loop.run(config, copy)  # nothing left to train: complete, no set-up
  out = capsys.readouterr().out
  assert (f'config changed from {copy}/config.json '
          '(loop.allow_config_change): feedback.lam (1.0 -> 0.5)') in out
  assert 'the run is complete' in out


@pytest.mark.slow
def test_more_epochs_resume_and_complete_again(copy, capsys):
  last = loop.run(_config(num_epochs=2), copy)
  out = capsys.readouterr().out
  assert 'resumed from epoch 1 checkpoint; starting epoch 2' in out
  assert 'the run is complete' not in out
  assert _last_eval(copy) == (2, last['eval/eval/accuracy'])
  with open(os.path.join(copy, 'config.json')) as f:
    assert json.load(f)['loop']['num_epochs'] == 2
  with open(os.path.join(copy, resume.COMPLETE)) as f:
    assert json.load(f)['epoch'] == 2
  loop.run(_config(num_epochs=2), copy)
  assert 'the run is complete (2 epochs trained)' in capsys.readouterr().out
