"""chat.complete: identical prompts in a batch share one prefill."""

import ml_collections
import pytest

from configs import base
from rla_jax import chat
from rla_jax.envs import word_tokenizer
from rla_jax.models import transformer


@pytest.fixture(scope='module')
def setup():
  tok = word_tokenizer.make_tokenizer()
  config = transformer.ModelConfig(
      model_type='qwen2', vocab_size=len(tok), hidden_size=32,
      intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
      head_dim=16)
  sampling = ml_collections.ConfigDict(base.sampling_section(
      max_new_tokens=3, max_prompt_len=32, prompt_buckets=(32,),
      batch_buckets=(4, 8, 16), stop_strings=()))
  return transformer.create(config, seed=0), tok, sampling


def _calls(monkeypatch):
  calls, generate = [], chat.sampler.generate

  def recording(model, prompts, *args, num_samples=1, **kwargs):
    calls.append((len(prompts), num_samples))
    return generate(model, prompts, *args, num_samples=num_samples, **kwargs)

  monkeypatch.setattr(chat.sampler, 'generate', recording)
  return calls


@pytest.mark.parametrize('order,num_samples,expected', [
    ('aaabbb', 1, [(2, 3)]),  # a rollout's first turn: G = 3 per task
    ('aabb', 2, [(2, 4)]),
    ('aab', 1, [(3, 1)]),  # runs of unequal length: no sharing
    ('abab', 1, [(4, 1)]),  # equal prompts that are not adjacent
])
def test_runs_of_identical_prompts_share_a_prefill(setup, monkeypatch, order,
                                                   num_samples, expected):
  model, tok, sampling = setup
  text = {'a': 'go north', 'b': 'take the key'}
  messages = [[{'role': 'user', 'content': text[c]}] for c in order]
  calls = _calls(monkeypatch)
  rows = chat.complete(model, tok, messages, sampling=sampling,
                       num_samples=num_samples, seed=0)
  assert calls == expected
  assert [len(r) for r in rows] == [num_samples] * len(order)
  for c, row in zip(order, rows):
    for completion in row:
      assert completion.prompt == chat.render(tok, [
          {'role': 'user', 'content': text[c]}])
      assert 1 <= len(completion.tokens) <= 3
      assert len(completion.logprobs) == len(completion.tokens)
