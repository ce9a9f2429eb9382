"""Clipped surrogate + k3 KL loss (RLANYTHING.md 2.3), shared by policy and RM.

Pure jnp. Letters: B sequences, T response tokens, C tokens of one chunk,
D model width, V vocabulary.

Every loss and metric is a weighted sum over tokens, `sum(weights_BxT * x)`.
The weights pick the aggregation and carry the normaliser of the whole global
batch, so sums over micro-batches add up to the loss of the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

SEQUENCE_MEAN = 'sequence'  # token-mean per sequence, then over sequences
TOKEN_MEAN = 'token'  # token-mean over the whole batch
AGGREGATIONS = (SEQUENCE_MEAN, TOKEN_MEAN)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static loss settings (hashable, so it can be a static jit argument)."""

  clip_eps: float  # epsilon of the clipped surrogate
  kl_coef: float  # beta of the k3 KL penalty
  entropy_coef: float  # bonus on the policy entropy; 0 = none (the paper)
  log_ratio_clamp: float  # |log-ratio| bound before exp (the authors use 10)
  aggregation: str  # SEQUENCE_MEAN | TOKEN_MEAN
  compute_entropy: bool  # report entropy even when entropy_coef == 0
  # The step's parameters are pi_old (the first optimizer step of an epoch,
  # KL against pi_old): pi_old and the KL reference are the step's own
  # log-probs (stop_gradient), so no separate log-prob pass is needed. The
  # `old_logp` input then holds the sampler's log-probs (NO_LOGPROB where
  # there are none) and only feeds the `gap_*` metrics.
  on_policy: bool = False

  def __post_init__(self):
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f'aggregation={self.aggregation!r}; expected one of '
                       f'{AGGREGATIONS}')

  @property
  def needs_entropy(self) -> bool:
    return self.compute_entropy or self.entropy_coef != 0


def token_weights(mask_BxT, aggregation: str, num_sequences=None,
                  num_tokens=None):
  """Weights whose weighted token sum is the aggregated mean.

  Args:
    mask_BxT: 1 on real response tokens.
    aggregation: SEQUENCE_MEAN or TOKEN_MEAN.
    num_sequences: sequences with at least one token in the global batch;
      by default those in `mask_BxT`.
    num_tokens: tokens in the global batch; by default those in `mask_BxT`.
  """
  mask_BxT = mask_BxT.astype(jnp.float32)
  lengths_B = jnp.sum(mask_BxT, axis=1)
  if aggregation == SEQUENCE_MEAN:
    if num_sequences is None:
      num_sequences = jnp.sum(lengths_B > 0)
    denom_B = jnp.maximum(lengths_B, 1.0) * jnp.maximum(num_sequences, 1)
    return mask_BxT / denom_B[:, None]
  if aggregation == TOKEN_MEAN:
    if num_tokens is None:
      num_tokens = jnp.sum(lengths_B)
    return mask_BxT / jnp.maximum(num_tokens, 1).astype(jnp.float32)
  raise ValueError(f'unknown aggregation {aggregation!r}')


def token_terms(logp, old_logp, ref_logp, advantage, mask, config: LossConfig):
  """Per-token loss pieces; all arguments broadcast to one shape.

  Returns a dict of per-token arrays: `loss` (negated clipped surrogate plus
  kl_coef * k3 KL), `kl`, `ratio`, `clipped` (1 where the clipped branch is
  the active one, i.e. the token has no policy gradient).
  """
  bound = config.log_ratio_clamp
  log_ratio = jnp.clip(jnp.where(mask, logp - old_logp, 0.0), -bound, bound)
  ratio = jnp.exp(log_ratio)
  clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
  surrogate = jnp.minimum(ratio * advantage, clipped_ratio * advantage)
  # k3 estimator of KL(pi || ref): exp(r) - 1 - r with r = log(ref / pi).
  ref_log_ratio = jnp.clip(jnp.where(mask, ref_logp - logp, 0.0), -bound,
                           bound)
  kl = jnp.exp(ref_log_ratio) - 1.0 - ref_log_ratio
  clipped = (((advantage > 0) & (ratio > 1.0 + config.clip_eps))
             | ((advantage < 0) & (ratio < 1.0 - config.clip_eps)))
  return dict(loss=config.kl_coef * kl - surrogate, kl=kl, ratio=ratio,
              clipped=clipped.astype(jnp.float32))


def weighted_loss(logp_BxT, old_logp_BxT, ref_logp_BxT, advantages_B,
                  weights_BxT, config: LossConfig, entropy_BxT=None):
  """(loss, metrics) as weighted token sums; `ratio_max` is a masked max."""
  mask_BxT = weights_BxT > 0
  terms = token_terms(logp_BxT, old_logp_BxT, ref_logp_BxT,
                      advantages_B[:, None], mask_BxT, config)
  wsum = lambda x: jnp.sum(weights_BxT * x)
  loss = wsum(terms['loss'])
  metrics = dict(pg_loss=wsum(terms['loss'] - config.kl_coef * terms['kl']),
                 kl=wsum(terms['kl']), clip_frac=wsum(terms['clipped']),
                 ratio_mean=wsum(terms['ratio']),
                 ratio_max=jnp.max(jnp.where(mask_BxT, terms['ratio'], 0.0)))
  if entropy_BxT is not None:
    metrics['entropy'] = wsum(entropy_BxT)
    loss = loss - config.entropy_coef * metrics['entropy']
  return loss, metrics


def policy_loss(logp_BxT, old_logp_BxT, advantages_B, mask_BxT,
                config: LossConfig, *, ref_logp_BxT=None, entropy_BxT=None,
                num_sequences=None, num_tokens=None):
  """The loss of RLANYTHING.md 2.3 from per-token log-probs.

  Args:
    logp_BxT: log pi_theta of the response tokens (differentiated).
    old_logp_BxT: log pi_old of the same tokens (the pre-update policy).
    advantages_B: one scalar advantage per sequence.
    mask_BxT: 1 on real response tokens.
    config: LossConfig.
    ref_logp_BxT: KL reference; defaults to `old_logp_BxT` (the authors').
    entropy_BxT: per-token policy entropy, for the bonus and the metric.
    num_sequences, num_tokens: global-batch normalisers (see token_weights).

  Returns:
    (loss, metrics) with metrics kl, clip_frac, ratio_mean, entropy
    aggregated like the loss, ratio_max over tokens and pg_loss.
  """
  if ref_logp_BxT is None:
    ref_logp_BxT = old_logp_BxT
  weights_BxT = token_weights(mask_BxT, config.aggregation, num_sequences,
                              num_tokens)
  return weighted_loss(logp_BxT, old_logp_BxT, ref_logp_BxT, advantages_B,
                       weights_BxT, config, entropy_BxT)


# ---- log-probs straight from hidden states ----------------------------------
#
# The head is most of the arithmetic (a 32k vocabulary against a 256-wide
# model) and its [B, T, V] logits are the largest tensors of the step. Both
# functions below walk the response in chunks of C positions so at most one
# [B, C, V] block exists at a time.


def _chunked(x, chunk: int):
  """[B, T, ...] -> [T // chunk, B, chunk, ...]."""
  b, t = x.shape[:2]
  x = x.reshape((b, t // chunk, chunk) + x.shape[2:])
  return jnp.swapaxes(x, 0, 1)


def _unchunked(x):
  """[T // chunk, B, chunk, ...] -> [B, T, ...]."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _scan_chunks(fn, carry, xs):
  """lax.scan, without a loop when there is a single chunk."""
  if jax.tree.leaves(xs)[0].shape[0] > 1:
    return jax.lax.scan(fn, carry, xs)
  carry, ys = fn(carry, jax.tree.map(lambda x: x[0], xs))
  return carry, jax.tree.map(lambda y: y[None], ys)


def _chunk_size(t: int, chunk: int) -> int:
  """The largest divisor of t that is at most `chunk` (t when chunk <= 0)."""
  if chunk <= 0 or chunk >= t:
    return t
  return max(c for c in range(1, chunk + 1) if t % c == 0)


def _head_stats(h_BxCxD, w_VxD, targets_BxC, with_entropy: bool):
  """Logits of one chunk and their log-softmax statistics."""
  z_BxCxV = jnp.einsum('BCD,VD->BCV', h_BxCxD, w_VxD,
                       preferred_element_type=jnp.float32)
  max_BxC = jax.lax.stop_gradient(jnp.max(z_BxCxV, axis=-1))
  e_BxCxV = jnp.exp(z_BxCxV - max_BxC[..., None])
  sum_BxC = jnp.sum(e_BxCxV, axis=-1)
  lse_BxC = max_BxC + jnp.log(sum_BxC)
  target_BxC = jnp.take_along_axis(z_BxCxV, targets_BxC[..., None],
                                   axis=-1)[..., 0]
  entropy_BxC = None
  if with_entropy:
    entropy_BxC = lse_BxC - jnp.sum(e_BxCxV * z_BxCxV, axis=-1) / sum_BxC
  return z_BxCxV, lse_BxC, target_BxC - lse_BxC, entropy_BxC


@functools.partial(jax.jit, static_argnames=('chunk', 'with_entropy'))
def token_logprobs(hidden_BxTxD, w_VxD, targets_BxT, *, chunk: int = 0,
                   with_entropy: bool = False):
  """log softmax(hidden @ w.T)[targets] per token (and the entropy).

  Not differentiable in a useful way; the train step uses `head_loss`.
  """
  chunk = _chunk_size(hidden_BxTxD.shape[1], chunk)

  def one(xs):
    h_BxCxD, y_BxC = xs
    _, _, logp_BxC, entropy_BxC = _head_stats(h_BxCxD, w_VxD, y_BxC,
                                              with_entropy)
    return logp_BxC, entropy_BxC

  logp, entropy = _scan_chunks(lambda carry, xs: (carry, one(xs)), None,
                               (_chunked(hidden_BxTxD, chunk),
                                _chunked(targets_BxT, chunk)))[1]
  logp_BxT = _unchunked(logp)
  return (logp_BxT, _unchunked(entropy)) if with_entropy else logp_BxT


# Metrics reduced by max (over chunks, micro-batches and steps), not summed.
MAX_METRICS = ('ratio_max', 'gap_max')
# "No sampler log-prob for this token" (a log-prob is never positive; NaN
# would do, but multi-process device_put compares host arrays by value).
NO_LOGPROB = 1.0


def _gap_metrics(logp_BxC, sampler_BxC, mask_BxC):
  """|sampler - trainer| log-prob over the tokens that have a sampler value."""
  has_BxC = mask_BxC & (sampler_BxC <= 0)
  gap_BxC = jnp.where(has_BxC, jnp.abs(sampler_BxC -
                                       jax.lax.stop_gradient(logp_BxC)), 0.0)
  return dict(gap_sum=jnp.sum(gap_BxC), gap_count=jnp.sum(has_BxC).astype(
      jnp.float32), gap_max=jnp.max(gap_BxC))


def _head_loss_chunks(hidden_BxTxD, w_VxD, targets_BxT, data, config, chunk,
                      with_grads):
  """Loss, metrics and (optionally) gradients, one chunk of positions at a time.

  The loss is a sum of per-token terms of (log-prob, entropy), so its
  gradient with respect to a chunk's logits is known as soon as that chunk's
  log-probs are: the backward pass through the head runs inside the same loop
  and no logits are kept for later.
  """
  chunk = _chunk_size(hidden_BxTxD.shape[1], chunk)
  with_entropy = config.needs_entropy
  xs = jax.tree.map(lambda x: _chunked(x, chunk),
                    (hidden_BxTxD, targets_BxT, data['old_logp_BxT'],
                     data['ref_logp_BxT'], data['weights_BxT']))
  advantages_B = data['advantages_B']

  def loss_of(logp_BxC, entropy_BxC, old, ref, weights):
    return weighted_loss(logp_BxC, old, ref, advantages_B, weights, config,
                         entropy_BxC)

  def step(carry, chunk_xs):
    h_BxCxD, y_BxC, old, ref, weights = chunk_xs
    z_BxCxV, lse_BxC, logp_BxC, entropy_BxC = _head_stats(
        h_BxCxD, w_VxD, y_BxC, with_entropy)
    gaps = {}
    if config.on_policy:
      gaps = _gap_metrics(logp_BxC, old, weights > 0)
      old = ref = jax.lax.stop_gradient(logp_BxC)
    if not with_grads:
      loss, metrics = loss_of(logp_BxC, entropy_BxC, old, ref, weights)
      return carry, (loss, dict(metrics, **gaps))
    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
    out, (g_logp_BxC, g_entropy_BxC) = grad_fn(logp_BxC, entropy_BxC, old,
                                              ref, weights)
    out = (out[0], dict(out[1], **gaps))
    # dz = g * (onehot - p) row by row. The row scale g is applied to the
    # narrow [B, C, D] operands instead of the [B, C, V] block: XLA:CPU would
    # fuse the whole per-token gradient into the block's loop otherwise and
    # recompute it for every vocabulary entry.
    onehot_BxCxV = (jax.lax.broadcasted_iota(jnp.int32, z_BxCxV.shape, 2)
                    == y_BxC[..., None])
    p_BxCxV = jnp.exp(z_BxCxV - lse_BxC[..., None])
    q_BxCxV = onehot_BxCxV - p_BxCxV
    if with_entropy and config.entropy_coef != 0:  # dH/dz = -p (log p + H)
      q_BxCxV = g_logp_BxC[..., None] * q_BxCxV - (
          g_entropy_BxC[..., None] * p_BxCxV
          * (z_BxCxV - lse_BxC[..., None] + entropy_BxC[..., None]))
      g_logp_BxC = jnp.ones_like(g_logp_BxC)
    q_BxCxV = q_BxCxV.astype(w_VxD.dtype)
    g_BxCx1 = g_logp_BxC[..., None]
    dh_BxCxD = g_BxCx1 * jnp.einsum('BCV,VD->BCD', q_BxCxV, w_VxD,
                                    preferred_element_type=jnp.float32)
    hg_BxCxD = (g_BxCx1 * h_BxCxD.astype(jnp.float32)).astype(w_VxD.dtype)
    # [D, V] = [D, BC] @ [BC, V] reads the block in its own layout; the
    # [V, D] product makes XLA:CPU copy the block transposed first.
    dw_DxV = carry + jnp.einsum('BCD,BCV->DV', hg_BxCxD, q_BxCxV,
                                preferred_element_type=jnp.float32)
    return dw_DxV, (out, dh_BxCxD.astype(h_BxCxD.dtype))

  v, d = w_VxD.shape
  dw_DxV = jnp.zeros((d, v), jnp.float32) if with_grads else None
  dw_DxV, ys = _scan_chunks(step, dw_DxV, xs)
  (loss, metrics), dh = ys if with_grads else (ys, None)
  maxima = {k: jnp.max(metrics.pop(k)) for k in MAX_METRICS if k in metrics}
  loss, metrics = jnp.sum(loss), jax.tree.map(jnp.sum, metrics)
  metrics.update(maxima)
  if not with_grads:
    return loss, metrics
  # Cast before transposing: XLA:CPU folds a transpose into the dot, and
  # with a single chunk (the zero carry folded away) that leaves a bf16 x
  # bf16 = f32 dot its DotThunk does not run (bfloat16 compute).
  return loss, metrics, _unchunked(dh), dw_DxV.astype(w_VxD.dtype).T


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def head_loss(hidden_BxTxD, w_VxD, targets_BxT, data, config: LossConfig,
              chunk: int):
  """`weighted_loss` of log softmax(hidden @ w.T)[targets], fused with the head.

  Args:
    hidden_BxTxD: final hidden states at the positions that predict targets.
    w_VxD: output projection.
    targets_BxT: response token ids.
    data: dict of old_logp_BxT, ref_logp_BxT, weights_BxT (see token_weights)
      and advantages_B; not differentiated.
    config: LossConfig.
    chunk: positions per chunk (0 = all at once); the largest divisor of T
      not above it is used.

  Returns:
    (loss, metrics) as `weighted_loss`. Gradients flow to hidden and w only.
  """
  return _head_loss_chunks(hidden_BxTxD, w_VxD, targets_BxT, data, config,
                           chunk, with_grads=False)


def _head_loss_fwd(hidden_BxTxD, w_VxD, targets_BxT, data, config, chunk):
  loss, metrics, dh, dw = _head_loss_chunks(hidden_BxTxD, w_VxD, targets_BxT,
                                            data, config, chunk,
                                            with_grads=True)
  return (loss, metrics), (dh, dw)


def _head_loss_bwd(config, chunk, residuals, cotangents):
  del config, chunk
  dh, dw = residuals
  g = cotangents[0]  # metrics are outputs only; their cotangents are ignored
  return (g.astype(dh.dtype) * dh, g.astype(dw.dtype) * dw, None, None)


head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)
