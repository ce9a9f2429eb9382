"""Shared-prompt rows (train.share_prompts): layout, and the same log-probs,
losses and updates as one row per example, on 1 and 8 devices."""

# pylint: disable=protected-access  (counting a Trainer's compiled programs)

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
    MODEL, SMOOTH, CONFIG, assert_trees_close, host, optim_config,
    train_config)


def grouped_examples(seed=0):
  """14 examples over 6 prompts: groups of 4 (a task's first turns), pairs
  (a step's judgments) and singles, interleaved as a shuffle leaves them."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, 256, rng.integers(3, 12)).tolist()
             for _ in range(6)]
  order = [0, 1, 0, 2, 3, 0, 1, 4, 0, 5, 3, 2, 4, 4]
  return [structs.Example(
      prompt_tokens=list(prompts[i]),
      response_tokens=rng.integers(1, 256, rng.integers(1, 9)).tolist(),
      advantage=float(rng.normal()), key=f'{i}/{n}')
          for n, i in enumerate(order)]


def trainer_for(share_prompts, mesh=None, **overrides):
  config = train_config(share_prompts=share_prompts, response_buckets=(8,),
                        max_response_len=8, **overrides)
  return train.Trainer(MODEL, optim_config(**SMOOTH), config, mesh)


@pytest.fixture(scope='module')
def params():
  return nnx.to_pure_dict(nnx.split(transformer.create(CONFIG, seed=2))[1])


def pack(exs, share_prompts, micro_batch_size=8):
  return batching.pack(exs, micro_batch_size=micro_batch_size,
                       prompt_buckets=(12,), response_buckets=(8,),
                       share_prompts=share_prompts)


def by_example(batch_array, exs, share_prompts):
  """[M, N, ...] laid out by batching.slots -> one entry per example."""
  flat = np.asarray(batch_array).reshape((-1,) + batch_array.shape[2:])
  index = {id(e): i for i, e in enumerate(batching.slots(exs, share_prompts))
           if e is not None}
  return flat[[index[id(e)] for e in exs]]


def test_rows_group_equal_prompts_up_to_the_limit():
  exs = grouped_examples()
  rows = batching.share_rows(exs, 3)
  keys = [[e.key for e in row] for row in rows]
  # Prompt 0 (4 examples) fills a row of 3 and starts another; first
  # appearance orders the rows.
  assert keys == [['0/0', '0/2', '0/5'], ['1/1', '1/6'], ['2/3', '2/11'],
                  ['3/4', '3/10'], ['4/7', '4/12', '4/13'], ['0/8'], ['5/9']]
  assert batching.share_rows(exs, 1) == [[e] for e in exs]
  slots = batching.slots(exs, 3)
  assert len(slots) == 7 * 3 and slots[3:6] == [exs[1], exs[6], None]
  images = structs.Images(np.zeros((4, 8), np.float32), [[1, 2, 2]])
  with_image = exs[:3] + [structs.Example([1], [2], 0.0, images=images)]
  assert len(batching.share_rows(with_image, 4)) == 4  # no sharing
  with pytest.raises(ValueError, match='share_prompts=0'):
    batching.share_rows(exs, 0)


def test_pack_lays_out_a_prompt_and_its_responses():
  exs = [structs.Example([1, 2, 3], [4, 5], 0.5),
         structs.Example([6], [7, 8, 9], -1.0),
         structs.Example([1, 2, 3], [10], 2.0)]
  batch = batching.pack(exs, micro_batch_size=1, prompt_buckets=(4,),
                        response_buckets=(3,), share_prompts=2)
  assert batch.branches == 2
  assert batch.tokens_MxBxT.shape == (2, 1, 4 + 2 * 3)
  assert batch.response_mask_MxBxR.shape == (2, 2, 3)
  np.testing.assert_array_equal(batch.tokens_MxBxT[:, 0], [
      [0, 1, 2, 3, 4, 5, 0, 10, 0, 0], [0, 0, 0, 6, 7, 8, 9, 0, 0, 0]])
  np.testing.assert_array_equal(batch.mask_MxBxT[:, 0], [
      [0, 1, 1, 1, 1, 1, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch.response_mask_MxBxR, [
      [[1, 1, 0], [1, 0, 0]], [[1, 1, 1], [0, 0, 0]]])
  np.testing.assert_array_equal(batch.advantages_MxB, [[0.5, 2.0],
                                                       [-1.0, 0.0]])
  assert batching.slots(exs, 2) == [exs[0], exs[2], exs[1], None]


def test_logprobs_equal_one_row_per_example(params):
  exs = grouped_examples()
  one, shared = trainer_for(1), trainer_for(4)
  want = by_example(one.logprobs(params, pack(exs, 1)), exs, 1)
  batch = pack(exs, 4)
  assert batch.branches == 4 and batch.tokens_MxBxT.shape[:2] == (1, 8)
  got = by_example(shared.logprobs(params, batch), exs, 4)
  mask = by_example(batch.response_mask_MxBxR, exs, 4)
  np.testing.assert_array_equal(mask, by_example(
      pack(exs, 1).response_mask_MxBxR, exs, 1))
  np.testing.assert_allclose(got * mask, want * mask, atol=2e-5)


@pytest.fixture(scope='module')
def unshared_step(params):
  """One off-policy step with one row per example: (params, metrics)."""
  exs = grouped_examples(seed=1)
  trainer = trainer_for(1)
  batch = pack(exs, 1)
  old = trainer.logprobs(params, batch)
  state, metrics = trainer.step(trainer.init_state(params),
                                batch.replace(old_logp_MxBxR=old,
                                              ref_logp_MxBxR=old))
  return exs, host((state.params, metrics))


@pytest.mark.parametrize('mesh_shape,remat', [(None, False), ((8, 1, 1), True),
                                              ((1, 4, 2), False)])
def test_step_equals_one_row_per_example(params, unshared_step, mesh_shape,
                                         remat):
  exs, expected = unshared_step
  mesh = None if mesh_shape is None else sharding.make_mesh(*mesh_shape)
  trainer = trainer_for(4, mesh, remat=remat)
  batch = pack(exs, 4)
  old = trainer.logprobs(params, batch)
  state, metrics = trainer.step(trainer.init_state(params),
                                batch.replace(old_logp_MxBxR=old,
                                              ref_logp_MxBxR=old))
  assert metrics['sequences'] == len(exs)
  assert_trees_close((state.params, metrics), expected, atol=2e-5)


def test_update_orders_sampler_logprobs_and_does_not_retrace(params):
  """`train_epoch.update` with shared prompts: the sampler log-probs (here the
  unshared trainer's) line up with the shared rows in the on-policy step and
  in the later steps' host-side comparison, and the same shapes reuse the
  compiled programs."""
  exs = grouped_examples(seed=3)
  logp = by_example(trainer_for(1).logprobs(params, pack(exs, 1)), exs, 1)
  for example, row in zip(exs, logp):
    example.logprobs = row[:len(example.response_tokens)].tolist()
  trainer = trainer_for(4, updates_per_epoch=2)
  state = trainer.init_state(params)
  state, metrics = train_epoch.update(trainer, state, exs, epoch=0)
  assert metrics['steps'] == 2 and metrics['sequences'] == len(exs)
  # Off by one position or one row, the gaps would be ~1 nat.
  assert metrics['logprob_gap_max'] < 1e-4, metrics
  programs = (trainer._step._cache_size(),
              trainer._step_on_policy._cache_size(),
              trainer._logprobs._cache_size())
  assert programs == (1, 1, 1)
  train_epoch.update(trainer, state, exs, epoch=1)
  assert (trainer._step._cache_size(), trainer._step_on_policy._cache_size(),
          trainer._logprobs._cache_size()) == programs


def test_bad_share_prompts_is_named():
  with pytest.raises(ValueError, match=r'train\.share_prompts=0'):
    trainer_for(0)
