"""Trainer log-probs do not depend on how a batch is cut (issue 32, item 9).

The same (prompt, response) rows are packed with different micro-batch sizes,
padding buckets, shared-prompt rows, and on 1 or 8 devices, in float32 and in
bfloat16 compute (float32 master weights and logits). For each cut:

  pass: the pi_old pass (Trainer.logprobs) against the reference cut's pass;
  step: the train step's own log-probs against the reference cut's pass (the
        on-policy step's gap metrics: `gap_max` = max |given - step logp|);
  self: the step's log-probs against its own cut's pi_old pass, i.e. the
        importance ratio at step 0 (max |log ratio|).

Run with -s to see the worst gap of every case.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rla_jax import batching
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train
from rla_jax import train_epoch
from rla_jax.models import transformer

from tests.train_test import (  # pylint: disable=g-multiple-import
    CONFIG, SMOOTH, optim_config, train_config)

# float32: the cuts change only the amount of exact-zero padding and the
# shapes XLA tiles, so per-token log-probs agree to float32 rounding
# (measured: <= 1e-6).
F32_TOL = 1e-5
# bfloat16 compute, one device: every cut runs the same fused program on other
# shapes, so activations round to bfloat16 at the same places (measured:
# <= 5e-7, from the float32 logits).
BF16_TOL = 1e-5
# bfloat16 compute on a mesh (measured: 1.5e-3 data/fsdp, 1.9e-3 with tensor
# sharding; bfloat16 vs float32 compute is 2.5e-3). Not a bug in the step:
# XLA's default --xla_allow_excess_precision lets a fusion keep bf16
# intermediates in float32, and the partitioned program fuses differently
# (with it off, a data-parallel mesh matches one device to 1e-6); tensor
# sharding also sums bfloat16 partial products of row-parallel matmuls
# across devices. Either moves an activation by about one bfloat16 ulp
# (2^-8 relative); a real cut bug (a shifted token, a lost prompt) is O(1).
BF16_MESH_TOL = 1e-2

DTYPES = {'float32': CONFIG,
          'bfloat16': dataclasses.replace(CONFIG, dtype='bfloat16',
                                          param_dtype='float32')}

# name -> (train_config overrides, mesh shape (data, fsdp, tensor) or None,
# 1 for a 1-device mesh). The reference cut: all rows in one micro-batch,
# prompt bucket 12, response bucket 8, one row per example, no mesh.
REFERENCE = dict(micro_batch_size=8, prompt_buckets=(12,),
                 response_buckets=(8,), share_prompts=1)
CASES = {
    'micro_batch_all': ({}, None),
    'micro_batch_4': (dict(micro_batch_size=4), None),
    'micro_batch_1': (dict(micro_batch_size=1), None),
    'buckets_p20_r16': (dict(prompt_buckets=(20,), response_buckets=(16,)),
                        None),
    'buckets_p32_r24': (dict(prompt_buckets=(4, 32), response_buckets=(24,)),
                        None),
    'shared_prompts_4': (dict(share_prompts=4), None),
    'shared_prompts_4_micro_batch_1': (dict(share_prompts=4,
                                            micro_batch_size=1), None),
    # Every host-side cut at once (the quick run's single-device case).
    'micro_batch_1_buckets_shared': (dict(
        micro_batch_size=1, prompt_buckets=(20,), response_buckets=(16,),
        share_prompts=4), None),
    'mesh_1_device': ({}, 1),
    'mesh_data2_fsdp4': ({}, (2, 4, 1)),
    'mesh_fsdp4_tensor2': ({}, (1, 4, 2)),
    'mesh_data2_fsdp4_shared': (dict(share_prompts=4), (2, 4, 1)),
}
# Each case compiles a log-prob pass and a train step (10-20 s here); the
# quick run takes these, CI (`slow`) the whole table.
QUICK = ('micro_batch_1_buckets_shared', 'mesh_data2_fsdp4')


def invariance_examples(seed=0):
  """8 examples over 4 prompts (prompt 0 four times, prompt 1 twice)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, 256, n).tolist() for n in (11, 7, 3, 9)]
  return [structs.Example(
      prompt_tokens=list(prompts[i]),
      response_tokens=rng.integers(1, 256, rng.integers(1, 9)).tolist(),
      advantage=float(rng.normal()), key=f'{i}/{n}')
          for n, i in enumerate([0, 1, 0, 2, 0, 1, 3, 0])]


@pytest.fixture(scope='module')
def params():
  return nnx.to_pure_dict(nnx.split(transformer.create(CONFIG, seed=3))[1])


def make_trainer(dtype, overrides, mesh_shape):
  config = dict(REFERENCE, max_response_len=8, **overrides)
  if mesh_shape is None:
    mesh = None
  elif mesh_shape == 1:
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  else:
    mesh = sharding.make_mesh(*mesh_shape)
  graphdef = nnx.split(transformer.abstract_model(DTYPES[dtype]))[0]
  return train.Trainer(graphdef, optim_config(**SMOOTH),
                       train_config(**config), mesh)


def pack(trainer, exs):
  c = trainer.train_config
  return batching.pack(exs, micro_batch_size=c.micro_batch_size,
                       prompt_buckets=c.prompt_buckets,
                       response_buckets=c.response_buckets,
                       share_prompts=c.share_prompts)


def per_example(logp_MxNxR, exs, share_prompts):
  """[M, N, R] in batching.slots order -> each example's response log-probs."""
  flat = sharding.to_host(logp_MxNxR)
  flat = flat.reshape(-1, flat.shape[-1])
  index = {id(e): i for i, e in enumerate(batching.slots(exs, share_prompts))
           if e is not None}
  return [flat[index[id(e)], :len(e.response_tokens)] for e in exs]


def worst(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def step_gap(trainer, params, batch, exs, given):
  """max |given - the on-policy step's log-probs| over all response tokens;
  `given` holds one log-prob list per example."""
  order = batching.slots(exs, trainer.train_config.share_prompts)
  with_given = {id(e): dataclasses.replace(e, logprobs=g.tolist())
                for e, g in zip(exs, given)}
  old = train_epoch.sampler_logprobs(
      [None if e is None else with_given[id(e)] for e in order],
      batch.old_logp_MxBxR.shape)
  _, metrics = trainer.step(trainer.init_state(params),
                            batch.replace(old_logp_MxBxR=old),
                            on_policy=True)
  metrics = jax.device_get(metrics)
  assert metrics['gap_count'] == sum(len(e.response_tokens) for e in exs)
  return float(metrics['gap_max'])


@pytest.fixture(scope='module')
def reference(params):
  """The reference cut's pi_old log-probs per dtype (one list per example)."""
  exs = invariance_examples()
  out = {}
  for dtype in DTYPES:
    trainer = make_trainer(dtype, {}, None)
    out[dtype] = per_example(trainer.logprobs(params, pack(trainer, exs)),
                             exs, 1)
  return exs, out


@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('case', [
    case if case in QUICK else pytest.param(case, marks=pytest.mark.slow)
    for case in CASES])
def test_logprobs_do_not_depend_on_the_cut(params, reference, case, dtype):
  exs, want = reference
  overrides, mesh_shape = CASES[case]
  trainer = make_trainer(dtype, overrides, mesh_shape)
  batch = pack(trainer, exs)
  k = trainer.train_config.share_prompts
  if k > 1:
    assert batch.branches > 1  # the rows really share prompts
  got = per_example(trainer.logprobs(params, batch), exs, k)
  gaps = dict(pass_=worst(got, want[dtype]),
              step=step_gap(trainer, params, batch, exs, want[dtype]),
              self=step_gap(trainer, params, batch, exs, got))
  print(f'\n{case:32s} {dtype:9s} M={batch.tokens_MxBxT.shape[0]} '
        f'T={batch.tokens_MxBxT.shape[2]:3d} pass={gaps["pass_"]:.2e} '
        f'step={gaps["step"]:.2e} self={gaps["self"]:.2e} '
        f'vs_f32={worst(got, want["float32"]):.2e}')
  tol = (F32_TOL if dtype == 'float32' else
         BF16_TOL if mesh_shape in (None, 1) else BF16_MESH_TOL)
  for name, gap in gaps.items():
    assert gap <= tol, (name, gap)
