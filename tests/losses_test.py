"""Clipped surrogate + k3 KL against hand-computed numbers; the fused head."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rla_jax import losses


def _config(**overrides):
  values = dict(clip_eps=0.2, kl_coef=0.1, entropy_coef=0.0,
                log_ratio_clamp=10.0, aggregation=losses.SEQUENCE_MEAN,
                compute_entropy=False)
  values.update(overrides)
  return losses.LossConfig(**values)


# Two sequences: three tokens with A = +1, two tokens (plus padding) with
# A = -2. Every token's numbers are written out below.
LOGP = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.3, -9.0]], np.float32)
OLD = np.array([[-1.0, -2.3, -0.2], [-1.0, -0.3, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)


def _k3(r):  # r = log(ref / pi)
  return math.exp(r) - 1 - r


# (loss, kl, ratio, clipped) per real token, eps = 0.2, beta = 0.1.
TOKENS = [
    # delta 0: ratio 1, surrogate 1 * 1.
    [(-1.0, 0.0, 1.0, 0),
     # delta +0.3, A > 0: ratio 1.35 is clipped to 1.2.
     (-1.2 + 0.1 * _k3(-0.3), _k3(-0.3), math.exp(0.3), 1),
     # delta -0.3, A > 0: min(0.741, 0.8) = 0.741, not clipped.
     (-math.exp(-0.3) + 0.1 * _k3(0.3), _k3(0.3), math.exp(-0.3), 0)],
    # delta -0.5, A < 0: min(0.607 * -2, 0.8 * -2) = -1.6, clipped.
    [(1.6 + 0.1 * _k3(0.5), _k3(0.5), math.exp(-0.5), 1),
     # delta 0: surrogate -2.
     (2.0, 0.0, 1.0, 0)],
]


def _expected(aggregation, index):
  per_seq = [[t[index] for t in seq] for seq in TOKENS]
  if aggregation == losses.SEQUENCE_MEAN:
    return np.mean([np.mean(s) for s in per_seq])
  return np.mean([x for s in per_seq for x in s])


@pytest.mark.parametrize('aggregation', losses.AGGREGATIONS)
def test_loss_matches_hand_computed(aggregation):
  loss, metrics = losses.policy_loss(
      jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
      _config(aggregation=aggregation))
  np.testing.assert_allclose(loss, _expected(aggregation, 0), rtol=1e-6)
  np.testing.assert_allclose(metrics['kl'], _expected(aggregation, 1),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics['ratio_mean'], _expected(aggregation, 2),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics['clip_frac'], _expected(aggregation, 3),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics['ratio_max'], math.exp(0.3), rtol=1e-6)


def test_hand_computed_means():
  # The two aggregations differ: sequence-mean weighs the short sequence more.
  assert _expected(losses.SEQUENCE_MEAN, 0) == pytest.approx(0.41509, abs=1e-4)
  assert _expected(losses.TOKEN_MEAN, 0) == pytest.approx(0.13662, abs=1e-4)
  assert _expected(losses.SEQUENCE_MEAN, 3) == pytest.approx(5 / 12)
  assert _expected(losses.TOKEN_MEAN, 3) == pytest.approx(2 / 5)


def test_clipped_tokens_get_no_policy_gradient():
  config = _config(kl_coef=0.0, aggregation=losses.TOKEN_MEAN)
  grad = jax.grad(lambda lp: losses.policy_loss(
      lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK), config)[0])(
          jnp.asarray(LOGP))
  # d(-ratio * A)/dlogp = -ratio * A, divided by the 5 tokens.
  expected = np.array([[-1.0, 0.0, -math.exp(-0.3)], [0.0, 2.0, 0.0]]) / 5
  np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


def test_on_policy_has_ratio_one_and_zero_kl():
  logp = jnp.asarray(LOGP)
  loss, metrics = losses.policy_loss(logp, logp, jnp.asarray(ADV),
                                     jnp.asarray(MASK), _config())
  assert float(metrics['kl']) == 0.0
  assert float(metrics['clip_frac']) == 0.0
  assert float(metrics['ratio_max']) == 1.0
  np.testing.assert_allclose(metrics['ratio_mean'], 1.0, rtol=1e-7)
  # Surrogate = A per token: sequence-mean of (1, -2) advantages, negated.
  np.testing.assert_allclose(loss, -(1.0 - 2.0) / 2, rtol=1e-6)


def test_frozen_reference_kl():
  ref = OLD + 0.5
  _, metrics = losses.policy_loss(
      jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
      _config(aggregation=losses.TOKEN_MEAN), ref_logp_BxT=jnp.asarray(ref))
  r = (ref - LOGP)[MASK > 0]
  np.testing.assert_allclose(metrics['kl'], np.mean(np.exp(r) - 1 - r),
                             rtol=1e-6)


def test_log_ratio_is_clamped():
  logp = jnp.asarray([[0.0]])
  old = jnp.asarray([[-50.0]])
  _, metrics = losses.policy_loss(logp, old, jnp.asarray([1.0]),
                                  jnp.ones((1, 1)), _config())
  np.testing.assert_allclose(metrics['ratio_max'], math.exp(10.0), rtol=1e-6)
  np.testing.assert_allclose(metrics['kl'], _k3(-10.0), rtol=1e-6)


def test_global_normalisers_make_micro_batches_add_up():
  config = _config()
  args = [jnp.asarray(x) for x in (LOGP, OLD, ADV, MASK)]
  whole, _ = losses.policy_loss(*args, config)
  parts = [losses.policy_loss(*[x[i:i + 1] for x in args], config,
                              num_sequences=2, num_tokens=5)[0]
           for i in range(2)]
  np.testing.assert_allclose(sum(parts), whole, rtol=1e-6)


def test_entropy_bonus_and_metric():
  entropy = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
  base, _ = losses.policy_loss(*[jnp.asarray(x) for x in (LOGP, OLD, ADV,
                                                           MASK)], _config())
  loss, metrics = losses.policy_loss(
      *[jnp.asarray(x) for x in (LOGP, OLD, ADV, MASK)],
      _config(entropy_coef=0.5), entropy_BxT=entropy)
  np.testing.assert_allclose(metrics['entropy'], (2.0 + 4.5) / 2, rtol=1e-6)
  np.testing.assert_allclose(loss, base - 0.5 * 3.25, rtol=1e-6)


# ---- the fused head --------------------------------------------------------


def _head_problem(seed=0, b=3, t=8, d=16, v=50):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(v, d)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = np.ones((b, t), np.float32)
  mask[1, 5:] = 0
  mask[2, :] = 0  # a padding row
  old = jnp.asarray(rng.normal(size=(b, t)) * 0.3 - 4.0, jnp.float32)
  adv = jnp.asarray([1.5, -0.7, 3.0], jnp.float32)
  return hidden, w, targets, jnp.asarray(mask), old, adv


def _reference_logp(hidden, w, targets):
  logp_all = jax.nn.log_softmax(jnp.einsum('BTD,VD->BTV', hidden, w), -1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
  return logp, entropy


@pytest.mark.parametrize('chunk,entropy_coef,compute_entropy',
                         [(0, 0.0, False), (4, 0.0, True), (3, 0.05, True)])
def test_head_loss_matches_autodiff(chunk, entropy_coef, compute_entropy):
  hidden, w, targets, mask, old, adv = _head_problem()
  config = _config(entropy_coef=entropy_coef, compute_entropy=compute_entropy)
  ref_logp = old + 0.2

  def reference(hidden, w):
    logp, entropy = _reference_logp(hidden, w, targets)
    return losses.policy_loss(logp, old, adv, mask, config,
                              ref_logp_BxT=ref_logp,
                              entropy_BxT=entropy if compute_entropy else None)

  def fused(hidden, w):
    data = dict(old_logp_BxT=old, ref_logp_BxT=ref_logp, advantages_B=adv,
                weights_BxT=losses.token_weights(mask, config.aggregation))
    return losses.head_loss(hidden, w, targets, data, config, chunk)

  (loss0, m0), g0 = jax.value_and_grad(reference, (0, 1), has_aux=True)(
      hidden, w)
  (loss1, m1), g1 = jax.jit(jax.value_and_grad(fused, (0, 1), has_aux=True))(
      hidden, w)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5, atol=1e-6)
  assert set(m1) == set(m0)
  for key in m0:
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6)
  for a, b in zip(g1, g0):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Without differentiation the primal gives the same numbers.
  loss2, _ = fused(hidden, w)
  np.testing.assert_allclose(loss2, loss0, rtol=1e-5, atol=1e-6)


def test_token_logprobs_matches_log_softmax():
  hidden, w, targets, *_ = _head_problem(seed=1)
  logp, entropy = _reference_logp(hidden, w, targets)
  ours, ours_entropy = losses.token_logprobs(hidden, w, targets, chunk=4,
                                             with_entropy=True)
  np.testing.assert_allclose(ours, logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours_entropy, entropy, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(losses.token_logprobs(hidden, w, targets), logp,
                             rtol=1e-5, atol=1e-5)


def test_unknown_aggregation_is_rejected():
  with pytest.raises(ValueError, match='aggregation'):
    _config(aggregation='mean')
