"""Runs untrusted Python (programs, model-written tests) in a sandbox.

  results = sandbox.run(program, tests, time_limit_s=2.0)

`tests` holds (stdin, expected_stdout) pairs, `Check(code)` assert-style
tests (HumanEval's `check(candidate)`), or None for a test that could not be
parsed (reported as 'invalid_test', never run). All tests of one program run
in ONE sandbox (sandbox_harness.py); `run_many` runs many programs in
parallel. Nothing the program does makes these functions raise; a broken
sandbox raises SandboxError (SandboxUnavailable when bwrap is missing).

Rewards the program cannot forge. A policy is trained on these verdicts, so
the program is treated as an attacker of them:
- The expected outputs never enter the sandbox: the harness reports a hash
  of each test's (whitespace-collapsed) stdout and this process compares.
  A program that walks its frames or heap to the expected data, or to
  anything else of the job, finds nothing: it runs in a fresh interpreter
  (sandbox_runner.py, exec'd, not forked from the harness) that holds the
  program and the input of its current test only.
- An assert-style check never runs in the program's process. The program
  runs in a serving runner; the check runs in a second, non-dumpable
  runner in which each of the program's names is a stub: calls and results
  cross a pipe as plain values (builtin types, exact), so an object whose
  `__eq__` is always true, a replaced `builtins.exec` or `abs`, a swapped
  compiled check, the check's expected values read from memory, or result
  frames written to the program's own event pipe cannot make it pass. Only
  the checking runner's event is a verdict; whatever the program reports
  can only fail its test.
- The harness (PID 1, non-dumpable) cannot be traced or read, its channel
  to this process is not inherited by any runner, and runner events are
  plain text it parses without unmarshalling.

Isolation (ENVIRONMENTS.md section 4): bubblewrap as an unprivileged uid of
its own per concurrent sandbox (RLIMIT_NPROC counts per uid, so parallel
sandboxes would otherwise share one process budget), new user, PID, network,
IPC and UTS namespaces, a read-only view of the host's /usr only, a private
size-capped /tmp and /dev/shm, rlimits on memory, CPU, processes, file size
and open files, per-test CPU and wall-clock limits, and an output cap. The
harness is PID 1 of the sandbox (bwrap --as-pid-1): it reaps every orphan
and its exit kills whatever the program left, so no zombie or process
outlives a run (bwrap's own init would leave a zombie per run on this
machine, see ENVIRONMENTS.md).

Kernel memory. Files, buffers and kernel objects cost memory that
RLIMIT_AS does not count: the tmpfs cap inodes too (Limits.tmp_files), a
seccomp filter refuses what allocates more per call, and
`kernel_memory_bound` states what a program can still hold
(sandbox_kernel.py says how and why).

Programs get the host's system Python (Limits.python) with its standard
library only: `-I -S`, so no site-packages (and no numpy).

Statuses: 'ok' (passed), 'wrong_answer', 'timeout', 'memory', 'error' (an
exception, a crash or a non-zero exit), 'output_limit' (stdout over the cap
or a file over the size limit), 'invalid_test'. Outputs are compared after
collapsing all whitespace (RLANYTHING.md 5.5).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
import contextlib
import dataclasses
import hashlib
import logging
import marshal
import os
import secrets
import shutil
import subprocess
import threading
from typing import Any, Union

from rla_jax.envs.coding import sandbox_kernel

OK = 'ok'
WRONG_ANSWER = 'wrong_answer'
TIMEOUT = 'timeout'
MEMORY = 'memory'
ERROR = 'error'
OUTPUT_LIMIT = 'output_limit'
INVALID_TEST = 'invalid_test'
STATUSES = (OK, WRONG_ANSWER, TIMEOUT, MEMORY, ERROR, OUTPUT_LIMIT,
            INVALID_TEST)

INSTALL_HINT = ('install bubblewrap (Debian/Ubuntu: `apt-get install -y '
                'bubblewrap`; Fedora: `dnf install bubblewrap`), or allow '
                'the unsafe unsandboxed mode explicitly with '
                '--config.env.sandbox.allow_unsandboxed=True')
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'sandbox_harness.py')
_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       'sandbox_runner.py')
# The harness's code object arrives on stdin ahead of the job, compiled once
# per interpreter (compiling it in every run would cost ~3 ms of start-up).
_BOOT = ('import marshal,os\n'
         'def r(n):\n'
         ' b=b""\n'
         ' while len(b)<n:\n'
         '  c=os.read(0,n-len(b))\n'
         '  if not c:raise EOFError\n'
         '  b+=c\n'
         ' return b\n'
         'exec(marshal.loads(r(int.from_bytes(r(4),"big"))))\n')
_COMPILE = ('import marshal,sys\n'
            'src=sys.stdin.buffer.read()\n'
            'sys.stdout.buffer.write(marshal.dumps(compile(src,%r,"exec")))\n')
# A run the harness has not finished this long after its tests' own limits
# is a broken sandbox, not a slow program.
_GRACE_S = 30.0


class SandboxError(RuntimeError):
  """The sandbox failed (not the program): the caller marks an error."""


class SandboxUnavailable(SandboxError):
  """bubblewrap is missing and unsandboxed runs are not allowed."""


@dataclasses.dataclass(frozen=True)
class Check:
  """An assert-style test: `code` runs after the program in its globals.

  It passes when `code` returns; a failed assert is 'wrong_answer'.
  HumanEval: Check(problem['test'] + f'\\ncheck({entry_point})\\n').
  """

  code: str


Test = Union[tuple[str, str], Check, None]


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits and sandbox settings (config.env.sandbox)."""

  memory_mb: int = 512  # RLIMIT_AS of each process
  stack_mb: int = 64  # RLIMIT_STACK (deep recursion in contest code)
  processes: int = 16  # RLIMIT_NPROC: processes and threads of the sandbox
  file_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
  output_mb: int = 16  # captured stdout per test
  tmp_mb: int = 64  # size of the private /tmp and of /dev/shm
  tmp_files: int = 4096  # files, directories and links in each of them
  open_files: int = 64  # RLIMIT_NOFILE
  wall_factor: float = 3.0  # wall limit per test = factor * time + extra
  wall_extra_s: float = 1.0
  keep_output: int = 200  # characters of stdout kept in each Result
  python: str = '/usr/bin/python3'  # interpreter inside the sandbox
  uid_base: int = 0  # first sandbox uid; 0 = derived from our pid
  allow_unsandboxed: bool = False  # no bwrap: run with rlimits only (unsafe)


@dataclasses.dataclass(frozen=True)
class Result:
  """What happened to one test."""

  status: str
  detail: str = ''  # error message, limit that was hit, ...
  seconds: float = 0.0  # wall-clock time of the test
  output: str = ''  # the start of the program's stdout

  @property
  def passed(self) -> bool:
    return self.status == OK


def available() -> bool:
  """Whether bubblewrap (and setpriv, when we are root) can be used."""
  return bool(shutil.which('bwrap')) and (
      os.geteuid() != 0 or bool(shutil.which('setpriv')))


def run(program: str, tests: Sequence[Test], time_limit_s: float = 2.0, *,
        limits: Limits | None = None) -> list[Result]:
  """Runs `program` on every test in one sandboxed process; one Result each.

  `time_limit_s` is the CPU time allowed per test (wall-clock time gets
  `wall_factor` times that, plus `wall_extra_s`, so a loaded machine does not
  turn slow-but-correct programs into timeouts). Any program and test text
  gives Results (lone surrogates in a test are encoded as they are); a time
  limit or `limits` field that is not a number in its range raises
  SandboxError naming it.
  """
  limits = limits or Limits()
  _check_limits(limits, time_limit_s)
  results: list[Result | None] = [None] * len(tests)
  job_tests, expected, index = [], [], []
  for i, test in enumerate(tests):
    spec = _test_spec(test)
    if spec is None:
      results[i] = Result(INVALID_TEST, 'no test')
      continue
    job_tests.append(spec[:2])
    expected.append(spec[2])
    index.append(i)
  if not isinstance(program, str):
    return [r or Result(ERROR, 'no program') for r in results]
  if job_tests:
    token = secrets.token_hex(16)
    # The expected outputs stay here: the sandbox reports each output's
    # digest and this process compares.
    job = {'program': program, 'tests': job_tests,
           'time_limit_s': float(time_limit_s), 'token': token,
           'limits': _harness_limits(limits, time_limit_s, job_tests)}
    wall = len(job_tests) * (time_limit_s * limits.wall_factor +
                             limits.wall_extra_s)
    for i, result in zip(index, _execute(job, expected, limits,
                                         wall + _GRACE_S)):
      results[i] = result
  return results


def run_many(jobs: Sequence[tuple[Any, ...]], time_limit_s: float = 2.0, *,
             limits: Limits | None = None,
             workers: int | None = None) -> list[list[Result]]:
  """`run` over many (program, tests[, time_limit_s]) jobs, in parallel.

  At most `workers` (default: the number of CPUs) sandboxes run at once;
  each gets its own uid. Raises the first SandboxError after all finished.
  """
  workers = workers or os.cpu_count() or 1

  def one(job):
    program, tests, *rest = job
    return run(program, tests, rest[0] if rest else time_limit_s,
               limits=limits)

  if workers == 1 or len(jobs) <= 1:
    return [one(job) for job in jobs]
  with futures.ThreadPoolExecutor(min(workers, len(jobs)),
                                  thread_name_prefix='sandbox') as pool:
    pending = [pool.submit(one, job) for job in jobs]
    futures.wait(pending)
  return [f.result() for f in pending]


def utf8(text: str) -> bytes:
  """`text` as bytes, never an exception: surrogate escapes back to their
  bytes, any other lone surrogate in its (invalid) UTF-8 form."""
  try:
    return text.encode('utf-8', 'surrogateescape')
  except UnicodeEncodeError:
    return text.encode('utf-8', 'surrogatepass')


def expected_digest(expected: str) -> bytes:
  """The hash a test's stdout is compared by (whitespace collapsed)."""
  return hashlib.sha256(b' '.join(utf8(expected).split())).digest()


# Limits fields -> (smallest allowed value, whether it must be an integer).
_RANGES = {'memory_mb': (1, True), 'stack_mb': (1, True),
           'processes': (1, True), 'file_mb': (1, True),
           'output_mb': (1, True), 'tmp_mb': (1, True),
           'tmp_files': (1, True),
           'open_files': (4, True), 'wall_factor': (1.0, False),
           'wall_extra_s': (0.0, False), 'keep_output': (0, True),
           'uid_base': (0, True)}
_MAX_TIME_S = 86400.0


def kernel_memory_bound(limits: Limits | None = None,
                        largest_input: int = 0) -> dict[str, int]:
  """Bytes of kernel memory one sandbox can hold outside RLIMIT_AS, at worst
  (sandbox_kernel.kernel_memory_bound, which lists the items)."""
  return sandbox_kernel.kernel_memory_bound(limits or Limits(), largest_input)


def _check_limits(limits: Limits, time_limit_s: float):
  """SandboxError for a limit that is not a finite number in its range."""
  values = {f'limits.{k}': (getattr(limits, k), low, whole)
            for k, (low, whole) in _RANGES.items()}
  values['time_limit_s'] = (time_limit_s, 1e-3, False)
  for name, (value, low, whole) in values.items():
    high = _MAX_TIME_S if name == 'time_limit_s' else float('inf')
    kinds = (int,) if whole else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kinds) or
        not low <= value < float('inf') or value > high):
      kind = 'an integer' if whole else 'a number'
      bound = f' and <= {high:g}' if high < float('inf') else ''
      raise SandboxError(f'{name}={value!r}: must be {kind} >= {low}{bound}')


def _test_spec(test: Test) -> tuple[str, str | bytes, bytes | None] | None:
  """(kind, payload, expected digest) of a test; None when invalid. An io
  test's payload is its stdin as bytes (sandbox_runner writes them as they
  are)."""
  if isinstance(test, Check):
    return ('check', test.code, None) if isinstance(test.code, str) else None
  if not isinstance(test, (tuple, list)) or len(test) != 2:
    return None
  stdin, expected = test
  if stdin is None or expected is None:
    return None
  return ('io', utf8(str(stdin)), expected_digest(str(expected)))


def _harness_limits(limits: Limits, time_limit_s: float,
                    tests: list[tuple[str, str | bytes]]) -> dict[str, Any]:
  names = ('memory_mb', 'stack_mb', 'processes', 'output_mb', 'open_files',
           'wall_factor', 'wall_extra_s', 'keep_output')
  out = {name: getattr(limits, name) for name in names}
  # The worker writes each test's stdin into a file under this limit too.
  largest = max((len(p) for kind, p in tests if kind == 'io'), default=0)
  out['file_bytes'] = max(limits.file_mb << 20, largest + 1)
  # Backstop only: the harness enforces the per-test CPU limit itself.
  out['cpu_total_s'] = int(len(tests) * (time_limit_s + 1)) + 5
  out['signals'] = sandbox_kernel.SIGNALS_PENDING
  out['tmp'] = sandbox_kernel.tmp_mounts(limits, largest)
  out['own_tmp'] = False  # whether the harness mounts them (_owns_tmp)
  return out


# Sandbox uids: one per concurrent run, so RLIMIT_NPROC is per sandbox.

_lock = threading.Lock()
_free_slots: list[int] = []
_num_slots = 0
_UID_SLOTS = 256  # uids reserved per host process
_warned_unsandboxed = False


def _uid_base(limits: Limits) -> int:
  if limits.uid_base:
    return limits.uid_base
  # A range per host process (by pid), far above real and system users.
  return 1_000_000_000 + (os.getpid() % 1_000_000) * _UID_SLOTS


def _acquire_slot() -> int:
  global _num_slots
  with _lock:
    if _free_slots:
      return _free_slots.pop()
    if _num_slots >= _UID_SLOTS:
      raise SandboxError(f'more than {_UID_SLOTS} concurrent sandboxes')
    _num_slots += 1
    return _num_slots - 1


def _release_slot(slot: int):
  with _lock:
    _free_slots.append(slot)


def _root_binds() -> list[str]:
  """/usr read-only, and /bin, /lib, ... as on the host (links or binds)."""
  args = ['--ro-bind', '/usr', '/usr']
  for name in ('bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32'):
    path = '/' + name
    if os.path.islink(path):
      args += ['--symlink', os.readlink(path), path]
    elif os.path.isdir(path):
      args += ['--ro-bind', path, path]
  return args


def _command(limits: Limits, uid: int, mounts: list[tuple[str, int, int]],
             own_tmp: bool = False,
             seccomp_fd: int | None = None) -> list[str]:
  """The argv of one sandboxed harness. With `own_tmp` the harness mounts
  /tmp and /dev/shm itself (bwrap cannot cap their inodes) and bwrap raises
  the capabilities it needs for that; `seccomp_fd` holds the filter."""
  python = [limits.python, '-I', '-S', '-c', _BOOT]
  bwrap, setpriv = shutil.which('bwrap'), shutil.which('setpriv')
  # As root, drop to the slot's uid first (bwrap itself then needs no
  # privileges); an unsandboxed run drops too, where setpriv exists.
  drop = [setpriv, f'--reuid={uid}', f'--regid={uid}', '--clear-groups',
          '--inh-caps=-all', '--'] if os.geteuid() == 0 and setpriv else []
  if not available():
    if not limits.allow_unsandboxed:
      raise SandboxUnavailable(f'cannot run untrusted code: {INSTALL_HINT}')
    _warn_unsandboxed()
    return drop + python
  # bwrap < 0.8 (e.g. Ubuntu 22.04) lacks --size and --disable-userns.
  modern = _bwrap_version(bwrap) >= (0, 8)
  sizes = {path: size for path, size, _ in mounts}

  def tmpfs(path):
    if own_tmp:
      return ['--dir', path]  # a mount point for the harness's tmpfs
    return (['--size', str(sizes[path])] if modern else []) + [
        '--tmpfs', path]

  caps = [a for cap in _HARNESS_CAPS for a in ('--cap-add', cap)]
  return drop + [
      bwrap, '--unshare-all', '--unshare-user',
      *(['--disable-userns'] if modern else []),
      '--die-with-parent', '--new-session', '--as-pid-1', *_root_binds(),
      '--proc', '/proc', '--dev', '/dev',
      *tmpfs('/dev/shm'), '--remount-ro', '/dev',
      *tmpfs('/tmp'), '--remount-ro', '/',
      *(caps if own_tmp else []),
      *(['--seccomp', str(seccomp_fd)] if seccomp_fd is not None else []),
      '--chdir', '/tmp', '--clearenv',
      '--setenv', 'PATH', '/usr/bin:/bin', '--setenv', 'HOME', '/tmp',
      '--setenv', 'LANG', 'C.UTF-8', '--setenv', 'OMP_NUM_THREADS', '1',
      '--', *python]


_versions: dict[str, tuple[int, ...]] = {}


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
  """(major, minor, ...) of `bwrap --version`, cached; (0,) if unknown."""
  with _lock:
    if bwrap in _versions:
      return _versions[bwrap]
  proc = subprocess.run([bwrap, '--version'], capture_output=True, text=True,
                        check=False)
  numbers = proc.stdout.split()[-1:] or ['0']
  try:
    version = tuple(int(x) for x in numbers[0].split('.'))
  except ValueError:
    version = (0,)
  if version < (0, 8):
    logging.warning('bubblewrap %s is older than 0.8: the sandbox\'s /tmp '
                    'and /dev/shm are not size-capped and nested user '
                    'namespaces are not disabled', numbers[0])
  with _lock:
    _versions[bwrap] = version
  return version


def _warn_unsandboxed():
  global _warned_unsandboxed
  if not _warned_unsandboxed:
    _warned_unsandboxed = True
    logging.warning('bubblewrap is missing: running untrusted programs '
                    'WITHOUT a sandbox (allow_unsandboxed=True); only rlimits '
                    'protect this machine. To fix: %s', INSTALL_HINT)


def _execute(job: dict[str, Any], expected: list[bytes | None],
             limits: Limits, timeout_s: float) -> list[Result]:
  """Starts one harness on `job`; its Results, in job order."""
  if not os.path.exists(limits.python):
    raise SandboxUnavailable(f'no interpreter at {limits.python} '
                             '(config.env.sandbox.python)')
  # The harness starts every runner from this code (compiling the runner's
  # source in each one would cost ~3 ms).
  job = dict(job, runner=_compiled(limits.python, _RUNNER))
  slot = _acquire_slot()
  try:
    uid = _uid_base(limits) + slot
    job['limits'] = dict(job['limits'], own_tmp=_owns_tmp(limits, uid))
    stdout, stderr, returncode = _start(job, limits, uid, timeout_s)
  finally:
    _release_slot(slot)
  return _parse(stdout, stderr, returncode, job, expected)


def _start(job: dict[str, Any], limits: Limits, uid: int,
           timeout_s: float) -> tuple[bytes, bytes, int]:
  """Runs one harness on `job` to its end: (stdout, stderr, exit status)."""
  code = _compiled(limits.python, _HARNESS)
  payload = marshal.dumps(job, 4)
  payload = b''.join((len(code).to_bytes(4, 'big'), code,
                      len(payload).to_bytes(4, 'big'), payload))
  seccomp = sandbox_kernel.seccomp_fd() if available() else None
  try:
    cmd = _command(limits, uid, job['limits']['tmp'],
                   job['limits']['own_tmp'], seccomp)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=() if seccomp is None else (seccomp,))
  finally:
    if seccomp is not None:
      os.close(seccomp)  # bwrap holds its own copy
  try:
    stdout, stderr = proc.communicate(payload, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    _kill_tree(proc)
    raise SandboxError(f'the sandbox did not finish in {timeout_s:.0f} s '
                       f'({len(job["tests"])} tests)') from None
  except BaseException:
    _kill_tree(proc)
    raise
  return stdout, stderr, proc.returncode


# The harness's own /tmp and /dev/shm: CAP_SYS_ADMIN to mount them in its
# user namespace, CAP_SETPCAP to empty its bounding set afterwards.
_HARNESS_CAPS = ('CAP_SYS_ADMIN', 'CAP_SETPCAP')
_owns_tmp_cache: dict[str, bool] = {}  # bwrap path -> probed


def _owns_tmp(limits: Limits, uid: int) -> bool:
  """Whether the harness mounts /tmp and /dev/shm itself, with an inode cap.

  bwrap must raise capabilities for it (--cap-add), which a setuid bwrap
  refuses to anyone but root. Probed once per bwrap with an empty job; where
  that fails: one warning, and bwrap's tmpfs, whose inodes are not capped.
  """
  if not available():
    return False
  bwrap = shutil.which('bwrap')
  with _lock:
    known = _owns_tmp_cache.get(bwrap)
  if known is not None:
    return known
  probe = {'program': '', 'tests': [], 'time_limit_s': 1.0,
           'token': secrets.token_hex(16),
           'limits': dict(_harness_limits(limits, 1.0, []), own_tmp=True)}
  try:
    _parse(*_start(probe, limits, uid, _GRACE_S), probe, [])
    owns, why = True, ''
  except SandboxError as e:
    owns, why = False, str(e)
  with _lock:
    first = bwrap not in _owns_tmp_cache
    _owns_tmp_cache.setdefault(bwrap, owns)
  if first and not owns:
    logging.warning('the sandbox cannot mount its own /tmp (%s): the NUMBER '
                    'of files a program makes in /tmp and /dev/shm is not '
                    'bounded (Limits.tmp_files), only their size',
                    why[-300:])
  return owns


_code_cache: dict[tuple[str, str], bytes] = {}


def _compiled(python: str, path: str) -> bytes:
  """Our own trusted source at `path`, compiled by `python`, cached."""
  with _lock:
    code = _code_cache.get((python, path))
  if code is None:
    with open(path, 'rb') as f:
      source = f.read()
    proc = subprocess.run([python, '-I', '-S', '-c', _COMPILE % path],
                          input=source, capture_output=True, check=False)
    if proc.returncode:
      raise SandboxUnavailable(f'{python} cannot compile {path}: '
                               f'{proc.stderr.decode(errors="replace")}')
    code = proc.stdout
    with _lock:
      _code_cache[(python, path)] = code
  return code


def _parse(stdout: bytes, stderr: bytes, returncode: int,
           job: dict[str, Any], expected: list[bytes | None]) -> list[Result]:
  """The harness's frames -> Results; stdin/stdout tests are judged here."""
  results: list[Result | None] = [None] * len(job['tests'])
  done, pos = False, 0
  while pos + 4 <= len(stdout):
    size = int.from_bytes(stdout[pos:pos + 4], 'big')
    frame = marshal.loads(stdout[pos + 4:pos + 4 + size])
    pos += 4 + size
    if not isinstance(frame, tuple) or frame[0] != job['token']:
      raise SandboxError('corrupted result channel')
    _, k, status, detail, seconds, output, digest = frame
    if k == -1:
      done = True
      continue
    io = job['tests'][k][0] == 'io'
    if status == 'done' and io:
      status = OK if digest == expected[k] else WRONG_ANSWER
    elif status not in STATUSES or status == INVALID_TEST or (
        status == OK and io):
      raise SandboxError(f'the harness reported {status!r} for test {k}')
    results[k] = Result(status, detail, seconds, output)
  if not done or any(r is None for r in results):
    tail = stderr.decode('utf-8', 'replace').strip()[-2000:]
    raise SandboxError(f'the sandbox failed (exit {returncode}): {tail}')
  return results


def _kill_tree(proc: subprocess.Popen):
  """Kills a harness that overran, innermost first, so nothing is orphaned.

  Killing bwrap first would orphan the harness to the host's init, which
  reaps slowly; killing the harness (the sandbox's PID 1) ends the whole PID
  namespace and lets bwrap exit by itself.
  """
  for pid in _children(proc.pid):
    with contextlib.suppress(OSError):
      os.kill(pid, 9)
  try:
    proc.communicate(timeout=5)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()


def _children(pid: int) -> list[int]:
  """Pids whose parent is `pid` (from /proc/*/stat)."""
  out = []
  for name in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{name}/stat', 'rb') as f:
        if int(f.read().rsplit(b')', 1)[1].split()[1]) == pid:
          out.append(int(name))
    except OSError:
      continue
  return out
