"""Runs inside the sandbox: one program against all of its tests.

Started by sandbox.py as `python3 -I -S -c <this file's source>`, normally as
PID 1 of the sandbox's PID namespace (bwrap --as-pid-1), so signals from the
program cannot kill it and every orphan is reaped here. Standard library
only, no imports that cost start-up time (no json, re or hashlib).

Protocol. stdin: a 4-byte big-endian length, then a marshal'd job dict
(see sandbox._job). stdout: length-prefixed marshal'd frames, each a tuple
starting with the job's token: (token, k, status, detail, seconds, output)
per test, then (token, -1, 'done', ...).

Trust. The program runs in a forked worker that holds neither stdout nor
stdin of this process, cannot ptrace it or open its /proc fds (it is made
non-dumpable), and never sees an expected output: stdin/stdout tests are
judged here, by comparing the hash of the worker's whitespace-normalised
stdout with the host's hash of the expected one. So a program can only pass
such a test by printing the right answer. Assert-style checks pass when the
worker reports that the check returned; a program that forges that report
(by finding the worker's event fd) is beyond what this design stops.
"""

import _signal as signal  # the `signal` module imports enum (~3 ms)
import builtins
import io
import marshal
import os
import resource
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

_EV_FD = 3  # worker -> harness: length-prefixed marshal'd events
_OUT_FD = 4  # the worker's private copy of its stdout pipe
# harness -> worker: one byte per judged test. The worker starts test k + 1
# only then, so everything in the stdout pipe at event k belongs to test k.
_ACK_FD = 5
_POLL_S = 0.05  # CPU-time checks while a test runs
_READY_S = 10.0  # worker set-up; longer means the machine is broken
_MAX_EVENT = 1 << 16
_DETAIL = 300  # characters of an error message kept
_SIGNALS = {signal.SIGXCPU: 'timeout', signal.SIGXFSZ: 'output_limit'}
_SIGNAL_NAMES = {getattr(signal, n): n for n in (
    'SIGABRT', 'SIGBUS', 'SIGFPE', 'SIGILL', 'SIGKILL', 'SIGSEGV', 'SIGTERM',
    'SIGXCPU', 'SIGXFSZ', 'SIGINT', 'SIGHUP', 'SIGPIPE', 'SIGUSR1', 'SIGUSR2',
    'SIGALRM', 'SIGSYS', 'SIGTRAP', 'SIGQUIT')}
# What a worker may report; only 'done' can become a pass, after judging.
_REPORTED = ('done', 'error', 'memory', 'output_limit', 'wrong_answer')


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


def _describe(exc):
  try:
    text = f'{type(exc).__name__}: {exc}'
  except BaseException:  # pylint: disable=broad-except
    text = type(exc).__name__
  return text[:_DETAIL]


def _prctl():
  """libc's prctl through _ctypes alone (the ctypes package costs ~1 ms)."""
  import _ctypes  # pylint: disable=g-import-not-at-top

  class Int(_ctypes._SimpleCData):  # pylint: disable=protected-access
    _type_ = 'i'

  class Function(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL
    _restype_ = Int

  class Libc:
    _handle = _ctypes.dlopen(None, 0)

  return Function(('prctl', Libc()))


def _nondumpable():
  """Keeps the worker from ptrace-ing us or opening /proc/1/fd (same uid)."""
  try:
    prctl = _prctl()
  except Exception:  # pylint: disable=broad-except
    import ctypes  # pylint: disable=g-import-not-at-top
    prctl = ctypes.CDLL(None).prctl
  if prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    raise HarnessError('prctl(PR_SET_DUMPABLE, 0) failed')


def _limit(which, value):
  hard = resource.getrlimit(which)[1]
  if hard != resource.RLIM_INFINITY:
    value = min(value, hard)  # raising a hard limit needs privileges
  resource.setrlimit(which, (value, value))


# The worker: a fork of the harness that runs the program, test after test.


def _worker_setup(job, pipes, pid1):
  """Fds 0-2 private, pipes on 3-5, rlimits."""
  top = max(pipes) + 1  # above every pipe, so no dup2 overwrites another
  ev, out, ack = (os.dup2(fd, top + i) for i, fd in enumerate(pipes))
  devnull = os.open('/dev/null', os.O_RDWR)
  for src, dst in ((ev, _EV_FD), (out, _OUT_FD), (ack, _ACK_FD), (out, 1),
                   (devnull, 0), (devnull, 2)):
    os.dup2(src, dst)
  os.closerange(_ACK_FD + 1, 1 << 20)  # our stdin/stdout, older pipes, ...
  if not pid1:
    os.setsid()  # unsandboxed: the process group is what gets killed
  lim = job['limits']
  mb = 1 << 20
  _limit(resource.RLIMIT_AS, lim['memory_mb'] * mb)
  _limit(resource.RLIMIT_STACK, min(lim['stack_mb'], lim['memory_mb']) * mb)
  _limit(resource.RLIMIT_FSIZE, lim['file_bytes'])
  _limit(resource.RLIMIT_NOFILE, lim['open_files'])
  _limit(resource.RLIMIT_CORE, 0)
  _limit(resource.RLIMIT_CPU, lim['cpu_total_s'])
  if pid1:  # per user (namespace); outside a sandbox it would count ours too
    _limit(resource.RLIMIT_NPROC, lim['processes'])
  builtins.exit = builtins.quit = sys.exit  # `-S` skips site, which adds them
  sys.stderr = sys.__stderr__ = io.TextIOWrapper(
      io.open(2, 'wb', closefd=False), encoding='utf-8', errors='replace')


def _join_threads():
  """Waits for the program's threads, as interpreter shutdown would."""
  threading = sys.modules.get('threading')
  if threading is None:
    return
  for t in threading.enumerate():
    if t is not threading.main_thread() and not t.daemon:
      t.join()


def _run_test(code, kind, payload, checks, recursion):
  """(status, detail) of one test; 'done' means judged by the harness."""
  data = payload.encode('utf-8', 'surrogateescape') if kind == 'io' else b''
  fd = os.memfd_create('stdin')
  _write_all(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  os.dup2(fd, 0)
  os.close(fd)
  os.dup2(_OUT_FD, 1)  # the program may have closed or replaced fd 1
  sys.stdin = sys.__stdin__ = io.TextIOWrapper(
      io.open(0, 'rb', closefd=False), encoding='utf-8', errors='replace')
  out = sys.stdout = sys.__stdout__ = io.TextIOWrapper(
      io.open(1, 'wb', closefd=False), encoding='utf-8',
      errors='surrogateescape')
  sys.setrecursionlimit(recursion)
  scope = {'__name__': '__main__', '__builtins__': builtins}
  try:
    exec(code, scope)  # pylint: disable=exec-used
    if kind == 'check':
      exec(checks[payload], scope)  # pylint: disable=exec-used
    _join_threads()
    result = ('done', '')
  except SystemExit as e:
    clean = e.code is None or e.code == 0
    result = ('done', '') if clean and kind == 'io' else (
        'error', f'SystemExit({e.code!r})'[:_DETAIL])
  except MemoryError:
    result = ('memory', 'MemoryError')
  except AssertionError as e:
    result = ('wrong_answer' if kind == 'check' else 'error', _describe(e))
  except BaseException as e:  # pylint: disable=broad-except
    too_big = isinstance(e, OSError) and e.errno == 27  # EFBIG
    result = ('output_limit' if too_big else 'error', _describe(e))
  try:
    out.flush()  # ours, even if the program replaced sys.stdout
  except BaseException:  # pylint: disable=broad-except
    pass
  return result


def _worker(job, start, pipes, pid1):
  """Runs tests start.. and reports each on fd 3; never returns."""
  try:
    _worker_setup(job, pipes, pid1)
    _write_all(_EV_FD, _frame('ready'))
  except BaseException:  # pylint: disable=broad-except
    os._exit(70)  # before 'ready': the harness reports its own failure
  try:
    recursion = sys.getrecursionlimit()
    try:
      code = compile(job['program'], '<program>', 'exec')
      failure = None
    except BaseException as e:  # pylint: disable=broad-except
      code, failure = None, ('error', _describe(e))
    checks = {}
    for k in range(start, len(job['tests'])):
      kind, payload = job['tests'][k]
      result = failure
      if kind == 'check' and payload not in checks and failure is None:
        try:
          checks[payload] = compile(payload, '<check>', 'exec')
        except BaseException as e:  # pylint: disable=broad-except
          result = ('error', 'the check does not compile: ' + _describe(e))
      result = result or _run_test(code, kind, payload, checks, recursion)
      _write_all(_EV_FD, _frame((k, result[0], result[1])))
      if k + 1 < len(job['tests']) and not os.read(_ACK_FD, 1):
        break  # the harness is gone
  except BaseException:  # pylint: disable=broad-except
    pass  # e.g. the program closed fd 3; the harness sees an early exit
  os._exit(0)


# The harness: supervises workers, judges outputs, reports to the host.


def _cpu_s(pid, tick):
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      fields = f.read().rsplit(b')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick
  except (OSError, IndexError, ValueError):
    return 0.0


class Harness:
  """Runs the job's tests in as few workers as the program allows."""

  def __init__(self, job):
    self.job = job
    self.tests = job['tests']
    self.lim = job['limits']
    self.cap = self.lim['output_mb'] << 20
    self.pid1 = os.getpid() == 1
    self.tick = os.sysconf('SC_CLK_TCK')

  def emit(self, k, status, detail, seconds, output=b''):
    preview = bytes(output[:self.lim['keep_output']]).decode('utf-8',
                                                             'replace')
    _write_all(1, _frame((self.job['token'], k, status, detail,
                          round(seconds, 4), preview)))

  def run(self):
    k = 0
    while k < len(self.tests):
      k = self.supervise(k)
    _write_all(1, _frame((self.job['token'], -1, 'done', '', 0.0, '')))

  def supervise(self, start):
    """One worker from test `start`; returns the next test to run."""
    ev_r, ev_w = os.pipe()
    out_r, out_w = os.pipe()
    ack_r, ack_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      _worker(self.job, start, (ev_w, out_w, ack_r), self.pid1)
    for fd in (ev_w, out_w, ack_r):
      os.close(fd)
    pidfd = os.pidfd_open(pid)
    for fd in (ev_r, out_r):
      os.set_blocking(fd, False)
    try:
      return self._watch(start, pid, pidfd, ev_r, out_r, ack_w)
    finally:
      for fd in (pidfd, ev_r, out_r, ack_w):
        os.close(fd)

  def _watch(self, k, pid, pidfd, ev_r, out_r, ack_w):
    """Judges the worker's tests until it ends, dies or breaks a limit."""
    cpu_limit = self.job['time_limit_s']
    wall_limit = cpu_limit * self.lim['wall_factor'] + self.lim['wall_extra_s']
    watched = [ev_r, out_r, pidfd]
    events, output = bytearray(), bytearray()
    ready, verdict = False, None
    t0 = checked = time.monotonic()
    cpu0 = None  # worker CPU seconds at the start of the test, if read
    while verdict is None and k < len(self.tests):
      deadline = t0 + (wall_limit if ready else _READY_S)
      now = time.monotonic()
      readable = select.select(watched, [], [],
                               max(0.0, min(deadline - now, _POLL_S)))[0]
      if out_r in readable:
        self._drain(out_r, output, watched)
      if ev_r in readable:
        self._drain(ev_r, events, watched)
      for event in self._events(events):
        if event == 'ready' and not ready:
          ready, t0 = True, time.monotonic()
          continue
        if not (ready and isinstance(event, tuple) and len(event) == 3 and
                event[0] == k and event[1] in _REPORTED):
          verdict = ('error', 'the program corrupted the result channel')
          break
        self._drain(out_r, output, watched)  # written before the event
        if len(output) > self.cap:
          break
        now = time.monotonic()
        self.emit(k, *self.judge(k, event[1], str(event[2]), output),
                  now - t0, output)
        k += 1
        output.clear()
        if k == len(self.tests):
          break
        t0 = checked = now
        cpu0 = None
        try:
          os.write(ack_w, b'.')
        except BrokenPipeError:
          pass  # it died; its pidfd says so next
      if len(output) > self.cap:
        verdict = ('output_limit', f'stdout over {self.lim["output_mb"]} MB')
      if verdict is not None or k == len(self.tests):
        break
      if pidfd in readable:
        verdict = 'exited'
        break
      now = time.monotonic()
      if now >= deadline:
        if not ready:
          raise HarnessError('the worker did not start')
        verdict = ('timeout', f'over {wall_limit:g} s of wall-clock time')
      elif ready and now - checked >= _POLL_S:
        checked, cpu = now, _cpu_s(pid, self.tick)
        if cpu0 is None:  # read lazily: most tests end before the first poll
          cpu0 = cpu - (now - t0)  # as if it had been busy (an upper bound)
        if cpu - cpu0 > cpu_limit:
          verdict = ('timeout', f'over {cpu_limit:g} s of CPU time')
    elapsed = time.monotonic() - t0
    if verdict == 'exited':  # what it wrote before dying still counts
      self._drain(out_r, output, watched)
    status = self.kill_all(pid)
    if k == len(self.tests):
      return k
    if verdict == 'exited':
      if not ready:
        raise HarnessError(f'the worker failed to start (status {status})')
      verdict = self._death(k, status, output)
    if len(output) > self.cap:
      verdict = ('output_limit', f'stdout over {self.lim["output_mb"]} MB')
    self.emit(k, *verdict, elapsed, output)
    return k + 1

  def judge(self, k, status, detail, output):
    """Final (status, detail) of test k from the worker's report."""
    kind = self.tests[k][0]
    if status != 'done':
      if status == 'wrong_answer' and kind != 'check':
        status = 'error'  # only a failed assert is a wrong answer here
      return status, detail
    if kind == 'check':
      return 'ok', ''
    if digest(bytes(output)) == self.job['expected'][k]:
      return 'ok', ''
    return 'wrong_answer', ''

  def _death(self, k, status, output):
    """Verdict on test k when the worker died during it."""
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
    if code == 0 and self.tests[k][0] == 'io':  # os._exit(0) after printing
      return self.judge(k, 'done', '', output)
    return 'error', f'exited with code {code} during the test'

  def kill_all(self, pid):
    """Kills every process but us, reaps them; the worker's wait status."""
    status = None
    while True:
      try:
        if self.pid1:
          os.kill(-1, signal.SIGKILL)  # the whole namespace except PID 1
        else:
          os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass
      try:
        done, st = os.waitpid(-1 if self.pid1 else pid, 0)
      except ChildProcessError:
        return status
      if done == pid:
        status = st
        if not self.pid1:
          return status

  def _events(self, events):
    """Complete events at the front of `events` (removed from it)."""
    while len(events) >= 4:
      size = int.from_bytes(events[:4], 'big')
      if size > _MAX_EVENT:
        events.clear()
        yield None
        return
      if len(events) < 4 + size:
        return
      try:
        event = marshal.loads(bytes(events[4:4 + size]))
      except (EOFError, ValueError, TypeError):
        event = None
      del events[:4 + size]
      yield event

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
  Harness(job).run()
  os._exit(0)  # everything is written; skip the interpreter's teardown


if __name__ == '__main__':
  main()
