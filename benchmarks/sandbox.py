"""Sandbox throughput and per-execution overhead against bare Python start-up.

  .venv/bin/python benchmarks/sandbox.py [--executions 300] [--workers 2 4]

One execution = one program with 16 stdin/stdout tests (an a+b solution) in
one sandboxed process. Measures, alternating the sides in rounds so that load
from other processes hits both alike: `python3 -I -c pass` run serially (the
floor), `sandbox.run` of a one-test program run serially (overhead = the
difference, wall-clock and CPU), and executions/s through `run_many` with 2
and 4 workers. About a minute on a 2-core CPU. Prints the load average before
and after; the last line is
`executions_per_s=<float> overhead_ms=<float> load=<1m/5m/15m>`.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rla_jax.envs.coding import sandbox  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

PROGRAM = 'a, b = map(int, input().split())\nprint(a + b)\n'
TESTS = [(f'{i} {2 * i}', str(3 * i)) for i in range(16)]


def load():
  return '/'.join(f'{x:.2f}' for x in os.getloadavg())


def _cpu():
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def per_call_ms(fn, n):
  """(wall ms, CPU ms of us and our children) per call of `fn`."""
  wall, cpu = time.perf_counter(), _cpu()
  for _ in range(n):
    fn()
  return ((time.perf_counter() - wall) / n * 1e3, (_cpu() - cpu) / n * 1e3)


def bare():
  subprocess.run(['/usr/bin/python3', '-I', '-c', 'pass'], check=True)


def one_test():
  result, = sandbox.run('print(1)', [('', '1')])
  assert result.passed, result


def throughput(executions, workers):
  jobs = [(PROGRAM, TESTS)] * executions
  start = time.perf_counter()
  results = sandbox.run_many(jobs, workers=workers)
  seconds = time.perf_counter() - start
  assert all(r.passed for rs in results for r in rs)
  return executions / seconds


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--executions', type=int, default=300)
  parser.add_argument('--serial', type=int, default=60)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--workers', type=int, nargs='+', default=[2, 4])
  args = parser.parse_args()
  if not sandbox.available():
    sys.exit(f'no sandbox: {sandbox.INSTALL_HINT}')
  print(f'load before: {load()} on {os.cpu_count()} CPUs')
  one_test()  # compiles and caches the harness
  rows = {'bare': [], 'sandbox': []}
  rates = {w: [] for w in args.workers}
  for _ in range(args.rounds):
    rows['bare'].append(per_call_ms(bare, args.serial))
    rows['sandbox'].append(per_call_ms(one_test, args.serial))
    for w in args.workers:
      rates[w].append(throughput(args.executions, w))
  med = {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1))
         for k, v in rows.items()}
  report = {
      'bare_python_ms': {'wall': med['bare'][0], 'cpu': med['bare'][1]},
      'sandbox_one_test_ms': {'wall': med['sandbox'][0],
                              'cpu': med['sandbox'][1]},
      'overhead_ms': {'wall': med['sandbox'][0] - med['bare'][0],
                      'cpu': med['sandbox'][1] - med['bare'][1]},
      'executions_per_s': {str(w): statistics.median(r)
                           for w, r in rates.items()},
      'executions_per_s_rounds': {str(w): r for w, r in rates.items()},
      'tests_per_execution': len(TESTS),
  }
  print(json.dumps(report, indent=1))
  print(f'load after: {load()}')
  best = max(report['executions_per_s'].values())
  print(f'executions_per_s={best:.1f} '
        f'overhead_ms={report["overhead_ms"]["wall"]:.1f} load={load()}')


if __name__ == '__main__':
  main()
