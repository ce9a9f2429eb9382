"""rla_jax.report: the end-of-run table and report.png from metrics.jsonl."""

import json
import os
import struct
import subprocess
import sys

import pytest

from rla_jax import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workdir(tmp_path, rows):
  os.makedirs(tmp_path / 'tb')
  with open(tmp_path / 'tb' / 'metrics.jsonl', 'w') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  return str(tmp_path)


def _epoch(step, accuracy, **extra):
  return {'step': step, 'rollout/accuracy': accuracy, 'rm/outcome_acc': 0.5,
          'rm/process_acc': 0.25, 'curator/requested': 2,
          'curator/created': 1, 'curator/accepted': step - 1,
          'curator/rejected': 1, 'time/rollout_s': 10.0,
          'time/judge_s': 5.0, 'time/policy_update_s': 3.0,
          'time/epoch_s': 20.0, **extra}


def _eval(step, accuracy, episodes):
  return {'step': step, 'eval/seen/accuracy': accuracy,
          'eval/seen/episodes': episodes, 'eval/seen/rm_outcome_acc': 0.6,
          'eval/seen/rm_process_acc': 0.7, 'time/eval_s': 4.0}


def _png_size(path):
  with open(path, 'rb') as f:
    head = f.read(24)
  assert head[:8] == b'\x89PNG\r\n\x1a\n'
  return struct.unpack('>II', head[16:24])


def test_wilson_interval_matches_hand_computed_values():
  # 8 of 32: p = 0.25, z = 1.96 -> [0.1325, 0.4211] (by hand).
  low, high = report.wilson(8, 32)
  assert low == pytest.approx(0.1325, abs=1e-4)
  assert high == pytest.approx(0.4211, abs=1e-4)
  assert report.wilson(0, 10)[0] == 0.0
  assert report.wilson(10, 10)[1] == 1.0


def test_table_has_every_row_and_the_picture_its_size(tmp_path):
  # Epoch 2's row comes from a run that was resumed: its eval row merges.
  rows = [_eval(0, 0.25, 32), _epoch(1, 0.3, **{'memory/peak_rss_gb': 3.5}),
          _epoch(2, 0.5, **{'memory/peak_rss_gb': 3.25}), _eval(2, 0.5, 32)]
  workdir = _workdir(tmp_path, rows)
  table = report.write(workdir)
  lines = table.splitlines()
  assert lines[0].split() == ['before', 'after']
  acc = next(l for l in lines if l.startswith('eval accuracy (seen)'))
  assert '0.250 [0.13, 0.42] of 32 (epoch 0)' in acc
  assert '0.500 [0.34, 0.66] of 32 (epoch 2)' in acc
  assert any(l.startswith('RM outcome acc (seen rollouts)') and
             l.split()[-2:] == ['0.600', '0.600'] for l in lines)
  assert any(l.startswith('RM process acc (seen rollouts)') for l in lines)
  assert any(l.startswith('training rollout accuracy') and
             l.split()[-2:] == ['0.300', '0.500'] for l in lines)
  assert any(l.startswith('rewrites requested / accepted / rejected') and
             l.endswith('4 / 1 / 4 (2 without a valid proposal, 2 after '
                        'measuring)') for l in lines)
  assert any(l.startswith('peak RSS') and l.endswith('3.5 GB') for l in lines)
  assert any(l.startswith('time rollout') and '20 s over 2 (10.0 s each)' in l
             for l in lines)
  assert any(l.startswith('time eval') for l in lines)
  assert any(l.startswith('epochs') and l.endswith('2 (40 s)') for l in lines)
  assert lines[-2] == f'TensorBoard: tensorboard --logdir {workdir}/tb'
  assert _png_size(os.path.join(workdir, report.PNG)) == (
      report.FIGSIZE[0] * report.DPI, report.FIGSIZE[1] * report.DPI)


def test_training_rm_accuracy_when_evaluation_was_not_judged(tmp_path):
  rows = [{'step': 0, 'eval/seen/accuracy': 0.0, 'eval/seen/episodes': 4},
          _epoch(1, 0.3, **{'rm/outcome_acc': 0.4}), _epoch(2, 0.5)]
  table = report.table(rows, str(tmp_path))
  assert 'RM outcome acc (training rollouts)' in table
  assert 'RM process acc (training rollouts)' in table


def test_command_line_on_a_workdir_and_on_a_missing_one(tmp_path):
  workdir = _workdir(tmp_path / 'run', [_eval(0, 0.5, 8), _epoch(1, 0.5)])
  proc = subprocess.run([sys.executable, '-m', 'rla_jax.report', workdir],
                        cwd=ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert 'eval accuracy (seen)' in proc.stdout
  assert os.path.exists(os.path.join(workdir, report.PNG))
  proc = subprocess.run([sys.executable, '-m', 'rla_jax.report',
                         str(tmp_path / 'nothing')], cwd=ROOT,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 1
  assert 'no metrics' in proc.stderr


def test_fallback_rewrites_and_rejection_reasons_have_their_rows(tmp_path):
  # Issue 32.5 and 32.3: who made the rewrites (env LLM or the fallback
  # generator) and why proposals were turned down.
  rows = [_epoch(1, 0.0, **{'curator/created': 0,
                            'curator/created_fallback': 3,
                            'curator/rewrite_failures': 0,
                            'curator/rewrite_unchanged': 0,
                            'curator/rejected_no_json': 5,
                            'curator/rejected_contradictory_tests': 1}),
          _epoch(2, 0.5, **{'curator/created': 1, 'curator/accepted': 1,
                            'curator/created_fallback': 1,
                            'curator/accepted_fallback': 2,
                            'curator/rewrite_failures': 0,
                            'curator/rewrite_unchanged': 0,
                            'curator/rejected_no_json': 2,
                            'curator/rejected_malformed_json': 2})]
  workdir = _workdir(tmp_path, rows)
  lines = report.write(workdir).splitlines()
  row = lambda start: next(l for l in lines if l.startswith(start))
  assert row('rewrites requested / accepted / rejected').endswith(
      '4 / 3 / 2 (0 without a valid proposal, 2 after measuring)')
  assert row('  by the env LLM: created / accepted').endswith('1 / 1')
  assert row('  by the fallback generator: created / accepted').endswith(
      '4 / 2')
  assert row('  proposals rejected, by reason').endswith(
      'no_json 7, malformed_json 2, contradictory_tests 1')
  assert os.path.exists(os.path.join(workdir, report.PNG))


def test_runs_without_a_fallback_have_no_origin_rows(tmp_path):
  lines = report.table([_epoch(1, 0.3), _epoch(2, 0.5)], str(tmp_path))
  assert 'by the env LLM' not in lines
  assert 'fallback generator' not in lines
  assert 'by reason' not in lines
