"""A local "mini-OSWorld" desktop and the client of its controller API.

  with desktop.LocalDesktop(desktop.free_display(),
                            home='/tmp/rla_home') as d:
    d.client.launch(['zenity', '--entry'])
    d.client.run_pyautogui("pyautogui.write('hello')")
    png, tree = d.client.screenshot(), d.client.accessibility()
    d.client.reset()  # apps killed, home emptied: a fresh episode

`LocalDesktop` runs launch/desktop.sh (Xvfb, D-Bus, the AT-SPI bus,
openbox and desktop_server.py); the server listens on a unix socket in the
desktop's run dir (<run dir>/server.sock), a 0700 directory of our uid, so
no other local user can reach it (the server runs any command it is sent).
The desktop is tied to the process that started it: when that process
dies, even by SIGKILL, the desktop stops itself within seconds.

`Client` speaks OSWorld's controller HTTP API (the paths and JSON of
OSWorld's desktop server, plus our /local/reset) over that socket. Before
each connection it checks that the socket's directory is ours and closed
to others, so it cannot be talking to an impostor: no other uid can have
made that socket. Every failure to reach the desktop, a timeout or an
error answer raises DesktopError naming the desktop and the endpoint; a
command that runs and fails does not: its result dict says so.

OSWorld's own `PythonController` calls `requests.get/post(http_server +
path)`; `python_controller(local_desktop)` gives one that reaches the
desktop through its socket (see `unix_requests`).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
from pathlib import Path
import socket
import stat
import subprocess
import threading
from typing import Any, Sequence, Union
import urllib.parse

Command = Union[str, Sequence[str]]
PYAUTOGUI_PREFIX = ('import pyautogui; import time; '
                    'pyautogui.FAILSAFE = False; ')
SCRIPT = Path(__file__).resolve().parents[3] / 'launch' / 'desktop.sh'
SOCKET_NAME = 'server.sock'  # in the run dir (desktop.sh's --run-dir)
START_TIMEOUT_S = 60.0


class DesktopError(Exception):
  """The desktop is unreachable, timed out, answered an error or is not ours."""


def check_private_dir(fd: int, folder: str) -> None:
  """DesktopError unless the open directory fd is ours and closed to others.

  Only the owner of a 0700 directory (and root) can create a socket in it:
  this is what proves the socket was made by our own desktop server and not
  by another local user who bound it after ours died.
  """
  st = os.fstat(fd)
  if not stat.S_ISDIR(st.st_mode):
    raise DesktopError(f'{folder} is not a directory')
  if st.st_uid != os.geteuid():
    raise DesktopError(f'{folder} belongs to uid {st.st_uid}, not to us '
                       f'(uid {os.geteuid()}): its socket may be an '
                       'impostor\'s')
  if st.st_mode & 0o077:
    raise DesktopError(f'{folder} is open to others (mode '
                       f'{stat.S_IMODE(st.st_mode):o}, want 0700): its socket '
                       'may be an impostor\'s')


def connect_unix(path: str, timeout: float | None) -> socket.socket:
  """A socket connected to path, once its directory is proven ours.

  The directory is opened once and the connection goes through that open
  directory (/proc/self/fd/N/name), so it cannot be swapped between the
  check and the connect.
  """
  folder, name = os.path.split(os.path.abspath(path))
  fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW |
               os.O_CLOEXEC)
  try:
    check_private_dir(fd, folder)
    via = f'/proc/self/fd/{fd}/{name}'
    if not os.path.isdir(f'/proc/self/fd/{fd}'):
      via = path  # no /proc: the check still rules out other uids' dirs
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      sock.settimeout(timeout)
      sock.connect(via)
    except BaseException:
      sock.close()
      raise
    return sock
  finally:
    os.close(fd)


def fake_host(socket_path: str) -> str:
  """The host name URLs of this desktop use (`http://<it>/path`).

  HTTP needs a host; ours names the socket (a hash of its path), never a
  machine, so such a URL cannot reach anything over the network.
  """
  digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()
  return f'rla-desktop-{digest[:16]}'


class UnixHTTPConnection(http.client.HTTPConnection):
  """http.client over the desktop's unix socket (see connect_unix)."""

  def __init__(self, socket_path: str, timeout: float | None = None):
    super().__init__(fake_host(socket_path), timeout=timeout)
    self.socket_path = socket_path

  def connect(self):
    self.sock = connect_unix(self.socket_path, self.timeout)


class Client:
  """OSWorld's controller API of a local desktop, over its unix socket."""

  def __init__(self, socket_path: str, timeout: float = 30.0):
    self.socket_path = os.path.abspath(socket_path)
    self.url = f'http://{fake_host(self.socket_path)}'  # see unix_requests
    self.timeout = timeout

  def __repr__(self):
    return f'Client(unix:{self.socket_path})'

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
    where = f'desktop unix:{self.socket_path} {method} {endpoint}'
    connection = UnixHTTPConnection(self.socket_path,
                                    timeout=timeout or self.timeout)
    try:
      connection.request(method, endpoint, body=data, headers=headers)
      answer = connection.getresponse()
      status, body = answer.status, answer.read()
    except DesktopError as e:  # not our socket
      raise DesktopError(f'{where} refused: {e}') from None
    except (http.client.HTTPException,
            OSError) as e:  # missing, refused, reset, timed out
      raise DesktopError(f'{where} failed: {e!r}') from e
    finally:
      connection.close()
    if status == 404 and missing_ok:
      return None
    if status >= 400:
      detail = body.decode(errors='replace')[:2000]
      raise DesktopError(f'{where} answered HTTP {status}: {detail}')
    return body

  def _json(self, endpoint: str, **kwargs) -> Any:
    body = self._request(endpoint, **kwargs)
    try:
      return json.loads(body)
    except ValueError as e:
      raise DesktopError(f'desktop unix:{self.socket_path} {endpoint} '
                         f'answered no JSON: {body[:200]!r}') from e

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

  def reset(self, network: bool = False) -> None:
    """Kills every app, closes windows, empties home (the local revert);
    the next task's apps reach the network only with `network`."""
    self._json('/local/reset', json_body={'network': bool(network)},
               timeout=max(self.timeout, 30.0))


class LocalDesktop:
  """A desktop of this host on display :display, served in run_dir.

  Its server listens on <run_dir>/server.sock; run_dir (default
  /tmp/rla_desktop_<display>) must be ours and closed to others, or
  desktop.sh makes it so when it creates it. The desktop stops itself when
  the process that started it dies.
  """

  def __init__(self, display: int, *, size: tuple[int, int] = (1280, 800),
               home: str, run_dir: str | None = None,
               python: str | None = None):
    self.display = int(display)
    self.size = (int(size[0]), int(size[1]))
    self.home = os.path.abspath(home)
    # desktop.sh resolves it too: the paths must agree. A symlink in its
    # place may be another user's: desktop.sh refuses it, so do we.
    run_dir = run_dir or f'/tmp/rla_desktop_{display}'
    if os.path.islink(run_dir.rstrip('/')):
      raise DesktopError(f'refusing run dir {run_dir}: it is a symlink '
                         '(another user\'s, perhaps); give the folder itself')
    self.run_dir = os.path.realpath(run_dir)
    self.socket_path = os.path.join(self.run_dir, SOCKET_NAME)
    self.python = python
    self.client = Client(self.socket_path)

  def __repr__(self):
    return f'LocalDesktop(:{self.display}, unix:{self.socket_path})'

  def _script(self, action: str) -> None:
    if not SCRIPT.is_file():
      raise DesktopError(f'{SCRIPT} is missing: LocalDesktop needs the '
                         'rla_jax repository checkout (launch/desktop.sh)')
    command = ['bash', str(SCRIPT), action, '--display', str(self.display),
               '--size', f'{self.size[0]}x{self.size[1]}',
               '--home', self.home, '--run-dir', self.run_dir]
    if action == 'start':  # the desktop dies with this process
      command += ['--owner-pid', str(os.getpid())]
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
    """Whether our server (not an impostor) answers within 5 s."""
    try:
      Client(self.socket_path, timeout=5.0).platform()
      return True
    except DesktopError:
      return False

  def __enter__(self) -> LocalDesktop:
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


_claimed: set[int] = set()  # displays handed out by this process
_claim_lock = threading.Lock()


def _display_free(n: int) -> bool:
  return not (os.path.exists(f'/tmp/.X11-unix/X{n}') or
              os.path.exists(f'/tmp/.X{n}-lock'))


def free_display(display: int = 100) -> int:
  """The first free X display >= display.

  Free means no X socket or lock file; a number handed out once by this
  process is not handed out again (its desktop may not have started yet).
  """
  with _claim_lock:
    d = next(n for n in range(display, display + 10_000)
             if n not in _claimed and _display_free(n))
    _claimed.add(d)
  return d


# -- OSWorld's PythonController over the socket -------------------------------

_router = None
_router_lock = threading.Lock()


def unix_requests():
  """A stand-in for the `requests` module that reaches local desktops.

  `get`, `post` and `request` send a URL of a desktop registered with
  `.add(client)` (http://rla-desktop-<id>/..., its `client.url`) over that
  desktop's unix socket, checked as Client checks it; any other URL goes
  to the real requests. Everything else (requests.exceptions, ...) is the
  real module's. One for the process, so controllers of several desktops
  can share OSWorld's module.
  """
  global _router
  with _router_lock:
    if _router is None:
      _router = _make_router()
    return _router


def python_controller(local: LocalDesktop):
  """OSWorld's PythonController driving `local` through its socket.

  PythonController calls its module's `requests.get/post(self.http_server
  + path)`; that name is pointed at unix_requests(), which routes the
  desktop's fake host to its socket and every other URL to requests.
  """
  # pylint: disable-next=g-import-not-at-top
  from desktop_env.controllers import python as controller_module
  router = unix_requests()
  router.add(local.client)
  controller_module.requests = router
  controller = controller_module.PythonController(
      fake_host(local.socket_path), 80)
  controller.http_server = local.client.url
  return controller


def _make_router():
  """unix_requests()'s object (requests is imported only when needed)."""
  import requests  # pylint: disable=g-import-not-at-top
  import requests.adapters  # pylint: disable=g-import-not-at-top
  import urllib3  # pylint: disable=g-import-not-at-top

  class Connection(urllib3.connection.HTTPConnection):
    socket_path = ''

    def _new_conn(self):
      timeout = self.timeout if isinstance(self.timeout, (int, float)) else None
      return connect_unix(self.socket_path, timeout)

  class Adapter(requests.adapters.HTTPAdapter):
    """Every request through this adapter goes to one desktop's socket."""

    def __init__(self, socket_path):
      super().__init__()
      self.socket_path = socket_path
      connection = type('UnixConnection', (Connection,),
                        {'socket_path': socket_path})
      self.pool = urllib3.HTTPConnectionPool(fake_host(socket_path))
      self.pool.ConnectionCls = connection

    def get_connection_with_tls_context(self, request, verify, proxies=None,
                                        cert=None):
      del request, verify, proxies, cert
      return self.pool

    def get_connection(self, url, proxies=None):  # requests < 2.32
      del url, proxies
      return self.pool

    def request_url(self, request, proxies):
      del proxies
      return request.path_url

    def close(self):
      super().close()
      self.pool.close()

  class Router:
    """See unix_requests."""

    def __init__(self):
      self.session = requests.Session()
      self.session.trust_env = False  # no proxy for a socket
      self.prefixes: set[str] = set()
      self.lock = threading.Lock()

    def add(self, client: Client) -> None:
      with self.lock:
        for prefix in (client.url + '/', client.url + ':80/'):
          if prefix not in self.prefixes:
            self.session.mount(prefix, Adapter(client.socket_path))
            self.prefixes.add(prefix)

    def request(self, method, url, **kwargs):
      if url.lower().startswith(tuple(self.prefixes)):
        return self.session.request(method, url, **kwargs)
      return requests.request(method, url, **kwargs)

    def get(self, url, params=None, **kwargs):
      return self.request('GET', url, params=params, **kwargs)

    def post(self, url, data=None, json=None, **kwargs):  # pylint: disable=redefined-outer-name
      return self.request('POST', url, data=data, json=json, **kwargs)

    def __getattr__(self, name):
      return getattr(requests, name)

  return Router()
