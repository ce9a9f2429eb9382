"""A local "mini-OSWorld" desktop and the client of its controller API.

  with desktop.LocalDesktop(*desktop.free_display_and_port(),
                            home='/tmp/rla_home') as d:
    d.client.launch(['zenity', '--entry'])
    d.client.run_pyautogui("pyautogui.write('hello')")
    png, tree = d.client.screenshot(), d.client.accessibility()
    d.client.reset()  # apps killed, home emptied: a fresh episode

`LocalDesktop` runs launch/desktop.sh (Xvfb, D-Bus, the AT-SPI bus,
openbox and desktop_server.py on 127.0.0.1); `Client` speaks OSWorld's
controller HTTP API (the paths and JSON of OSWorld's desktop server, plus
our /local/reset), so it also talks to a real OSWorld VM's server. Every
failure to reach the desktop, a timeout or an error answer raises
DesktopError naming the URL; a command that runs and fails does not: its
result dict says so.
"""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
import socket
import subprocess
import threading
from typing import Any, Sequence, Union
import urllib.error
import urllib.parse
import urllib.request

Command = Union[str, Sequence[str]]
PYAUTOGUI_PREFIX = ('import pyautogui; import time; '
                    'pyautogui.FAILSAFE = False; ')
SCRIPT = Path(__file__).resolve().parents[3] / 'launch' / 'desktop.sh'
START_TIMEOUT_S = 60.0


class DesktopError(Exception):
  """The desktop is unreachable, timed out or answered an error."""


class Client:
  """OSWorld's controller API at http://host:port."""

  def __init__(self, host: str = '127.0.0.1', port: int = 5000,
               timeout: float = 30.0):
    self.url = f'http://{host}:{port}'
    self.timeout = timeout

  def __repr__(self):
    return f'Client({self.url})'

  def _request(self, endpoint: str, *, json_body: Any = None,
               form: dict[str, str] | None = None, method: str = 'GET',
               timeout: float | None = None,
               missing_ok: bool = False) -> bytes | None:
    """The answer's body; None for a 404 when missing_ok."""
    data, headers = None, {}
    if json_body is not None:
      data, method = json.dumps(json_body).encode(), 'POST'
      headers['Content-Type'] = 'application/json'
    elif form is not None:
      data, method = urllib.parse.urlencode(form).encode(), 'POST'
      headers['Content-Type'] = 'application/x-www-form-urlencoded'
    request = urllib.request.Request(self.url + endpoint, data=data,
                                     headers=headers, method=method)
    where = f'desktop {self.url}{endpoint}'
    try:
      with urllib.request.urlopen(request,
                                  timeout=timeout or self.timeout) as answer:
        return answer.read()
    except urllib.error.HTTPError as e:
      if e.code == 404 and missing_ok:
        return None
      detail = e.read().decode(errors='replace')[:2000]
      raise DesktopError(f'{where} answered HTTP {e.code}: {detail}') from e
    except (urllib.error.URLError, http.client.HTTPException,
            OSError) as e:  # refused, reset, timed out (socket.timeout)
      reason = getattr(e, 'reason', None) or e
      raise DesktopError(f'{where} failed: {reason!r}') from e

  def _json(self, endpoint: str, **kwargs) -> Any:
    body = self._request(endpoint, **kwargs)
    try:
      return json.loads(body)
    except ValueError as e:
      raise DesktopError(f'desktop {self.url}{endpoint} answered no JSON: '
                         f'{body[:200]!r}') from e

  def screenshot(self) -> bytes:
    """PNG of the whole screen."""
    return self._request('/screenshot')

  def accessibility(self) -> str:
    """The AT-SPI tree as OSWorld's XML."""
    return self._json('/accessibility')['AT']

  def execute(self, command: Command, shell: bool = False,
              timeout: float | None = None) -> dict[str, Any]:
    """Runs command to its end (killed after timeout s, default the client's).

    Returns {'status': 'success' | 'error', 'output', 'error',
    'returncode'}: 'error' when it could not run or timed out.
    """
    timeout = self.timeout if timeout is None else float(timeout)
    body = {'command': command if isinstance(command, str) else
                       list(command),
            'shell': shell, 'timeout': timeout}
    return self._json('/execute', json_body=body, timeout=timeout + 10.0)

  def run_pyautogui(self, code: str) -> dict[str, Any]:
    """Runs `import pyautogui; ...; code` on the desktop; execute's dict."""
    return self.execute(['python', '-c', PYAUTOGUI_PREFIX + code])

  def launch(self, command: Command, shell: bool = False) -> None:
    """Starts an app in the background; it lives until the next reset."""
    body = {'command': command if isinstance(command, str) else
                       list(command), 'shell': shell}
    self._json('/setup/launch', json_body=body)

  def file(self, path: str) -> bytes | None:
    """The file's bytes (`~` is the desktop's home), None if missing."""
    return self._request('/file', form={'file_path': path}, missing_ok=True)

  def platform(self) -> str:
    return self._request('/platform').decode()

  def screen_size(self) -> tuple[int, int]:
    size = self._json('/screen_size', method='POST')
    return int(size['width']), int(size['height'])

  def reset(self) -> None:
    """Kills every app, closes windows, empties home (the local revert)."""
    self._json('/local/reset', json_body={}, timeout=max(self.timeout, 30.0))


class LocalDesktop:
  """A desktop of this host on display :display, served on 127.0.0.1:port."""

  def __init__(self, display: int, port: int, *,
               size: tuple[int, int] = (1280, 800), home: str,
               run_dir: str | None = None, python: str | None = None):
    self.display, self.port = int(display), int(port)
    self.size = (int(size[0]), int(size[1]))
    self.home = os.path.abspath(home)
    self.run_dir = os.path.abspath(run_dir or f'/tmp/rla_desktop_{display}')
    self.python = python
    self.client = Client('127.0.0.1', self.port)

  def __repr__(self):
    return f'LocalDesktop(:{self.display}, {self.client.url})'

  def _script(self, action: str) -> None:
    if not SCRIPT.is_file():
      raise DesktopError(f'{SCRIPT} is missing: LocalDesktop needs the '
                         'rla_jax repository checkout (launch/desktop.sh)')
    command = ['bash', str(SCRIPT), action, '--display', str(self.display),
               '--port', str(self.port),
               '--size', f'{self.size[0]}x{self.size[1]}',
               '--home', self.home, '--run-dir', self.run_dir]
    if self.python:
      command += ['--python', self.python]
    try:
      done = subprocess.run(command, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True,
                            timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
      raise DesktopError(f'desktop.sh {action} for {self} took over '
                         f'{START_TIMEOUT_S:g} s (logs in {self.run_dir})'
                         ) from e
    if done.returncode != 0:
      raise DesktopError(f'desktop.sh {action} for {self} failed '
                         f'(exit {done.returncode}):\n'
                         f'{(done.stderr or done.stdout).strip()}')

  def start(self) -> None:
    """Starts the desktop; returns once its server answers."""
    self._script('start')

  def stop(self) -> None:
    """Ends every process of the desktop (nothing if it is not running)."""
    self._script('stop')

  def restart(self) -> None:
    self.stop()
    self.start()

  def alive(self) -> bool:
    """Whether the server answers within 5 s."""
    try:
      Client('127.0.0.1', self.port, timeout=5.0).platform()
      return True
    except DesktopError:
      return False

  def __enter__(self) -> LocalDesktop:
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


_claimed: set[int] = set()  # displays handed out by this process
_claimed_ports: set[int] = set()
_claim_lock = threading.Lock()


def _display_free(n: int) -> bool:
  return not (os.path.exists(f'/tmp/.X11-unix/X{n}') or
              os.path.exists(f'/tmp/.X{n}-lock'))


def _port_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(('127.0.0.1', port))
      return True
    except OSError:
      return False


def free_display_and_port(display: int = 100,
                          port: int = 5000) -> tuple[int, int]:
  """The first free X display >= display and TCP port >= port on 127.0.0.1.

  Free means no X socket or lock file, and a port that binds; a number
  handed out once by this process is not handed out again.
  """
  with _claim_lock:
    d = next(n for n in range(display, display + 10_000)
             if n not in _claimed and _display_free(n))
    p = next((n for n in range(port, 65536)
              if n not in _claimed_ports and _port_free(n)), None)
    if p is None:
      raise DesktopError(f'no free TCP port from {port} on 127.0.0.1')
    _claimed.add(d)
    _claimed_ports.add(p)
  return d, p
