"""Task evaluators of the local OSWorld tasks: desktop state -> pass / fail.

An evaluator is a JSON object {"func": name, ...}. It reads the desktop
through the OSWorld controller (files, command output, the accessibility
tree), like OSWorld's getters and metrics read a VM:

  file_text       {"path", "text", "match": "exact" | "contains"}: the file's
                  text (trailing whitespace ignored) equals / contains text
  file_exists     {"path", "exists": true | false}
  command_output  {"command", "text", "match"}: a shell command's stdout (a
                  command that cannot run or times out is a desktop error)
  a11y_text       {"text"}: the accessibility tree shows this text
  all             {"items": [evaluators]}: every item passes

`check` validates one at task-load time, so a typo in a task file fails
with the file and key named, not mid-run.
"""

from __future__ import annotations

from typing import Any

from rla_jax.envs import base
from rla_jax.envs.osworld import desktop

MATCHES = ('exact', 'contains')
_FIELDS = {
    'file_text': ('path', 'text'),
    'file_exists': ('path', 'exists'),
    'command_output': ('command', 'text'),
    'a11y_text': ('text',),
    'all': ('items',),
}


# The type of each field an evaluator may have.
_TYPES = {'path': str, 'text': str, 'command': (str, list), 'exists': bool,
          'items': list, 'match': str, 'func': str}


def check(evaluator: Any, where: str) -> None:
  """Raises base.DataError naming `where` if `evaluator` is malformed."""
  if not isinstance(evaluator, dict) or evaluator.get('func') not in _FIELDS:
    raise base.DataError(f'{where}: an evaluator is an object with "func" '
                         f'one of {sorted(_FIELDS)}; got {evaluator!r}')
  func = evaluator['func']
  missing = [k for k in _FIELDS[func] if k not in evaluator]
  if missing:
    raise base.DataError(f'{where}: evaluator {func!r} lacks {missing}')
  for key, kind in _TYPES.items():
    if key in evaluator and not isinstance(evaluator[key], kind):
      raise base.DataError(f'{where}: evaluator {func!r}: "{key}" must be '
                           f'{getattr(kind, "__name__", "a string or list")}'
                           f'; got {evaluator[key]!r}')
  if evaluator.get('match', 'exact') not in MATCHES:
    raise base.DataError(f'{where}: "match" must be one of {MATCHES}')
  if func == 'all':
    if not isinstance(evaluator['items'], list) or not evaluator['items']:
      raise base.DataError(f'{where}: "all" needs a non-empty "items" list')
    for k, item in enumerate(evaluator['items']):
      check(item, f'{where}.items[{k}]')


def _matches(actual: str, evaluator: dict[str, Any]) -> bool:
  expected = evaluator['text']
  if evaluator.get('match', 'exact') == 'contains':
    return expected in actual
  return actual.rstrip() == expected.rstrip()


def evaluate(client, evaluator: dict[str, Any]) -> bool:
  """Whether the desktop behind `client` passes `evaluator`.

  Desktop failures (desktop.DesktopError) propagate: the trajectory is
  then an environment error, not a failed task.
  """
  func = evaluator['func']
  if func == 'all':
    return all(evaluate(client, item) for item in evaluator['items'])
  if func == 'file_text':
    data = client.file(evaluator['path'])
    return data is not None and _matches(
        data.decode('utf-8', errors='replace'), evaluator)
  if func == 'file_exists':
    return (client.file(evaluator['path']) is not None) == bool(
        evaluator['exists'])
  if func == 'command_output':
    return _matches(_command_output(client, evaluator['command']), evaluator)
  if func == 'a11y_text':
    return _escape(evaluator['text']) in client.accessibility()
  raise ValueError(f'unknown evaluator func {func!r}')


def _command_output(client, command) -> str:
  """The stdout of `command` run on the desktop.

  A command that could not run or timed out (execute's status 'error')
  says nothing about the agent's work: it raises desktop.DesktopError, as
  an unreachable desktop does, so the trajectory is an environment error
  and not a failed task. A command that ran and exited non-zero is read
  as any other: its output decides.
  """
  result = client.execute(command, shell=True)
  if result.get('status') == 'error':
    detail = (result.get('message') or result.get('error') or '').strip()
    raise desktop.DesktopError(f'evaluator command {command!r} could not run '
                               f'or timed out: {detail[-300:]}')
  return result.get('output') or ''


def _escape(text: str) -> str:
  """`text` as it appears inside the accessibility XML."""
  return (text.replace('&', '&amp;').replace('<', '&lt;')
          .replace('>', '&gt;'))
