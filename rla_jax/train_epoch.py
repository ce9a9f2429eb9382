"""One RL epoch of a model's training, on the host: `update`.

Examples are fitted to the length limits, grouped into optimizer steps (a
seeded grain shuffle), packed (batching.pack), given pi_old log-probs (from
the sampler on the first step, from train.Trainer.logprobs on the others)
and run through the Trainer's jitted step, skipping non-finite steps. The
device-side steps live in train.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grain
import jax
import numpy as np

from rla_jax import batching
from rla_jax import losses
from rla_jax import metrics as metrics_lib
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train


def _epoch_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
  """Step metrics over the applied (finite) steps."""
  out = dict(tokens=0.0, sequences=0.0)
  for key in per_step[0] if per_step else ():
    values = [m[key] for m in per_step]
    if key in losses.MAX_METRICS:
      out[key] = max(values)
    elif key in ('tokens', 'sequences'):
      out[key] = sum(values)
    elif key == 'lr':
      out[key] = values[-1]
    else:
      out[key] = float(np.mean(values))
  return out


def _steps(train_config, kept: Sequence[structs.Example], epoch: int):
  """Examples grouped per optimizer step by a grain pipeline.

  A seeded shuffle (per RL epoch, when `shuffle` is on) then consecutive
  groups of `global_batch_size`, or `updates_per_epoch` near-equal groups.
  """
  c = train_config
  per_step = batching.step_size(len(kept),
                                updates_per_epoch=c.updates_per_epoch,
                                global_batch_size=c.global_batch_size)
  ds = grain.MapDataset.source(list(kept))
  if c.shuffle:
    ds = ds.shuffle(seed=int(np.random.SeedSequence([c.seed, epoch])
                             .generate_state(1)[0]))
  return list(ds.batch(per_step, batch_fn=list))


def sampler_logprobs(examples: Sequence[structs.Example | None],
                     shape) -> np.ndarray:
  """The sampler log-probs of `examples`, in the order of a packed batch's
  sequences (batching.slots; None: an empty slot), shape [M, N, R] or
  [M * N, R]; losses.NO_LOGPROB where there is none."""
  out = np.full((int(np.prod(shape[:-1])), shape[-1]), losses.NO_LOGPROB,
                np.float32)
  for row, example in enumerate(examples):
    if example is None:
      continue
    n = min(len(example.logprobs), len(example.response_tokens), shape[-1])
    out[row, :n] = example.logprobs[:n]
  return out.reshape(shape)


def logprob_gaps(old_NxR: np.ndarray,
                 examples: Sequence[structs.Example | None]) -> np.ndarray:
  """|sampler log-prob - trainer pi_old| of every response token that has one.

  Row i of `old_NxR` holds the response of `examples[i]` (batching.slots).
  A sampler/trainer mismatch (different numerics, a cut context, a wrong
  template) shows up here before it biases the importance ratios.
  """
  sampler_NxR = sampler_logprobs(examples, old_NxR.shape)
  has_NxR = sampler_NxR != losses.NO_LOGPROB
  return np.abs(old_NxR - sampler_NxR)[has_NxR].astype(np.float32)


def _batches(trainer: train.Trainer, state: train.TrainState, groups,
             ref_params):
  """(Batch, on_policy) per optimizer step, with pi_old (and reference)
  log-probs, and the sampler/trainer log-prob gaps of the off-policy steps.

  The first step runs at pi_old itself: with the KL taken against pi_old it
  needs no log-prob pass (losses.LossConfig.on_policy), and measures the
  gaps in the step. Later steps get pi_old from one pass before any update.
  """
  c = trainer.train_config
  batches, gaps = [], []
  for i, group in enumerate(groups):
    batch = batching.pack(group, micro_batch_size=c.micro_batch_size,
                          prompt_buckets=c.prompt_buckets,
                          response_buckets=c.response_buckets,
                          vision_config=trainer.vision_config,
                          share_prompts=c.share_prompts)
    order = batching.slots(group, c.share_prompts)
    if i == 0 and ref_params is None:
      batches.append((batch.replace(old_logp_MxBxR=sampler_logprobs(
          order, batch.old_logp_MxBxR.shape)), True))
      continue
    old = trainer.logprobs(state.params, batch)
    ref = old if ref_params is None else trainer.logprobs(ref_params, batch)
    batches.append((batch.replace(old_logp_MxBxR=old, ref_logp_MxBxR=ref),
                    False))
    old_NxR = sharding.to_host(old)
    gaps.append(logprob_gaps(old_NxR.reshape(-1, old_NxR.shape[-1]), order))
  return batches, (np.concatenate(gaps) if gaps else
                   np.zeros((0,), np.float32))


_GAP_KEYS = ('gap_sum', 'gap_count', 'gap_max')


def _gap_metrics(trainer: train.Trainer, gaps: np.ndarray,
                 in_step: dict[str, float], epoch: int) -> dict[str, float]:
  """Mean and max |sampler - pi_old| over the host-side gaps and those the
  on-policy step measured (`in_step`: gap_sum, gap_count, gap_max)."""
  count = gaps.size + in_step.get('gap_count', 0.0)
  if not count:
    return {}
  mean = (float(gaps.sum()) + in_step.get('gap_sum', 0.0)) / count
  top = max(float(gaps.max()) if gaps.size else 0.0,
            in_step.get('gap_max', 0.0))
  bound = trainer.train_config.logprob_gap_warn
  if mean > bound:
    logging.warning(
        '%s epoch %d: sampler and trainer log-probs differ by %.4f on average '
        '(max %.4f) over %d response tokens, above train.logprob_gap_warn=%g; '
        'the importance ratios are biased (check dtypes, prompt limits and '
        'the chat template)', trainer.kind, epoch, mean, top, int(count),
        bound)
  return {'logprob_gap_mean': mean, 'logprob_gap_max': top}


def update(trainer: train.Trainer, state: train.TrainState,
           examples: Sequence[structs.Example], *, epoch: int,
           ref_params=None) -> tuple[train.TrainState, dict[str, float]]:
  """One RL epoch of training on `examples`.

  Examples are fitted to the length limits (triples stay together), pi_old
  log-probs of all of them are computed with the current params before the
  first update, then one optimizer step runs per group of examples.

  Args:
    trainer: the model's Trainer.
    state: its TrainState (donated).
    examples: (prompt, response, advantage) triples.
    epoch: RL epoch (seeds the shuffle; named in errors).
    ref_params: a frozen reference model's params for the KL term; by
      default the KL is taken against pi_old, as the authors do.

  Returns:
    (state, metrics): loss, pg_loss, kl, clip_frac, ratio_mean, entropy (if
    computed) and grad_norm averaged over steps; ratio_max over steps; lr of
    the last step; tokens, sequences, steps, dropped, examples, time_s,
    tokens_per_s; logprob_gap_mean / _max (|sampler - pi_old| per response
    token, when the examples carry sampler log-probs).

    skipped_steps: steps whose loss or gradient norm was not finite; they
    leave the state unchanged, are logged with their examples' keys and are
    left out of the other metrics.

  Raises:
    train.NonFiniteLossError: `train.max_nonfinite_steps` steps in a row
      (counted across calls in `trainer.nonfinite_streak`) were not finite.
  """
  c = trainer.train_config
  start = time.perf_counter()
  kept, dropped = batching.select(
      examples, max_prompt_len=c.max_prompt_len,
      max_response_len=c.max_response_len, overlong_prompt=c.overlong_prompt)
  base = dict(examples=float(len(examples)), dropped=float(dropped))
  if not kept:
    return state, dict(base, steps=0.0, skipped_steps=0.0, tokens=0.0,
                       sequences=0.0, time_s=time.perf_counter() - start)
  if trainer.optim_config.reset_every_epoch:
    state = trainer.reset_optimizer(state)
  groups = _steps(c, kept, epoch)
  batches, gaps = _batches(trainer, state, groups, ref_params)
  per_step, skipped, in_step = [], 0, {}
  for i, (group, (batch, on_policy)) in enumerate(zip(
      groups, metrics_lib.progress(batches, desc=f'{trainer.kind} updates'),
      strict=True)):
    state, metrics = trainer.step(state, batch, on_policy=on_policy)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    in_step.update({k: metrics.pop(k) for k in _GAP_KEYS if k in metrics})
    if np.isfinite(metrics['loss']) and np.isfinite(metrics['grad_norm']):
      trainer.nonfinite_streak = 0
      per_step.append(metrics)
      continue
    skipped += 1
    trainer.nonfinite_streak += 1
    where = (f'{trainer.kind} update {i + 1}/{len(batches)} of epoch {epoch} '
             f'(at step {int(state.step)}): loss={metrics["loss"]}, '
             f'grad_norm={metrics["grad_norm"]}')
    logging.warning('skipped %s; parameters and optimizer state unchanged '
                    '(%d non-finite steps in a row); examples: %s', where,
                    trainer.nonfinite_streak,
                    ' '.join(e.key or '?' for e in group))
    if trainer.nonfinite_streak >= c.max_nonfinite_steps:
      raise train.NonFiniteLossError(
          f'{trainer.nonfinite_streak} non-finite {trainer.kind} train steps '
          f'in a row (train.max_nonfinite_steps={c.max_nonfinite_steps}), '
          f'the last {where}; the skipped steps\' example keys are in the '
          'log. Lower the learning rate or fix the data; a resume continues '
          'the count', state)
  out = dict(_epoch_metrics(per_step), **base, steps=float(len(per_step)),
             skipped_steps=float(skipped),
             **_gap_metrics(trainer, gaps, in_step, epoch))
  out['time_s'] = time.perf_counter() - start
  out['tokens_per_s'] = out['tokens'] / out['time_s']
  return state, out
