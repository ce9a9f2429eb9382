"""Training examples -> padded, bucketed batches of micro-batches (host side).

Letters: M micro-batches per optimizer step, B rows per micro-batch, K
responses per row, N = B * K sequences per micro-batch, P prompt slots, R
response slots, T = P + K * R.

A row is `[left-padded prompt | right-padded response]`, so every response
starts at column P and the hidden state at P - 1 + r predicts response token r.
With `share_prompts` = K > 1, examples with the same prompt share a row:
`[prompt | response 1 | ... | response K]`, each response in its own R slots,
attending to the prompt and to itself only (the model's branch ids), so the
prompt is computed once for up to K responses (the G rollouts of a task on
their first turn, the m judgments of a step). Response-level arrays are laid
out [M, N, R], row-major: sequence b * K + k is response k of row b.
Prompt and response lengths are rounded up to configured buckets and M to a
power of two, which keeps the number of compiled programs small; padding
micro-batches are skipped on the device.

Examples with images (Qwen3-VL) add each row's patches (padded to one bucket
length N for the step, [M, B, N, ...]) and multimodal positions
[M, B, T, 3].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from rla_jax import structs
from rla_jax.models import vision

DROP = 'drop'
TRUNCATE = 'truncate'  # keep the last max_prompt_len prompt tokens


@flax.struct.dataclass
class Batch:
  """One optimizer step's data (numpy on the host, jax.Array on the device)."""

  tokens_MxBxT: np.ndarray  # int32
  mask_MxBxT: np.ndarray  # bool: real (non-pad) tokens
  # Response-level arrays have N = B * K sequences per micro-batch (B when
  # no prompts are shared); the names keep the K = 1 letters.
  response_mask_MxBxR: np.ndarray  # bool: response tokens that are trained
  advantages_MxB: np.ndarray  # float32: one scalar per sequence
  old_logp_MxBxR: np.ndarray  # float32: log pi_old, from the log-prob pass
  ref_logp_MxBxR: np.ndarray  # float32: KL reference (pi_old by default)
  # With images: positions (t, h, w) and each row's patches [M, B, N, ...].
  positions_MxBxTx3: np.ndarray | None = None
  patches: vision.Patches | None = None

  @property
  def response_len(self) -> int:
    return self.response_mask_MxBxR.shape[-1]

  @property
  def branches(self) -> int:
    """K: responses per row (static, from the shapes)."""
    return self.response_mask_MxBxR.shape[1] // self.tokens_MxBxT.shape[1]


def select(examples: Sequence[structs.Example], *, max_prompt_len: int,
           max_response_len: int,
           overlong_prompt: str) -> tuple[list[structs.Example], int]:
  """Fits examples to the length limits, keeping each triple together.

  Over-long prompts are dropped or left-truncated (`overlong_prompt`), long
  responses are cut to `max_response_len`, and examples with an empty prompt
  or response are dropped. The advantage always travels with its own tokens
  (the authors' code mispairs them after a drop, RLANYTHING.md bug B1).

  Returns:
    (kept examples, number dropped).
  """
  if overlong_prompt not in (DROP, TRUNCATE):
    raise ValueError(f'overlong_prompt={overlong_prompt!r}; expected '
                     f'{DROP!r} or {TRUNCATE!r}')
  kept, dropped = [], 0
  for i, example in enumerate(examples):
    if not math.isfinite(example.advantage):
      raise ValueError(f'example {i} has a non-finite advantage '
                       f'{example.advantage}')
    prompt = list(example.prompt_tokens)
    response = list(example.response_tokens)[:max_response_len]
    logprobs = list(example.logprobs)[:max_response_len]
    if len(prompt) > max_prompt_len:
      if overlong_prompt == DROP or example.images is not None:
        dropped += 1
        continue
      prompt = prompt[len(prompt) - max_prompt_len:]
    if not prompt or not response:
      dropped += 1
      continue
    kept.append(dataclasses.replace(example, prompt_tokens=prompt,
                                    response_tokens=response,
                                    logprobs=logprobs,
                                    advantage=float(example.advantage)))
  return kept, dropped


def step_size(num_examples: int, *, updates_per_epoch: int,
              global_batch_size: int) -> int:
  """Examples per optimizer step.

  `global_batch_size` when > 0 (the last step takes the rest); otherwise the
  data are split into `updates_per_epoch` near-equal steps, as the authors'
  trainer does.
  """
  if global_batch_size > 0:
    return global_batch_size
  return max(1, math.ceil(num_examples / updates_per_epoch))


def bucket(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds `length`."""
  fitting = [b for b in buckets if b >= length]
  if not fitting:
    raise ValueError(f'length {length} exceeds the largest bucket '
                     f'{max(buckets)}')
  return min(fitting)


def num_micro_batches(num_examples: int, micro_batch_size: int) -> int:
  """Micro-batches for one step, rounded up to a power of two."""
  needed = max(1, math.ceil(num_examples / micro_batch_size))
  return 1 << (needed - 1).bit_length()


def share_rows(examples: Sequence[structs.Example],
               share_prompts: int = 1) -> list[list[structs.Example]]:
  """The examples grouped into rows of at most `share_prompts` responses.

  Examples with token-identical prompts share a row, in order of first
  appearance (a full row starts a new one); with `share_prompts` 1, or when
  any example has images, every example is its own row, in order.
  """
  if share_prompts < 1:
    raise ValueError(f'share_prompts={share_prompts}; expected >= 1')
  if share_prompts == 1 or any(e.images is not None for e in examples):
    return [[e] for e in examples]
  rows, open_rows = [], {}
  for example in examples:
    key = tuple(example.prompt_tokens)
    row = open_rows.get(key)
    if row is None or len(row) == share_prompts:
      row = open_rows[key] = []
      rows.append(row)
    row.append(example)
  return rows


def slots(examples: Sequence[structs.Example],
          share_prompts: int = 1) -> list[structs.Example | None]:
  """The examples in the order of a packed batch's sequences (N axis,
  flattened over micro-batches); None where a row has fewer than K."""
  rows = share_rows(examples, share_prompts)
  k = max((len(row) for row in rows), default=1)
  return [row[i] if i < len(row) else None for row in rows for i in range(k)]


def pack(examples: Sequence[structs.Example], *, micro_batch_size: int,
         prompt_buckets: Sequence[int],
         response_buckets: Sequence[int],
         vision_config: vision.VisionConfig | None = None,
         share_prompts: int = 1) -> Batch:
  """Pads one step's examples into a Batch.

  Examples keep their order (`slots` gives it when prompts are shared, up to
  `share_prompts` responses per row). Padding uses token id 0; it is masked
  out of attention and the loss. Examples with images need the model's
  `vision_config`.
  """
  if not examples:
    raise ValueError('pack needs at least one example')
  rows = share_rows(examples, share_prompts)
  k = max(len(row) for row in rows)
  p = bucket(max(len(e.prompt_tokens) for e in examples), prompt_buckets)
  r = bucket(max(len(e.response_tokens) for e in examples), response_buckets)
  m = num_micro_batches(len(rows), micro_batch_size)
  n_rows = m * micro_batch_size
  tokens = np.zeros((n_rows, p + k * r), np.int32)
  mask = np.zeros((n_rows, p + k * r), bool)
  response_mask = np.zeros((n_rows * k, r), bool)
  advantages = np.zeros((n_rows * k,), np.float32)
  for i, row in enumerate(rows):
    n_p = len(row[0].prompt_tokens)
    tokens[i, p - n_p:p] = row[0].prompt_tokens
    mask[i, p - n_p:p] = True
    for j, example in enumerate(row):
      n_r, start = len(example.response_tokens), p + j * r
      tokens[i, start:start + n_r] = example.response_tokens
      mask[i, start:start + n_r] = True
      response_mask[i * k + j, :n_r] = True
      advantages[i * k + j] = example.advantage
  shape = lambda x: x.reshape((m, -1) + x.shape[1:])
  zeros = np.zeros((m, micro_batch_size * k, r), np.float32)
  batch = Batch(tokens_MxBxT=shape(tokens), mask_MxBxT=shape(mask),
                response_mask_MxBxR=shape(response_mask),
                advantages_MxB=shape(advantages), old_logp_MxBxR=zeros,
                ref_logp_MxBxR=zeros)
  if any(e.images is not None for e in examples):
    batch = _with_images(batch, examples, vision_config)
  return batch


def _with_images(batch: Batch, examples, config) -> Batch:
  """The batch with its rows' patches and multimodal positions."""
  if config is None:
    raise ValueError('examples with images need a model with a vision tower')
  m, b, _ = batch.tokens_MxBxT.shape
  rows = list(examples) + [None] * (m * b - len(examples))
  held = [e.images if e is not None else None for e in rows]
  grids = [() if i is None else vision.check_grids(config, i.grids)
           for i in held]
  length = vision.bucket_length(config, max(
      sum(t * h * w for t, h, w in g) for g in grids))
  positions, patches = [], []
  for i in range(m):
    mine = range(i * b, (i + 1) * b)
    pixels = [np.asarray(held[r].pixel_values, np.float32) for r in mine
              if held[r] is not None]
    flat = tuple(g for r in mine for g in grids[r])
    positions.append(vision.multimodal_positions(
        batch.tokens_MxBxT[i], batch.mask_MxBxT[i], flat, config)[0])
    patches.append(vision.patches(
        config, np.concatenate(pixels) if pixels else
        np.zeros((0, config.patch_dim), np.float32), flat,
        [len(grids[r]) for r in mine], length))
  return batch.replace(positions_MxBxTx3=np.stack(positions),
                       patches=jax.tree.map(lambda *a: np.stack(a), *patches))
