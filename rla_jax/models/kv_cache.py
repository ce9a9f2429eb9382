"""The decode KV cache, in its two layouts, and the writes into them.

At rest (prefill, sessions, a scanned decode step) the keys and values of all
layers are stacked [L, B, S, K, Dh]: a scan over the layers reads its layer's
slice and every layer's new slot is written once, after the last layer.

An unrolled decode loop (`sampler.generate`'s `unroll_decode_from`) holds one
[B, K, S, Dh] array per layer instead (`per_layer`): on XLA:CPU a slice of a
stacked array is a copy when a matmul reads it, so each step would copy the
whole cache, while a layer's own array is read where it lies and its new slot
written in place. `stacked` turns it back at the end of the loop.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rla_jax import sharding


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer and which slots hold real tokens.

  Slots are filled left to right; `index` is the next free slot, shared by the
  whole batch (prompts are left-padded, so every row writes in lockstep).
  """

  k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, K, Dh] or L x [B, K, S, Dh]
  v: jax.Array | tuple[jax.Array, ...]  # as k
  mask_BxS: jax.Array  # bool: slot holds a real (non-pad) token
  index: jax.Array  # int32 scalar


CACHE_AXES = ('layers', 'cache_batch', 'cache_length', 'cache_kv_heads',
              'head_dim')
LAYER_AXES = ('cache_batch', 'cache_kv_heads', 'cache_length', 'head_dim')


def init(config, batch: int, length: int, dtype: str | None = None) -> KVCache:
  """An empty stacked cache of `length` slots for `batch` rows of a model
  config."""
  dtype = dtype or config.dtype
  shape = (config.num_layers, batch, length, config.num_kv_heads,
           config.head_dim)
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), CACHE_AXES)
  return KVCache(k=zeros(), v=zeros(), mask_BxS=jnp.zeros((batch, length), bool),
                 index=jnp.zeros((), jnp.int32))


def map_rows(fn, cache: KVCache) -> KVCache:
  """fn([B, S, ...]) applied to every array of a stacked cache (k and v per
  layer, and the slot mask)."""
  return cache.replace(k=jax.vmap(fn)(cache.k), v=jax.vmap(fn)(cache.v),
                       mask_BxS=fn(cache.mask_BxS))


def widen(cache: KVCache, length: int) -> KVCache:
  """The stacked cache grown to `length` slots; the new ones are empty."""
  pad = length - cache.mask_BxS.shape[1]
  return map_rows(
      lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)), cache)


def is_per_layer(cache: KVCache) -> bool:
  return isinstance(cache.k, tuple)


def per_layer(cache: KVCache) -> KVCache:
  """The stacked cache as one [B, K, S, Dh] array per layer (a copy)."""
  split = lambda a_LxBxSxKxDh: tuple(
      sharding.constrain(jnp.swapaxes(a, 1, 2), LAYER_AXES)
      for a in a_LxBxSxKxDh)
  return cache.replace(k=split(cache.k), v=split(cache.v))


def stacked(cache: KVCache) -> KVCache:
  """A per-layer cache stacked back into [L, B, S, K, Dh] (a copy)."""
  stack = lambda arrays: sharding.constrain(
      jnp.stack([jnp.swapaxes(a, 1, 2) for a in arrays]), CACHE_AXES)
  return cache.replace(k=stack(cache.k), v=stack(cache.v))


def write_layer(cache_BxKxSxDh, new_BxTxKxDh, index):
  """`new` written at slots index.. of one layer's array (in place when the
  array is donated or dead after)."""
  new_BxKxTxDh = jnp.swapaxes(new_BxTxKxDh, 1, 2).astype(cache_BxKxSxDh.dtype)
  return sharding.constrain(jax.lax.dynamic_update_slice(
      cache_BxKxSxDh, new_BxKxTxDh, (0, 0, index, 0)), LAYER_AXES)


def write_stacked(cache_LxBxSxKxDh, new_LxBxTxKxDh, index):
  """Every layer's `new` written at slots index.. of the stacked array."""
  return sharding.constrain(jax.lax.dynamic_update_slice(
      cache_LxBxSxKxDh, new_LxBxTxKxDh.astype(cache_LxBxSxKxDh.dtype),
      (0, 0, index, 0, 0)), CACHE_AXES)
