"""One RL policy train step, ours (JAX) against torch 2.13 eager, side by side.

The tiny Qwen2 of STACK.md (12.1M params, tied 32k vocabulary), batch 8 x 256
tokens (64 prompt + 192 response), fp32. One step = forward, clipped surrogate
+ k3 KL loss on the response tokens, backward, global-norm clipping, AdamW.
Both sides start from the same weights and data; torch computes logits only
for the positions that predict response tokens (`logits_to_keep`, as TRL's
GRPO does). Rounds alternate the two sides; compile and warm-up are excluded.

  .venv/bin/python benchmarks/train_step.py  # about a minute on 2 cores

The last line is `ratio_vs_torch=<our tokens/s over torch's>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import ml_collections
import numpy as np
import torch
import transformers
from flax import nnx

from rla_jax import batching
from rla_jax import structs
from rla_jax import train
from rla_jax.models import hf

QWEN2_TINY = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
CLIP_EPS, KL_COEF, LR, MAX_GRAD_NORM = 0.2, 0.01, 1e-6, 1.0


def configs(args):
  optim = ml_collections.ConfigDict(dict(
      learning_rate=LR, schedule='constant', warmup_steps=0, decay_steps=0,
      min_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
      max_grad_norm=MAX_GRAD_NORM, reset_every_epoch=False))
  train_config = ml_collections.ConfigDict(dict(
      micro_batch_size=args.batch, updates_per_epoch=1, global_batch_size=0,
      max_prompt_len=args.prompt, max_response_len=args.response,
      overlong_prompt='truncate', prompt_buckets=(args.prompt,),
      response_buckets=(args.response,), clip_eps=CLIP_EPS,
      kl_coef=KL_COEF, entropy_coef=0.0, log_ratio_clamp=10.0,
      aggregation='sequence', compute_entropy=args.entropy,
      head_chunk=args.head_chunk, remat=False, shuffle=False, seed=0))
  return optim, train_config


def torch_loss(model, tokens, mask, old_logp, advantages, prompt,
               full_logits=False):
  """The same loss as rla_jax.losses.policy_loss (sequence mean)."""
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


def make_jax_step(model, examples, args):
  """Our trainer on the model; returns (step_fn, first-step loss, pi_old)."""
  optim, train_config = configs(args)
  graphdef, model_state = nnx.split(model)
  trainer = train.Trainer(graphdef, optim, train_config)
  state = trainer.init_state(nnx.to_pure_dict(model_state))
  batch = batching.pack(examples, micro_batch_size=args.batch,
                        prompt_buckets=(args.prompt,),
                        response_buckets=(args.response,))
  old = trainer.logprobs(state.params, batch)  # the pi_old pass, untimed
  batch = jax.device_put(batch.replace(old_logp_MxBxR=old,
                                       ref_logp_MxBxR=old))
  start = time.perf_counter()
  state, metrics = trainer.step(state, batch)
  jax.block_until_ready(metrics)
  print(f'jax: first step (compile + run) {time.perf_counter() - start:.1f} s')

  def step():
    nonlocal state
    state, step_metrics = trainer.step(state, batch)
    jax.block_until_ready(step_metrics)

  return step, float(metrics['loss']), np.asarray(old[0]), batch


def make_torch_step(model, batch, args):
  """The same step in torch eager; returns (step_fn, pi_old)."""
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

  return step, old.numpy()


def interleave(sides, rounds, steps_per_round):
  """Alternating rounds of timed steps; returns {name: [seconds]}."""
  times = {name: [] for name, _ in sides}
  for round_index in range(rounds):
    load_before = os.getloadavg()[0]
    for name, step in sides if round_index % 2 == 0 else sides[::-1]:
      for _ in range(steps_per_round):
        start = time.perf_counter()
        step()
        times[name].append(time.perf_counter() - start)
    mins = ', '.join(f'{name} {min(t[-steps_per_round:]):.3f} s'
                     for name, t in times.items())
    print(f'round {round_index}: {mins}, loadavg {load_before:.2f} -> '
          f'{os.getloadavg()[0]:.2f}')
  return times


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps_per_round', type=int, default=2)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--prompt', type=int, default=64)
  parser.add_argument('--response', type=int, default=192)
  parser.add_argument('--head_chunk', type=int, default=512)
  parser.add_argument('--entropy', action='store_true',
                      help='also compute the entropy metric (torch does not)')
  parser.add_argument('--torch_threads', type=int, default=2)
  parser.add_argument('--torch_full_logits', action='store_true',
                      help='torch computes logits at every position, as the '
                      "authors' trainer does")
  args = parser.parse_args()
  torch.set_num_threads(args.torch_threads)

  # Same weights on both sides: a random HF model, saved and loaded by us.
  torch.manual_seed(0)
  reference = transformers.Qwen2ForCausalLM(
      transformers.Qwen2Config(**QWEN2_TINY))
  with tempfile.TemporaryDirectory() as path:
    reference.save_pretrained(path)
    model, _ = hf.load(path)
  rng = np.random.default_rng(0)
  examples = [structs.Example(rng.integers(3, 32000, args.prompt).tolist(),
                              rng.integers(3, 32000, args.response).tolist(),
                              float(rng.normal())) for _ in range(args.batch)]

  jax_step, jax_loss, jax_old, batch = make_jax_step(model, examples, args)
  del model
  torch_step, torch_old = make_torch_step(reference, batch, args)
  torch_loss_first = torch_step()  # warm-up; the same first step as ours
  print(f'first-step loss: jax {jax_loss:.7f}, torch {torch_loss_first:.7f};'
        f' max |pi_old difference| {np.abs(jax_old - torch_old).max():.1e}')

  times = interleave([('jax', jax_step), ('torch', torch_step)], args.rounds,
                     args.steps_per_round)
  tokens = args.batch * (args.prompt + args.response)
  medians = {name: statistics.median(t) for name, t in times.items()}
  for name, seconds in medians.items():
    print(f'{name:5s} step median {seconds:.3f} s -> {tokens / seconds:,.0f} '
          f'tokens/s')
  print(f'loadavg {os.getloadavg()}, jax devices {jax.devices()}, torch '
        f'threads {torch.get_num_threads()}')
  print(f'ratio_vs_torch={medians["torch"] / medians["jax"]:.3f}')


if __name__ == '__main__':
  main()
