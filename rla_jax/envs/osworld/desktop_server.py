"""The OSWorld controller's HTTP API for a local desktop (no VM).

  /usr/bin/python3 desktop_server.py --socket /tmp/rla_desktop_99/server.sock \
      --home /tmp/rla_desktop_99/home --python .venv/bin/python

launch/desktop.sh starts it inside a desktop (Xvfb, D-Bus, the AT-SPI bus,
openbox) whose DISPLAY, XAUTHORITY and DBUS_SESSION_BUS_ADDRESS it
inherits. It answers OSWorld's `PythonController` and `SetupController`
with the same paths and JSON as OSWorld's desktop_env/server/main.py
(handlers past the first block live in desktop_setup.py, next to it):

  GET  /screenshot     PNG of the whole screen, mouse cursor drawn in
  GET  /accessibility  {"AT": xml}: the AT-SPI tree of every application
  POST /execute        {"command": list | str, "shell": bool, "timeout": s}
   and /setup/execute  -> {"status", "output", "error", "returncode"}; a
                       command that cannot run or times out answers status
                       "error" (HTTP 200: the command failed, not the server)
  GET  /platform       "Linux"
  POST /screen_size    {"width", "height"}
  POST /local/reset    ours, the stand-in for a VM snapshot revert
                       ({"network": bool}, the next task's: default off): kills
                       what was started here, closes the remaining windows,
                       releases held keys and buttons, ends a recording,
                       clears the wallpaper and empties --home

  POST /setup/launch   {"command", "shell"}: start an app in the background
  POST /execute_with_verification (and /setup/...)  {"command", "shell",
                       "verification": {"window_exists", "command_success"},
                       "max_wait_time", "check_interval"}: 500 if unverified
  POST /run_python     {"code"} -> {"status", "message", "output", "error",
                       "return_code", "need_more"}, 30 s
  POST /run_bash_script  {"script", "timeout", "working_dir"} -> {"status",
                       "output" (stderr merged in), "error": "", "returncode"}
  GET  /terminal       {"output": text of the focused a11y terminal | null}
  GET  /cursor_position  [x, y]
  POST /file           form file_path -> the file's bytes (see below)
  POST /setup/upload   multipart file_path + file_data: writes the file
  POST /list_directory {"path"} -> {"directory_tree": nested dicts}
  POST /desktop_path   {"desktop_path"}, 404 without ~/Desktop
  POST /window_size    form app_class_name -> {"width", "height"}
  POST /setup/open_file  {"path"}: opens it with its app (.desktop entries)
                       and waits for its window; a bare app name starts it
  POST /setup/activate_window, /setup/close_window  {"window_name",
                       "strict", "by_class"}: wmctrl's matching, via EWMH
  POST /setup/change_wallpaper  {"path"}: painted as the root background
  POST /wallpaper      the picture set, 404 if none
  POST /start_recording, /end_recording  ffmpeg x11grab -> MP4 bytes; 501
                       when ffmpeg is not installed
  POST /setup/download_file  501: needs the internet (upload files instead)

Paths in requests name files as the apps see them: relative or `~` from
the home, absolute under the apps' HOME, OSWorld's /home/user or --home;
anything out of the home (`..`, other absolute paths, symlinks leading
out) is refused with 403; /file serves regular files only (FIFOs,
devices, sockets refused at once), up to 64 MB. Request bodies are capped
(1 MB, 64 MB for uploads); a bad Content-Length answers 400 (413 when
over the cap) before anything is read, and a client that stalls is
dropped after 30 s without holding up others (a thread per connection).

Commands run with `python` / `python3` the --python interpreter (a venv
with pyautogui). An agent drives the apps, so each of them and every
command runs in a jail of its own (desktop_jail.py: the system read-only,
--home writable at /home/user, no network unless the task asks, an
allowlisted environment, its own PID namespace). A reset kills the jails,
and with them every process inside, however it detached; processes of
--no-sandbox (as is) are found by RLA_DESKTOP_APP=<this server's id> in
their environment.

It runs with the system python3 (pyatspi is a Debian package) and imports
only the standard library, pyatspi (desktop_a11y.py, next to it, as are
desktop_jail.py and desktop_setup.py), PIL and Xlib. Anyone who reaches it
can run any command, so it listens on a unix socket only (no TCP), made 0600
in a directory that must be ours and closed to others (desktop.sh's 0700 run
dir): no other uid can connect, nor bind an impostor there after we die.
"""

import argparse
from concurrent import futures
import http.server
import io
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET

import desktop_a11y  # this folder (the script's): pyatspi first
import desktop_jail  # this folder too
import desktop_setup  # this folder too
import desktop_windows  # this folder too
from gi.repository import Atspi  # pylint: disable=wrong-import-order
from PIL import ImageGrab
import Xlib.display
import Xlib.error
import Xlib.X

RESET_WAIT_S = 3.0
REQUEST_TIMEOUT_S = 30.0  # a client that stalls this long is dropped
TAG_VAR = 'RLA_DESKTOP_APP'


RequestError = desktop_setup.RequestError


def parse_args(argv):
  """Flags, with the socket's folder checked private and --home safe."""
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--socket', required=True, help='the unix socket to listen '
                 'on; its folder must be ours with no group or other access')
  p.add_argument('--listen-fd', type=int, help='serve the unix socket '
                 'already bound and listening on this fd (desktop.sh binds '
                 '--socket for a root-started desktop, whose uid may not '
                 'enter its folder)')
  p.add_argument('--home', required=True)
  p.add_argument('--trainer-home', help='the home\'s path on the trainer\'s '
                 'side, where /file and the like may name it (a root-started '
                 'desktop sees its home at /run/rla/home)')
  p.add_argument('--python', default=sys.executable)
  p.add_argument('--no-sandbox', dest='sandbox', action='store_false',
                 help='run apps and commands with the host writable (by '
                 'default they run under bubblewrap: the filesystem read-only '
                 'but for --home and the desktop\'s run dir)')
  args = p.parse_args(argv)
  if args.sandbox and not shutil.which('bwrap'):
    p.error('apps run under bubblewrap, which is not installed (apt-get '
            'install bubblewrap), or pass --no-sandbox')
  args.socket = os.path.abspath(args.socket)
  problem = (args.listen_fd is None
             and _private_dir_problem(os.path.dirname(args.socket)))
  if problem:
    p.error(f'refusing --socket {args.socket}: this server runs any command '
            f'it is sent, so its folder must be ours and closed to others '
            f'(0700); it is {problem}')
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


def _private_dir_problem(folder):
  """Why folder may not hold our socket, or None when it may.

  A 0700 folder of ours is one that no other uid can enter (to connect) or
  write (to bind a socket of its own after we died).
  """
  try:
    st = os.lstat(folder)
  except OSError as e:
    return f'not there ({e.strerror})'
  if not stat.S_ISDIR(st.st_mode):
    return 'not a directory'
  if st.st_uid != os.geteuid():
    return f'owned by uid {st.st_uid}, not by us (uid {os.geteuid()})'
  if st.st_mode & 0o077:
    return f'mode {stat.S_IMODE(st.st_mode):o}, open to group or others'
  return None


class Desktop:
  """What the handlers share: the X connection, the apps started, the lock."""

  def __init__(self, home, python, sandbox=True, trainer_home=None):
    self.home, self.python = home, python
    self.trainer_home = trainer_home  # the home's path outside, if another
    self.sandbox = sandbox
    self.python_roots = desktop_jail.python_roots(python)
    self.network = False  # the current task's (POST /local/reset)
    self.tag = uuid.uuid4().hex
    os.makedirs(home, exist_ok=True)
    self.bin_dir = tempfile.mkdtemp(  # in desktop.sh's run dir if any
        prefix='rla_desktop_bin_', dir=os.environ.get('RLA_DESKTOP_STATE'))
    os.chmod(self.bin_dir, 0o755)  # read by the jails, which hold no groups
    for name in ('python', 'python3'):  # for shell commands and scripts
      path = os.path.join(self.bin_dir, name)
      with open(path, 'w') as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
      os.chmod(path, 0o755)
    self.display_name = os.environ.get('DISPLAY', ':0')
    self.x = Xlib.display.Display(self.display_name)
    if sandbox:
      desktop_jail.write_identity(self.bin_dir)  # bound at /etc/passwd, group
      # The agent drives these apps: each command gets a jail of its own
      # (desktop_jail.py) with an allowlisted environment.
      self.environ = dict(os.environ)
      bus = self._a11y_bus()
      if bus:
        self.environ['AT_SPI_BUS_ADDRESS'] = bus
      self.env = desktop_jail.environment(self.environ, {TAG_VAR: self.tag})
      self.host_path = os.pathsep.join((self.bin_dir, '/usr/local/bin',
                                        '/usr/bin', '/bin'))
    else:
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
      self.host_path = self.env['PATH']
    self.x_lock = threading.Lock()
    self.a11y_lock = threading.Lock()
    self.procs_lock = threading.Lock()
    self.procs = []  # Popen of /setup/launch and running /execute commands
    self.groups = set()  # their process groups
    self.spawner = futures.ThreadPoolExecutor(1, thread_name_prefix='spawn')

  def _a11y_bus(self):
    """The AT-SPI bus address the launcher put on the root window, or ''."""
    try:
      value = self.x.screen().root.get_full_property(
          self.x.intern_atom('AT_SPI_BUS'), Xlib.X.AnyPropertyType)
    except Xlib.error.XError:
      return ''
    data = value.value if value else b''
    return data.decode() if isinstance(data, bytes) else str(data or '')

  def close(self):
    try:
      self.kill_apps()
    finally:
      shutil.rmtree(self.bin_dir, ignore_errors=True)

  # -- processes ------------------------------------------------------------

  def program(self, name):
    """The host path of program `name` where the apps find it, or None."""
    return shutil.which(name, path=self.host_path)

  def popen(self, command, shell, **kwargs):
    """Starts command in its own process group, in the apps' environment
    (and, sandboxed, in a jail of its own: desktop_jail.py, whose process
    lives on while anything the command started runs; the object returned
    waits for the command alone)."""
    if not shell and command and command[0] in ('python', 'python3'):
      command = [self.python] + command[1:]
    status = None
    if self.sandbox:
      if not shell and not self.program(command[0]):
        raise FileNotFoundError(f'no program {command[0]!r}')
      status, status_w = os.pipe()
      command = desktop_jail.command(
          ['/bin/sh', '-c', command] if shell else list(command),
          home=self.home, bin_dir=self.bin_dir, identity_dir=self.bin_dir,
          python_roots=self.python_roots, environ=self.environ,
          status_fd=status_w, network=self.network)
      shell = False
      kwargs['pass_fds'] = (status_w,)
    try:
      # From one long-lived thread: bwrap's --die-with-parent fires when the
      # thread that started it ends, and a request's thread ends with it.
      proc = self.spawner.submit(
          subprocess.Popen, command, shell=shell, cwd=self.home, env=self.env,
          stdin=subprocess.DEVNULL, start_new_session=True, **kwargs).result()
    except BaseException:
      if status is not None:
        os.close(status)
      raise
    finally:
      if status is not None:
        os.close(status_w)
    with self.procs_lock:
      self.procs = [p for p in self.procs if p.poll() is None]
      self.procs.append(proc)
      self.groups.add(proc.pid)
    return proc if status is None else desktop_jail.Jailed(proc, status)

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

    A jailed command's bwrap takes its whole PID namespace with it (the
    jail's init dies with it), so nothing started inside survives, however
    it detached; rounds repeat until no process is left in those
    namespaces and none carries our tag (unsandboxed apps, and a child
    forked while we kill).
    """
    with self.procs_lock:
      procs, self.procs = self.procs, []
      groups, self.groups = self.groups, set()
    jails = desktop_jail.pid_namespaces(p.pid for p in procs if p.poll() is None)
    own = os.getpgid(0)
    deadline = time.monotonic() + RESET_WAIT_S
    while True:
      for proc in procs:  # reap our children (and send their groups SIGKILL)
        if proc.poll() is None:
          desktop_jail.kill(-proc.pid)
      victims = self.tagged()
      victims.update(desktop_jail.members(jails))
      if not victims:
        return
      if time.monotonic() > deadline:
        raise RuntimeError(f'processes {sorted(victims)} outlived SIGKILL '
                           f'for {RESET_WAIT_S} s')
      for pid, group in victims.items():
        if group in groups and group != own:
          desktop_jail.kill(-group)
        desktop_jail.kill(pid)
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


# -- handlers -----------------------------------------------------------------

def screenshot(desk):
  image = ImageGrab.grab(xdisplay=desk.display_name)
  cursor = desktop_windows.cursor(desk)
  if cursor is not None:
    shape, x, y = cursor
    image.paste(shape, (x, y), shape)
  out = io.BytesIO()
  image.save(out, 'PNG', compress_level=1)
  return out.getvalue()


def reset(desk, data=None):
  """Back to a fresh episode; `data['network']` (default false) says
  whether the next task's apps may reach the network."""
  network = (data or {}).get('network', False)
  if not isinstance(network, bool):
    raise RequestError(400, f'"network" must be true or false, not '
                       f'{network!r}')
  started = time.monotonic()
  desktop_setup.reset(desk)
  desk.kill_apps()
  desk.network = network
  desktop_windows.close_windows_and_release_input(desk)
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
  """Routes a request to its handler; errors become 4xx / 500 answers.

  Fails safe: a body is read only when its Content-Length is a number
  within the endpoint's cap (else 400 / 413 at once, before reading), and
  a client that stalls is dropped after `timeout` s (the server runs a
  thread per connection, so it never holds up other requests).
  """

  desk = None  # set by serve()
  server_version = 'rla-desktop/1'
  timeout = REQUEST_TIMEOUT_S  # per socket read and write

  def do_GET(self):  # pylint: disable=invalid-name
    self._route('GET')

  def do_POST(self):  # pylint: disable=invalid-name
    self._route('POST')

  def _route(self, method):
    started = time.monotonic()
    path = urllib.parse.urlsplit(self.path).path.rstrip('/') or '/'
    try:
      body = self._body(path) if method == 'POST' else b''
      answer = self._answer(method, path, body)
    except RequestError as e:
      answer = e.status, {'status': 'error', 'message': str(e)}
    except TimeoutError:
      answer = 408, {'status': 'error', 'message': 'the request body did not '
                     f'arrive within {self.timeout} s'}
    except Exception as e:  # pylint: disable=broad-except
      answer = 500, {'status': 'error',
                     'message': f'{type(e).__name__}: {e}'}
    status, content, kind = (tuple(answer) + (None,))[:3]
    self._send(status, content, kind, path)
    sys.stderr.write(f'{method} {path} {status} '
                     f'{time.monotonic() - started:.3f}s\n')

  def _send(self, status, content, kind, path):
    if isinstance(content, bytes):
      kind = kind or ('image/png' if path == '/screenshot'
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
      pass  # the client went away or stalled

  def _body(self, path):
    """The request body; RequestError before reading if it is malformed."""
    if self.headers.get('Transfer-Encoding'):
      raise RequestError(400, 'chunked bodies are not supported: send a '
                         'Content-Length')
    length = self.headers.get('Content-Length')
    if length is None:
      return b''  # POST without a body
    if not re.fullmatch(r'[0-9]+', length.strip()):
      raise RequestError(400, f'bad Content-Length {length!r}')
    length, limit = int(length), desktop_setup.body_limit(path)
    if length > limit:
      raise RequestError(413, f'a body of {length} bytes is over the '
                         f'{limit} this endpoint takes')
    body = self.rfile.read(length) if length else b''
    if len(body) < length:
      raise RequestError(400, f'the body ended after {len(body)} of '
                         f'{length} bytes')
    return body

  def _answer(self, method, path, body):
    desk = self.desk
    request = desktop_setup.Request(self.headers.get('Content-Type'), body)
    if (method, path) == ('GET', '/screenshot'):
      return 200, screenshot(desk)
    if (method, path) == ('GET', '/accessibility'):
      with desk.a11y_lock:
        return 200, {'AT': desktop_a11y.accessibility_tree()}
    if method == 'POST' and path in ('/execute', '/setup/execute'):
      return 200, desktop_setup.execute(desk, request.json())
    if path == '/platform':
      return 200, 'Linux'
    if path == '/screen_size':
      width, height = desk.screen_size()
      return 200, {'width': width, 'height': height}
    if (method, path) == ('POST', '/local/reset'):
      return 200, reset(desk, request.json())
    answer = desktop_setup.answer(desk, method, path, request)
    if answer is None:
      raise RequestError(404, f'no endpoint {method} {path}')
    return answer

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    pass  # one line per request is written by _route

  def address_string(self):
    return 'unix'  # an AF_UNIX peer has no address ('' not a (host, port))


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
  """A thread per connection on a unix socket: a stalled client holds up
  no one."""
  daemon_threads = True


def _listen(args):
  """The server on --socket, made 0600 (or on the socket of --listen-fd)."""
  if args.listen_fd is not None:
    server = UnixServer(args.socket, Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = socket.socket(fileno=args.listen_fd)
    return server
  umask = os.umask(0o177)
  try:
    return UnixServer(args.socket, Handler)
  finally:
    os.umask(umask)


def serve(args):
  """Serves until SIGTERM / SIGINT; then kills the apps it started."""
  Atspi.set_timeout(desktop_a11y.A11Y_CALL_TIMEOUT_MS,
                    2 * desktop_a11y.A11Y_CALL_TIMEOUT_MS)
  desk = Desktop(args.home, args.python, args.sandbox, args.trainer_home)
  Handler.desk = desk

  where = args.socket
  try:
    server = _listen(args)
  except OSError as e:
    desk.close()
    sys.exit(f'desktop_server.py: cannot listen on unix socket {where}: {e}')
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  sys.stderr.write(f'serving {desk.display_name} on unix socket {where}, '
                   f'home {args.home}\n')
  sys.stderr.flush()
  try:
    server.serve_forever(poll_interval=0.2)
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    _unlink(args.socket)
    desktop_setup.close()
    desk.close()


def _unlink(path):
  try:
    os.unlink(path)
  except OSError:
    pass


if __name__ == '__main__':
  for prefix, uri in desktop_a11y.NS.items():
    ET.register_namespace(prefix, uri)
  serve(parse_args(sys.argv[1:]))
