"""What a start finds in its workdir: a finished run, or another experiment.

A run that ends (all epochs trained, checkpointed and evaluated, no stop)
writes WORKDIR/complete.json last, atomically; started again with no more
epochs to train, it prints that the run is complete with its last
evaluation and returns without loading a model (loop.run asks `complete`
and `say_complete`). A workdir whose config.json differs from the config in
a key of the experiment is refused naming the keys (runtime.config_changes;
keys in runtime.RESUMABLE_KEYS may change), unless
config.loop.allow_config_change.
"""

from __future__ import annotations

import json
import logging
import os
import time

from rla_jax import report
from rla_jax import runtime

# Written last by a run that ended with every epoch trained, checkpointed
# and evaluated; removed when a run starts that has epochs to train.
COMPLETE = 'complete.json'


def check_config_change(config, workdir: str, chief: bool):
  """ConfigChangeError naming each experiment key that differs from the
  workdir's config.json, unless config.loop.allow_config_change."""
  path = os.path.join(workdir, 'config.json')
  try:
    with open(path, encoding='utf-8') as f:
      previous = json.load(f)
  except FileNotFoundError:
    return
  except (OSError, ValueError) as e:
    logging.warning('%s does not read (%s); not compared', path, e)
    return
  changes = runtime.config_changes(previous, config)
  if not changes:
    return

  def short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + '...'

  listed = ', '.join(f'{key} ({short(old)} -> {short(new)})'
                     for key, old, new in changes)
  if config.loop.allow_config_change:
    if chief:
      print(f'config changed from {path} (loop.allow_config_change): '
            f'{listed}', flush=True)
    return
  raise runtime.ConfigChangeError(
      f'{workdir} was run with another config: {listed}; resume with the '
      f'config in {path}, use a new --workdir, or allow the change with '
      '--config.loop.allow_config_change=True')


def _files(folder: str) -> dict[str, list[int]]:
  """relative path -> [size, mtime_ns] of every file under `folder`."""
  found = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      stat = os.stat(path)
      found[os.path.relpath(path, folder)] = [stat.st_size, stat.st_mtime_ns]
  return found


def write_complete(run, ckpt):
  """WORKDIR/complete.json: the last epoch and its checkpoint's files."""
  epoch = run.saved_epoch
  folder = ckpt.path(epoch) if epoch else None
  marker = {'epoch': epoch,
            'num_epochs': run.config.loop.num_epochs,
            'checkpoint': os.path.relpath(folder, run.workdir) if folder
                          else None,
            'files': _files(folder) if folder else {},
            'time': time.time()}
  path = os.path.join(run.workdir, COMPLETE)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(marker, f, indent=1)
  os.replace(path + '.tmp', path)


def complete(config, workdir: str) -> dict | None:
  """The workdir's complete.json if its run has no epoch left to train.

  Its last checkpoint must be the one the run ended with, file for file
  (size and modification time): a damaged or removed one makes it a resume.
  """
  try:
    with open(os.path.join(workdir, COMPLETE), encoding='utf-8') as f:
      marker = json.load(f)
    if marker['epoch'] < config.loop.num_epochs:
      return None
    if marker['checkpoint'] and _files(os.path.join(
        workdir, marker['checkpoint'])) != marker['files']:
      return None
  except (OSError, ValueError, KeyError, TypeError):
    return None  # unreadable: a resume decides
  return marker


def say_complete(config, workdir: str, marker) -> dict[str, float]:
  """Prints that the run is complete and its last evaluation; returns that
  evaluation's scalars."""
  epoch, asked = marker['epoch'], config.loop.num_epochs
  trained = f'{epoch} epoch{"s" if epoch != 1 else ""} trained' + (
      f' ({asked} asked for)' if asked != epoch else '')
  print(f'{workdir}: the run is complete ({trained}); nothing to do (a '
        'larger --config.loop.num_epochs trains on)', flush=True)
  try:
    rows = report.read(workdir)
  except (OSError, ValueError) as e:
    rows = []
    logging.warning('no metrics to show: %s', e)
  evaluated = [r for r in rows if any(
      k.startswith('eval/') and k.endswith('/accuracy') for k in r)]
  if not evaluated:
    print('no evaluation in its metrics', flush=True)
    return {}
  row = evaluated[-1]
  values = {k: v for k, v in row.items() if k.startswith('eval/')}
  accuracy = ', '.join(f'{k}={v:.3f}' for k, v in sorted(values.items())
                       if k.endswith('/accuracy'))
  print(f'last evaluation (epoch {row["step"]}): {accuracy}', flush=True)
  print(f'the whole table: python -m rla_jax.report {workdir}', flush=True)
  return values
