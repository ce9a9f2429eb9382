"""The optimizer of both train steps: learning-rate schedule, clipping, AdamW.

Hyper-parameters come from a `config.optim.<model>` section
(configs/base.py optim_section).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def make_schedule(optim_config) -> optax.Schedule:
  """'constant' | 'cosine' | 'linear' decay after a linear warmup."""
  lr, warmup = optim_config.learning_rate, optim_config.warmup_steps
  kind, decay_steps = optim_config.schedule, optim_config.decay_steps
  if kind not in ('constant', 'cosine', 'linear'):
    raise ValueError(f'optim.schedule={kind!r}; expected constant, cosine or '
                     'linear')
  if kind != 'constant' and decay_steps <= 0:
    raise ValueError(f'optim.schedule={kind!r} needs optim.decay_steps > 0')
  if kind == 'constant':
    decay = optax.constant_schedule(lr)
  elif kind == 'cosine':
    decay = optax.cosine_decay_schedule(lr, decay_steps,
                                        alpha=optim_config.min_lr_ratio)
  else:
    decay = optax.linear_schedule(lr, lr * optim_config.min_lr_ratio,
                                  decay_steps)
  if warmup <= 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def make_optimizer(optim_config) -> optax.GradientTransformation:
  """Global-norm clipping (on the accumulated gradient), then AdamW.

  `optim.mu_dtype` 'bfloat16' keeps Adam's first moment in bfloat16 (a
  quarter of the optimizer memory saved; the second moment stays float32).

  The AdamW hyper-parameters (and a constant learning rate) live in the
  optimizer state rather than in the compiled program.
  """
  schedule = make_schedule(optim_config)
  if optim_config.schedule == 'constant' and optim_config.warmup_steps <= 0:
    schedule = float(optim_config.learning_rate)
  if optim_config.mu_dtype not in ('float32', 'bfloat16'):
    raise ValueError(f'optim.mu_dtype={optim_config.mu_dtype!r}: float32 or '
                     'bfloat16')
  adamw = optax.inject_hyperparams(optax.adamw, static_args=('mu_dtype',))(
      learning_rate=schedule, b1=optim_config.b1, b2=optim_config.b2,
      eps=optim_config.eps, weight_decay=optim_config.weight_decay,
      mu_dtype=jnp.dtype(optim_config.mu_dtype))
  if optim_config.max_grad_norm <= 0:
    return adamw
  return optax.chain(clip_by_global_norm(optim_config.max_grad_norm), adamw)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """Scales the gradient by min(1, max_norm / ||g||), as optax's transform.

  One multiply by a scalar, which XLA fuses into AdamW's moment updates;
  optax.clip_by_global_norm's per-leaf select materialises a clipped copy of
  the gradient (measured: 540 MB more temporary memory in a SmolLM2-135M
  step).
  """

  def update(grads, state, params=None):
    del params
    norm = optax.tree.norm(grads)
    scale = jnp.minimum(1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), state

  return optax.GradientTransformation(
      lambda params: optax.EmptyState(), update)


def current_lr(opt_state) -> jax.Array:
  """The learning rate of the last update."""
  return optax.tree_utils.tree_get(opt_state, 'hyperparams')['learning_rate']
