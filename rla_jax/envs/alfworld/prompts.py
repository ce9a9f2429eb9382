"""ALFWorld prompts and answer parsing, as the authors wrote them (3.3, 3.4).

The policy prompt (system turn, guide, the history of observations and
actions, the 0-based numbered admissible actions), the authors' action
parsing (last \\boxed{}, its first integer, clamped; none -> candidate 0),
the step judge's instructions, and a word-level tokenizer for random models.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import re

from rla_jax import boxed
from rla_jax import structs
from rla_jax.envs import word_tokenizer
from rla_jax.envs.alfworld import games
from rla_jax.envs.alfworld import rewrite as rewriting

SYSTEM = 'You are a helpful assistant.'
GUIDE = (
    'You are playing a text game. Your objective is to complete the task as '
    'soon as possible.\n'
    'Below is your trajectory so far and current candidate actions.\n'
    'You need to think step by step then put the integer (the index of your '
    'chosen action) in \\boxed{}.\n')
CHOOSE = 'You need to think step by step then choose one action by number:'
JUDGE = (
    "You are a judge for an agent acting in a text-based environment.\n"
    "Evaluate ONE step using:\n"
    " - the agent's prompt (observation + candidate actions),\n"
    " - its response (reasoning + chosen index), and\n"
    " - the environment's next observation after executing that action.\n"
    "Scoring (binary):\n"
    "\u2022 Score 1 if ALL are true:\n"
    "  (a) The selected action is appropriate for the current observation "
    "and task goal (it reasonably explores, progresses or completes the "
    "task);\n"
    "  (b) The reasoning is present, relevant, and not self-contradictory "
    "(no hallucinated objects/locations);\n"
    "  (c) The chosen index exists in the candidate list, and the resulting "
    "next observation is consistent with the described action.\n"
    "\u2022 Otherwise score -1. Cases include: no reasoning provided; index "
    "out of range; clearly irrelevant; undoes progress; "
    "self-contradictory/hallucinated reasoning; or next observation "
    "contradicts the action.\n"
    "Important: think first then put the final score in \\boxed{}.\n\n")
# What an unparseable answer executes: the authors' first candidate, or an
# action the game does not know ("Nothing happens.").
ON_UNPARSEABLE = ('first', 'noop')
NOOP = '(no valid action chosen)'
OK, CLAMPED, MISSING = 'ok', 'clamped', 'missing'


def parse_index(text: str, num_commands: int) -> tuple[int, str]:
  """(index, status) of an answer, as the authors parse it (3.3).

  The last closed \\boxed{} (brace-balanced), its first integer, clamped
  into [0, num_commands - 1]; no box or no integer -> 0. status is OK,
  CLAMPED (the integer was out of range) or MISSING.
  """
  content = boxed.last_boxed(text)
  number = re.search(r'-?\d+', content) if content is not None else None
  if number is None:
    return 0, MISSING
  index = int(number.group())
  clamped = max(0, min(index, num_commands - 1))
  return clamped, OK if clamped == index else CLAMPED


def policy_content(prompt: str) -> tuple[str, list[str]]:
  """(the user turn, its candidate actions) inside a rendered policy prompt."""
  start = prompt.find(GUIDE.split('\n', 1)[0])
  if start < 0:
    return prompt, []
  marker = prompt.find(CHOOSE, start)
  if marker < 0:
    return prompt[start:], []
  end = marker + len(CHOOSE)
  commands = []
  for line in prompt[end + 1:].split('\n'):
    number, paren, command = line.partition(') ')
    if not paren or number != str(len(commands)):
      break
    commands.append(command)
    end += 1 + len(line)
  return prompt[start:end], commands


def options(commands: Sequence[str]) -> str:
  """The authors' numbered candidate list (0-based; 'look' if none)."""
  listed = '\n'.join(f'{k}) {c}' for k, c in enumerate(commands or ['look']))
  return f'{CHOOSE}\n{listed}\n'


def make_tokenizer(stage_texts: Sequence[str] = ()):
  """A word-level tokenizer over ALFWorld's words, for random models.

  Words of the grammar, the object types, the prompts and `stage_texts`
  (what the stages add to prompts: runtime.setup hands in the curator's
  critique template), with or without a leading space, are one token each
  (prompts are ~4x shorter than character by character); any other word is
  <unk>, other characters are single tokens.
  """
  import string  # pylint: disable=g-import-not-at-top
  constants, _ = games.alfworld_modules()
  with open(games.package_file('data', 'alfred.twl2')) as f:
    texts = [f.read(), SYSTEM, GUIDE, CHOOSE, JUDGE, *stage_texts,
             json.dumps(rewriting.EXPLAIN), json.dumps(rewriting.FRAMEWORK),
             rewriting.prompt('', games.TASK_TYPES[0], structs.HARDER, 0.5,
                              ['x'], ('A', 'B'))]
  types = list(constants.OBJECTS) + list(games.LAMPS)
  words = set(re.findall(r'[A-Za-z]+', ' '.join(texts)))
  words |= {w for t in types for w in (t, t.lower(), t + 'Type')}
  chars = [c for c in string.printable if c not in '\x0b\x0c\r']
  words = sorted(words)
  return word_tokenizer.make_tokenizer(
      chars + words + [' ' + w for w in words], split=r' ?[A-Za-z]+|.|\n')
