"""Decoder-only transformer (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3) in Flax NNX.

With a `vision` config it is Qwen3-VL: the tower's (`vision.py`) tokens
replace the text's image tokens, its deepstack features are added to them
after the first layers, and RoPE has three position axes (`mrope_section`).

Dimension letters used in names and einsums:
  B batch, T query tokens, S key/cache slots, D model width, H query heads,
  K kv heads, G query heads per kv head (H = K * G), Dh head dim, F mlp width,
  V vocabulary, L layers.

Every parameter carries `logical_axes` metadata; `rla_jax.sharding` maps these
names onto the device mesh. With `scan_layers`, the L decoder layers are one
Block whose parameters have a leading 'layers' axis, run by `jax.lax.scan`
(program size and compile time do not grow with depth); otherwise they are a
list of Blocks. The KV cache (kv_cache.py) is stacked [L, ...] either way,
except inside an unrolled decode loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rla_jax import sharding
from rla_jax.models import attention
from rla_jax.models import kv_cache
from rla_jax.models import manual_vjp
from rla_jax.models import rope
from rla_jax.models import vision

# What the backward pass keeps of each layer's forward (`train.remat`):
# 'none' everything, 'full' only the layer's input (the rest is recomputed),
# or one of jax.checkpoint_policies (matmul outputs are kept).
REMAT_POLICIES = ('none', 'full', 'dots_saveable',
                  'dots_with_no_batch_dims_saveable')


def check_remat(policy, key: str = 'train.remat'):
  """Raises a ValueError naming the config `key` for an unknown policy."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f'{key}={policy!r}; expected one of {REMAT_POLICIES}')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static architecture; hashable so it can be a static jit argument."""

  model_type: str  # 'llama' | 'qwen2' | 'qwen3' | 'qwen3_vl'
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
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  # Qwen3-VL: rotary frequencies driven by the (t, h, w) position axes, and
  # the vision tower.
  mrope_section: tuple[int, ...] | None = None
  vision: vision.VisionConfig | None = None
  # How it runs, not what it computes (configs/base.py picks the run's
  # values; these defaults are the plain model).
  attention: str = 'auto'  # one of attention.IMPLEMENTATIONS
  attention_block: int = 512  # query/key block of the blockwise attention
  scan_layers: bool = False  # stacked layers under lax.scan
  remat: str = 'none'  # one of REMAT_POLICIES

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} is not a multiple of '
          f'num_kv_heads={self.num_kv_heads}')
    attention.check_impl(self.attention, 'attention')
    check_remat(self.remat, 'remat')
    if self.attention_block < 1:
      raise ValueError(f'attention_block={self.attention_block} must be >= 1')
    if self.mrope_section is not None and (
        len(self.mrope_section) != 3
        or sum(self.mrope_section) != self.head_dim // 2):
      raise ValueError(f'mrope_section={self.mrope_section} must be 3 sizes '
                       f'summing to head_dim / 2 = {self.head_dim // 2}')


RUN_OPTIONS = ('attention', 'attention_block', 'scan_layers', 'remat')


def with_run_options(config: ModelConfig, **options) -> ModelConfig:
  """`config` with some of RUN_OPTIONS replaced (loaders take these)."""
  unknown = sorted(set(options) - set(RUN_OPTIONS))
  if unknown:
    raise TypeError(f'unknown model options {unknown}; expected some of '
                    f'{RUN_OPTIONS}')
  return dataclasses.replace(config, **options)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init='normal',
           stack: int | None = None):
  """A Param; with `stack`, one per layer along a leading 'layers' axis."""
  if stack:
    shape, axes = (stack,) + tuple(shape), ('layers',) + tuple(axes)
  if init == 'normal':
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == 'ones':
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype: str, axis_name: str,
               stack: int | None = None):
    self.scale = _param(None, (dim,), (axis_name,), dtype, init='ones',
                        stack=stack)
    self.eps = eps

  def __call__(self, x):
    return manual_vjp.rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
               stack: int | None = None):
    c, pd = config, config.param_dtype
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    p = lambda shape, axes, init='normal', r=rngs: _param(
        r, shape, axes, pd, init, stack)
    self.config = config
    self.wq = p((d, h, dh), ('embed', 'q_heads', 'head_dim'))
    self.wk = p((d, k, dh), ('embed', 'kv_heads', 'head_dim'))
    self.wv = p((d, k, dh), ('embed', 'kv_heads', 'head_dim'))
    self.wo = p((h, dh, d), ('q_heads', 'head_dim', 'embed'))
    if c.qkv_bias:
      self.bq = p((h, dh), ('q_heads', 'head_dim'), 'zeros', None)
      self.bk = p((k, dh), ('kv_heads', 'head_dim'), 'zeros', None)
      self.bv = p((k, dh), ('kv_heads', 'head_dim'), 'zeros', None)
    if c.o_bias:
      self.bo = p((d,), ('norm',), 'zeros', None)
    if c.qk_norm:
      self.q_norm = RMSNorm(dh, c.rms_norm_eps, pd, 'head_dim', stack)
      self.k_norm = RMSNorm(dh, c.rms_norm_eps, pd, 'head_dim', stack)

  def __call__(self, x_BxTxD, angles_BxTxF, attend):
    """attend(q, k, v) -> (out [B, T, H, Dh], aux); returns (output, aux)."""
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
    q = attention.rotary(q, angles_BxTxF)
    k = attention.rotary(k, angles_BxTxF)
    out, aux = attend(q, k, v)
    out = jnp.einsum('BTHd,HdD->BTD', out, self.wo[...].astype(dt))
    if c.o_bias:
      out = out + self.bo[...].astype(dt)[None, None]
    return out, aux


class MLP(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
               stack: int | None = None):
    d, f, pd = config.hidden_size, config.intermediate_size, config.param_dtype
    self.w_gate = _param(rngs, (d, f), ('embed', 'mlp'), pd, stack=stack)
    self.w_up = _param(rngs, (d, f), ('embed', 'mlp'), pd, stack=stack)
    self.w_down = _param(rngs, (f, d), ('mlp', 'embed'), pd, stack=stack)

  def __call__(self, x_BxTxD):
    dt = x_BxTxD.dtype
    return manual_vjp.gated_mlp(
        x_BxTxD, self.w_gate[...].astype(dt), self.w_up[...].astype(dt),
        self.w_down[...].astype(dt))


class Block(nnx.Module):
  """One decoder layer; with `stack`, all of them (leading 'layers' axis)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
               stack: int | None = None):
    eps, pd = config.rms_norm_eps, config.param_dtype
    self.attn_norm = RMSNorm(config.hidden_size, eps, pd, 'norm', stack)
    self.attn = Attention(config, rngs, stack)
    self.mlp_norm = RMSNorm(config.hidden_size, eps, pd, 'norm', stack)
    self.mlp = MLP(config, rngs, stack)

  def __call__(self, x_BxTxD, angles_BxTxF, attend):
    h, aux = self.attn(self.attn_norm(x_BxTxD), angles_BxTxF, attend)
    x_BxTxD = x_BxTxD + h
    x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
    return sharding.constrain(x_BxTxD, ('batch', 'length', 'act_embed')), aux


def default_positions(mask_BxT):
  """Positions that ignore left padding: cumsum(mask) - 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def _remat(fn, policy: str, prevent_cse: bool):
  if policy == 'none':
    return fn
  saveable = (None if policy == 'full'
              else getattr(jax.checkpoint_policies, policy))
  return jax.checkpoint(fn, policy=saveable, prevent_cse=prevent_cse)


class Transformer(nnx.Module):
  """Causal LM. `model(tokens_BxT)` returns float32 logits [B, T, V]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    pd = config.param_dtype
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size),
                        ('vocab', 'embed'), pd)
    if config.scan_layers:
      self.layers = Block(config, rngs, stack=config.num_layers)
    else:
      self.layers = nnx.List(
          [Block(config, rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd,
                              'norm')
    if not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (config.vocab_size, config.hidden_size),
                            ('vocab', 'embed'), pd)
    if config.vision is not None:
      self.vision = vision.VisionTower(config.vision, rngs, config.dtype, pd,
                                       scan=config.scan_layers)

  def __call__(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None,
               pixel_values=None, image_grid_thw=None):
    """Logits [B, T, V]; with images, the arrays transformers' processing makes.

    Image tokens are found in `tokens_BxT` (the image token id); positions
    default to the multimodal ones (computed on the host, so `tokens_BxT`
    must be concrete then).
    """
    images = None
    if pixel_values is not None:
      if self.config.vision is None:
        raise ValueError(f'pixel_values given to a {self.config.model_type} '
                         'model, which has no vision tower')
      c = self.config.vision
      grids = vision.check_grids(c, image_grid_thw)
      if isinstance(tokens_BxT, jax.core.Tracer):  # under jit: one row
        if positions_BxT is None or tokens_BxT.shape[0] != 1:
          raise ValueError('traced input_ids with images: pass one row and '
                           'its positions_BxT (vision.multimodal_positions)')
        per_row = [len(grids)]
      else:
        positions, _, per_row = vision.multimodal_positions(
            tokens_BxT, mask_BxT, grids, c)
        if positions_BxT is None:
          positions_BxT = jnp.asarray(positions)
      images = self.encode_images(vision.patches(c, pixel_values, grids,
                                                 per_row))
    return self.logits(self.hidden(tokens_BxT, positions_BxT=positions_BxT,
                                   mask_BxT=mask_BxT, images=images))

  def encode_images(self, patches: vision.Patches) -> vision.ImageTokens:
    """The vision tower on each row's patches (`vision.patches`), its blocks
    rematerialised like the decoder's layers (`remat`)."""
    c = self.config
    checkpoint = None if c.remat == 'none' else (
        lambda fn: _remat(fn, c.remat, prevent_cse=not c.scan_layers))
    tokens_BxMxD, deepstack_JxBxMxD = self.vision(
        jax.tree.map(jnp.asarray, patches), block=c.attention_block,
        checkpoint=checkpoint)
    return vision.ImageTokens(tokens_BxMxD.astype(c.dtype),
                              deepstack_JxBxMxD.astype(c.dtype))

  def head_weight(self):
    """The [V, D] output projection (the embedding when tied)."""
    w = self.embed if self.config.tie_word_embeddings else self.lm_head
    return w[...].astype(self.config.dtype)

  def logits(self, hidden_BxTxD):
    logits = jnp.einsum('BTD,VD->BTV', hidden_BxTxD, self.head_weight(),
                        preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ('batch', 'length', 'act_vocab'))

  def _embed(self, tokens_BxT, images: vision.ImageTokens | None):
    """(embeddings [B, T, D], add_deepstack(x, layer) or None)."""
    x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.config.dtype)
    add_deepstack = None
    if images is not None:
      x, add_deepstack = vision.splice(
          x, tokens_BxT == self.config.vision.image_token_id, images)
    x = sharding.constrain(x, ('batch', 'length', 'act_embed'))
    return x, add_deepstack

  @staticmethod
  def _with_deepstack(layer_fn, add_deepstack):
    if add_deepstack is None:
      return layer_fn

    def layer(block, i, x):
      x, y = layer_fn(block, i, x)
      return add_deepstack(x, i), y

    return layer

  def _attend(self, mask_BxS, **kwargs):
    c = self.config
    return lambda q, k, v: attention.attention(
        q, k, v, mask_BxS, impl=c.attention, block=c.attention_block, **kwargs)

  def layer_list(self) -> list[Block]:
    """One Block per layer; under `scan_layers`, slices of the stacked
    parameters (copies: make them once, outside a decode loop)."""
    if not self.config.scan_layers:
      return list(self.layers)
    graphdef, stacked = nnx.split(self.layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
            for i in range(self.config.num_layers)]

  def _run_layers(self, layer_fn, carry, remat: str = 'none',
                  layers: list[Block] | None = None):
    """(carry, ys): carry, y = layer_fn(block, layer index, carry) per layer.

    The function sees one layer's Block either way; under `scan_layers` it is
    traced once, unless `layers` (a `layer_list`) is given: those run
    unrolled, the layer index a Python int. ys are stacked [L, ...] (None:
    none). Remat under a scan needs no CSE barrier: the recomputation sits in
    the backward loop, which XLA cannot merge with the forward one.
    """
    if layers is None and self.config.scan_layers:
      graphdef, stacked = nnx.split(self.layers)

      def step(carry, xs):
        layer_state, i = xs
        return layer_fn(nnx.merge(graphdef, layer_state), i, carry)

      step = _remat(step, remat, prevent_cse=False)
      return jax.lax.scan(step, carry,
                          (stacked, jnp.arange(self.config.num_layers)))
    ys = []
    for i, block in enumerate(self.layers if layers is None else layers):
      if remat == 'none':
        carry, y = layer_fn(block, i, carry)
      else:
        graphdef, state = nnx.split(block)
        carry, y = _remat(lambda st, c, i=i, g=graphdef: layer_fn(
            nnx.merge(g, st), i, c), remat, prevent_cse=True)(state, carry)
      ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

  def hidden(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None,
             images: vision.ImageTokens | None = None, branch_BxT=None):
    """Final-normed hidden states [B, T, D] of a full (uncached) forward.

    `mask_BxT` marks real tokens; each row's real tokens must form one run
    (left and/or right padding), as training batches and prompts do.
    `positions_BxT` may be [B, T, 3] (multimodal); `images` the encoded
    images of the image tokens in `tokens_BxT`. `branch_BxT` lays a row out
    as one prompt (branch 0) and responses to it (branches 1, 2, ...) that
    each see the prompt and themselves only (attention.attention); such rows
    need explicit `positions_BxT` (each response continues the prompt's).
    """
    if mask_BxT is None:
      mask_BxT = jnp.ones(tokens_BxT.shape, bool)
    mask_BxT = mask_BxT.astype(bool)
    if positions_BxT is None:
      if branch_BxT is not None:
        raise ValueError('rows with branches need their positions_BxT')
      positions_BxT = default_positions(mask_BxT)
    angles_BxTxF = rope.rope_angles(self.config, positions_BxT)
    if branch_BxT is None:
      attend = self._attend(mask_BxT, contiguous=True)
    else:
      attend = self._attend(mask_BxT, branch_BxS=branch_BxT)

    def layer(block, _, x):
      return block(x, angles_BxTxF,
                   lambda q, k, v: (attend(q, k, v), None))[0], None

    x, add_deepstack = self._embed(tokens_BxT, images)
    x, _ = self._run_layers(self._with_deepstack(layer, add_deepstack), x,
                            self.config.remat)
    return self.final_norm(x)

  def decode(self, tokens_BxT, positions_BxT, mask_BxT,
             cache: kv_cache.KVCache, *, head_DxV=None, fresh: bool = False,
             images: vision.ImageTokens | None = None,
             layers: list[Block] | None = None):
    """Appends T tokens to the cache; returns (logits [B, T, V], cache).

    `positions_BxT` may be [B, T, 3] and `images` the encoded images of the
    chunk's image tokens (see `hidden`); the cache then holds them as keys
    and values for every later call.

    Query t (cache slot `index + t`) attends to earlier real slots only.
    `fresh`: the cache is empty (index 0), so the chunk attends within itself
    (one run of real tokens per row), which fused kernels can take.
    `head_DxV` is the output projection already transposed (once, outside a
    decode loop), as one [D, V] array or a tuple of [D, V_i] column blocks
    (`head_blocks`): XLA:CPU streams a decode step's [D, 1536] blocks at
    ~2x the rate of the whole [V, D] head.

    A per-layer cache (kv_cache.per_layer) takes one token a step, its
    layers unrolled; `layers`, a `layer_list()` made once outside the decode
    loop, saves a scanned model's per-step copies of each layer's slice of
    the stacked parameters (the list holds one copy of them instead).
    """
    c = self.config
    t = tokens_BxT.shape[1]
    index = cache.index
    mask_BxS = jax.lax.dynamic_update_slice(
        cache.mask_BxS, mask_BxT.astype(bool), (0, index))
    angles_BxTxF = rope.rope_angles(c, positions_BxT)
    x, add_deepstack = self._embed(tokens_BxT, images)
    if kv_cache.is_per_layer(cache):
      if t != 1:
        raise ValueError(f'a per-layer KV cache takes one token a step, not {t}')
      x, k, v = self._decode_in_place(x, angles_BxTxF, mask_BxS, cache,
                                      layers or self.layer_list(),
                                      add_deepstack)
    else:
      x, k, v = self._decode_stacked(x, angles_BxTxF, mask_BxT, mask_BxS,
                                     cache, fresh, add_deepstack)
    cache = kv_cache.KVCache(k=k, v=v, mask_BxS=mask_BxS, index=index + t)
    hidden_BxTxD = self.final_norm(x)
    if head_DxV is None:
      return self.logits(hidden_BxTxD), cache
    blocks = head_DxV if isinstance(head_DxV, (tuple, list)) else (head_DxV,)
    logits = jnp.concatenate([
        jnp.einsum('BTD,DV->BTV', hidden_BxTxD, w.astype(hidden_BxTxD.dtype),
                   preferred_element_type=jnp.float32) for w in blocks], -1)
    return sharding.constrain(logits, ('batch', 'length', 'act_vocab')), cache

  def _decode_stacked(self, x, angles_BxTxF, mask_BxT, mask_BxS, cache,
                      fresh: bool, add_deepstack):
    """`decode` over the stacked cache: (x, k, v) after every layer."""
    c = self.config
    b, t = mask_BxT.shape
    index = cache.index
    if fresh:
      attend = self._attend(mask_BxT.astype(bool), contiguous=True)
    else:
      attend = self._attend(mask_BxS, q_offset=index)

    def layer(block, i, x):

      def attend_cached(q, k, v):
        # The cache is only read here; the new keys are written once, after
        # all layers. A read and an in-place write of the same (stacked)
        # cache inside the layer loop make XLA copy all of it, per layer.
        if t == 1:
          out = attention.decode_attention(
              q.reshape(b, c.num_kv_heads, -1, c.head_dim), cache.k, cache.v,
              mask_BxS, index, layer=i, block=c.attention_block,
              new_kv=(k[:, 0], v[:, 0], mask_BxT[:, 0].astype(bool)),
          ).reshape(q.shape)
        elif fresh:
          out = attend(q, k, v)
        else:  # this layer's cache with the chunk in it: one layer's copy
          with_chunk = lambda cache_all, new: jax.lax.dynamic_update_slice(
              jax.lax.dynamic_index_in_dim(cache_all, i, 0, False),
              new.astype(cache_all.dtype), (0, index, 0, 0)).astype(q.dtype)
          out = attend(q, with_chunk(cache.k, k), with_chunk(cache.v, v))
        return out, (k, v)

      return block(x, angles_BxTxF, attend_cached)

    x, (k_LxBxTxKxDh, v_LxBxTxKxDh) = self._run_layers(
        self._with_deepstack(layer, add_deepstack), x)
    return (x, kv_cache.write_stacked(cache.k, k_LxBxTxKxDh, index),
            kv_cache.write_stacked(cache.v, v_LxBxTxKxDh, index))

  def _decode_in_place(self, x, angles_Bx1xF, mask_BxS, cache,
                       layers: list[Block], add_deepstack):
    """`decode` of one token over a per-layer cache, the layers unrolled:
    (x, k, v) after every layer."""
    c = self.config
    b = x.shape[0]
    index = cache.index
    k_cache, v_cache = list(cache.k), list(cache.v)

    def layer(block, i, x):

      def attend_cached(q, k, v):
        # Written before the read, which then depends on the write: XLA
        # updates the buffer in place. (A read that does not depend on the
        # write makes XLA copy the layer's cache every step to keep the old
        # value for it.)
        k_cache[i] = kv_cache.write_layer(k_cache[i], k, index)
        v_cache[i] = kv_cache.write_layer(v_cache[i], v, index)
        out = attention.decode_attention(
            q.reshape(b, c.num_kv_heads, -1, c.head_dim), k_cache[i],
            v_cache[i], mask_BxS, index, block=c.attention_block,
            kv_major=True)
        return out.reshape(q.shape), None

      return block(x, angles_Bx1xF, attend_cached)

    x, _ = self._run_layers(self._with_deepstack(layer, add_deepstack), x,
                            layers=layers)
    return x, tuple(k_cache), tuple(v_cache)


def head_blocks(model: Transformer, columns: int) -> tuple[jax.Array, ...]:
  """The output projection transposed, in [D, <= columns] column blocks
  (`decode`'s `head_DxV`; each block a separate array)."""
  head_VxD = model.head_weight()
  return tuple(head_VxD[i:i + columns].T
               for i in range(0, head_VxD.shape[0], columns))


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
