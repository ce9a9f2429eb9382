"""Logit parity with transformers, padding, sharding and HF folder I/O."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rla_jax import sharding
from rla_jax.models import hf
from rla_jax.models import transformer

TOL = 1e-4


def _torch_logits(model, tokens, mask=None):
  with torch.no_grad():
    kwargs = {}
    if mask is not None:
      kwargs['attention_mask'] = torch.tensor(mask)
      kwargs['position_ids'] = torch.tensor(
          np.maximum(np.cumsum(mask, -1) - 1, 0))
    return model(torch.tensor(tokens), **kwargs).logits.float().numpy()


def _tokens(shape, seed=0, vocab=256):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


CASES = [('llama', dict(tie_word_embeddings=True)),
         ('llama', dict(tie_word_embeddings=False,
                        rope_scaling=dict(rope_type='llama3', factor=8.0,
                                          low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8))),
         ('qwen2', dict(tie_word_embeddings=True)),
         ('qwen2', dict(tie_word_embeddings=False)),
         ('qwen3', dict(tie_word_embeddings=True)),
         ('qwen3', dict(tie_word_embeddings=False))]


@pytest.mark.parametrize('family,overrides', CASES,
                         ids=[f'{f}-{"tied" if o["tie_word_embeddings"] else "untied"}'
                              + ('-llama3rope' if 'rope_scaling' in o else '')
                              for f, o in CASES])
def test_logits_match_transformers(hf_model_factory, family, overrides):
  path, ref = hf_model_factory(family, **overrides)
  model, tokenizer = hf.load(path)
  assert tokenizer is None
  tokens = _tokens((2, 24))
  diff = np.abs(np.asarray(model(jnp.asarray(tokens))) -
                _torch_logits(ref, tokens)).max()
  print(f'{family} {overrides} unpadded max|diff|={diff:.2e}')
  assert diff <= TOL
  # Left padding: each row must match its own unpadded forward.
  lengths = [24, 15]
  padded = np.zeros((2, 24), np.int32)
  mask = np.zeros((2, 24), np.int32)
  for row, n in enumerate(lengths):
    padded[row, 24 - n:] = tokens[row, :n]
    mask[row, 24 - n:] = 1
  ours = np.asarray(model(jnp.asarray(padded), mask_BxT=jnp.asarray(mask)))
  theirs = _torch_logits(ref, padded, mask)
  for row, n in enumerate(lengths):
    alone = _torch_logits(ref, tokens[row:row + 1, :n])[0]
    d_pad = np.abs(ours[row, 24 - n:] - alone).max()
    d_ref = np.abs(ours[row, 24 - n:] - theirs[row, 24 - n:]).max()
    print(f'  row {row} padded max|diff| vs unpadded={d_pad:.2e} '
          f'vs torch padded={d_ref:.2e}')
    assert d_pad <= TOL and d_ref <= TOL


def test_explicit_positions_shift_rope(hf_model_factory):
  path, ref = hf_model_factory('llama')
  model, _ = hf.load(path)
  tokens = _tokens((1, 10))
  pos = np.arange(5, 15)[None]
  with torch.no_grad():
    theirs = ref(torch.tensor(tokens),
                 position_ids=torch.tensor(pos)).logits.numpy()
  ours = model(jnp.asarray(tokens), positions_BxT=jnp.asarray(pos))
  assert np.abs(np.asarray(ours) - theirs).max() <= TOL


@pytest.mark.parametrize('family', ['llama', 'qwen2', 'qwen3'])
def test_save_round_trip_through_transformers(hf_model_factory, tmp_path,
                                              family):
  path, _ = hf_model_factory(family, tie_word_embeddings=family != 'qwen2')
  model, _ = hf.load(path)
  out = str(tmp_path / 'saved')
  hf.save(model, out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens((2, 12), seed=3)
  diff = np.abs(np.asarray(model(jnp.asarray(tokens))) -
                _torch_logits(reloaded, tokens)).max()
  print(f'{family} round trip max|diff|={diff:.2e}')
  assert diff <= TOL
  again, _ = hf.load(out)
  assert np.array_equal(np.asarray(again(jnp.asarray(tokens))),
                        np.asarray(model(jnp.asarray(tokens))))


def test_save_many_shards_and_load_them(hf_model_factory, tmp_path):
  path, _ = hf_model_factory('qwen3')
  model, _ = hf.load(path)
  out = str(tmp_path / 'sharded')
  hf.save(model, out, max_shard_bytes=100_000)
  with open(os.path.join(out, 'model.safetensors.index.json')) as f:
    files = set(json.load(f)['weight_map'].values())
  assert len(files) > 2
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens((1, 8))
  assert np.abs(np.asarray(model(jnp.asarray(tokens))) -
                _torch_logits(reloaded, tokens)).max() <= TOL
  again, _ = hf.load(out)
  assert np.array_equal(np.asarray(again(jnp.asarray(tokens))),
                        np.asarray(model(jnp.asarray(tokens))))


def test_bfloat16_checkpoint_and_compute(hf_model_factory, tmp_path):
  path, ref = hf_model_factory('qwen2')
  ref.to(torch.bfloat16).save_pretrained(str(tmp_path / 'bf16'))
  model, _ = hf.load(str(tmp_path / 'bf16'), dtype='bfloat16',
                     param_dtype='float32')
  assert model.embed[...].dtype == jnp.float32
  tokens = _tokens((2, 16))
  logits = np.asarray(model(jnp.asarray(tokens)))
  assert logits.dtype == np.float32
  ref32 = _torch_logits(ref.float(), tokens)
  assert np.abs(logits - ref32).max() < 0.1  # bf16 rounding, not a bug


@pytest.mark.parametrize('data,fsdp,tensor', [(8, 1, 1), (1, 4, 2), (2, 2, 2),
                                              (1, 1, 8)])
def test_sharded_forward_equals_single_device(hf_model_factory, data, fsdp,
                                              tensor):
  path, _ = hf_model_factory('qwen3')
  single, _ = hf.load(path)
  mesh = sharding.make_mesh(data, fsdp, tensor)
  sharded, _ = hf.load(path, mesh=mesh)
  w_gate = sharded.layers[0].mlp.w_gate[...]
  assert len(w_gate.sharding.device_set) == 8
  if fsdp * tensor > 1:  # no device holds the whole weight
    assert w_gate.addressable_shards[0].data.size < w_gate.size
  tokens = _tokens((8, 16))
  mask = np.ones((8, 16), np.int32)
  mask[1, :5] = 0
  batch = jax.device_put(jnp.asarray(tokens),
                         sharding.named(mesh, ('batch', 'length'), (8, 16)))
  with sharding.use(mesh):
    logits = jax.jit(lambda m, t, k: m(t, mask_BxT=k))(sharded, batch, mask)
  expected = single(jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected),
                             atol=1e-5, rtol=1e-5)


def test_random_init_in_sharding_matches_layout():
  config = transformer.ModelConfig('qwen2', 128, 64, 96, 2, 4, 2, 16,
                                   qkv_bias=True, tie_word_embeddings=True)
  mesh = sharding.make_mesh(1, 4, 2)
  model = transformer.create(config, seed=0, mesh=mesh)
  assert model.embed[...].sharding.spec == jax.sharding.PartitionSpec(
      'tensor', 'fsdp')
  plain = transformer.create(config, seed=0)
  tokens = jnp.asarray(_tokens((2, 8), vocab=128))
  np.testing.assert_allclose(np.asarray(model(tokens)),
                             np.asarray(plain(tokens)), atol=1e-5)


# ---- scanned layers ----------------------------------------------------------


def _loss_grads(model, tokens, mask, weights):
  graphdef, state = nnx.split(model)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(
      tokens, mask_BxT=mask) * weights)
  return jax.jit(jax.grad(loss))(nnx.to_pure_dict(state))


@pytest.mark.parametrize('family', ['llama', 'qwen2', 'qwen3'])
def test_scanned_layers_equal_unrolled_and_transformers(hf_model_factory,
                                                        family):
  path, ref = hf_model_factory(family, tie_word_embeddings=family != 'qwen2')
  plain, _ = hf.load(path)
  scanned, _ = hf.load(path, scan_layers=True, attention_block=8)
  assert scanned.layers.mlp.w_gate[...].shape == (2, 64, 128)
  tokens = _tokens((2, 24), seed=5)
  mask = np.ones((2, 24), np.int32)
  mask[1, :7] = 0
  ours = np.asarray(scanned(jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))
  np.testing.assert_allclose(
      ours, np.asarray(plain(jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))),
      atol=1e-5)
  theirs = _torch_logits(ref, tokens, mask)
  assert np.abs(ours - theirs)[mask.astype(bool)].max() <= TOL
  # Gradients: the stacked ones are the per-layer ones stacked, under every
  # remat policy.
  weights = jnp.asarray(np.random.default_rng(0).normal(size=ours.shape)
                        * mask[..., None], jnp.float32)
  want = _loss_grads(plain, tokens, mask, weights)
  for policy in transformer.REMAT_POLICIES:
    model = nnx.merge(
        nnx.split(transformer.abstract_model(dataclasses.replace(
            scanned.config, remat=policy)))[0], nnx.state(scanned))
    got = _loss_grads(model, tokens, mask, weights)
    # Magnitudes reach ~15: blockwise f32 sums differ by a few 1e-6 of it.
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                    atol=1e-4)
    close(got['embed'], want['embed'])
    stacked = jax.tree.map(lambda *xs: np.stack(xs),
                           *[want['layers'][i] for i in range(2)])
    jax.tree.map(close, got['layers'], stacked)


def test_scanned_export_and_sharded_load(hf_model_factory, tmp_path):
  path, _ = hf_model_factory('qwen3')
  scanned, _ = hf.load(path, scan_layers=True)
  out = str(tmp_path / 'saved')
  hf.save(scanned, out, max_shard_bytes=100_000)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens((2, 12), seed=3)
  ours = np.asarray(scanned(jnp.asarray(tokens)))
  assert np.abs(ours - _torch_logits(reloaded, tokens)).max() <= TOL
  mesh = sharding.make_mesh(1, 4, 2)
  sharded, _ = hf.load(out, mesh=mesh, scan_layers=True)
  w_gate = sharded.layers.mlp.w_gate[...]  # [L, D, F]: D over fsdp, F tensor
  assert w_gate.addressable_shards[0].data.shape == (2, 64 // 4, 128 // 2)
  with sharding.use(mesh):
    logits = jax.jit(lambda m, t: m(t))(sharded, jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), ours, atol=1e-5)


def _abstract_grad(config, tokens_shape):
  graphdef, state = nnx.split(transformer.abstract_model(config))
  tokens = jax.ShapeDtypeStruct(tokens_shape, jnp.int32)
  loss = lambda p, t: jnp.sum(nnx.merge(graphdef, p).hidden(t) ** 2)
  return jax.jit(jax.grad(loss)).lower(nnx.to_pure_dict(state), tokens)


def test_remat_cuts_compiled_temp_memory_on_cpu():
  config = transformer.ModelConfig('qwen2', 256, 128, 512, 4, 4, 2, 32,
                                   qkv_bias=True, tie_word_embeddings=True,
                                   scan_layers=True)
  temp = {}
  for policy in ('none', 'dots_saveable', 'full'):
    lowered = _abstract_grad(dataclasses.replace(config, remat=policy),
                             (4, 512))
    temp[policy] = lowered.compile().memory_analysis().temp_size_in_bytes
  print({k: f'{v / 2**20:.1f} MiB' for k, v in temp.items()})
  assert temp['full'] < 0.5 * temp['none']
  assert temp['full'] < temp['dots_saveable'] < temp['none']


def test_scanned_program_does_not_grow_with_depth():
  sizes = {}
  for scan in (False, True):
    for layers in (2, 8):
      config = transformer.ModelConfig('llama', 128, 64, 128, layers, 4, 2,
                                       16, scan_layers=scan)
      sizes[scan, layers] = len(_abstract_grad(config, (1, 16)).as_text())
  print(sizes)
  assert sizes[True, 8] < 1.05 * sizes[True, 2]
  assert sizes[False, 8] > 2.5 * sizes[False, 2]


def test_bad_model_options_are_named():
  config = transformer.ModelConfig('llama', 128, 64, 128, 2, 4, 2, 16)
  with pytest.raises(ValueError, match=r"attention='flash'; expected"):
    dataclasses.replace(config, attention='flash')
  with pytest.raises(ValueError, match=r"remat='some'; expected"):
    dataclasses.replace(config, remat='some')
  with pytest.raises(TypeError, match=r"unknown model options \['scan'\]"):
    transformer.with_run_options(config, scan=True)


# ---- bad input -------------------------------------------------------------


def _edit_config(path, **changes):
  file = os.path.join(path, 'config.json')
  with open(file) as f:
    config = json.load(f)
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  with open(file, 'w') as f:
    json.dump(config, f)


def test_missing_model_type(hf_model_factory):
  path, _ = hf_model_factory('llama')
  _edit_config(path, model_type=None)
  with pytest.raises(hf.CheckpointError, match=r'config.json.*model_type'):
    hf.load(path)


def test_unsupported_model_type(hf_model_factory):
  path, _ = hf_model_factory('llama')
  _edit_config(path, model_type='gpt2')
  with pytest.raises(hf.CheckpointError, match="model_type 'gpt2' is not "
                     'supported'):
    hf.load(path)


def test_unknown_rope_scaling(hf_model_factory):
  path, _ = hf_model_factory('llama')
  _edit_config(path, rope_parameters={'rope_type': 'yarn', 'factor': 4.0,
                                      'rope_theta': 10000.0})
  with pytest.raises(hf.CheckpointError, match="config.json.*'yarn'"):
    hf.load(path)


def test_legacy_rope_keys(hf_model_factory):
  path, ref = hf_model_factory('llama')
  _edit_config(path, rope_parameters=None, rope_theta=10000.0,
               rope_scaling={'type': 'linear', 'factor': 1.0})
  model, _ = hf.load(path)
  assert dict(model.config.rope_scaling)['rope_type'] == 'linear'
  tokens = _tokens((1, 8))
  assert np.abs(np.asarray(model(jnp.asarray(tokens))) -
                _torch_logits(ref, tokens)).max() <= TOL


def test_shape_mismatch_names_the_tensor(hf_model_factory):
  path, _ = hf_model_factory('qwen2')
  _edit_config(path, intermediate_size=96)
  with pytest.raises(hf.CheckpointError,
                     match=r"model.layers.0.mlp.gate_proj.weight.*\(128, 64\)"):
    hf.load(path)


def test_missing_shard(hf_model_factory, tmp_path):
  path, _ = hf_model_factory('qwen2')
  model, _ = hf.load(path)
  out = str(tmp_path / 'broken')
  hf.save(model, out, max_shard_bytes=100_000)
  os.remove(os.path.join(out, 'model-00002-of-' +
                         sorted(os.listdir(out))[-2][-17:]))
  with pytest.raises(hf.CheckpointError, match=r'shard .model-00002-of'):
    hf.load(out)


def test_missing_folder_and_weights(tmp_path):
  with pytest.raises(hf.CheckpointError, match='does not exist'):
    hf.load(str(tmp_path / 'nope'))
  (tmp_path / 'empty').mkdir()
  with pytest.raises(hf.CheckpointError, match='no config.json'):
    hf.load(str(tmp_path / 'empty'))
  with open(tmp_path / 'empty' / 'config.json', 'w') as f:
    json.dump({'model_type': 'llama', **_tiny_hf()}, f)
  with pytest.raises(hf.CheckpointError, match='no model.safetensors'):
    hf.load(str(tmp_path / 'empty'))


def _tiny_hf():
  from conftest import TINY_HF  # pylint: disable=g-import-not-at-top
  return TINY_HF


def test_missing_tensor(hf_model_factory, tmp_path):
  path, ref = hf_model_factory('llama', tie_word_embeddings=False)
  state = {k: v for k, v in ref.state_dict().items() if 'lm_head' not in k}
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  save_file(state, os.path.join(path, 'model.safetensors'),
            metadata={'format': 'pt'})
  with pytest.raises(hf.CheckpointError, match="'lm_head.weight' is missing"):
    hf.load(path)


def test_tokenizer_loaded_from_folder(hf_model_factory, tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  path, _ = hf_model_factory('qwen2')
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      ['the cat sat on the mat', 'open the fridge'] * 10,
      trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'],
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token='<|endoftext|>').save_pretrained(path)
  model, tokenizer = hf.load(path)
  ids = tokenizer('the cat')['input_ids']
  assert tokenizer.decode(ids) == 'the cat'
  assert ids == tok.encode('the cat').ids
  out = str(tmp_path / 'with_tok')
  hf.save(model, out, tokenizer)
  assert hf.load_tokenizer(out)('the cat')['input_ids'] == ids
