"""Chat messages -> prompt token ids -> sampled completions as text.

The one place where text meets the sampler: policy turns, RM judgments,
critiques and rewrite proposals all go through `complete`. Over-long prompts
are shortened by `truncation.encode` (they lose their history, not their
head) and every cut is reported in `Completion.prompt_cut`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rla_jax import metrics
from rla_jax import sampler
from rla_jax import truncation


@dataclasses.dataclass
class Completion:
  prompt: str  # rendered prompt text as seen, answer prefix and cut marks
               # included (`truncation.plain(prompt)` for display)
  prompt_tokens: list[int]  # exactly what the sampler saw
  text: str  # generated text (after the prefix)
  tokens: list[int]
  logprobs: list[float]
  finish_reason: str
  prompt_cut: bool = False  # the prompt was over max_prompt_len and shortened


def render(tokenizer, messages: Sequence[dict[str, str]]) -> str:
  """Chat template text; a trailing assistant message becomes an answer prefix."""
  messages = list(messages)
  prefix = ''
  if messages and messages[-1]['role'] == 'assistant':
    prefix = messages.pop()['content']
  if getattr(tokenizer, 'chat_template', None):
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=True)
  else:
    text = ''.join(f'{m["role"]}: {m["content"]}\n' for m in messages)
    text += 'assistant: '
  return text + prefix


def stop_token_ids(tokenizer) -> tuple[int, ...]:
  ids = {tokenizer.eos_token_id}
  for token in ('<|im_end|>', '<|endoftext|>', '<|eot_id|>'):
    tid = tokenizer.convert_tokens_to_ids(token)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id:
      ids.add(tid)
  return tuple(sorted(i for i in ids if i is not None))


def complete(model, tokenizer, messages_batch: Sequence[Sequence[dict]], *,
             sampling, num_samples: int, seed: int, mesh=None,
             rules=None) -> list[list[Completion]]:
  """`num_samples` completions for each conversation (prompt-major lists).

  `sampling` is a config section: temperature, top_p, top_k, max_new_tokens,
  max_prompt_len, stop_strings, allowed_tokens (constrained decoding),
  prompt_buckets, batch_buckets, max_rows (rows per sampler call; larger
  batches are split).
  """
  encoded = [truncation.encode(tokenizer, render(tokenizer, m),
                               sampling.max_prompt_len)
             for m in messages_batch]
  prompt_ids = [ids for ids, _, _ in encoded]
  prompts = [text for _, _, text in encoded]
  allowed = [tokenizer.convert_tokens_to_ids(t) for t in sampling.allowed_tokens]
  if any(a is None or a == tokenizer.unk_token_id for a in allowed):
    raise ValueError(f'allowed_tokens={tuple(sampling.allowed_tokens)}: each '
                     'must be one token of the tokenizer')
  stop_ids = stop_token_ids(tokenizer)
  per_call = max(1, sampling.max_rows // num_samples)
  kwargs = {} if rules is None else {'rules': rules}
  results = []
  for start in metrics.progress(range(0, len(prompts), per_call),
                                desc=f'sampling {len(prompts)} prompts'):
    chunk = prompt_ids[start:start + per_call]
    out = sampler.generate(
        model, chunk, sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, stop_token_ids=stop_ids,
        allowed_token_ids=tuple(allowed),
        seed=(seed * 100_003 + start) % 2**32, num_samples=num_samples,
        stop_strings=tuple(sampling.stop_strings), tokenizer=tokenizer,
        prompt_buckets=tuple(sampling.prompt_buckets),
        batch_buckets=tuple(sampling.batch_buckets), mesh=mesh, **kwargs)
    for i, ids in enumerate(chunk):
      row = []
      for j in range(num_samples):
        k = i * num_samples + j
        tokens = list(out.tokens[k])
        row.append(Completion(
            prompt=prompts[start + i], prompt_tokens=list(ids),
            text=tokenizer.decode(tokens, skip_special_tokens=True),
            tokens=tokens, logprobs=list(out.logprobs[k]),
            finish_reason=out.finish_reason[k],
            prompt_cut=encoded[start + i][1]))
      results.append(row)
  return results
