"""Two JAX processes on localhost (4 CPU devices each, gloo) = one with 8.

launch/local.sh runs configs/tiny.py for 2 epochs on the 8-device global
mesh; both processes must end with the same pool and parameters, equal to a
single process with 8 devices. A process killed mid-epoch takes the other
one down within 60 s, and the rerun resumes to the same end.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two turns and one update per model keep the run short: every decode step's
# collectives cross the processes over TCP.
FLAGS = ('--config.loop.num_epochs=2', '--config.eval.every=0',
         '--config.env.max_turns=2',
         '--config.train.policy.updates_per_epoch=1',
         '--config.train.reward_model.updates_per_epoch=1')


def _local(workdir, *flags, **popen):
  env = dict(os.environ, HEARTBEAT_S='10')
  env.pop('XLA_FLAGS', None)
  return subprocess.Popen(
      ['bash', 'launch/local.sh', '2', 'configs/tiny.py', str(workdir),
       *FLAGS, *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, **popen)


def _reports(workdir, n):
  out = []
  for i in range(n):
    with open(os.path.join(workdir, f'process_{i}.json')) as f:
      out.append(json.load(f))
  return out


def _same_run(a, b, rtol=1e-5):
  """Pools and steps equal; parameters equal up to reduction order."""
  assert a['pool_digest'] == b['pool_digest']
  assert a['steps'] == b['steps'] and a['epoch'] == b['epoch']
  for name, stats in a['param_stats'].items():
    for key, value in stats.items():
      assert value == pytest.approx(b['param_stats'][name][key], rel=rtol), (
          name, key)


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('two')
  start = time.time()
  proc = _local(workdir)
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, out
  seconds = time.time() - start
  print(f'2 processes x 4 devices, 2 epochs: {seconds:.1f} s')
  return workdir, out, seconds


@pytest.mark.slow
def test_two_processes_agree_with_each_other_and_with_one(two_processes,
                                                          tmp_path):
  workdir, out, seconds = two_processes
  first, second = _reports(workdir, 2)
  assert (first['process'], second['process']) == (0, 1)
  assert first['processes'] == 2 and first['devices'] == 8
  # The processes of one run hold bit-identical parameters.
  for key in ('pool_digest', 'steps', 'params', 'param_stats', 'epoch'):
    assert first[key] == second[key], key
  assert 'platform cpu' in out and '8 devices, 4 on this host, 2 process' in out
  rows = [json.loads(l) for l in open(workdir / 'tb' / 'metrics.jsonl')]
  traffic = [r for r in rows if 'distributed/allgather_bytes' in r]
  assert len(traffic) == 2 and all(r['distributed/allgather_bytes'] > 0
                                   for r in traffic)
  print('bytes sent per epoch (process 0):',
        [(r['distributed/allgather_bytes'], r['distributed/broadcast_bytes'])
         for r in traffic])
  single = tmp_path / 'one'
  env = dict(os.environ,
             XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  start = time.time()
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
       f'--workdir={single}', *FLAGS], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  print(f'1 process x 8 devices: {time.time() - start:.1f} s '
        f'(2 processes: {seconds:.1f} s)')
  (one,) = _reports(single, 1)
  assert one['processes'] == 1 and one['devices'] == 8
  _same_run(first, one)


@pytest.mark.slow
def test_a_dead_process_ends_the_job_and_the_rerun_resumes(two_processes,
                                                            tmp_path):
  reference, _, _ = two_processes
  workdir = tmp_path / 'killed'
  proc = _local(workdir, start_new_session=True)
  for line in proc.stdout:
    if line.startswith('epoch 2: policy_update'):
      break
  victim = subprocess.run(
      ['pgrep', '-f', '--', f'--workdir={workdir} .*--process_id=1'],
      capture_output=True, text=True, check=True).stdout.split()
  assert len(victim) == 1
  killed_at = time.time()
  os.kill(int(victim[0]), signal.SIGKILL)
  proc.communicate(timeout=120)
  ended = time.time() - killed_at
  assert proc.returncode != 0
  assert ended < 60, f'the job took {ended:.0f} s to end'
  assert not subprocess.run(['pgrep', '-f', '--', f'--workdir={workdir} '],
                            capture_output=True, check=False).stdout
  proc = _local(workdir)
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, out
  assert 'resumed from epoch 1 checkpoint; starting epoch 2' in out
  for report in _reports(workdir, 2):
    _same_run(report, _reports(reference, 1)[0], rtol=1e-6)


def test_a_mesh_larger_than_the_devices_is_refused_with_the_platform():
  from rla_jax import distributed  # pylint: disable=g-import-not-at-top
  assert distributed.describe().startswith('platform cpu (cpu): 8 devices')
  distributed.check_devices({'data': 2, 'fsdp': -1, 'tensor': 2})
  with pytest.raises(ValueError, match=(
      r"config.mesh \{'data': 4, 'fsdp': 2, 'tensor': 4\} needs a multiple "
      r'of 32 devices but this run has 8 cpu device\(s\)\. This JAX sees '
      r'only CPUs: install the accelerator build with `bash launch/setup.sh '
      r'tpu`')):
    distributed.check_devices({'data': 4, 'fsdp': 2, 'tensor': 4})
