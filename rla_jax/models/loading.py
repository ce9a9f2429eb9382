"""Builds a model + tokenizer from a config section (HF folder, GGUF, random)."""

from __future__ import annotations

from rla_jax import sharding
from rla_jax.models import attention
from rla_jax.models import hf
from rla_jax.models import hf_vision
from rla_jax.models import transformer
from rla_jax.models import vision


def from_config(model_config, *, name: str, mesh, rules, make_tokenizer=None):
  """(model, tokenizer) for config section `name` (policy, reward_model, ...).

  `model_config.path` is a Hugging Face folder or a .gguf file; empty means
  a random model of shape `model_config.random` with the environment's own
  tokenizer (`make_tokenizer`), as the tiny config uses.
  """
  path = model_config.path
  options = run_options(model_config, name)
  try:
    if path.endswith('.gguf'):
      from rla_jax.models import gguf  # pylint: disable=g-import-not-at-top
      model, tokenizer = gguf.load(path, model_config.dtype, mesh,
                                   param_dtype=model_config.param_dtype,
                                   rules=rules, **options)
    elif path:
      model, tokenizer = hf.load(path, model_config.dtype, mesh,
                                 param_dtype=model_config.param_dtype,
                                 rules=rules, **options)
    else:
      model, tokenizer = _random(model_config, mesh, rules, make_tokenizer,
                                 name, options)
  except (hf.CheckpointError, FileNotFoundError) as e:
    raise ValueError(f'config.{name}.path={path!r}: {e}') from e
  if tokenizer is None:
    raise ValueError(f'config.{name}.path={path!r}: the folder has no '
                     'tokenizer files (tokenizer.json / tokenizer_config.json)')
  return model, tokenizer


def run_options(model_config, name: str) -> dict:
  """How the model runs (transformer.RUN_OPTIONS but remat, a train key)."""
  attention.check_impl(model_config.attention, f'config.{name}.attention')
  if model_config.attention_block < 1:
    raise ValueError(f'config.{name}.attention_block='
                     f'{model_config.attention_block}; must be >= 1')
  if not isinstance(model_config.scan_layers, bool):
    raise ValueError(f'config.{name}.scan_layers='
                     f'{model_config.scan_layers!r}; must be True or False')
  return dict(attention=model_config.attention,
              attention_block=model_config.attention_block,
              scan_layers=model_config.scan_layers)


def _random(model_config, mesh, rules, make_tokenizer, name, options):
  if model_config.random is None:
    raise ValueError(f'config.{name}: set either .path (a model folder or '
                     '.gguf file) or .random (shape of a random model)')
  if make_tokenizer is None:
    raise ValueError(f'config.{name}.random needs an environment that '
                     'provides make_tokenizer()')
  tokenizer = make_tokenizer()
  shape = model_config.random
  tower = (_random_tower(shape, tokenizer, name)
           if shape.model_type == 'qwen3_vl' else None)
  config = transformer.ModelConfig(
      model_type=shape.model_type, vocab_size=len(tokenizer),
      hidden_size=shape.hidden_size,
      intermediate_size=shape.intermediate_size,
      num_layers=shape.num_layers, num_heads=shape.num_heads,
      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
      qkv_bias=shape.model_type == 'qwen2',
      qk_norm=shape.model_type in ('qwen3', 'qwen3_vl'),
      mrope_section=None if tower is None else tuple(
          shape.vision.mrope_section),
      vision=tower,
      tie_word_embeddings=shape.tie_word_embeddings,
      dtype=model_config.dtype, param_dtype=model_config.param_dtype,
      eos_token_ids=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, **options)
  model = transformer.create(config, seed=model_config.seed, mesh=mesh,
                             rules=rules if rules is not None else
                             sharding.DEFAULT_RULES)
  if tower is not None:
    tokenizer = hf_vision.Processor(
        tokenizer, _image_processor(shape.vision), tower)
  return model, tokenizer


def _random_tower(shape, tokenizer, name: str) -> vision.VisionConfig:
  """The vision tower of a random Qwen3-VL (`random.vision`)."""
  v = shape.get('vision')
  if v is None:
    raise ValueError(f'config.{name}.random.model_type=\'qwen3_vl\' needs '
                     f'config.{name}.random.vision (the tower\'s shape)')
  ids = {}
  for key, token in (('image_token_id', hf_vision.IMAGE_PLACEHOLDER),
                     ('video_token_id', '<|video_pad|>'),
                     ('vision_start_token_id', '<|vision_start|>'),
                     ('vision_end_token_id', '<|vision_end|>')):
    ids[key] = tokenizer.convert_tokens_to_ids(token)
    if ids[key] in (None, tokenizer.unk_token_id):
      raise ValueError(f'config.{name}.random: the environment\'s tokenizer '
                       f'has no {token} token (a Qwen3-VL needs it)')
  return vision.VisionConfig(
      depth=v.depth, hidden_size=v.hidden_size,
      intermediate_size=v.intermediate_size, num_heads=v.num_heads,
      out_hidden_size=shape.hidden_size, patch_size=v.patch_size,
      spatial_merge_size=v.merge_size,
      num_position_embeddings=v.num_position_embeddings,
      deepstack_indexes=tuple(v.deepstack_indexes), **ids)


def _image_processor(v):
  """transformers' Qwen2-VL image processor (PIL), sized by `random.vision`."""
  from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ip  # pylint: disable=g-import-not-at-top
  return ip.Qwen2VLImageProcessorPil(
      patch_size=v.patch_size, temporal_patch_size=2, merge_size=v.merge_size,
      min_pixels=v.min_pixels, max_pixels=v.max_pixels)

