"""Runs inside the sandbox: supervises the processes that run one program.

Started by sandbox.py as `python3 -I -S -c <boot>` (this file's code object
on stdin), normally as PID 1 of the sandbox's PID namespace (bwrap
--as-pid-1), so signals from the program cannot kill it and every orphan is
reaped here. Standard library only, no imports that cost start-up time (no
json, re or hashlib).

Protocol. stdin: a 4-byte big-endian length, then a marshal'd job dict
(sandbox._execute: the program, the tests' kinds and inputs, the runner's
compiled code, limits, a token; never an expected output). stdout:
length-prefixed marshal'd frames, each a tuple starting with the job's
token: (token, k, status, detail, seconds, output, digest) per test, then
(token, -1, 'done', ...). For stdin/stdout tests the status is 'done' and
`digest` hashes the whitespace-collapsed stdout: the host compares it with
the expected output's hash, which never enters the sandbox.

Trust. Every process that runs model code is a fresh interpreter
(sandbox_runner.py, exec'd): it holds the program and the input of its
test, not the job. It holds neither stdout nor stdin of this process and
cannot trace this process or open its /proc fds (this process is
non-dumpable). Its events are plain text, parsed here without unmarshalling.
An assert-style check runs in a second, non-dumpable runner that calls the
program's functions through plain values (sandbox_runner.py); only that
runner's event makes a check pass. Where the host asks (job limits
'own_tmp'), this process first mounts /tmp and /dev/shm with an inode cap,
then gives up every capability bwrap raised for it (_own_tmp): no runner
ever holds one.
"""

import _signal as signal  # the `signal` module imports enum (~3 ms)
import marshal
import os
import select
import sys
import time

try:
  from _sha256 import sha256  # CPython <= 3.11: no OpenSSL import
except ImportError:
  try:
    from _sha2 import sha256  # CPython >= 3.12
  except ImportError:
    from hashlib import sha256

_POLL_S = 0.05  # CPU-time checks while a test runs
_READY_S = 10.0  # a runner's start-up; longer means the machine is broken
_MAX_EVENT = 1 << 16
_DETAIL = 300  # characters of an error message kept
_SEP = '\x1f'
_SIGNALS = {signal.SIGXCPU: 'timeout', signal.SIGXFSZ: 'output_limit'}
_SIGNAL_NAMES = {getattr(signal, n): n for n in (
    'SIGABRT', 'SIGBUS', 'SIGFPE', 'SIGILL', 'SIGKILL', 'SIGSEGV', 'SIGTERM',
    'SIGXCPU', 'SIGXFSZ', 'SIGINT', 'SIGHUP', 'SIGPIPE', 'SIGUSR1', 'SIGUSR2',
    'SIGALRM', 'SIGSYS', 'SIGTRAP', 'SIGQUIT')}
# What a runner may report about a test; only a checking runner's 'done'
# is a pass, and an io runner's 'done' means "compare the output".
_REPORTED = ('done', 'error', 'memory', 'output_limit', 'wrong_answer')
# A runner's `-c` program: the runner's code object arrives on fd 5 (its
# command pipe), ahead of its job.
_RUNNER_BOOT = ('import marshal,os\n'
                'def r(n):\n'
                ' b=b""\n'
                ' while len(b)<n:\n'
                '  c=os.read(5,n-len(b))\n'
                '  if not c:raise EOFError\n'
                '  b+=c\n'
                ' return b\n'
                'exec(marshal.loads(r(int.from_bytes(r(4),"big"))),'
                '{"__name__":"__main__"})\n')


class HarnessError(Exception):
  """The harness itself failed (not something the program did)."""


def _read_exact(fd, n):
  chunks = []
  while n:
    chunk = os.read(fd, n)
    if not chunk:
      raise HarnessError('truncated job on stdin')
    chunks.append(chunk)
    n -= len(chunk)
  return b''.join(chunks)


def _frame(obj):
  data = marshal.dumps(obj, 4)
  return len(data).to_bytes(4, 'big') + data


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def digest(data):
  """Hash of `data` with all whitespace runs collapsed (the comparison)."""
  return sha256(b' '.join(data.split())).digest()


def _libc(*names):
  """libc's functions `names` through _ctypes alone (the ctypes package
  costs ~1 ms): ints and bytes in, an int out, errno kept for _errno()."""
  try:
    import _ctypes  # pylint: disable=g-import-not-at-top

    class Int(_ctypes._SimpleCData):  # pylint: disable=protected-access
      _type_ = 'i'

    class Function(_ctypes.CFuncPtr):
      _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
      _restype_ = Int

    class Libc:
      _handle = _ctypes.dlopen(None, 0)

    return [Function((name, Libc())) for name in names]
  except Exception:  # pylint: disable=broad-except
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    return [getattr(libc, name) for name in names]


def _errno():
  """errno of the last _libc call that failed."""
  import _ctypes  # pylint: disable=g-import-not-at-top
  return _ctypes.get_errno()


def _ok(result, what):
  """Raises HarnessError naming `what` and errno when a libc call failed."""
  if result != 0:
    code = _errno()
    raise HarnessError(f'{what}: {os.strerror(code)} (errno {code})')


def _nondumpable():
  """Keeps the runners from ptrace-ing us or opening /proc/1/fd (same uid)."""
  prctl, = _libc('prctl')
  _ok(prctl(4, 0, 0, 0, 0), 'prctl(PR_SET_DUMPABLE, 0)')


_CLONE_NEWNS = 0x20000
_MS_NOSUID, _MS_NODEV = 2, 4
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAP_VERSION_3 = 0x20080522
_EINVAL = 22


def _own_tmp(mounts):
  """Mounts /tmp and /dev/shm with their size and inode caps, then gives up
  every capability, before any runner exists.

  bwrap cannot cap a tmpfs's inodes, so it raised CAP_SYS_ADMIN and
  CAP_SETPCAP for this process alone, in the sandbox's user namespace.
  bwrap's mount namespace refuses mounts even so (it belongs to another
  user namespace): hence one of our own, which the runners inherit. Without
  the cap, a program fills 64 MB of /tmp with millions of empty files, each
  up to ~1.5 KB of kernel memory outside every limit.
  """
  unshare, mount, prctl, capset = _libc('unshare', 'mount', 'prctl',
                                        'capset')
  _ok(unshare(_CLONE_NEWNS), 'unshare(CLONE_NEWNS)')
  for path, size, inodes in mounts:
    options = f'size={size},nr_inodes={inodes},mode=1777,huge=never'
    _ok(mount(b'tmpfs', path.encode(), b'tmpfs', _MS_NOSUID | _MS_NODEV,
              options.encode()), f'mount tmpfs on {path}')
  os.chdir('/tmp')  # our cwd was the mount point underneath
  # Ambient capabilities would survive execve into the runners.
  _ok(prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0),
      'prctl(PR_CAP_AMBIENT_CLEAR_ALL)')
  for cap in range(64):  # up to cap_last_cap, where the kernel says EINVAL
    if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
      if _errno() == _EINVAL and cap:
        break
      _ok(-1, f'prctl(PR_CAPBSET_DROP, {cap})')
  header = _CAP_VERSION_3.to_bytes(4, sys.byteorder) + bytes(4)  # pid 0
  _ok(capset(header, bytes(24)), 'capset(none)')  # effective, permitted, ...
  _ok(prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 'prctl(PR_SET_NO_NEW_PRIVS)')


def _cpu_s(pid, tick):
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      fields = f.read().rsplit(b')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick
  except (OSError, IndexError, ValueError):
    return 0.0


def _parse_event(data):
  """(k, status, detail) of a runner's event, or None when malformed."""
  try:
    k, status, detail = data.decode('utf-8').split(_SEP)
    return int(k), status, detail[:_DETAIL]
  except ValueError:
    return None


class _Runner:
  """One exec'd sandbox_runner.py process and the harness's ends of its
  pipes."""

  def __init__(self, harness, mode, fds, job):
    self.events = bytearray()
    ev_r, ev_w = os.pipe()
    cmd_r, cmd_w = os.pipe()
    self.ev, self.cmd = ev_r, cmd_w
    fds = {3: ev_w, 5: cmd_r, **fds}
    self.pid = os.fork()
    if self.pid == 0:
      harness.exec_runner(mode, fds)
    for fd in (ev_w, cmd_r):
      os.close(fd)
    self.pidfd = os.pidfd_open(self.pid)
    os.set_blocking(ev_r, False)
    code = harness.job['runner']  # what _RUNNER_BOOT reads first
    self._write(len(code).to_bytes(4, 'big') + code)
    self.send(job)

  def send(self, obj):
    self._write(_frame(obj))

  def _write(self, data):
    try:
      _write_all(self.cmd, data)
    except BrokenPipeError:
      pass  # it died; its pidfd says so

  def read_events(self):
    """Complete events at the front of the buffer; None for a bad one."""
    out = []
    while True:
      try:
        chunk = os.read(self.ev, 1 << 16)
      except BlockingIOError:
        break
      if not chunk:
        break
      self.events += chunk
      if len(self.events) > 4 * _MAX_EVENT:
        break
    while len(self.events) >= 4:
      size = int.from_bytes(self.events[:4], 'big')
      if size > _MAX_EVENT:
        self.events.clear()
        out.append(None)
        break
      if len(self.events) < 4 + size:
        break
      out.append(_parse_event(bytes(self.events[4:4 + size])))
      del self.events[:4 + size]
    return out

  def close(self):
    for fd in (self.ev, self.cmd, self.pidfd):
      os.close(fd)


class _Clock:
  """The wall-clock and CPU time of one test, run by the processes `pids`."""

  def __init__(self, harness, pids):
    self.harness, self.pids = harness, pids
    self.start(time.monotonic())

  def start(self, now):
    self.t0 = self.checked = now
    self.cpu0 = None  # the runners' CPU seconds at t0, once read

  def over(self):
    """A timeout verdict once the test is past a limit, else None."""
    h, now = self.harness, time.monotonic()
    if now >= self.t0 + h.wall_limit:
      return 'timeout', f'over {h.wall_limit:g} s of wall-clock time'
    if now - self.checked >= _POLL_S:
      self.checked = now
      cpu = sum(_cpu_s(pid, h.tick) for pid in self.pids)
      if self.cpu0 is None:  # read lazily: most tests end before a poll
        # As if each had been busy since t0 (an upper bound).
        self.cpu0 = cpu - len(self.pids) * (now - self.t0)
      if cpu - self.cpu0 > h.cpu_limit:
        return 'timeout', f'over {h.cpu_limit:g} s of CPU time'
    return None

  def select(self, watched):
    """The fds of `watched` that are ready, waiting at most until the next
    CPU check or the wall-clock limit."""
    left = self.t0 + self.harness.wall_limit - time.monotonic()
    return select.select(watched, [], [], max(0.0, min(left, _POLL_S)))[0]


class Harness:
  """Runs the job's tests: stdin/stdout tests in as few runners as the
  program allows, each check in a serving and a checking runner."""

  def __init__(self, job):
    self.job = job
    self.tests = job['tests']
    self.lim = dict(job['limits'], pid1=os.getpid() == 1)
    self.cap = self.lim['output_mb'] << 20
    self.pid1 = self.lim['pid1']
    self.tick = os.sysconf('SC_CLK_TCK')
    self.cpu_limit = job['time_limit_s']
    self.wall_limit = (self.cpu_limit * self.lim['wall_factor'] +
                       self.lim['wall_extra_s'])

  def exec_runner(self, mode, fds):
    """In a forked child: fds in place, everything else closed, then exec
    a fresh interpreter on the runner; never returns."""
    try:
      top = max(max(fds), max(fds.values())) + 1
      held = {target: os.dup2(src, top + i)
              for i, (target, src) in enumerate(sorted(fds.items()))}
      devnull = os.open('/dev/null', os.O_RDWR)
      for fd in range(8):
        os.dup2(held.get(fd, devnull), fd)
      os.closerange(8, 1 << 20)
      for fd in range(3, 8):
        if fd not in fds:
          os.close(fd)
      if not self.pid1:
        os.setsid()  # unsandboxed: the process group is what gets killed
      python = sys.executable
      os.execv(python, [python, '-I', '-S', '-c', _RUNNER_BOOT, mode])
    except BaseException:  # pylint: disable=broad-except
      pass
    os._exit(70)

  def emit(self, k, status, detail, seconds, output=b'', out_digest=b''):
    preview = bytes(output[:self.lim['keep_output']]).decode('utf-8',
                                                             'replace')
    _write_all(1, _frame((self.job['token'], k, status, detail,
                          round(seconds, 4), preview, out_digest)))

  def run(self):
    k = 0
    while k < len(self.tests):
      k = self.check(k) if self.tests[k][0] == 'check' else self.io(k)
    _write_all(1, _frame((self.job['token'], -1, 'done', '', 0.0, '', b'')))

  def job_for_runner(self, **extra):
    return dict(limits=self.lim, **extra)

  def _wait_ready(self, runner, more):
    """Blocks until `runner` reports ready; False if it died first."""
    deadline = time.monotonic() + _READY_S
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise HarnessError('a runner did not start')
      readable = select.select([runner.ev, runner.pidfd], [], [], left)[0]
      events = runner.read_events()
      ready = [i for i, e in enumerate(events) if e and e[1] == 'ready']
      if ready:
        more.extend(events[ready[0] + 1:])
        return True
      if events or runner.pidfd in readable:
        return False  # anything before 'ready' is a broken start

  # stdin/stdout tests.

  def io(self, k):
    """One runner from test k on, while the tests are stdin/stdout ones;
    returns the next test to run."""
    out_r, out_w = os.pipe()
    runner = _Runner(self, 'io', {1: out_w, 4: out_w},
                     self.job_for_runner(program=self.job['program']))
    os.close(out_w)
    os.set_blocking(out_r, False)
    try:
      if not self._wait_ready(runner, []):
        status = self.kill_all([runner.pid])[runner.pid]
        raise HarnessError(f'a runner failed to start (status {status})')
      return self._watch_io(k, runner, out_r)
    finally:
      os.close(out_r)
      runner.close()

  def _watch_io(self, k, runner, out_r):
    watched = [runner.ev, out_r, runner.pidfd]
    output = bytearray()
    runner.send((k, self.tests[k][1]))
    clock, verdict = _Clock(self, [runner.pid]), None
    while verdict is None:
      readable = clock.select(watched)
      if out_r in readable:
        self._drain(out_r, output, watched)
      for event in runner.read_events():
        if not (event and event[0] == k and event[1] in _REPORTED):
          verdict = ('error', 'the program corrupted the result channel')
          break
        self._drain(out_r, output, watched)  # written before the event
        if len(output) > self.cap:
          break
        now = time.monotonic()
        status, detail, out_digest = self._judged(event[1], event[2], output)
        self.emit(k, status, detail, now - clock.t0, output, out_digest)
        k += 1
        output.clear()
        if k == len(self.tests) or self.tests[k][0] != 'io':
          verdict = 'next'
          break
        runner.send((k, self.tests[k][1]))
        clock.start(now)
      if verdict is not None:
        break
      if len(output) > self.cap:
        verdict = ('output_limit', f'stdout over {self.lim["output_mb"]} MB')
        break
      if runner.pidfd in readable:
        verdict = 'exited'
        break
      verdict = clock.over()
    elapsed = time.monotonic() - clock.t0
    if verdict == 'exited':  # what it wrote before dying still counts
      self._drain(out_r, output, watched)
    status = self.kill_all([runner.pid])[runner.pid]
    if verdict == 'next':
      return k
    if verdict == 'exited':
      verdict = self._death(status)
    if len(output) > self.cap:
      verdict = ('output_limit', f'stdout over {self.lim["output_mb"]} MB')
    status, detail, out_digest = self._judged(*verdict, output)
    self.emit(k, status, detail, elapsed, output, out_digest)
    return k + 1

  def _judged(self, status, detail, output):
    """(status, detail, digest) of an io test; 'done' goes to the host with
    the output's digest, which it compares."""
    if status == 'done':
      return 'done', '', digest(bytes(output))
    if status == 'wrong_answer':
      status = 'error'  # only the host says an output is wrong
    return status, detail, b''

  def _death(self, status):
    """Verdict on the running test when its runner died during it."""
    if status is None:
      return 'error', 'the program exited'
    if os.WIFSIGNALED(status):
      sig = os.WTERMSIG(status)
      name = _SIGNAL_NAMES.get(sig, f'signal {sig}')
      if sig in _SIGNALS:
        return _SIGNALS[sig], f'killed by {name}'
      if sig == signal.SIGSEGV:
        return 'error', 'killed by SIGSEGV (stack overflow?)'
      return 'error', f'killed by {name}'
    code = os.WEXITSTATUS(status)
    if code == 0:  # os._exit(0) after printing: compare what it printed
      return 'done', ''
    return 'error', f'exited with code {code} during the test'

  # Assert-style checks.

  def check(self, k):
    """Test k, a check, in a checking and a serving runner; returns k + 1."""
    req_r, req_w = os.pipe()  # check -> program
    ans_r, ans_w = os.pipe()  # program -> check
    out_r, out_w = os.pipe()
    checker = _Runner(self, 'check', {6: ans_r, 7: req_w},
                      self.job_for_runner(check=self.tests[k][1]))
    os.close(req_w)
    os.close(ans_r)
    server, verdict, early = None, None, []
    try:
      # The checker is non-dumpable before the program starts beside it.
      if not self._wait_ready(checker, early):
        verdict = ('error', 'the check failed to start')
      else:
        server = _Runner(self, 'serve', {1: out_w, 6: req_r, 7: ans_w},
                         self.job_for_runner(program=self.job['program']))
      for fd in (req_r, ans_w, out_w):
        os.close(fd)
      os.set_blocking(out_r, False)
      clock = _Clock(self, [checker.pid] + ([server.pid] if server else []))
      if verdict is None:
        verdict = self._watch_check(checker, server, out_r, early, clock)
      elapsed = time.monotonic() - clock.t0
      self.kill_all([checker.pid] + ([server.pid] if server else []))
    finally:
      os.close(out_r)
      checker.close()
      if server:
        server.close()
    self.emit(k, *verdict, elapsed)
    return k + 1

  def _watch_check(self, checker, server, out_r, early, clock):
    """The checking runner's verdict, or a limit's."""
    watched = [checker.ev, server.ev, out_r, checker.pidfd, server.pidfd]
    sink, program_failure = bytearray(), None
    while True:
      readable = clock.select(watched)
      if out_r in readable:
        self._drain(out_r, sink, watched)
        del sink[:]  # a check's verdict does not read the program's output
      for event in server.read_events():
        if event and event[1] in _REPORTED and event[1] != 'done':
          program_failure = event[1:]  # it can only make the test fail
      for event in early + checker.read_events():
        if event is None or event[0] != 0 or event[1] not in _REPORTED:
          return 'error', 'the check corrupted its result channel'
        status, detail = event[1:]
        if status == 'done':
          return 'ok', ''
        if program_failure and status == 'error':
          return program_failure
        return status, detail
      early = []
      if checker.pidfd in readable:
        return program_failure or ('error', 'the check ended without a '
                                   'verdict')
      if server.pidfd in readable and server.pidfd in watched:
        watched.remove(server.pidfd)  # the checker sees the channel close
      verdict = clock.over()
      if verdict:
        return verdict

  def kill_all(self, pids):
    """Kills every runner and what it started, reaps them; pid -> status."""
    statuses = dict.fromkeys(pids)
    pending = set(pids)
    while True:
      for target in ([-1] if self.pid1 else pending):
        try:
          if self.pid1:
            os.kill(-1, signal.SIGKILL)  # the whole namespace except PID 1
          else:
            os.killpg(target, signal.SIGKILL)
        except OSError:
          pass  # a group already gone must not spare the others
      try:
        done, status = os.waitpid(-1 if self.pid1 else next(iter(pending)),
                                  0)
      except (ChildProcessError, StopIteration):
        return statuses
      if done in statuses:
        statuses[done] = status
        pending.discard(done)
        if not pending and not self.pid1:
          return statuses

  def _drain(self, fd, buf, watched):
    """Appends what `fd` holds (up to just over the output cap) to `buf`."""
    while len(buf) <= self.cap:
      try:
        chunk = os.read(fd, 1 << 16)
      except BlockingIOError:
        return
      if not chunk:
        if fd in watched:
          watched.remove(fd)
        return
      buf += chunk


def main():
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Python's one handler
  _nondumpable()
  size = int.from_bytes(_read_exact(0, 4), 'big')
  job = marshal.loads(_read_exact(0, size))
  if job['limits']['own_tmp']:
    _own_tmp(job['limits']['tmp'])
  Harness(job).run()
  os._exit(0)  # everything is written; skip the interpreter's teardown


if __name__ == '__main__':
  main()
