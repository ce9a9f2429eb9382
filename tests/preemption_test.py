"""One run per workdir, and SIGTERM/SIGINT: a clean stop the rerun continues."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rla_jax import checkpoint
from rla_jax import loop
from rla_jax import preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _python(code: str, *args: str):
  """A Python subprocess (one CPU device) running `code` with `args`."""
  env = dict(os.environ, XLA_FLAGS='', PYTHONPATH=ROOT)
  return subprocess.Popen([sys.executable, '-c', textwrap.dedent(code), *args],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _main(workdir, *flags):
  env = dict(os.environ, XLA_FLAGS='')  # one CPU device
  cmd = [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
         f'--workdir={workdir}', *flags]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, prefix: str) -> list[str]:
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith(prefix):
      return lines
  raise AssertionError(f'{prefix!r} never printed:\n{"".join(lines)}')


# ---- one run per workdir ---------------------------------------------------


def test_second_launch_exits_naming_the_holder(tmp_path):
  workdir = str(tmp_path)
  holder = _python(f"""
      import time
      from rla_jax import preemption
      with preemption.WorkdirLock({workdir!r}):
        print('locked', flush=True)
        time.sleep(600)
      """)
  try:
    _wait_for(holder, 'locked')
    start = time.time()
    second = _main(workdir, '--config.loop.num_epochs=1')
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 1, out
    assert time.time() - start < 60  # before any model is built
    assert f'is in use by another run: pid {holder.pid} on ' in out, out
    assert 'Traceback' not in out
    assert 'epoch 0' not in out and not os.path.exists(
        os.path.join(workdir, 'checkpoints'))
  finally:
    holder.kill()
    holder.wait()
  # The kernel released the dead holder's lock: it is taken over, and named.
  with preemption.WorkdirLock(workdir) as lock:
    assert lock.stale['pid'] == holder.pid
    assert f'pid {holder.pid}' in lock.stale_message()
    with pytest.raises(preemption.LockedError, match=f'pid {os.getpid()} '):
      with preemption.WorkdirLock(workdir):
        pass
  with open(os.path.join(workdir, preemption.LOCK_FILE)) as f:
    assert not f.read()  # a clean exit leaves no holder behind
  with preemption.WorkdirLock(workdir) as lock:
    assert lock.stale is None
  # Processes other than 0 don't take it.
  with preemption.WorkdirLock(str(tmp_path / 'none'), enabled=False):
    assert not os.path.exists(tmp_path / 'none')


# ---- the Stopper on its own --------------------------------------------------


def test_first_signal_sets_the_flag_and_a_second_gets_the_default():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Stopper(grace_s=30) as stopper:
    assert preemption.current() is stopper
    stopper.boundary('epoch 1: rollout')
    assert not stopper.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stopper.requested()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    stopper.boundary('epoch 1: rm_update')  # nothing may be dropped: go on
    stopper.abandonable = lambda: True
    with pytest.raises(preemption.Preempted, match='epoch 2: judge'):
      stopper.boundary('epoch 2: judge')
    assert 'stopped by SIGTERM at "epoch 2: judge"' in stopper.summary(
        '/w/checkpoints/1', False, 'python -m rla_jax.main --workdir=/w')
  assert preemption.current() is None
  assert signal.getsignal(signal.SIGTERM) == before


def test_second_signal_stops_at_once_and_the_grace_period_is_enforced():
  code = """
      import sys, time
      from rla_jax import preemption
      with preemption.Stopper(grace_s={grace}):
        print('ready', flush=True)
        time.sleep(60)  # a stage that outlasts the grace period
      """
  proc = _python(code.format(grace=30))
  _wait_for(proc, 'ready')
  start = time.time()
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == -signal.SIGTERM, out
  assert time.time() - start < 5
  assert 'a second signal stops at once' in out

  proc = _python(code.format(grace=1))
  _wait_for(proc, 'ready')
  start = time.time()
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGINT, out
  assert 1 <= time.time() - start < 10
  assert 'grace period of 1 s ran out after "set-up"' in out


def test_bad_stop_keys_are_named(tmp_path):
  config = tiny.get_config()
  config.loop.preempt_grace_s = 0
  with pytest.raises(ValueError, match=r'config.loop.preempt_grace_s=0'):
    loop.run(config, str(tmp_path))
  config = tiny.get_config()
  config.train.reward_model.max_nonfinite_steps = 0
  with pytest.raises(ValueError,
                     match=r'config.train.reward_model.max_nonfinite_steps=0'):
    loop.run(config, str(tmp_path))


# ---- SIGTERM at each point of an epoch: the rerun == an uninterrupted run ---
#
# Each run is a subprocess on one CPU device, like a user's. (Several tiny runs
# in one process on the 8 fake devices of conftest.py can deadlock XLA:CPU's
# collectives when two programs overlap on a loaded 2-core machine.)

# A run that signals itself from inside the function that runs at `where`,
# then, unpatched, the rerun: argv = point workdir loop-overrides-json.
DRIVER = """
import json, os, signal, sys
from configs import tiny
from rla_jax import checkpoint, judge, loop, preemption, rollout, train_epoch
point, workdir, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# What the run must put back (SIG_IGN under nohup or a background job).
handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
config = tiny.get_config()
config.loop.num_epochs = 2
config.loop.update(overrides)
if point != 'none':
  owner, name = dict(rollout=(rollout, 'run'), evaluation=(rollout, 'run'),
                     judge=(judge, 'score'),
                     policy_update=(train_epoch, 'update'),
                     checkpoint=(checkpoint.Checkpointer, 'save'))[point]
  real, sent = getattr(owner, name), []

  def wrapper(*args, **kwargs):
    if not sent and preemption.current().where == f'epoch 2: {point}':
      sent.append(point)
      os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

  setattr(owner, name, wrapper)
  loop.run(config, workdir, resume_command='RESUME')
  setattr(owner, name, real)
  assert sent, 'the signal was never sent'
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  meta = ckpt.meta(ckpt.latest_epoch())
  print('KEPT ' + json.dumps(dict(
      epoch=meta['epoch'], steps=meta['steps'],
      eval_pending=meta['eval_pending'], pool=len(meta['pool']),
      pool_jsonl=len(open(os.path.join(workdir, 'pool.jsonl')).readlines()),
      tmp=[f for f in os.listdir(ckpt.directory) if 'tmp' in f],
      handler=[signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
      == handlers,
      lock=open(os.path.join(workdir, 'run.lock')).read())), flush=True)
loop.run(config, workdir)
"""


def _drive(point: str, workdir: str, **loop_overrides):
  proc = _python(DRIVER, point, workdir, json.dumps(loop_overrides))
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  return out


def _outcome(workdir):
  """What an uninterrupted run must agree on: pool, steps, logged epochs."""
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  meta = ckpt.meta(ckpt.latest_epoch())
  with open(os.path.join(workdir, 'tb', 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  evals = sorted((r['step'], k, v) for r in rows for k, v in r.items()
                 if k.startswith('eval/') and k.endswith('/accuracy'))
  return dict(epoch=meta['epoch'], pool=loop.pool_digest(meta['pool']),
              steps=meta['steps'],
              epochs=[r['step'] for r in rows if 'rollout/accuracy' in r],
              evals=evals)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('uninterrupted'))
  _drive('none', workdir)
  return _outcome(workdir)


# point -> (epoch whose checkpoint the stop leaves, loop overrides)
POINTS = {
    'rollout': (1, dict(checkpoint_every=2)),  # epoch 1 is saved by the stop
    'judge': (1, {}),
    'policy_update': (2, {}),  # the RM update is finished, eval owed
    'checkpoint': (2, {}),
    'evaluation': (2, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize('point', list(POINTS))
def test_sigterm_stops_cleanly_and_the_rerun_matches(uninterrupted, tmp_path,
                                                     point):
  kept, overrides = POINTS[point]
  workdir = str(tmp_path)
  out = _drive(point, workdir, **overrides)
  first, rerun = out.split('KEPT ')
  assert f'stopped by SIGTERM at "epoch 2: ' in first, out
  assert 'To resume: RESUME' in first
  state = json.loads(rerun.splitlines()[0])
  assert state['epoch'] == kept, out
  assert state['steps']['policy'] == 2 * kept  # no half-trained epoch
  # Training finished, evaluation not started: it is owed to the rerun.
  assert state['eval_pending'] == (point == 'policy_update')
  assert state['tmp'] == [] and state['lock'] == ''
  assert state['pool_jsonl'] == state['pool']
  assert state['handler']  # the handlers from before the run are back
  assert f'resumed from epoch {kept} checkpoint' in rerun
  assert _outcome(workdir) == uninterrupted


@pytest.mark.slow
def test_sigterm_from_outside_exits_zero_within_the_grace_period(tmp_path):
  """The real thing: main in a subprocess, SIGTERM while the policy trains."""
  workdir = str(tmp_path)
  proc = _main(workdir, '--config.loop.num_epochs=2')
  lines = _wait_for(proc, 'epoch 2: policy_update')
  start = time.time()
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  out = ''.join(lines) + out
  assert proc.returncode == 0, out
  assert time.time() - start < 30  # loop.preempt_grace_s
  assert 'epoch 2 |' in out  # the epoch was finished and reported
  assert 'stopped by SIGTERM' in out
  assert (f'To resume: {sys.executable} -m rla_jax.main '
          f'--config=configs/tiny.py --workdir={workdir}') in out
  meta = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 2).meta(2)
  assert meta['steps'] == {'policy': 4, 'reward_model': 4}
  assert meta['eval_pending']
