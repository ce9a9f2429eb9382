"""Chat messages -> prompt token ids -> sampled completions as text.

The one place where text meets the sampler: policy turns, RM judgments,
critiques and rewrite proposals all go through `complete`. Over-long prompts
are shortened by `truncation.encode` (they lose their history, not their
head) and every cut is reported in `Completion.prompt_cut`.

Multi-turn rollouts pass `Turn`s. By default (sampling.session='none') a
turn's messages are rendered and prefilled whole, history included, as the
authors do. With 'kv' each conversation stays in the sampler's KV cache
across turns as a chat (system, user, assistant, user, ...): a turn only
appends the end of the last answer's assistant turn and the new user turn
(`turn_delta`), and its `prompt_tokens` are the whole conversation the
model conditioned on, so training sees exactly that context.

A message's content may be a list of parts, transformers' multimodal format:
{'type': 'text', 'text': ...} and {'type': 'image', 'image': PIL image or
array}. Images need a vision-language model, whose loader returns a
`hf_vision.Processor` to pass as the tokenizer; each image part becomes that
model's image tokens, and every Completion carries its prompt's `Images` so
the train steps see the same pixels. A prompt with images is never cut (its
image tokens would lose their image): an over-long one is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rla_jax import metrics
from rla_jax import sampler
from rla_jax import structs
from rla_jax import truncation
from rla_jax.models import hf_vision

SESSIONS = ('none', 'kv')
_SENTINEL = '\x07\x07'  # stands for an answer while rendering what follows it


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
  images: structs.Images | None = None  # of the image tokens in prompt_tokens
  # In a KV session, `prompt` is the turn in the environment's own prompt
  # format (what the RM judges and logs show) and `prompt_tokens` is the
  # conversation held in the cache.


@dataclasses.dataclass
class ChatState:
  """The conversations of one multi-turn rollout (sampling.session='kv').

  Rows are the rollout's conversation indices; rows r of one chunk
  (r // sampling.max_rows) share a sampler session.
  """

  messages: dict[int, list[dict[str, str]]] = dataclasses.field(
      default_factory=dict)  # row -> the chat so far, answers included
  stop_text: dict[int, str] = dataclasses.field(
      default_factory=dict)  # row -> text of the stop token ending its answer
  sessions: dict[int, Any] = dataclasses.field(
      default_factory=dict)  # chunk -> (rows in session order, Session)
  restarts: int = 0  # fresh prefills after the first (a row outgrew the cap)
  images: dict[int, list[structs.Images]] = dataclasses.field(
      default_factory=dict)  # row -> images held in its session, in order


class Turn(list):
  """A policy turn's messages in the environment's own format, continuable.

  As a list it is what `complete` renders by default. With
  sampling.session='kv', `complete` continues conversation `row` of `state`
  with `chat()`: the messages this turn adds to the chat (the environment's
  `turn_messages`; a final 'assistant' message is an answer prefix).
  """

  def __init__(self, messages: Sequence[dict[str, str]], *, state: ChatState,
               row: int, chat: Callable[[], list[dict[str, str]]]):
    super().__init__(messages)
    self.state, self.row, self.chat = state, row, chat


def _prefix(messages: Sequence[dict[str, str]]):
  """(messages without a trailing assistant message, that answer prefix)."""
  messages = list(messages)
  if messages and messages[-1]['role'] == 'assistant':
    return messages[:-1], messages[-1]['content']
  return messages, ''


def _flat(message: dict) -> dict:
  """The message with list content as text (image parts as placeholders)."""
  content = message['content']
  if isinstance(content, str):
    return message
  text = ''.join(hf_vision.IMAGE_TEXT if part['type'] == 'image'
                 else part['text'] for part in content)
  return dict(message, content=text)


def images_of(messages: Sequence[dict]) -> list:
  """The image parts of the messages, in order."""
  return [part['image'] for m in messages if not isinstance(m['content'], str)
          for part in m['content'] if part['type'] == 'image']


def join_images(images: Sequence[structs.Images | None]):
  """One Images of several (in order), or None when there are none."""
  images = [i for i in images if i is not None]
  if not images:
    return None
  return structs.Images(
      np.concatenate([np.asarray(i.pixel_values) for i in images]),
      np.concatenate([np.asarray(i.grids).reshape(-1, 3) for i in images]))


def _split_processor(tokenizer):
  """(tokenizer, processor or None): a Processor stands for both."""
  if isinstance(tokenizer, hf_vision.Processor):
    return tokenizer.tokenizer, tokenizer
  return tokenizer, None


def _encode_images(processor, text: str, images, max_len: int):
  """(ids, Images or None) of a prompt with image parts, never cut."""
  if processor is None:
    raise ValueError('messages carry images; the model needs a vision '
                     'processor (load a Qwen3-VL folder)')
  ids, held = processor.encode(truncation.plain(text), images)
  if len(ids) > max_len:
    raise ValueError(f'a prompt with {len(images)} images is {len(ids)} '
                     f'tokens, over sampling.max_prompt_len={max_len}; '
                     'prompts with images are not cut (keep fewer images or '
                     'raise the limit)')
  return ids, held


def _template(tokenizer, messages, generation_prompt: bool) -> str:
  messages = [_flat(m) for m in messages]
  if getattr(tokenizer, 'chat_template', None):
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False,
        add_generation_prompt=generation_prompt)
  text = ''.join(f'{m["role"]}: {m["content"]}\n' for m in messages)
  return text + ('assistant: ' if generation_prompt else '')


def render(tokenizer, messages: Sequence[dict[str, str]]) -> str:
  """Chat template text; a trailing assistant message is an answer prefix."""
  messages, prefix = _prefix(messages)
  return _template(tokenizer, messages, True) + prefix


def turn_delta(tokenizer, chat: Sequence[dict[str, str]],
               new: Sequence[dict[str, str]], stop_text: str = '') -> str:
  """Text that continues a held conversation with the messages `new`.

  `chat` ends with the assistant turn just sampled: the delta closes it as
  the template does (minus `stop_text`, the stop token the answer already
  ended with), then renders `new` and the generation prompt (and `new`'s
  answer prefix). Needs an append-only chat template.
  """
  new, prefix = _prefix(new)
  head = list(chat[:-1]) + [dict(chat[-1], content=_SENTINEL)]
  closed = _template(tokenizer, head, False)
  both = _template(tokenizer, head + new, True)
  if _SENTINEL not in closed or not both.startswith(closed):
    raise ValueError('sampling.session=\'kv\' needs an append-only chat '
                     'template (rendering a longer chat must extend the text)')
  closing = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]
  if stop_text and closing.startswith(stop_text):
    closing = closing[len(stop_text):]
  return closing + both[len(closed):] + prefix


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
  batches are split), session ('kv': `Turn`s continue their conversation in
  the KV cache, see the module docstring), cache_bucket.
  """
  if sampling.session not in SESSIONS:
    raise ValueError(f'sampling.session={sampling.session!r}: one of '
                     f'{SESSIONS}')
  tokenizer, processor = _split_processor(tokenizer)
  if (sampling.session == 'kv' and messages_batch
      and all(isinstance(m, Turn) for m in messages_batch)):
    return _continue(model, tokenizer, processor, messages_batch,
                     sampling=sampling, num_samples=num_samples, seed=seed,
                     mesh=mesh, rules=rules)
  encoded, held = [], []
  for m in messages_batch:
    text, images = render(tokenizer, m), images_of(m)
    if images:
      ids, row_images = _encode_images(processor, text, images,
                                       sampling.max_prompt_len)
      encoded.append((ids, False, text))
      held.append(row_images)
    else:
      encoded.append(truncation.encode(tokenizer, text,
                                       sampling.max_prompt_len))
      held.append(None)
  copies = _runs_of_equal(encoded) if not any(held) else 1
  if copies > 1:  # e.g. a rollout's first turn: G rows of each task
    rows = _complete_encoded(model, tokenizer, encoded[::copies],
                             held[::copies], sampling, num_samples * copies,
                             seed, mesh, rules)
    return [row[j * num_samples:(j + 1) * num_samples]
            for row in rows for j in range(copies)]
  return _complete_encoded(model, tokenizer, encoded, held, sampling,
                           num_samples, seed, mesh, rules)


def _runs_of_equal(encoded) -> int:
  """k > 1 when the prompts come in consecutive runs of k identical ones.

  Those are sampled as k samples of one prompt, sharing its prefill.
  """
  ids = [tuple(i) for i, _, _ in encoded]
  k = 1
  while k < len(ids) and ids[k] == ids[0]:
    k += 1
  if k == 1 or len(ids) % k:
    return 1
  same = all(ids[i] == ids[i - i % k] for i in range(len(ids)))
  return k if same else 1


def _complete_encoded(model, tokenizer, encoded, held, sampling,
                      num_samples: int, seed: int, mesh,
                      rules) -> list[list[Completion]]:
  """`complete` for encoded prompts: (ids, cut, text) and their images."""
  prompt_ids = [ids for ids, _, _ in encoded]
  prompts = [text for _, _, text in encoded]
  per_call = max(1, sampling.max_rows // num_samples)
  results = []
  for start in metrics.progress(range(0, len(prompts), per_call),
                                desc=f'sampling {len(prompts)} prompts'):
    chunk = prompt_ids[start:start + per_call]
    out = _sample(model, tokenizer, chunk, sampling, num_samples,
                  (seed * 100_003 + start) % 2**32, mesh, rules,
                  images=join_images(held[start:start + per_call]))
    for i, ids in enumerate(chunk):
      row = []
      for j in range(num_samples):
        k = i * num_samples + j
        row.append(_completion(tokenizer, out, k, prompts[start + i], ids,
                               encoded[start + i][1], held[start + i]))
      results.append(row)
  return results


def _sample(model, tokenizer, prompts, sampling, num_samples, seed, mesh,
            rules, images=None, **session):
  """One sampler.generate call with the options of a sampling section."""
  allowed = [tokenizer.convert_tokens_to_ids(t)
             for t in sampling.allowed_tokens]
  if any(a is None or a == tokenizer.unk_token_id for a in allowed):
    raise ValueError(f'allowed_tokens={tuple(sampling.allowed_tokens)}: each '
                     'must be one token of the tokenizer')
  kwargs = {} if rules is None else {'rules': rules}
  if images is not None:
    kwargs['images'] = (images.pixel_values, images.grids)
  return sampler.generate(
      model, prompts, sampling.max_new_tokens,
      temperature=sampling.temperature, top_p=sampling.top_p,
      top_k=sampling.top_k, stop_token_ids=stop_token_ids(tokenizer),
      allowed_token_ids=tuple(allowed), seed=seed, num_samples=num_samples,
      stop_strings=tuple(sampling.stop_strings), tokenizer=tokenizer,
      prompt_buckets=tuple(sampling.prompt_buckets),
      batch_buckets=tuple(sampling.batch_buckets),
      unroll_decode_from=sampling.unroll_decode_from, mesh=mesh, **session,
      **kwargs)


def _completion(tokenizer, out, k, prompt, prompt_ids, cut,
                images=None) -> Completion:
  tokens = list(out.tokens[k])
  return Completion(
      prompt=prompt, prompt_tokens=list(prompt_ids),
      text=tokenizer.decode(tokens, skip_special_tokens=True), tokens=tokens,
      logprobs=list(out.logprobs[k]), finish_reason=out.finish_reason[k],
      prompt_cut=cut, images=images)


def _continue(model, tokenizer, processor, turns: Sequence[Turn], *,
              sampling, num_samples: int, seed: int, mesh,
              rules) -> list[list[Completion]]:
  """`complete` for Turns in KV sessions (one completion per turn)."""
  if num_samples != 1:
    raise ValueError('sampling.session=\'kv\' samples one answer per turn')
  state = turns[0].state
  if any(t.state is not state for t in turns):
    raise ValueError('the Turns of one call must share one ChatState')
  per_call = max(1, sampling.max_rows)
  chunks: dict[int, list[Turn]] = {}
  for t in turns:
    chunks.setdefault(t.row // per_call, []).append(t)
  done = {}
  for chunk, members in sorted(chunks.items()):
    new = {t.row: t.chat() for t in members}
    held = state.sessions.get(chunk)
    deltas = None if held is None else _deltas(
        tokenizer, processor, state, held, new, sampling.max_prompt_len)
    if deltas is None:  # a fresh prefill: first turn, or a row outgrew the cap
      state.restarts += held is not None
      rows = sorted(new)
      prompts, cuts = zip(*(_fresh(tokenizer, processor, state, r, new[r],
                                   sampling.max_prompt_len) for r in rows))
      out = _sample(model, tokenizer, list(prompts), sampling, 1,
                    (seed * 100_003 + chunk) % 2**32, mesh, rules,
                    images=join_images(join_images(state.images[r])
                                       for r in rows),
                    keep_session=True, cache_bucket=sampling.cache_bucket)
    else:
      rows, session = held
      prompts = [deltas[r][0] if r in deltas else None for r in rows]
      cuts = [False] * len(rows)
      before = [list(c) for c in session.conversations]
      for r in rows:
        if r in deltas and deltas[r][1] is not None:
          state.images[r].append(deltas[r][1])
      out = _sample(model, tokenizer, prompts, sampling, 1,
                    (seed * 100_003 + chunk) % 2**32, mesh, rules,
                    images=join_images(deltas[r][1] for r in rows
                                       if r in deltas),
                    session=session, keep_session=True,
                    cache_bucket=sampling.cache_bucket)
      prompts = [None if d is None else b + d for b, d in zip(before, prompts)]
    state.sessions[chunk] = (list(rows), out.session)
    for k, r in enumerate(rows):
      if r not in new:
        continue
      completion = _completion(tokenizer, out, k, '', prompts[k], cuts[k],
                               join_images(state.images[r]))
      _, prefix = _prefix(new[r])
      state.messages[r] = (_chat_only(new[r]) if r not in state.messages
                           else state.messages[r] + _chat_only(new[r]))
      state.messages[r].append({'role': 'assistant',
                                'content': prefix + completion.text})
      last = completion.tokens[-1:] if (
          completion.finish_reason == sampler.STOP_TOKEN) else []
      state.stop_text[r] = tokenizer.decode(last, skip_special_tokens=False)
      done[r] = completion
  results = []
  for t in turns:
    completion = done[t.row]
    # What the RM judges: this turn in the environment's own format.
    _, _, completion.prompt = truncation.encode(
        tokenizer, render(tokenizer, t), sampling.max_prompt_len)
    results.append([completion])
  return results


def _chat_only(messages):
  return _prefix(messages)[0]


def _deltas(tokenizer, processor, state, held, new, max_len):
  """Row -> (tokens continuing its conversation, their Images or None), or
  None when one would outgrow max_len (the chunk then starts a fresh
  session)."""
  rows, session = held
  deltas = {}
  for k, r in enumerate(rows):
    if r not in new:
      continue
    text = turn_delta(tokenizer, state.messages[r], new[r], state.stop_text[r])
    images = images_of(new[r])
    if images:
      ids, row_images = _encode_images(processor, text, images, max_len)
    else:
      ids = tokenizer(text, add_special_tokens=False)['input_ids']
      row_images = None
    if len(session.conversations[k]) + len(ids) > max_len:
      return None
    deltas[r] = (ids, row_images)
  if any(r not in rows for r in new):
    raise ValueError(f'rows {sorted(set(new) - set(rows))} are not in the '
                     'session of their chunk')
  return deltas


def _fresh(tokenizer, processor, state, row, new,
           max_len) -> tuple[list[int], bool]:
  """(prompt tokens of a whole conversation, whether turns were dropped).

  An over-long chat loses its oldest exchanges after the first (which holds
  the instructions and the task); if that is not enough, the middle of the
  text (truncation.encode; a chat with images is not cut, see `complete`).
  The images of what is kept go to `state.images[row]`.
  """
  chat = list(state.messages.get(row, []))
  tail, prefix = _prefix(new)
  dropped = False
  while True:
    text = _template(tokenizer, chat + tail, True) + prefix
    images = images_of(chat + tail)
    if images:
      ids, held = processor.encode(text, images) if processor else (
          _encode_images(None, text, images, max_len))
    else:
      ids, held = tokenizer(text, add_special_tokens=False)['input_ids'], None
    first_answer = next((i for i, m in enumerate(chat)
                         if m['role'] == 'assistant'), None)
    if len(ids) <= max_len or first_answer is None or (
        len(chat) < first_answer + 3):
      break
    del chat[first_answer + 1:first_answer + 3]  # the oldest user + answer
    dropped = True
  state.messages[row] = chat
  state.images[row] = [] if held is None else [held]
  if len(ids) > max_len and held is not None:
    _encode_images(processor, text, images, max_len)  # raises
  if len(ids) > max_len:
    ids, _, _ = truncation.encode(
        tokenizer, _template(tokenizer, chat + tail, True) + prefix, max_len)
    dropped = True
  return ids, dropped
