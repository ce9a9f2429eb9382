"""Desktops the OSWorld episodes run on: local ones, or OSWorld's own VMs.

Both kinds offer an episode the same few calls: `start_task(spec)` (back to
a clean desktop, then the task's set-up), `screenshot()`, `accessibility()`,
`run_pyautogui(code)`, `screen_size()` and `evaluate(spec)`.

- `Local`: a desktop on this host (launch/desktop.sh: Xvfb, openbox, the
  accessibility bus and our OSWorld server on a unix socket of its own).
  A task starts from a reset that kills the apps and empties the home
  folder (seconds), then runs the task's `config` steps; the task's own
  evaluators (evaluators.py) decide it.
- `VM`: OSWorld's `desktop_env.DesktopEnv` (`pip install desktop-env`;
  providers docker, vmware, virtualbox, aws, ...), for the benchmark's
  task files: DesktopEnv reverts the VM snapshot and runs the task's
  set-up, and its own getters and metrics evaluate (the evaluator that
  the task's `current_task` names: vm_task).

A `Pool` hands one desktop to each episode that runs at once, starting
them on demand.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from typing import Any

from rla_jax.envs.osworld import desktop
from rla_jax.envs.osworld import evaluators as osworld_eval

WINDOW_WAIT_S = 20.0  # a task's apps must show a window within this


class Local:
  """A local desktop and its controller client."""

  def __init__(self, made: 'desktop.LocalDesktop'):
    self.desktop = made
    self.client = made.client

  def __repr__(self):
    return f'Local({self.desktop})'

  def alive(self) -> bool:
    return self.desktop.alive()

  def restart(self):
    self.desktop.restart()

  def stop(self):
    self.desktop.stop()

  def start_task(self, spec: dict[str, Any]):
    self.client.reset(network=spec.get('network', False))
    launched = 0
    for step in spec.get('config', []):
      params = step.get('parameters', {})
      if step['type'] == 'launch':
        self.client.launch(params['command'], shell=params.get('shell', False))
        launched += 1
      elif step['type'] == 'execute':
        result = self.client.execute(params['command'],
                                     shell=params.get('shell', False))
        if result.get('returncode', 0) != 0:
          raise RuntimeError(f'task {spec["id"]} set-up step '
                             f'{params["command"]!r} failed: '
                             f'{(result.get("error") or "")[-300:]}')
      else:
        time.sleep(float(params.get('seconds', 1.0)))
    self._wait_for_windows(launched)

  def _wait_for_windows(self, count: int):
    """Until the window manager shows `count` windows (apps start slower on
    a loaded machine than a task's sleep assumes); then their first frame."""
    deadline = time.monotonic() + WINDOW_WAIT_S
    while count:
      listed = self.client.execute(['wmctrl', '-l']).get('output') or ''
      if len(listed.splitlines()) >= count:
        time.sleep(0.3)
        return
      if time.monotonic() > deadline:
        raise desktop.DesktopError(
            f'{self}: {count} app windows did not appear within '
            f'{WINDOW_WAIT_S:g} s (wmctrl -l: {listed.strip()!r})')
      time.sleep(0.1)

  def screenshot(self) -> bytes:
    return self.client.screenshot()

  def accessibility(self) -> str:
    return self.client.accessibility()

  def run_pyautogui(self, code: str) -> dict[str, Any]:
    return self.client.run_pyautogui(code)

  def screen_size(self) -> tuple[int, int]:
    return self.client.screen_size()

  def evaluate(self, spec: dict[str, Any], name: str) -> bool:
    return osworld_eval.evaluate(self.client, spec['evaluators'][name])


class VM:
  """One of OSWorld's VMs through `desktop_env.DesktopEnv`."""

  def __init__(self, vm):
    self.vm = vm
    self._evaluator = None  # the evaluator of the last reset

  def alive(self) -> bool:
    return True  # DesktopEnv recovers its VM in reset()

  def restart(self):
    pass

  def stop(self):
    self.vm.close()

  def start_task(self, spec: dict[str, Any]):
    task = vm_task(spec)
    self.vm.reset(task_config=task)
    self._evaluator = task['evaluator']

  def screenshot(self) -> bytes:
    return self._checked(self.vm.controller.get_screenshot(), 'screenshot')

  def accessibility(self) -> str:
    return self.vm.controller.get_accessibility_tree() or ''

  def run_pyautogui(self, code: str) -> dict[str, Any]:
    result = self.vm.controller.execute_python_command(code)
    return result if isinstance(result, dict) else {}

  def screen_size(self) -> tuple[int, int]:
    size = self._checked(self.vm.controller.get_vm_screen_size(),
                         'screen size')
    return int(size['width']), int(size['height'])

  def evaluate(self, spec: dict[str, Any], name: str) -> bool:
    """Scores evaluator `name` of `spec`.

    DesktopEnv.evaluate() scores the evaluator of its last reset; when
    `name` is another one (start_task always resets with the one
    evaluate is later asked for, so only a caller outside the episode
    gets here) DesktopEnv is pointed at it first.
    """
    wanted = _evaluator(spec, name)
    if wanted != self._evaluator:
      self.vm._set_evaluator_info({'evaluator': wanted})  # pylint: disable=protected-access
      self._evaluator = wanted
    return float(self.vm.evaluate()) > 0

  @staticmethod
  def _checked(value, what: str):
    if value is None:  # the controller logs and returns None on failure
      raise desktop.DesktopError(f'the OSWorld VM returned no {what}')
    return value


def _current_name(spec: dict[str, Any]) -> str:
  """The evaluator key of `current_task` (environment.evaluator_name,
  which imports this module)."""
  return next(iter(spec['current_task']))


def _evaluator(spec: dict[str, Any], name: str) -> dict[str, Any]:
  """OSWorld's evaluator object of key `name`: from `evaluators` in the
  authors' format (one per key), else the task's single `evaluator`."""
  if 'evaluators' in spec:
    return spec['evaluators'][name]
  return spec['evaluator']


def vm_task(spec: dict[str, Any]) -> dict[str, Any]:
  """The task config DesktopEnv.reset runs: the task's fields with the
  instruction and the evaluator of its `current_task`.

  A rewrite may switch `current_task` to another evaluator key, and the
  JSON's own `evaluator` is the original one: a rollout of the rewrite
  must be reset and scored with the evaluator its instruction names.
  """
  name = _current_name(spec)
  task = {k: v for k, v in spec.items()
          if k not in ('evaluators', 'task_template', 'current_task')}
  task['instruction'] = spec['current_task'][name]
  task['evaluator'] = _evaluator(spec, name)
  return task


def local_factory(env_config):
  """desktop i on the first free display >= display_base + i.

  Its server listens on a unix socket in its run dir (no port to pick);
  the desktop stops itself if this process dies.
  """
  width, height = env_config.screen_size

  def make(i: int) -> Local:
    display = desktop.free_display(env_config.display_base + i)
    made = desktop.LocalDesktop(
        display, size=(width, height),
        home=os.path.join(env_config.desktop_dir or '/tmp',
                          f'rla_desktop_home_{display}'))
    made.start()
    return Local(made)

  return make


def vm_factory(env_config):
  """OSWorld's DesktopEnv with config.env.vm (provider, path, region...)."""
  try:
    from desktop_env.desktop_env import DesktopEnv  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError("config.env.provider='vm' needs OSWorld's desktop_env "
                     f'(pip install desktop-env): {e}') from e
  vm = env_config.vm
  width, height = env_config.screen_size

  def make(i: int) -> VM:
    del i
    return VM(DesktopEnv(
        provider_name=vm.provider_name, path_to_vm=vm.path_to_vm or None,
        region=vm.region or None, snapshot_name=vm.snapshot_name,
        action_space='pyautogui', screen_size=(width, height),
        headless=True, os_type=vm.os_type, require_a11y_tree=False))

  return make


class Pool:
  """Desktops for concurrent episodes: an episode holds one at a time.

  Desktops start on demand, up to `max_desktops`; a dead one (its episode
  ended in an environment error) is started again when handed out.
  """

  def __init__(self, make, max_desktops: int, acquire_timeout_s: float):
    self._make, self._max = make, max_desktops
    self._timeout = acquire_timeout_s
    self._free: queue.Queue = queue.Queue()
    self._count = 0
    self._all: list = []
    self._lock = threading.Lock()
    self._starting = threading.Lock()  # one start at a time: free displays
    atexit.register(self.close)

  def acquire(self):
    with self._lock:
      grow = self._free.empty() and self._count < self._max
      index = self._count
      self._count += grow
    if grow:
      try:
        with self._starting:
          made = self._make(index)
      except BaseException:
        with self._lock:
          self._count -= 1
        raise
      with self._lock:
        self._all.append(made)
      return made
    try:
      made = self._free.get(timeout=self._timeout)
    except queue.Empty:
      raise RuntimeError(
          f'all {self._max} desktops stayed busy for {self._timeout:.0f} s; '
          'raise config.env.max_desktops to the episodes that run at once '
          '(rollout.num_tasks x rollout.group_size, plus pending rewrites)'
      ) from None
    if not made.alive():
      logging.warning('%s is down; starting it again', made)
      made.restart()
    return made

  def release(self, made):
    self._free.put(made)

  def close(self):
    with self._lock:
      made, self._all = self._all, []
    for d in made:
      try:
        d.stop()
      except Exception:  # pylint: disable=broad-except
        logging.exception('stopping %s failed', d)
