"""Checkpoints that do not restore, and saves that fail, on configs/tiny.py.

Runs are `rla_jax.main` subprocesses on one CPU device, as a user runs them.
"""

# pylint: disable=protected-access  (the reason a failed save names)

import errno
import os
import shutil
import subprocess
import sys

import pytest

from rla_jax import checkpoint
from rla_jax import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# main with every JSON write into epoch 2's unfinished folder failing with
# ENOSPC (the disk fills up during that save).
DISK_FULL = """
import errno, os, runpy, sys
from etils import epath
path_cls = type(epath.Path('/'))
real = path_cls.write_text

def full(self, *args, **kwargs):
  if os.sep + '2.orbax-checkpoint-tmp' in os.fspath(self):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(self))
  return real(self, *args, **kwargs)

path_cls.write_text = full
sys.argv = ['main', *sys.argv[1:]]
runpy.run_module('rla_jax.main', run_name='__main__')
"""


def _main(workdir, *prefix):
  env = dict(os.environ, XLA_FLAGS='', PYTHONPATH=ROOT)  # one CPU device
  cmd = [*(prefix or (sys.executable, '-m', 'rla_jax.main')),
         '--config=configs/tiny.py', f'--workdir={workdir}',
         '--config.loop.num_epochs=2']
  proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=600,
                        check=False)
  return proc.returncode, proc.stdout


def _final(workdir):
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  meta = ckpt.meta(ckpt.latest_epoch())
  return meta['epoch'], loop.pool_digest(meta['pool']), meta['steps']


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A 2-epoch tiny run: checkpoints 1 and 2."""
  workdir = str(tmp_path_factory.mktemp('finished'))
  code, out = _main(workdir)
  assert code == 0, out
  return workdir, _final(workdir)


def _copy(finished, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(finished[0], workdir)
  return workdir, os.path.join(workdir, 'checkpoints')


def _damage(path):
  with open(path, 'w') as f:
    f.write('{"truncated')


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_and_is_moved_aside(finished,
                                                                tmp_path):
  workdir, ckpts = _copy(finished, tmp_path)
  _damage(os.path.join(ckpts, '2', 'policy', '_sharding'))
  code, out = _main(workdir)
  assert code == 0, out
  # One line naming the checkpoint and why.
  reported = [line for line in out.splitlines() if 'cannot be restored' in line]
  assert len(reported) == 1, out
  assert reported[0].endswith(
      f'checkpoint {ckpts}/2 cannot be restored: ValueError: '
      f'FAILED_PRECONDITION: Error reading local file '
      f'"{ckpts}/2/policy/_sharding": Invalid JSON'), reported
  assert 'resumed from epoch 1 checkpoint' in out
  # Kept, not deleted; epoch 2 was trained again, to the same result.
  with open(os.path.join(ckpts, checkpoint.DAMAGED, '2', 'policy',
                         '_sharding')) as f:
    assert f.read() == '{"truncated'
  assert _final(workdir) == finished[1]


@pytest.mark.slow
def test_no_restorable_checkpoint_stops_naming_the_folder(finished, tmp_path):
  workdir, ckpts = _copy(finished, tmp_path)
  for epoch in ('1', '2'):
    _damage(os.path.join(ckpts, epoch, 'meta', 'metadata'))
  code, out = _main(workdir)
  assert code == 1, out
  assert f'error: no checkpoint in {ckpts} restores (epochs 2, 1;' in out
  assert 'Traceback' not in out
  assert sorted(os.listdir(ckpts)) == ['1', '2']  # nothing moved


@pytest.mark.slow
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(finished,
                                                               tmp_path):
  workdir, ckpts = _copy(finished, tmp_path)
  shutil.rmtree(os.path.join(ckpts, '2'))  # the rerun saves epoch 2 again
  code, out = _main(workdir, sys.executable, '-c', DISK_FULL)
  assert code == 1, out
  assert (f'error: saving the epoch 2 checkpoint in {ckpts} failed: no space '
          'left on the device') in out, out
  assert f'the epoch 1 checkpoint ({ckpts}/1) is intact' in out
  assert 'the unfinished 2.orbax-checkpoint-tmp is removed at the next start' \
      in out
  # orbax logs its own threads' tracebacks too; ours is one line.
  assert out.count('error: ') == 1
  ckpt = checkpoint.Checkpointer(ckpts, 2)
  assert ckpt.epochs() == [1] and ckpt.meta(1)['epoch'] == 1
  # With space again, the same command resumes and cleans up.
  code, out = _main(workdir)
  assert code == 0, out
  assert sorted(os.listdir(ckpts)) == ['1', '2']
  assert _final(workdir) == finished[1]


def test_failure_reasons_name_the_os_error(tmp_path):
  # tensorstore (array data) names the OS error only in its message.
  tensorstore = ValueError(
      'RESOURCE_EXHAUSTED: Error writing "step/0" in OCDBT database at local '
      'file "/x/2.orbax-checkpoint-tmp/policy/": Failed to write 230760 bytes '
      "to file 4: No space left on device [os_error_code='28']")
  assert checkpoint._errno(tensorstore) == errno.ENOSPC
  wrapped = RuntimeError('commit failed')
  wrapped.__cause__ = PermissionError(errno.EACCES, 'Permission denied')
  assert checkpoint._errno(wrapped) == errno.EACCES
  ckpt = checkpoint.Checkpointer(str(tmp_path), 2)
  message = ckpt._save_failure(1, wrapped)
  assert 'the folder is not writable (Permission denied)' in message
  assert 'there is no earlier checkpoint' in message
