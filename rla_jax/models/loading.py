"""Builds a model + tokenizer from a config section (HF folder, GGUF, random)."""

from __future__ import annotations

from rla_jax import sharding
from rla_jax.models import attention
from rla_jax.models import hf
from rla_jax.models import transformer


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
  config = transformer.ModelConfig(
      model_type=shape.model_type, vocab_size=len(tokenizer),
      hidden_size=shape.hidden_size,
      intermediate_size=shape.intermediate_size,
      num_layers=shape.num_layers, num_heads=shape.num_heads,
      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
      qkv_bias=shape.model_type == 'qwen2', qk_norm=shape.model_type == 'qwen3',
      tie_word_embeddings=shape.tie_word_embeddings,
      dtype=model_config.dtype, param_dtype=model_config.param_dtype,
      eos_token_ids=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, **options)
  model = transformer.create(config, seed=model_config.seed, mesh=mesh,
                             rules=rules if rules is not None else
                             sharding.DEFAULT_RULES)
  return model, tokenizer

