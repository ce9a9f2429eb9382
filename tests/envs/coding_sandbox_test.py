"""The sandbox: verdicts, isolation of tests, containment, nothing left over."""

import errno
import logging
import os
import socket
import stat
import struct
import tempfile
import time

import pytest

from rla_jax.envs.coding import sandbox
from rla_jax.envs.coding import sandbox_kernel

needs_bwrap = pytest.mark.skipif(
    not sandbox.available(),
    reason='bubblewrap is not installed (apt-get install -y bubblewrap)')
pytestmark = needs_bwrap
FAST = 0.5  # seconds of CPU per test where a test is meant to time out
HOST_DIRS = ('/tmp', '/var/tmp', '/dev/shm', os.path.expanduser('~'))


def _our_uids():
  # pylint: disable=protected-access
  base = sandbox._uid_base(sandbox.Limits())
  return range(base, base + sandbox._UID_SLOTS)


def _processes():
  """(pid, state, ppid, real uid) of every process on the host."""
  out = []
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/status') as f:
        fields = dict(line.split(':', 1) for line in f if ':' in line)
    except OSError:
      continue
    out.append((int(name), fields['State'].split()[0], int(fields['PPid']),
                int(fields['Uid'].split()[0])))
  return out


def _sandbox_files():
  uids = _our_uids()
  found = []
  for top in HOST_DIRS:
    for root, dirs, files in os.walk(top):
      for name in dirs + files:
        path = os.path.join(root, name)
        try:
          if os.lstat(path).st_uid in uids:
            found.append(path)
        except OSError:
          pass
      if root.count(os.sep) > 3:
        dirs.clear()
  return found


@pytest.fixture
def nothing_left():
  """After the test: no process, zombie or file of a sandbox uid remains."""
  yield
  uids = _our_uids()
  deadline = time.time() + 5
  while True:
    left = [p for p in _processes()
            if p[3] in uids or (p[2] == os.getpid() and p[1] == 'Z')]
    if not left or time.time() > deadline:
      break
    time.sleep(0.1)
  assert not left, f'left behind: {left}'
  assert not _sandbox_files()


def _one(program, stdin='', expected='', time_limit_s=2.0, **limits):
  result, = sandbox.run(program, [(stdin, expected)], time_limit_s,
                        limits=sandbox.Limits(**limits))
  return result


# Verdicts.


def test_verdicts_of_a_simple_program(nothing_left):
  prog = 'a, b = map(int, input().split())\nprint(a + b)\n'
  results = sandbox.run(prog, [('1 2', '3'), ('2 2', '5'), None, ('x', '1'),
                               ('5 5\n', ' 10 \n\n')])
  assert [r.status for r in results] == ['ok', 'wrong_answer', 'invalid_test',
                                         'error', 'ok']
  assert [r.passed for r in results] == [True, False, False, False, True]
  assert 'ValueError' in results[3].detail
  assert results[0].output == '3\n'


def test_comparison_collapses_whitespace_only():
  prog = 'print("1  2\\n3")'
  assert _one(prog, expected='1 2 3').passed
  assert _one(prog, expected='1\n2\n3\n').passed
  assert not _one(prog, expected='12 3').passed


def test_syntax_error_fails_every_test():
  results = sandbox.run('def f(:\n', [('', ''), ('', '')])
  assert [r.status for r in results] == ['error', 'error']
  assert 'SyntaxError' in results[0].detail


def test_exit_codes_and_common_input_styles():
  assert _one('import sys\nprint(7)\nsys.exit(0)', expected='7').passed
  assert _one('print(7)\nexit()', expected='7').passed  # site's exit()
  assert _one('print(7)\nraise SystemExit(3)', expected='7').status == 'error'
  reads = ['import sys\nprint(sys.stdin.read().split()[1])',
           'import sys\nprint(sys.stdin.buffer.read().split()[1].decode())',
           'print(open(0).read().split()[1])',
           'import os\nprint(os.read(0, 100).split()[1].decode())',
           'input()\nprint(input())']
  for prog in reads:
    assert _one(prog, stdin='a\nb\n', expected='b').passed, prog


def test_os_exit_after_printing_counts_and_later_tests_still_run():
  prog = 'import os\nprint(input(), flush=True)\nos._exit(0)'
  results = sandbox.run(prog, [('1', '1'), ('2', '2'), ('3', '4')])
  assert [r.status for r in results] == ['ok', 'ok', 'wrong_answer']


def test_tests_are_isolated_from_each_other():
  prog = ('import builtins\n'
          'n = globals().get("n", 0) + 1\n'
          'builtins.seen = getattr(builtins, "seen", 0) + 1\n'
          'print(n, input())\n')
  results = sandbox.run(prog, [('a', '1 a'), ('b', '1 b'), ('c', '1 c')])
  assert all(r.passed for r in results), results  # fresh globals, own stdin


def test_threads_and_deep_recursion_are_waited_for_and_allowed():
  threaded = ('import threading\n'
              'def main():\n  print(int(input()) * 2)\n'
              'threading.stack_size(1 << 26)\n'
              'threading.Thread(target=main).start()\n')
  assert _one(threaded, stdin='21', expected='42').passed
  deep = ('import sys\nsys.setrecursionlimit(10**6)\n'
          'def f(n): return 0 if n == 0 else 1 + f(n - 1)\n'
          'print(f(100000))\n')
  assert _one(deep, expected='100000').passed


def test_assert_style_checks():
  prog = 'def add(a, b):\n  return a + b\n'
  results = sandbox.run(prog, [
      sandbox.Check('assert add(1, 2) == 3\n'),
      sandbox.Check('assert add(1, 2) == 4, "bad sum"\n'),
      sandbox.Check('assert undefined_name(1)\n'),
      sandbox.Check('def check(candidate):\n  assert candidate(2, 2) == 4\n'
                    'check(add)\n'),
      sandbox.Check('def broken(:'),
  ])
  assert [r.status for r in results] == ['ok', 'wrong_answer', 'error', 'ok',
                                         'error']
  assert 'bad sum' in results[1].detail
  assert 'does not compile' in results[4].detail


def test_exits_do_not_pass_assert_style_checks():
  for prog in ('import sys\nsys.exit(0)\n', 'import os\nos._exit(0)\n',
               'raise SystemExit\n', 'import os\nos.close(3)\n'):
    result, = sandbox.run(prog, [sandbox.Check('assert False\n')])
    assert not result.passed, (prog, result)


# The result channel cannot be forged.


def test_printing_exiting_or_closing_stdout_cannot_fake_a_pass():
  cases = [
      'print("ok")\nprint("{\\"passed\\": true}")',
      'import sys\nsys.exit(0)',
      'import os\nos.close(1)\nos.close(2)\nprint(42)',
      'import sys\nsys.stdout.close()',
      # A forged worker event: 'ok' is not a status a worker may report.
      'import os, marshal\nf = marshal.dumps((0, "ok", ""))\n'
      'os.write(3, len(f).to_bytes(4, "big") + f)\n',
      # Claiming 'done' early still needs the right output.
      'import os, marshal\nf = marshal.dumps((0, "done", ""))\n'
      'os.write(3, len(f).to_bytes(4, "big") + f)\n',
      'import os\nos.write(3, b"\\xff" * 64)\n',
      'import os\nfor fd in range(3, 64):\n'
      '  try: os.write(fd, b"\\0\\0\\0\\1N" * 8)\n  except OSError: pass\n',
  ]
  for prog in cases:
    results = sandbox.run(prog, [('', '42'), ('', '42')])
    assert not any(r.passed for r in results), (prog, results)


def test_the_harness_cannot_be_traced_or_read():
  for target in ('/proc/1/fd/1', '/proc/1/mem', '/proc/1/environ'):
    result = _one(f'open({target!r}, "rb").read(1)\nprint("read")',
                  expected='read')
    assert result.status == 'error', (target, result)
    assert 'Permission' in result.detail, result
  result = _one('import ctypes\n'
                'libc = ctypes.CDLL(None)\n'
                'print(libc.ptrace(16, 1, 0, 0))',  # PTRACE_ATTACH to PID 1
                expected='0')
  assert result.status == 'wrong_answer' and result.output == '-1\n'


# Containment (the security list).


def test_network_is_unreachable(nothing_left):
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen(1)
  listener.setblocking(False)
  port = listener.getsockname()[1]
  try:
    prog = ('import socket\n'
            f's = socket.create_connection(("127.0.0.1", {port}), timeout=2)\n'
            'print("connected")\n')
    result = _one(prog, expected='connected')
    assert result.status == 'error', result
    assert 'connected' not in result.output
    # The seccomp filter refuses inet sockets; without it: no route.
    assert any(why in result.detail.lower() for why in (
        'not supported', 'refused', 'unreachable')), result
    with pytest.raises(BlockingIOError):
      listener.accept()
  finally:
    listener.close()


def test_fork_bomb_is_capped_and_cleaned_up(nothing_left):
  prog = ('import os\n'
          'while True:\n'
          '  try:\n    os.fork()\n'
          '  except OSError:\n    pass\n')
  start = time.time()
  results = sandbox.run(prog, [('', ''), ('', '')], time_limit_s=FAST)
  assert [r.status for r in results] == ['timeout', 'timeout'], results
  assert time.time() - start < 2 * (FAST * 3 + 1) + 5


def test_fork_bomb_in_one_sandbox_does_not_starve_the_others(nothing_left):
  bomb = 'import os\nwhile True:\n  try: os.fork()\n  except OSError: pass\n'
  # Forks once; the child ends at once (else it too would print, as it does
  # under a plain python3).
  fine = ('import os\npid = os.fork()\nif pid == 0:\n  os._exit(0)\n'
          'os.waitpid(pid, 0)\nprint(1)')
  jobs = [(bomb, [('', '')])] + [(fine, [('', '1')] * 3)] * 3
  results = sandbox.run_many(jobs, FAST, workers=4)
  assert results[0][0].status == 'timeout'
  assert all(r.passed for rs in results[1:] for r in rs), results


def test_huge_allocation_is_a_memory_error(nothing_left):
  assert _one('x = bytearray(4 << 30)').status == 'memory'
  assert _one('x = [0] * (1 << 30)').status == 'memory'


def test_infinite_loop_and_sleep_time_out(nothing_left):
  start = time.time()
  result = _one('while True:\n  pass\n', time_limit_s=FAST)
  assert result.status == 'timeout' and 'CPU' in result.detail
  assert time.time() - start < FAST * 3 + 1 + 3
  result = _one('import time\ntime.sleep(60)\n', time_limit_s=FAST)
  assert result.status == 'timeout' and 'wall' in result.detail


def test_huge_output_is_capped(nothing_left):
  to_stdout = ('import sys\nchunk = "x" * (1 << 20)\n'
               'for _ in range(200):\n  sys.stdout.write(chunk)\n')
  result = _one(to_stdout)
  assert result.status == 'output_limit', result
  assert len(result.output) <= sandbox.Limits().keep_output
  to_file = ('with open("big", "wb") as f:\n'
             '  for _ in range(200):\n    f.write(b"x" * (1 << 20))\n')
  result = _one(to_file)
  assert result.status == 'output_limit', result
  many_files = ('for i in range(200):\n'
                '  with open(f"/tmp/f{i}", "wb") as f:\n'
                '    f.write(b"x" * (1 << 20))\n')
  result = _one(many_files)  # the private /tmp is size-capped
  assert result.status == 'error' and 'No space' in result.detail, result


@pytest.mark.parametrize('path', [
    '/pwned', '/usr/pwned', '/usr/lib/pwned', '/tmp/rla_sandbox_pwned',
    '/var/tmp/rla_sandbox_pwned', '/dev/shm/rla_sandbox_pwned',
    '/dev/rla_sandbox_pwned', os.path.expanduser('~/rla_sandbox_pwned'),
    os.path.join(os.getcwd(), 'rla_sandbox_pwned'), '../rla_sandbox_pwned'])
def test_writes_outside_the_sandbox_never_reach_the_host(path, nothing_left):
  host_path = os.path.normpath(os.path.join('/tmp', path))
  assert not os.path.exists(host_path)
  result = _one(f'open({path!r}, "w").write("x")\nprint("wrote")',
                expected='wrote')
  assert not os.path.exists(host_path), host_path
  if result.status == 'error':  # refused: read-only or not even there
    assert ('Read-only' in result.detail or 'No such file' in result.detail
            or 'Permission' in result.detail), result
  else:  # a private tmpfs that vanished with the sandbox
    assert result.passed and path.startswith(('/tmp', '/dev/shm')), result


def test_files_of_root_are_not_visible(nothing_left):
  secret = 'rla-secret-' + os.urandom(8).hex()
  fd, path = tempfile.mkstemp(dir=os.path.expanduser('~'))
  try:
    os.write(fd, secret.encode())
    os.close(fd)
    for target in (path, '/etc/shadow', '/etc/passwd'):
      result = _one(f'print(open({target!r}).read())', expected=secret)
      assert result.status == 'error', (target, result)
      assert secret not in result.output
  finally:
    os.unlink(path)


def test_killing_the_parent_or_everyone_is_contained(nothing_left):
  cases = {
      'import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(1)':
          'ok',  # the harness is PID 1 of the sandbox: immune
      'import os, signal\nos.kill(1, signal.SIGTERM)\nprint(1)': 'ok',
      'import os, signal\nos.kill(1, signal.SIGINT)\nprint(1)': 'ok',
      'import os\ntry:\n  os.kill(-1, 9)\nexcept OSError:\n  pass\nprint(1)':
          'ok',  # nothing else to kill in its namespace
      f'import os\nos.kill({os.getpid()}, 9)\nprint(1)': 'error',  # not here
      'import os, signal\nos.killpg(0, signal.SIGKILL)': 'error',
      'import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)': 'timeout',
  }
  for prog, status in cases.items():
    results = sandbox.run(prog, [('', '1'), ('', '1')], time_limit_s=FAST)
    assert [r.status for r in results] == [status] * 2, (prog, results)


# Kernel memory outside RLIMIT_AS (issue 31, part 2): each an attack.

BOMB = '''
import errno, os
{setup}
n = 0
try:
  while n < 10 ** 7:
    path = {top!r} + '/' + str(n)
    {make}
    n += 1
except OSError as e:
  print(n, errno.errorcode[e.errno])
'''
EMPTY_FILE = 'os.close(os.open(path, os.O_CREAT | os.O_WRONLY))'
# name -> (directory, setup, what each step makes, files it makes besides).
BOMBS = {
    'files in /tmp': ('/tmp', '', EMPTY_FILE, 0),
    'files in /dev/shm': ('/dev/shm', '', EMPTY_FILE, 0),
    'files in the cwd': ('.', '', EMPTY_FILE, 0),
    'hard links': ('/tmp', 'open("/tmp/f", "w").close()',
                   'os.link("/tmp/f", path)', 1),
    'directories': ('/dev/shm', '', 'os.mkdir(path)', 0),
    'symlinks': ('/tmp', '', 'os.symlink("x" * 200, path)', 0),
}


@pytest.mark.parametrize('name', sorted(BOMBS))
def test_an_inode_bomb_stops_at_tmp_files(name, nothing_left):
  # Before: 3.09 M empty files in a 64 MB /tmp, ~1.5 KB of kernel memory
  # each, outside every limit.
  top, setup, make, besides = BOMBS[name]
  prog = BOMB.format(top=top, setup=setup, make=make)
  for tmp_files in (sandbox.Limits().tmp_files, 100):
    result = _one(prog, tmp_files=tmp_files)
    count, error = result.output.split()
    assert error == 'ENOSPC', (name, result)
    assert tmp_files - 1 <= int(count) + besides <= tmp_files, (name, result)


PRELUDE = '''
import ctypes, errno, fcntl, os, select, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
  if getattr(libc, name)(*args) == -1:
    raise OSError(ctypes.get_errno(), name)
try:
{code}
  print('allowed')
except OSError as e:
  print(errno.errorcode.get(e.errno, e.errno))
'''
# What would hold kernel memory no limit counts -> the error it now gets.
REFUSED = {
    'memfd_create': ("os.memfd_create('x')", 'EPERM'),
    'memfd_secret': ('call("syscall", 447, 0)', 'EPERM'),
    'SysV shared memory': ('call("shmget", 0, 1 << 20, 0o1600)', 'EPERM'),
    'SysV message queue': ('call("msgget", 0, 0o1600)', 'EPERM'),
    'SysV semaphores': ('call("semget", 0, 1, 0o1600)', 'EPERM'),
    'POSIX message queue': (
        'call("mq_open", b"/q", os.O_CREAT | os.O_RDWR, 0o600, None)',
        'EPERM'),
    'io_uring': ('call("syscall", 425, 8, ctypes.create_string_buffer(120))',
                 'EPERM'),
    'epoll': ('select.epoll()', 'EPERM'),
    'inotify': ('call("inotify_init1", 0)', 'EPERM'),
    'TCP socket': ('socket.socket()', 'EAFNOSUPPORT'),
    'UDP socket': ('socket.socket(socket.AF_INET, socket.SOCK_DGRAM)',
                   'EAFNOSUPPORT'),
    'unix datagrams': ('socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)',
                       'ESOCKTNOSUPPORT'),
    'unix listener': ('s = socket.socket(socket.AF_UNIX)\n'
                      's.bind("\\0x")\ns.listen()', 'EPERM'),
    'bigger socket buffer': (
        'socket.socketpair()[0].setsockopt(socket.SOL_SOCKET, '
        'socket.SO_SNDBUF, 1 << 22)', 'EPERM'),
    'bigger pipe': ('fcntl.fcntl(os.pipe()[1], fcntl.F_SETPIPE_SZ, 1 << 20)',
                    'EPERM'),
    'byte-range lock': ('fcntl.lockf(os.open("/tmp/l", os.O_CREAT | '
                        'os.O_RDWR), fcntl.LOCK_EX, 1, 0)', 'ENOLCK'),
    'splice': ('os.splice(os.open("/usr/bin/env", 0), os.pipe()[1], 4096)',
               'EPERM'),
    'sendfile': ('os.sendfile(os.pipe()[1], os.open("/usr/bin/env", 0), 0, '
                 '4096)', 'EPERM'),
    'vmsplice': ('call("vmsplice", os.pipe()[1], None, 0, 0)', 'EPERM'),
    'names of mappings': ('call("prctl", 0x53564D41, 0, 0, 0, 0)', 'EPERM'),
    # The capabilities that mounted /tmp are gone.
    'remount /tmp': ('call("mount", None, b"/tmp", None, 32, b"nr_inodes=0")',
                     'EPERM'),
    'mount over /tmp': (
        'call("mount", b"tmpfs", b"/tmp", b"tmpfs", 0, b"nr_inodes=0")',
        'EPERM'),
    'unmount /tmp': ('call("umount2", b"/tmp", 2)', 'EPERM'),
    'a mount namespace': ('call("unshare", 0x20000)', 'EPERM'),
}


@pytest.mark.parametrize('name', sorted(REFUSED))
def test_what_holds_kernel_memory_is_refused(name):
  code, error = REFUSED[name]
  indented = '\n'.join('  ' + line for line in code.splitlines())
  result = _one(PRELUDE.format(code=indented))
  assert result.output == error + '\n', (name, result)


def test_a_program_holds_no_capability():
  prog = ('import resource as r\n'
          'for line in open("/proc/self/status"):\n'
          '  if line.startswith(("Cap", "NoNewPrivs")):\n'
          '    print(line.split()[1], end=" ")\n'
          'print(open("/proc/self/oom_score_adj").read().strip(),\n'
          '      r.getrlimit(r.RLIMIT_MSGQUEUE),\n'
          '      r.getrlimit(r.RLIMIT_SIGPENDING))')
  zero = '0000000000000000'
  # Inheritable, permitted, effective, bounding, ambient; no_new_privs.
  expected = f'{zero} ' * 5 + '1 1000 (0, 0) (64, 64)'
  assert _one(prog, expected=expected).passed


def test_posix_timers_stop_at_the_pending_signals_limit():
  # Before: 96,367 (the host's RLIMIT_SIGPENDING), ~0.5 KB each.
  prog = ('import ctypes\n'
          'libc = ctypes.CDLL(None, use_errno=True)\n'
          'timer, n = ctypes.c_void_p(), 0\n'
          'while n < 10 ** 6 and libc.timer_create(\n'
          '    1, None, ctypes.byref(timer)) == 0:\n'
          '  n += 1\n'
          'print(n, ctypes.get_errno())')
  count, error = _one(prog).output.split()
  assert int(count) <= 64 and int(error) == 11, (count, error)  # EAGAIN


def test_ordinary_python_still_works(nothing_left):
  prog = '''
import concurrent.futures, fcntl, mmap, multiprocessing as mp, os, shutil
import socket, subprocess, sys, tempfile, threading
with mp.Pool(2) as pool:
  assert pool.map(abs, range(-3, 3)) == [3, 2, 1, 0, 1, 2]
with concurrent.futures.ProcessPoolExecutor(2) as executor:
  assert list(executor.map(abs, [-1, -2])) == [1, 2]
queue = mp.Queue()
process = mp.Process(target=queue.put, args=(7,))
process.start()
assert queue.get() == 7
process.join()
a, b = mp.Pipe()  # a unix stream socketpair
a.send([1, 2])
assert b.recv() == [1, 2]
with mp.Lock():  # a POSIX semaphore in /dev/shm
  pass
run = subprocess.run([sys.executable, '-c', 'print(6 * 7)'],
                     capture_output=True, text=True)
assert run.stdout == '42\\n', run
with tempfile.NamedTemporaryFile('w', delete=False) as f:
  f.write('x' * 100000)
shutil.copyfile(f.name, f.name + '.copy')  # without sendfile
assert open(f.name + '.copy').read() == 'x' * 100000
thread = threading.Thread(target=queue.put, args=(8,))
thread.start()
thread.join()
assert queue.get() == 8
mmap.mmap(-1, 1 << 20)[:3] = b'abc'
fcntl.flock(os.open(f.name, os.O_RDONLY), fcntl.LOCK_EX)  # whole file
print('ok')
'''
  result = _one(prog, expected='ok', time_limit_s=10.0)
  assert result.passed, result


def test_a_full_tmp_fails_the_programs_own_later_tests(nothing_left):
  # The runner puts each test's stdin in /tmp: a program that filled it
  # (and kept the earlier stdin open) gets Results, the sandbox no error.
  prog = ('import os\n'
          'os.dup(0)\n'
          'try:\n'
          '  with open(f"/tmp/{os.getpid()}", "ab") as f:\n'
          '    while True:\n'
          '      f.write(b"x" * (1 << 20))\n'
          'except OSError:\n'
          '  pass\n'
          'print(input())\n')
  results = sandbox.run(prog, [('1', '1'), ('2' * 100000, '2' * 100000)],
                        limits=sandbox.Limits(tmp_mb=4))
  assert [r.status for r in results] == ['ok', 'error'], results
  assert 'no room for the input' in results[1].detail, results


def _seccomp_verdict(program, arch, nr, args=()):
  """What a classic-BPF seccomp program returns for one call."""
  data = struct.pack('=iIQ6Q', nr, arch, 0, *(list(args) + [0] * 6)[:6])
  code = [struct.unpack_from('=HBBI', program, i)
          for i in range(0, len(program), 8)]
  pc, acc = 0, 0
  while True:
    op, jt, jf, k = code[pc]
    pc += 1
    if op == 0x20:  # ld [k]
      acc = struct.unpack_from('=I', data, k)[0]
    elif op == 0x54:  # and k
      acc &= k
    elif op in (0x15, 0x35):  # jeq, jge
      pc += jt if (acc == k if op == 0x15 else acc >= k) else jf
    elif op == 0x06:  # ret k
      return k
    else:
      raise AssertionError(f'unexpected BPF opcode {op:#x}')


@pytest.mark.parametrize('machine', ['x86_64', 'aarch64'])
def test_the_seccomp_filter_of_each_cpu(machine):
  # pylint: disable=protected-access
  program = sandbox_kernel.seccomp_filter(machine)
  column, arch = sandbox_kernel._MACHINES[machine]
  nr = {n: v[column] for n, v in sandbox_kernel._SYSCALLS.items()}
  allow, refused = 0x7FFF0000, lambda e: 0x50000 | e
  verdict = lambda name, *args: _seccomp_verdict(program, arch, nr[name],
                                                 args)
  for name in sandbox_kernel._DENIED:
    if nr[name] is not None:
      assert verdict(name) == refused(errno.EPERM), name
  read, mmap = {'x86_64': (0, 9), 'aarch64': (63, 222)}[machine]
  for call in (read, mmap):
    assert _seccomp_verdict(program, arch, call) == allow
  for name in ('socket', 'socketpair'):
    assert verdict(name, 1, 1 | 0o4000 | 0o2000000) == allow  # flags kept
    assert verdict(name, 1, 2) == refused(errno.ESOCKTNOSUPPORT)
    assert verdict(name, 2, 1) == refused(errno.EAFNOSUPPORT)
  assert verdict('setsockopt', 3, 1, 7) == refused(errno.EPERM)  # SO_SNDBUF
  assert verdict('setsockopt', 3, 1, 2) == allow  # SO_REUSEADDR
  assert verdict('setsockopt', 3, 6, 7) == allow  # not SOL_SOCKET
  assert verdict('fcntl', 3, 6) == refused(errno.ENOLCK)  # F_SETLK
  assert verdict('fcntl', 3, 1031) == refused(errno.EPERM)  # F_SETPIPE_SZ
  assert verdict('fcntl', 3, 4) == allow  # F_SETFL
  assert verdict('prctl', 0x53564D41) == refused(errno.EPERM)
  assert verdict('prctl', 4) == allow  # PR_SET_DUMPABLE
  # Another ABI's calls (i386 through int 0x80, x32) all fail.
  assert _seccomp_verdict(program, 0x40000003, read) == refused(errno.EPERM)
  if machine == 'x86_64':
    assert _seccomp_verdict(program, arch, 0x40000000) == refused(errno.EPERM)
  assert sandbox_kernel.seccomp_filter('riscv64') is None  # run without, warned


def test_kernel_memory_bound_of_the_default_limits():
  bound = sandbox.kernel_memory_bound()
  limits, mb = sandbox.Limits(), 1 << 20
  with open('/proc/sys/net/core/wmem_default') as f:
    wmem = int(f.read())
  with open('/proc/sys/vm/max_map_count') as f:
    mappings = int(f.read())
  objects = 16 * 64 + 64 + 253  # processes * open_files, in flight
  assert bound == {
      'tmp_data': 2 * 64 * mb,
      'tmp_files': (2 * 4096 + 3) * 1600,  # + 2 roots and the stdin
      'buffers': objects * (max(64 << 10, wmem * 3 // 2) + (8 << 10)),
      'tasks': 16 * (64 << 10) + 64 * 1024,
      'page_tables': 16 * mappings * (8192 + 512),
      'total': sum(v for k, v in bound.items() if k != 'total'),
  }
  assert limits.tmp_mb == 64 and limits.tmp_files == 4096
  # The budget: what no process's OOM score counts, with Linux's default
  # 208 KB socket buffers. Page tables are in the OOM score.
  assert bound['total'] - bound['page_tables'] < 600 * mb, bound
  assert bound['tmp_data'] + bound['tmp_files'] < 150 * mb  # outlives runners
  assert sandbox.kernel_memory_bound(limits, 5 * mb)['tmp_data'] == 133 * mb


def test_without_cap_add_the_sandbox_still_works(monkeypatch, caplog,
                                                 nothing_left):
  # A setuid bwrap refuses --cap-add; an unknown capability fails alike.
  monkeypatch.setattr(sandbox, '_HARNESS_CAPS', ('CAP_NO_SUCH_THING',))
  monkeypatch.setattr(sandbox, '_owns_tmp_cache', {})
  prog = ('import os\n'
          'print(os.statvfs("/tmp").f_files > 10 ** 5, input())\n'
          'os.memfd_create("x")')
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      result = _one(prog, stdin='1', expected='True 1')
      assert result.status == 'error' and 'Operation not permitted' in (
          result.detail), result  # bwrap's tmpfs, seccomp still there
      assert result.output == 'True 1\n', result
  warnings = [r for r in caplog.records if 'tmp_files' in r.getMessage()]
  assert len(warnings) == 1, caplog.text
  assert 'NUMBER' in warnings[0].getMessage()


# Parallel runs and configuration.


def test_run_many_matches_run_and_keeps_order(nothing_left):
  jobs = [(f'print({i} * int(input()))', [('2', str(2 * i)), ('3', '0')])
          for i in range(6)]
  results = sandbox.run_many(jobs, workers=3)
  assert [[r.status for r in rs] for rs in results] == [
      ['ok', 'ok']] + [['ok', 'wrong_answer']] * 5
  assert results[2] == [r for r in results[2]]
  per_job = sandbox.run_many([('print(1)', [('', '1')], 0.2)])
  assert per_job[0][0].passed


def test_missing_bwrap_refuses_unless_allowed(monkeypatch, caplog):
  monkeypatch.setattr(sandbox, 'available', lambda: False)
  with pytest.raises(sandbox.SandboxUnavailable, match='apt-get install'):
    sandbox.run('print(1)', [('', '1')])
  limits = sandbox.Limits(allow_unsandboxed=True)
  monkeypatch.setattr(sandbox, '_warned_unsandboxed', False)
  with caplog.at_level(logging.WARNING):
    results = sandbox.run('print(1)', [('', '1'), ('', '2')], limits=limits)
  assert [r.status for r in results] == ['ok', 'wrong_answer']
  assert 'WITHOUT a sandbox' in caplog.text


def test_a_missing_interpreter_is_an_infrastructure_error():
  limits = sandbox.Limits(python='/nonexistent/python3')
  with pytest.raises(sandbox.SandboxUnavailable):
    sandbox.run('print(1)', [('', '1')], limits=limits)
  assert sandbox.run('print(1)', []) == []
  assert sandbox.run(None, [('', '1')])[0].status == 'error'


def test_limits_reach_the_program():
  prog = ('import resource\n'
          'print(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20,\n'
          '      resource.getrlimit(resource.RLIMIT_NPROC)[0])\n')
  assert _one(prog, expected='256 8', memory_mb=256, processes=8).passed
  assert stat.S_ISDIR(os.stat('/tmp').st_mode)  # the host /tmp is untouched


def test_a_hung_harness_is_killed_innermost_first(monkeypatch, nothing_left):
  # The host's own deadline only fires when the harness is stuck; make it
  # fire first (before the harness's wall-clock limit) to test that path.
  monkeypatch.setattr(sandbox, '_GRACE_S', -2.0)
  start = time.time()
  with pytest.raises(sandbox.SandboxError, match='did not finish'):
    sandbox.run('import time\ntime.sleep(30)', [('', '')], time_limit_s=FAST)
  assert time.time() - start < 5


def test_large_inputs_and_escaped_daemons(nothing_left):
  big = ' '.join(['7'] * (6 << 20))  # 12 MB of input: over file_mb
  prog = ('import os\nprint(len(os.read(0, os.fstat(0).st_size).split()))')
  assert _one(prog, stdin=big, expected=str(len(big.split())), file_mb=1,
              memory_mb=1024).passed
  daemon = ('import os, time\n'
            'if os.fork() == 0:\n'
            '  os.setsid()\n'
            '  if os.fork() == 0:\n'
            '    time.sleep(60)\n'
            '  os._exit(0)\n'
            'print(1)\n')
  assert _one(daemon, expected='1').passed  # the grandchild dies with it


# Forged rewards (issue 31): what a policy would find, each a wrong program.

FRAME_WALK = '''
import hashlib, sys
def forged():
  f = sys._getframe()
  while f:
    job, k = f.f_locals.get('job'), f.f_locals.get('k')
    if isinstance(job, dict) and 'expected' in job and isinstance(k, int):
      for answer in ['YES', 'NO'] + [str(i) for i in range(100)]:
        if hashlib.sha256(answer.encode()).digest() == job['expected'][k]:
          return answer
    f = f.f_back
  return 'none'
print(forged())
'''

CHECK_FROM_MEMORY = '''
import ast, gc, sys
def _answers():
  """candidate(args) == value pairs of any check source in reach."""
  sources = []
  f = sys._getframe()
  while f:
    sources += [v for v in f.f_locals.values() if isinstance(v, str)]
    for v in f.f_locals.values():
      if isinstance(v, (list, tuple, dict)):
        items = v.values() if isinstance(v, dict) else v
        for t in items:
          if isinstance(t, (list, tuple)):
            sources += [x for x in t if isinstance(x, str)]
          elif isinstance(t, str):
            sources.append(t)
    f = f.f_back
  table = {}
  for text in sources:
    try:
      tree = ast.parse(text)
    except (SyntaxError, ValueError):
      continue
    for node in ast.walk(tree):
      if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
          and node.left.func.id == 'candidate'):
        args = tuple(ast.literal_eval(a) for a in node.left.args)
        table[args] = ast.literal_eval(node.comparators[0])
  return table
TABLE = _answers()
def double(x):
  return TABLE.get((x,), 0)
'''

CHECK = ('def check(candidate):\n'
         '  assert candidate(3) == 6\n'
         '  assert candidate(5) == 10\n'
         '  assert candidate(0.5) == 1.0\n'
         'check(double)\n')
CHECK_ABS = ('assert double(3) == 6\n'
             'assert abs(double(0.5) - 1.0) < 1e-9\n')
WRONG = 'def double(x):\n  return x\n'

FORGED_CHECKS = {
    'builtins.exec replaced':
        WRONG + 'import builtins\nbuiltins.exec = lambda *a, **k: None\n',
    'the compiled check swapped in the caller frame':
        WRONG + 'import sys\ndef swap():\n  f = sys._getframe()\n'
        '  while f:\n'
        '    for v in list(f.f_locals.values()):\n'
        '      if isinstance(v, dict):\n'
        '        for key in list(v):\n'
        '          if type(v[key]).__name__ == "code":\n'
        '            v[key] = compile("pass", "<forged>", "exec")\n'
        '    f = f.f_back\n'
        'swap()\n',
    'result frames written to fd 3':
        WRONG + 'import marshal, os\n'
        'for event in ((0, "done", ""), "0\\x1fdone\\x1f"):\n'
        '  data = (marshal.dumps(event) if isinstance(event, tuple) else\n'
        '          event.encode())\n'
        '  os.write(3, len(data).to_bytes(4, "big") + data)\n'
        'os._exit(0)\n',
    'an object that equals everything':
        'class Any:\n  def __eq__(self, other):\n    return True\n'
        'def double(x):\n  return Any()\n',
    'an int subclass that equals everything':
        'class Int(int):\n  def __eq__(self, other):\n    return True\n'
        '  __hash__ = int.__hash__\n'
        'def double(x):\n  return Int(0)\n',
    # Our own: the expected values read from the check's source in memory.
    'answers read from the check in memory': CHECK_FROM_MEMORY,
    # Our own: leaving before the check runs, however it is done.
    'sys.exit(0) before the check': WRONG + 'import sys\nsys.exit(0)\n',
    'os._exit(0) in an atexit hook':
        WRONG + 'import atexit, os\natexit.register(os._exit, 0)\n',
    'AssertionError replaced':
        WRONG + 'import builtins\n'
        'builtins.AssertionError = type("AssertionError", (Exception,), {})\n',
}


def test_a_frame_walk_finds_no_expected_output(nothing_left):
  tests = [('', 'YES'), ('', 'NO'), ('', '7'), ('', '12')]
  results = sandbox.run(FRAME_WALK, tests)
  assert [r.status for r in results] == ['wrong_answer'] * 4, results
  assert [r.output for r in results] == ['none\n'] * 4


@pytest.mark.parametrize('name', sorted(FORGED_CHECKS))
def test_a_forged_check_fails(name, nothing_left):
  result, = sandbox.run(FORGED_CHECKS[name], [sandbox.Check(CHECK)])
  assert result.status in ('wrong_answer', 'error'), (name, result)


def test_a_builtin_the_check_uses_cannot_be_patched(nothing_left):
  # Our own forge: the program patches abs, which the check calls.
  forged = ('import builtins\nbuiltins.abs = lambda x: 0\n'
            'def double(x):\n  return {3: 6}.get(x, x)\n')
  result, = sandbox.run(forged, [sandbox.Check(CHECK_ABS)])
  assert result.status == 'wrong_answer', result


def test_the_real_solution_passes_the_forged_checks_checks():
  results = sandbox.run('def double(x):\n  return 2 * x\n',
                        [sandbox.Check(CHECK), sandbox.Check(CHECK_ABS)])
  assert all(r.passed for r in results), results


def test_checks_see_plain_values_of_the_program():
  program = ('import math\nN = 3\nPAIRS = {(1, 2): [b"x", {4.5}]}\n'
             'def f(*args, **kwargs):\n  return (args, kwargs)\n'
             'def g():\n  raise ValueError("no")\n'
             'def h():\n  return math.sqrt\n')
  checks = {
      'assert N == 3 and PAIRS == {(1, 2): [b"x", {4.5}]}': 'ok',
      'assert f(1, "a", k=(None, 2j)) == ((1, "a"), {"k": (None, 2j)})': 'ok',
      'assert type(f(1)[0]) is tuple': 'ok',
      'try:\n  g()\nexcept ValueError as e:\n  assert "no" in str(e)': 'ok',
      'h()': 'error',  # a function is not a plain value
      'f(lambda: 1)': 'error',  # nor as an argument
      'math': 'error',  # modules stay with the program
  }
  results = sandbox.run(program, [sandbox.Check(c) for c in checks])
  assert [r.status for r in results] == list(checks.values()), results


def test_no_expected_output_is_anywhere_the_program_can_read(nothing_left):
  # Our own forge: look for the expected text in memory, in every fd and in
  # every process's files the sandbox shows, and print what is found.
  search = '''
import gc, os, sys
def found():
  texts = [o for o in gc.get_objects() if isinstance(o, (str, bytes))]
  f = sys._getframe()
  while f:
    texts += list(f.f_locals.values()) + list(f.f_globals.values())
    f = f.f_back
  for fd in range(64):
    try:
      texts.append(os.pread(fd, 1 << 20, 0))
    except OSError:
      pass
  for pid in os.listdir('/proc'):
    for name in ('cmdline', 'environ', 'fd/0', 'fd/1', 'fd/3', 'fd/5'):
      try:
        fd = os.open(f'/proc/{pid}/{name}', os.O_RDONLY | os.O_NONBLOCK)
        texts.append(os.read(fd, 1 << 20))
        os.close(fd)
      except OSError:
        pass
  for t in texts:
    t = t.decode('latin-1') if isinstance(t, bytes) else t
    if isinstance(t, str) and 'MARK' + 'ER-' in t:
      i = t.index('MARK' + 'ER-')
      return t[i:i + 15]
  return 'none'
print(found())
'''
  results = sandbox.run(search, [('', 'MARKER-81726354'), ('1', 'MARKER-2')])
  assert [r.output for r in results] == ['none\n', 'none\n'], results


# The contract: a Result for any text, a named SandboxError for a bad limit.


def test_any_test_text_gives_results(nothing_left):
  echo = 'import sys\nsys.stdout.write(sys.stdin.read())\n'
  cases = [('\ud800', '\ufffd' * 3), ('a\udcffb', 'a\ufffdb'),
           ('x\0y', 'x\0y'), ('z' * (2 << 20), 'z' * (2 << 20))]
  results = sandbox.run(echo, cases + [(s, '') for s, _ in cases[:2]] +
                        [('\ud800', '\ud800'), sandbox.Check('\ud800')])
  assert [r.status for r in results] == (
      ['ok'] * 4 + ['wrong_answer'] * 3 + ['error']), results
  assert sandbox.run('print("\ud800")', [('', '\ud800')])[0].status == 'error'
  assert sandbox.run('print(1)\0', [('', '1')])[0].status == 'error'


@pytest.mark.parametrize('time_limit_s', [float('nan'), float('inf'), -1.0,
                                          0.0, 1e9, '2', True, None])
def test_a_bad_time_limit_is_a_named_sandbox_error(time_limit_s):
  with pytest.raises(sandbox.SandboxError, match='time_limit_s='):
    sandbox.run('print(1)', [('', '1')], time_limit_s)


@pytest.mark.parametrize('field,value', [
    ('memory_mb', 0), ('memory_mb', 1.5), ('processes', -1),
    ('wall_factor', float('nan')), ('wall_extra_s', -1.0),
    ('keep_output', float('inf')), ('open_files', True)])
def test_a_bad_limit_is_a_named_sandbox_error(field, value):
  limits = sandbox.Limits(**{field: value})
  with pytest.raises(sandbox.SandboxError, match=f'limits.{field}='):
    sandbox.run('print(1)', [('', '1')], limits=limits)
