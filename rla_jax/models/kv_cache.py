"""The decode KV cache: one [B, K, S, Dh] array per layer, and its updates.

A decode step reads each layer's cache where it lies and writes its new slot
in place; a slice of a stacked [L, ...] cache would be a copy on XLA:CPU.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rla_jax import sharding


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer and which slots hold real tokens.

  Slots are filled left to right; `index` is the next free slot, shared by
  the whole batch (prompts are left-padded, so every row writes in lockstep).
  """

  k: tuple[jax.Array, ...]  # L x [B, K, S, Dh]
  v: tuple[jax.Array, ...]  # L x [B, K, S, Dh]
  mask_BxS: jax.Array  # bool: slot holds a real (non-pad) token
  index: jax.Array  # int32 scalar


CACHE_AXES = ('cache_batch', 'cache_kv_heads', 'cache_length', 'head_dim')


def init(config, batch: int, length: int, dtype: str | None = None) -> KVCache:
  """An empty cache of `length` slots for `batch` rows of a model config."""
  dtype = dtype or config.dtype
  shape = (batch, config.num_kv_heads, length, config.head_dim)
  zeros = lambda: tuple(sharding.constrain(jnp.zeros(shape, dtype), CACHE_AXES)
                        for _ in range(config.num_layers))
  return KVCache(k=zeros(), v=zeros(), mask_BxS=jnp.zeros((batch, length), bool),
                 index=jnp.zeros((), jnp.int32))


def write(cache_BxKxSxDh, new_BxTxKxDh, index):
  """`new` written at slots index.. of one layer's cache (in place when the
  cache is donated or dead after)."""
  new_BxKxTxDh = jnp.swapaxes(new_BxTxKxDh, 1, 2).astype(cache_BxKxSxDh.dtype)
  return sharding.constrain(jax.lax.dynamic_update_slice(
      cache_BxKxSxDh, new_BxKxTxDh, (0, 0, index, 0)), CACHE_AXES)


def repeat_rows(cache: KVCache, g: int) -> KVCache:
  """Each row repeated g times (row r becomes rows r*g .. r*g + g - 1)."""
  repeat = lambda a: jnp.repeat(a, g, axis=0)
  return cache.replace(k=tuple(map(repeat, cache.k)),
                       v=tuple(map(repeat, cache.v)),
                       mask_BxS=repeat(cache.mask_BxS))


def widen(cache: KVCache, length: int) -> KVCache:
  """The cache grown to `length` slots; the new ones are empty."""
  pad = length - cache.mask_BxS.shape[1]
  slots = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)])
  return cache.replace(k=tuple(map(slots, cache.k)),
                       v=tuple(map(slots, cache.v)),
                       mask_BxS=jnp.pad(cache.mask_BxS, [(0, 0), (0, pad)]))
