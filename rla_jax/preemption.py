"""A run stopped or doubled by users and clusters: workdir lock and signals.

Lock: process 0 holds `fcntl.flock` on `<workdir>/run.lock` for the whole run
and writes its host, pid, start time and command into it. The kernel drops the
lock when the process dies, so a lock left by a dead run is taken over (and
reported: its details are still in the file, since only a clean exit clears
them); a second launch on a live run exits at once naming the holder.

Signals: SIGTERM (TPU/cloud preemption, SLURM, Kubernetes) and SIGINT set a
flag that `loop.run` reads at every stage boundary: entering each stage of an
epoch (`loop._Timer`), and before its evaluation and its checkpoint. What it
keeps depends on where the flag is seen:
- set-up, or an evaluation before the first epoch (the initial one, or one
  owed by the checkpoint): nothing new to keep; exit, it runs again.
- rollout, judge, curator, feedback, or entering the policy update: the train
  states are still those of the last completed epoch e-1, so epoch e is
  dropped. e-1 is checkpointed if it is not yet (checkpoint_every > 1), with
  the pool and data position held from the start of e; a rerun repeats e.
- during the policy update or later: the update's input state is gone (the
  states are donated to the jitted step), so the RM update is finished and
  epoch e checkpointed; an evaluation that was due but not started is marked
  pending in that checkpoint and runs first on resume.
- during the evaluation or the checkpoint: it finishes, then as above.
Then pool.jsonl and TensorBoard are flushed, the resume command is printed and
`loop.run` returns (exit 0). Seeds depend only on (seed, epoch, stage), so the
rerun ends with the pool and steps of an uninterrupted run. The first signal
also starts a watchdog: if the run has not stopped `grace_s` seconds later it
exits with 128 + signal, leaving the last committed checkpoint (set
loop.preempt_grace_s below the cluster's kill delay). It restores the default
action of both signals, so a second one ends the process at once, even inside
a long XLA call.

Multi-host: our handler replaces the SIGTERM hook that jax.distributed's
preemption sync manager installs (tsl SigtermNotifier uses std::signal), so
`reached_preemption_sync_point` would never fire; instead every stop check ORs
the processes' flags with one `process_allgather`. All processes make the same
checks in the same order, so they all reach the same decision at the same
boundary. A single process makes no collective.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

LOCK_FILE = 'run.lock'
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_current: Stopper | None = None  # the run's Stopper; signals are per process


class LockedError(RuntimeError):
  """Another live process runs in this workdir."""


class Preempted(Exception):
  """Raised at a stage boundary: the epoch is dropped (nothing of it kept)."""


def _holder() -> dict[str, object]:
  return dict(host=socket.gethostname(), pid=os.getpid(),
              started=datetime.datetime.now().astimezone().isoformat(
                  timespec='seconds'),
              command=' '.join(sys.argv))


def _read_holder(fd: int) -> dict | None:
  try:
    data = json.loads(os.pread(fd, 1 << 16, 0).decode() or 'null')
  except ValueError:  # being written, or not ours
    return None
  return data if isinstance(data, dict) else None


def _describe(holder: dict) -> str:
  get = lambda key: holder.get(key, '?')
  return (f'pid {get("pid")} on {get("host")}, started {get("started")} '
          f'({get("command")})')


class WorkdirLock:
  """An exclusive flock on `<workdir>/run.lock` while the `with` block runs."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.enabled = enabled
    self.stale: dict | None = None  # a dead holder's details, if taken over
    self._fd: int | None = None

  def __enter__(self) -> WorkdirLock:
    if not self.enabled:
      return self
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = None
      for _ in range(10):  # the holder writes its details just after locking
        holder = _read_holder(fd)
        if holder:
          break
        time.sleep(0.1)
      os.close(fd)
      who = (_describe(holder) if holder
             else 'a process whose details are not written yet')
      pid = (f' (kill -TERM {holder.get("pid")} on {holder.get("host")})'
             if holder else '')
      raise LockedError(
          f'{os.path.dirname(self.path)} is in use by another run: {who}. '
          f'Wait for it to finish, stop it{pid}, or use another --workdir.'
      ) from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
      os.close(fd)
      logging.warning('%s: this filesystem has no flock (%s); a second run '
                      'on this workdir is not prevented', self.path, e)
      return self
    self.stale = _read_holder(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder()).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def __exit__(self, *exc):
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def stale_message(self) -> str | None:
    """One line about a lock taken over from a dead run, if any."""
    if not self.stale:
      return None
    return (f'took over {self.path} from a run that ended without releasing '
            f'it: {_describe(self.stale)}')


def _any_process(flag: bool) -> bool:
  """`flag` OR-ed over all processes (the same answer on each)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


class Stopper:
  """SIGTERM/SIGINT -> a stop decision read at stage boundaries."""

  def __init__(self, grace_s: float):
    self.grace_s = grace_s
    self.signum: int | None = None
    self.where = 'set-up'  # the last boundary passed (named by the watchdog)
    # Set by the loop per epoch: True while dropping the epoch loses nothing.
    self.abandonable: Callable[[], bool] = lambda: False
    self._stop = False
    self._previous = {}
    self._watchdog: threading.Timer | None = None

  def __enter__(self) -> Stopper:
    global _current
    if threading.current_thread() is not threading.main_thread():
      logging.warning('not on the main thread: SIGTERM/SIGINT are not '
                      'handled (no checkpoint on preemption)')
    else:
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._on_signal)
    _current = self
    return self

  def __exit__(self, *exc):
    global _current
    _current = None
    if self._watchdog is not None:
      self._watchdog.cancel()
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _on_signal(self, signum, frame):
    del frame
    self.signum = signum
    for s in SIGNALS:  # a second signal: the default action, at once
      signal.signal(s, signal.SIG_DFL)
    self._watchdog = threading.Timer(self.grace_s, self._expire)
    self._watchdog.daemon = True
    self._watchdog.start()
    # os.write: print() may be interrupted mid-write of the same stream.
    os.write(2, (f'\nreceived {signal.Signals(signum).name}: stopping at the '
                 f'next stage boundary with a checkpoint (grace period '
                 f'{self.grace_s:g} s); a second signal stops at once\n'
                 ).encode())

  def _expire(self):
    os.write(2, (f'grace period of {self.grace_s:g} s ran out after '
                 f'"{self.where}"; exiting now: the next start resumes from '
                 'the last committed checkpoint\n').encode())
    os._exit(128 + self.signum)  # pylint: disable=protected-access

  def summary(self, checkpoint_path: str, eval_pending: bool,
              resume_command: str) -> str:
    """The line printed when the run has stopped."""
    name = signal.Signals(self.signum).name if self.signum else 'request'
    kept = (f'the last checkpoint is {checkpoint_path}' if checkpoint_path
            else 'no epoch had completed (nothing to checkpoint)')
    pending = ('; its evaluation runs first on resume' if eval_pending
               else '')
    how = resume_command or 'run the same config and workdir again'
    return (f'stopped by {name} at "{self.where}": {kept}{pending}. To '
            f'resume: {how}')

  def requested(self) -> bool:
    """Whether to stop; the same answer on every process."""
    if not self._stop:
      self._stop = _any_process(self.signum is not None)
    return self._stop

  def boundary(self, where: str):
    """A stage boundary: raises Preempted if stopping and nothing is lost."""
    self.where = where
    if self.requested() and self.abandonable():
      raise Preempted(where)


def check_keys(config):
  """Rejects bad values of the keys of stopping and skipping, by name."""
  if not config.loop.preempt_grace_s > 0:
    raise ValueError(f'config.loop.preempt_grace_s='
                     f'{config.loop.preempt_grace_s!r}: must be > 0 (seconds '
                     'from SIGTERM to exit)')
  for name in ('policy', 'reward_model'):
    limit = config.train[name].max_nonfinite_steps
    if not (isinstance(limit, int) and limit >= 1):
      raise ValueError(f'config.train.{name}.max_nonfinite_steps={limit!r}: '
                       'must be an integer >= 1 (non-finite steps in a row '
                       'before the run stops)')


def current() -> Stopper | None:
  """The Stopper of the run in progress (None outside `loop.run`)."""
  return _current


@contextlib.contextmanager
def guard(workdir: str, grace_s: float, chief: bool):
  """The workdir lock (process 0) and the signal handlers, for one run."""
  with WorkdirLock(workdir, enabled=chief) as lock, Stopper(grace_s) as stop:
    message = lock.stale_message()
    if message:
      print(message, flush=True)
    yield stop
