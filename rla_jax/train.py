"""Policy and reward-model training: TrainState, log-prob pass, jitted steps.

`policy_step` / `reward_step` are module-level pure functions; a `Trainer`
only holds them jitted for one model on one mesh. train_epoch.update runs
one RL epoch's training from a list of `structs.Example`s.

Letters: M micro-batches, B rows, K responses per row (batching.pack),
N = B * K sequences, T tokens, R response tokens, D width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rla_jax import batching
from rla_jax import losses
from rla_jax import optim
from rla_jax import sharding
from rla_jax.models import transformer

POLICY = 'policy'
REWARD = 'reward'


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32: optimizer steps applied so far
  params: Any  # pure dict, the arrays the sampler reads
  opt_state: Any


def state_dict(state: TrainState) -> dict[str, Any]:
  """The state as a plain dict (for checkpoints)."""
  return dict(step=state.step, params=state.params, opt_state=state.opt_state)


def state_from_dict(tree: dict[str, Any]) -> TrainState:
  return TrainState(step=tree['step'], params=tree['params'],
                    opt_state=tree['opt_state'])


class NonFiniteLossError(FloatingPointError):
  """Too many steps in a row were non-finite; `state` is the (unchanged) state.

  Each such step is skipped; `train.max_nonfinite_steps` in a row raise this.
  """

  def __init__(self, message: str, state: TrainState):
    super().__init__(message)
    self.state = state


def loss_config(train_config) -> losses.LossConfig:
  return losses.LossConfig(
      clip_eps=train_config.clip_eps, kl_coef=train_config.kl_coef,
      entropy_coef=train_config.entropy_coef,
      log_ratio_clamp=train_config.log_ratio_clamp,
      aggregation=train_config.aggregation,
      compute_entropy=train_config.compute_entropy)


# ---- device functions ------------------------------------------------------


def _response_hidden(model, tokens_BxT, mask_BxT, response_len: int,
                     positions_BxTx3=None, patches=None, branches: int = 1):
  """Hidden states that predict the response tokens, and those tokens:
  [N, R, D] and [N, R] for rows of `branches` responses (batching.pack).

  With images, the vision tower encodes the micro-batch's `patches` inside
  the step (its parameters train with the rest).
  """
  t = tokens_BxT.shape[1]
  p = t - branches * response_len
  if branches > 1:
    return _branch_hidden(model, tokens_BxT, mask_BxT, p, branches,
                          response_len)
  images = None if patches is None else model.encode_images(patches)
  hidden_BxTxD = model.hidden(tokens_BxT, mask_BxT=mask_BxT,
                              positions_BxT=positions_BxTx3, images=images)
  return hidden_BxTxD[:, p - 1:t - 1], tokens_BxT[:, p:]


def _branch_hidden(model, tokens_BxT, mask_BxT, p: int, k: int, r: int):
  """`_response_hidden` of rows `[prompt | response 1 | ... | response K]`.

  Each response continues the prompt's positions and sees only the prompt
  and itself; its first token is predicted by the prompt's last hidden state.
  """
  b, t = tokens_BxT.shape
  mask_BxT = mask_BxT.astype(bool)
  slot_T = np.arange(t)
  branch_T = np.where(slot_T < p, 0, (slot_T - p) // r + 1)
  prompt_BxP = mask_BxT[:, :p]
  positions_BxT = jnp.concatenate([
      transformer.default_positions(prompt_BxP),
      jnp.sum(prompt_BxP, axis=1, dtype=jnp.int32)[:, None]
      + jnp.asarray(np.arange(k * r) % r)[None]], axis=1)
  hidden_BxTxD = model.hidden(
      tokens_BxT, mask_BxT=mask_BxT, positions_BxT=positions_BxT,
      branch_BxT=jnp.broadcast_to(jnp.asarray(branch_T, jnp.int32), (b, t)))
  r_KxR = np.arange(r)[None]
  source_KxR = np.where(r_KxR == 0, p - 1,
                        p + np.arange(k)[:, None] * r + r_KxR - 1)
  hidden_BxKxRxD = jnp.take(hidden_BxTxD, source_KxR, axis=1)
  return (hidden_BxKxRxD.reshape(b * k, r, -1),
          tokens_BxT[:, p:].reshape(b * k, r))


def _head_positions(head_chunk: int, batch_size: int) -> int:
  """Positions per head chunk for `head_chunk` tokens over the micro-batch."""
  return max(1, head_chunk // batch_size) if head_chunk > 0 else 0


def _over_micro_batches(fn, init, xs, active_M):
  """Folds fn(carry, x) -> (carry, y) over micro-batches; skips padding ones.

  A single micro-batch compiles to straight-line code.
  """
  if active_M.shape[0] == 1:
    carry, y = fn(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda v: v[None], y)
  y_shape = jax.eval_shape(fn, init, jax.tree.map(lambda x: x[0], xs))[1]

  def body(carry, active_x):
    active, x = active_x
    skip = lambda: (carry, jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), y_shape))
    return jax.lax.cond(active, lambda: fn(carry, x), skip)

  return jax.lax.scan(body, init, (active_M, xs))


def logprob_pass(params, batch: batching.Batch, *, graphdef, head_chunk: int):
  """log pi(response token) of every micro-batch: [M, N, R] float32."""
  r, k = batch.response_len, batch.branches
  chunk = _head_positions(head_chunk, batch.response_mask_MxBxR.shape[1])

  def one(carry, xs):
    model = nnx.merge(graphdef, params)
    hidden_BxRxD, targets_BxR = _response_hidden(model, *xs[:2], r, *xs[2:],
                                                 branches=k)
    return carry, losses.token_logprobs(hidden_BxRxD, model.head_weight(),
                                        targets_BxR, chunk=chunk)

  active_M = jnp.any(batch.response_mask_MxBxR, axis=(1, 2))
  xs = (batch.tokens_MxBxT, batch.mask_MxBxT, batch.positions_MxBxTx3,
        batch.patches)
  return _over_micro_batches(one, (), xs, active_M)[1]


def _global_weights(batch: batching.Batch, aggregation: str):
  """Token weights normalised over all micro-batches of the step."""
  mask_MxBxR = batch.response_mask_MxBxR
  m, b, r = mask_MxBxR.shape
  mask_NxR = mask_MxBxR.reshape(m * b, r)
  num_tokens = jnp.sum(mask_NxR)
  num_sequences = jnp.sum(jnp.any(mask_NxR, axis=1))
  weights = losses.token_weights(mask_NxR, aggregation, num_sequences,
                                 num_tokens)
  return weights.reshape(m, b, r), num_tokens, num_sequences


def _accumulate(params, batch: batching.Batch, graphdef, loss_cfg, head_chunk,
                grad_shardings, accum_dtype=jnp.float32):
  """Sums of loss, metrics and gradients over the micro-batches.

  With more than one micro-batch the running sum is held in `accum_dtype`
  (bfloat16 halves that buffer, one model's worth of float32; each
  micro-batch's gradient is still computed in float32). The result is float32.
  """
  weights_MxBxR, num_tokens, num_sequences = _global_weights(
      batch, loss_cfg.aggregation)
  r, k = batch.response_len, batch.branches
  chunk = _head_positions(head_chunk, batch.response_mask_MxBxR.shape[1])

  def loss_fn(p, xs):
    (tokens_BxT, mask_BxT, weights_BxR, old_BxR, ref_BxR, adv_B, positions,
     patches) = xs
    model = nnx.merge(graphdef, p)
    hidden_BxRxD, targets_BxR = _response_hidden(model, tokens_BxT, mask_BxT,
                                                 r, positions, patches, k)
    data = dict(old_logp_BxT=old_BxR, ref_logp_BxT=ref_BxR,
                weights_BxT=weights_BxR, advantages_B=adv_B)
    return losses.head_loss(hidden_BxRxD, model.head_weight(), targets_BxR,
                            data, loss_cfg, chunk)

  constrain = lambda g: g if grad_shardings is None else (
      jax.lax.with_sharding_constraint(g, grad_shardings))

  single = batch.tokens_MxBxT.shape[0] == 1
  dtype = jnp.float32 if single else accum_dtype

  def micro(acc, xs):
    out, grads = jax.value_and_grad(loss_fn, has_aux=True)(params, xs)
    if acc is not None:
      grads = jax.tree.map(lambda a, g: (a.astype(jnp.float32) + g), acc,
                           grads)
    return constrain(jax.tree.map(lambda g: g.astype(dtype), grads)), out

  xs = (batch.tokens_MxBxT, batch.mask_MxBxT, weights_MxBxR,
        batch.old_logp_MxBxR, batch.ref_logp_MxBxR, batch.advantages_MxB,
        batch.positions_MxBxTx3, batch.patches)
  active_M = jnp.any(batch.response_mask_MxBxR, axis=(1, 2))
  init = None if single else constrain(
      jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params))
  grads, (loss_M, metrics_M) = _over_micro_batches(micro, init, xs, active_M)
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  metrics = {k: jnp.max(v) if k in losses.MAX_METRICS else jnp.sum(v)
             for k, v in metrics_M.items()}
  metrics.update(tokens=num_tokens, sequences=num_sequences)
  return grads, jnp.sum(loss_M), metrics


def policy_step(state: TrainState, batch: batching.Batch, *, graphdef,
                tx: optax.GradientTransformation,
                loss_cfg: losses.LossConfig, head_chunk: int,
                grad_shardings=None,
                accum_dtype=jnp.float32) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step on the summed gradient of all micro-batches.

  A step whose loss or gradient is not finite leaves the state unchanged
  (the host counts and logs it, see train_epoch.update).
  """
  grads, loss, metrics = _accumulate(state.params, batch, graphdef, loss_cfg,
                                     head_chunk, grad_shardings, accum_dtype)
  grad_norm = optax.tree.norm(grads)

  def apply():
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state)

  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_state = jax.lax.cond(finite, apply, lambda: state)
  metrics.update(loss=loss, grad_norm=grad_norm,
                 lr=optim.current_lr(new_state.opt_state))
  return new_state, metrics


def reward_step(state: TrainState, batch: batching.Batch, **kwargs):
  """The RM is trained with the policy's loss (RLANYTHING.md 2.3)."""
  return policy_step(state, batch, **kwargs)


# ---- host side -------------------------------------------------------------


def model_config(graphdef) -> transformer.ModelConfig:
  """The ModelConfig a Transformer graphdef was built from."""
  for _, attribute in graphdef.attributes:
    value = getattr(attribute, 'value', None)
    if isinstance(value, transformer.ModelConfig):
      return value
  raise TypeError('graphdef is not a rla_jax.models.transformer.Transformer')


def remat_policy(value) -> str:
  """`train.remat` as a transformer.REMAT_POLICIES name.

  True and False, the key's old boolean spelling, mean 'full' and 'none'.
  """
  if isinstance(value, bool):
    return 'full' if value else 'none'
  transformer.check_remat(value, 'train.remat')
  return value


class Trainer:
  """The jitted train functions of one model on one mesh; holds no arrays.

  Compute dtype, parameter dtype, attention implementation and layer layout
  come from the model's config (bf16 compute with float32 master weights:
  dtype='bfloat16', param_dtype='float32'); `train.remat` says what the
  backward pass recomputes of each layer.
  """

  # Non-finite (skipped) steps in a row, across train_epoch.update calls:
  # host state of the run, checkpointed with it (checkpoint.run_meta).
  nonfinite_streak = 0

  def __init__(self, graphdef, optim_config, train_config, mesh=None,
               rules=sharding.DEFAULT_RULES, *, kind: str = POLICY):
    if kind not in (POLICY, REWARD):
      raise ValueError(f'kind={kind!r}; expected {POLICY!r} or {REWARD!r}')
    self.kind, self.mesh, self.rules = kind, mesh, rules
    self.optim_config, self.train_config = optim_config, train_config
    self._check_config(train_config)
    config = dataclasses.replace(model_config(graphdef),
                                 remat=remat_policy(train_config.remat))
    self.graphdef, abstract = nnx.split(transformer.abstract_model(config))
    self.vision_config = config.vision
    self.tx = optim.make_optimizer(optim_config)
    self.loss_cfg = loss_config(train_config)
    step_fn = functools.partial(
        policy_step if kind == POLICY else reward_step,
        graphdef=self.graphdef, tx=self.tx, head_chunk=train_config.head_chunk,
        accum_dtype=jnp.dtype(train_config.grad_accum_dtype))
    fns = dict(
        step=functools.partial(step_fn, loss_cfg=self.loss_cfg),
        step_on_policy=functools.partial(step_fn, loss_cfg=dataclasses.replace(
            self.loss_cfg, on_policy=True)),
        logprobs=functools.partial(logprob_pass, graphdef=self.graphdef,
                                   head_chunk=train_config.head_chunk),
        init=lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                  opt_state=self.tx.init(p)),
        init_opt=self.tx.init)
    self.shardings = None
    if mesh is None:
      self._step = jax.jit(fns['step'], donate_argnums=(0,))
      self._step_on_policy = jax.jit(fns['step_on_policy'],
                                     donate_argnums=(0,))
      self._logprobs = jax.jit(fns['logprobs'])
      self._init = jax.jit(fns['init'])
      self._init_opt = jax.jit(fns['init_opt'])
      return
    params_sh = sharding.param_shardings(abstract, mesh, rules)
    repl = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(
        self.tx, lambda _, s: s,
        jax.eval_shape(self.tx.init, nnx.to_pure_dict(abstract)), params_sh,
        transform_non_params=lambda _: repl)
    state_sh = TrainState(step=repl, params=params_sh, opt_state=opt_sh)
    batch_sh = jax.sharding.NamedSharding(
        mesh, sharding.spec((None, 'batch'), None, mesh, rules))
    self._check_batch_split(mesh, batch_sh)
    self.shardings = dict(params=params_sh, batch=batch_sh)
    self._step, self._step_on_policy = (
        jax.jit(functools.partial(fns[name], grad_shardings=params_sh),
                in_shardings=(state_sh, batch_sh),
                out_shardings=(state_sh, repl), donate_argnums=(0,))
        for name in ('step', 'step_on_policy'))
    self._logprobs = jax.jit(fns['logprobs'],
                             in_shardings=(params_sh, batch_sh),
                             out_shardings=batch_sh)
    self._init = jax.jit(fns['init'], in_shardings=(params_sh,),
                         out_shardings=state_sh)
    self._init_opt = jax.jit(fns['init_opt'], in_shardings=(params_sh,),
                             out_shardings=opt_sh)

  @staticmethod
  def _check_config(c):
    for name, limit in (('prompt_buckets', c.max_prompt_len),
                        ('response_buckets', c.max_response_len)):
      if max(getattr(c, name)) < limit:
        raise ValueError(f'train.{name}={tuple(getattr(c, name))} does not '
                         f'reach the length limit {limit}')
    if c.updates_per_epoch < 1 and c.global_batch_size < 1:
      raise ValueError('train.updates_per_epoch or train.global_batch_size '
                       'must be positive')
    if c.grad_accum_dtype not in ('float32', 'bfloat16'):
      raise ValueError(f'train.grad_accum_dtype={c.grad_accum_dtype!r}: '
                       'float32 or bfloat16')
    if c.micro_batch_size < 1:
      raise ValueError(f'train.micro_batch_size={c.micro_batch_size}')
    if not isinstance(c.share_prompts, int) or c.share_prompts < 1:
      raise ValueError(f'train.share_prompts={c.share_prompts!r}: the most '
                       'responses that share one copy of a prompt, >= 1')
    if c.overlong_prompt not in (batching.DROP, batching.TRUNCATE):
      raise ValueError(f'train.overlong_prompt={c.overlong_prompt!r}; '
                       f'expected {batching.DROP!r} or {batching.TRUNCATE!r}')

  def _check_batch_split(self, mesh, batch_sh):
    axes = batch_sh.spec[1] or ()
    axes = (axes,) if isinstance(axes, str) else axes
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    if self.train_config.micro_batch_size % ways:
      raise ValueError(f'train.micro_batch_size='
                       f'{self.train_config.micro_batch_size} is not a multiple'
                       f' of the {ways} batch shards of the mesh')

  def _put(self, tree, kind: str):
    if self.shardings is None:
      return jax.device_put(tree)
    return jax.device_put(tree, self.shardings[kind])

  def init_state(self, params) -> TrainState:
    """A fresh state (step 0, new optimizer moments) around `params`."""
    with sharding.use(self.mesh, self.rules):
      return self._init(self._put(params, 'params'))

  def reset_optimizer(self, state: TrainState) -> TrainState:
    with sharding.use(self.mesh, self.rules):
      return state.replace(opt_state=self._init_opt(state.params))

  def logprobs(self, params, batch: batching.Batch) -> jax.Array:
    """Per-token log-probs [M, B, R] of the batch's responses under params."""
    with sharding.use(self.mesh, self.rules):
      return self._logprobs(self._put(params, 'params'),
                            self._put(batch, 'batch'))

  def step(self, state: TrainState, batch: batching.Batch, *,
           on_policy: bool = False):
    """One optimizer step; `state` is donated. Returns (state, metrics).

    on_policy: `state.params` are pi_old and the KL reference (see
    losses.LossConfig.on_policy); the batch's old_logp holds the sampler's
    log-probs, losses.NO_LOGPROB where there are none.
    """
    step = self._step_on_policy if on_policy else self._step
    with sharding.use(self.mesh, self.rules):
      return step(state, self._put(batch, 'batch'))
