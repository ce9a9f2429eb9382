"""Entry point: `python -m rla_jax.main --config=configs/tiny.py --workdir=DIR`.

Config keys are overridable as flags (`--config.rollout.sampling.temperature=0.7`);
`--config.loop.num_epochs=N` sets the total number of epochs, also when the
run resumes from a checkpoint in DIR. SIGTERM or Ctrl-C stops it cleanly
with a checkpoint (exit 0); the same command resumes. Started again on a
complete run with no more epochs, it prints so with the last evaluation and
exits 0 without loading a model. A usage error (a --config that does not
load, an override of a key the config lacks, a value that does not fit)
prints one line naming the key and exits 2 before DIR is made; so does a
resume whose config differs from DIR/config.json in a key of the experiment
(the line names the keys; runtime.RESUMABLE_KEYS may change, others need
--config.loop.allow_config_change=True), leaving DIR as it was. Other
errors a user can act on (workdir in use, no restorable checkpoint, a failed
save, non-finite training, a setting whose known reward outcomes come out
wrong at start-up) print one line and exit 1.
`-v 0` adds the traceback to the log.
"""

import importlib.util
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


def _usage_error(message: str):
  """Prints `message` as one line (a traceback in it reduced to its first
  and last lines) and exits 2."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  if len(lines) > 1:
    lines = [lines[0].rstrip(':') + ':', lines[-1]]
  print(f'error: {" ".join(lines)}', file=sys.stderr, flush=True)
  sys.exit(2)


def _load_config_file(spec: str):
  """The ConfigDict that --config=`spec` names (path[:options])."""
  path, _, options = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(options) if options else module.get_config()


def _override_problem(argv) -> str | None:
  """Which --config.<key>=... names a key the config lacks, if one does."""
  specs = [a.split('=', 1)[1] for a in argv if a.startswith('--config=')]
  if not specs:
    return None
  try:
    config = _load_config_file(specs[-1])
  except Exception as e:  # pylint: disable=broad-except
    return f'--config={specs[-1]} does not load: {type(e).__name__}: {e}'
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    node, walked = config, []
    for part in key.split('.'):
      if not hasattr(node, 'keys') or part not in node.keys():
        where = '.'.join(['config', *walked])
        known = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else ''
        return (f'{arg}: {specs[-1]} has no key config.{key} ({where} has '
                f'{known or "no keys"})')
      node, walked = node[part], walked + [part]
  return None


def _parse_flags(argv):
  """absl's flag parsing, with usage errors as one line and exit 2."""
  try:
    remaining = flags.FLAGS(argv)
    _CONFIG.value.keys()  # a config file that failed to load raises here
    return remaining
  except flags.Error as e:
    _usage_error(str(e))
  except Exception as e:  # pylint: disable=broad-except
    # config_flags raises AttributeError/KeyError/TypeError for overrides of
    # keys the config lacks; name the flag instead of a traceback.
    _usage_error(_override_problem(argv) or f'{type(e).__name__}: {e}')


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
  from rla_jax import reward_check
  from rla_jax import runtime
  from rla_jax import train
  from rla_jax.envs import base
  # pylint: enable=g-import-not-at-top
  command = shlex.join([sys.executable, '-m', 'rla_jax.main', *sys.argv[1:]])
  try:
    loop.run(_CONFIG.value, os.path.abspath(_WORKDIR.value),
             resume_command=command)
  except (runtime.ConfigError, base.DataError) as e:
    logging.info('%s', type(e).__name__, exc_info=True)  # shown with -v 0
    _usage_error(str(e))
  except (preemption.LockedError, checkpoint.RestoreError,
          checkpoint.SaveError, checkpoint.ConfigMismatchError,
          train.NonFiniteLossError, reward_check.RewardCheckFailed) as e:
    logging.info('%s', type(e).__name__, exc_info=True)  # shown with -v 0
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == '__main__':
  sys.path.insert(0, os.getcwd())  # configs/*.py import `configs.base`
  app.run(main, flags_parser=_parse_flags)
