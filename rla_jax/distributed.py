"""Multi-host runs: JAX's multi-controller runtime and host-side exchanges.

Every process runs the same loop (SPMD): the sampler and train steps are one
program over the global mesh. Host-side work is split instead of repeated:
process p steps the environment episodes (and runs the unit tests) whose
index i has i % process_count == p, and `allgather` gives every process the
results of all of them, so every process builds the same prompts and the same
training batch. `broadcast` sends process 0's objects (the task pool).

The exchanges pickle Python objects: every process runs this program, so the
peers are trusted. With one process they return at once, without
collectives.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rla_jax import sharding


def initialize(*, coordinator: str = '', num_processes: int = 0,
               process_id: int = -1, heartbeat_timeout_s: int = 60) -> None:
  """jax.distributed.initialize from flags, or from the cluster it is on.

  With `coordinator` (host:port of process 0), `num_processes` and
  `process_id` the processes are named explicitly (the local launcher, a
  hand-started cluster); otherwise JAX detects a TPU slice or a SLURM job.
  A process that stops sending heartbeats for `heartbeat_timeout_s` makes
  every other process exit (no hang on a dead peer). CPU processes exchange
  over gloo.
  """
  # Collectives between CPU devices of different processes; accelerators use
  # their own (ICI, NCCL), so this is harmless there.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  kwargs = dict(heartbeat_timeout_seconds=heartbeat_timeout_s)
  if coordinator:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f'--coordinator={coordinator} needs --num_processes >= 1 '
                       f'and 0 <= --process_id < num_processes (got '
                       f'{num_processes}, {process_id})')
    kwargs.update(coordinator_address=coordinator,
                  num_processes=num_processes, process_id=process_id)
  jax.distributed.initialize(**kwargs)


def describe() -> str:
  """One line: platform, devices and processes this run got."""
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  return (f'platform {jax.default_backend()} ({", ".join(kinds)}): '
          f'{len(devices)} devices, {jax.local_device_count()} on this host, '
          f'{jax.process_count()} process(es), this is process '
          f'{jax.process_index()}')


def check_devices(mesh_config) -> None:
  """Refuses a mesh that asks for more devices than this run has.

  Such a config was written for accelerators; on a CPU-only install (the
  default `launch/setup.sh cpu`) it would otherwise fail deep in XLA or run
  on host CPUs.
  """
  sizes = {a: mesh_config[a] for a in ('data', 'fsdp', 'tensor')}
  wanted = int(np.prod([s for s in sizes.values() if s != -1]))
  have = jax.device_count()
  if wanted > have or have % wanted:
    platform = jax.default_backend()
    hint = (' This JAX sees only CPUs: install the accelerator build with '
            '`bash launch/setup.sh tpu` or `bash launch/setup.sh cuda`.'
            if platform == 'cpu' else '')
    raise ValueError(
        f'config.mesh {sizes} needs a multiple of {wanted} devices but this '
        f'run has {have} {platform} device(s).{hint}')


def is_multiprocess() -> bool:
  return jax.process_count() > 1


def owns(index: int) -> bool:
  """Whether this process does the host-side work of item `index`."""
  return index % jax.process_count() == jax.process_index()


# Bytes this process contributed to exchanges since the last `take_traffic`.
_SENT = collections.Counter()


def take_traffic() -> dict[str, int]:
  """{'allgather': bytes, 'broadcast': bytes} sent since the last call."""
  out = {k: int(_SENT[k]) for k in ('allgather', 'broadcast')}
  _SENT.clear()
  return out


def allgather(obj: Any) -> list[Any]:
  """`obj` of every process, in process order (every process gets all)."""
  if not is_multiprocess():
    return [obj]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  _SENT['allgather'] += data.size
  sizes = multihost_utils.process_allgather(np.int64(data.size))
  padded = np.zeros(int(np.max(sizes)), np.uint8)
  padded[:data.size] = data
  rows = multihost_utils.process_allgather(padded)
  return [pickle.loads(rows[p, :int(n)].tobytes())
          for p, n in enumerate(np.asarray(sizes).reshape(-1))]


def merge(parts: Sequence[dict[Any, Any]]) -> dict[Any, Any]:
  """The union of per-process dicts (each process's keys are its own)."""
  out = {}
  for part in parts:
    out.update(part)
  return out


def gather_owned(results: dict[int, Any]) -> dict[int, Any]:
  """{index: result} of every process from this process's own items."""
  return merge(allgather(results))


@jax.jit
def _leaf_checksum(x):
  """Two order-independent uint32 hashes of an array's float32 bits.

  Integer addition wraps exactly and commutes, so the result does not depend
  on how the array is sharded or in which order devices reduce it.
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32),
                                      jnp.uint32).reshape(-1)
  index = jnp.arange(bits.size, dtype=jnp.uint32)
  first = jnp.sum(bits * (index * jnp.uint32(2654435761) + 1),
                  dtype=jnp.uint32)
  second = jnp.sum((bits ^ (index * jnp.uint32(40503))) * jnp.uint32(
      2246822519), dtype=jnp.uint32)
  return jnp.stack([first, second])


def checksum(tree) -> str:
  """A hex digest of a parameter tree, equal on every process of a run.

  Computed on device (no gather of the weights to the host), so it is cheap
  for a 7B model too; equal trees (same values, any sharding) give equal
  digests.
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  parts = [f'{jax.tree_util.keystr(path)}:{x.shape}:'
           f'{sharding.to_host(_leaf_checksum(x)).tolist()}'
           for path, x in leaves]
  return hashlib.sha256('\n'.join(parts).encode()).hexdigest()[:16]


@jax.jit
def _leaf_stats(x):
  x = x.astype(jnp.float32)
  return jnp.stack([jnp.sum(x), jnp.sum(x * x)])


def param_stats(tree) -> dict[str, float]:
  """Sum and sum of squares of all parameters (to compare runs whose
  reductions ran in another order, where `checksum` differs)."""
  total = sum(sharding.to_host(_leaf_stats(x)).astype(float)
              for x in jax.tree.leaves(tree))
  return {'sum': float(total[0]), 'sum_sq': float(total[1])}


def broadcast(obj: Any) -> Any:
  """Process 0's `obj` on every process."""
  if not is_multiprocess():
    return obj
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = data
    _SENT['broadcast'] += size
  buf = multihost_utils.broadcast_one_to_all(buf)
  return pickle.loads(np.asarray(buf).tobytes())

