"""OSWorld's controller endpoints beyond the basics, for desktop_server.py.

The rest of OSWorld's desktop_env/server/main.py, with its paths and JSON,
as its `PythonController` and `SetupController` call them: scripts,
windows, the wallpaper, directory listings, uploads, recording (the table
is in desktop_server.py's docstring). What needs a VM, a cloud account or
the internet answers HTTP 501 with the reason, never a silent 404.
SetupController's Chrome, Google Drive, login, proxy and browsing-history
steps never reach this server (they talk to Chrome's debugging port or the
internet), so they have no endpoint here.

It runs on the training host rather than in a throwaway VM, so every
path a request names must lie in the desktop's home (desktop_files.py), and
commands (scripts, openers, verification checks) run through the server's
`Desktop.popen`, in the apps' jail with their HOME, exactly as /execute runs
them; only window queries, the wallpaper and recording use the server's own
X connection (desktop_windows.py).

Imports only the standard library and the two modules next to it: the
system python3 runs it.
"""

import configparser
import glob
import json
import mimetypes
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.parse


import desktop_files  # this folder (the script's)
import desktop_jail
import desktop_windows

UPLOAD_LIMIT = 64 << 20  # bytes of a /setup/upload body: what /file serves
BODY_LIMIT = 1 << 20  # bytes of any other request body (JSON, forms)
ARG_LIMIT = 100_000  # bytes of a script, passed as one argv string
EXECUTE_TIMEOUT_S = 120.0  # OSWorld's
RUN_PYTHON_TIMEOUT_S = 30.0  # OSWorld's
BASH_TIMEOUT_S = 100.0  # OSWorld's default for /run_bash_script
MAX_TIMEOUT_S = 600.0  # a longer timeout in a request is cut to this
OPEN_TIMEOUT_S = 120.0  # /setup/open_file waits this long for its window
CHECK_TIMEOUT_S = 5.0  # one command_success check (OSWorld's)
OUTPUT_LIMIT = 4 << 20  # bytes of stdout / stderr returned
APP_DIRS = ('/usr/local/share/applications', '/usr/share/applications')
NO_INTERNET = ('this local desktop has no internet access; put the file in '
               'the cache and send it with /setup/upload instead')


RequestError = desktop_files.RequestError


class Request:
  """A request's body, decoded the way its endpoint expects."""

  def __init__(self, content_type, body):
    self.content_type, self.body = content_type or '', body

  def json(self):
    try:
      data = json.loads(self.body or b'{}')
    except ValueError as e:
      raise desktop_files.RequestError(400, f'the body is not JSON: {e}') from e
    if not isinstance(data, dict):
      raise desktop_files.RequestError(400, 'expected a JSON object body')
    return data

  def form(self):
    """Fields of a urlencoded form (or of a JSON object, as some send)."""
    if self.content_type.startswith('application/json'):
      return self.json()
    if self.content_type.startswith('multipart/form-data'):
      return {k: v.decode(errors='replace')
              for k, v in self.multipart().items()}
    return dict(urllib.parse.parse_qsl(self.body.decode(errors='replace')))

  def multipart(self):
    """{name: bytes} of a multipart/form-data body (files and fields)."""
    found = re.search(r'boundary="?([^";]+)"?', self.content_type)
    if not found:
      raise desktop_files.RequestError(400, 'expected a multipart/form-data body with a '
                         'boundary')
    fields = {}
    for part in self.body.split(b'--' + found.group(1).encode())[1:]:
      if part.startswith(b'--'):
        break
      head, sep, value = part.partition(b'\r\n\r\n')
      name = re.search(rb'[;\s]name="([^"]*)"', head)
      if sep and name:
        fields[name.group(1).decode(errors='replace')] = (
            value[:-2] if value.endswith(b'\r\n') else value)
    return fields


def body_limit(path):
  """Bytes a request body to path may hold."""
  return UPLOAD_LIMIT if path == '/setup/upload' else BODY_LIMIT


# -- commands -------------------------------------------------------------

def command_of(data):
  """(command, shell) of an /execute-style body, OSWorld's way."""
  shell = bool(data.get('shell', False))
  command = data.get('command', '' if shell else [])
  if isinstance(command, str) and not shell:
    command = shlex.split(command)
  if isinstance(command, list):
    command = [str(a) for a in command]
  if not command or not isinstance(command, (str, list)):
    raise desktop_files.RequestError(400, 'no "command" given')
  if shell and isinstance(command, list):
    command = ' '.join(shlex.quote(a) for a in command)
  return command, shell


def expand(path, home):
  """path with a leading ~ as home; relative paths from home, as apps see."""
  if path == '~' or path.startswith('~/'):
    path = home + path[1:]
  return os.path.join(home, path)


def number(data, key, default, low=0.1, high=MAX_TIMEOUT_S):
  """data[key] (default if absent) as a float clipped to [low, high]."""
  try:
    value = float(data.get(key) or default)
  except (TypeError, ValueError) as e:
    raise desktop_files.RequestError(400, f'bad "{key}": {data.get(key)!r}') from e
  return min(max(value, low), high)


def _read_capped(f):
  f.seek(0)
  data = f.read(OUTPUT_LIMIT + 1)
  text = data[:OUTPUT_LIMIT].decode('utf-8', errors='replace')
  return text + ('\n[output cut]' if len(data) > OUTPUT_LIMIT else '')


def run_captured(desk, command, shell, timeout, merge=False):
  """(returncode, stdout, stderr, timed_out) of a command run in the jail.

  Its output goes to files, not pipes: a command that leaves a background
  child holding stdout open must not make us wait for that child. A
  command that outlives timeout is killed with its process group
  (returncode then is the kill's). OSError if it cannot start.
  """
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    proc = desk.popen(command, shell, stdout=out,
                      stderr=out if merge else err)
    try:
      return proc.wait(timeout), _read_capped(out), _read_capped(err), False
    except subprocess.TimeoutExpired:
      desktop_jail.kill(-proc.pid)
      return proc.wait(), _read_capped(out), _read_capped(err), True


def _apps_argv(desk, command, shell):
  if not shell:
    command = [expand(a, desktop_files.apps_home(desk)) if a.startswith('~/') else a
               for a in command]
  return command


def execute(desk, data):
  """/execute: runs a command to its end; status 'error' if it could not."""
  command, shell = command_of(data)
  timeout = number(data, 'timeout', EXECUTE_TIMEOUT_S)
  try:
    code, out, err, timed_out = run_captured(
        desk, _apps_argv(desk, command, shell), shell, timeout)
  except OSError as e:
    return {'status': 'error', 'output': '', 'error': str(e),
            'returncode': None, 'message': str(e)}
  result = {'status': 'success', 'output': out, 'error': err,
            'returncode': code}
  if timed_out:
    message = f'command timed out after {timeout:g} s and was killed'
    result.update(status='error', message=message,
                  error=err + ('\n' if err else '') + message)
  return result


def run_python(desk, request):
  """/run_python {code}: the code in the apps' python, OSWorld's answer."""
  code = request.json().get('code')
  if not code or not isinstance(code, str):
    return 400, {'status': 'error', 'message': 'Code not supplied!'}
  _check_arg(code, 'code')
  try:
    returncode, out, err, timed_out = run_captured(
        desk, ['python', '-c', code], False, RUN_PYTHON_TIMEOUT_S)
  except OSError as e:
    return 500, {'status': 'error', 'message': f'Execution error: {e}',
                 'error': str(e), 'need_more': False, 'output': None}
  if timed_out:
    return 500, {'status': 'error', 'message': 'Execution timeout: Code '
                 f'took longer than {RUN_PYTHON_TIMEOUT_S:g} s',
                 'error': 'TimeoutExpired', 'need_more': False,
                 'output': None}
  if returncode and not err:
    err = f'Process exited with code {returncode}'
  return 200, {'status': 'error' if returncode else 'success',
               'message': '\n'.join(s for s in (out, err) if s),
               'need_more': False, 'output': out, 'error': err,
               'return_code': returncode}


def run_bash_script(desk, request):
  """/run_bash_script {script, timeout, working_dir}: stderr merged in."""
  data = request.json()
  script = data.get('script')

  def failed(status, output):
    return status, {'status': 'error', 'output': output, 'error': '',
                    'returncode': -1}
  if not script or not isinstance(script, str):
    return failed(400, 'Script not supplied!')
  _check_arg(script, 'script')
  timeout = number(data, 'timeout', BASH_TIMEOUT_S)
  folder = data.get('working_dir')
  if folder:
    try:
      seen = desktop_files.apps_path(desk, desktop_files.host_path(desk, folder))
    except desktop_files.RequestError:  # outside the home: the system's, as the jail has
      seen = folder if os.path.isabs(folder) else None
    if seen is None or not os.path.isdir(desktop_files.to_host(desk, seen)):
      return failed(400, f'Working directory does not exist: {folder}')
    script = f'cd -- {shlex.quote(seen)} || exit 1\n{script}'
  try:
    code, out, _, timed_out = run_captured(
        desk, ['/bin/bash', '-c', script], False, timeout, merge=True)
  except OSError as e:
    return failed(500, f'Failed to execute script: {e}')
  if timed_out:
    return failed(500, f'Script execution timed out after {timeout:g} '
                  'seconds')
  return 200, {'status': 'error' if code else 'success', 'output': out,
               'error': '', 'returncode': code}


def _check_arg(text, what):
  if len(text.encode()) > ARG_LIMIT:
    raise desktop_files.RequestError(413, f'the {what} is over {ARG_LIMIT} bytes (it is '
                       'passed as one argument)')


def execute_with_verification(desk, request):
  """Runs a command, then polls its verification until max_wait_time."""
  data = request.json()
  result = execute(desk, data)
  if 'returncode' not in result or result['returncode'] is None:
    return 500, {'status': 'error', 'message': result.get('message')}
  checks = data.get('verification') or {}
  if not checks:
    return 200, result
  wait = number(data, 'max_wait_time', 10.0, low=0.0)
  interval = number(data, 'check_interval', 1.0, low=0.05, high=10.0)
  started = time.monotonic()
  while True:
    waited = time.monotonic() - started
    if _verified(desk, checks):
      return 200, dict(result, verification='passed', wait_time=waited)
    if waited >= wait:
      return 500, dict(result, status='verification_failed',
                       verification='failed', wait_time=wait)
    time.sleep(interval)


def _verified(desk, checks):
  """Whether a window and a command of checks exist and succeed."""
  title = checks.get('window_exists')
  if title and not any(str(title).lower() in w[1].lower()
                       for w in desktop_windows.windows(desk)):
    return False
  check = checks.get('command_success')
  if check:
    try:
      code, _, _, timed_out = run_captured(desk, str(check), True,
                                           CHECK_TIMEOUT_S)
    except OSError:
      return False
    return code == 0 and not timed_out
  return True


def launch(desk, request):
  """/setup/launch: starts an app in the background (it lives to a reset)."""
  command, shell = command_of(request.json())
  command = _apps_argv(desk, command, shell)
  try:
    proc = desk.popen(command, shell, stdout=sys.stderr, stderr=sys.stderr)
  except OSError as e:
    raise desktop_files.RequestError(500, f'cannot launch {command!r}: {e}') from e
  return 200, {'status': 'success', 'pid': proc.pid}


# -- opening files --------------------------------------------------------

def _opener(path):
  """argv (its Exec line) of an installed app that opens path's type."""
  kind = mimetypes.guess_type(path)[0] or 'application/octet-stream'
  wanted = [kind] + (['text/plain'] if kind.startswith('text/') else [])
  entries = []
  for folder in APP_DIRS:
    entries += sorted(glob.glob(os.path.join(folder, '*.desktop')))
  for want in wanted:
    for entry in entries:
      parser = configparser.ConfigParser(interpolation=None, strict=False)
      try:
        parser.read(entry, encoding='utf-8')
        app = parser['Desktop Entry']
      except (configparser.Error, KeyError, UnicodeDecodeError):
        continue
      if want in app.get('MimeType', '').split(';') and app.get('Exec'):
        return _exec_argv(app['Exec'], path)
  raise desktop_files.RequestError(501, f'no installed application opens {kind} files '
                     f'(no .desktop entry in {", ".join(APP_DIRS)} lists it)')


def _exec_argv(line, path):
  """A desktop entry's Exec line with its field codes filled for path."""
  argv, placed = [], False
  for arg in shlex.split(line):
    if arg in ('%f', '%F', '%u', '%U'):
      argv.append(path)
      placed = True
    elif not re.fullmatch(r'%[a-zA-Z]', arg):
      argv.append(arg.replace('%%', '%'))
  return argv if placed else argv + [path]


def open_file(desk, request):
  """/setup/open_file {path}: opens a file (or starts an app), waits for it.

  Returns once a window whose title holds the file's name appears, and
  activates it, as OSWorld's server does; 500 after OPEN_TIMEOUT_S. A
  path that is no file of the home is started as an app only when it is a
  bare name on the apps' PATH (never a path out of the home).
  """
  path = request.json().get('path')
  if not path or not isinstance(path, str):
    return 400, 'Path not supplied!'
  try:
    host = desktop_files.host_path(desk, path)
    refused = None
  except desktop_files.RequestError as e:
    host, refused = None, e
  if host and os.path.exists(host):
    seen = desktop_files.apps_path(desk, host)
    command, title = _opener(seen), os.path.basename(host)
  elif '/' not in path and desk.program(path):
    command, title = [path], os.path.basename(path)
  elif refused:
    raise refused
  else:
    return 404, f'Application/file not found: {path}'
  try:
    desk.popen(command, False, stdout=sys.stderr, stderr=sys.stderr)
  except OSError as e:
    return 500, f'Failed to open {path}. Error: {e}'
  return _await_window(desk, title)


def _await_window(desk, name):
  names = {name.lower(), os.path.splitext(name)[0].lower()}
  deadline = time.monotonic() + OPEN_TIMEOUT_S
  while time.monotonic() < deadline:
    for wid, title, _ in desktop_windows.windows(desk):
      if any(n in title.lower() for n in names):
        desktop_windows.activate(desk, wid)
        return 200, 'File opened and window activated successfully'
    time.sleep(0.2)
  return 500, (f'Failed to find window for {name} within '
               f'{OPEN_TIMEOUT_S:g} seconds.')


# -- the rest -------------------------------------------------------------

def close():
  """Ends a recording still running (the server is stopping)."""
  desktop_windows.stop_recording()


def _not_here(reason):
  def answer(desk, request):
    del desk, request
    return 501, {'status': 'error', 'message': reason}
  return answer


def reset(desk):
  """The part of /local/reset that is ours: no recording, no wallpaper."""
  close()
  if desktop_windows.STATE.wallpaper is not None:
    desktop_windows.STATE.wallpaper = None
    desk.with_x(desktop_windows.unpaint_root)


ROUTES = {
    ('GET', '/terminal'): desktop_windows.terminal,
    ('GET', '/cursor_position'): desktop_windows.cursor_position,
    ('POST', '/file'): desktop_files.get_file,
    ('POST', '/window_size'): desktop_windows.window_size,
    ('POST', '/desktop_path'): desktop_files.desktop_path,
    ('POST', '/wallpaper'): desktop_windows.wallpaper,
    ('POST', '/list_directory'): desktop_files.list_directory,
    ('POST', '/run_python'): run_python,
    ('POST', '/run_bash_script'): run_bash_script,
    ('POST', '/start_recording'): desktop_windows.start_recording,
    ('POST', '/end_recording'): desktop_windows.end_recording,
    ('POST', '/execute_with_verification'): execute_with_verification,
    ('POST', '/setup/execute_with_verification'): execute_with_verification,
    ('POST', '/setup/launch'): launch,
    ('POST', '/setup/upload'): desktop_files.upload,
    ('POST', '/setup/open_file'): open_file,
    ('POST', '/setup/activate_window'): desktop_windows.activate_window,
    ('POST', '/setup/close_window'): desktop_windows.close_window,
    ('POST', '/setup/change_wallpaper'): desktop_windows.change_wallpaper,
    ('POST', '/setup/download_file'): _not_here(
        f'/setup/download_file needs the internet: {NO_INTERNET}'),
}


def answer(desk, method, path, request):
  """(status, content[, content type]) of an endpoint here, else None."""
  handler = ROUTES.get((method, path))
  return None if handler is None else handler(desk, request)
