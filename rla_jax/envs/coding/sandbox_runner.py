"""Runs inside the sandbox in a fresh interpreter: the program, or a check.

sandbox_harness.py starts each of these processes as `python3 -I -S -c
<boot> MODE`, exec'd (never a fork of the harness, which holds the job);
this file's code (compiled once by the host) arrives on fd 5 ahead of the
runner's job. So a process that runs the program holds the program and the
input of the test it runs, and nothing else. Standard library only.

Modes:
  io     the program on stdin/stdout tests, one at a time; the harness sends
         test k + 1's input only after it judged test k, and the expected
         outputs never enter the sandbox (the host compares).
  serve  the program once, then calls of its top-level functions, for an
         assert-style check: arguments and results cross as plain values
         (None, bool, int, float, complex, str, bytes, list, tuple, dict,
         set, frozenset; exact types only), so no object of the program's
         can answer a comparison.
  check  the check's code, with a stub in place of each of the program's
         names: a call goes to the serving process, and its answer comes
         back as a plain value or an exception. The program never runs in
         this process, which is non-dumpable (the program, same uid, can
         neither trace it nor open its fds): the verdict is this process's.

Fds: 3 events to the harness; 4 the test's stdout (io); 5 commands from the
harness; 6 and 7 the call channel (serve: requests in, answers out; check:
answers in, requests out). Events are length-prefixed UTF-8 text
'k<US>status<US>detail', so the harness never unmarshals what the program
could have written.
"""

import _signal as signal
import builtins
import errno
import io
import marshal
import os
import resource
import sys

_EV, _OUT, _CMD, _IN, _OUT_CALLS = 3, 4, 5, 6, 7
_SEP = '\x1f'
_DETAIL = 300  # characters of an error message kept
_DEPTH = 200  # nesting of a plain value


def _read_exact(fd, n):
  chunks = []
  while n:
    chunk = os.read(fd, min(n, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    n -= len(chunk)
  return b''.join(chunks)


def _read_frame(fd, limit):
  size = int.from_bytes(_read_exact(fd, 4), 'big')
  if size > limit:
    raise ValueError(f'a frame of {size} bytes')
  return _read_exact(fd, size)


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _send(fd, data):
  _write_all(fd, len(data).to_bytes(4, 'big') + data)


def _event(k, status, detail=''):
  text = _SEP.join((str(k), status, detail.replace(_SEP, ' ')))
  _send(_EV, text.encode('utf-8', 'replace'))


def _describe(exc):
  try:
    text = f'{type(exc).__name__}: {exc}'
  except BaseException:  # pylint: disable=broad-except
    text = type(exc).__name__
  return text[:_DETAIL]


def _nondumpable():
  import ctypes  # pylint: disable=g-import-not-at-top
  if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    raise OSError('prctl(PR_SET_DUMPABLE, 0) failed')


def _limit(which, value):
  hard = resource.getrlimit(which)[1]
  if hard != resource.RLIM_INFINITY:
    value = min(value, hard)  # raising a hard limit needs privileges
  resource.setrlimit(which, (value, value))


def _set_limits(lim):
  mb = 1 << 20
  _limit(resource.RLIMIT_AS, lim['memory_mb'] * mb)
  _limit(resource.RLIMIT_STACK, min(lim['stack_mb'], lim['memory_mb']) * mb)
  _limit(resource.RLIMIT_FSIZE, lim['file_bytes'])
  _limit(resource.RLIMIT_NOFILE, lim['open_files'])
  _limit(resource.RLIMIT_CORE, 0)
  _limit(resource.RLIMIT_CPU, lim['cpu_total_s'])
  if lim['pid1']:  # per user (namespace); outside a sandbox it counts ours
    _limit(resource.RLIMIT_NPROC, lim['processes'])
  # Kernel memory: POSIX message queues, and queued signals or POSIX timers
  # (sandbox.kernel_memory_bound).
  _limit(resource.RLIMIT_MSGQUEUE, 0)
  _limit(resource.RLIMIT_SIGPENDING, lim['signals'])
  if hasattr(sys, 'set_int_max_str_digits'):
    sys.set_int_max_str_digits(0)  # plain values may hold huge integers
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


def _outcome(exc, assertion):
  """(status, detail) of an exception the program or the check raised."""
  if isinstance(exc, MemoryError):
    return 'memory', 'MemoryError'
  if isinstance(exc, AssertionError):
    return assertion, _describe(exc)
  if isinstance(exc, OSError) and exc.errno == 27:  # EFBIG
    return 'output_limit', _describe(exc)
  return 'error', _describe(exc)


# io: stdin/stdout tests.


def _stdin(data):
  """fd 0: an unnamed file in /tmp holding `data` (a regular file, so
  fstat gives its size). The sandbox refuses memfd_create, which would put
  it outside every cap; /tmp has room and an inode for it on top of the
  program's share. The last test's stdin goes first, to free both."""
  try:
    os.close(0)
  except OSError:
    pass
  try:
    fd = os.open('/tmp', os.O_TMPFILE | os.O_RDWR, 0o600)
  except OSError as e:
    if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
      raise
    fd = os.memfd_create('stdin')  # unsandboxed, /tmp without O_TMPFILE
  try:
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
  except OSError:
    os.close(fd)
    raise
  if fd != 0:
    os.dup2(fd, 0)
    os.close(fd)


def _io_test(code, data, recursion):
  """(status, detail) of one stdin/stdout test; 'done' means 'compare'."""
  try:
    _stdin(data)
  except OSError as e:  # /tmp filled by the program's earlier tests
    return 'error', 'no room for the input in /tmp: ' + _describe(e)
  os.dup2(_OUT, 1)  # the program may have closed or replaced fd 1
  sys.stdin = sys.__stdin__ = io.TextIOWrapper(
      io.open(0, 'rb', closefd=False), encoding='utf-8', errors='replace')
  out = sys.stdout = sys.__stdout__ = io.TextIOWrapper(
      io.open(1, 'wb', closefd=False), encoding='utf-8',
      errors='surrogateescape')
  sys.setrecursionlimit(recursion)
  scope = {'__name__': '__main__', '__builtins__': builtins}
  try:
    exec(code, scope)  # pylint: disable=exec-used
    _join_threads()
    result = ('done', '')
  except SystemExit as e:
    clean = e.code is None or e.code == 0
    result = ('done', '') if clean else (
        'error', f'SystemExit({e.code!r})'[:_DETAIL])
  except BaseException as e:  # pylint: disable=broad-except
    result = _outcome(e, 'error')
  try:
    out.flush()  # ours, even if the program replaced sys.stdout
  except BaseException:  # pylint: disable=broad-except
    pass
  return result


def _io(job):
  recursion = sys.getrecursionlimit()
  try:
    code, failure = compile(job['program'], '<program>', 'exec'), None
  except BaseException as e:  # pylint: disable=broad-except
    code, failure = None, ('error', _describe(e))
  limit = job['limits']['file_bytes'] + 64
  while True:
    try:
      k, data = marshal.loads(_read_frame(_CMD, limit))
    except EOFError:
      return
    _event(k, *(failure or _io_test(code, data, recursion)))


# Plain values: what crosses between the serving and the checking process.


def encode(value, depth=0):
  """A JSON-able form of a plain value; TypeError for anything else."""
  if depth > _DEPTH:
    raise TypeError('a value nested too deeply')
  kind = type(value)
  if value is None or kind in (bool, int, float, str):
    return value
  if kind is list:
    return [encode(v, depth + 1) for v in value]
  if kind in (tuple, set, frozenset):
    tag = {tuple: 't', set: 's', frozenset: 'f'}[kind]
    return {tag: [encode(v, depth + 1) for v in value]}
  if kind is dict:
    return {'d': [[encode(k, depth + 1), encode(v, depth + 1)]
                  for k, v in value.items()]}
  if kind is bytes:
    return {'b': value.decode('latin-1')}
  if kind is complex:
    return {'c': [value.real, value.imag]}
  raise TypeError(f'a {kind.__name__} is not a plain value')


def decode(data, depth=0):
  """The plain value `encode` gave `data`; TypeError for anything else."""
  if depth > _DEPTH:
    raise TypeError('a value nested too deeply')
  kind = type(data)
  if data is None or kind in (bool, int, float, str):
    return data
  if kind is list:
    return [decode(v, depth + 1) for v in data]
  if kind is dict and len(data) == 1:
    (tag, v), = data.items()
    if tag in ('t', 's', 'f') and type(v) is list:
      items = [decode(e, depth + 1) for e in v]
      return {'t': tuple, 's': set, 'f': frozenset}[tag](items)
    if tag == 'd' and type(v) is list and all(
        type(p) is list and len(p) == 2 for p in v):
      return {decode(a, depth + 1): decode(b, depth + 1) for a, b in v}
    if tag == 'b' and type(v) is str:
      return v.encode('latin-1')
    if tag == 'c' and type(v) is list and len(v) == 2 and all(
        type(x) in (int, float) for x in v):
      return complex(*v)
  raise TypeError('not a plain value')


def _dumps(obj):
  import json  # pylint: disable=g-import-not-at-top
  return json.dumps(obj).encode()


def _loads(data):
  import json  # pylint: disable=g-import-not-at-top
  return json.loads(data.decode('utf-8'))


# serve: the program, answering calls.


def _serve(job):
  scope = {'__name__': '__main__', '__builtins__': builtins}
  try:
    code = compile(job['program'], '<program>', 'exec')
    exec(code, scope)  # pylint: disable=exec-used
    _join_threads()
  except BaseException as e:  # pylint: disable=broad-except
    _event(0, *_outcome(e, 'error'))
    return
  names = {}
  for name, value in list(scope.items()):
    if name.startswith('__'):
      continue
    try:
      names[name] = {'v': encode(value)}
    except TypeError:
      if callable(value):
        names[name] = None
  _send(_OUT_CALLS, _dumps(names))
  limit = job['limits']['output_mb'] << 20
  while True:
    try:
      request = _read_frame(_IN, limit)
    except EOFError:
      return
    try:
      name, args, kwargs = _loads(request)
      result = scope[name](*decode(args), **decode(kwargs))
    except BaseException as e:  # pylint: disable=broad-except
      answer = {'raise': [type(e).__name__, _describe(e)]}
    else:
      try:
        answer = {'ok': encode(result)}
      except TypeError as e:
        answer = {'bad': str(e)}
    _send(_OUT_CALLS, _dumps(answer))


# check: an assert-style check against the serving process.


class CallFailed(Exception):
  """The program answered a call with something other than a plain value,
  or ended during it."""


def _exception(name, detail):
  cls = getattr(builtins, name, None)
  if (isinstance(cls, type) and issubclass(cls, Exception) and
      cls.__module__ == 'builtins'):
    return cls(detail)
  return CallFailed(detail)


def _stub(name, limit):
  def call(*args, **kwargs):
    _send(_OUT_CALLS, _dumps([name, encode(list(args)), encode(kwargs)]))
    try:
      answer = _loads(_read_frame(_IN, limit))
    except EOFError:
      raise CallFailed(f'the program ended during {name}()') from None
    if type(answer) is not dict or len(answer) != 1:
      raise CallFailed(f'{name}() gave no answer')
    (kind, value), = answer.items()
    if kind == 'ok':
      return decode(value)
    if kind == 'raise' and type(value) is list and len(value) == 2:
      raise _exception(str(value[0]), str(value[1]))
    raise CallFailed(f'{name}() returned {str(value)[:_DETAIL]}')
  call.__name__ = name
  return call


def _check(job):
  limit = job['limits']['output_mb'] << 20
  try:
    code = compile(job['check'], '<check>', 'exec')
  except BaseException as e:  # pylint: disable=broad-except
    _event(0, 'error', 'the check does not compile: ' + _describe(e))
    return
  try:
    names = _loads(_read_frame(_IN, limit))
  except EOFError:
    _event(0, 'error', 'the program ended before its functions could be '
           'called')
    return
  except (ValueError, TypeError) as e:
    _event(0, 'error', 'the program broke the call channel: ' + _describe(e))
    return
  scope = {'__name__': '__main__', '__builtins__': builtins}
  try:
    for name, value in names.items():
      scope[name] = _stub(name, limit) if value is None else decode(
          value['v'])
    exec(code, scope)  # pylint: disable=exec-used
    result = ('done', '')
  except BaseException as e:  # pylint: disable=broad-except
    result = _outcome(e, 'wrong_answer')
  _event(0, *result)


def _oom_first():
  """Makes this process and its children the OOM killer's first choice:
  their page tables, which no limit bounds, count in its score. Before
  _nondumpable, which would make /proc/self root's."""
  try:
    fd = os.open('/proc/self/oom_score_adj', os.O_WRONLY)
    try:
      os.write(fd, b'1000')
    finally:
      os.close(fd)
  except OSError:
    pass


def main():
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _oom_first()
  mode = sys.argv[1]
  if mode == 'check':
    _nondumpable()
  job = marshal.loads(_read_frame(_CMD, 1 << 30))
  _set_limits(job['limits'])
  _event(-1, 'ready')
  {'io': _io, 'serve': _serve, 'check': _check}[mode](job)
  os._exit(0)


if __name__ == '__main__':
  main()
