"""One RL policy train step, ours (JAX) against torch 2.13 eager, side by side.

Models (`--model`): `tiny` is the Qwen2 of STACK.md (12.1M params, tied 32k
vocabulary), batch 8 x (64 prompt + 192 response) tokens; `smollm2` has
SmolLM2-135M's shapes (30 layers, d=576, 9 heads / 3 kv, ffn 1536, vocab
49152; random weights), one sequence of `--lengths` prompt tokens + 16
response tokens, as configs/default.py trains. fp32 on both sides. One step =
forward, clipped surrogate + k3 KL loss on the response tokens, backward,
global-norm clipping, AdamW. Both sides load the same weights (a random HF
folder) and data; torch computes logits only for the positions that predict
response tokens (`logits_to_keep`, as TRL's GRPO does) and uses SDPA.

Each side runs in its own process (so each one's peak RSS is its own); the
parent alternates timed rounds between them, one side idle while the other
runs. Compile and warm-up are excluded from the times.

  .venv/bin/python benchmarks/train_step.py  # tiny: about a minute
  .venv/bin/python benchmarks/train_step.py --model=smollm2  # ~10 min

The last line is `ratio_vs_torch=<ours tokens/s over torch's>` (per length
for smollm2). Before it: `peak_rss_ratio=<ours over torch's>` and
`matmul_frac=<our model matmul FLOP/s over a numpy float32 matmul's>` (per
length for smollm2; both sides' fractions are printed with their times).

`--profile`: after the timed rounds, our side runs one more step under the
profiler and prints where its time goes (step_profile.py): LM head and loss,
attention (core and projections), MLP, norms, embedding, optimizer and
clipping, the layer scan's slices and stacking, residual adds, other ops,
and host and runtime gaps; then the instructions that took longest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_check  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import step_profile  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

MODELS = {
    'tiny': dict(family='qwen2', hf=dict(
        vocab_size=32000, hidden_size=256, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
                 batch=8, lengths=(64,), response=192),
    'smollm2': dict(family='llama', hf=dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2),
                    batch=1, lengths=(1024, 2048), response=16),
}
CLIP_EPS, KL_COEF, LR, MAX_GRAD_NORM = 0.2, 0.01, 1e-6, 1.0
# Stages of our step, by the innermost frame of an op's Python stack.
STAGES = step_profile.by_frames((
    ('LM head and loss', ('/rla_jax/losses.py:',)),
    ('attention core', ('/rla_jax/models/attention.py:',)),
    ('attention projections', ('Attention.__call__',)),
    ('MLP', ('MLP.__call__', 'gated_mlp')),
    ('norms', ('RMSNorm.', 'rms_norm')),
    ('embedding', ('Transformer._embed',)),
    ('optimizer and clipping', ('/optax/',)),
    ('layer scan: weight slices, gradient stacking',
     ('Transformer._run_layers',)),
    ('residual adds', ('Block.__call__',)),
    ('loop state copies', ('<no source: copy>',)),
), 'other')


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_rate() -> float:
  """FLOP/s of a float32 2048^3 numpy matmul on all cores (best of 5): the
  matmul peak each side's step is held to."""
  a = np.ones((2048, 2048), np.float32)
  best = min(_timed(lambda: a @ a) for _ in range(5))
  return 2 * 2048**3 / best


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def configs(args):
  import ml_collections  # pylint: disable=g-import-not-at-top
  optim = ml_collections.ConfigDict(dict(
      learning_rate=LR, schedule='constant', warmup_steps=0, decay_steps=0,
      min_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
      max_grad_norm=MAX_GRAD_NORM, reset_every_epoch=False,
      mu_dtype='float32'))
  train_config = ml_collections.ConfigDict(dict(
      micro_batch_size=args.batch, updates_per_epoch=1, global_batch_size=0,
      max_prompt_len=args.prompt, max_response_len=args.response,
      overlong_prompt='truncate', prompt_buckets=(args.prompt,),
      response_buckets=(args.response,), clip_eps=CLIP_EPS,
      kl_coef=KL_COEF, entropy_coef=0.0, log_ratio_clamp=10.0,
      aggregation='sequence', compute_entropy=args.entropy,
      head_chunk=args.head_chunk, remat=args.remat, shuffle=False, seed=0,
      grad_accum_dtype='float32', share_prompts=1))
  return optim, train_config


def torch_loss(model, tokens, mask, old_logp, advantages, prompt,
               full_logits=False):
  """The same loss as rla_jax.losses.policy_loss (sequence mean)."""
  import torch  # pylint: disable=g-import-not-at-top
  positions = torch.clamp(mask.cumsum(-1) - 1, min=0)
  response = tokens.shape[1] - prompt
  keep = 0 if full_logits else response + 1  # 0: all positions
  logits = model(input_ids=tokens, attention_mask=mask,
                 position_ids=positions,
                 logits_to_keep=keep).logits[:, -response - 1:-1]
  logp_all = torch.log_softmax(logits.float(), dim=-1)
  logp = logp_all.gather(-1, tokens[:, prompt:, None])[..., 0]
  resp_mask = mask[:, prompt:].float()
  log_ratio = torch.clamp((logp - old_logp) * resp_mask, -10, 10)
  ratio = torch.exp(log_ratio)
  adv = advantages[:, None]
  clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
  surrogate = torch.minimum(ratio * adv, clipped * adv)
  ref_log_ratio = torch.clamp((old_logp - logp) * resp_mask, -10, 10)
  kl = torch.exp(ref_log_ratio) - 1 - ref_log_ratio
  per_token = (KL_COEF * kl - surrogate) * resp_mask
  per_seq = per_token.sum(-1) / resp_mask.sum(-1).clamp(min=1)
  return per_seq.mean(), logp.detach()


def _batch(args):
  from rla_jax import batching  # pylint: disable=g-import-not-at-top
  from rla_jax import structs  # pylint: disable=g-import-not-at-top
  with open(os.path.join(args.workdir, 'examples.json')) as f:
    rows = json.load(f)
  examples = [structs.Example(p, r, a) for p, r, a in rows]
  return batching.pack(examples, micro_batch_size=args.batch,
                       prompt_buckets=(args.prompt,),
                       response_buckets=(args.response,))


def jax_side(args):
  """Our trainer; returns (step_fn, first-step info)."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rla_jax import train  # pylint: disable=g-import-not-at-top
  from rla_jax.models import hf  # pylint: disable=g-import-not-at-top
  model, _ = hf.load(os.path.join(args.workdir, 'model'),
                     scan_layers=args.scan_layers, attention=args.attention,
                     attention_block=args.attention_block)
  optim, train_config = configs(args)
  graphdef, model_state = nnx.split(model)
  trainer = train.Trainer(graphdef, optim, train_config)
  state = trainer.init_state(nnx.to_pure_dict(model_state))
  del model, model_state
  batch = _batch(args)
  old = trainer.logprobs(state.params, batch)  # the pi_old pass, untimed
  batch = jax.device_put(batch.replace(old_logp_MxBxR=old,
                                       ref_logp_MxBxR=old))
  start = time.perf_counter()
  compiled = trainer._step.lower(state, batch).compile()  # pylint: disable=protected-access
  temp_gb = compiled.memory_analysis().temp_size_in_bytes / 2**30
  state, metrics = trainer.step(state, batch)
  jax.block_until_ready(metrics)
  info = dict(first_s=time.perf_counter() - start, loss=float(metrics['loss']),
              old=np.asarray(old[0]).tolist(), temp_gb=temp_gb)

  def step():
    nonlocal state
    state, step_metrics = trainer.step(state, batch)
    jax.block_until_ready(step_metrics)

  step.hlo_text = compiled.as_text()
  return step, info


def torch_side(args):
  """The same step in torch eager; returns (step_fn, first-step info)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.torch_threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.join(args.workdir, 'model'), attn_implementation='sdpa')
  batch = _batch(args)
  tokens = torch.tensor(np.asarray(batch.tokens_MxBxT[0]), dtype=torch.long)
  mask = torch.tensor(np.asarray(batch.mask_MxBxT[0]), dtype=torch.long)
  advantages = torch.tensor(np.asarray(batch.advantages_MxB[0]))
  with torch.no_grad():
    _, old = torch_loss(model, tokens, mask, torch.zeros(args.batch,
                                                         args.response),
                        advantages, args.prompt)
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999),
                          eps=1e-8, weight_decay=0.0)

  def step():
    loss, _ = torch_loss(model, tokens, mask, old, advantages, args.prompt,
                         args.torch_full_logits)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()

  start = time.perf_counter()
  loss = step()  # warm-up; the same first step as ours
  return step, dict(first_s=time.perf_counter() - start, loss=loss,
                    old=old.numpy().tolist())


def serve(args):
  """Child process: prepare one side, then run rounds the parent asks for."""
  step, info = (jax_side if args.side == 'jax' else torch_side)(args)
  print(json.dumps(dict(info, ready=True)), flush=True)
  for line in sys.stdin:
    if line.strip() == 'quit':
      break
    times = []
    for _ in range(int(line)):
      start = time.perf_counter()
      step()
      times.append(time.perf_counter() - start)
    print(json.dumps(dict(times=times)), flush=True)
  done = dict(peak_rss_gb=peak_rss_gb())
  if args.profile and args.side == 'jax':
    done['profile'] = step_profile.run(step, step.hlo_text, STAGES)
  print(json.dumps(done), flush=True)


class Side:
  """A child process running one side."""

  def __init__(self, side, args, prompt):
    flags = [f'--{k}={v}' for k, v in vars(args).items()
             if k not in ('side', 'lengths', 'prompt') and v is not None
             and not isinstance(v, bool)]
    flags += [f'--{k}' for k, v in vars(args).items()
              if v is True and k != 'scan_layers']
    flags.append(f'--scan_layers={int(args.scan_layers)}')
    self.name = side
    self.proc = subprocess.Popen(
        [sys.executable, __file__, f'--side={side}', f'--prompt={prompt}']
        + flags, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = self.read()

  def read(self):
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f'{self.name} side exited with {self.proc.wait()}')
      if line.startswith('{'):
        return json.loads(line)

  def run(self, steps):
    self.proc.stdin.write(f'{steps}\n')
    self.proc.stdin.flush()
    return self.read()['times']

  def close(self):
    self.proc.stdin.write('quit\n')
    self.proc.stdin.flush()
    done = self.read()
    self.proc.wait()
    if 'profile' in done:
      stages, wall, longest = done['profile']
      print(f'{self.name} step profile ({wall:.3f} s, one step):\n'
            + step_profile.table(stages, wall, longest))
    return done['peak_rss_gb']


def write_inputs(args, spec, prompt):
  """The shared random HF model folder and examples."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config_cls, model_cls = {
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
  }[spec['family']]
  path = os.path.join(args.workdir, 'model')
  if not os.path.exists(path):
    torch.manual_seed(0)
    model_cls(config_cls(**spec['hf'])).save_pretrained(path)
  vocab = spec['hf']['vocab_size']
  rng = np.random.default_rng(0)
  rows = [(rng.integers(3, vocab, prompt).tolist(),
           rng.integers(3, vocab, args.response).tolist(),
           float(rng.normal())) for _ in range(args.batch)]
  with open(os.path.join(args.workdir, 'examples.json'), 'w') as f:
    json.dump(rows, f)


def compare(args, prompt):
  """Both sides at one prompt length; returns (ratio, peak RSS ratio, our
  fraction of the matmul rate)."""
  tokens = args.batch * (prompt + args.response)
  print(f'== {args.model}: batch {args.batch} x ({prompt} + {args.response}) '
        f'tokens, remat={args.remat}, attention={args.attention}, '
        f'scan_layers={args.scan_layers} (load {os.getloadavg()[0]:.2f})',
        flush=True)
  sides = [Side('jax', args, prompt), Side('torch', args, prompt)]
  jax_info, torch_info = sides[0].info, sides[1].info
  print(f'jax: compile + first step {jax_info["first_s"]:.1f} s, compiled '
        f'temp {jax_info["temp_gb"]:.2f} GiB; torch first step '
        f'{torch_info["first_s"]:.1f} s')
  print(f'first-step loss: jax {jax_info["loss"]:.7f}, torch '
        f'{torch_info["loss"]:.7f}; max |pi_old difference| '
        f'{np.abs(np.subtract(jax_info["old"], torch_info["old"])).max():.1e}')
  times = {s.name: [] for s in sides}
  for r in range(args.rounds):
    load = os.getloadavg()[0]
    for side in sides if r % 2 == 0 else sides[::-1]:
      times[side.name] += side.run(args.steps_per_round)
    mins = ', '.join(f'{n} {min(t[-args.steps_per_round:]):.3f} s'
                     for n, t in times.items())
    print(f'round {r}: {mins}, loadavg {load:.2f} -> {os.getloadavg()[0]:.2f}',
          flush=True)
  peaks = {s.name: s.close() for s in sides}
  medians = {n: statistics.median(t) for n, t in times.items()}
  hf_config = MODELS[args.model]['hf']
  flops = gpu_check.train_flops(types.SimpleNamespace(
      vocab_size=hf_config['vocab_size'], hidden_size=hf_config['hidden_size'],
      intermediate_size=hf_config['intermediate_size'],
      num_layers=hf_config['num_hidden_layers'],
      num_heads=hf_config['num_attention_heads'],
      num_kv_heads=hf_config['num_key_value_heads'],
      head_dim=hf_config['hidden_size'] // hf_config['num_attention_heads']),
      args.batch, prompt + args.response, args.response)
  rate = matmul_rate()
  for n, seconds in medians.items():
    print(f'{n:5s} step median {seconds:.3f} s -> {tokens / seconds:,.0f} '
          f'tokens/s, {flops / seconds / 1e9:.0f} GFLOP/s of model matmuls = '
          f'{flops / seconds / rate:.1%} of a {rate / 1e9:.0f} GFLOP/s numpy '
          f'matmul, peak RSS {peaks[n]:.2f} GiB')
  return (medians['torch'] / medians['jax'], peaks['jax'] / peaks['torch'],
          flops / medians['jax'] / rate)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', choices=sorted(MODELS), default='tiny')
  parser.add_argument('--lengths', default=None,
                      help='comma-separated prompt lengths (model default)')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps_per_round', type=int, default=2)
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--response', type=int, default=None)
  parser.add_argument('--head_chunk', type=int, default=512)
  parser.add_argument('--remat', default='none')
  parser.add_argument('--attention', default='auto')
  parser.add_argument('--attention_block', type=int, default=512)
  parser.add_argument('--scan_layers', type=int, default=1)
  parser.add_argument('--entropy', action='store_true',
                      help='also compute the entropy metric (torch does not)')
  parser.add_argument('--torch_threads', type=int, default=2)
  parser.add_argument('--torch_full_logits', action='store_true',
                      help='torch computes logits at every position, as the '
                      "authors' trainer does")
  parser.add_argument('--profile', action='store_true',
                      help='print where our step spends its time')
  parser.add_argument('--side', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--prompt', type=int, default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument('--workdir', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  spec = MODELS[args.model]
  args.batch = args.batch or spec['batch']
  args.response = args.response or spec['response']
  args.scan_layers = bool(args.scan_layers)
  if args.side:
    serve(args)
    return
  lengths = ([int(n) for n in args.lengths.split(',')] if args.lengths
             else spec['lengths'])
  results = {}
  with tempfile.TemporaryDirectory(prefix='train_bench_') as workdir:
    args.workdir = workdir
    for prompt in lengths:
      write_inputs(args, spec, prompt)
      results[prompt] = compare(args, prompt)
  print(f'loadavg {os.getloadavg()}, torch threads {args.torch_threads}')
  if len(lengths) == 1:
    ratio, peak, frac = results[lengths[0]]
    print(f'peak_rss_ratio={peak:.3f} matmul_frac={frac:.3f}')
    print(f'ratio_vs_torch={ratio:.3f}')
    return
  print(' '.join(f'peak_rss_ratio@{n}={results[n][1]:.3f}' for n in lengths))
  print(' '.join(f'matmul_frac@{n}={results[n][2]:.3f}' for n in lengths))
  print(' '.join(f'ratio_vs_torch@{n}={results[n][0]:.3f}' for n in lengths))


if __name__ == '__main__':
  main()
