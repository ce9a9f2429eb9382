"""OSWorld's own task format, checked at load time for provider 'vm'.

DesktopEnv (desktops.VM) runs a task's `config` steps with its
SetupController and scores an evaluator with its getters and metrics; these
pure checks refuse what it would only fail on mid-run, with one line naming
the file and the key path. The local format is environment.py's.
"""

from __future__ import annotations

from typing import Any

from rla_jax.envs import base

# OSWorld's set-up step types: the `_<type>_setup` methods of SetupController
# in desktop_env/controllers/setup.py (desktop-env 1.0.2, and the authors'
# copy in Gen-Verse/Open-AgentRL OSWorld-main/, the same 20).
SETUP_STEPS = (
    'download', 'upload_file', 'change_wallpaper', 'tidy_desktop', 'open',
    'launch', 'execute', 'execute_with_verification', 'command', 'sleep',
    'act', 'replay', 'activate_window', 'close_window', 'proxy',
    'chrome_open_tabs', 'chrome_close_tabs', 'googledrive', 'login',
    'update_browse_history')
CONJUNCTIONS = ('and', 'or')  # how the metrics of a list "func" combine
INFEASIBLE = 'infeasible'  # the one metric without a "result" getter


def is_metric_evaluator(evaluator: Any) -> bool:
  """Whether `evaluator` is in OSWorld's format (metrics over getters), not
  a local one (evaluators.py)."""
  return isinstance(evaluator, dict) and (
      isinstance(evaluator.get('func'), list)
      or bool({'result', 'expected', 'postconfig'} & set(evaluator)))


def check_steps(steps: Any, where: str) -> None:
  """Raises base.DataError at the first set-up step (`config`, an
  evaluator's `postconfig`) SetupController has no method for."""
  if not isinstance(steps, list):
    raise base.DataError(f'{where}: a list of set-up steps; got {steps!r}')
  for k, step in enumerate(steps):
    at = f'{where}[{k}]'
    if not isinstance(step, dict) or step.get('type') not in SETUP_STEPS:
      raise base.DataError(f'{at}: a step is an object with "type" one of '
                           f'OSWorld\'s {SETUP_STEPS}; got {step!r}')
    if not isinstance(step.get('parameters'), dict):
      raise base.DataError(f'{at}: needs an object "parameters" (the '
                           f'arguments of _{step["type"]}_setup)')


def check_evaluator(evaluator: Any, where: str) -> None:
  """Raises base.DataError naming the key of `evaluator` that DesktopEnv
  could not score: "func" a metric or a list of them; "result" (and the
  optional "expected") a getter {"type": ...}, or with a list "func" a list
  of one per metric; optional "options", "conj" and "postconfig"."""
  if not isinstance(evaluator, dict):
    raise base.DataError(f'{where}: an OSWorld evaluator is an object with '
                         f'"func"; got {evaluator!r}')
  func = evaluator.get('func')
  metrics = func if isinstance(func, list) else [func]
  if not metrics or not all(isinstance(m, str) and m for m in metrics):
    raise base.DataError(f'{where}.func: a metric name or a non-empty list '
                         f'of them; got {func!r}')
  if 'result' not in evaluator and func != INFEASIBLE:
    raise base.DataError(f'{where}: needs a getter "result" (only '
                         f'{INFEASIBLE!r} has none)')
  count = len(metrics) if isinstance(func, list) else None
  for key, kind in (('result', 'getter'), ('expected', 'getter'),
                    ('options', 'options')):
    if key in evaluator:
      _check_per_metric(evaluator[key], count, f'{where}.{key}', kind,
                        may_be_null=key != 'result')
  if evaluator.get('conj', 'and') not in CONJUNCTIONS:
    raise base.DataError(f'{where}.conj: one of {CONJUNCTIONS}; got '
                         f'{evaluator["conj"]!r}')
  check_steps(evaluator.get('postconfig', []), f'{where}.postconfig')


def _check_per_metric(value: Any, count: int | None, where: str, kind: str,
                      may_be_null: bool) -> None:
  """One getter (or options object) per metric: itself for a single metric,
  a list of `count` for a list "func" (a null where a metric takes none)."""
  if count is None:
    _check_item(value, where, kind)
    return
  if not isinstance(value, list) or len(value) != count:
    raise base.DataError(f'{where}: a list of {count} (one per "func" '
                         f'metric); got {value!r}')
  for k, item in enumerate(value):
    if not (item is None and may_be_null):
      _check_item(item, f'{where}[{k}]', kind)


def _check_item(item: Any, where: str, kind: str) -> None:
  if kind == 'options':
    if not isinstance(item, dict):
      raise base.DataError(f'{where}: an object of the metric\'s options; '
                           f'got {item!r}')
  elif not isinstance(item, dict) or not isinstance(item.get('type'), str):
    raise base.DataError(f'{where}: needs a string "type" (a getter '
                         f'object); got {item!r}')
