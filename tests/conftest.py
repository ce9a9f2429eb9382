"""Test setup: 8 simulated CPU devices, no network, tiny HF models on demand."""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
os.environ['JAX_PLATFORMS'] = 'cpu'
# XLA:CPU runs the simulated devices' collectives on one thread pool sized
# max(cores, devices); a device may block in two independent collectives at
# once, so 8 threads can all wait while a participant never gets one (the
# rendezvous then aborts the process). NPROC sizes that pool (and reaches the
# subprocesses tests start).
os.environ.setdefault('NPROC', '64')
os.environ['HF_HUB_OFFLINE'] = '1'
os.environ['TRANSFORMERS_OFFLINE'] = '1'
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_numpy_rank_promotion', 'raise')


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'slow: an end-to-end test of a minute or more; it runs in CI '
      '(deselect with -m "not slow" for a quick local pass)')

TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512)


def make_hf_model(path, family='qwen2', seed=0, **overrides):
  """Saves a tiny random transformers model to `path`; returns the torch model."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config_cls, model_cls = {
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
  }[family]
  kwargs = dict(TINY_HF)
  if family == 'qwen3':
    kwargs.update(head_dim=24, rope_theta=1e6)
  kwargs.update(overrides)
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kwargs)).eval()
  with torch.no_grad():  # random norm scales and biases, so they are tested
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif name.endswith('bias'):
        p.copy_(0.1 * torch.randn_like(p))
  model.save_pretrained(str(path))
  return model


@pytest.fixture
def hf_model_factory(tmp_path):
  def factory(family='qwen2', name=None, **overrides):
    path = tmp_path / (name or family)
    return str(path), make_hf_model(path, family, **overrides)
  return factory


def fake_generate(completions):
  """An environment's GenerateFn returning `completions`; records prompts."""
  seen = []

  def generate(prompts):
    seen.extend(prompts)
    return list(completions)[:len(prompts)]
  return generate, seen
