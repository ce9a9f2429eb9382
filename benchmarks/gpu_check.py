"""Decode bandwidth and train-step MFU of random Qwen2.5-0.5B / 1.5B on a GPU.

For each model (random weights, nothing downloaded):
  decode: `sampler.generate` on `--batch` rows of `--prompt` random tokens,
    `--new` new tokens each (no early stop); the per-step time is the
    difference of a long and a 1-token call, so prefill is excluded. Bytes
    per step = every parameter (the tied head reads the whole embedding) +
    the KV cache read up to the filled slots, for the step's average fill.
    Reported as tokens/s and the fraction of the device's HBM bandwidth.
  train: one policy train step (bf16 compute, f32 master weights, AdamW) on
    `--train_batch` sequences of `--train_len` tokens (half prompt, half
    response); model FLOPs = 6 * (non-embedding params) * tokens + the head
    on response tokens + causal attention (fwd + bwd, no recompute counted),
    over the step time and the device's peak bf16 FLOP/s: MFU.

Targets on an H200: decode >= 60% of HBM bandwidth, train >= 40% MFU.
Each line also gives the host overhead of one call: the CPU time of the
calling thread while the device works (Python, pytrees, dispatch, copies).

  python benchmarks/gpu_check.py                 # on the GPU, < 10 minutes
  python benchmarks/gpu_check.py --tiny          # CPU smoke run (tests)
  python benchmarks/gpu_check.py --models=qwen2.5-0.5b --batch=8 --new=16 \
      --dtype=float32 --train_dtype=float32 --train_batch=1 \
      --train_len=256   # host overhead of a 0.5B model on a CPU

Peak numbers come from --peak_tflops / --peak_gbps, else from the device
kind (H200: 989 TFLOP/s dense bf16, 4800 GB/s). The last line is
`gpu_check decode_bw_fraction=<min> train_mfu=<min>` (nan without peaks).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5 config.json shapes (tied embeddings, q/k/v bias).
MODELS = {
    'qwen2.5-0.5b': dict(vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64),
    'qwen2.5-1.5b': dict(vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128),
    'tiny': dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
}
# device_kind substring: (dense bf16 TFLOP/s, HBM GB/s)
PEAKS = {'H200': (989.0, 4800.0), 'H100': (989.0, 3350.0),
         'A100': (312.0, 2039.0)}


def model_config(name, dtype, param_dtype, attention):
  from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
  return transformer.ModelConfig(
      'qwen2', **MODELS[name], rope_theta=1e6, qkv_bias=True,
      tie_word_embeddings=True, dtype=dtype, param_dtype=param_dtype,
      attention=attention, scan_layers=True)


def param_count(config, embedding=True) -> int:
  d, f, h, k, dh = (config.hidden_size, config.intermediate_size,
                    config.num_heads, config.num_kv_heads, config.head_dim)
  layer = d * dh * (2 * h + 2 * k) + 3 * d * f + 2 * d + (h + 2 * k) * dh
  return config.num_layers * layer + d + (config.vocab_size * d
                                          if embedding else 0)


def train_flops(config, batch: int, length: int, response: int) -> float:
  """Model FLOPs of one train step (forward and backward, 3x the forward):
  6 x non-embedding params x tokens, the LM head on the `response`
  positions of each row only, and causal attention (half the pairs)."""
  attention = (12 * config.num_layers * batch * length**2 * config.num_heads
               * config.head_dim / 2)
  return (6 * param_count(config, embedding=False) * batch * length
          + 6 * config.vocab_size * config.hidden_size * batch * response
          + attention)


def timed(fn, repeats):
  """Best of `repeats` wall times (the least disturbed run)."""
  return min(_wall_and_host(fn) for _ in range(repeats))[0]


def _wall_and_host(fn) -> tuple[float, float]:
  """(wall seconds, seconds of this thread's CPU) of one call.

  The device work runs on XLA's threads (or the accelerator) while this
  thread waits, so its CPU time is the host overhead of the call: Python,
  pytree handling, dispatch, transfers and host-side post-processing.
  """
  wall, host = time.perf_counter(), time.thread_time()
  fn()
  return time.perf_counter() - wall, time.thread_time() - host


def host_ms(fn, repeats) -> float:
  """Median host overhead of a call in milliseconds (see _wall_and_host)."""
  return 1e3 * float(np.median([_wall_and_host(fn)[1]
                                for _ in range(repeats)]))


def decode_check(name, args, peak_gbps):
  import jax  # pylint: disable=g-import-not-at-top
  from rla_jax import sampler  # pylint: disable=g-import-not-at-top
  from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
  config = model_config(name, args.dtype, args.dtype, args.attention)
  model = transformer.create(config, seed=0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, config.vocab_size, args.prompt).tolist()
             for _ in range(args.batch)]
  call = lambda n: sampler.generate(
      model, prompts, n, temperature=1.0, prompt_buckets=(args.prompt,),
      batch_buckets=(args.batch,), transpose_head=False)
  start = time.perf_counter()
  call(1), call(args.new)  # compile both programs
  compile_s = time.perf_counter() - start
  t1 = timed(lambda: call(1), args.repeats)
  tn = timed(lambda: call(args.new), args.repeats)
  host = host_ms(lambda: call(args.new), args.repeats)
  step_s = max(tn - t1, 1e-9) / (args.new - 1)
  itemsize = jax.numpy.dtype(config.dtype).itemsize
  kv_per_slot = (2 * config.num_layers * config.num_kv_heads
                 * config.head_dim * itemsize)
  filled = args.prompt + args.new / 2
  step_bytes = (param_count(config) * itemsize
                + args.batch * filled * kv_per_slot)
  gbps = step_bytes / step_s / 1e9
  fraction = gbps / peak_gbps if peak_gbps else math.nan
  print(f'{name} decode: batch {args.batch}, prompt {args.prompt}, '
        f'{args.new} new ({config.dtype} weights): {step_s * 1e3:.2f} ms/step'
        f' = {args.batch / step_s:,.0f} tok/s; {step_bytes / 1e9:.2f} GB per '
        f'step -> {gbps:,.0f} GB/s = {fraction:.1%} of HBM bandwidth '
        f'(prefill+1 step {t1 * 1e3:.0f} ms; host {host:.1f} ms per call of '
        f'{tn * 1e3:.0f} ms; compile {compile_s:.0f} s)', flush=True)
  return fraction


def train_check(name, args, peak_tflops):
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rla_jax import batching  # pylint: disable=g-import-not-at-top
  from rla_jax import structs  # pylint: disable=g-import-not-at-top
  from rla_jax import train  # pylint: disable=g-import-not-at-top
  from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
  config = model_config(name, args.train_dtype, 'float32', args.attention)
  graphdef, state = nnx.split(transformer.create(config, seed=0))
  prompt = response = args.train_len // 2
  optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, schedule='constant', warmup_steps=0, decay_steps=0,
      min_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
      max_grad_norm=1.0, reset_every_epoch=False, mu_dtype='float32'))
  train_config = ml_collections.ConfigDict(dict(
      micro_batch_size=args.train_batch, updates_per_epoch=1,
      global_batch_size=0, max_prompt_len=prompt, max_response_len=response,
      overlong_prompt='truncate', prompt_buckets=(prompt,),
      response_buckets=(response,), clip_eps=0.2, kl_coef=0.01,
      entropy_coef=0.0, log_ratio_clamp=10.0, aggregation='sequence',
      compute_entropy=False, head_chunk=args.head_chunk, remat=args.remat,
      shuffle=False, seed=0, grad_accum_dtype='float32', share_prompts=1))
  trainer = train.Trainer(graphdef, optim, train_config)
  train_state = trainer.init_state(nnx.to_pure_dict(state))
  del state
  rng = np.random.default_rng(0)
  examples = [structs.Example(
      rng.integers(3, config.vocab_size, prompt).tolist(),
      rng.integers(3, config.vocab_size, response).tolist(),
      float(rng.normal())) for _ in range(args.train_batch)]
  batch = batching.pack(examples, micro_batch_size=args.train_batch,
                        prompt_buckets=(prompt,), response_buckets=(response,))
  old = trainer.logprobs(train_state.params, batch)
  batch = jax.device_put(batch.replace(old_logp_MxBxR=old,
                                       ref_logp_MxBxR=old))
  start = time.perf_counter()
  train_state, metrics = trainer.step(train_state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start

  def step():
    nonlocal train_state
    train_state, step_metrics = trainer.step(train_state, batch)
    jax.block_until_ready(step_metrics)

  step_s = timed(step, args.repeats)
  host = host_ms(step, args.repeats)
  tokens = args.train_batch * args.train_len
  flops = train_flops(config, args.train_batch, args.train_len, response)
  tflops = flops / step_s / 1e12
  mfu = tflops / peak_tflops if peak_tflops else math.nan
  print(f'{name} train: {args.train_batch} x {args.train_len} tokens, '
        f'{config.dtype}, remat={args.remat}: {step_s * 1e3:.0f} ms/step = {tokens / step_s:,.0f}'
        f' tok/s; {flops / 1e12:.1f} TFLOP -> {tflops:.0f} TFLOP/s = '
        f'{mfu:.1%} MFU (host {host:.1f} ms per step; compile + first step '
        f'{compile_s:.0f} s, loss {float(metrics["loss"]):.4f})', flush=True)
  return mfu


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='qwen2.5-0.5b,qwen2.5-1.5b')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--prompt', type=int, default=128)
  parser.add_argument('--new', type=int, default=256)
  parser.add_argument('--dtype', default='bfloat16',
                      help='decode weights and compute')
  parser.add_argument('--train_dtype', default='bfloat16',
                      help='train compute (master weights are float32)')
  parser.add_argument('--train_batch', type=int, default=8)
  parser.add_argument('--train_len', type=int, default=2048)
  parser.add_argument('--remat', default='none')
  parser.add_argument('--head_chunk', type=int, default=4096)
  parser.add_argument('--attention', default='auto')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--peak_tflops', type=float, default=0.0)
  parser.add_argument('--peak_gbps', type=float, default=0.0)
  parser.add_argument('--tiny', action='store_true',
                      help='tiny model and shapes (a CPU smoke run)')
  args = parser.parse_args(argv)
  if args.tiny:
    args.models, args.batch, args.prompt, args.new = 'tiny', 4, 16, 8
    args.train_batch, args.train_len, args.repeats = 2, 64, 1
    args.dtype = args.train_dtype = 'float32'  # XLA:CPU lacks some bf16 dots
  import jax  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  kind = getattr(device, 'device_kind', device.platform)
  peak = next((v for k, v in PEAKS.items() if k in kind), (0.0, 0.0))
  peak_tflops = args.peak_tflops or peak[0]
  peak_gbps = args.peak_gbps or peak[1]
  print(f'device {kind} ({jax.default_backend()}, jax {jax.__version__}); '
        f'peaks {peak_tflops or "?"} TFLOP/s, {peak_gbps or "?"} GB/s',
        flush=True)
  start = time.perf_counter()
  fractions, mfus = [], []
  for name in args.models.split(','):
    fractions.append(decode_check(name, args, peak_gbps))
    mfus.append(train_check(name, args, peak_tflops))
  print(f'total {time.perf_counter() - start:.0f} s')
  print(f'gpu_check decode_bw_fraction={min(fractions):.3f} '
        f'train_mfu={min(mfus):.3f}')


if __name__ == '__main__':
  main()
