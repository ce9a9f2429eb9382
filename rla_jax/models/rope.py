"""Rotary position embedding: the angles of a model config's positions.

Text models rotate by one position axis; Qwen3-VL's frequencies follow the
(t, h, w) axes of its multimodal positions (`mrope_section`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(config) -> jax.Array:
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


def mrope_axes(config) -> np.ndarray:
  """[Dh/2]: the position axis (0 t, 1 h, 2 w) of each rotary frequency.

  Qwen3-VL interleaves them: frequency 3i+1 follows h for i < section[1],
  3i+2 follows w for i < section[2], every other one follows t.
  """
  axis_F = np.zeros(config.head_dim // 2, np.int32)
  _, h, w = config.mrope_section
  axis_F[1:3 * h:3] = 1
  axis_F[2:3 * w:3] = 2
  return axis_F


def rope_angles(config, positions):
  """Rotary angles [B, T, Dh/2] for positions [B, T] or [B, T, 3] (t, h, w)."""
  inv_freq = rope_inv_freq(config)
  if positions.ndim == 2:
    return positions[..., None].astype(jnp.float32) * inv_freq[None, None]
  if config.mrope_section is None:
    raise ValueError(f'positions of shape {positions.shape}: 3-axis positions '
                     'need a model with mrope_section (Qwen3-VL)')
  positions_BxTxF = jnp.take(positions, mrope_axes(config), axis=-1)
  return positions_BxTxF.astype(jnp.float32) * inv_freq[None, None]
