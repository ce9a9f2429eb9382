"""What the OSWorld GUI agent, its judge and the rewriter read and write.

The policy (RLANYTHING.md 4.2) acts through one `computer_use` tool call
per turn, with coordinates relative to the screen on a 0-999 grid; the
action becomes pyautogui code that the OSWorld controller executes. The RM
(4.3) sees the screenshot an action was taken on and the one after it. The
environment LLM (4.5) rewrites a task as a one-key JSON object: evaluator
name -> instruction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

GRID = 999  # relative coordinates run 0..GRID on both axes
MAX_WAIT_S = 5.0
MAX_SCROLL = 50  # wheel clicks of one scroll action
MAX_TYPE_CHARS = 500

ACTIONS = {  # action -> its required arguments
    'left_click': ('coordinate',), 'double_click': ('coordinate',),
    'triple_click': ('coordinate',), 'right_click': ('coordinate',),
    'middle_click': ('coordinate',), 'mouse_move': ('coordinate',),
    'left_click_drag': ('coordinate',), 'type': ('text',),
    'key': ('keys',), 'scroll': ('pixels',), 'wait': ('time',),
    'terminate': ('status',),
}

SYSTEM = '''You are a GUI agent operating a Linux desktop through one tool.

# Tool
computer_use: controls the mouse and keyboard. Coordinates are [x, y] \
relative to the screenshot: 0..999 from left to right and from top to \
bottom.
Arguments (JSON):
- "action", one of:
  * "left_click", "double_click", "triple_click", "right_click", \
"middle_click": click at "coordinate".
  * "mouse_move": move the pointer to "coordinate".
  * "left_click_drag": press the left button at the pointer and release it \
at "coordinate".
  * "type": type "text".
  * "key": press the "keys" together, e.g. ["ctrl", "s"] or ["enter"].
  * "scroll": scroll "pixels" wheel clicks (positive up, negative down).
  * "wait": wait "time" seconds.
  * "terminate": end the task with "status" "success" or "failure".
- "coordinate": [x, y]; "text": string; "keys": list of key names; \
"pixels": integer; "time": number; "status": string.

# Response format
Action: one sentence saying what you do next.
<tool_call>
{"name": "computer_use", "arguments": {"action": "left_click", \
"coordinate": [500, 300]}}
</tool_call>'''

INSTRUCTION = '''Instruction: {instruction}

Previous actions:
{history}

Look at the current screenshot and give the next action.'''

JUDGE_SYSTEM = ('You are an evaluator for the most recent step of a GUI agent '
                'working on a Linux desktop.')

JUDGE = '''Objective: {instruction}

Previous actions:
{history}

The screenshot the agent acted on:
{{before}}
The agent's most recent response:
{response}

The screenshot after that action was executed:
{{after}}
Score the step +1 if and only if it is relevant to the objective, \
executable, coherent with the next screenshot, and shows concrete progress \
(not a no-op). Score it -1 if it is irrelevant, impossible, has no visible \
effect, undoes progress, contradicts the next screenshot or hallucinates. \
Give your reason, then put the score in \\boxed{{}}.'''

REWRITE = '''You adapt a desktop task for a GUI agent in training. Its \
accuracy over its last rollouts was {acc:.2f}: make it {direction}.

Current task (evaluator -> instruction):
{current}

All evaluators of this task (evaluator -> canonical instruction):
{template}

What went wrong in failed rollouts:
{critiques}

Rules: keep the essential task. You may switch to another evaluator of the \
list above or keep the current one; never invent one. To make it easier, \
add hints (which app, which keys, where to click); to make it harder, \
remove hints. Keep the instruction under {max_chars} characters. Answer \
with ONLY a JSON object with exactly one key, the evaluator's name, whose \
value is the new instruction.'''

# The last block may lack its closing tag (generation stopped inside it).
_TOOL_CALL = re.compile(r'<tool_call>\s*(.*?)\s*(?:</tool_call>|$)', re.S)
_ACTION_LINE = re.compile(r'Action:\s*(.*)')


class ParseError(ValueError):
  """The response holds no valid computer_use call; says why."""


def _coordinate(value) -> tuple[int, int]:
  if (not isinstance(value, (list, tuple)) or len(value) != 2 or
      not all(isinstance(v, (int, float)) and not isinstance(v, bool)
              for v in value)):
    raise ParseError(f'coordinate {value!r} is not [x, y]')
  x, y = value
  if not (0 <= x <= GRID and 0 <= y <= GRID):
    raise ParseError(f'coordinate {value!r} is outside 0..{GRID}')
  return int(round(x)), int(round(y))


def parse_tool_call(response: str) -> tuple[str, dict[str, Any]]:
  """(the 'Action:' sentence, the validated arguments) of the last call."""
  calls = _TOOL_CALL.findall(response)
  if not calls:
    raise ParseError('no <tool_call>...</tool_call> block')
  call, error = None, None
  for closing in ('', '}', '}}'):  # an answer cut before its last braces
    try:
      call = json.loads(calls[-1] + closing)
      break
    except json.JSONDecodeError as e:
      error = error or e
  if call is None:
    raise ParseError(f'tool call is not JSON: {error}')
  if not isinstance(call, dict) or call.get('name') != 'computer_use':
    raise ParseError('tool call is not {"name": "computer_use", ...}')
  args = call.get('arguments')
  if not isinstance(args, dict):
    raise ParseError('tool call has no "arguments" object')
  action = args.get('action')
  if action not in ACTIONS:
    raise ParseError(f'unknown action {action!r}')
  missing = [k for k in ACTIONS[action] if k not in args]
  if missing:
    raise ParseError(f'{action} lacks {missing}')
  clean: dict[str, Any] = {'action': action}
  if 'coordinate' in ACTIONS[action]:
    clean['coordinate'] = list(_coordinate(args['coordinate']))
  if action == 'type':
    if not isinstance(args['text'], str) or not args['text']:
      raise ParseError('type needs a non-empty "text" string')
    clean['text'] = args['text'][:MAX_TYPE_CHARS]
  if action == 'key':
    keys = args['keys']
    if isinstance(keys, str):
      keys = [keys]
    if (not isinstance(keys, list) or not keys or
        not all(isinstance(k, str) and k.strip() for k in keys)):
      raise ParseError('key needs "keys", a list of key names')
    clean['keys'] = [k.strip().lower() for k in keys]
  if action == 'scroll':
    if not isinstance(args['pixels'], (int, float)):
      raise ParseError('scroll needs a number of "pixels"')
    clean['pixels'] = int(max(-MAX_SCROLL, min(MAX_SCROLL, args['pixels'])))
  if action == 'wait':
    if not isinstance(args['time'], (int, float)) or args['time'] < 0:
      raise ParseError('wait needs a "time" >= 0')
    clean['time'] = float(min(args['time'], MAX_WAIT_S))
  if action == 'terminate':
    if args['status'] not in ('success', 'failure'):
      raise ParseError('terminate needs "status" "success" or "failure"')
    clean['status'] = args['status']
  lines = _ACTION_LINE.findall(response[:response.rfind('<tool_call>')])
  return (lines[-1].strip() if lines else ''), clean


def canonical(sentence: str, args: dict[str, Any]) -> str:
  """The action as the episode executes it and later prompts show it."""
  call = json.dumps({'name': 'computer_use', 'arguments': args})
  return f'Action: {sentence}\n<tool_call>\n{call}\n</tool_call>'


def arguments(action: str) -> dict[str, Any]:
  """The arguments of a canonical action (parse_tool_call's, validated)."""
  return parse_tool_call(action)[1]


def pyautogui_code(args: dict[str, Any], width: int, height: int) -> str:
  """pyautogui code of one action on a width x height screen ('' = none)."""
  def xy():
    x, y = args['coordinate']
    return (round(x * (width - 1) / GRID), round(y * (height - 1) / GRID))
  action = args['action']
  if action in ('left_click', 'right_click', 'middle_click'):
    button = action.split('_')[0]
    return 'pyautogui.click(%d, %d, button=%r)' % (*xy(), button)
  if action == 'double_click':
    return 'pyautogui.doubleClick(%d, %d)' % xy()
  if action == 'triple_click':
    return 'pyautogui.click(%d, %d, clicks=3, interval=0.05)' % xy()
  if action == 'mouse_move':
    return 'pyautogui.moveTo(%d, %d)' % xy()
  if action == 'left_click_drag':
    return 'pyautogui.dragTo(%d, %d, duration=0.3, button="left")' % xy()
  if action == 'type':
    lines = args['text'].split('\n')
    return '; pyautogui.press("enter"); '.join(
        f'pyautogui.write({line!r}, interval=0.01)' for line in lines)
  if action == 'key':
    keys = ', '.join(repr(k) for k in args['keys'])
    return f'pyautogui.hotkey({keys})'
  if action == 'scroll':
    return f'pyautogui.scroll({args["pixels"]})'
  if action == 'wait':
    return f'time.sleep({args["time"]})'
  return ''  # terminate


def _compact(action: str) -> str:
  """'<sentence> <arguments JSON>' of a canonical action (else as is)."""
  try:
    sentence, args = parse_tool_call(action)
  except ParseError:
    return action  # an invalid action's note
  return f'{sentence} {json.dumps(args)}'.strip()


def history(actions: Sequence[str]) -> str:
  """'Step k: <sentence> <arguments>' lines of the earlier actions.

  Compact (about 30 tokens a step), so 30 steps and three 1920x1080
  screenshots (3 x 2,040 image tokens) fit an 8,192-token prompt.
  """
  if not actions:
    return '(none)'
  return '\n'.join(f'Step {k}: {_compact(a)}'
                   for k, a in enumerate(actions, start=1))


def clip_middle(text: str, max_chars: int) -> str:
  """`text` without its middle past max_chars (0: whole): a long thought's
  start and its action at the end stay."""
  if not max_chars or len(text) <= max_chars:
    return text
  half = max_chars // 2
  return f'{text[:half]}\n[... {len(text) - 2 * half} characters ...]\n' + (
      text[-half:])


def parse_rewrite(text: str, template: dict[str, str],
                  max_chars: int) -> tuple[str, str] | None:
  """(evaluator, instruction) from the last JSON object, None if invalid."""
  for match in reversed(list(re.finditer(r'\{[^{}]*\}', text))):
    try:
      obj = json.loads(match.group(0))
    except json.JSONDecodeError:
      continue
    if not isinstance(obj, dict) or len(obj) != 1:
      return None
    (key, instruction), = obj.items()
    if (key in template and isinstance(instruction, str) and
        instruction.strip() and len(instruction) <= max_chars):
      return key, instruction.strip()
    return None
  return None
