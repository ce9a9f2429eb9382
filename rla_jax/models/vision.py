"""Qwen3-VL vision tower in Flax NNX: image patches in, language tokens out.

Dimension letters (besides the decoder's): N patches of all images, packed in
the image processor's order; P values of one patch (channels x temporal patch
x patch x patch); E vision width; I vision MLP width; M merged image tokens
(N / m^2 for merge size m), each one language-model token of width D; J
deepstack levels.

The geometry of images of grids (t, h, w) (patch positions, rotary angles,
the interpolation of the learned position table, which frame each patch
belongs to) is numpy on the host, packed with the pixels into `Patches` of a
bucketed length: any images whose patches fit one bucket share one compiled
program. The tower attends within each image frame, bidirectionally, with the
decoder's blockwise attention and segment ids: every key placed before every
query (q_offset = N - 1) makes the causal kernel see all keys of the segment,
and no [N, N] score matrix is built, which a 1920x1080 screenshot (~8,000
patches) would need.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rla_jax import sharding
from rla_jax.models import attention

Grid = tuple[int, int, int]  # (t, h, w) in patches, as image_grid_thw rows


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """The tower's architecture and the token ids that place images in text."""

  depth: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  out_hidden_size: int  # the language model's width D
  patch_size: int = 16
  temporal_patch_size: int = 2
  in_channels: int = 3
  spatial_merge_size: int = 2
  num_position_embeddings: int = 2304
  deepstack_indexes: tuple[int, ...] = ()  # tower layers feeding the decoder
  rope_theta: float = 10000.0
  image_token_id: int = 151655
  video_token_id: int = 151656
  vision_start_token_id: int = 151652
  vision_end_token_id: int = 151653

  def __post_init__(self):
    if self.hidden_size % self.num_heads:
      raise ValueError(f'vision hidden_size={self.hidden_size} is not a '
                       f'multiple of num_heads={self.num_heads}')
    if (self.hidden_size // self.num_heads) % 4:
      raise ValueError('vision head dim must be a multiple of 4 (2-D rotary)')
    side = int(round(self.num_position_embeddings ** 0.5))
    if side * side != self.num_position_embeddings:
      raise ValueError(f'num_position_embeddings={self.num_position_embeddings}'
                       ' is not a square')
    bad = [i for i in self.deepstack_indexes if not 0 <= i < self.depth]
    if bad:
      raise ValueError(f'deepstack indexes {bad} outside 0..{self.depth - 1}')

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    return (self.in_channels * self.temporal_patch_size * self.patch_size
            * self.patch_size)

  @property
  def merged_dim(self) -> int:
    return self.hidden_size * self.spatial_merge_size ** 2


# ---- host-side geometry -------------------------------------------------------


def check_grids(config: VisionConfig, grids) -> tuple[Grid, ...]:
  """image_grid_thw rows as a tuple of int triples, checked against `config`."""
  out = tuple(tuple(int(v) for v in g) for g in np.asarray(grids).reshape(-1, 3))
  m = config.spatial_merge_size
  for i, (t, h, w) in enumerate(out):
    if min(t, h, w) < 1 or h % m or w % m:
      raise ValueError(f'image_grid_thw[{i}]={(t, h, w)}: h and w must be '
                       f'positive multiples of the merge size {m}')
  return out


def tokens_per_image(config: VisionConfig, grid: Grid) -> int:
  return grid[0] * grid[1] * grid[2] // config.spatial_merge_size ** 2


def _rows_cols(grid: Grid, merge: int) -> tuple[np.ndarray, np.ndarray]:
  """Row and column of every patch, in merge-block order (the processor's)."""
  t, h, w = grid
  rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing='ij')
  block = lambda a: a.reshape(h // merge, merge, w // merge, merge).transpose(
      0, 2, 1, 3).reshape(-1)
  return np.tile(block(rows), t), np.tile(block(cols), t)


def _axis_taps(index: np.ndarray, size: int, side: int):
  """Bilinear taps and weights into a `side`-long table (align_corners)."""
  src = index.astype(np.float32) * np.float32(side - 1) / np.float32(
      max(size - 1, 1))
  floor = np.floor(src)
  offsets = np.arange(2)
  taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
  weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0,
                    None)
  return taps, weights.astype(np.float32)


@flax.struct.dataclass
class Patches:
  """Packed patches of some images, padded to a bucket length N."""

  pixels_NxP: np.ndarray | jax.Array  # float32; zero rows past the images
  pos_index_Nx4: np.ndarray | jax.Array  # int32 rows of the position table
  pos_weight_Nx4: np.ndarray | jax.Array  # float32 bilinear weights
  angles_NxF: np.ndarray | jax.Array  # float32 2-D rotary angles, F = Dh/2
  segment_N: np.ndarray | jax.Array  # int32 frame of each patch; -1 padding


@flax.struct.dataclass
class ImageTokens:
  """The tower's output for some images, in the order of their tokens."""

  tokens_MxD: jax.Array  # spliced over the M image tokens of the text
  deepstack_JxMxD: jax.Array  # added after decoder layers 0..J-1


def bucket_length(config: VisionConfig, num_patches: int) -> int:
  """Padded patch count: m^2 times a power of two (>= 16 merged tokens)."""
  unit = config.spatial_merge_size ** 2
  merged = max(16, -(-num_patches // unit))
  return unit * (1 << (merged - 1).bit_length())


def patches(config: VisionConfig, pixel_values, grids,
            length: int | None = None) -> Patches:
  """Host arrays of images for the tower, padded to `length` patches.

  `length` defaults to bucket_length(total patches). The learned position
  table is resampled bilinearly onto each image's grid; rotary angles put
  rows on the first half of the frequencies and columns on the second.
  """
  grids = check_grids(config, grids)
  n = sum(t * h * w for t, h, w in grids)
  if tuple(np.shape(pixel_values)) != (n, config.patch_dim):
    raise ValueError(f'pixel_values has shape {np.shape(pixel_values)}; the '
                     f'grids {grids} need ({n}, {config.patch_dim})')
  length = bucket_length(config, n) if length is None else length
  if length < n or length % config.spatial_merge_size ** 2:
    raise ValueError(f'{length} patch slots for {n} patches (a multiple of '
                     f'{config.spatial_merge_size ** 2} is needed)')
  side = int(round(config.num_position_embeddings ** 0.5))
  quarter = config.head_dim // 4
  inv_freq = 1.0 / (config.rope_theta ** (
      np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
  out = Patches(np.zeros((length, config.patch_dim), np.float32),
                np.zeros((length, 4), np.int32),
                np.zeros((length, 4), np.float32),
                np.zeros((length, 2 * quarter), np.float32),
                np.full((length,), -1, np.int32))
  if isinstance(pixel_values, jax.Array):  # on device, maybe traced
    out = out.replace(pixels_NxP=jnp.pad(
        pixel_values.astype(jnp.float32), ((0, length - n), (0, 0))))
  else:
    out.pixels_NxP[:n] = np.asarray(pixel_values, np.float32)
  start, frame = 0, 0
  for grid in grids:
    t, h, w = grid
    rows, cols = _rows_cols(grid, config.spatial_merge_size)
    row_taps, row_w = _axis_taps(rows, h, side)
    col_taps, col_w = _axis_taps(cols, w, side)
    span = slice(start, start + t * h * w)
    out.pos_index_Nx4[span] = (row_taps[:, :, None] * side
                               + col_taps[:, None, :]).reshape(-1, 4)
    out.pos_weight_Nx4[span] = (row_w[:, :, None]
                                * col_w[:, None, :]).reshape(-1, 4)
    out.angles_NxF[span] = np.concatenate([rows[:, None] * inv_freq,
                                           cols[:, None] * inv_freq], axis=1)
    out.segment_N[span] = frame + np.repeat(np.arange(t), h * w)
    start, frame = start + t * h * w, frame + t
  return out


def multimodal_positions(tokens_BxT, mask_BxT, grids: tuple[Grid, ...],
                         config: VisionConfig):
  """Qwen3-VL rotary positions: ([B, T, 3] int32 (t, h, w), next [B] int32).

  Text tokens advance all three axes together; an image's merged tokens sit
  on its (frame, row, column) grid offset by the position it starts at, and
  the text after it continues from that start plus the image's longer side.
  Images are taken in order from `grids` as their image tokens appear (row
  by row). Padding gets position 0. `next` is each row's first free position
  (the one a generated token takes), as in transformers' rope deltas.
  """
  tokens_BxT = np.asarray(tokens_BxT)
  mask_BxT = (np.ones(tokens_BxT.shape, bool) if mask_BxT is None
              else np.asarray(mask_BxT, bool))
  m = config.spatial_merge_size
  b, t = tokens_BxT.shape
  out = np.zeros((b, t, 3), np.int32)
  next_B = np.zeros((b,), np.int32)
  queue = list(grids)
  for row in range(b):
    slots = np.flatnonzero(mask_BxT[row])
    is_image = tokens_BxT[row, slots] == config.image_token_id
    pos, i = 0, 0
    while i < len(slots):
      if not is_image[i]:
        out[row, slots[i]] = pos
        pos, i = pos + 1, i + 1
        continue
      if not queue:
        raise ValueError(f'row {row}: more image tokens than image_grid_thw '
                         f'has images ({len(grids)})')
      gt, gh, gw = queue.pop(0)
      n = gt * (gh // m) * (gw // m)
      if i + n > len(slots) or not is_image[i:i + n].all():
        raise ValueError(f'row {row}: an image of grid {(gt, gh, gw)} needs '
                         f'{n} consecutive image tokens at token {slots[i]}')
      f, r, c = np.meshgrid(np.arange(gt), np.arange(gh // m),
                            np.arange(gw // m), indexing='ij')
      out[row, slots[i:i + n]] = pos + np.stack(
          [f.reshape(-1), r.reshape(-1), c.reshape(-1)], axis=1)
      pos += max(gh, gw) // m
      i += n
    next_B[row] = (out[row, slots].max() + 1) if len(slots) else 0
  if queue:
    raise ValueError(f'{len(queue)} of {len(grids)} images in image_grid_thw '
                     'have no image tokens in input_ids')
  return out, next_B


# ---- the tower --------------------------------------------------------------


def _param(rngs, shape, axes, dtype, init='normal'):
  if init == 'normal':
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  else:
    value = (jnp.ones if init == 'ones' else jnp.zeros)(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, dtype: str, axis_name: str = 'norm',
               eps: float = 1e-6):
    self.scale = _param(None, (dim,), (axis_name,), dtype, 'ones')
    self.bias = _param(None, (dim,), (axis_name,), dtype, 'zeros')
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    shape = (1,) * (x.ndim - 1) + self.scale.shape
    return (y * self.scale[...].astype(jnp.float32).reshape(shape)
            + self.bias[...].astype(jnp.float32).reshape(shape)).astype(x.dtype)


class VisionBlock(nnx.Module):
  """Pre-norm attention + GELU(tanh) MLP, all projections with biases."""

  def __init__(self, config: VisionConfig, rngs: nnx.Rngs, dtype: str):
    e, i, h, dh = (config.hidden_size, config.intermediate_size,
                   config.num_heads, config.head_dim)
    self.norm1 = LayerNorm(e, dtype)
    self.norm2 = LayerNorm(e, dtype)
    self.wqkv = _param(rngs, (e, 3, h, dh), ('embed', None, 'q_heads',
                                             'head_dim'), dtype)
    self.bqkv = _param(None, (3, h, dh), (None, 'q_heads', 'head_dim'), dtype,
                       'zeros')
    self.wo = _param(rngs, (h, dh, e), ('q_heads', 'head_dim', 'embed'), dtype)
    self.bo = _param(None, (e,), ('norm',), dtype, 'zeros')
    self.w_fc1 = _param(rngs, (e, i), ('embed', 'mlp'), dtype)
    self.b_fc1 = _param(None, (i,), ('mlp',), dtype, 'zeros')
    self.w_fc2 = _param(rngs, (i, e), ('mlp', 'embed'), dtype)
    self.b_fc2 = _param(None, (e,), ('norm',), dtype, 'zeros')

  def __call__(self, x_NxE, angles_NxF, segment_N, block: int):
    dt = x_NxE.dtype
    n = x_NxE.shape[0]
    qkv = jnp.einsum('NE,EcHd->cNHd', self.norm1(x_NxE),
                     self.wqkv[...].astype(dt)) + self.bqkv[...].astype(
                         dt)[:, None, :, :]
    q = attention.rotary(qkv[0], angles_NxF)
    k, v = attention.rotary(qkv[1], angles_NxF), qkv[2]
    out_NxHxDh = attention.chunked(  # bidirectional within each frame
        q[None], k[None], v[None], (segment_N >= 0)[None], q_offset=n - 1,
        block=block, segment_BxS=segment_N[None])[0]
    x_NxE = x_NxE + jnp.einsum('NHd,HdE->NE', out_NxHxDh,
                               self.wo[...].astype(dt)) + self.bo[...].astype(
                                   dt)[None]
    h = (self.norm2(x_NxE) @ self.w_fc1[...].astype(dt)
         + self.b_fc1[...].astype(dt)[None])
    h = sharding.constrain(jax.nn.gelu(h, approximate=True), (None, 'act_mlp'))
    return (x_NxE + h @ self.w_fc2[...].astype(dt)
            + self.b_fc2[...].astype(dt)[None])


class Merger(nnx.Module):
  """m x m neighbouring patches -> one language token (LayerNorm, MLP).

  `postshuffle`: the norm runs on the concatenated patches (the deepstack
  mergers) instead of on each patch (the final merger).
  """

  def __init__(self, config: VisionConfig, rngs: nnx.Rngs, dtype: str,
               postshuffle: bool):
    md, d = config.merged_dim, config.out_hidden_size
    self.postshuffle = postshuffle
    self.norm = LayerNorm(md if postshuffle else config.hidden_size, dtype)
    self.w_fc1 = _param(rngs, (md, md), ('embed', 'mlp'), dtype)
    self.b_fc1 = _param(None, (md,), ('mlp',), dtype, 'zeros')
    self.w_fc2 = _param(rngs, (md, d), ('mlp', 'embed'), dtype)
    self.b_fc2 = _param(None, (d,), ('norm',), dtype, 'zeros')

  def __call__(self, x_NxE):
    dt = x_NxE.dtype
    md = self.w_fc1.shape[0]
    if self.postshuffle:
      x_MxMd = self.norm(x_NxE.reshape(-1, md))
    else:
      x_MxMd = self.norm(x_NxE).reshape(-1, md)
    h = jax.nn.gelu(x_MxMd @ self.w_fc1[...].astype(dt)
                    + self.b_fc1[...].astype(dt)[None], approximate=False)
    return h @ self.w_fc2[...].astype(dt) + self.b_fc2[...].astype(dt)[None]


class VisionTower(nnx.Module):
  """Patches of images -> (tokens [M, D], deepstack [J, M, D]), M = N / m^2."""

  def __init__(self, config: VisionConfig, rngs: nnx.Rngs, dtype: str,
               param_dtype: str):
    self.config = config
    self.dtype = dtype
    pd, e = param_dtype, config.hidden_size
    self.patch_w = _param(rngs, (config.patch_dim, e), (None, 'embed'), pd)
    self.patch_b = _param(None, (e,), ('norm',), pd, 'zeros')
    self.pos_embed = _param(rngs, (config.num_position_embeddings, e),
                            (None, 'embed'), pd)
    self.blocks = nnx.List([VisionBlock(config, rngs, pd)
                            for _ in range(config.depth)])
    self.merger = Merger(config, rngs, pd, postshuffle=False)
    self.deepstack = nnx.List([Merger(config, rngs, pd, postshuffle=True)
                               for _ in config.deepstack_indexes])

  def __call__(self, patches_: Patches, *, block: int = 512,
               checkpoint=None):
    """`checkpoint(fn)`: what the backward pass keeps of each block (remat);
    it wraps fn(block state, x) -> x. None keeps everything."""
    c, dt = self.config, self.dtype
    x_NxE = (patches_.pixels_NxP.astype(dt) @ self.patch_w[...].astype(dt)
             + self.patch_b[...].astype(dt)[None])
    table = self.pos_embed[...].astype(jnp.float32)
    pos_NxE = jnp.einsum('NtE,Nt->NE',
                         jnp.take(table, patches_.pos_index_Nx4, axis=0),
                         patches_.pos_weight_Nx4)
    x_NxE = sharding.constrain(x_NxE + pos_NxE.astype(dt), (None, 'act_embed'))
    levels = []
    for i, blk in enumerate(self.blocks):
      if checkpoint is None:
        x_NxE = blk(x_NxE, patches_.angles_NxF, patches_.segment_N, block)
      else:
        graphdef, state = nnx.split(blk)
        x_NxE = checkpoint(lambda st, x, g=graphdef: nnx.merge(g, st)(
            x, patches_.angles_NxF, patches_.segment_N, block))(state, x_NxE)
      if i in c.deepstack_indexes:
        levels.append(self.deepstack[c.deepstack_indexes.index(i)](x_NxE))
    tokens_MxD = self.merger(x_NxE)
    if levels:
      return tokens_MxD, jnp.stack(levels)
    return tokens_MxD, jnp.zeros((0,) + tokens_MxD.shape, tokens_MxD.dtype)
