"""Device mesh and the logical-axis rules that place arrays on it.

Parameters, activations, batches and KV caches are annotated with logical axis
names; one rules table maps each name to mesh axes. A mesh axis that does not
divide a dimension is dropped for that array (it stays replicated there), so
the same rules serve a 135M model on 8 CPU devices and a 7B model on a pod.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('norm', None),
    ('layers', None),  # the stacked layer axis (of parameters and KV cache)
    # activations and batches
    ('batch', ('data', 'fsdp')),
    ('length', None),
    ('act_embed', None),
    ('act_mlp', 'tensor'),
    ('act_vocab', 'tensor'),
    # KV cache
    ('cache_batch', ('data', 'fsdp')),
    ('cache_length', None),
    ('cache_kv_heads', 'tensor'),
)

_ACTIVE_RULES = contextvars.ContextVar('rla_jax_rules', default=DEFAULT_RULES)


def resolve_rules(overrides: Iterable[Sequence] = ()) -> tuple:
  """DEFAULT_RULES with `overrides` ((name, axes) pairs) replacing entries."""
  rules = dict(DEFAULT_RULES)
  for i, pair in enumerate(overrides):
    if len(pair) != 2:
      raise ValueError(f'mesh.rules[{i}]={pair!r}: expected (name, axes)')
    name, axes = pair
    if name not in rules:
      raise ValueError(f'mesh.rules[{i}]: unknown logical axis {name!r}; '
                       f'known: {sorted(rules)}')
    axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
    for axis in axes_tuple:
      if axis not in MESH_AXES:
        raise ValueError(f'mesh.rules[{i}]: {name!r} maps to unknown mesh '
                         f'axis {axis!r}; mesh axes are {MESH_AXES}')
    rules[name] = tuple(axes_tuple) if len(axes_tuple) > 1 else (
        axes_tuple[0] if axes_tuple else None)
  return tuple(rules.items())


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh; one size may be -1 (use the rest)."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f'mesh sizes {dict(zip(MESH_AXES, sizes))}: at most one '
                     'may be -1')
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f'mesh sizes {dict(zip(MESH_AXES, sizes))} do not '
                       f'divide {len(devices)} devices')
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f'mesh sizes {dict(zip(MESH_AXES, sizes))} need '
                     f'{int(np.prod(sizes))} devices, have {len(devices)}')
  return jax.make_mesh(tuple(sizes), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def mesh_from_config(mesh_config) -> Mesh:
  return make_mesh(mesh_config.data, mesh_config.fsdp, mesh_config.tensor)


@contextlib.contextmanager
def use(mesh: Mesh | None, rules: tuple = DEFAULT_RULES):
  """Activates `mesh` (jax.set_mesh) and `rules` for `constrain` calls."""
  token = _ACTIVE_RULES.set(rules)
  try:
    if mesh is None:
      yield
    else:
      with jax.set_mesh(mesh):
        yield
  finally:
    _ACTIVE_RULES.reset(token)


def spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None,
         mesh, rules: tuple | None = None) -> PartitionSpec:
  """PartitionSpec for an array; mesh axes that don't divide a dim are dropped."""
  table = dict(rules if rules is not None else _ACTIVE_RULES.get())
  used: set[str] = set()
  out = []
  for dim, name in enumerate(logical_axes):
    if name is not None and name not in table:
      raise KeyError(f'logical axis {name!r} has no sharding rule')
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept = []
    size = 1
    for axis in axes:
      n = mesh.shape[axis]
      if axis in used or n == 1:
        continue
      if shape is not None and shape[dim] % (size * n):
        continue
      kept.append(axis)
      size *= n
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def named(mesh: Mesh, logical_axes, shape, rules=None) -> NamedSharding:
  return NamedSharding(mesh, spec(logical_axes, shape, mesh, rules))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint under the active mesh; a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(
      x, spec(logical_axes, x.shape, mesh))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(abstract_state, mesh: Mesh, rules: tuple = DEFAULT_RULES):
  """Pure-dict tree of NamedShardings for an (abstract) nnx.State of Params."""

  def one(v):
    axes = v.get_metadata().get('logical_axes')
    if axes is None:
      raise ValueError(f'parameter of shape {v.shape} has no logical_axes')
    return named(mesh, axes, v.shape, rules)

  return nnx.to_pure_dict(
      jax.tree.map(lambda v: v.replace(one(v)), abstract_state,
                   is_leaf=_is_variable))


def to_host(x) -> np.ndarray:
  """The whole array on this host, also when other processes hold shards."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable
                                       or x.is_fully_replicated):
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
