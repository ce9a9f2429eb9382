"""Entry point: `python -m rla_jax.main --config=configs/tiny.py --workdir=DIR`.

Config keys are overridable as flags (`--config.rollout.sampling.temperature=0.7`);
`--config.loop.num_epochs=N` sets the total number of epochs, also when the
run resumes from a checkpoint in DIR. SIGTERM or Ctrl-C stops it cleanly
with a checkpoint (exit 0); the same command resumes. Errors a user can act
on (workdir in use, no restorable checkpoint, a failed save, non-finite
training) print one line and exit 1.
"""

import os
import re
import shlex
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Path to a configs/*.py file.', lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Run folder: checkpoints, TensorBoard logs, task pool.')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Multi-host (one process per host): call '
    'jax.distributed.initialize(). TPU slices and SLURM jobs are detected; '
    'elsewhere give --coordinator, --num_processes and --process_id (or '
    'JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).')
_COORDINATOR = flags.DEFINE_string(
    'coordinator', os.environ.get('JAX_COORDINATOR_ADDRESS', ''),
    'host:port of process 0 (implies --distributed).')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)),
    'Processes in the job (with --coordinator).')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
    'This process (with --coordinator).')
_HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout_s', 60, 'A process silent this long (dead host) makes '
    'every process of the job exit.')
flags.mark_flags_as_required(['config', 'workdir'])


def _size_cpu_thread_pool():
  """Enough XLA:CPU threads for simulated devices' collectives.

  With --xla_force_host_platform_device_count=N, XLA runs the N devices on
  one pool of max(cores, N) threads, and a device can block in two
  independent collectives at once: on a small machine every thread can end
  up waiting for a participant that never gets one (the rendezvous then
  aborts). NPROC sizes that pool; set it before jax starts its backend.
  """
  match = re.search(r'--xla_force_host_platform_device_count=(\d+)',
                    os.environ.get('XLA_FLAGS', ''))
  if match and int(match.group(1)) > 1:
    os.environ.setdefault('NPROC', str(8 * int(match.group(1))))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  _size_cpu_thread_pool()
  # pylint: disable=g-import-not-at-top
  from rla_jax import metrics
  metrics.limit_malloc_arenas()  # before jax starts its threads
  if not flags.FLAGS['verbosity'].present:
    # orbax logs every save at INFO; `-v 0` brings it back.
    logging.set_verbosity(logging.WARNING)
  # Imported here so `--help` and flag errors are instant.
  # pylint: disable=g-import-not-at-top
  from rla_jax import distributed
  if _DISTRIBUTED.value or _COORDINATOR.value:
    distributed.initialize(coordinator=_COORDINATOR.value,
                           num_processes=_NUM_PROCESSES.value,
                           process_id=_PROCESS_ID.value,
                           heartbeat_timeout_s=_HEARTBEAT.value)
  from rla_jax import checkpoint
  from rla_jax import loop
  from rla_jax import preemption
  from rla_jax import train
  # pylint: enable=g-import-not-at-top
  command = shlex.join([sys.executable, '-m', 'rla_jax.main', *sys.argv[1:]])
  try:
    loop.run(_CONFIG.value, os.path.abspath(_WORKDIR.value),
             resume_command=command)
  except (preemption.LockedError, checkpoint.RestoreError,
          checkpoint.SaveError, checkpoint.ConfigMismatchError,
          train.NonFiniteLossError) as e:
    logging.info('%s', type(e).__name__, exc_info=True)  # shown with -v 0
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == '__main__':
  sys.path.insert(0, os.getcwd())  # configs/*.py import `configs.base`
  app.run(main)
