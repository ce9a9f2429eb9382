"""Decoder-only transformer (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3) in Flax NNX.

Dimension letters used in names and einsums:
  B batch, T query tokens, S key/cache slots, D model width, H query heads,
  K kv heads, G query heads per kv head (H = K * G), Dh head dim, F mlp width,
  V vocabulary, L layers.

Every parameter carries `logical_axes` metadata; `rla_jax.sharding` maps these
names onto the device mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from rla_jax import sharding

_NEG_INF = -1e30  # finite, so fully masked rows (left padding) stay NaN-free


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static architecture; hashable so it can be a static jit argument."""

  model_type: str  # 'llama' | 'qwen2' | 'qwen3'
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # llama3 rope scaling as a sorted tuple of (key, value) pairs, or None.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2/2.5, or Llama with attention_bias
  o_bias: bool = False  # Llama with attention_bias
  qk_norm: bool = False  # Qwen3
  tie_word_embeddings: bool = False
  dtype: str = 'float32'  # compute dtype
  param_dtype: str = 'float32'
  remat: bool = False  # rematerialise each block in the backward pass
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} is not a multiple of '
          f'num_kv_heads={self.num_kv_heads}')


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values and which slots hold real tokens.

  Slots are filled left to right; `index` is the next free slot, shared by the
  whole batch (prompts are left-padded, so every row writes in lockstep).
  """

  k: tuple[jax.Array, ...]  # L x [B, S, K, Dh]
  v: tuple[jax.Array, ...]  # L x [B, S, K, Dh]
  mask_BxS: jax.Array  # bool: slot holds a real (non-pad) token
  index: jax.Array  # int32 scalar


CACHE_AXES = ('cache_batch', 'cache_length', 'cache_kv_heads', 'head_dim')


def init_cache(config: ModelConfig, batch: int, length: int,
               dtype: str | None = None) -> KVCache:
  """An empty cache of `length` slots for `batch` rows."""
  dtype = dtype or config.dtype
  shape = (batch, length, config.num_kv_heads, config.head_dim)
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), CACHE_AXES)
  return KVCache(
      k=tuple(zeros() for _ in range(config.num_layers)),
      v=tuple(zeros() for _ in range(config.num_layers)),
      mask_BxS=jnp.zeros((batch, length), bool),
      index=jnp.zeros((), jnp.int32))


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init='normal'):
  if init == 'normal':
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == 'ones':
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype: str, axis_name: str):
    self.scale = _param(None, (dim,), (axis_name,), dtype, init='ones')
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(x.dtype)
    return scale.reshape((1,) * (x.ndim - 1) + scale.shape) * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse frequencies [Dh/2], with llama3-style scaling when configured."""
  dh = config.head_dim
  inv = 1.0 / (config.rope_theta ** (
      jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  if config.rope_scaling is None:
    return inv
  s = dict(config.rope_scaling)
  if s['rope_type'] == 'linear':
    return inv / s['factor']
  # llama3: long wavelengths divided by `factor`, short ones kept, smooth mix.
  factor, low, high = s['factor'], s['low_freq_factor'], s['high_freq_factor']
  old_len = s['original_max_position_embeddings']
  wavelen = 2 * math.pi / inv
  smooth = (old_len / wavelen - low) / (high - low)
  mixed = (1 - smooth) * inv / factor + smooth * inv
  out = jnp.where(wavelen > old_len / low, inv / factor, inv)
  is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
  return jnp.where(is_medium, mixed, out)


def apply_rope(x_BxTxNxDh, positions_BxT, inv_freq):
  """Rotary embedding in the 'rotate half' layout used by HF checkpoints."""
  angles_BxTxF = (positions_BxT[..., None].astype(jnp.float32)
                  * inv_freq[None, None, :])
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxNxDh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)


def _attend_one_query(q_BxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, attend_BxS):
  """Attention of one query per row over a [B, S, K, Dh] cache.

  Multiply-and-reduce reads the cache in its own layout; a dot_general with
  (B, K) batch dimensions would first transpose all of it, every step.
  """
  f32 = jnp.float32
  q = q_BxKxGxDh.astype(f32)[:, None]
  scores_BxSxKxG = jnp.sum(q * k_BxSxKxDh.astype(f32)[:, :, :, None], axis=-1)
  scores_BxSxKxG = scores_BxSxKxG / math.sqrt(q_BxKxGxDh.shape[-1])
  scores_BxSxKxG = jnp.where(attend_BxS[:, :, None, None], scores_BxSxKxG,
                             _NEG_INF)
  probs_BxSxKxG = jax.nn.softmax(scores_BxSxKxG, axis=1)
  out_BxKxGxDh = jnp.sum(
      probs_BxSxKxG[..., None] * v_BxSxKxDh.astype(f32)[:, :, :, None], axis=1)
  return out_BxKxGxDh.astype(q_BxKxGxDh.dtype)


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c, pd = config, config.param_dtype
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.config = config
    self.wq = _param(rngs, (d, h, dh), ('embed', 'q_heads', 'head_dim'), pd)
    self.wk = _param(rngs, (d, k, dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wv = _param(rngs, (d, k, dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wo = _param(rngs, (h, dh, d), ('q_heads', 'head_dim', 'embed'), pd)
    if c.qkv_bias:
      self.bq = _param(None, (h, dh), ('q_heads', 'head_dim'), pd, 'zeros')
      self.bk = _param(None, (k, dh), ('kv_heads', 'head_dim'), pd, 'zeros')
      self.bv = _param(None, (k, dh), ('kv_heads', 'head_dim'), pd, 'zeros')
    if c.o_bias:
      self.bo = _param(None, (d,), ('norm',), pd, 'zeros')
    if c.qk_norm:
      self.q_norm = RMSNorm(dh, c.rms_norm_eps, pd, 'head_dim')
      self.k_norm = RMSNorm(dh, c.rms_norm_eps, pd, 'head_dim')

  def __call__(self, x_BxTxD, positions_BxT, inv_freq, attend_BxTxS,
               kv_cache=None, index=None):
    """Returns the attention output and, with a cache, the updated (k, v)."""
    c = self.config
    dt = x_BxTxD.dtype
    q = jnp.einsum('BTD,DHd->BTHd', x_BxTxD, self.wq[...].astype(dt))
    k = jnp.einsum('BTD,DKd->BTKd', x_BxTxD, self.wk[...].astype(dt))
    v = jnp.einsum('BTD,DKd->BTKd', x_BxTxD, self.wv[...].astype(dt))
    if c.qkv_bias:
      q = q + self.bq[...].astype(dt)[None, None]
      k = k + self.bk[...].astype(dt)[None, None]
      v = v + self.bv[...].astype(dt)[None, None]
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    new_kv = None
    if kv_cache is not None:
      cache_k, cache_v = kv_cache
      start = (0, index, 0, 0)
      cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype),
                                             start)
      cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype),
                                             start)
      new_kv = (cache_k, cache_v)
      k, v = cache_k.astype(dt), cache_v.astype(dt)
    b, t, h, dh = q.shape
    kv = c.num_kv_heads
    if kv_cache is not None and t == 1:
      out = _attend_one_query(q.reshape(b, kv, h // kv, dh), k, v,
                              attend_BxTxS[:, 0]).reshape(b, t, h, dh)
    else:
      q = q.reshape(b, t, kv, h // kv, dh)
      scores = jnp.einsum('BTKGd,BSKd->BKGTS', q, k,
                          preferred_element_type=jnp.float32)
      scores = scores / math.sqrt(dh)
      scores = jnp.where(attend_BxTxS[:, None, None], scores, _NEG_INF)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      out = jnp.einsum('BKGTS,BSKd->BTKGd', probs, v).reshape(b, t, h, dh)
    out = jnp.einsum('BTHd,HdD->BTD', out, self.wo[...].astype(dt))
    if c.o_bias:
      out = out + self.bo[...].astype(dt)[None, None]
    return out, new_kv


def _mlp_hidden(gate_BxTxF, up_BxTxF):
  return sharding.constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF,
                            ('batch', 'length', 'act_mlp'))


@jax.custom_vjp
def gated_mlp(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD):
  """down(silu(x @ w_gate) * (x @ w_up)), with a hand-written backward pass.

  The backward pass computes what autodiff does, with each weight gradient
  written as a 2-D [K, N] @ [N, M] matmul. XLA:CPU compiles autodiff's
  version with transposed copies of the [B, T, F] gradients that recompute
  the SiLU derivative and cost more than the matmuls themselves.
  """
  return _gated_mlp_fwd(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD)[0]


def _gated_mlp_fwd(x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD):
  gate_BxTxF = x_BxTxD @ w_gate_DxF
  up_BxTxF = x_BxTxD @ w_up_DxF
  h_BxTxF = _mlp_hidden(gate_BxTxF, up_BxTxF)
  residuals = (x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD, gate_BxTxF,
               up_BxTxF, h_BxTxF)
  return h_BxTxF @ w_down_FxD, residuals


def _gated_mlp_bwd(residuals, dout_BxTxD):
  x_BxTxD, w_gate_DxF, w_up_DxF, w_down_FxD, gate, up, h_BxTxF = residuals
  b, t, d = x_BxTxD.shape
  f = w_gate_DxF.shape[1]
  dh_BxTxF = dout_BxTxD @ w_down_FxD.T
  sig = jax.nn.sigmoid(gate)
  d_up = dh_BxTxF * gate * sig
  d_gate = dh_BxTxF * up * sig * (1 + gate * (1 - sig))
  dx_BxTxD = d_gate @ w_gate_DxF.T + d_up @ w_up_DxF.T
  x_NxD = x_BxTxD.reshape(b * t, d)
  dw_gate = x_NxD.T @ d_gate.reshape(b * t, f)
  dw_up = x_NxD.T @ d_up.reshape(b * t, f)
  dw_down = (dout_BxTxD.reshape(b * t, d).T @ h_BxTxF.reshape(b * t, f)).T
  return dx_BxTxD, dw_gate, dw_up, dw_down


gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)


class MLP(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    d, f, pd = config.hidden_size, config.intermediate_size, config.param_dtype
    self.w_gate = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.w_up = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.w_down = _param(rngs, (f, d), ('mlp', 'embed'), pd)

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    return gated_mlp(x_BxTxD, self.w_gate[...].astype(dt),
                     self.w_up[...].astype(dt), self.w_down[...].astype(dt))


class Block(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    eps, pd = config.rms_norm_eps, config.param_dtype
    self.attn_norm = RMSNorm(config.hidden_size, eps, pd, 'norm')
    self.attn = Attention(config, rngs)
    self.mlp_norm = RMSNorm(config.hidden_size, eps, pd, 'norm')
    self.mlp = MLP(config, rngs)

  def __call__(self, x_BxTxD, positions_BxT, inv_freq, attend_BxTxS,
               kv_cache=None, index=None):
    h, new_kv = self.attn(self.attn_norm(x_BxTxD), positions_BxT, inv_freq,
                          attend_BxTxS, kv_cache, index)
    x_BxTxD = x_BxTxD + h
    x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
    return sharding.constrain(x_BxTxD, ('batch', 'length', 'act_embed')), new_kv


def default_positions(mask_BxT):
  """Positions that ignore left padding: cumsum(mask) - 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Transformer(nnx.Module):
  """Causal LM. `model(tokens_BxT)` returns float32 logits [B, T, V]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    pd = config.param_dtype
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size),
                        ('vocab', 'embed'), pd)
    self.layers = nnx.List(
        [Block(config, rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd,
                              'norm')
    if not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (config.vocab_size, config.hidden_size),
                            ('vocab', 'embed'), pd)

  def __call__(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None):
    return self.logits(self.hidden(tokens_BxT, positions_BxT=positions_BxT,
                                   mask_BxT=mask_BxT))

  def head_weight(self):
    """The [V, D] output projection (the embedding when tied)."""
    w = self.embed if self.config.tie_word_embeddings else self.lm_head
    return w[...].astype(self.config.dtype)

  def logits(self, hidden_BxTxD):
    logits = jnp.einsum('BTD,VD->BTV', hidden_BxTxD, self.head_weight(),
                        preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ('batch', 'length', 'act_vocab'))

  def _embed(self, tokens_BxT):
    x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.config.dtype)
    return sharding.constrain(x, ('batch', 'length', 'act_embed'))

  def hidden(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None):
    """Final-normed hidden states [B, T, D] of a full (uncached) forward."""
    t = tokens_BxT.shape[1]
    if mask_BxT is None:
      mask_BxT = jnp.ones(tokens_BxT.shape, bool)
    mask_BxT = mask_BxT.astype(bool)
    if positions_BxT is None:
      positions_BxT = default_positions(mask_BxT)
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    attend_BxTxS = causal_TxT[None, :, :] & mask_BxT[:, None, :]
    inv_freq = rope_inv_freq(self.config)
    x = self._embed(tokens_BxT)
    for block in self.layers:
      if self.config.remat:
        x, _ = nnx.remat(lambda blk, y: blk(y, positions_BxT, inv_freq,
                                            attend_BxTxS))(block, x)
      else:
        x, _ = block(x, positions_BxT, inv_freq, attend_BxTxS)
    return self.final_norm(x)

  def decode(self, tokens_BxT, positions_BxT, mask_BxT, cache: KVCache, *,
             head_DxV=None):
    """Appends T tokens to the cache; returns (logits [B, T, V], cache).

    Query t (cache slot `index + t`) attends to earlier real slots only.
    `head_DxV` is the output projection already transposed (once, outside a
    decode loop): XLA:CPU runs the logits matmul ~1.4x faster in that layout.
    """
    t = tokens_BxT.shape[1]
    s = cache.mask_BxS.shape[1]
    index = cache.index
    mask_BxS = jax.lax.dynamic_update_slice(
        cache.mask_BxS, mask_BxT.astype(bool), (0, index))
    slot_S = jnp.arange(s)
    query_slot_T = index + jnp.arange(t)
    attend_BxTxS = (mask_BxS[:, None, :]
                    & (slot_S[None, None, :] <= query_slot_T[None, :, None]))
    inv_freq = rope_inv_freq(self.config)
    x = self._embed(tokens_BxT)
    ks, vs = [], []
    for block, ck, cv in zip(self.layers, cache.k, cache.v):
      x, (ck, cv) = block(x, positions_BxT, inv_freq, attend_BxTxS, (ck, cv),
                          index)
      ks.append(sharding.constrain(ck, CACHE_AXES))
      vs.append(sharding.constrain(cv, CACHE_AXES))
    cache = KVCache(k=tuple(ks), v=tuple(vs), mask_BxS=mask_BxS,
                    index=index + t)
    hidden_BxTxD = self.final_norm(x)
    if head_DxV is None:
      return self.logits(hidden_BxTxD), cache
    logits = jnp.einsum('BTD,DV->BTV', hidden_BxTxD,
                        head_DxV.astype(hidden_BxTxD.dtype),
                        preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ('batch', 'length', 'act_vocab')), cache


def abstract_model(config: ModelConfig) -> Transformer:
  """The model with ShapeDtypeStruct leaves (no memory allocated)."""
  return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def create(config: ModelConfig, *, seed: int = 0, mesh=None,
           rules=sharding.DEFAULT_RULES) -> Transformer:
  """Randomly initialised model, built directly in its sharding."""
  if mesh is None:
    return Transformer(config, rngs=nnx.Rngs(seed))
  graphdef, abstract_state = nnx.split(abstract_model(config))
  shardings = sharding.param_shardings(abstract_state, mesh, rules)

  @jax.jit
  def init():
    state = nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))[1]
    return jax.lax.with_sharding_constraint(nnx.to_pure_dict(state), shardings)

  return nnx.merge(graphdef, init())
