"""The \\boxed{} answer convention shared by actions, scores and critiques."""

_BOX = '\\boxed{'


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` in `text`, braces balanced.

  Nested braces inside the box are kept. Returns None when there is no box or
  the last one is never closed.
  """
  start = text.rfind(_BOX)
  if start < 0:
    return None
  depth = 1
  begin = start + len(_BOX)
  for i in range(begin, len(text)):
    if text[i] == '{':
      depth += 1
    elif text[i] == '}':
      depth -= 1
      if depth == 0:
        return text[begin:i]
  return None
