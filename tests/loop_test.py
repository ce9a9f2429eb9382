"""End to end: configs/tiny.py through main, resume, SIGKILL, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rla_jax import checkpoint
from rla_jax import curator
from rla_jax import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _main(workdir, *flags, **popen):
  env = dict(os.environ)
  env['XLA_FLAGS'] = ''  # one CPU device, like a user's laptop
  cmd = [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
         f'--workdir={workdir}', *flags]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **popen)


def _events(workdir):
  tb = os.path.join(workdir, 'tb')
  return [f for f in os.listdir(tb) if f.startswith('events.out.tfevents')]


def _scalars(workdir):
  with open(os.path.join(workdir, 'tb', 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _read_tb_scalars(workdir, tag):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, 'tb'))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope='module')
def two_epochs(tmp_path_factory):
  """configs/tiny.py for 2 epochs in-process on the 8-device mesh."""
  workdir = str(tmp_path_factory.mktemp('tiny'))
  config = tiny.get_config()
  config.loop.num_epochs = 2
  start = time.time()
  last = loop.run(config, workdir)
  print(f'2 tiny epochs in {time.time() - start:.1f} s: {last}')
  return workdir, config, last


def test_two_epochs_write_events_pool_and_checkpoint(two_epochs):
  workdir, _, last = two_epochs
  assert _events(workdir)
  steps = _read_tb_scalars(workdir, 'rollout/accuracy')
  assert [s for s, _ in steps] == [1, 2]
  for key in ('policy/loss', 'policy/kl', 'curator/pool_difficulty',
              'time/rollout_s', 'judge/parse_fail_rate', 'eval/accuracy'):
    assert key in last, key
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  assert len(pool) == 12
  assert checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 2).latest_epoch() == 2
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['loop']['num_epochs'] == 2


def test_rewrites_are_requested_and_judged(two_epochs):
  workdir, _, _ = two_epochs
  rows = _scalars(workdir)
  assert sum(r.get('curator/created', 0) for r in rows) > 0
  decided = sum(r.get('curator/accepted', 0) + r.get('curator/rejected', 0)
                for r in rows)
  assert decided > 0
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  events = [e for t in pool for e in t.history]
  assert len(events) == decided
  for e in events:
    assert e['critiques'] is not None and e['direction'] in ('harder',
                                                             'easier')


def test_second_invocation_resumes_at_epoch_three(two_epochs, tmp_path):
  workdir, _, _ = two_epochs
  proc = _main(workdir, '--config.loop.num_epochs=3')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  assert 'resumed from epoch 2 checkpoint; starting epoch 3' in out
  assert 'epoch 1:' not in out and 'epoch 3 |' in out
  assert [r['step'] for r in _scalars(workdir)
          if 'rollout/accuracy' in r] == [1, 2, 3]


def test_sigkill_mid_epoch_resumes_with_same_pool_and_step(tmp_path):
  workdir = str(tmp_path / 'killed')
  proc = _main(workdir, '--config.loop.num_epochs=1')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  meta = ckpt.meta(1)
  # Epoch 2 is killed while the policy is being updated.
  proc = _main(workdir, '--config.loop.num_epochs=2')
  for line in proc.stdout:
    if line.startswith('epoch 2: policy_update'):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert ckpt.latest_epoch() == 1
  proc = _main(workdir, '--config.loop.num_epochs=2')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  expected = (f'resumed from epoch 1 checkpoint; starting epoch 2 '
              f'(pool {loop.pool_digest(meta["pool"])}, '
              f'policy step {meta["steps"]["policy"]})')
  assert expected in out, out
  assert ckpt.latest_epoch() == 2


def test_checkpoint_of_another_config_fails_clearly(two_epochs):
  workdir, _, _ = two_epochs
  config = tiny.get_config()
  config.loop.num_epochs = 4
  config.policy.random.intermediate_size = 96
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r'policy\.params\.layers\.0\.mlp\.w_down has shape '
                     r'\(128, 64\) in the checkpoint but the config builds '
                     r'\(96, 64\)'):
    loop.run(config, workdir)


def test_malformed_config_key_is_named(tmp_path):
  proc = _main(str(tmp_path), '--config.rollout.temprature=0.5')
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert 'temprature' in out


def test_bad_value_and_missing_model_path_are_named(tmp_path):
  config = tiny.get_config()
  config.curator.alpha_low = 0.9
  with pytest.raises(ValueError, match=r'config.curator.alpha_low=0.9'):
    loop.run(config, str(tmp_path / 'a'))
  config = tiny.get_config()
  config.policy.path = str(tmp_path / 'no_such_model')
  with pytest.raises(ValueError, match=r'config.policy.path=.*no_such_model.*'
                     'does not exist'):
    loop.run(config, str(tmp_path / 'b'))


def test_environment_errors_become_error_trajectories(tmp_path):
  config = tiny.get_config()
  config.env.fail_task_ids = tuple(f'train{i:04d}' for i in range(12))
  config.rollout.num_tasks = 2
  config.loop.num_epochs = 1
  config.eval.every = 0
  last = loop.run(config, str(tmp_path))
  assert last['rollout/errors'] == last['rollout/trajectories'] > 0
  assert last['feedback/error_trajectories'] == last['rollout/errors']
  assert last['policy/examples'] == 0
