"""The end-of-run table and `report.png`, from a workdir's metrics.jsonl.

  python -m rla_jax.report DIR    # any workdir, finished or not

The table: evaluation accuracy before and after (games and a 95% Wilson
interval per split), the RM's outcome and process accuracy before and after,
the curator's rewrites, time per stage and where the TensorBoard logs are.
The picture: accuracy per epoch (training rollouts and every evaluation
split, with intervals), curator decisions per epoch and stage times.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

PNG = 'report.png'
FIGSIZE, DPI = (13.0, 4.0), 100  # report.png is 1300 x 400 pixels
_CURATOR = ('requested', 'created', 'accepted', 'rejected')
# A setting's generator standing in for the env LLM (coding's knob_fallback):
# plotted and tabled apart when the run made any.
_FALLBACK = ('created_fallback', 'accepted_fallback')
_REASON = 'curator/rejected_'  # + a proposal rejection's reason key
_STAGES = ('rollout', 'judge', 'curator', 'feedback', 'policy_update',
           'rm_update', 'eval')


def read(workdir: str) -> list[dict[str, Any]]:
  """The rows of WORKDIR/tb/metrics.jsonl; a resumed run's newest per epoch."""
  path = os.path.join(workdir, 'tb', 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no metrics (is {workdir} a workdir?)')
  by_step: dict[int, dict[str, Any]] = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        by_step.setdefault(row['step'], {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
  """95% Wilson score interval of a success rate (NaN, NaN for n = 0)."""
  if n <= 0:
    return float('nan'), float('nan')
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)


def splits(rows: Sequence[dict[str, Any]]) -> list[str]:
  names = {k.split('/')[1] for r in rows for k in r
           if k.startswith('eval/') and k.endswith('/accuracy')}
  return sorted(names)


def _evals(rows, split: str) -> list[dict[str, Any]]:
  return [r for r in rows if f'eval/{split}/accuracy' in r]


def _fmt(x: float | None, digits: int = 3) -> str:
  return '-' if x is None or not math.isfinite(x) else f'{x:.{digits}f}'


def _accuracy_cell(row: dict[str, Any] | None, split: str) -> str:
  if row is None:
    return '-'
  acc = row[f'eval/{split}/accuracy']
  n = row.get(f'eval/{split}/episodes', 0)
  low, high = wilson(acc * n, n)
  return (f'{_fmt(acc)} [{_fmt(low, 2)}, {_fmt(high, 2)}] of {int(n)} '
          f'(epoch {row["step"]})')


def _rm_cells(rows, first, last, split: str) -> list[tuple[str, str, str]]:
  """(name, before, after) rows of the RM's accuracy.

  Measured on the evaluation rollouts when the RM judged them, otherwise on
  the first and last epoch's training rollouts.
  """
  out = []
  for name, keys in (('outcome', ('rm_outcome_acc',)),
                     ('process', ('rm_process_acc',
                                  'rm_outcome_agreement'))):
    eval_keys = [f'eval/{split}/{k}' for k in keys]
    train_keys = [f'rm/{k[3:]}' for k in keys]
    train = [r for r in rows if any(k in r for k in train_keys)]
    for label, ks, a, b in ((f'{split} rollouts', eval_keys, first, last),
                            ('training rollouts', train_keys,
                             train[0] if train else None,
                             train[-1] if train else None)):
      if a is not None and any(k in a for k in ks):
        key = next(k for k in ks if k in a)
        what = 'outcome agreement' if key.endswith('agreement') else name
        out.append((f'RM {what} acc ({label})', _fmt(a.get(key)),
                    _fmt(b.get(key) if b else None)))
        break
  return out


def _total(rows, key: str) -> int:
  return int(sum(r.get(f'curator/{key}', 0) for r in rows))


def _has_fallback(rows) -> bool:
  return any(f'curator/{k}' in r for r in rows for k in _FALLBACK)


def _rewrites_cell(rows) -> str:
  """'requested / accepted / rejected (why)' over the run.

  Accepted counts every origin (the env LLM's `curator/accepted` and the
  fallback generator's `accepted_fallback`). A request is rejected either
  before it is rolled out (no valid proposal: `curator/rewrite_failures`
  and `rewrite_unchanged`) or after its rollouts were measured
  (`curator/rejected`).
  """
  requested, measured = _total(rows, 'requested'), _total(rows, 'rejected')
  accepted = _total(rows, 'accepted') + _total(rows, 'accepted_fallback')
  if any('curator/rewrite_failures' in r for r in rows):
    invalid = _total(rows, 'rewrite_failures') + _total(rows,
                                                       'rewrite_unchanged')
  else:
    invalid = requested - _total(rows, 'created') - _total(
        rows, 'created_fallback')
  return (f'{requested} / {accepted} / {invalid + measured} ({invalid} '
          f'without a valid proposal, {measured} after measuring)')


def _curator_lines(rows) -> list[tuple[str, str, str]]:
  """The rewrites' rows: totals; with a fallback generator in the run, who
  made them (the env LLM or the generator: created / accepted); and the env
  LLM's rejected proposals per reason (`curator/rejected_<reason>`)."""
  lines = [('rewrites requested / accepted / rejected', '',
            _rewrites_cell(rows))]
  if _has_fallback(rows):
    for who, suffix in (('env LLM', ''), ('fallback generator', '_fallback')):
      lines.append((f'  by the {who}: created / accepted', '',
                     f'{_total(rows, "created" + suffix)} / '
                     f'{_total(rows, "accepted" + suffix)}'))
  reasons: dict[str, int] = {}
  for row in rows:
    for key, value in row.items():
      if key.startswith(_REASON):
        name = key[len(_REASON):]
        reasons[name] = reasons.get(name, 0) + int(value)
  if reasons:
    lines.append(('  proposals rejected, by reason', '', ', '.join(
        f'{name} {n}' for name, n in sorted(reasons.items(),
                                            key=lambda kv: (-kv[1], kv[0])))))
  return lines


def table(rows: Sequence[dict[str, Any]], workdir: str) -> str:
  """The end-of-run summary as aligned text."""
  lines: list[tuple[str, str, str]] = []
  for split in splits(rows):
    evals = _evals(rows, split)
    first, last = evals[0], evals[-1] if len(evals) > 1 else None
    lines.append((f'eval accuracy ({split}) [95% CI]',
                  _accuracy_cell(first, split), _accuracy_cell(last, split)))
    lines += _rm_cells(rows, first, last or first, split)
  train = [r for r in rows if 'rollout/accuracy' in r]
  if train:
    lines.append(('training rollout accuracy',
                  _fmt(train[0]['rollout/accuracy']),
                  _fmt(train[-1]['rollout/accuracy'])))
  lines += _curator_lines(rows)
  for stage in _STAGES:
    seconds = [r[f'time/{stage}_s'] for r in rows if f'time/{stage}_s' in r]
    if seconds:
      lines.append((f'time {stage}', '',
                     f'{sum(seconds):.0f} s over {len(seconds)} '
                     f'({sum(seconds) / len(seconds):.1f} s each)'))
  epochs = [r['time/epoch_s'] for r in rows if 'time/epoch_s' in r]
  lines.append(('epochs', '', f'{len(epochs)} ({sum(epochs):.0f} s)'))
  rss = [r['memory/peak_rss_gb'] for r in rows if 'memory/peak_rss_gb' in r]
  if rss:
    lines.append(('peak RSS', '', f'{max(rss):.1f} GB'))
  width = max(len(name) for name, _, _ in lines)
  head = f'{"":{width}}  {"before":34s}  after'
  body = [f'{name:{width}}  {before:34s}  {after}'
          for name, before, after in lines]
  tb = os.path.join(workdir, 'tb')
  return '\n'.join([head, *body,
                    f'TensorBoard: tensorboard --logdir {tb}',
                    f'picture: {os.path.join(workdir, PNG)}'])


def _series(rows, key):
  pairs = [(r['step'], r[key]) for r in rows
           if key in r and math.isfinite(r[key])]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(rows: Sequence[dict[str, Any]], path: str) -> str:
  """Writes the three-panel picture to `path`; returns `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (acc_ax, cur_ax, time_ax) = plt.subplots(1, 3, figsize=FIGSIZE,
                                                dpi=DPI)
  x, y = _series(rows, 'rollout/accuracy')
  acc_ax.plot(x, y, 'o-', label='training rollouts')
  for split in splits(rows):
    evals = _evals(rows, split)
    xs = [r['step'] for r in evals]
    ys = [r[f'eval/{split}/accuracy'] for r in evals]
    intervals = [wilson(r[f'eval/{split}/accuracy'] *
                        r.get(f'eval/{split}/episodes', 0),
                        r.get(f'eval/{split}/episodes', 0)) for r in evals]
    errors = [[max(0.0, y - lo) if math.isfinite(lo) else 0.0
               for y, (lo, _) in zip(ys, intervals)],
              [max(0.0, hi - y) if math.isfinite(hi) else 0.0
               for y, (_, hi) in zip(ys, intervals)]]
    acc_ax.errorbar(xs, ys, yerr=errors, fmt='s--', capsize=3,
                    label=('evaluation' if split == 'eval' else
                           f'evaluation: {split}') + ' (95% CI)')
  acc_ax.set(title='accuracy', xlabel='epoch', ylim=(-0.02, 1.02))
  acc_ax.legend(fontsize=8)
  epochs = [r['step'] for r in rows if 'time/epoch_s' in r]
  kinds = _CURATOR + (_FALLBACK if _has_fallback(rows) else ())
  width = 0.8 / len(kinds)
  for i, kind in enumerate(kinds):
    cur_ax.bar([e + (i - (len(kinds) - 1) / 2) * width for e in epochs],
               [r.get(f'curator/{kind}', 0) for r in rows
                if 'time/epoch_s' in r], width, label=kind)
  cur_ax.set(title='curator rewrites', xlabel='epoch')
  cur_ax.legend(fontsize=8)
  bottom = [0.0] * len(rows)
  for stage in _STAGES:
    values = [r.get(f'time/{stage}_s', 0.0) for r in rows]
    if any(values):
      time_ax.bar([r['step'] for r in rows], values, bottom=bottom,
                  label=stage)
      bottom = [b + v for b, v in zip(bottom, values)]
  time_ax.set(title='time per stage', xlabel='epoch', ylabel='seconds')
  time_ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


def write(workdir: str) -> str:
  """report.png and the table of a workdir; returns the table."""
  rows = read(workdir)
  plot(rows, os.path.join(workdir, PNG))
  return table(rows, workdir)


def main(argv: Sequence[str]) -> int:
  if len(argv) != 2:
    print('usage: python -m rla_jax.report WORKDIR', file=sys.stderr)
    return 2
  try:
    print(write(argv[1]))
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
