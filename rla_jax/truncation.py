"""Over-long prompts lose their middle, not their head.

Environments wrap the part of a prompt that may be shortened (the history)
with `cuttable(...)`; `encode` drops the oldest tokens of those parts first,
so the instructions at the start and the latest turn and answer prefix at
the end stay whole. A prompt without cuttable parts (or whose fixed parts
alone are too long) keeps its first and last halves. No JAX here: the
curator builds prompts with it.
"""

from __future__ import annotations

# Marks around a cuttable span; control characters no tokenizer is fed.
CUT_BEGIN, CUT_END = '\x02', '\x03'
CUT_NOTICE = '[...] '  # stands where tokens were dropped


def cuttable(text: str) -> str:
  """Marks `text` as the part of a prompt that may lose tokens when too long."""
  return f'{CUT_BEGIN}{text}{CUT_END}' if text else ''


def plain(text: str) -> str:
  """`text` without cut marks."""
  return text.replace(CUT_BEGIN, '').replace(CUT_END, '')


def _segments(text: str) -> list[tuple[str, bool]]:
  """(text, cuttable) pieces of a marked prompt, in order."""
  out = []
  for i, piece in enumerate(text.split(CUT_BEGIN)):
    fixed_or_cut = piece.split(CUT_END, 1) if i else [None, piece]
    if len(fixed_or_cut) == 1:  # an unmatched begin mark: keep as fixed text
      fixed_or_cut = [None, fixed_or_cut[0]]
    cut, fixed = fixed_or_cut
    if cut:
      out.append((cut, True))
    if fixed:
      out.append((fixed.replace(CUT_END, ''), False))
  return out


def _ids(tokenizer, text: str) -> list[int]:
  return tokenizer(text, add_special_tokens=False)['input_ids']


def encode(tokenizer, text: str, max_len: int) -> tuple[list[int], bool, str]:
  """(token ids of at most `max_len`, whether it was cut, the text they say).

  `text` may hold `cuttable` spans; see the module docstring for what an
  over-long prompt loses. The returned text keeps the marks of what is left.
  """
  ids = _ids(tokenizer, plain(text))
  if len(ids) <= max_len:
    return ids, False, text
  notice = _ids(tokenizer, CUT_NOTICE)
  pieces = [(seg, cut, _ids(tokenizer, seg)) for seg, cut in _segments(text)]
  fixed = sum(len(t) for _, cut, t in pieces if not cut)
  budget = max_len - fixed - len(notice)
  if any(cut for _, cut, _ in pieces) and budget >= 0:
    # Drop the oldest cuttable tokens until the rest fits.
    excess = sum(len(t) for _, cut, t in pieces if cut) - budget
    out_ids, out_text, noted = [], [], False
    for seg, cut, tokens in pieces:
      if cut and excess > 0:
        drop = min(excess, len(tokens))
        excess -= drop
        tokens = tokens[drop:]
        seg = tokenizer.decode(tokens)
        if not noted:
          tokens, seg, noted = notice + tokens, CUT_NOTICE + seg, True
      out_ids += tokens
      out_text.append(cuttable(seg) if cut else seg)
    return out_ids, True, ''.join(out_text)
  # The fixed parts alone are too long: drop every cuttable span and keep the
  # first and last halves of the rest.
  ids = [t for _, cut, tokens in pieces if not cut for t in tokens]
  if len(ids) <= max_len:
    return ids, True, tokenizer.decode(ids)
  head = (max_len - len(notice)) // 2
  tail = max_len - len(notice) - head
  ids = ids[:head] + notice + ids[len(ids) - tail:]
  return ids, True, tokenizer.decode(ids)


