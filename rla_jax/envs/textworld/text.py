"""TextWorld's text as the agents see it: observations, action choice, knobs.

Pure functions (no textworld import): the observation a policy reads (text,
then the numbered admissible actions), the action an answer picks, and the
generation knobs a rewrite proposes.
"""

from __future__ import annotations

from collections.abc import Sequence
import re

_ACTIONS_HEADER = 'Admissible actions:'
_BOXED = re.compile(r'\\boxed\{([^{}]*)(?:\}|$)')
_NUMBERED = re.compile(r'^(\d+)\. (.+)$')
# A sentence that mentions TextWorld itself (with the space before it).
_SELF_MENTION = re.compile(r'[^.!?\n]*\bTextWorld\b[^.!?\n]*[.!?]+')
_TRIPLE = re.compile(
    r'(?<![\d,])(?<!\d, )(\d+) ?, ?(\d+) ?, ?(\d+)(?! ?, ?\d)(?!\d)')


def clean_text(text: str) -> str:
  """Drops the banner's status line, the input prompt and the restart menu.

  Also drops TextWorld's self-referential filler sentences ("Welcome to
  TextWorld!", "Wow, isn't TextWorld just the best?"): they name no object
  or exit and cost every prompt tokens.
  """
  text = text.split('Would you like to RESTART')[0]
  lines = [_SELF_MENTION.sub('', l).strip() for l in text.split('\n')
           if not l.startswith('>')]
  text = '\n'.join(lines)
  return re.sub(r'\n{3,}', '\n\n', text).strip()


def render_observation(text: str, commands: Sequence[str]) -> str:
  """An observation as the policy sees it: text, then the numbered actions."""
  if not commands:
    return text
  listed = '\n'.join(f'{i}. {c}' for i, c in enumerate(commands, 1))
  return f'{text}\n\n{_ACTIONS_HEADER}\n{listed}'


def split_observation(observation: str) -> tuple[str, list[str]]:
  """Inverse of render_observation: (text, admissible commands)."""
  text, sep, rest = observation.rpartition(f'\n\n{_ACTIONS_HEADER}\n')
  if not sep:
    return observation, []
  commands = []
  for line in rest.split('\n'):
    match = _NUMBERED.match(line.strip())
    if not match or int(match.group(1)) != len(commands) + 1:
      break
    commands.append(match.group(2).strip())
  return text, commands


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (an unclosed one at the end counts)."""
  found = _BOXED.findall(text)
  return found[-1] if found else None


def _normalize(text: str) -> str:
  return ' '.join(text.strip().strip('"\'.!').lower().split())


def choose(text: str, commands: Sequence[str]) -> tuple[str, bool]:
  """The command `text` picks and whether it was understood.

  Order: the last \\boxed{} holding exactly a command's text; else its first
  integer as a 1-based index; else the admissible command whose text occurs
  last in `text` (the longer one on a tie); else the first command with
  ok=False. An index out of range is not understood (the authors clamp it).
  """
  if not commands:
    return 'look', False
  boxed = last_boxed(text)
  if boxed is not None:
    exact = [c for c in commands if _normalize(c) == _normalize(boxed)]
    if exact:
      return exact[0], True
    number = re.search(r'\d+', boxed)
    if number and 1 <= int(number.group()) <= len(commands):
      return commands[int(number.group()) - 1], True
  best, best_rank = None, None
  for command in commands:
    pattern = r'(?<!\w)' + re.escape(command) + r'(?!\w)'
    starts = [m.start() for m in re.finditer(pattern, text, re.IGNORECASE)]
    if starts and (best_rank is None or (starts[-1], len(command)) > best_rank):
      best, best_rank = command, (starts[-1], len(command))
  if best is not None:
    return best, True
  return commands[0], False


def parse_knobs(text: str) -> tuple[int, int, int] | None:
  """(rooms, objects, quest_length) from the last \\boxed{}.

  The box must hold exactly three integers. Without a box, the last bare
  'a, b, c' triple (not part of a longer list) is used: small models often
  drop the box.
  """
  boxed = last_boxed(text)
  if boxed is None:
    triples = _TRIPLE.findall(text)
    return tuple(int(n) for n in triples[-1]) if triples else None
  numbers = re.findall(r'-?\d+', boxed)
  if len(numbers) != 3:
    return None
  return tuple(int(n) for n in numbers)


def strip_chat_markup(text: str) -> str:
  """Turns ChatML markers into plain labels, so they do not open turns."""
  text = re.sub(r'<\|im_start\|>(\w+)\n?', r'[\1]\n', text)
  return text.replace('<|im_end|>', '').strip()
