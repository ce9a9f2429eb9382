"""Orbax checkpoints of a whole run: both train states, the pool, RNG, epoch.

One checkpoint per saved epoch, written atomically by orbax (a temporary
folder renamed on commit), so a run killed at any moment resumes from the
last committed epoch with the same task pool, data position and optimizer
state.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class ConfigMismatchError(ValueError):
  """The checkpoint holds arrays the current config does not build."""


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


class Checkpointer:
  """Saves and restores {name: pytree} plus a JSON `meta` dict per epoch."""

  def __init__(self, directory: str, keep: int, names=('policy',
                                                        'reward_model')):
    self.directory = os.path.abspath(directory)
    handlers = {name: ocp.StandardCheckpointHandler() for name in names}
    handlers['meta'] = ocp.JsonCheckpointHandler()
    self._manager = ocp.CheckpointManager(
        self.directory, item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_epoch(self) -> int | None:
    self._manager.reload()  # another process may have written since
    return self._manager.latest_step()

  def save(self, epoch: int, trees: dict[str, Any], meta: dict[str, Any]):
    args = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
    args['meta'] = ocp.args.JsonSave(meta)
    self._manager.save(epoch, args=ocp.args.Composite(**args))
    self._manager.wait_until_finished()

  def _check_shapes(self, epoch: int, targets: dict[str, Any]):
    stored = self._manager.item_metadata(epoch)
    for name, target in targets.items():
      if name not in stored or stored[name] is None:
        raise ConfigMismatchError(
            f'{self.directory}/{epoch}: checkpoint has no {name!r} state; '
            'it was written by a run with a different config')
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
    args = {name: ocp.args.StandardRestore(tree)
            for name, tree in abstract.items()}
    args['meta'] = ocp.args.JsonRestore()
    restored = self._manager.restore(epoch, args=ocp.args.Composite(**args))
    return {name: restored[name] for name in targets}, restored['meta']

  def meta(self, epoch: int) -> dict[str, Any]:
    """The JSON part of a checkpoint alone."""
    return self._manager.restore(
        epoch, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def close(self):
    self._manager.close()
