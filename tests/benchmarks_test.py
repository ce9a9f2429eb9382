"""The memory plan and the GPU check run end to end at a tiny size on CPU."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *flags):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'benchmarks', script), *flags],
      capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
      check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


@pytest.mark.slow
def test_memory_plan_tiny():
  out = _run('memory_plan.py', '--tiny')
  # One row per program, each with the per-device numbers and headroom.
  rows = [line for line in out.splitlines() if line.startswith('tiny ')]
  assert [r.split()[3:5] for r in rows] == [
      ['policy', 'step'], ['rm', 'step'], ['policy', 'sampler'],
      ['rm', 'sampler']], out
  assert "'embed': 'fsdp'" in out and "{'data': 1, 'fsdp': 2, 'tensor': 2}" in out
  for row in rows:
    args, total = float(row.split()[5]), float(row.split()[10])
    assert 0 < args <= total, row
  worst = float(re.search(r'worst_headroom=([\d.]+)', out).group(1))
  assert 0.5 < worst < 1.0


@pytest.mark.slow
def test_gpu_check_tiny_on_cpu():
  out = _run('gpu_check.py', '--tiny')
  assert re.search(r'tiny decode: batch 4, .* tok/s.*host [\d.]+ ms per '
                   r'call', out), out
  assert re.search(r'tiny train: 2 x 64 tokens, .* tok/s.*host [\d.]+ ms per '
                   r'step', out), out
  assert 'gpu_check decode_bw_fraction=nan train_mfu=nan' in out  # no peaks
