"""Batching, optimizer, and the policy / RM train steps on 1 and 8 devices."""

# pylint: disable=protected-access  (counting a Trainer's compiled programs)

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from rla_jax import batching
from rla_jax import losses
from rla_jax import optim
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train
from rla_jax import train_epoch
from rla_jax.models import manual_vjp
from rla_jax.models import transformer

CONFIG = transformer.ModelConfig('qwen2', 256, 64, 128, 2, 4, 2, 16,
                                 qkv_bias=True, tie_word_embeddings=True)
MODEL = nnx.split(transformer.abstract_model(CONFIG))[0]  # the graphdef


def optim_config(**overrides):
  values = dict(learning_rate=1e-2, schedule='constant', warmup_steps=0,
                decay_steps=0, min_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8,
                weight_decay=0.0, max_grad_norm=1.0, reset_every_epoch=False,
                mu_dtype='float32')
  values.update(overrides)
  return ml_collections.ConfigDict(values)


# Adam with eps=1 turns the first update into g / (|g| + 1): smooth in the
# gradient, so parameters after one step compare gradients (sign-like Adam
# updates would flip on rounding noise).
SMOOTH = dict(learning_rate=1.0, eps=1.0)


def train_config(**overrides):
  values = dict(
      micro_batch_size=8, updates_per_epoch=2, global_batch_size=0,
      max_prompt_len=12, max_response_len=16, overlong_prompt='drop',
      prompt_buckets=(12,), response_buckets=(16,), clip_eps=0.2,
      kl_coef=0.01, entropy_coef=0.0, log_ratio_clamp=10.0,
      aggregation='sequence', compute_entropy=True, head_chunk=64,
      remat=False, shuffle=False, seed=0, logprob_gap_warn=0.05,
      max_nonfinite_steps=8, grad_accum_dtype='float32', share_prompts=1)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def examples(n, seed=0, prompt=(3, 12), response=(2, 16)):
  rng = np.random.default_rng(seed)
  return [structs.Example(
      prompt_tokens=rng.integers(1, 256, rng.integers(*prompt)).tolist(),
      response_tokens=rng.integers(1, 256, rng.integers(*response)).tolist(),
      advantage=float(rng.normal())) for _ in range(n)]


@pytest.fixture(scope='module')
def params():
  return nnx.to_pure_dict(nnx.split(transformer.create(CONFIG, seed=0))[1])


def prepared_batch(model_trainer, state, exs):
  batch = batching.pack(exs, micro_batch_size=8, prompt_buckets=(12,),
                        response_buckets=(16,))
  old = model_trainer.logprobs(state.params, batch)
  return batch.replace(old_logp_MxBxR=old, ref_logp_MxBxR=old)


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))):
    np.testing.assert_allclose(x, y, atol=atol, rtol=0)


# ---- host-side batching ----------------------------------------------------


def test_select_keeps_triples_aligned_when_dropping():
  exs = [structs.Example([1, 2], [3], 0.1),
         structs.Example(list(range(1, 20)), [4], 0.2),  # prompt too long
         structs.Example([5], [], 0.3),  # empty response
         structs.Example([6, 7], list(range(30)), 0.4)]
  kept, dropped = batching.select(exs, max_prompt_len=12, max_response_len=5,
                                  overlong_prompt='drop')
  assert dropped == 2
  assert [(e.prompt_tokens, e.response_tokens, e.advantage) for e in kept] == [
      ([1, 2], [3], 0.1), ([6, 7], [0, 1, 2, 3, 4], 0.4)]
  kept, dropped = batching.select(exs, max_prompt_len=12, max_response_len=5,
                                  overlong_prompt='truncate')
  assert dropped == 1
  assert kept[1].prompt_tokens == list(range(8, 20))  # the last 12 tokens
  assert [e.advantage for e in kept] == [0.1, 0.2, 0.4]
  with pytest.raises(ValueError, match='example 0 has a non-finite'):
    batching.select([structs.Example([1], [2], math.nan)], max_prompt_len=4,
                    max_response_len=4, overlong_prompt='drop')


def test_pack_layout_and_buckets():
  exs = [structs.Example([1, 2, 3], [4, 5], 0.5),
         structs.Example([6], [7, 8, 9], -1.0),
         structs.Example([10, 11], [12], 2.0)]
  batch = batching.pack(exs, micro_batch_size=2, prompt_buckets=(2, 4, 8),
                        response_buckets=(4, 8))
  assert batch.tokens_MxBxT.shape == (2, 2, 8)  # P=4, R=4, 2 micro-batches
  np.testing.assert_array_equal(batch.tokens_MxBxT[0, 0], [0, 1, 2, 3, 4, 5,
                                                           0, 0])
  np.testing.assert_array_equal(batch.tokens_MxBxT[0, 1], [0, 0, 0, 6, 7, 8,
                                                           9, 0])
  np.testing.assert_array_equal(batch.mask_MxBxT[1, 0], [0, 0, 1, 1, 1, 0, 0,
                                                         0])
  np.testing.assert_array_equal(batch.response_mask_MxBxR[0, 1], [1, 1, 1, 0])
  np.testing.assert_array_equal(batch.advantages_MxB, [[0.5, -1.0], [2.0, 0]])
  assert not batch.mask_MxBxT[1, 1].any()  # a padding row
  assert batching.num_micro_batches(5, 2) == 4  # 3 rounded up to a power of 2
  assert batching.step_size(10, updates_per_epoch=4, global_batch_size=0) == 3
  assert batching.step_size(10, updates_per_epoch=4, global_batch_size=6) == 6


def test_steps_group_examples_with_a_seeded_grain_shuffle():
  steps = train_epoch._steps  # pylint: disable=protected-access
  exs = examples(10)
  c = train_config(updates_per_epoch=4)
  groups = steps(c, exs, epoch=1)
  assert [len(g) for g in groups] == [3, 3, 3, 1]
  assert [e for g in groups for e in g] == exs  # no shuffle: data order
  c = train_config(updates_per_epoch=4, shuffle=True, seed=3)
  first, again = steps(c, exs, epoch=1), steps(c, exs, epoch=1)
  other = steps(c, exs, epoch=2)
  assert first == again and first != other
  flat = [e for g in first for e in g]
  assert flat != exs and sorted(map(id, flat)) == sorted(map(id, exs))


# ---- optimizer -------------------------------------------------------------


def test_schedules():
  cosine = optim.make_schedule(optim_config(learning_rate=1.0,
                                            schedule='cosine', decay_steps=4))
  # The authors' effective schedule: a half cosine to 0 over one epoch.
  np.testing.assert_allclose([cosine(i) for i in range(4)],
                             [1.0, 0.8536, 0.5, 0.1464], atol=1e-4)
  linear = optim.make_schedule(optim_config(
      learning_rate=1.0, schedule='linear', decay_steps=4, min_lr_ratio=0.5,
      warmup_steps=2))
  np.testing.assert_allclose([linear(i) for i in range(7)],
                             [0, 0.5, 1.0, 0.875, 0.75, 0.625, 0.5], atol=1e-6)
  assert optim.make_schedule(optim_config())(100) == pytest.approx(1e-2)
  with pytest.raises(ValueError, match='schedule'):
    optim.make_schedule(optim_config(schedule='step'))
  with pytest.raises(ValueError, match='decay_steps'):
    optim.make_optimizer(optim_config(schedule='cosine'))


# ---- train steps -----------------------------------------------------------
#
# Compiling a step takes seconds, so the tests share one single-device trainer
# and feed it 9-16 sequences per step: always two micro-batches of 8, one
# program.


@pytest.fixture(scope='module')
def trainer():
  return train.Trainer(MODEL, optim_config(**SMOOTH), train_config())


@pytest.fixture(scope='module')
def reference(trainer, params):
  """A prepared two-micro-batch batch and the single-device step on it."""
  state = trainer.init_state(params)
  batch = prepared_batch(trainer, state, examples(16, seed=1))
  state, metrics = trainer.step(state, batch)
  return batch, host((state.params, metrics))


def test_first_update_is_on_policy_and_loss_goes_down(trainer, params):
  state = trainer.init_state(params)
  batch = prepared_batch(trainer, state, examples(16))
  losses_seen = []
  for i in range(6):
    state, metrics = trainer.step(state, batch)
    metrics = host(metrics)
    if i == 0:
      assert metrics['clip_frac'] == 0.0
      assert abs(metrics['ratio_max'] - 1.0) < 1e-5
      assert abs(metrics['ratio_mean'] - 1.0) < 1e-5
      assert metrics['kl'] < 1e-9
      assert metrics['entropy'] > 0
    losses_seen.append(float(metrics['loss']))
  assert int(state.step) == 6
  assert losses_seen[-1] < losses_seen[0] - 0.1, losses_seen
  assert metrics['clip_frac'] > 0  # later steps are off-policy


def test_on_policy_step_needs_no_logprob_pass(trainer, reference, params):
  """The first step of an epoch takes pi_old from its own forward pass: the
  same parameters and metrics as the step given a separate pi_old pass."""
  batch, (expected_params, expected) = reference
  sampler = np.full(batch.old_logp_MxBxR.shape, losses.NO_LOGPROB,
                    np.float32)
  sampler[0, :2, :3] = np.asarray(batch.old_logp_MxBxR)[0, :2, :3] - 0.25
  on_policy = batch.replace(old_logp_MxBxR=sampler,
                            ref_logp_MxBxR=np.zeros_like(sampler))
  state, metrics = trainer.step(trainer.init_state(params), on_policy,
                                on_policy=True)
  metrics = host(metrics)
  assert_trees_close(state.params, expected_params, atol=1e-6)
  for key, value in expected.items():
    np.testing.assert_allclose(metrics[key], value, atol=1e-6, err_msg=key)
  # The sampler's log-probs only feed the gap metrics, over 6 tokens.
  assert metrics['gap_count'] == 6
  assert metrics['gap_sum'] == pytest.approx(6 * 0.25, abs=1e-4)
  assert metrics['gap_max'] == pytest.approx(0.25, abs=1e-5)


def test_bfloat16_first_moment(params):
  model_trainer = train.Trainer(MODEL, optim_config(mu_dtype='bfloat16'),
                                train_config(updates_per_epoch=1))
  state = model_trainer.init_state(params)
  moments = optax.tree_utils.tree_get_all_with_path(state.opt_state, 'mu')
  nus = optax.tree_utils.tree_get_all_with_path(state.opt_state, 'nu')
  assert {x.dtype for _, mu in moments for x in jax.tree.leaves(mu)} == {
      jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for _, nu in nus for x in jax.tree.leaves(nu)} == {
      jnp.dtype(jnp.float32)}
  state, metrics = train_epoch.update(model_trainer, state, examples(8),
                                      epoch=0)
  assert metrics['steps'] == 1 and math.isfinite(metrics['loss'])
  with pytest.raises(ValueError, match='mu_dtype'):
    optim.make_optimizer(optim_config(mu_dtype='float16'))


def test_update_runs_its_first_step_without_a_logprob_pass(params):
  model_trainer = train.Trainer(MODEL, optim_config(**SMOOTH),
                                train_config(updates_per_epoch=1))
  state = model_trainer.init_state(params)
  state, metrics = train_epoch.update(model_trainer, state,
                                      examples(12, seed=3), epoch=0)
  assert metrics['steps'] == 1 and abs(metrics['ratio_max'] - 1) < 1e-5
  assert model_trainer._logprobs._cache_size() == 0
  assert model_trainer._step._cache_size() == 0
  assert model_trainer._step_on_policy._cache_size() == 1


@pytest.mark.parametrize('data,fsdp,tensor,remat',
                         [(8, 1, 1, False), (1, 8, 1, True),
                          (1, 4, 2, False)])
def test_sharded_step_equals_single_device(trainer, reference, params, data,
                                           fsdp, tensor, remat):
  batch, expected = reference
  mesh = sharding.make_mesh(data, fsdp, tensor)
  sharded = train.Trainer(MODEL, optim_config(**SMOOTH),
                          train_config(remat=remat), mesh)
  state = sharded.init_state(params)
  if tensor > 1:  # the log-prob pass, sharded
    np.testing.assert_allclose(sharded.logprobs(state.params, batch),
                               trainer.logprobs(params, batch), atol=1e-5)
  state, metrics = sharded.step(state, batch)
  w = state.params['layers'][0]['mlp']['w_gate']
  assert len(w.sharding.device_set) == 8
  if fsdp * tensor > 1:
    assert w.addressable_shards[0].data.size < w.size
  assert_trees_close((state.params, metrics), expected, atol=1e-5)


@pytest.mark.parametrize('remat', [False, True])
def test_remat_wraps_each_block(params, reference, remat):
  """`train.remat` puts every block under jax.checkpoint (the memory saving
  itself shows on GPU/TPU only: XLA:CPU expands the CSE barrier)."""
  batch, _ = reference
  trainer = train.Trainer(MODEL, optim_config(), train_config(remat=remat))
  state = jax.eval_shape(trainer._init, params)
  jaxpr = str(jax.make_jaxpr(trainer._step)(state, batch))
  # The primal runs inline; each block's backward is one remat equation.
  assert jaxpr.count('remat') == (CONFIG.num_layers if remat else 0)


def test_gradient_accumulation_equals_one_big_batch(reference, params):
  batch, expected = reference  # 16 sequences as 2 micro-batches of 8
  big = jax.tree.map(lambda x: np.asarray(x).reshape((1, 16) + x.shape[2:]),
                     batch)
  one_batch = train.Trainer(MODEL, optim_config(**SMOOTH),
                            train_config(micro_batch_size=16))
  state, metrics = one_batch.step(one_batch.init_state(params), big)
  assert_trees_close((state.params, metrics), expected, atol=1e-5)


def test_bfloat16_gradient_sum_is_close_to_float32(reference, params):
  batch, expected = reference  # 2 micro-batches: the sum is held in bf16
  bf16_sum = train.Trainer(MODEL, optim_config(**SMOOTH),
                           train_config(grad_accum_dtype='bfloat16'))
  state, metrics = bf16_sum.step(bf16_sum.init_state(params), batch)
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float32
  # Adam with eps=1: each parameter moves by ~g / (|g| + 1), so a bf16
  # rounding of the summed gradient (relative 2^-8) moves it by < 1e-2 * lr.
  assert_trees_close(state.params, expected[0], atol=1e-2)
  assert metrics['loss'] == pytest.approx(expected[1]['loss'], rel=1e-6)
  assert metrics['grad_norm'] == pytest.approx(expected[1]['grad_norm'],
                                               rel=1e-2)
  assert metrics['grad_norm'] != expected[1]['grad_norm']  # bf16 was used


def test_clip_by_global_norm_matches_optax():
  grads = {'a': jnp.arange(6.0).reshape(2, 3), 'b': -jnp.ones(4)}
  for max_norm in (0.5, 100.0):
    ours, _ = optim.clip_by_global_norm(max_norm).update(grads, None)
    theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, None)
    assert_trees_close(ours, theirs, atol=1e-6)
  zeros = jax.tree.map(jnp.zeros_like, grads)
  out, _ = optim.clip_by_global_norm(1.0).update(zeros, None)
  assert_trees_close(out, zeros, atol=0)
  assert optax.tree.norm(optim.clip_by_global_norm(0.5).update(
      grads, None)[0]) == pytest.approx(0.5)


def test_bfloat16_compute_keeps_float32_master_weights(reference, params):
  batch, expected = reference
  bf16_model = nnx.split(transformer.abstract_model(dataclasses.replace(
      CONFIG, dtype='bfloat16', param_dtype='float32')))[0]
  bf16 = train.Trainer(bf16_model, optim_config(**SMOOTH), train_config())
  state, metrics = bf16.step(bf16.init_state(params), batch)
  assert state.params['embed'].dtype == jnp.float32
  mu = optax.tree_utils.tree_get(state.opt_state, 'mu')
  assert mu['embed'].dtype == jnp.float32
  assert abs(float(metrics['loss']) - expected[1]['loss']) < 0.05


def test_gated_mlp_backward_matches_autodiff():
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.normal(size=shape), jnp.float32)
          for shape in ((2, 5, 8), (8, 12), (8, 12), (12, 8))]
  cotangent = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)

  def plain(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down

  ours = jax.vjp(manual_vjp.gated_mlp, *args)
  theirs = jax.vjp(plain, *args)
  np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
  for a, b in zip(ours[1](cotangent), theirs[1](cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_rms_norm_backward_matches_autodiff(dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, 3, 16)), dtype)
  scale = jnp.asarray(1 + 0.1 * rng.normal(size=16), dtype)
  cotangent = jnp.asarray(rng.normal(size=x.shape), dtype)

  def plain(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return scale[None, None, None] * x32.astype(x.dtype)

  ours = jax.vjp(lambda x, s: manual_vjp.rms_norm(x, s, 1e-6), x, scale)
  theirs = jax.vjp(plain, x, scale)
  assert ours[0].dtype == theirs[0].dtype == x.dtype
  np.testing.assert_array_equal(ours[0], theirs[0])
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == 'float32' else dict(
      rtol=2e-2, atol=5e-2)  # bfloat16: autodiff rounds its sums there
  for a, b in zip(ours[1](cotangent), theirs[1](cotangent)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), **tol)


def test_step_gradient_matches_plain_autodiff(trainer, reference, params):
  """The fused head and MLP backward give autodiff's gradient."""
  batch, (new_params, metrics) = reference
  # With lr = eps = 1 the first Adam update is g / (|g| + 1) of the clipped
  # gradient g, so the gradient can be read back from the parameter change.
  scale = max(1.0, float(metrics['grad_norm']))
  grads = jax.tree.map(lambda p, q: (p - q) / (1 - np.abs(p - q)) * scale,
                       host(params), new_params)
  flat = jax.tree.map(lambda x: np.asarray(x).reshape((16,) + x.shape[2:]),
                      batch)

  def plain_loss(p):
    logits = nnx.merge(MODEL, p)(flat.tokens_MxBxT, mask_BxT=flat.mask_MxBxT)
    logp_all = jax.nn.log_softmax(logits[:, 11:-1], axis=-1)
    logp = jnp.take_along_axis(logp_all, flat.tokens_MxBxT[:, 12:, None],
                               axis=-1)[..., 0]
    return losses.policy_loss(logp, flat.old_logp_MxBxR, flat.advantages_MxB,
                              flat.response_mask_MxBxR, trainer.loss_cfg)[0]

  loss, expected = jax.jit(jax.value_and_grad(plain_loss))(params)
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-5, atol=1e-7)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(host(expected))):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def compiled_programs(model_trainer):
  return (model_trainer._step._cache_size(),
          model_trainer._step_on_policy._cache_size(),
          model_trainer._logprobs._cache_size())


def optimizer_counts(state):
  found = optax.tree_utils.tree_get_all_with_path(state.opt_state, 'count')
  return {int(count) for _, count in found}


def test_update_epochs_persist_optimizer_without_retrace(trainer, params):
  state = trainer.init_state(params)
  state, _ = train_epoch.update(trainer, state, examples(20, seed=4), epoch=0)
  programs = compiled_programs(trainer)
  state, metrics = train_epoch.update(trainer, state, examples(31, seed=5),
                                      epoch=1)
  assert metrics['steps'] == 2 and metrics['dropped'] == 0
  assert int(state.step) == 4 and optimizer_counts(state) == {4}
  for key in ('loss', 'kl', 'clip_frac', 'ratio_mean', 'ratio_max', 'entropy',
              'grad_norm', 'lr', 'dropped', 'tokens'):
    assert math.isfinite(metrics[key]), key
  assert metrics['lr'] == 1.0
  # The authors' behaviour: fresh Adam moments (and schedule) every epoch.
  # The switch is host-side, read by every update() call.
  optim = trainer.optim_config
  optim.reset_every_epoch = True
  try:
    state, _ = train_epoch.update(trainer, state, examples(18, seed=6), epoch=2)
  finally:
    optim.reset_every_epoch = False
  assert int(state.step) == 6 and optimizer_counts(state) == {2}
  # Same buckets every step: no new programs.
  assert compiled_programs(trainer) == programs


def test_update_reports_drops_and_handles_empty_lists(trainer, params):
  state = trainer.init_state(params)
  restored = train.state_from_dict(train.state_dict(state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  exs = examples(20, seed=6)
  exs[2] = structs.Example(list(range(1, 40)), [5, 6], 1.0)  # too long
  state, metrics = train_epoch.update(trainer, state, exs, epoch=0)
  assert metrics['dropped'] == 1 and metrics['sequences'] == 19
  assert metrics['steps'] == 2
  state, metrics = train_epoch.update(trainer, state, [], epoch=1)
  assert metrics['steps'] == 0 and metrics['tokens'] == 0
  assert int(state.step) == 2


def test_non_finite_steps_are_skipped_logged_and_limited(trainer, params,
                                                         caplog):
  state = trainer.init_state(params)
  state, _ = train_epoch.update(trainer, state, examples(20), epoch=0)
  bad = jax.tree.map(lambda x: x, state.params)
  bad['final_norm']['scale'] = bad['final_norm']['scale'] * jnp.nan
  state = state.replace(params=bad)
  before = host(state)
  exs = [dataclasses.replace(e, key=f'task{i}/train/0/0')
         for i, e in enumerate(examples(20))]
  limit = trainer.train_config.max_nonfinite_steps
  trainer.train_config.max_nonfinite_steps = 3
  try:
    with caplog.at_level(logging.WARNING):
      state, metrics = train_epoch.update(trainer, state, exs, epoch=7)
    # Both steps skipped: parameters and optimizer state as they were.
    assert metrics['skipped_steps'] == 2 and metrics['steps'] == 0
    assert metrics['tokens'] == 0 and 'loss' not in metrics
    assert_trees_close(state, before, atol=0)
    assert trainer.nonfinite_streak == 2
    logged = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith('skipped policy update')]
    assert len(logged) == 2
    assert 'update 1/2 of epoch 7 (at step 2): loss=nan' in logged[0]
    keys = {k for line in logged for k in line.split('examples: ')[1].split()}
    assert keys == {e.key for e in exs}
    # The count goes on across calls (epochs) up to the limit.
    with pytest.raises(train.NonFiniteLossError,
                       match=r'3 non-finite policy train steps in a row '
                       r'\(train.max_nonfinite_steps=3\), the last policy '
                       r'update 1/2 of epoch 8') as error:
      train_epoch.update(trainer, state, exs, epoch=8)
    assert int(error.value.state.step) == 2
    # A finite step ends the run of them.
    train_epoch.update(trainer, trainer.init_state(params), exs, epoch=9)
    assert trainer.nonfinite_streak == 0
  finally:
    trainer.train_config.max_nonfinite_steps = limit
    trainer.nonfinite_streak = 0


def test_frozen_reference_model_gives_kl(trainer, params):
  state = trainer.init_state(params)
  ref = jax.tree.map(lambda x: x * 1.5, params)
  _, metrics = train_epoch.update(trainer, state, examples(20), epoch=0,
                                  ref_params=ref)
  assert metrics['kl'] > 1e-4


def test_reward_model_trainer(params):
  rm = train.Trainer(MODEL, optim_config(), train_config(), kind='reward')
  state = rm.init_state(params)
  batch = batching.pack(examples(8), micro_batch_size=8, prompt_buckets=(12,),
                        response_buckets=(16,))
  out = jax.eval_shape(rm.step, state, batch)
  assert out[1]['loss'].shape == ()
  assert train.reward_step is not train.policy_step


def test_bad_settings_are_rejected():
  with pytest.raises(ValueError, match='micro_batch_size=4'):
    train.Trainer(MODEL, optim_config(), train_config(micro_batch_size=4),
                  sharding.make_mesh(8, 1, 1))
  with pytest.raises(ValueError, match='response_buckets'):
    train.Trainer(MODEL, optim_config(), train_config(max_response_len=64))
  with pytest.raises(ValueError, match='overlong_prompt'):
    train.Trainer(MODEL, optim_config(), train_config(overlong_prompt='cut'))
  with pytest.raises(ValueError, match='kind'):
    train.Trainer(MODEL, optim_config(), train_config(), kind='critic')
  with pytest.raises(ValueError, match='grad_accum_dtype'):
    train.Trainer(MODEL, optim_config(),
                  train_config(grad_accum_dtype='float16'))


def test_logprob_gap_between_sampler_and_trainer(trainer, params, caplog):
  state = trainer.init_state(params)
  exs = examples(8, seed=9)
  batch = batching.pack(exs, micro_batch_size=8, prompt_buckets=(12,),
                        response_buckets=(16,))
  old_NxR = np.asarray(trainer.logprobs(state.params, batch)).reshape(8, 16)
  # What a sampler with the trainer's numerics would have recorded.
  exact = [dataclasses.replace(e, logprobs=old_NxR[i, :len(
      e.response_tokens)].tolist()) for i, e in enumerate(exs)]
  state, metrics = train_epoch.update(trainer, state, exact, epoch=0)
  assert metrics['logprob_gap_mean'] < 1e-6
  assert not [r for r in caplog.records if 'log-probs differ' in r.message]
  # A sampler that is off by 0.5 nat on every token is flagged.
  shifted = [dataclasses.replace(e, logprobs=[p - 0.5 for p in e.logprobs])
             for e in exact]
  state = trainer.init_state(params)
  _, metrics = train_epoch.update(trainer, state, shifted, epoch=1)
  assert metrics['logprob_gap_mean'] == pytest.approx(0.5, abs=1e-5)
  assert metrics['logprob_gap_max'] == pytest.approx(0.5, abs=1e-5)
  assert [r for r in caplog.records if 'log-probs differ' in r.message]
  # Examples without sampler log-probs report no gap.
  _, metrics = train_epoch.update(trainer, trainer.init_state(params), exs,
                                  epoch=2)
  assert 'logprob_gap_mean' not in metrics
