"""Entry point: `python -m rla_jax.main --config=configs/tiny.py --workdir=DIR`.

Config keys are overridable as flags (`--config.rollout.sampling.temperature=0.7`);
`--config.loop.num_epochs=N` sets the total number of epochs, also when the
run resumes from a checkpoint in DIR. SIGTERM or Ctrl-C stops it cleanly
with a checkpoint (exit 0); the same command resumes. Errors a user can act
on (workdir in use, no restorable checkpoint, a failed save, non-finite
training) print one line and exit 1.
"""

import os
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
    'distributed', False, 'Multi-host: call jax.distributed.initialize() '
    '(TPU pods and SLURM are detected; else JAX_COORDINATOR_ADDRESS, '
    'JAX_NUM_PROCESSES and JAX_PROCESS_ID are read).')
flags.mark_flags_as_required(['config', 'workdir'])


def _initialize_distributed():
  import jax  # pylint: disable=g-import-not-at-top
  address = os.environ.get('JAX_COORDINATOR_ADDRESS')
  if address:
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ['JAX_NUM_PROCESSES']),
        process_id=int(os.environ['JAX_PROCESS_ID']))
  else:
    jax.distributed.initialize()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    # orbax logs every save at INFO; `-v 0` brings it back.
    logging.set_verbosity(logging.WARNING)
  if _DISTRIBUTED.value:
    _initialize_distributed()
  # Imported here so `--help` and flag errors are instant.
  # pylint: disable=g-import-not-at-top
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
