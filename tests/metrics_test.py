"""metrics: progress lines in plain logs, the epoch summary line."""

import io

from rla_jax import metrics


def test_progress_prints_plain_lines_when_stderr_is_not_a_terminal(
    monkeypatch):
  err = io.StringIO()  # not a TTY, like a log file or CI
  monkeypatch.setattr(metrics.sys, 'stderr', err)
  clock = iter([0.0, 5.0, 25.0, 30.0, 50.0])
  monkeypatch.setattr(metrics.time, 'perf_counter', lambda: next(clock))
  assert list(metrics.progress(range(4), desc='rollout turns')) == [0, 1, 2,
                                                                     3]
  # Start at 0 s; items end at 5, 25, 30 and 50 s: a line after 20 s each.
  assert err.getvalue().splitlines() == ['  rollout turns: 2/4 (25 s)',
                                         '  rollout turns: 4/4 (50 s)']


def test_summary_line_expands_wildcards():
  line = metrics.summary_line(3, {'rollout/accuracy': 0.41234,
                                  'eval/seen/accuracy': 0.5,
                                  'eval/unseen/accuracy': 0.25},
                              ('rollout/accuracy', 'eval/*/accuracy',
                               'policy/kl'))
  assert line == ('epoch 3 | rollout/accuracy 0.4123 | eval/seen/accuracy '
                  '0.5 | eval/unseen/accuracy 0.25')
