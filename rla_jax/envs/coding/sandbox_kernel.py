"""What a sandboxed program can hold in the kernel, outside RLIMIT_AS.

Here are the pieces that bound it: the sizes and inode counts of the sandbox's two tmpfs
(`tmp_mounts`, mounted by sandbox_harness.py), the seccomp filter every
process of the sandbox runs under (`seccomp_filter`, handed to bwrap by
`seccomp_fd`), and the worst case of what is left (`kernel_memory_bound`).
`limits` arguments are sandbox.Limits.

Why. Files, buffers and kernel objects cost memory that RLIMIT_AS does not
count, and without a memory cgroup nothing else would:
in 64 MB of /tmp, one program made 3.09 M empty files (up to 1.5 KB of
kernel memory each). So each kind is bounded or closed, and
`kernel_memory_bound` states what a program can still hold (0.56 GB per
sandbox for the default Limits, plus page tables, see there):
- /tmp and /dev/shm cap their inodes as well as their size (Limits.tmp_files:
  files, directories and links alike). bwrap 0.8 cannot pass nr_inodes, so
  the harness mounts both itself: bwrap raises CAP_SYS_ADMIN for it alone
  (--cap-add, which an unprivileged user namespace allows), and it drops
  every capability, bounding and ambient sets included, and sets
  no_new_privs before any runner starts. A setuid bwrap refuses --cap-add:
  then one warning, and bwrap's own tmpfs, whose files are not bounded.
- A seccomp filter (bwrap --seccomp, for every process of the sandbox)
  refuses what allocates kernel memory per call or per fd: memfd_create (an
  uncapped internal tmpfs), SysV shared memory, message queues and
  semaphores, POSIX message queues, io_uring, BPF, perf events; epoll,
  inotify and fanotify (watches); splice, tee, vmsplice and sendfile (pipe
  and socket slots that pin pages); every socket but a unix stream one,
  listen() (one listener held 0.9 GB in unaccepted connections), larger
  socket buffers or pipes, byte-range locks and names of mappings. Python's
  multiprocessing (not its managers), subprocess, threads and tempfile keep
  working; asyncio's event loop (epoll) and sqlite3 files (locks) do not.
- Runners get RLIMIT_MSGQUEUE 0, RLIMIT_SIGPENDING 64 and oom_score_adj
  1000: page tables, which no limit here bounds, count in a process's OOM
  score, so under memory pressure the kernel kills runners first.
"""

from __future__ import annotations

from collections.abc import Sequence
import errno
import logging
import os
import struct
import threading
from typing import Any

_lock = threading.Lock()


def tmp_mounts(limits: Any,
                largest_input: int) -> list[tuple[str, int, int]]:
  """(path, bytes, inodes) of the sandbox's two tmpfs. /tmp also holds each
  test's stdin (an unnamed file: one inode and up to the largest input), and
  each root directory takes an inode, so the program gets tmp_mb and
  tmp_files in each."""
  size = limits.tmp_mb << 20
  return [('/tmp', size + largest_input, limits.tmp_files + 2),
          ('/dev/shm', size, limits.tmp_files + 1)]


# Kernel memory per object (Linux 6.x, 4 KB pages), for kernel_memory_bound.
_FILE_BYTES = 1600  # tmpfs inode + dentry, 255-byte name: 1.56 KB measured
_OBJECT_BYTES = 8 << 10  # an open file: file, inode, socket or pipe, seq_file
_PIPE_BYTES = 16 << 12  # a pipe's 16 one-page slots (no F_SETPIPE_SZ)
_TASK_BYTES = 64 << 10  # a process or thread: kernel stack, task, FPU, fds
_SIGNAL_BYTES = 1 << 10  # a queued signal or a POSIX timer
_MAPPING_BYTES = (2 << 12) + 512  # a mapping alone in its GB: PTE, PMD, VMA
_SCM_MAX_FD = 253  # fds in one SCM_RIGHTS message
SIGNALS_PENDING = 64  # RLIMIT_SIGPENDING of the runners


def kernel_memory_bound(limits: Any,
                        largest_input: int = 0) -> dict[str, int]:
  """Bytes of kernel memory one sandbox can hold outside RLIMIT_AS, at worst.

  Per item, and their 'total'; what the seccomp filter refuses (memfd,
  SysV IPC, epoll, listeners, ...: module docstring) is not here, nor are
  caches the kernel reclaims (names looked up and not found, page cache).
  - tmp_data: the pages of /tmp and /dev/shm, tmp_mb each, plus the largest
    test input (the host's data, in /tmp as the runner's stdin).
  - tmp_files: their inodes, each file, directory, symlink or hard link one
    (tmpfs charges a link an inode; xattrs come out of the same budget, 1 KB
    per inode), at the cost of an empty file with a 255-byte name.
  - buffers: what open objects queue. A process holds open_files fds, and
    SCM_RIGHTS keeps fds alive in flight, which the kernel refuses once a
    user has open_files of them in flight (checked before each message of
    up to 253). Each object queues at most the larger of a pipe (16 pages:
    bigger pipes are refused) and a unix stream socket, whose received data
    is charged to the peer's send buffer (net.core.wmem_default; larger
    buffers are refused) and may overshoot it by one message of half that.
  - tasks: kernel stack and task of each process or thread
    (Limits.processes), and RLIMIT_SIGPENDING queued signals or timers.
  - page_tables: a mapping alone in its own gigabyte (MAP_FIXED, or holes
    munmap'd) costs a PTE and a PMD page: up to vm.max_map_count mappings
    per process, 8 KB each, for 4 KB of address space. No limit here bounds
    them (only vm.max_map_count or a memory cgroup would), but the kernel
    counts them in the process's OOM score and runners have oom_score_adj
    1000, so they are the first processes killed under memory pressure.
  Everything but tmp_* is freed when the runners die; tmp_* when the run
  ends.
  """
  mounts = tmp_mounts(limits, largest_input)
  wmem = _sysctl('net/core/wmem_default', 212992)
  objects = (limits.processes * limits.open_files + limits.open_files +
             _SCM_MAX_FD)
  per_object = max(_PIPE_BYTES, wmem * 3 // 2) + _OBJECT_BYTES
  bound = {
      'tmp_data': sum(size for _, size, _ in mounts),
      'tmp_files': sum(inodes for _, _, inodes in mounts) * _FILE_BYTES,
      'buffers': objects * per_object,
      'tasks': (limits.processes * _TASK_BYTES +
                SIGNALS_PENDING * _SIGNAL_BYTES),
      'page_tables': (limits.processes * _MAPPING_BYTES *
                      _sysctl('vm/max_map_count', 65530)),
  }
  bound['total'] = sum(bound.values())
  return bound


def _sysctl(name: str, default: int) -> int:
  """/proc/sys/`name` as an integer; `default` where it cannot be read."""
  try:
    with open(f'/proc/sys/{name}', 'rb') as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return default


# Seccomp: what allocates kernel memory that neither RLIMIT_AS nor the tmpfs
# caps count. Syscall numbers (x86_64, aarch64); None: no such call there.
_SYSCALLS = {
    'memfd_create': (319, 279), 'memfd_secret': (447, 447),
    'shmget': (29, 194), 'msgget': (68, 186), 'semget': (64, 190),
    'mq_open': (240, 180), 'io_uring_setup': (425, 425),
    'bpf': (321, 280), 'perf_event_open': (298, 241),
    'epoll_create': (213, None), 'epoll_create1': (291, 20),
    'inotify_init': (253, None), 'inotify_init1': (294, 26),
    'fanotify_init': (300, 262), 'splice': (275, 76), 'tee': (276, 77),
    'vmsplice': (278, 75), 'sendfile': (40, 71), 'listen': (50, 201),
    'socket': (41, 198), 'socketpair': (53, 199), 'setsockopt': (54, 208),
    'fcntl': (72, 25), 'prctl': (157, 167),
}
# os.uname().machine -> (column above, AUDIT_ARCH_* of its native ABI).
_MACHINES = {'x86_64': (0, 0xC000003E), 'aarch64': (1, 0xC00000B7)}
_DENIED = (
    # Files of the kernel's internal tmpfs, which has no size cap.
    'memfd_create', 'memfd_secret',
    # Kept until the IPC namespace ends, not counted per process.
    'shmget', 'msgget', 'semget', 'mq_open',
    # Rings, maps and buffers of their own.
    'io_uring_setup', 'bpf', 'perf_event_open',
    # Watches (~200 B each, millions per user) and inodes they pin.
    'epoll_create', 'epoll_create1', 'inotify_init', 'inotify_init1',
    'fanotify_init',
    # Pipe and socket slots that hold pages by reference (huge pages, the
    # page cache), not by their size.
    'splice', 'tee', 'vmsplice', 'sendfile',
    # Up to somaxconn (4096) unaccepted connections, each with a buffer.
    'listen',
)
_AF_UNIX = _SOCK_STREAM = _SOL_SOCKET = 1
_SOCKET_BUFFERS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF and their FORCEs
_BYTE_RANGE_LOCKS = (6, 7, 37, 38)  # F_SETLK(W), F_OFD_SETLK(W)
_F_SETPIPE_SZ = 1031
_PR_SET_VMA = 0x53564D41
# Classic BPF: ld [k], jeq, jge, and, ret; seccomp's return values.
_LD, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
  return struct.pack('=HBBI', code, jt, jf, k)  # struct sock_filter


def _arg(i: int) -> bytes:
  """Loads the low 32 bits of syscall argument i (little-endian)."""
  return _bpf(_LD, 16 + 8 * i)


def _refuse(errno_: int) -> bytes:
  return _bpf(_RET, _ERRNO | errno_)


def _refused_values(i: int, values: Sequence[int],
                    errno_: int) -> list[bytes]:
  """Refuses the call when argument i is one of `values`, else allows it."""
  out = [_arg(i)]
  for value in values:
    out += [_bpf(_JEQ, value, 0, 1), _refuse(errno_)]
  return out + [_bpf(_RET, _ALLOW)]


def _seccomp_rules(nr: dict[str, int]) -> list[bytes]:
  """Per syscall: jump past its block unless it is this call; each block
  ends in a return."""
  blocks = [(name, [_refuse(errno.EPERM)]) for name in _DENIED]
  # TCP over the sandbox's loopback grows buffers to MBs per connection,
  # and a datagram socket queues messages of senders already closed.
  for name in ('socket', 'socketpair'):
    blocks.append((name, [
        _arg(0), _bpf(_JEQ, _AF_UNIX, 1, 0), _refuse(errno.EAFNOSUPPORT),
        _arg(1), _bpf(_AND, 0xF), _bpf(_JEQ, _SOCK_STREAM, 0, 1),
        _bpf(_RET, _ALLOW), _refuse(errno.ESOCKTNOSUPPORT)]))
  blocks.append(('setsockopt', [  # up to 2 * wmem_max (8 MB) per socket
      _arg(1), _bpf(_JEQ, _SOL_SOCKET, 1, 0), _bpf(_RET, _ALLOW),
      *_refused_values(2, _SOCKET_BUFFERS, errno.EPERM)]))
  blocks.append(('fcntl', [  # one lock per byte range, no limit; 1 MB pipes
      _arg(1), _bpf(_JEQ, _F_SETPIPE_SZ, 0, 1), _refuse(errno.EPERM),
      *_refused_values(1, _BYTE_RANGE_LOCKS, errno.ENOLCK)]))
  blocks.append(('prctl', _refused_values(0, [_PR_SET_VMA], errno.EPERM)))
  out = []
  for name, block in blocks:
    if name in nr:
      out += [_bpf(_JEQ, nr[name], 0, len(block)), *block]
  return out


def seccomp_filter(machine: str) -> bytes | None:
  """The seccomp program (struct sock_filter[]) bwrap installs before the
  harness starts, so every process of the sandbox runs under it; None for
  a CPU whose syscall numbers are not listed here."""
  if machine not in _MACHINES:
    return None
  column, arch = _MACHINES[machine]
  nr = {name: numbers[column] for name, numbers in _SYSCALLS.items()
        if numbers[column] is not None}
  body = _seccomp_rules(nr) + [_bpf(_RET, _ALLOW)]
  # Another ABI (i386 through int 0x80, x32) numbers its calls differently:
  # all of its calls fail.
  x32 = [_bpf(_JGE, 0x40000000, len(body), 0)] if machine == 'x86_64' else []
  head = [_bpf(_LD, 4), _bpf(_JEQ, arch, 0, 1 + len(x32) + len(body)),
          _bpf(_LD, 0)]
  program = head + x32 + body + [_refuse(errno.EPERM)]
  assert len(program) < 256, 'jumps must fit in 8 bits'
  return b''.join(program)


_seccomp: list[bytes | None] = []  # the filter for this machine, once built


def seccomp_fd() -> int | None:
  """A pipe's read end holding the seccomp program (bwrap --seccomp reads
  it); None, with one warning, on a CPU without syscall numbers here."""
  with _lock:
    if not _seccomp:
      _seccomp.append(seccomp_filter(os.uname().machine))
      if _seccomp[0] is None:
        logging.warning('no seccomp filter for %s: sandboxed programs may '
                        'allocate kernel memory through memfd_create, SysV '
                        'IPC, sockets, ... (see sandbox.py)',
                        os.uname().machine)
  if _seccomp[0] is None:
    return None
  read, write = os.pipe()
  try:
    os.write(write, _seccomp[0])  # ~1 KB: fits in the pipe's buffer
  finally:
    os.close(write)
  return read
