"""The jail every app and command of a local desktop runs in (bubblewrap).

The agent drives these apps, so anything it types into a terminal is
untrusted code. Each command the server starts gets a jail of its own:

- New user, PID, IPC and cgroup namespaces, and no network unless the
  task asks for it. The jail's PID 1 is bwrap's init, which dies with the
  server (--die-with-parent); killing the command's bwrap ends every
  process in the jail, however it detached (setsid, double fork, env -i),
  so a reset that kills what it started leaves nothing behind.
- It runs with the server's uid in a user namespace of its own, with
  every capability dropped. Under a root trainer, desktop.sh runs the
  whole desktop as an unprivileged host uid of its own (uid 1000 of a
  user namespace root made, with nothing else mapped), so the jails nest
  there as that uid: not root anywhere, and no file of root's is theirs.
- What it sees: the system's programs and libraries read-only (/usr, /bin,
  /lib*, /etc), the desktop's home writable at /home/user (OSWorld's path,
  so benchmark task JSONs work unchanged), a private /tmp and /run, the X
  socket and the buses' sockets read-only, and the apps' python read-only.
  Nothing of the training user: no /root, /home/*, repository, workdir,
  checkpoints or run dir (where the buses' service files, pid files and
  the window manager's config live: nothing the jail can write is read as
  code or config outside it).
- Its environment is an allowlist (DISPLAY, XAUTHORITY, the buses, HOME,
  PATH, LANG, ...), never the server's (API keys, tokens).

Standard library only: desktop_server.py runs with the system python3.
"""

import os
import select
import shutil
import signal
import subprocess
import threading

HOME = '/home/user'  # the home as the apps see it (OSWorld's)
_XAUTHORITY = '/run/rla/Xauthority'
_BIN = '/run/rla/bin'  # `python` / `python3` wrappers
_RUNTIME = '/run/user/jail'  # XDG_RUNTIME_DIR: private per command
_SYSTEM = ('/usr', '/etc', '/bin', '/sbin', '/lib', '/lib32', '/lib64',
           '/libx32')
# Variables of the server's environment that reach the apps, when set.
PASSED = ('DISPLAY', 'DBUS_SESSION_BUS_ADDRESS', 'AT_SPI_BUS_ADDRESS', 'LANG',
          'LC_ALL', 'TZ', 'XDG_SESSION_TYPE', 'QT_ACCESSIBILITY',
          'QT_LINUX_ACCESSIBILITY_ALWAYS_ON')


def socket_paths(environ) -> list[str]:
  """The unix socket paths the apps must reach: X and both buses."""
  paths = []
  display = environ.get('DISPLAY', '')
  if display.startswith(':'):
    number = display[1:].split('.')[0]
    paths.append(f'/tmp/.X11-unix/X{number}')
  for name in ('DBUS_SESSION_BUS_ADDRESS', 'AT_SPI_BUS_ADDRESS'):
    for part in environ.get(name, '').split(';'):
      for field in part.split(','):
        if field.startswith('unix:path='):
          paths.append(field[len('unix:path='):])
  return paths


def write_identity(folder: str):
  """The jail's passwd and group files, in `folder`: the host's, without
  the `tty` group, which is not mapped in the jail's user namespace: xterm
  gives up when it cannot hand its pty to that group, and without the
  group it keeps its own."""
  for name in ('passwd', 'group'):
    try:
      with open(f'/etc/{name}', encoding='utf-8', errors='replace') as f:
        kept = [line for line in f
                if not (name == 'group' and line.startswith('tty:'))]
    except OSError:
      kept = []
    path = os.path.join(folder, name)
    with open(path, 'w', encoding='utf-8') as f:
      f.write(''.join(kept))
    os.chmod(path, 0o644)


def environment(environ, extra=()) -> dict[str, str]:
  """The apps' environment: the allowlist of `environ`, our own paths."""
  env = {k: environ[k] for k in PASSED if k in environ}
  env.update({'HOME': HOME, 'USER': 'user', 'LOGNAME': 'user',
              'PATH': f'{_BIN}:/usr/local/bin:/usr/bin:/bin',
              'XDG_RUNTIME_DIR': _RUNTIME, 'SHELL': '/bin/sh',
              # Settings in ~/.config (emptied by a reset), not in dconf.
              'GSETTINGS_BACKEND': 'keyfile'})
  env.setdefault('LANG', 'C.UTF-8')
  if 'XAUTHORITY' in environ:
    env['XAUTHORITY'] = _XAUTHORITY
  env.update(dict(extra))
  return env


def python_roots(python: str) -> list[str]:
  """The folders the apps' python needs read-only, outside the system's:
  a venv's root and the installation its pyvenv.cfg names (e.g. pyenv's)."""
  if not os.path.isabs(python) or _system(python):
    return []
  root = os.path.dirname(os.path.dirname(python))  # <venv>/bin/python
  config = os.path.join(root, 'pyvenv.cfg')
  if not os.path.exists(config):
    return [os.path.dirname(python)]
  roots = [root]
  with open(config, encoding='utf-8', errors='replace') as f:
    for line in f:
      key, _, value = line.partition('=')
      if key.strip() == 'home' and value.strip():
        base = os.path.dirname(os.path.realpath(value.strip()))
        if not _system(base):
          roots.append(base)  # <prefix>/bin -> <prefix>
  return roots


def _system(path: str) -> bool:
  return any(path == p or path.startswith(p + '/') for p in _SYSTEM)


# The jail's PID 1: runs the command, writes its exit code to the status fd
# (argv[1]) when it ends, then reaps whatever the command left running in
# the background until nothing is left, so a background app lives on until
# a reset kills the jail.
INIT = '''import os, sys
fd, argv = int(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if not pid:
    os.close(fd)
    try:
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
while True:
    try:
        done, status = os.wait()
    except ChildProcessError:
        break
    if done == pid:
        try:  # nobody may be waiting any more (a launched app)
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
        except OSError:
            pass
        os.close(fd)
'''


def command(argv: list[str], *, home: str, bin_dir: str, identity_dir: str,
            python_roots: list[str], environ, status_fd: int,
            network: bool = False) -> list[str]:
  """The argv that runs `argv` in a jail of its own (see the docstring).

  The command keeps our uid inside (the buses' EXTERNAL authentication
  compares the uid a client names with the one the kernel reports);
  `identity_dir` holds the jail's passwd and group (write_identity).
  `home` is bound at /home/user, `bin_dir` (the python wrappers) and
  `python_roots` (the apps' interpreter's folders) read-only at their own
  paths; the X socket, the buses' sockets and the X authority file of
  `environ` read-only. The jail's PID 1 (INIT) writes the command's exit
  code to `status_fd` (the caller passes it on) and the jail lives on while
  anything the command started runs.
  """
  # The host name stays: the X cookie names it.
  args = [shutil.which('bwrap'), '--unshare-user', '--unshare-pid',
          '--unshare-ipc', '--unshare-cgroup-try', '--die-with-parent',
          '--new-session', '--cap-drop', 'ALL', '--as-pid-1']
  if not network:
    args.append('--unshare-net')
  for path in _SYSTEM:
    if os.path.islink(path):
      args += ['--symlink', os.readlink(path), path]
    elif os.path.isdir(path):
      args += ['--ro-bind', path, path]
  args += ['--proc', '/proc', '--dev', '/dev', '--tmpfs', '/tmp',
           '--tmpfs', '/run', '--dir', _RUNTIME, '--chmod', '0700', _RUNTIME,
           '--bind', home, HOME, '--ro-bind', bin_dir, _BIN]
  for root in python_roots:
    args += ['--ro-bind', root, root]
  for path in socket_paths(environ):
    if os.path.exists(path):
      args += ['--ro-bind', path, path]
  if 'XAUTHORITY' in environ and os.path.exists(environ['XAUTHORITY']):
    args += ['--ro-bind', environ['XAUTHORITY'], _XAUTHORITY]
  for name in ('passwd', 'group'):
    args += ['--ro-bind', os.path.join(identity_dir, name), f'/etc/{name}']
  args += ['--chdir', HOME, '--', '/usr/bin/python3', '-I', '-S', '-c', INIT,
           str(status_fd)]
  return args + list(argv)


class Jailed:
  """A command in a jail (Desktop.popen): `wait` and `poll` give the
  command's exit code, which the jail's init reports on a pipe; `pid` is
  the jail's (its process group: killing it ends the whole jail)."""

  def __init__(self, jail, status_fd):
    self.jail, self.pid, self.returncode = jail, jail.pid, None
    self._status = status_fd
    self._lock = threading.Lock()

  def poll(self):
    return self._read(0.0)

  def wait(self, timeout=None):
    code = self._read(timeout)
    if code is None:
      raise subprocess.TimeoutExpired(self.jail.args, timeout)
    return code

  def _read(self, timeout):
    with self._lock:
      if self.returncode is None:
        ready, _, _ = select.select([self._status], [], [], timeout)
        if ready:
          data = os.read(self._status, 64)
          os.close(self._status)
          # No code: the jail died before the command ended (a reset).
          self.returncode = int(data) if data.strip() else (
              self.jail.wait() or -signal.SIGKILL)
      return self.returncode

  def __del__(self):
    if self.returncode is None:
      try:
        os.close(self._status)
      except OSError:
        pass


def _children(pids):
  """The pids of the processes whose parent is in pids."""
  pids, found = set(pids), []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat', 'rb') as f:
          ppid = int(f.read().rsplit(b')', 1)[1].split()[1])
      except (OSError, ValueError, IndexError):
        continue
      if ppid in pids:
        found.append(int(entry))
  return found


def pid_namespaces(bwrap_pids):
  """The PID namespaces of the jails whose bwrap processes are given (their
  init is bwrap's child)."""
  spaces = set()
  for child in _children(bwrap_pids):
    try:
      spaces.add(os.readlink(f'/proc/{child}/ns/pid'))
    except OSError:
      continue
  return spaces


def members(spaces):
  """{pid: process group} of the live processes in those namespaces."""
  found = {}
  if not spaces:
    return found
  for entry in os.listdir('/proc'):
    if not entry.isdigit():
      continue
    try:
      if os.readlink(f'/proc/{entry}/ns/pid') in spaces:
        with open(f'/proc/{entry}/stat', 'rb') as f:
          if f.read().rsplit(b')', 1)[1].split()[0] == b'Z':
            continue  # a zombie waits for its parent, which dies too
        found[int(entry)] = os.getpgid(int(entry))
    except (OSError, ProcessLookupError):
      continue
  return found


def kill(pid_or_group):
  """SIGKILLs a process (a negative number: a process group) that may be
  gone already."""
  try:
    os.kill(pid_or_group, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
