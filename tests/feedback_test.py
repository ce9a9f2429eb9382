"""Tests for integrated feedback, consistency reward and RM metrics.

Expected values are written out by hand from the formulas. Tokens encode
where an example came from: a step's prompt is [rollout, k, 0] and response
[rollout, k, 1]; a judgment's prompt is [rollout, k, j, 2], response
[rollout, k, j, 3]. Each group uses its own task id.
"""

import math

import ml_collections
import numpy as np
import pytest

from rla_jax import feedback
from rla_jax import structs


def make_config(**overrides):
  config = ml_collections.ConfigDict(dict(
      lam=1.0, eps=1e-8, singleton='raw', parse_penalty=-2.0,
      mode='steps', unit_test_reward='gt',
      policy_filter='band', policy_acc_low=1 / 8, policy_acc_high=7 / 8,
      rm_acc_low=0.2,
      rm_acc_high=0.8))
  config.update(overrides)
  return config


def step(r, k):
  return structs.Step(prompt=f'p{r}{k}', prompt_tokens=[r, k, 0],
                      response=f'r{r}{k}', response_tokens=[r, k, 1],
                      logprobs=[0.0], action=f'act {k}',
                      observation=f'obs {k}', finish_reason='stop')


def rollout(task, r, outcome, scores, source='active', status=structs.OK):
  """A trajectory and its judgments; scores[k] lists S_j (None: unparsed)."""
  traj = structs.Trajectory(task_id=task, source=source, rollout=r,
                            spec={'id': task},
                            steps=[step(r, k) for k in range(len(scores))],
                            outcome=outcome, status=status)
  judgments = []
  for k, samples in enumerate(scores):
    for j, s in enumerate(samples):
      judgments.append(structs.Judgment(
          task_id=task, source=source, rollout=r, step=k, sample=j,
          prompt='', prompt_tokens=[r, k, j, 2], response='',
          response_tokens=[r, k, j, 3], logprobs=[], score=s or 0,
          parsed=s is not None))
  return traj, judgments


def build(*rollouts):
  trajs = [t for t, _ in rollouts]
  judgments = [j for _, js in rollouts for j in js]
  return trajs, judgments


def as_table(examples):
  return {(tuple(e.prompt_tokens), tuple(e.response_tokens)): e.advantage
          for e in examples}


def policy_key(r, k):
  return ((r, k, 0), (r, k, 1))


def rm_key(r, k, j):
  return ((r, k, j, 2), (r, k, j, 3))


# Group 'a': 4 rollouts, outcomes +1 -1 +1 -1 (acc 0.5), steps 2, 3, 1, 2.
#   R(step 0) = [1+1, -1-1, 1+0, -1+1] = [2, -2, 1, 0]
#   R(step 1) = [1+1/3, -1+0, -, -1-1] = [4/3, -1, -2]   (rollouts 0, 1, 3)
#   R(step 2) = [-, -1-1/3, -, -]      = [-4/3]          (singleton, rollout 1)
GROUP_A = [
    ('a', 0, 1.0, [[1, 1, 1], [1, 1, -1]]),
    ('a', 1, -1.0, [[-1, -1, -1], [1, -1, None], [-1, None, None]]),
    ('a', 2, 1.0, [[1, None, -1]]),
    ('a', 3, -1.0, [[1, 1, 1], [-1, -1, -1]]),
]


def test_task_accuracy_excludes_and_counts_errors():
  trajs, _ = build(rollout('a', 0, 1.0, [[1]]), rollout('a', 1, 1.0, [[1]]),
                   rollout('a', 2, -1.0, [[1]]),
                   rollout('a', 3, 1.0, [[1]], status=structs.ERROR),
                   rollout('a', 0, -1.0, [[1]], source='pending'),
                   rollout('b', 0, 1.0, [[1]], status=structs.ERROR))
  acc = feedback.task_accuracy(trajs)
  assert acc[('a', 'active')] == feedback.GroupAccuracy(2 / 3, 2, 3, 1)
  assert acc[('a', 'pending')] == feedback.GroupAccuracy(0.0, 0, 1, 0)
  assert acc[('b', 'active')] == feedback.GroupAccuracy(None, 0, 0, 1)


def test_step_rewards_lambda_and_unparseable_as_zero():
  trajs, judgments = build(rollout('a', 0, 1.0, [[1, -1, None], [1, 1, None]]),
                           rollout('a', 1, -1.0, [[], [-1, -1, -1]]))
  by_step = feedback.judgments_by_step(judgments)
  rewards = feedback.step_rewards(trajs, by_step, lam=0.5)
  assert rewards == pytest.approx({
      ('a', 'active', 0, 0): 1.0,  # mean(1, -1, 0) = 0
      ('a', 'active', 0, 1): 1.0 + 0.5 * 2 / 3,
      ('a', 'active', 1, 0): -1.0,  # no judgments: R = O
      ('a', 'active', 1, 1): -1.5,
  })


@pytest.mark.parametrize('singleton', ['raw', 'zero'])
def test_policy_advantages_table(singleton):
  trajs, judgments = build(*[rollout(*spec) for spec in GROUP_A])
  policy, _, stats = feedback.integrate(trajs, judgments,
                                        make_config(singleton=singleton))
  std0 = math.sqrt((1.75**2 + 2.25**2 + 0.75**2 + 0.25**2) / 4)  # mean 0.25
  std1 = math.sqrt(((17 / 9)**2 + (4 / 9)**2 + (13 / 9)**2) / 3)  # mean -5/9
  expected = {
      policy_key(0, 0): 1.75 / std0, policy_key(1, 0): -2.25 / std0,
      policy_key(2, 0): 0.75 / std0, policy_key(3, 0): -0.25 / std0,
      policy_key(0, 1): (17 / 9) / std1, policy_key(1, 1): (-4 / 9) / std1,
      policy_key(3, 1): (-13 / 9) / std1,
  }
  if singleton == 'raw':
    expected[policy_key(1, 2)] = -4 / 3
  assert as_table(policy) == pytest.approx(expected)
  assert len(policy) == len(expected)
  assert stats['feedback/policy_singleton_steps'] == 1
  assert stats['feedback/policy_dropped_zero'] == (singleton == 'zero')
  assert stats['feedback/reward_mean'] == pytest.approx(
      (2 - 2 + 1 + 0 + 4 / 3 - 1 - 2 - 4 / 3) / 8)


def test_policy_zero_variance_and_value_at_mean_are_dropped():
  trajs, judgments = build(
      # Group 'b': R = [1-1, -1+1] = [0, 0] -> std 0 -> both dropped.
      rollout('b', 0, 1.0, [[-1, -1, -1]]),
      rollout('b', 1, -1.0, [[1, 1, 1]]),
      # Group 'c': R = [4/3, -2/3, 1/3, 1/3], mean 1/3 -> rollouts 2, 3 at 0.
      rollout('c', 0, 1.0, [[1, 1, -1]]),
      rollout('c', 1, -1.0, [[1, 1, -1]]),
      rollout('c', 2, 1.0, [[-1, -1, None]]),
      rollout('c', 3, 1.0, [[-1, None, -1]]),
  )
  policy, _, stats = feedback.integrate(trajs, judgments, make_config())
  std = math.sqrt((1 + 1 + 0 + 0) / 4)
  assert as_table(policy) == pytest.approx({policy_key(0, 0): 1 / std,
                                            policy_key(1, 0): -1 / std})
  assert stats['feedback/policy_dropped_zero'] == 4
  assert stats['feedback/policy_examples'] == 2


def test_singleton_zero_raw_reward_is_dropped():
  # A single rollout reaching step 1 with R = 1 + (-1) = 0: dropped in 'raw'.
  trajs, judgments = build(rollout('a', 0, 1.0, [[1], [-1]]),
                           rollout('a', 1, -1.0, [[1]]))
  policy, _, stats = feedback.integrate(trajs, judgments, make_config())
  assert set(as_table(policy)) == {policy_key(0, 0), policy_key(1, 0)}
  assert stats['feedback/policy_singleton_steps'] == 1
  assert stats['feedback/policy_dropped_zero'] == 1


def test_bad_singleton_mode_raises():
  trajs, judgments = build(rollout('a', 0, 1.0, [[1]]))
  with pytest.raises(ValueError, match='singleton'):
    feedback.integrate(trajs, judgments, make_config(singleton='keep'))


def test_policy_band_filter_is_inclusive_and_exclude_is_honoured():
  def group(task, successes, size, source='active'):
    return [rollout(task, r, 1.0 if r < successes else -1.0,
                    [[1 if r % 2 else -1]], source=source)
            for r in range(size)]
  trajs, judgments = build(
      *group('low', 1, 8),  # acc 1/8: kept
      *group('high', 7, 8),  # acc 7/8: kept
      *group('none', 0, 8),  # acc 0: filtered
      *group('all', 8, 8),  # acc 1: filtered
      *group('low', 1, 8, source='pending'),  # rejected rewrite: excluded
  )
  policy, rm, stats = feedback.integrate(
      trajs, judgments, make_config(), exclude={('low', 'pending')})
  assert stats['feedback/policy_groups_used'] == 2
  assert stats['feedback/policy_groups_filtered'] == 2
  assert stats['feedback/policy_groups_excluded'] == 1
  assert len(policy) == 16  # two groups x 8 rollouts, no zero advantages
  # The RM band [0.2, 0.8] rejects 1/8 and 7/8; m = 1 has zero variance.
  assert stats['feedback/rm_groups_used'] == 0
  assert stats['feedback/rm_groups_filtered'] == 4
  assert not rm
  # OSWorld as launched: no policy filter.
  _, _, stats = feedback.integrate(
      trajs, judgments, make_config(policy_acc_low=0.0, policy_acc_high=1.0))
  assert stats['feedback/policy_groups_used'] == 5


def test_mixed_filter_is_some_but_not_all_ok_rollouts_won():
  def group(task, wins, size, errors=0):
    out = [rollout(task, r, 1.0 if r < wins else -1.0,
                   [[1 if r % 2 else -1]]) for r in range(size)]
    out += [rollout(task, size + e, 1.0, [[1]], status=structs.ERROR)
            for e in range(errors)]
    return out
  trajs, judgments = build(
      *group('one_of_16', 1, 16),  # acc 1/16 < 1/8: the band drops it
      *group('eight_of_9', 8, 9),  # acc 8/9 > 7/8: the band drops it
      *group('all_ok_won', 2, 2, errors=2),  # every ok rollout won
      *group('none', 0, 4),
      *group('half', 2, 4, errors=1),
  )
  _, _, stats = feedback.integrate(trajs, judgments,
                                   make_config(policy_filter='mixed'))
  assert stats['feedback/policy_groups_used'] == 3
  assert stats['feedback/policy_groups_filtered'] == 2
  _, _, stats = feedback.integrate(trajs, judgments, make_config())
  assert stats['feedback/policy_groups_used'] == 1  # only 'half'
  with pytest.raises(ValueError, match='policy_filter'):
    feedback.integrate(trajs, judgments, make_config(policy_filter='some'))


def test_examples_carry_keys_and_sampler_logprobs():
  trajs, judgments = build(rollout('a', 0, 1.0, [[1, -1]]),
                           rollout('a', 1, -1.0, [[1, -1]]))
  policy, rm, _ = feedback.integrate(trajs, judgments,
                                     make_config(policy_filter='mixed',
                                                 rm_acc_low=0.0))
  assert sorted(e.key for e in policy) == ['a/active/0/0', 'a/active/1/0']
  assert all(e.logprobs == [0.0] for e in policy)
  assert sorted(e.key for e in rm) == ['a/active/0/0/0', 'a/active/0/0/1',
                                       'a/active/1/0/0', 'a/active/1/0/1']


def test_error_trajectories_are_left_out_of_everything():
  good = [rollout('a', 0, 1.0, [[1, 1, 1]]),
          rollout('a', 1, -1.0, [[-1, -1, 1]])]
  broken = rollout('a', 2, 1.0, [[1, 1, 1], [1, 1, 1]], status=structs.ERROR)
  with_error = feedback.integrate(*build(*good, broken), make_config())
  without = feedback.integrate(*build(*good), make_config())
  assert with_error[0] == without[0]
  assert with_error[1] == without[1]
  assert with_error[2]['feedback/error_trajectories'] == 1
  assert with_error[2]['feedback/steps'] == 2
  for example in with_error[0] + with_error[1]:
    assert example.prompt_tokens[0] != 2


def test_rm_consistency_table():
  # Group 'r': 5 rollouts, 1 success -> acc 0.2 (inclusive edge of the band).
  trajs, judgments = build(
      rollout('r', 0, 1.0, [[1, -1, None], [1, 1, 1]]),
      rollout('r', 1, -1.0, [[1, 1, -1], [None, None, None]]),
      rollout('r', 2, -1.0, [[-1, -1, -1]]),
      rollout('r', 3, -1.0, [[-1, -1, -1]]),
      rollout('r', 4, -1.0, [[-1, -1, -1]]),
  )
  _, rm, stats = feedback.integrate(trajs, judgments, make_config())
  # (0, 0): R = 1 + 0 = 1, raw = [1, -1, -2], mean -2/3.
  std00 = math.sqrt(((5 / 3)**2 + (1 / 3)**2 + (4 / 3)**2) / 3)
  # (1, 0): R = -1 + 1/3 = -2/3, raw = [-2/3, -2/3, 2/3], mean -2/9.
  std10 = math.sqrt(((4 / 9)**2 * 2 + (8 / 9)**2) / 3)
  assert as_table(rm) == pytest.approx({
      rm_key(0, 0, 0): (5 / 3) / std00, rm_key(0, 0, 1): (-1 / 3) / std00,
      rm_key(0, 0, 2): (-4 / 3) / std00,
      rm_key(1, 0, 0): (-4 / 9) / std10, rm_key(1, 0, 1): (-4 / 9) / std10,
      rm_key(1, 0, 2): (8 / 9) / std10,
  })
  # (0, 1) all +1, (1, 1) all unparsed (-2 each), (2..4, 0) all -1.
  assert stats['feedback/rm_steps_zero_var'] == 5
  assert stats['feedback/rm_penalties'] == 4
  assert stats['feedback/parse_failures'] == 4
  assert stats['feedback/rm_examples'] == 6


def test_rm_penalty_and_zero_dropping():
  # S = [1, -1, None], R = O = 1; penalty 0 -> raw [1, -1, 0] -> A_2 = 0.
  trajs, judgments = build(rollout('r', 0, 1.0, [[1, -1, None]]),
                           rollout('r', 1, -1.0, [[1, -1, 1]]))
  _, rm, stats = feedback.integrate(trajs, judgments,
                                    make_config(parse_penalty=0.0))
  assert as_table(rm) == pytest.approx({
      rm_key(0, 0, 0): 1 / math.sqrt(2 / 3),
      rm_key(0, 0, 1): -1 / math.sqrt(2 / 3),
      # R = -1 + 1/3 = -2/3, raw [-2/3, 2/3, -2/3], mean -2/9.
      rm_key(1, 0, 0): (-4 / 9) / math.sqrt(96 / 243),
      rm_key(1, 0, 1): (8 / 9) / math.sqrt(96 / 243),
      rm_key(1, 0, 2): (-4 / 9) / math.sqrt(96 / 243),
  })
  assert stats['feedback/rm_dropped_zero'] == 1


def test_rm_band_upper_edge_and_outside():
  def group(task, successes, size):
    return [rollout(task, r, 1.0 if r < successes else -1.0, [[1, -1]])
            for r in range(size)]
  trajs, judgments = build(*group('in', 4, 5), *group('out', 7, 8))
  _, rm, stats = feedback.integrate(trajs, judgments, make_config())
  assert stats['feedback/rm_groups_used'] == 1  # 0.8 kept, 7/8 filtered
  assert stats['feedback/rm_groups_filtered'] == 1
  assert len(rm) == 10 and all(abs(e.advantage) == 1.0 for e in rm)


def test_examples_keep_tokens_and_advantages_aligned():
  trajs, judgments = build(*[rollout(*spec) for spec in GROUP_A])
  by_step = feedback.judgments_by_step(judgments)
  rewards = feedback.step_rewards(trajs, by_step, 1.0)
  policy, _, _ = feedback.integrate(trajs, judgments, make_config())
  for example in policy:
    r, k, tag = example.prompt_tokens
    assert tag == 0 and example.response_tokens == [r, k, 1]
    # The advantage has the sign of R minus its step mean: check the step.
    same_step = [rewards[('a', 'active', t.rollout, k)] for t in trajs
                 if len(t.steps) > k]
    if len(same_step) > 1:
      assert np.sign(example.advantage) == np.sign(
          rewards[('a', 'active', r, k)] - np.mean(same_step))


def test_rm_metrics():
  trajs, judgments = build(
      rollout('a', 0, 1.0, [[1, 1, -1], [1, None, 1]]),  # means 1/3, 2/3
      rollout('a', 1, -1.0, [[1, 1, 1], [-1, -1, 1]]),  # means 1, -1/3
      rollout('a', 2, -1.0, [[1, -1, None]]),  # mean 0: a wrong verdict
      rollout('a', 3, 1.0, [[]]),  # unjudged: not counted
      rollout('a', 4, 1.0, [[-1, -1, -1]], status=structs.ERROR),
  )
  metrics = feedback.rm_metrics(trajs, judgments)
  # Outcome: rollout 0 mean +1/2 (right), 1 mean +1/3 (wrong), 2 mean 0.
  assert metrics['rm/outcome_acc'] == pytest.approx(1 / 3)
  assert metrics['rm/outcome_count'] == 3
  # Agreement with the outcome per step (rollout, k), not the paper's
  # Process Acc: (0,0) y, (0,1) y, (1,0) n, (1,1) y, (2,0) n.
  assert metrics['rm/outcome_agreement'] == pytest.approx(3 / 5)
  assert 'rm/process_acc' not in metrics  # no step labels
  assert metrics['rm/p_plus'] == pytest.approx(4 / 6)
  assert metrics['rm/p_minus'] == pytest.approx(3 / 9)
  assert metrics['rm/mu'] == pytest.approx(1.0)
  assert metrics['judge/parse_fail_rate'] == pytest.approx(2 / 18)
  trajs[0].info['step_labels'] = [-1, None]  # (0,0) verdict +1: wrong
  trajs[1].info['step_labels'] = [None, -1]  # (1,1) verdict -1: right
  metrics = feedback.rm_metrics(trajs, judgments)
  assert metrics['rm/process_acc'] == pytest.approx(1 / 2)
  assert metrics['rm/process_count'] == 2
  assert math.isnan(feedback.rm_metrics([], [])['rm/outcome_acc'])


def test_duplicate_rollouts_raise():
  trajs, judgments = build(rollout('a', 0, 1.0, [[1]]),
                           rollout('a', 0, -1.0, [[1]]))
  with pytest.raises(ValueError, match='share'):
    feedback.integrate(trajs, judgments, make_config())


# ---- unit-test feedback (coding) -------------------------------------------


def program(task, r, gt_ratio, status=structs.OK):
  return structs.Trajectory(
      task_id=task, source='active', rollout=r, spec={'id': task},
      steps=[step(r, 0)], outcome=1.0 if gt_ratio == 1.0 else -1.0,
      status=status, info={'gt_ratio': gt_ratio, 'program': f'p{r}'})


def unit_test(task, j, passed, rollouts, parsed=True):
  return structs.Judgment(
      task_id=task, source='active', rollout=structs.TASK_LEVEL,
      step=structs.TASK_LEVEL, sample=j, prompt='', prompt_tokens=[9, j, 2],
      response='', response_tokens=[9, j, 3], logprobs=[], score=int(parsed),
      parsed=parsed, info={'test': ['1', '2'] if parsed else None,
                           'rollouts': rollouts, 'passed': passed})


def ut_config(**overrides):
  values = dict(mode='unit_tests', policy_acc_low=0.0, policy_acc_high=1.0,
                rm_acc_low=0.0, rm_acc_high=1.0)
  values.update(overrides)
  return make_config(**values)


def coding_group():
  # Programs: gt ratios 1, 0.5, 0, 0.5 (only rollout 0 is correct); rollout 4
  # errored. Tests: u0 passed by 0, 1; u1 by 0, 3; u2 by 1 only (wrong: the
  # correct program fails it); u3 unparseable (fails everywhere).
  trajs = [program('c', 0, 1.0), program('c', 1, 0.5), program('c', 2, 0.0),
           program('c', 3, 0.5), program('c', 4, 1.0, status=structs.ERROR)]
  rollouts = [0, 1, 2, 3]
  tests = [unit_test('c', 0, [True, True, False, False], rollouts),
           unit_test('c', 1, [True, False, False, True], rollouts),
           unit_test('c', 2, [False, True, False, False], rollouts),
           unit_test('c', 3, [False] * 4, rollouts, parsed=False)]
  return trajs, tests


def test_unit_test_rewards_table():
  trajs, tests = coding_group()
  policy, rm, stats = feedback.integrate(trajs, tests, ut_config())
  # Policy ('gt'): R = [1, .5, 0, .5], mean .5, std sqrt(1/8).
  s = math.sqrt(1 / 8)
  assert as_table(policy) == pytest.approx({
      policy_key(0, 0): 0.5 / s, policy_key(2, 0): -0.5 / s})
  assert stats['feedback/dropped_zero'] == 2
  # RM (5.7): C+ = {0}, C- = {1, 2, 3}. u0 correct, caught {2, 3}: 2;
  # u1 correct, caught {1, 2}: 2; u2 wrong, let through {1}: -1; u3 invalid
  # (wrong, lets nothing through): 0. r = [2, 2, -1, 0], mean 3/4.
  r = np.array([2, 2, -1, 0], float)
  z = (r - r.mean()) / r.std()
  assert as_table(rm) == pytest.approx({
      ((9, j, 2), (9, j, 3)): z[j] for j in range(4)})
  assert sorted(e.key for e in rm) == [f'c/active/test/{j}' for j in range(4)]
  metrics = feedback.rm_metrics(trajs, tests, 'unit_tests')
  assert metrics['rm/ut_accuracy'] == pytest.approx(2 / 4)
  assert metrics['rm/detect'] == 0.0  # no test fails all of C-
  assert metrics['judge/parse_fail_rate'] == pytest.approx(1 / 4)


def test_unit_test_integrated_policy_reward():
  trajs, tests = coding_group()
  policy, _, _ = feedback.integrate(
      trajs, tests, ut_config(unit_test_reward='integrated', lam=0.5))
  # K = {u0, u1} (valid, passed by the correct program 0).
  # q = [1, 1/2, 0, 1/2]; R = g + q/2 = [1.5, .75, 0, .75], mean .75.
  r = np.array([1.5, 0.75, 0.0, 0.75])
  z = (r - r.mean()) / r.std()
  assert as_table(policy) == pytest.approx({
      policy_key(0, 0): z[0], policy_key(2, 0): z[2]})


def test_unit_test_feedback_skips_and_filters():
  # No correct program: no RM data; the policy band [0.2, 0.8] filters.
  trajs = [program('z', r, g) for r, g in enumerate((0.0, 0.5))]
  tests = [unit_test('z', 0, [True, False], [0, 1])]
  _, rm, stats = feedback.integrate(trajs, tests, ut_config())
  assert not rm and stats['feedback/rm_no_correct'] == 1
  policy, _, stats = feedback.integrate(
      trajs, tests, ut_config(policy_acc_low=0.2, policy_acc_high=0.8))
  assert not policy and stats['feedback/groups_filtered'] == 1
  # Tests that never ran (the sandbox broke) are not trained on.
  trajs, tests = coding_group()
  for t in tests:
    t.info['passed'] = None
  _, rm, stats = feedback.integrate(trajs, tests, ut_config())
  assert not rm and stats['feedback/rm_unrun'] == 1
  # Rejected rewrites are excluded from both.
  trajs, tests = coding_group()
  policy, rm, stats = feedback.integrate(trajs, tests, ut_config(),
                                         exclude={('c', 'active')})
  assert not policy and not rm and stats['feedback/groups_excluded'] == 1
