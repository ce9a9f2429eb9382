"""google-tunix 0.1.7 sampler as a benchmark peer, run in tunix's own venv.

Started by benchmarks/sampler.py (tunix pins safetensors<0.8, which conflicts
with our stack; see STACK.md 2.4):

  /tmp/tunix-venv/bin/python benchmarks/tunix_sampler_peer.py MODEL_DIR \
      PROMPTS_JSON MAX_NEW_TOKENS

Loads the Hugging Face Qwen2 folder, compiles the sampler, prints
`{"ready": compile_s}`, then answers each stdin line `run SEED` with
`{"seconds": s, "tokens": n}` for one timed generation, until `quit`.
"""

import json
import sys
import time


class IdTokenizer:
  """Space-separated token ids <-> text; no BOS, so prompts stay unchanged."""

  def encode(self, text, **kwargs):
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs):
    del kwargs
    return ' '.join(str(int(t)) for t in ids)

  def bos_id(self):
    return 0  # falsy: tunix then adds no BOS

  def eos_id(self):
    return -1

  def pad_id(self):
    return 0


def main(model_dir, prompts_file, max_new_tokens):
  from tunix.generate import sampler as tunix_sampler  # pylint: disable=g-import-not-at-top
  from tunix.models.qwen2 import model as qwen2_model  # pylint: disable=g-import-not-at-top
  from tunix.models.qwen2 import params as qwen2_params  # pylint: disable=g-import-not-at-top
  with open(f'{model_dir}/config.json') as f:
    hf = json.load(f)
  with open(prompts_file) as f:
    prompts = json.load(f)
  heads = hf['num_attention_heads']
  head_dim = hf.get('head_dim') or hf['hidden_size'] // heads
  config = qwen2_model.ModelConfig(
      num_layers=hf['num_hidden_layers'], vocab_size=hf['vocab_size'],
      embed_dim=hf['hidden_size'], hidden_dim=hf['intermediate_size'],
      num_heads=heads, head_dim=head_dim,
      num_kv_heads=hf['num_key_value_heads'],
      rope_theta=int(hf.get('rope_theta') or
                     hf.get('rope_parameters', {}).get('rope_theta', 10000)),
      norm_eps=hf['rms_norm_eps'],
      use_tied_embedding=hf['tie_word_embeddings'])
  model = qwen2_params.create_model_from_safe_tensors(model_dir, config,
                                                      mesh=None)
  prompt_len = max(map(len, prompts))
  sampler = tunix_sampler.Sampler(
      model, IdTokenizer(),
      tunix_sampler.CacheConfig(cache_size=prompt_len + max_new_tokens,
                                num_layers=config.num_layers,
                                num_kv_heads=config.num_kv_heads,
                                head_dim=head_dim))
  texts = [' '.join(map(str, p)) for p in prompts]

  def run(seed):
    out = sampler(texts, max_generation_steps=max_new_tokens,
                  max_prompt_length=prompt_len, temperature=1.0, top_p=1.0,
                  eos_tokens=[-1], seed=seed)
    return sum(len(t) for t in out.tokens)

  start = time.perf_counter()
  run(0)
  print(json.dumps({'ready': time.perf_counter() - start}), flush=True)
  for line in sys.stdin:
    command = line.split()
    if not command or command[0] == 'quit':
      break
    start = time.perf_counter()
    tokens = run(int(command[1]))
    print(json.dumps({'seconds': time.perf_counter() - start,
                      'tokens': tokens}), flush=True)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
