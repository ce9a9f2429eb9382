"""Orbax checkpoints of a whole run: both train states, the pool, RNG, epoch.

One checkpoint per saved epoch, written atomically by orbax (a temporary
folder renamed on commit), so a run killed at any moment resumes from the
last committed epoch with the same task pool, data position and optimizer
state. Temporary folders of saves that never committed are removed when the
run starts again (orbax `cleanup_tmp_directories`).

Resume takes the newest checkpoint that restores: each one that does not is
reported (path and reason) and, once an older one has restored, moved to
`<checkpoints>/damaged/` (never deleted). When none restores nothing is moved
and `RestoreError` stops the run. A save that fails (disk full, folder not
writable) raises `SaveError`; orbax deletes old checkpoints only after a new
one commits, so the previous ones are intact.
"""

from __future__ import annotations

import copy
import errno
import glob
import logging
import os
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rla_jax import curator
from rla_jax import train

DAMAGED = 'damaged'  # subfolder for checkpoints that do not restore


class ConfigMismatchError(ValueError):
  """The checkpoint holds arrays the current config does not build."""


class RestoreError(RuntimeError):
  """No checkpoint in the folder restores."""


class SaveError(RuntimeError):
  """A checkpoint could not be written; the earlier ones are intact."""


def _path_str(path) -> str:
  parts = []
  for key in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return '.'.join(parts)


def _shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {_path_str(p): tuple(getattr(x, 'shape', ())) for p, x in leaves}


def _one_line(error: BaseException, limit: int = 300) -> str:
  text = ' '.join(str(error).split()) or repr(error)
  text = f'{type(error).__name__}: {text}'
  return text if len(text) <= limit else text[:limit - 3] + '...'


def _errno(error: BaseException) -> int | None:
  """The OS error code behind an error (tensorstore only names it in text)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno:
      return error.errno
    found = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", str(error))
    if found:
      return int(found.group(1) or found.group(2))
    error = error.__cause__ or error.__context__
  return None


def _all_processes(ok: bool) -> bool:
  """`ok` AND-ed over processes, so every host takes the same checkpoint."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


class Checkpointer:
  """Saves and restores {name: pytree} plus a JSON `meta` dict per epoch.

  `clean_tmp` removes unfinished saves at start-up: only for the process
  that owns the folder (holds the workdir lock), never for a reader.
  """

  def __init__(self, directory: str, keep: int, names=('policy',
                                                        'reward_model'),
               *, clean_tmp: bool = False):
    self.directory = os.path.abspath(directory)
    # Zarr v2 without compression: orbax's default (zarr3, zstd) held ~1.7 GB
    # of write buffers and took ~8 s for the default's two SmolLM2-135M states
    # (2.7 GB of float32 weights and moments, which barely compress); this
    # writes them in ~2 s with no extra memory.
    handlers = {name: ocp.PyTreeCheckpointHandler(use_zarr3=False,
                                                  use_compression=False)
                for name in names}
    handlers['meta'] = ocp.JsonCheckpointHandler()
    self._name_format = ocp.path.step.standard_name_format()  # orbax's
    self._manager = ocp.CheckpointManager(
        self.directory, item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=clean_tmp))
    self._save_failed = False

  def epochs(self) -> list[int]:
    self._manager.reload()  # another process may have written since
    return sorted(self._manager.all_steps())

  def latest_epoch(self) -> int | None:
    epochs = self.epochs()
    return epochs[-1] if epochs else None

  def path(self, epoch: int) -> str:
    return os.fspath(ocp.path.step.build_step_path(
        self.directory, self._name_format, epoch))

  def save(self, epoch: int, trees: dict[str, Any], meta: dict[str, Any]):
    """Writes the epoch's checkpoint and waits for its commit."""
    args = {name: ocp.args.PyTreeSave(tree) for name, tree in trees.items()}
    args['meta'] = ocp.args.JsonSave(meta)
    try:
      saved = self._manager.save(epoch, args=ocp.args.Composite(**args))
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._save_failed = True
      raise SaveError(self._save_failure(epoch, e)) from e
    if not saved:
      raise SaveError(f'{self.directory}: orbax skipped the save of epoch '
                      f'{epoch} (the latest is {self.latest_epoch()})')

  def _save_failure(self, epoch: int, error: Exception) -> str:
    code = _errno(error)
    if code in (errno.ENOSPC, errno.EDQUOT):
      free = shutil.disk_usage(self.directory).free / 2**20
      why = f'no space left on the device ({free:.0f} MiB free)'
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
      why = f'the folder is not writable ({os.strerror(code)})'
    else:
      why = _one_line(error)
    latest = self.latest_epoch()
    kept = (f'the epoch {latest} checkpoint ({self.path(latest)}) is intact '
            'and the next run resumes from it' if latest is not None
            else 'there is no earlier checkpoint')
    tmp = glob.glob(f'{self.path(epoch)}.orbax-checkpoint-tmp*')
    tmp = (f'; the unfinished {os.path.basename(tmp[0])} is removed at the '
           'next start' if tmp else '')
    return (f'saving the epoch {epoch} checkpoint in {self.directory} failed: '
            f'{why}; {kept}{tmp}. Free space (or fix permissions) and run '
            'the same command again.')

  def _check_shapes(self, epoch: int, targets: dict[str, Any]):
    stored = self._manager.item_metadata(epoch)
    for name, target in targets.items():
      if name not in stored or stored[name] is None:
        # Both names are always saved: a missing one is a damaged folder.
        raise ValueError(f'no readable {name!r} metadata')
      have = _shapes(stored[name])
      want = _shapes(target)
      # Parameters first: their names say most about what differs.
      for key in sorted(want, key=lambda k: not k.startswith('params.')):
        shape = want[key]
        if key not in have:
          raise ConfigMismatchError(
              f'{self.directory}/{epoch}: {name}.{key} is not in the '
              'checkpoint; the config does not match this workdir\'s run '
              '(use a new --workdir or the original config)')
        if have[key] != shape:
          raise ConfigMismatchError(
              f'{self.directory}/{epoch}: {name}.{key} has shape {have[key]} '
              f'in the checkpoint but the config builds {shape}; use a new '
              '--workdir or the original config')

  def restore(self, epoch: int, targets: dict[str, Any]):
    """Restores into the shapes and shardings of `targets`; returns (trees, meta)."""
    self._check_shapes(epoch, targets)
    abstract = {name: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
                for name, tree in targets.items()}
    args = {name: ocp.args.PyTreeRestore(
        tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
            for name, tree in abstract.items()}
    args['meta'] = ocp.args.JsonRestore()
    restored = self._manager.restore(epoch, args=ocp.args.Composite(**args))
    return {name: restored[name] for name in targets}, restored['meta']

  def restore_newest(self, targets: dict[str, Any]):
    """(epoch, trees, meta) of the newest checkpoint that restores, or None.

    Raises:
      ConfigMismatchError: the config builds other shapes (no fallback: an
        older checkpoint of the same run has the same shapes).
      RestoreError: there are checkpoints but none restores.
    """
    failed = []
    for epoch in reversed(self.epochs()):
      try:
        trees, meta = self.restore(epoch, targets)
        error = None
      except ConfigMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        error = e
      if _all_processes(error is None):
        self._move_aside(failed)
        return epoch, trees, meta
      reason = _one_line(error) if error else 'fails on another process'
      logging.warning('checkpoint %s cannot be restored: %s',
                      self.path(epoch), reason)
      failed.append(epoch)
    if failed:
      raise RestoreError(
          f'no checkpoint in {self.directory} restores (epochs '
          f'{", ".join(map(str, failed))}; reasons logged above). Nothing was '
          'moved: repair or move them away (the run then starts from epoch '
          '1), or use another --workdir.')
    return None

  def _move_aside(self, epochs: list[int]):
    """Renames unrestorable checkpoints into `damaged/` (process 0)."""
    if not epochs:
      return
    if jax.process_index() == 0:
      os.makedirs(os.path.join(self.directory, DAMAGED), exist_ok=True)
      for epoch in epochs:
        dest = os.path.join(self.directory, DAMAGED, str(epoch))
        n = 1
        while os.path.exists(dest):  # damaged before: keep both
          n += 1
          dest = os.path.join(self.directory, DAMAGED, f'{epoch}-{n}')
        os.rename(self.path(epoch), dest)
        logging.warning('moved the unrestorable checkpoint %s to %s',
                        self.path(epoch), dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices('rla_jax checkpoint moved aside')
    self._manager.reload()

  def meta(self, epoch: int) -> dict[str, Any]:
    """The JSON part of a checkpoint alone."""
    return self._manager.restore(
        epoch, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def close(self):
    try:
      self._manager.close()
    except Exception:  # pylint: disable=broad-exception-caught
      if not self._save_failed:  # else orbax repeats the SaveError's cause
        raise


# ---- a whole run (`run` is a runtime.Run) --------------------------------------


def run_meta(run, epoch: int) -> dict[str, Any]:
  """The JSON part of epoch `epoch`'s checkpoint, from the run as it is now."""
  return {'epoch': epoch, 'pool': curator.state(run.pool),
          'task_order': copy.deepcopy(run.order.get_state()),
          'seed': run.config.seed,
          'steps': {name: int(s.step) for name, s in run.states.items()},
          'nonfinite_streak': {name: t.nonfinite_streak
                               for name, t in run.trainers.items()},
          'eval_pending': run.eval_pending}


def save_run(ckpt: Checkpointer, run, epoch: int, meta=None):
  """Checkpoints both train states with `meta` (default: `run_meta` now)."""
  ckpt.save(epoch, {name: train.state_dict(s)
                    for name, s in run.states.items()},
            meta or run_meta(run, epoch))
  run.saved_epoch = epoch


def restore_run(ckpt: Checkpointer, run) -> int:
  """Loads the newest checkpoint that restores; returns its epoch (0: none)."""
  found = ckpt.restore_newest({name: train.state_dict(s)
                               for name, s in run.states.items()})
  if found is None:
    return 0
  epoch, trees, meta = found
  run.states = {name: train.state_from_dict(trees[name])
                for name in run.states}
  run.pool = curator.from_state(meta['pool'])
  run.order.set_state(meta['task_order'])
  # Checkpoints written before non-finite steps were skipped lack these two.
  for name, count in meta.get('nonfinite_streak', {}).items():
    run.trainers[name].nonfinite_streak = count
  run.saved_epoch, run.eval_pending = epoch, meta.get('eval_pending', False)
  return epoch
