"""The OSWorld controller's HTTP API for a local desktop (no VM).

  /usr/bin/python3 desktop_server.py --host 127.0.0.1 --port 5000 \
      --home /tmp/rla_desktop_99/home --python .venv/bin/python

launch/desktop.sh starts it inside a desktop (Xvfb, D-Bus, the AT-SPI bus,
openbox) whose DISPLAY, XAUTHORITY and DBUS_SESSION_BUS_ADDRESS it
inherits. It answers OSWorld's `PythonController` with the same paths and
JSON as OSWorld's desktop_env/server/main.py:

  GET  /screenshot     PNG of the whole screen, mouse cursor drawn in
  GET  /accessibility  {"AT": xml}: the AT-SPI tree of every application
  POST /execute        {"command": list | str, "shell": bool, "timeout": s}
                       -> {"status", "output", "error", "returncode"}; a
                       command that cannot run or times out answers status
                       "error" (HTTP 200: the command failed, not the server)
  POST /setup/launch   {"command", "shell"}: start an app in the background
  POST /file           form field file_path -> the file's bytes (404 if none)
  GET  /platform       "Linux"
  POST /screen_size    {"width", "height"}
  POST /local/reset    ours, the stand-in for a VM snapshot revert: kills
                       what /execute and /setup/launch started, closes the
                       remaining windows, releases held keys and buttons and
                       empties --home

Commands run with HOME and cwd = --home, and `python` / `python3` are the
--python interpreter (a venv with pyautogui). An agent drives the apps, so
they and every command run under bubblewrap: the host's files read-only,
only --home and the desktop's run dir writable (--no-sandbox: as is). Every process started here
carries RLA_DESKTOP_APP=<this server's id> in its environment, which is how
a reset finds them all, including what they started in the background.

It runs with the system python3 (pyatspi is a Debian package) and imports
only the standard library, pyatspi (desktop_a11y.py, next to it), PIL and
Xlib. It binds to a loopback address only: anyone who reaches it can run
any command.
"""

import argparse
import http.server
import io
import ipaddress
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET

import desktop_a11y  # this folder (the script's): pyatspi first
from gi.repository import Atspi  # pylint: disable=wrong-import-order
from PIL import Image
from PIL import ImageGrab
import Xlib.display
import Xlib.error
import Xlib.X
from Xlib.ext import xtest

EXECUTE_TIMEOUT_S = 120.0  # OSWorld's
OUTPUT_LIMIT = 4 << 20  # bytes of stdout / stderr returned by /execute
RESET_WAIT_S = 3.0
TAG_VAR = 'RLA_DESKTOP_APP'


class RequestError(Exception):
  """A bad request: answered with this HTTP status and message."""

  def __init__(self, status, message):
    super().__init__(message)
    self.status = status


def parse_args(argv):
  """Flags, with the host checked to be loopback and --home to be safe."""
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--host', default='127.0.0.1')
  p.add_argument('--port', type=int, default=5000)
  p.add_argument('--home', required=True)
  p.add_argument('--python', default=sys.executable)
  p.add_argument('--no-sandbox', dest='sandbox', action='store_false',
                 help='run apps and commands with the host writable (by '
                 'default they run under bubblewrap: the filesystem read-only '
                 'but for --home and the desktop\'s run dir)')
  args = p.parse_args(argv)
  if args.sandbox and not shutil.which('bwrap'):
    p.error('apps run under bubblewrap, which is not installed (apt-get '
            'install bubblewrap), or pass --no-sandbox')
  host = '127.0.0.1' if args.host == 'localhost' else args.host
  try:
    loopback = ipaddress.ip_address(host).is_loopback
  except ValueError:
    loopback = False
  if not loopback:
    p.error(f'refusing --host {args.host}: this server runs any command it '
            'is sent, so it binds to a loopback address only (127.0.0.1, '
            '::1 or localhost)')
  args.host = host
  args.home = os.path.realpath(os.path.expanduser(args.home))
  # rla_jax/envs/osworld/desktop_server.py -> the checkout
  repo = os.path.realpath(__file__).rsplit(os.sep, 4)[0]
  real_home = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)
  for keep in (real_home, repo):
    if keep == args.home or keep.startswith(args.home + '/'):
      p.error(f'refusing --home {args.home}: a reset empties it, and it is '
              f'or contains {keep}; give a directory of its own')
  if os.path.dirname(args.home) == '/':
    p.error(f'refusing --home {args.home}: a reset empties it; give a '
            'directory of its own, not one at the top of the file system')
  if not os.access(args.python, os.X_OK):
    p.error(f'--python {args.python} is not an executable')
  return args


class Desktop:
  """What the handlers share: the X connection, the apps started, the lock."""

  def __init__(self, home, python, sandbox=True):
    self.home, self.python = home, python
    # The agent drives these apps: under bubblewrap they see the host
    # read-only, writing only their home and the desktop's run dir (its
    # sockets and X authority live there); the X socket is reachable read-only.
    writable = [home] + [d for d in (os.environ.get('RLA_DESKTOP_RUN'),) if d]
    self.jail = [shutil.which('bwrap'), '--ro-bind', '/', '/', '--dev-bind',
                 '/dev', '/dev', '--proc', '/proc'] + [
                     a for d in writable for a in ('--bind', d, d)] + [
                         '--'] if sandbox else []
    self.tag = uuid.uuid4().hex
    os.makedirs(home, exist_ok=True)
    self.bin_dir = tempfile.mkdtemp(  # in desktop.sh's run dir if any
        prefix='rla_desktop_bin_', dir=os.environ.get('RLA_DESKTOP_RUN'))
    for name in ('python', 'python3'):  # for shell commands and scripts
      path = os.path.join(self.bin_dir, name)
      with open(path, 'w') as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
      os.chmod(path, 0o755)
    self.env = dict(os.environ)
    for name in ('PYTHONPATH', 'PYTHONHOME', 'VIRTUAL_ENV'):
      self.env.pop(name, None)
    self.env.update({
        'HOME': home, TAG_VAR: self.tag,
        'PATH': self.bin_dir + os.pathsep + os.environ.get('PATH', ''),
        'XDG_SESSION_TYPE': 'x11',
        # Settings in ~/.config (emptied by a reset), not in dconf.
        'GSETTINGS_BACKEND': 'keyfile',
    })
    self.display_name = os.environ.get('DISPLAY', ':0')
    self.x = Xlib.display.Display(self.display_name)
    self.x_lock = threading.Lock()
    self.a11y_lock = threading.Lock()
    self.procs_lock = threading.Lock()
    self.procs = []  # Popen of /setup/launch and running /execute commands
    self.groups = set()  # their process groups

  def close(self):
    try:
      self.kill_apps()
    finally:
      shutil.rmtree(self.bin_dir, ignore_errors=True)

  # -- processes ------------------------------------------------------------

  def popen(self, command, shell, **kwargs):
    """Starts command in its own process group, in the apps' environment."""
    if not shell and command and command[0] in ('python', 'python3'):
      command = [self.python] + command[1:]
    if self.jail:
      if not shell and not shutil.which(command[0], path=self.env['PATH']):
        raise FileNotFoundError(f'no program {command[0]!r}')
      command = self.jail + (['/bin/sh', '-c', command] if shell else
                             list(command))
      shell = False
    proc = subprocess.Popen(command, shell=shell, cwd=self.home, env=self.env,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            **kwargs)
    with self.procs_lock:
      self.procs = [p for p in self.procs if p.poll() is None]
      self.procs.append(proc)
      self.groups.add(proc.pid)
    return proc

  def tagged(self):
    """{pid: process group} of every live process carrying our tag."""
    found, needle = {}, f'{TAG_VAR}={self.tag}'.encode()
    for entry in os.listdir('/proc'):
      if not entry.isdigit():
        continue
      try:
        with open(f'/proc/{entry}/environ', 'rb') as f:
          if needle not in f.read().split(b'\0'):
            continue
        found[int(entry)] = os.getpgid(int(entry))
      except (OSError, ProcessLookupError):
        continue
    return found

  def kill_apps(self):
    """SIGKILLs everything started here (and its groups) until none is left.

    Rounds repeat until no live process carries our tag, so a child forked
    while we kill is found in the next round.
    """
    with self.procs_lock:
      procs, self.procs = self.procs, []
      groups, self.groups = self.groups, set()
    own = os.getpgid(0)
    deadline = time.monotonic() + RESET_WAIT_S
    while True:
      for proc in procs:  # reap our children (and send their groups SIGKILL)
        if proc.poll() is None:
          _signal(-proc.pid)
      victims = self.tagged()
      if not victims:
        return
      if time.monotonic() > deadline:
        raise RuntimeError(f'processes {sorted(victims)} outlived SIGKILL '
                           f'for {RESET_WAIT_S} s')
      for pid, group in victims.items():
        if group in groups and group != own:
          _signal(-group)
        _signal(pid)
      time.sleep(0.005)

  # -- X --------------------------------------------------------------------

  def with_x(self, fn):
    """Runs fn(display) under the lock; reconnects once if X went away."""
    with self.x_lock:
      try:
        return fn(self.x)
      except (Xlib.error.ConnectionClosedError, OSError):
        self.x = Xlib.display.Display(self.display_name)
        return fn(self.x)

  def screen_size(self):
    def size(d):
      screen = d.screen()
      return screen.width_in_pixels, screen.height_in_pixels
    return self.with_x(size)

  def cursor(self):
    """(RGBA image, top-left x, y) of the mouse cursor, or None."""

    def grab(d):
      if not d.has_extension('XFIXES'):
        return None
      d.xfixes_query_version()
      c = d.xfixes_get_cursor_image(d.screen().root)
      if not c.width or not c.height:
        return None
      data = struct.pack(f'={len(c.cursor_image)}I', *c.cursor_image)
      raw = 'BGRA' if sys.byteorder == 'little' else 'ARGB'
      image = Image.frombytes('RGBA', (c.width, c.height), data, 'raw', raw)
      return image, c.x - c.xhot, c.y - c.yhot
    try:
      return self.with_x(grab)
    except Exception:  # pylint: disable=broad-except
      return None  # the cursor is optional

  def close_windows_and_release_input(self):
    """Disconnects every managed window's client; releases keys, buttons."""

    def run(d):
      root = d.screen().root
      clients = root.get_full_property(d.intern_atom('_NET_CLIENT_LIST'),
                                       Xlib.X.AnyPropertyType)
      catch = Xlib.error.CatchError()
      for window in (clients.value if clients else []):
        d.create_resource_object('window', window).kill_client(onerror=catch)
      keymap = d.query_keymap()
      for i, byte in enumerate(keymap):
        for bit in range(8):
          if byte >> bit & 1:
            xtest.fake_input(d, Xlib.X.KeyRelease, i * 8 + bit)
      mask = root.query_pointer().mask
      for button in range(1, 6):
        if mask & (Xlib.X.Button1Mask << (button - 1)):
          xtest.fake_input(d, Xlib.X.ButtonRelease, button)
      screen = d.screen()
      root.warp_pointer(screen.width_in_pixels // 2,
                        screen.height_in_pixels // 2)
      d.sync()
    self.with_x(run)


def _signal(pid_or_group):
  try:
    os.kill(pid_or_group, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


# -- handlers -----------------------------------------------------------------

def _command(data):
  """(command, shell) of an /execute or /setup/launch body, OSWorld's way."""
  if not isinstance(data, dict):
    raise RequestError(400, 'expected a JSON object body')
  shell = bool(data.get('shell', False))
  command = data.get('command', '' if shell else [])
  if isinstance(command, str) and not shell:
    command = shlex.split(command)
  if isinstance(command, list):
    command = [str(a) for a in command]
  if not command:
    raise RequestError(400, 'no "command" given')
  if shell and isinstance(command, list):
    command = ' '.join(shlex.quote(a) for a in command)
  return command, shell


def _expand(path, home):
  if path == '~' or path.startswith('~/'):
    path = home + path[1:]
  return os.path.join(home, path)  # relative paths: from home, as apps see


def _read_capped(f):
  f.seek(0)
  data = f.read(OUTPUT_LIMIT + 1)
  text = data[:OUTPUT_LIMIT].decode('utf-8', errors='replace')
  return text + ('\n[output cut]' if len(data) > OUTPUT_LIMIT else '')


def execute(desk, data):
  command, shell = _command(data)
  if not shell:
    command = [_expand(a, desk.home) if a.startswith('~/') else a
               for a in command]
  timeout = float(data.get('timeout') or EXECUTE_TIMEOUT_S)
  # Files, not pipes: a command that leaves a background child holding its
  # stdout open must not make us wait for that child.
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    try:
      proc = desk.popen(command, shell, stdout=out, stderr=err)
    except OSError as e:
      return {'status': 'error', 'output': '', 'error': str(e),
              'returncode': None, 'message': str(e)}
    try:
      returncode = proc.wait(timeout)
      message = None
    except subprocess.TimeoutExpired:
      _signal(-proc.pid)
      returncode = proc.wait()
      message = f'command timed out after {timeout:g} s and was killed'
    result = {'status': 'error' if message else 'success',
              'output': _read_capped(out), 'error': _read_capped(err),
              'returncode': returncode}
  if message:
    result['message'] = message
    result['error'] += ('\n' if result['error'] else '') + message
  return result


def launch(desk, data):
  command, shell = _command(data)
  if not shell:
    command = [_expand(a, desk.home) if a.startswith('~/') else a
               for a in command]
  try:
    proc = desk.popen(command, shell, stdout=sys.stderr, stderr=sys.stderr)
  except OSError as e:
    raise RequestError(500, f'cannot launch {command!r}: {e}') from e
  return {'status': 'success', 'pid': proc.pid}


def get_file(desk, form):
  path = form.get('file_path')
  if not path:
    raise RequestError(400, 'form field "file_path" is required')
  path = _expand(path, desk.home)
  if not os.path.exists(path):
    raise RequestError(404, f'file not found: {path}')
  if os.path.isdir(path):
    raise RequestError(400, f'{path} is a directory')
  with open(path, 'rb') as f:
    return f.read()


def screenshot(desk):
  image = ImageGrab.grab(xdisplay=desk.display_name)
  cursor = desk.cursor()
  if cursor is not None:
    shape, x, y = cursor
    image.paste(shape, (x, y), shape)
  out = io.BytesIO()
  image.save(out, 'PNG', compress_level=1)
  return out.getvalue()


def reset(desk):
  started = time.monotonic()
  desk.kill_apps()
  desk.close_windows_and_release_input()
  _empty(desk.home)
  return {'status': 'success', 'seconds': round(time.monotonic() - started, 3)}


def _empty(directory):
  """Removes everything inside directory (made if missing), even read-only."""
  def writable(fn, path, _):
    parent = os.path.dirname(path)
    os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
    if os.path.isdir(path) and not os.path.islink(path):
      os.chmod(path, os.stat(path).st_mode | stat.S_IRWXU)
      shutil.rmtree(path)
    else:
      fn(path)
  os.makedirs(directory, exist_ok=True)
  os.chmod(directory, 0o755)
  for entry in os.scandir(directory):
    if entry.is_dir(follow_symlinks=False):
      shutil.rmtree(entry.path, onerror=writable)
    else:
      os.unlink(entry.path)


class Handler(http.server.BaseHTTPRequestHandler):
  """Routes a request to its handler; errors become 4xx / 500 answers."""

  desk = None  # set by serve()
  server_version = 'rla-desktop/1'

  def do_GET(self):  # pylint: disable=invalid-name
    self._route('GET')

  def do_POST(self):  # pylint: disable=invalid-name
    self._route('POST')

  def _route(self, method):
    started = time.monotonic()
    path = urllib.parse.urlsplit(self.path).path.rstrip('/') or '/'
    try:
      body = self._body() if method == 'POST' else b''
      answer = self._answer(method, path, body)
    except RequestError as e:
      answer = e.status, {'status': 'error', 'message': str(e)}
    except Exception as e:  # pylint: disable=broad-except
      answer = 500, {'status': 'error',
                     'message': f'{type(e).__name__}: {e}'}
    status, content = answer
    if isinstance(content, bytes):
      kind = ('image/png' if path == '/screenshot'
              else 'application/octet-stream')
    elif isinstance(content, str):
      content, kind = content.encode(), 'text/plain; charset=utf-8'
    else:
      content, kind = json.dumps(content).encode(), 'application/json'
    try:
      self.send_response(status)
      self.send_header('Content-Type', kind)
      self.send_header('Content-Length', str(len(content)))
      self.end_headers()
      self.wfile.write(content)
    except OSError:
      pass  # the client went away
    sys.stderr.write(f'{method} {path} {status} '
                     f'{time.monotonic() - started:.3f}s\n')

  def _body(self):
    length = int(self.headers.get('Content-Length') or 0)
    return self.rfile.read(length) if length else b''

  def _json(self, body):
    try:
      return json.loads(body or b'{}')
    except ValueError as e:
      raise RequestError(400, f'the body is not JSON: {e}') from e

  def _form(self, body):
    kind = self.headers.get('Content-Type', '')
    if kind.startswith('application/json'):
      return self._json(body)
    return dict(urllib.parse.parse_qsl(body.decode()))

  def _answer(self, method, path, body):
    desk = self.desk
    if (method, path) == ('GET', '/screenshot'):
      return 200, screenshot(desk)
    if (method, path) == ('GET', '/accessibility'):
      with desk.a11y_lock:
        return 200, {'AT': desktop_a11y.accessibility_tree()}
    if method == 'POST' and path in ('/execute', '/setup/execute'):
      return 200, execute(desk, self._json(body))
    if (method, path) == ('POST', '/setup/launch'):
      return 200, launch(desk, self._json(body))
    if (method, path) == ('POST', '/file'):
      return 200, get_file(desk, self._form(body))
    if path == '/platform':
      return 200, 'Linux'
    if path == '/screen_size':
      width, height = desk.screen_size()
      return 200, {'width': width, 'height': height}
    if (method, path) == ('POST', '/local/reset'):
      return 200, reset(desk)
    raise RequestError(404, f'no endpoint {method} {path}')

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    pass  # one line per request is written by _route


def serve(args):
  """Serves until SIGTERM / SIGINT; then kills the apps it started."""
  Atspi.set_timeout(desktop_a11y.A11Y_CALL_TIMEOUT_MS,
                    2 * desktop_a11y.A11Y_CALL_TIMEOUT_MS)
  desk = Desktop(args.home, args.python, args.sandbox)
  Handler.desk = desk

  class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET6 if ':' in args.host else socket.AF_INET

  try:
    server = Server((args.host, args.port), Handler)
  except OSError as e:
    desk.close()
    sys.exit(f'desktop_server.py: cannot listen on {args.host}:{args.port}: '
             f'{e}')
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  sys.stderr.write(f'serving {desk.display_name} on http://{args.host}:'
                   f'{args.port}, home {args.home}\n')
  sys.stderr.flush()
  try:
    server.serve_forever(poll_interval=0.2)
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    desk.close()


if __name__ == '__main__':
  for prefix, uri in desktop_a11y.NS.items():
    ET.register_namespace(prefix, uri)
  serve(parse_args(sys.argv[1:]))
