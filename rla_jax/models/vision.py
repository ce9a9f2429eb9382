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
from collections.abc import Sequence

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


# ---- host-side geometry ----------------------------------------------------


def check_grids(config: VisionConfig, grids) -> tuple[Grid, ...]:
  """image_grid_thw rows as a tuple of int triples, checked against `config`."""
  rows = np.asarray(grids).reshape(-1, 3)
  out = tuple(tuple(int(v) for v in g) for g in rows)
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
  """The patches of each batch row's images, padded to a bucket length N.

  Row b holds the images of batch row b (in token order), so the tower's
  work shards like the batch and attention never crosses rows.
  """

  pixels_BxNxP: np.ndarray | jax.Array  # float32; zeros past the images
  pos_index_BxNx4: np.ndarray | jax.Array  # int32 rows of the position table
  pos_weight_BxNx4: np.ndarray | jax.Array  # float32 bilinear weights
  angles_BxNxF: np.ndarray | jax.Array  # float32 2-D rotary angles, F = Dh/2
  segment_BxN: np.ndarray | jax.Array  # int32 frame of each patch; -1 padding


@flax.struct.dataclass
class ImageTokens:
  """The tower's output: each row's image tokens, in the order they occur."""

  tokens_BxMxD: jax.Array  # spliced over the image tokens of the text
  deepstack_JxBxMxD: jax.Array  # added after decoder layers 0..J-1


def splice(x_BxTxD, is_image_BxT, images: ImageTokens):
  """(x with image tokens in place, add_deepstack(x, layer) or None).

  The i-th image token of row b takes row b's i-th token of `images` (every
  image token must have one); add_deepstack adds deepstack level `layer`
  (traced or not) at the same places, and nothing past the last level.
  """
  slot_BxTx1 = jnp.clip(jnp.cumsum(is_image_BxT, axis=1) - 1, 0,
                        images.tokens_BxMxD.shape[1] - 1)[..., None]
  take = lambda v_BxMxD: jnp.take_along_axis(v_BxMxD, slot_BxTx1, axis=1)
  x_BxTxD = jnp.where(is_image_BxT[..., None], take(images.tokens_BxMxD),
                      x_BxTxD)
  levels = images.deepstack_JxBxMxD.shape[0]

  def add_deepstack(x_BxTxD, layer):
    level_BxMxD = jnp.take(images.deepstack_JxBxMxD,
                           jnp.minimum(layer, levels - 1), axis=0)
    here_BxT = is_image_BxT & (layer < levels)
    return x_BxTxD + jnp.where(here_BxT[..., None], take(level_BxMxD),
                               0).astype(x_BxTxD.dtype)

  return x_BxTxD, (add_deepstack if levels else None)


def abstract_patches(config: VisionConfig, length: int,
                     lead: tuple[int, ...] = (1,)) -> Patches:
  """Patches of ShapeDtypeStructs (memory plans and lowering; no arrays);
  `lead` is the batch shape ([B] or [M, B])."""
  sds = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(
      lead + shape, dtype)
  return Patches(sds(length, config.patch_dim),
                 sds(length, 4, dtype=jnp.int32), sds(length, 4),
                 sds(length, config.head_dim // 2),
                 sds(length, dtype=jnp.int32))


def bucket_length(config: VisionConfig, num_patches: int) -> int:
  """Padded patch count: m^2 times 16 merged tokens, or 4 steps per octave
  above (at most 25% padding past 64 merged tokens)."""
  unit = config.spatial_merge_size ** 2
  merged = max(16, -(-num_patches // unit))
  step = max(16, 1 << max(0, (merged - 1).bit_length() - 3))
  return unit * -(-merged // step) * step


def _geometry(config: VisionConfig, grids, length: int):
  """(pos index, pos weight, angles, segment) of one row's images, padded."""
  side = int(round(config.num_position_embeddings ** 0.5))
  quarter = config.head_dim // 4
  inv_freq = 1.0 / (config.rope_theta ** (
      np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
  index = np.zeros((length, 4), np.int32)
  weight = np.zeros((length, 4), np.float32)
  angles = np.zeros((length, 2 * quarter), np.float32)
  segment = np.full((length,), -1, np.int32)
  start, frame = 0, 0
  for grid in grids:
    t, h, w = grid
    rows, cols = _rows_cols(grid, config.spatial_merge_size)
    row_taps, row_w = _axis_taps(rows, h, side)
    col_taps, col_w = _axis_taps(cols, w, side)
    span = slice(start, start + t * h * w)
    index[span] = (row_taps[:, :, None] * side
                   + col_taps[:, None, :]).reshape(-1, 4)
    weight[span] = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    angles[span] = np.concatenate([rows[:, None] * inv_freq,
                                   cols[:, None] * inv_freq], axis=1)
    segment[span] = frame + np.repeat(np.arange(t), h * w)
    start, frame = start + t * h * w, frame + t
  return index, weight, angles, segment


def patches(config: VisionConfig, pixel_values, grids,
            images_per_row: Sequence[int] | None = None,
            length: int | None = None) -> Patches:
  """Arrays [B, N, ...] of images for the tower.

  Row b takes the next `images_per_row[b]` images (default: one row, all of
  them), padded to `length` patches (default: the bucket_length of the
  fullest row). The learned position table is resampled bilinearly onto each
  image's grid; rotary angles put rows on the first half of the frequencies
  and columns on the second. `pixel_values` may be a device array (traced
  too); the geometry is always host numpy.
  """
  grids = check_grids(config, grids)
  counts = [len(grids)] if images_per_row is None else list(images_per_row)
  if sum(counts) != len(grids):
    raise ValueError(f'images_per_row {counts} sum to {sum(counts)}, not the '
                     f'{len(grids)} images of image_grid_thw')
  sizes = [t * h * w for t, h, w in grids]
  if tuple(np.shape(pixel_values)) != (sum(sizes), config.patch_dim):
    raise ValueError(f'pixel_values has shape {np.shape(pixel_values)}; the '
                     f'grids {grids} need ({sum(sizes)}, {config.patch_dim})')
  offsets = np.cumsum([0] + counts)
  row_grids = [grids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
  row_sizes = [sum(sizes[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
  length = (bucket_length(config, max(row_sizes)) if length is None
            else length)
  if length < max(row_sizes) or length % config.spatial_merge_size ** 2:
    raise ValueError(f'{length} patch slots for rows of up to '
                     f'{max(row_sizes)} patches (a multiple of '
                     f'{config.spatial_merge_size ** 2} is needed)')
  geometry = [_geometry(config, g, length) for g in row_grids]
  starts = np.cumsum([0] + row_sizes)
  if isinstance(pixel_values, jax.Array):  # on device, maybe traced
    pixels = jnp.stack([jnp.pad(
        pixel_values[a:b].astype(jnp.float32), ((0, length - (b - a)), (0, 0)))
                        for a, b in zip(starts[:-1], starts[1:])])
  else:
    pixels = np.zeros((len(counts), length, config.patch_dim), np.float32)
    values = np.asarray(pixel_values, np.float32)
    for r, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
      pixels[r, :b - a] = values[a:b]
  return Patches(pixels, *(np.stack(parts) for parts in zip(*geometry)))


def multimodal_positions(tokens_BxT, mask_BxT, grids: tuple[Grid, ...],
                         config: VisionConfig):
  """Qwen3-VL rotary positions: ([B, T, 3] int32 (t, h, w), next [B] int32,
  images per row).

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
  images_B = np.zeros((b,), np.int32)
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
      images_B[row] += 1
    next_B[row] = (out[row, slots].max() + 1) if len(slots) else 0
  if queue:
    raise ValueError(f'{len(queue)} of {len(grids)} images in image_grid_thw '
                     'have no image tokens in input_ids')
  return out, next_B, images_B


# ---- the tower --------------------------------------------------------------


def _param(rngs, shape, axes, dtype, init='normal', stack: int | None = None):
  """A Param; with `stack`, one per layer along a leading 'layers' axis."""
  if stack:
    shape, axes = (stack,) + tuple(shape), ('layers',) + tuple(axes)
  if init == 'normal':
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  else:
    value = (jnp.ones if init == 'ones' else jnp.zeros)(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, dtype: str, axis_name: str = 'norm',
               eps: float = 1e-6, stack: int | None = None):
    self.scale = _param(None, (dim,), (axis_name,), dtype, 'ones', stack)
    self.bias = _param(None, (dim,), (axis_name,), dtype, 'zeros', stack)
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
  """Pre-norm attention + GELU(tanh) MLP, all projections with biases; with
  `stack`, all blocks (leading 'layers' axis, run by lax.scan)."""

  def __init__(self, config: VisionConfig, rngs: nnx.Rngs, dtype: str,
               stack: int | None = None):
    e, i, h, dh = (config.hidden_size, config.intermediate_size,
                   config.num_heads, config.head_dim)
    p = lambda shape, axes, init='normal': _param(
        rngs if init == 'normal' else None, shape, axes, dtype, init, stack)
    self.norm1 = LayerNorm(e, dtype, stack=stack)
    self.norm2 = LayerNorm(e, dtype, stack=stack)
    self.wqkv = p((e, 3, h, dh), ('embed', None, 'q_heads', 'head_dim'))
    self.bqkv = p((3, h, dh), (None, 'q_heads', 'head_dim'), 'zeros')
    self.wo = p((h, dh, e), ('q_heads', 'head_dim', 'embed'))
    self.bo = p((e,), ('norm',), 'zeros')
    self.w_fc1 = p((e, i), ('embed', 'mlp'))
    self.b_fc1 = p((i,), ('mlp',), 'zeros')
    self.w_fc2 = p((i, e), ('mlp', 'embed'))
    self.b_fc2 = p((e,), ('norm',), 'zeros')

  def __call__(self, x_BxNxE, angles_BxNxF, segment_BxN, block: int):
    dt = x_BxNxE.dtype
    n = x_BxNxE.shape[1]
    qkv = jnp.einsum('BNE,EcHd->cBNHd', self.norm1(x_BxNxE),
                     self.wqkv[...].astype(dt)) + self.bqkv[...].astype(
                         dt)[:, None, None, :, :]
    q = attention.rotary(qkv[0], angles_BxNxF)
    k, v = attention.rotary(qkv[1], angles_BxNxF), qkv[2]
    out_BxNxHxDh = attention.chunked(  # bidirectional within each frame
        q, k, v, segment_BxN >= 0, q_offset=n - 1, block=block,
        segment_BxS=segment_BxN)
    x_BxNxE = x_BxNxE + jnp.einsum(
        'BNHd,HdE->BNE', out_BxNxHxDh,
        self.wo[...].astype(dt)) + self.bo[...].astype(dt)[None, None]
    h = (self.norm2(x_BxNxE) @ self.w_fc1[...].astype(dt)
         + self.b_fc1[...].astype(dt)[None, None])
    h = sharding.constrain(jax.nn.gelu(h, approximate=True),
                           ('batch', 'length', 'act_mlp'))
    return (x_BxNxE + h @ self.w_fc2[...].astype(dt)
            + self.b_fc2[...].astype(dt)[None, None])


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

  def __call__(self, x_BxNxE):
    dt = x_BxNxE.dtype
    b, md = x_BxNxE.shape[0], self.w_fc1.shape[0]
    if self.postshuffle:
      x_BxMxMd = self.norm(x_BxNxE.reshape(b, -1, md))
    else:
      x_BxMxMd = self.norm(x_BxNxE).reshape(b, -1, md)
    h = jax.nn.gelu(x_BxMxMd @ self.w_fc1[...].astype(dt)
                    + self.b_fc1[...].astype(dt)[None, None], approximate=False)
    return (h @ self.w_fc2[...].astype(dt)
            + self.b_fc2[...].astype(dt)[None, None])


class VisionTower(nnx.Module):
  """Patches -> (tokens [B, M, D], deepstack [J, B, M, D]), M = N / m^2."""

  def __init__(self, config: VisionConfig, rngs: nnx.Rngs, dtype: str,
               param_dtype: str, scan: bool = False):
    self.config = config
    self.dtype = dtype
    self.scan = scan
    pd, e = param_dtype, config.hidden_size
    self.patch_w = _param(rngs, (config.patch_dim, e), (None, 'embed'), pd)
    self.patch_b = _param(None, (e,), ('norm',), pd, 'zeros')
    self.pos_embed = _param(rngs, (config.num_position_embeddings, e),
                            (None, 'embed'), pd)
    if scan:
      self.blocks = VisionBlock(config, rngs, pd, stack=config.depth)
    else:
      self.blocks = nnx.List([VisionBlock(config, rngs, pd)
                              for _ in range(config.depth)])
    self.merger = Merger(config, rngs, pd, postshuffle=False)
    self.deepstack = nnx.List([Merger(config, rngs, pd, postshuffle=True)
                               for _ in config.deepstack_indexes])

  def __call__(self, patches_: Patches, *, block: int = 512,
               checkpoint=None):
    """`checkpoint(fn)`: what the backward pass keeps of each block (remat);
    it wraps fn(block state, x) -> x, or the scan step fn(x, block state) ->
    (x, None) of stacked blocks. None keeps everything. Stacked blocks run
    as one scan per stretch between deepstack taps (XLA schedules a remat
    of unrolled blocks early, which keeps every block's activations)."""
    c, dt = self.config, self.dtype
    p = patches_
    x = (p.pixels_BxNxP.astype(dt) @ self.patch_w[...].astype(dt)
         + self.patch_b[...].astype(dt)[None, None])
    table = self.pos_embed[...].astype(jnp.float32)
    pos_BxNxE = jnp.einsum('BNtE,BNt->BNE',
                           jnp.take(table, p.pos_index_BxNx4, axis=0),
                           p.pos_weight_BxNx4)
    x_BxNxE = sharding.constrain(x + pos_BxNxE.astype(dt),
                                 ('batch', 'length', 'act_embed'))
    levels = []
    if self.scan:
      graphdef, stacked = nnx.split(self.blocks)

      def step(x, state):
        return nnx.merge(graphdef, state)(x, p.angles_BxNxF, p.segment_BxN,
                                          block), None

      step = step if checkpoint is None else checkpoint(step)
      start = 0
      for end in sorted(set(c.deepstack_indexes) | {c.depth - 1}):
        part = jax.tree.map(lambda a, s=start, e=end: a[s:e + 1], stacked)
        x_BxNxE = jax.lax.scan(step, x_BxNxE, part)[0]
        if end in c.deepstack_indexes:
          levels.append(self.deepstack[c.deepstack_indexes.index(end)](
              x_BxNxE))
        start = end + 1
    for i, blk in enumerate([] if self.scan else self.blocks):
      if checkpoint is None:
        x_BxNxE = blk(x_BxNxE, p.angles_BxNxF, p.segment_BxN, block)
      else:
        graphdef, state = nnx.split(blk)
        x_BxNxE = checkpoint(lambda st, x, g=graphdef: nnx.merge(g, st)(
            x, p.angles_BxNxF, p.segment_BxN, block))(state, x_BxNxE)
      if i in c.deepstack_indexes:
        levels.append(self.deepstack[c.deepstack_indexes.index(i)](x_BxNxE))
    tokens_BxMxD = self.merger(x_BxNxE)
    if levels:
      return tokens_BxMxD, jnp.stack(levels)
    return tokens_BxMxD, jnp.zeros((0,) + tokens_BxMxD.shape,
                                   tokens_BxMxD.dtype)
