"""Hugging Face model folders: config.json + safetensors (+ tokenizer) in and out.

Weights are memory-mapped and each device receives only its own shard, read
straight from the file, so a 7B checkpoint never exists unsharded on a device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rla_jax import sharding
from rla_jax.models import hf_vision
from rla_jax.models import transformer
from rla_jax.models.transformer import ModelConfig

SUPPORTED_MODEL_TYPES = ('llama', 'qwen2', 'qwen3', 'qwen3_vl')
SUPPORTED_ROPE_TYPES = ('default', 'linear', 'llama3')
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json',
                    'tokenizer.model', 'vocab.json')
# safetensors' numpy backend cannot return bfloat16 (checked on 0.8.0), and a
# memory map lets each device read just its slice; the format is a u64 header
# length, a JSON header, then raw little-endian tensor bytes.
_ST_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
    'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32,
}


class CheckpointError(ValueError):
  """A model folder that cannot be loaded as it is."""


def _require(hf: dict, key: str, where: str):
  if key not in hf:
    raise CheckpointError(f'{where}: missing key {key!r}')
  return hf[key]


def _rope(hf: dict, where: str) -> tuple[float, tuple | None]:
  """(rope_theta, rope_scaling) from transformers 5 or legacy config keys."""
  params = dict(hf.get('rope_parameters') or {})
  legacy = hf.get('rope_scaling') or {}
  theta = params.pop('rope_theta', hf.get('rope_theta', 10000.0))
  scaling = {**legacy, **params}
  rope_type = scaling.pop('rope_type', scaling.pop('type', 'default'))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise CheckpointError(
        f'{where}: rope scaling type {rope_type!r} is not supported '
        f'(supported: {", ".join(SUPPORTED_ROPE_TYPES)})')
  if rope_type == 'default':
    return float(theta), None
  needed = {'linear': ('factor',),
            'llama3': ('factor', 'low_freq_factor', 'high_freq_factor',
                       'original_max_position_embeddings')}[rope_type]
  for key in needed:
    if key not in scaling:
      raise CheckpointError(f'{where}: {rope_type} rope scaling needs {key!r}')
  values = tuple(sorted((k, scaling[k]) for k in needed))
  return float(theta), (('rope_type', rope_type),) + values


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf: dict[str, Any], *, dtype: str = 'float32',
                   param_dtype: str | None = None,
                   where: str = 'config.json') -> ModelConfig:
  """Maps a transformers config dict onto ModelConfig, rejecting what we lack."""
  model_type = hf.get('model_type')
  if model_type is None:
    raise CheckpointError(f'{where}: missing key "model_type" (expected one '
                          f'of {", ".join(SUPPORTED_MODEL_TYPES)})')
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(
        f'{where}: model_type {model_type!r} is not supported '
        f'(supported: {", ".join(SUPPORTED_MODEL_TYPES)})')
  if model_type == 'qwen3_vl':
    return _qwen3_vl_config(hf, dtype, param_dtype, where)
  act = hf.get('hidden_act', 'silu')
  if act != 'silu':
    raise CheckpointError(f'{where}: hidden_act {act!r} is not supported '
                          '(only silu)')
  if hf.get('use_sliding_window'):
    raise CheckpointError(f'{where}: use_sliding_window=true is not supported')
  if hf.get('mlp_bias'):
    raise CheckpointError(f'{where}: mlp_bias=true is not supported')
  heads = _require(hf, 'num_attention_heads', where)
  hidden = _require(hf, 'hidden_size', where)
  theta, scaling = _rope(hf, where)
  attention_bias = bool(hf.get('attention_bias', False))
  eos = _ids(hf.get('eos_token_id'))
  return ModelConfig(
      model_type=model_type,
      vocab_size=_require(hf, 'vocab_size', where),
      hidden_size=hidden,
      intermediate_size=_require(hf, 'intermediate_size', where),
      num_layers=_require(hf, 'num_hidden_layers', where),
      num_heads=heads,
      num_kv_heads=hf.get('num_key_value_heads') or heads,
      head_dim=hf.get('head_dim') or hidden // heads,
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      qkv_bias=model_type == 'qwen2' or attention_bias,
      o_bias=model_type != 'qwen2' and attention_bias,
      qk_norm=model_type == 'qwen3',
      tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
      dtype=dtype,
      param_dtype=param_dtype or dtype,
      bos_token_id=hf.get('bos_token_id'),
      eos_token_ids=eos,
      pad_token_id=hf.get('pad_token_id'))


def _qwen3_vl_config(hf, dtype, param_dtype, where) -> ModelConfig:
  """Qwen3-VL: a Qwen3 decoder (text_config) with 3-axis RoPE and a tower."""
  text = dict(_require(hf, 'text_config', where))
  rope = dict(text.pop('rope_parameters', None) or
              text.pop('rope_scaling', None) or {})
  section = tuple(rope.pop('mrope_section', (24, 20, 20)))
  rope.pop('mrope_interleaved', None)
  text.update(model_type='qwen3', rope_parameters=rope,
              tie_word_embeddings=hf.get('tie_word_embeddings', False))
  for key in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
    if text.get(key) is None and hf.get(key) is not None:
      text[key] = hf[key]
  base = config_from_hf(text, dtype=dtype, param_dtype=param_dtype,
                        where=f'{where} (text_config)')
  try:
    tower = hf_vision.config_from_hf(hf, where)
    return dataclasses.replace(base, model_type='qwen3_vl',
                               mrope_section=section, vision=tower)
  except ValueError as e:
    raise CheckpointError(str(e)) from e


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """Keyword arguments for transformers.AutoConfig.for_model."""
  if config.model_type == 'qwen3_vl':
    text = config_to_hf(dataclasses.replace(
        config, model_type='qwen3', mrope_section=None, vision=None))
    del text['architectures']
    text['rope_parameters'].update(mrope_section=list(config.mrope_section),
                                   mrope_interleaved=True)
    vision_config, token_ids = hf_vision.config_to_hf(config.vision)
    return dict(architectures=['Qwen3VLForConditionalGeneration'],
                tie_word_embeddings=text.pop('tie_word_embeddings'),
                text_config=text, vision_config=vision_config, **token_ids)
  if config.model_type == 'qwen2' and (config.o_bias or not config.qkv_bias):
    raise CheckpointError('qwen2 checkpoints have q/k/v bias and no o bias')
  if config.model_type != 'qwen2' and config.qkv_bias != config.o_bias:
    raise CheckpointError(f'{config.model_type}: attention_bias covers q, k, '
                          'v and o together')
  if config.qk_norm != (config.model_type == 'qwen3'):
    raise CheckpointError('q/k RMSNorm exists exactly in qwen3 checkpoints')
  rope = {'rope_type': 'default', 'rope_theta': config.rope_theta}
  if config.rope_scaling:
    rope.update(dict(config.rope_scaling))
  out = dict(
      architectures=[{'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                      'qwen3': 'Qwen3ForCausalLM'}[config.model_type]],
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      rms_norm_eps=config.rms_norm_eps,
      rope_parameters=rope,
      tie_word_embeddings=config.tie_word_embeddings,
      bos_token_id=config.bos_token_id,
      eos_token_id=(list(config.eos_token_ids) if len(config.eos_token_ids) > 1
                    else (config.eos_token_ids or [None])[0]),
      pad_token_id=config.pad_token_id,
      dtype=config.param_dtype)
  if config.model_type != 'qwen2':
    out['attention_bias'] = config.qkv_bias
  return out


# One entry per parameter: (path in our state, HF tensor names, view of an
# HF array in our layout, our array back in the HF layout). A stacked layer
# parameter ([L, ...], `scan_layers`) has one HF name per layer; any other has
# one name. Views never copy.
_Entry = tuple[tuple, tuple[str, ...], Callable, Callable]


def _param_table(c: ModelConfig) -> list[_Entry]:
  d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  ident = lambda a: a
  t = lambda a: a.T

  def heads_in(n):  # [n*Dh, D] -> [D, n, Dh]
    return (lambda a: a.reshape(n, dh, d).transpose(2, 0, 1),
            lambda a: a.transpose(1, 2, 0).reshape(n * dh, d))

  def bias_in(n):  # [n*Dh] -> [n, Dh]
    return (lambda a: a.reshape(n, dh), lambda a: a.reshape(n * dh))

  out_in = (lambda a: a.reshape(d, h, dh).transpose(1, 2, 0),  # [D, H*Dh]
            lambda a: a.transpose(2, 0, 1).reshape(d, h * dh))
  lm = 'model.language_model.' if c.vision is not None else 'model.'
  table: list[_Entry] = [(('embed',), (f'{lm}embed_tokens.weight',), ident,
                          ident),
                         (('final_norm', 'scale'), (f'{lm}norm.weight',),
                          ident, ident)]
  if c.vision is not None:
    table += hf_vision.param_rows(c.vision, stacked=c.scan_layers)
  if not c.tie_word_embeddings:
    table.append((('lm_head',), ('lm_head.weight',), ident, ident))
  rows = [
      (('attn', 'wq'), 'self_attn.q_proj.weight', *heads_in(h)),
      (('attn', 'wk'), 'self_attn.k_proj.weight', *heads_in(k)),
      (('attn', 'wv'), 'self_attn.v_proj.weight', *heads_in(k)),
      (('attn', 'wo'), 'self_attn.o_proj.weight', *out_in),
      (('mlp', 'w_gate'), 'mlp.gate_proj.weight', t, t),
      (('mlp', 'w_up'), 'mlp.up_proj.weight', t, t),
      (('mlp', 'w_down'), 'mlp.down_proj.weight', t, t),
      (('attn_norm', 'scale'), 'input_layernorm.weight', ident, ident),
      (('mlp_norm', 'scale'), 'post_attention_layernorm.weight', ident,
       ident),
  ]
  if c.qkv_bias:
    rows += [(('attn', 'bq'), 'self_attn.q_proj.bias', *bias_in(h)),
             (('attn', 'bk'), 'self_attn.k_proj.bias', *bias_in(k)),
             (('attn', 'bv'), 'self_attn.v_proj.bias', *bias_in(k))]
  if c.o_bias:
    rows.append((('attn', 'bo'), 'self_attn.o_proj.bias', ident, ident))
  if c.qk_norm:
    rows += [(('attn', 'q_norm', 'scale'), 'self_attn.q_norm.weight', ident,
              ident),
             (('attn', 'k_norm', 'scale'), 'self_attn.k_norm.weight', ident,
              ident)]
  names = lambda name, layers: tuple(f'{lm}layers.{i}.{name}'
                                     for i in layers)
  if c.scan_layers:
    return table + [(('layers',) + p, names(name, range(c.num_layers)), a, b)
                    for p, name, a, b in rows]
  return table + [(('layers', i) + p, names(name, (i,)), a, b)
                  for i in range(c.num_layers) for p, name, a, b in rows]


def _stacked(config: ModelConfig, path: tuple) -> bool:
  """Whether the parameter at `path` stacks its layers ([L, ...])."""
  return config.scan_layers and (path[0] == 'layers'
                                 or path[:2] == ('vision', 'blocks'))


def _map_safetensors(file: str) -> dict[str, np.ndarray]:
  """Memory-mapped arrays of every tensor in one .safetensors file."""
  with open(file, 'rb') as f:
    (n,) = struct.unpack('<Q', f.read(8))
    header = json.loads(f.read(n))
  raw = np.memmap(file, dtype=np.uint8, mode='r')
  out = {}
  for name, meta in header.items():
    if name == '__metadata__':
      continue
    if meta['dtype'] not in _ST_DTYPES:
      raise CheckpointError(f'{file}: tensor {name!r} has unsupported dtype '
                            f'{meta["dtype"]}')
    begin, end = meta['data_offsets']
    out[name] = raw[8 + n + begin:8 + n + end].view(
        _ST_DTYPES[meta['dtype']]).reshape(meta['shape'])
  return out


def _map_checkpoint(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get('weight_map')
    if not weight_map:
      raise CheckpointError(f'{index}: no "weight_map"')
    files = sorted(set(weight_map.values()))
    for name in files:
      if not os.path.exists(os.path.join(path, name)):
        raise CheckpointError(f'{index}: shard {name!r} is missing from {path}')
  elif os.path.exists(os.path.join(path, 'model.safetensors')):
    files = ['model.safetensors']
  else:
    raise CheckpointError(f'{path}: no model.safetensors or '
                          'model.safetensors.index.json')
  tensors = {}
  for name in files:
    tensors.update(_map_safetensors(os.path.join(path, name)))
  return tensors


def _set_path(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get_path(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def load_tokenizer(path: str):
  """transformers.AutoTokenizer for the folder, or None if it has none."""
  if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
    return None
  import transformers  # pylint: disable=g-import-not-at-top
  declared = None
  config_file = os.path.join(path, 'tokenizer_config.json')
  if os.path.exists(config_file):
    with open(config_file) as f:
      declared = json.load(f).get('tokenizer_class')
  # AutoTokenizer prefers the model type's tokenizer class over the declared
  # generic one, which rebuilds (and breaks) custom tokenizer.json pipelines.
  if declared in (None, 'PreTrainedTokenizerFast', 'TokenizersBackend') and (
      os.path.exists(os.path.join(path, 'tokenizer.json'))):
    return transformers.PreTrainedTokenizerFast.from_pretrained(
        path, local_files_only=True)
  return transformers.AutoTokenizer.from_pretrained(path,
                                                    local_files_only=True)


def load(path: str, dtype: str = 'float32', mesh=None, *,
         param_dtype: str | None = None, rules=sharding.DEFAULT_RULES,
         **run_options):
  """(model, tokenizer) from a Hugging Face folder; tokenizer may be None.

  A Qwen3-VL folder gives (model, hf_vision.Processor) instead: its
  tokenizer and image processor.

  `run_options` are the ModelConfig fields that say how the model runs
  (transformer.RUN_OPTIONS: attention, attention_block, scan_layers, remat).
  """
  config_file = os.path.join(path, 'config.json')
  if not os.path.isdir(path):
    raise CheckpointError(f'{path}: model folder does not exist')
  if not os.path.exists(config_file):
    raise CheckpointError(f'{path}: no config.json')
  with open(config_file) as f:
    config = config_from_hf(json.load(f), dtype=dtype,
                            param_dtype=param_dtype, where=config_file)
  config = transformer.with_run_options(config, **run_options)
  model = from_tensors(config, _map_checkpoint(path), path, mesh, rules)
  tokenizer = load_tokenizer(path)
  if config.vision is not None and tokenizer is not None:
    return model, hf_vision.load_processor(path, tokenizer, config.vision)
  return model, tokenizer


def from_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray],
                 where: str, mesh=None,
                 rules=sharding.DEFAULT_RULES) -> transformer.Transformer:
  """The model from HF-named host arrays, each device reading only its slice.

  `tensors` may be lazy (memory maps, or a Mapping that converts on lookup);
  each needed name is looked up once.
  """
  graphdef, abstract_state = nnx.split(transformer.abstract_model(config))
  abstract = nnx.to_pure_dict(abstract_state)
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  else:
    shardings = sharding.param_shardings(abstract_state, mesh, rules)
  params: dict = {}
  used = set()
  for our_path, names, to_ours, _ in _param_table(config):
    target = _get_path(abstract, our_path)
    stacked = _stacked(config, our_path)
    shape = tuple(target.shape[1:] if stacked else target.shape)
    views = []
    for name in names:
      if name not in tensors:
        raise CheckpointError(f'{where}: tensor {name!r} is missing')
      array = tensors[name]
      views.append(to_ours(array))
      if tuple(views[-1].shape) != shape:
        raise CheckpointError(
            f'{where}: tensor {name!r} has shape {tuple(array.shape)}, '
            f'which does not fit config.json (expected {shape} in our '
            'layout)')
      used.add(name)
    if stacked:  # a device's slice of [L, ...]: its layers, each sliced
      read = lambda idx, views=views, dt=target.dtype: np.stack(
          [np.asarray(views[i][idx[1:]], dt)
           for i in range(len(views))[idx[0]]])
    else:
      read = lambda idx, view=views[0], dt=target.dtype: np.asarray(
          view[idx], dt)
    _set_path(params, our_path, jax.make_array_from_callback(
        target.shape, _get_path(shardings, our_path), read))
  extra = sorted(set(tensors) - used - {'lm_head.weight'})
  if extra:
    logging.warning('%s: ignoring %d unknown tensors, e.g. %s', where,
                    len(extra), extra[:3])
  return nnx.merge(graphdef, params)


def save(model: transformer.Transformer, path: str, tokenizer=None, *,
         max_shard_bytes: int = 2 << 30):
  """Writes a folder that transformers' from_pretrained loads."""
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  config = model.config
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tensors = {}
  for our_path, names, _, to_hf in _param_table(config):
    array = sharding.to_host(_get_path(state, our_path))
    if _stacked(config, our_path):
      tensors.update((name, np.ascontiguousarray(to_hf(array[i])))
                     for i, name in enumerate(names))
    else:
      tensors[names[0]] = np.ascontiguousarray(to_hf(array))
  if jax.process_index() != 0:
    return
  os.makedirs(path, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors.items():
    if size and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, 'model.safetensors'),
              metadata={'format': 'pt'})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
      save_file(shard, os.path.join(path, file), metadata={'format': 'pt'})
      weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, 'model.safetensors.index.json'), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map},
                f, indent=2)
  hf_config = transformers.AutoConfig.for_model(config.model_type,
                                                **config_to_hf(config))
  hf_config.save_pretrained(path)
  if tokenizer is not None:  # a tokenizer or a hf_vision.Processor
    tokenizer.save_pretrained(path)
