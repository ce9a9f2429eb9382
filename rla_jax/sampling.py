"""Next-token choice on device: greedy, temperature, top-k, top-p.

Everything is built from elementwise ops and plain reductions over the
vocabulary: on XLA:CPU, `sort`, `lax.top_k`, `argmax` and `cumsum` over 32k
entries cost 1-60 ms per decode step (measured), against ~0.2 ms here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_BLOCK = 128  # vocabulary block of the two-level inverse CDF
_INT_MIN = -2**31


@dataclasses.dataclass(frozen=True)
class Params:
  """How to pick tokens; static (hashable), so each setting compiles once.

  temperature 0 is greedy. top_k 0 and top_p 1 disable those filters, applied
  in transformers' order: temperature, then top-k, then top-p.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  # Constrained decoding: only these token ids may be sampled (empty = all).
  allowed_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature={self.temperature} must be >= 0')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p={self.top_p} must be in (0, 1]')
    if self.top_k < 0:
      raise ValueError(f'top_k={self.top_k} must be >= 0')


def argmax(x_BxV):
  """First index of the maximum (jnp.argmax is ~5x slower on XLA:CPU)."""
  v = x_BxV.shape[-1]
  is_max_BxV = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
  iota_BxV = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, 1)
  first_B = jnp.min(jnp.where(is_max_BxV, iota_BxV, v), axis=-1)
  return jnp.minimum(first_B, v - 1)  # a NaN row has no maximum


def logprob(logits_BxV, tokens_B):
  """log_softmax(logits)[token]: the temperature-1 log-prob the RL ratio uses."""
  max_Bx1 = jnp.max(logits_BxV, axis=-1, keepdims=True)
  lse_B = max_Bx1[:, 0] + jnp.log(
      jnp.sum(jnp.exp(logits_BxV - max_Bx1), axis=-1))
  picked_B = jnp.take_along_axis(logits_BxV, tokens_B[:, None], axis=1)[:, 0]
  return picked_B - lse_B


def _ordered_keys(x_BxV):
  """int32 keys with the same order as the float32 values."""
  bits = jax.lax.bitcast_convert_type(x_BxV.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _threshold(keys_BxV, weights_BxV, target_Bx1):
  """Largest key t with sum(weights[keys >= t]) >= target, per row.

  Exact bisection over the int32 key range: 32 passes of one masked sum each,
  which XLA:CPU runs far faster than a sort of the vocabulary.
  """
  lo_Bx1 = jnp.full(target_Bx1.shape, _INT_MIN, jnp.int32)  # always enough
  hi_Bx1 = jnp.max(keys_BxV, axis=-1, keepdims=True) + 1  # never enough

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo+hi)/2), no overflow
    mass = jnp.sum(jnp.where(keys_BxV >= mid, weights_BxV, 0), axis=-1,
                   keepdims=True)
    enough = mass >= target_Bx1
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo_Bx1, _ = jax.lax.fori_loop(0, 32, halve, (lo_Bx1, hi_Bx1))
  return lo_Bx1


def _last_positive(w_BxN):
  """Index of the last entry > 0 per row (0 if none)."""
  iota_BxN = jax.lax.broadcasted_iota(jnp.int32, w_BxN.shape, 1)
  return jnp.max(jnp.where(w_BxN > 0, iota_BxN, 0), axis=-1)


def _inverse_cdf(weights_BxV, u_B):
  """Index i with cdf[i-1] < u * total <= cdf[i], for u in (0, 1).

  Two levels (block sums, then one block) replace a cumsum over the whole
  vocabulary. A token of zero weight is never returned: prefixes below the
  target skip leading zeros, and where float rounding would run past the last
  positive weight, the choice is clipped back to it.
  """
  b, v = weights_BxV.shape
  nb = -(-v // _BLOCK)
  w_BxNxC = jnp.pad(weights_BxV, ((0, 0), (0, nb * _BLOCK - v))).reshape(
      b, nb, _BLOCK)
  block_BxN = jnp.sum(w_BxNxC, axis=-1)
  cdf_BxN = jnp.cumsum(block_BxN, axis=-1)
  target_Bx1 = u_B[:, None] * cdf_BxN[:, -1:]
  # Mass before each block; a shifted cumsum, so it never decreases.
  before_BxN = jnp.concatenate([jnp.zeros((b, 1)), cdf_BxN[:, :-1]], axis=1)
  blk_B = jnp.minimum(jnp.sum(before_BxN < target_Bx1, axis=-1) - 1,
                      _last_positive(block_BxN))
  row_BxC = jnp.take_along_axis(w_BxNxC, blk_B[:, None, None], 1)[:, 0]
  cdf_BxC = (jnp.take_along_axis(before_BxN, blk_B[:, None], 1)
             + jnp.cumsum(row_BxC, axis=-1))
  within_B = jnp.minimum(jnp.sum(cdf_BxC < target_Bx1, axis=-1),
                         _last_positive(row_BxC))
  return blk_B * _BLOCK + within_B


def next_token(logits_BxV, u_B, params: Params, temperature=None):
  """Samples one token per row; `u_B` holds one uniform in (0, 1) per row.

  `temperature`, when given, is a traced scalar that replaces
  `params.temperature` (0: greedy), so greedy and sampled decoding share one
  compiled program; both choices are computed (a few ms per step at most).
  """
  if params.allowed_token_ids:
    allowed_V = jnp.zeros(logits_BxV.shape[-1], bool).at[
        jnp.asarray(params.allowed_token_ids)].set(True)
    logits_BxV = jnp.where(allowed_V[None, :], logits_BxV, -jnp.inf)
  if temperature is not None:
    safe = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    sampled_B = _sample(logits_BxV, u_B, params, safe)
    return jnp.where(temperature > 0, sampled_B, argmax(logits_BxV))
  if params.temperature == 0:
    return argmax(logits_BxV)
  return _sample(logits_BxV, u_B, params, params.temperature)


def _sample(logits_BxV, u_B, params: Params, temperature):
  """Temperature, then top-k and top-p filters, then one draw per row."""
  max_Bx1 = jnp.max(logits_BxV, axis=-1, keepdims=True)
  scaled_BxV = logits_BxV - max_Bx1
  if not isinstance(temperature, (int, float)) or temperature != 1:
    scaled_BxV = scaled_BxV / temperature
  weights_BxV = jnp.exp(scaled_BxV)
  if params.top_k:
    keys_BxV = _ordered_keys(scaled_BxV)
    target_Bx1 = jnp.full(max_Bx1.shape, params.top_k, jnp.float32)
    kth_Bx1 = _threshold(keys_BxV, jnp.ones_like(scaled_BxV), target_Bx1)
    weights_BxV = jnp.where(keys_BxV >= kth_Bx1, weights_BxV, 0)
  if params.top_p < 1:
    keys_BxV = jax.lax.bitcast_convert_type(weights_BxV, jnp.int32)  # >= 0
    target_Bx1 = params.top_p * jnp.sum(weights_BxV, axis=-1, keepdims=True)
    cut_Bx1 = _threshold(keys_BxV, weights_BxV, target_Bx1)
    weights_BxV = jnp.where(keys_BxV >= cut_Bx1, weights_BxV, 0)
  return _inverse_cdf(weights_BxV, u_B)
