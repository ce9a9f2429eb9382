"""TensorBoard (tensorboardX) scalars, text and histograms, mirrored to JSONL.

Names follow `stage/quantity` (rollout/accuracy, policy/kl, time/judge_s...).
Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import ctypes
import fnmatch
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterable, Mapping

import numpy as np


def _import_tensorboardx():
  """tensorboardX, without the torch it imports when torch is installed.

  Its writer tries `import torch` only to accept torch tensors; we log floats
  and numpy arrays, and torch would cost every run ~2 s and ~190 MB of RAM.
  The import is blocked for that one module load (a torch imported earlier,
  e.g. by a test, is used as is).
  """
  if 'tensorboardX' in sys.modules or 'torch' in sys.modules:
    import tensorboardX  # pylint: disable=g-import-not-at-top
    return tensorboardX
  sys.modules['torch'] = None  # `import torch` raises ImportError meanwhile
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  finally:
    del sys.modules['torch']
  return tensorboardX


class Writer:
  """Writes scalars/text/histograms to TensorBoard and `metrics.jsonl`."""

  def __init__(self, logdir: str, enabled: bool = True):
    self.enabled = enabled
    self._tb = None
    self._jsonl = None
    if enabled:
      tensorboardX = _import_tensorboardx()
      os.makedirs(logdir, exist_ok=True)
      self._tb = tensorboardX.SummaryWriter(logdir)
      self._jsonl = open(os.path.join(logdir, 'metrics.jsonl'), 'a')

  def scalars(self, step: int, values: Mapping[str, float]):
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in values.items()
             if v is not None and math.isfinite(float(v))}
    for name, value in clean.items():
      self._tb.add_scalar(name, value, step)
    self._jsonl.write(json.dumps({'step': step, 'time': time.time(),
                                  **clean}) + '\n')
    self._jsonl.flush()

  def text(self, step: int, name: str, text: str):
    if self.enabled:
      # TensorBoard renders markdown; indent so whitespace survives.
      self._tb.add_text(name, '    ' + text.replace('\n', '\n    '), step)

  def histogram(self, step: int, name: str, values: Iterable[float]):
    values = np.asarray(list(values), np.float64)
    if self.enabled and values.size:
      self._tb.add_histogram(name, values, step)

  def flush(self):
    if self.enabled:
      self._tb.flush()
      self._jsonl.flush()

  def close(self):
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def peak_rss_gb() -> float:
  """This process's peak resident memory so far, in GB (10^9 bytes)."""
  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  return kib * 1024 / 1e9


def _libc():
  try:
    return ctypes.CDLL('libc.so.6')
  except OSError:  # not glibc (macOS, musl): nothing to tune
    return None


def limit_malloc_arenas(arenas: int = 2) -> None:
  """Caps glibc's malloc arenas (call before threads start).

  glibc gives each thread that allocates its own arena (up to 8 per core);
  XLA's worker threads then leave freed buffers scattered over many arenas
  and the process's RSS keeps growing across stages.
  """
  libc = _libc()
  if libc is not None and hasattr(libc, 'mallopt'):
    libc.mallopt(-8, arenas)  # M_ARENA_MAX


def release_free_memory() -> None:
  """Hands the heap's free pages back to the OS (glibc malloc_trim)."""
  libc = _libc()
  if libc is not None and hasattr(libc, 'malloc_trim'):
    libc.malloc_trim(0)


PLAIN_EVERY_S = 20.0  # a progress line at most this often in plain logs


def progress(iterable, *, total=None, desc: str):
  """Progress of a long stage on stderr (process 0 only).

  A tqdm bar on a terminal; in a plain log (a file, CI) a line such as
  `  rollout turns: 3/6 (41 s)` at most every PLAIN_EVERY_S seconds.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return iterable
  if sys.stderr.isatty():
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    return tqdm(iterable, total=total, desc=desc, leave=False,
                file=sys.stderr, dynamic_ncols=True)
  if total is None and hasattr(iterable, '__len__'):
    total = len(iterable)
  return _plain_progress(iterable, total, desc)


def _plain_progress(iterable, total, desc: str):
  start = last = time.perf_counter()
  for done, item in enumerate(iterable, 1):
    yield item
    now = time.perf_counter()
    if now - last >= PLAIN_EVERY_S:
      print(f'  {desc}: {done}/{total if total is not None else "?"} '
            f'({now - start:.0f} s)', file=sys.stderr, flush=True)
      last = now


def summary_line(epoch: int, values: Mapping[str, float],
                 keys: Iterable[str]) -> str:
  """One line per epoch on stdout, e.g. `epoch 3 | rollout/accuracy 0.41 | ...`.

  A key may hold `*` wildcards (`eval/*/accuracy`: every split).
  """
  parts = [f'epoch {epoch}']
  for key in keys:
    for name in fnmatch.filter(values, key) if '*' in key else [key]:
      if name in values:
        parts.append(f'{name} {values[name]:.4g}')
  return ' | '.join(parts)
