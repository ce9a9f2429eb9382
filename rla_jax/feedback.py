"""Integrated feedback for the policy, consistency reward for the reward model.

Host-side numpy on the structs of one epoch (RLANYTHING.md 1, 3.5, 3.6; the
coding setting's unit-test rewards, 5.6-5.7, at the end). A
group is the set of rollouts of one task version, `(task_id, source)`; a step
key is `(task_id, source, rollout, step)`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
import dataclasses

import numpy as np

from rla_jax import structs

Group = tuple[str, str]
StepKey = tuple[str, str, int, int]

SINGLETON_MODES = ('raw', 'zero')
# Which groups train the policy: 'mixed' = some but not all of the non-error
# rollouts won (the authors' AlfWorld filter, for any G and with errors);
# 'band' = accuracy inside [policy_acc_low, policy_acc_high].
POLICY_FILTERS = ('mixed', 'band')
# Slack on inclusive band edges, so that 0.8 from a config equals 4/5.
_BAND_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class GroupAccuracy:
  """Accuracy of one group; error rollouts are excluded from it and counted."""

  accuracy: float | None  # num_success / num_ok; None when num_ok == 0
  num_success: int
  num_ok: int
  num_error: int


def task_accuracy(
    trajectories: Iterable[structs.Trajectory]) -> dict[Group, GroupAccuracy]:
  """acc(group) = #{O = +1} / #{status OK}, over the non-error rollouts."""
  counts = {}
  for traj in trajectories:
    success, ok, error = counts.get(traj.group, (0, 0, 0))
    if traj.status == structs.ERROR:
      error += 1
    else:
      ok += 1
      success += int(traj.outcome > 0)
    counts[traj.group] = (success, ok, error)
  return {
      group: GroupAccuracy(success / ok if ok else None, success, ok, error)
      for group, (success, ok, error) in counts.items()
  }


def in_band(acc: float | None, low: float, high: float) -> bool:
  """low <= acc <= high (inclusive, as the authors); False for None."""
  return acc is not None and low - _BAND_TOL <= acc <= high + _BAND_TOL


def mixed(acc: GroupAccuracy) -> bool:
  """Some, but not all, of the group's non-error rollouts succeeded."""
  return 0 < acc.num_success < acc.num_ok


def band(low: float, high: float) -> Callable[[GroupAccuracy], bool]:
  """Keeps groups whose accuracy is in [low, high] (inclusive)."""
  return lambda acc: in_band(acc.accuracy, low, high)


def policy_filter(config) -> Callable[[GroupAccuracy], bool]:
  """The policy's group filter from the `feedback` config section."""
  if config.policy_filter not in POLICY_FILTERS:
    raise ValueError(f'config.feedback.policy_filter={config.policy_filter!r}:'
                     f' expected one of {POLICY_FILTERS}')
  if config.policy_filter == 'mixed':
    return mixed
  return band(config.policy_acc_low, config.policy_acc_high)


def judgments_by_step(
    judgments: Iterable[structs.Judgment],
) -> dict[StepKey, list[structs.Judgment]]:
  """Judgments grouped by the policy step they score, ordered by sample."""
  index = {}
  for judgment in judgments:
    index.setdefault(judgment.step_key, []).append(judgment)
  for samples in index.values():
    samples.sort(key=lambda j: j.sample)
  return index


def step_score(samples: Sequence[structs.Judgment]) -> float:
  """mean_j S_j over the m judgments of a step (0 when there are none)."""
  return (float(np.mean([structs.score(j) for j in samples])) if samples
          else 0.0)


def step_rewards(trajectories: Iterable[structs.Trajectory],
                 by_step: Mapping[StepKey, Sequence[structs.Judgment]],
                 lam: float) -> dict[StepKey, float]:
  """Integrated feedback R = O + lam * mean_j S_j for every non-error step."""
  rewards = {}
  for traj in _ok(trajectories):
    for k in range(len(traj.steps)):
      key = traj.step_key(k)
      rewards[key] = traj.outcome + lam * step_score(by_step.get(key, ()))
  return rewards


def zscore(values: Sequence[float], eps: float) -> np.ndarray:
  """(x - mean) / std with the population std; all zeros when std <= eps."""
  x = np.asarray(values, dtype=np.float64)
  std = x.std()
  if std <= eps:
    return np.zeros_like(x)
  return (x - x.mean()) / std


def policy_examples(
    trajectories: Sequence[structs.Trajectory],
    rewards: Mapping[StepKey, float],
    accuracy: Mapping[Group, GroupAccuracy],
    *,
    keep: Callable[[GroupAccuracy], bool],
    singleton: str,
    eps: float,
    exclude: Collection[Group],
) -> tuple[list[structs.Example], dict[str, float]]:
  """Per-step policy examples with A = z-score of R per (group, step index).

  For group g and step index k, the R of the rollouts that reach step k are
  standardised: A = (R - mean) / std (population std; std <= eps -> A = 0).
  When a single rollout reaches step k, `singleton` decides: 'raw' keeps
  A = R (the authors, bug B11), 'zero' sets A = 0. Examples with |A| <= eps
  are dropped. Groups are used only when not in `exclude` and `keep`
  accepts their accuracy.
  """
  if singleton not in SINGLETON_MODES:
    raise ValueError(f'singleton must be one of {SINGLETON_MODES}: {singleton}')
  stats = dict.fromkeys(('groups_used', 'groups_filtered', 'groups_excluded',
                         'singleton_steps', 'dropped_zero'), 0)
  examples = []
  for trajs in _usable_groups(trajectories, accuracy, keep, exclude, stats):
    for k in range(max(len(t.steps) for t in trajs)):
      reach = [t for t in trajs if len(t.steps) > k]
      values = [rewards[t.step_key(k)] for t in reach]
      if len(reach) == 1:
        stats['singleton_steps'] += 1
        advantages = values if singleton == 'raw' else [0.0]
      else:
        advantages = zscore(values, eps)
      _keep_nonzero([t.steps[k] for t in reach],
                    [t.step_key(k) for t in reach], advantages, eps, examples,
                    stats)
  stats['examples'] = len(examples)
  return examples, stats


def rm_examples(
    trajectories: Sequence[structs.Trajectory],
    by_step: Mapping[StepKey, Sequence[structs.Judgment]],
    rewards: Mapping[StepKey, float],
    accuracy: Mapping[Group, GroupAccuracy],
    *,
    keep: Callable[[GroupAccuracy], bool],
    penalty: float,
    eps: float,
    exclude: Collection[Group],
) -> tuple[list[structs.Example], dict[str, float]]:
  """Reward-model examples from the consistency reward.

  For judgment j of step (rollout, k): raw_j = R * S_j, or raw_j = `penalty`
  when the answer was unparseable. A_j = z-score of raw over the m judgments
  of that step; the step is skipped when std <= eps; examples with
  |A| <= eps are dropped. Groups are used only when not in `exclude` and
  `keep` accepts their accuracy (the RM band; Theorem 2: both outcomes must
  be present).
  """
  stats = dict.fromkeys(('groups_used', 'groups_filtered', 'groups_excluded',
                         'steps_zero_var', 'penalties', 'dropped_zero'), 0)
  examples = []
  for trajs in _usable_groups(trajectories, accuracy, keep, exclude, stats):
    for traj in trajs:
      for k in range(len(traj.steps)):
        key = traj.step_key(k)
        samples = by_step.get(key, ())
        if not samples:
          continue
        raw = [rewards[key] * j.score if j.parsed else penalty for j in samples]
        stats['penalties'] += sum(not j.parsed for j in samples)
        if np.std(raw) <= eps:
          stats['steps_zero_var'] += 1
          continue
        _keep_nonzero(samples, [(*key, j.sample) for j in samples],
                      zscore(raw, eps), eps, examples, stats)
  stats['examples'] = len(examples)
  return examples, stats


def integrate(
    trajectories: Sequence[structs.Trajectory],
    judgments: Sequence[structs.Judgment],
    config,
    exclude: Collection[Group] = (),
) -> tuple[list[structs.Example], list[structs.Example], dict[str, float]]:
  """Policy and RM training examples of one epoch, plus `feedback/*` stats.

  `config` is the `feedback` section: mode ('steps': integrated feedback per
  step; 'unit_tests': the coding rewards, `unit_test_examples`), lam, eps,
  singleton, parse_penalty, policy_filter (+ policy_acc_low, policy_acc_high
  for 'band'), rm_acc_low, rm_acc_high, unit_test_reward. `exclude` holds
  the groups not to train on (rejected pending rewrites).
  """
  trajectories = list(trajectories)
  _check_unique(trajectories)
  if config.mode not in structs.FEEDBACK_MODES:
    raise ValueError(f'config.feedback.mode={config.mode!r}: one of '
                     f'{structs.FEEDBACK_MODES}')
  if config.mode == structs.UNIT_TESTS:
    policy, rm, stats = unit_test_examples(trajectories, judgments, config,
                                           set(exclude))
    return policy, rm, {f'feedback/{k}': v for k, v in stats.items()}
  accuracy = task_accuracy(trajectories)
  by_step = judgments_by_step(judgments)
  rewards = step_rewards(trajectories, by_step, config.lam)
  exclude = set(exclude)
  policy, policy_stats = policy_examples(
      trajectories, rewards, accuracy, keep=policy_filter(config),
      singleton=config.singleton,
      eps=config.eps, exclude=exclude)
  rm, rm_stats = rm_examples(
      trajectories, by_step, rewards, accuracy,
      keep=band(config.rm_acc_low, config.rm_acc_high),
      penalty=config.parse_penalty,
      eps=config.eps, exclude=exclude)
  judgments = list(judgments)
  stats = {
      'feedback/trajectories': len(trajectories),
      'feedback/error_trajectories': sum(
          t.status == structs.ERROR for t in trajectories),
      'feedback/groups_all_error': sum(
          a.accuracy is None for a in accuracy.values()),
      'feedback/steps': len(rewards),
      'feedback/steps_unjudged': sum(k not in by_step for k in rewards),
      'feedback/judgments': len(judgments),
      'feedback/parse_failures': sum(not j.parsed for j in judgments),
      'feedback/reward_mean': _mean(rewards.values()),
      'feedback/policy_advantage_abs_mean': _mean(
          abs(e.advantage) for e in policy),
      'feedback/rm_advantage_abs_mean': _mean(abs(e.advantage) for e in rm),
  }
  stats.update({f'feedback/policy_{k}': v for k, v in policy_stats.items()})
  stats.update({f'feedback/rm_{k}': v for k, v in rm_stats.items()})
  return policy, rm, stats


def rm_metrics(
    trajectories: Sequence[structs.Trajectory],
    judgments: Sequence[structs.Judgment],
    mode: str = 'steps',
) -> dict[str, float]:
  """Reward-model quality metrics (RLANYTHING.md 1, 7); NaN when undefined.

  mode 'unit_tests' (coding): `unit_test_metrics`. Otherwise (step judges):

  Non-error rollouts only; a step's verdict is sign(mean_j S_j), 0 = wrong.
    rm/outcome_acc: fraction of rollouts with a judged step where
      sign(mean over judged steps of mean_j S_j) == O (paper: Outcome Acc).
    rm/process_acc: fraction of labelled judged steps whose verdict equals
      the label (paper: Process Acc). Labels are +-1 per step in
      `Trajectory.info['step_labels']` (None = unlabelled), written by
      environments that know which actions progress (an expert or planner).
      Present only when some judged step is labelled.
    rm/outcome_agreement: fraction of judged steps whose verdict equals the
      rollout's outcome O (a proxy, not the paper's Process Acc).
    rm/p_plus: P(S_j = +1 | step of a successful rollout), per sample.
    rm/p_minus: P(S_j = -1 | step of a failed rollout), per sample.
    rm/mu: p_plus + p_minus; more samples m help iff mu > 1 (Theorem 1).
    judge/parse_fail_rate: unparseable answers / all judgments.
  """
  if mode == structs.UNIT_TESTS:
    return unit_test_metrics(trajectories, judgments)
  by_step = judgments_by_step(judgments)
  outcome_hits, agreement, process_hits = [], [], []
  plus, minus = [], []
  for traj in _ok(trajectories):
    labels = traj.info.get('step_labels') or ()
    step_means = []
    for k in range(len(traj.steps)):
      samples = by_step.get(traj.step_key(k), ())
      if not samples:
        continue
      mean = step_score(samples)
      step_means.append(mean)
      agreement.append(np.sign(mean) == np.sign(traj.outcome))
      if k < len(labels) and labels[k] is not None:
        process_hits.append(np.sign(mean) == np.sign(labels[k]))
      if traj.outcome > 0:
        plus.extend(structs.score(j) == 1 for j in samples)
      else:
        minus.extend(structs.score(j) == -1 for j in samples)
    if step_means:
      outcome_hits.append(np.sign(np.mean(step_means)) == np.sign(traj.outcome))
  judgments = list(judgments)
  p_plus, p_minus = _mean(plus), _mean(minus)
  out = {
      'rm/outcome_acc': _mean(outcome_hits),
      'rm/outcome_count': len(outcome_hits),
      'rm/outcome_agreement': _mean(agreement),
      'rm/p_plus': p_plus,
      'rm/p_minus': p_minus,
      'rm/mu': p_plus + p_minus,
      'judge/parse_fail_rate': _mean(not j.parsed for j in judgments),
  }
  if process_hits:
    out.update({'rm/process_acc': _mean(process_hits),
                'rm/process_count': len(process_hits)})
  return out


def example_key(*parts) -> str:
  """'task/source/rollout/step[/sample]': names an example in logs."""
  return '/'.join(str(p) for p in parts)


def _keep_nonzero(sources, keys, advantages, eps, examples, stats):
  """Appends an Example per (Step or Judgment, key, A) with |A| > eps."""
  for source, key, advantage in zip(sources, keys, advantages):
    if abs(advantage) <= eps:
      stats['dropped_zero'] += 1
    else:
      examples.append(structs.Example(
          list(source.prompt_tokens), list(source.response_tokens),
          float(advantage), logprobs=list(source.logprobs),
          key=example_key(*key), images=source.images))


def _usable_groups(trajectories, accuracy, keep, exclude, stats):
  """Rollouts of each group not excluded and accepted by `keep`."""
  for group, trajs in _by_group(_ok(trajectories)).items():
    if group in exclude:
      stats['groups_excluded'] += 1
    elif not keep(accuracy[group]):
      stats['groups_filtered'] += 1
    else:
      stats['groups_used'] += 1
      yield trajs


def _ok(trajectories: Iterable[structs.Trajectory]):
  return (t for t in trajectories if t.status != structs.ERROR)


def _by_group(trajectories: Iterable[structs.Trajectory]):
  groups = {}
  for traj in trajectories:
    groups.setdefault(traj.group, []).append(traj)
  return groups


def _check_unique(trajectories: Sequence[structs.Trajectory]) -> None:
  keys = [(t.task_id, t.source, t.rollout) for t in trajectories]
  if len(set(keys)) != len(keys):
    raise ValueError('two trajectories share (task_id, source, rollout)')


def _mean(values: Iterable[float]) -> float:
  values = [float(v) for v in values]
  return float(np.mean(values)) if values else float('nan')


# ---- Unit-test feedback (coding, RLANYTHING.md 5.6-5.7) ---------------------
# A group's programs are its non-error rollouts (Trajectory.info: 'gt_ratio',
# the fraction of ground-truth tests passed, and 'program'); its RM
# judgments are unit tests (Judgment.info 'test', 'rollouts', 'passed').

UNIT_TEST_REWARDS = ('gt', 'integrated')


def _ut_inputs(correct_P, passes_PxU, valid_U):
  correct = np.asarray(correct_P, dtype=bool).reshape(-1)
  passes = np.asarray(passes_PxU, dtype=bool).reshape(correct.size, -1)
  valid = np.asarray(valid_U, dtype=bool).reshape(passes.shape[1])
  return correct, passes & valid[None, :], valid


def rm_rewards(correct_P, passes_PxU, valid_U) -> np.ndarray | None:
  """Reward of each of the U unit tests (RLANYTHING.md 5.7); None = skip.

  C+ = programs passing every GT test, C- = the others; an invalid test
  fails every program. The task is skipped when C+ is empty. Test u is
  correct iff every program in C+ passes it. If C- is empty: r_u = +1 if u
  is correct else -1. Otherwise r_u = #{c in C-: c fails u} if u is correct,
  else -#{c in C-: c passes u} (so an invalid test gets 0, like a correct
  test that catches nothing). Advantages are z-scores of r over the U tests.
  """
  correct, passes, _ = _ut_inputs(correct_P, passes_PxU, valid_U)
  if not correct.any():
    return None
  good = passes[correct].all(axis=0)
  if correct.all():
    return np.where(good, 1.0, -1.0)
  wrong = passes[~correct]
  caught = (~wrong).sum(axis=0).astype(float)
  let_through = wrong.sum(axis=0).astype(float)
  return np.where(good, caught, -let_through)


def ut_metrics(correct_P, passes_PxU, valid_U) -> dict[str, int]:
  """Counts behind rm/ut_accuracy and rm/detect for one task (5.7).

  ut_correct / ut_total: tests passing every program in C+ (tasks with
  C+ non-empty). detect / detect_total: tests passing all of C+ and failing
  all of C- (tasks with both non-empty). Totals are 0 where undefined.
  """
  correct, passes, _ = _ut_inputs(correct_P, passes_PxU, valid_U)
  total = passes.shape[1]
  if not correct.any():
    return {'ut_correct': 0, 'ut_total': 0, 'detect': 0, 'detect_total': 0}
  good = passes[correct].all(axis=0)
  out = {'ut_correct': int(good.sum()), 'ut_total': total, 'detect': 0,
         'detect_total': 0}
  if not correct.all():
    detects = good & ~passes[~correct].any(axis=0)
    out.update(detect=int(detects.sum()), detect_total=total)
  return out


def aggregate_ut_metrics(per_task: Sequence[dict[str, int]]
                         ) -> dict[str, float]:
  """rm/ut_accuracy and rm/detect over tasks (pooled over tests; NaN: none)."""
  sums = {k: sum(m[k] for m in per_task) for k in (
      'ut_correct', 'ut_total', 'detect', 'detect_total')}
  nan = float('nan')
  return {
      'rm/ut_accuracy': (sums['ut_correct'] / sums['ut_total']
                         if sums['ut_total'] else nan),
      'rm/detect': (sums['detect'] / sums['detect_total']
                    if sums['detect_total'] else nan),
  }


def policy_rewards(gt_ratio_P, passes_PxU=None, valid_U=None, *,
                   mode: str = 'gt', lam: float = 1.0) -> np.ndarray:
  """Reward of each of the P programs of a task (before z-scoring).

  'gt' (the authors, 5.6): R_p = g_p, the fraction of GT tests p passes.
  'integrated' (the paper's claim for the Policy row, bug B5):
    R_p = g_p + lam * q_p,  q_p = #{u in K: p passes u} / |K|  (0 if K = {})
  where K are the RM's tests that look correct: when some program passes
  every GT test (C+ non-empty), K = valid tests that every program in C+
  passes, since a test that a GT-correct program fails is most likely wrong
  and would reward agreeing with its mistake; when C+ is empty nothing can
  vouch for a test, so K = all valid tests, the RM's unverified judgment,
  as integrated feedback uses the RM's scores in the agent settings. Both
  terms lie in [0, 1]; q separates programs with equal GT ratios, which is
  the common case (all-fail groups) where the GT reward alone has no signal.
  """
  gt = np.asarray(gt_ratio_P, dtype=float).reshape(-1)
  if mode not in UNIT_TEST_REWARDS:
    raise ValueError(f'config.feedback.unit_test_reward={mode!r}: one of '
                     f'{UNIT_TEST_REWARDS}')
  if mode == 'gt' or passes_PxU is None:
    if mode == 'integrated':
      raise ValueError("mode='integrated' needs passes_PxU and valid_U")
    return gt
  correct = gt >= 1.0
  _, passes, valid = _ut_inputs(correct, passes_PxU, valid_U)
  keep = valid & (passes[correct].all(axis=0) if correct.any() else True)
  if not keep.any():
    return gt
  return gt + lam * passes[:, keep].mean(axis=1)


def group_tests(trajs: Sequence[structs.Trajectory],
                judgments: Sequence[structs.Judgment]):
  """(gt_ratio_P, passes_PxU, valid_U, tests) of one group, None if unrun.

  Programs in `trajs` order; tests in sample order. Unparseable tests are
  invalid (they fail every program).
  """
  tests = sorted(judgments, key=lambda j: j.sample)
  gt = np.array([t.info['gt_ratio'] for t in trajs], dtype=float)
  passes = np.zeros((len(trajs), len(tests)), dtype=bool)
  for u, j in enumerate(tests):
    if j.info.get('passed') is None:
      return None
    column = dict(zip(j.info['rollouts'], j.info['passed']))
    passes[:, u] = [column.get(t.rollout, False) for t in trajs]
  valid = np.array([j.parsed for j in tests], dtype=bool)
  return gt, passes, valid, tests


def unit_test_examples(
    trajectories: Sequence[structs.Trajectory],
    judgments: Sequence[structs.Judgment],
    config,
    exclude: Collection[Group],
) -> tuple[list[structs.Example], list[structs.Example], dict[str, float]]:
  """Policy and RM examples of the coding setting.

  Policy: A = z-score over the group's programs of `policy_rewards` (the GT
  pass ratio, or with config.unit_test_reward='integrated' plus lam times
  the share of correct-looking RM tests passed), for groups the policy
  filter keeps. RM: A = z-score over the group's tests of `rm_rewards`, for
  groups in the RM band that have a correct program. Zero advantages are
  dropped (the authors keep them in coding; they carry no policy gradient).
  """
  stats = dict.fromkeys(('groups_used', 'groups_filtered', 'groups_excluded',
                         'dropped_zero', 'rm_groups_used', 'rm_no_correct',
                         'rm_unrun', 'rm_dropped_zero'), 0)
  accuracy = task_accuracy(trajectories)
  by_group = {}
  for j in judgments:
    by_group.setdefault(j.group, []).append(j)
  keep, rm_keep = policy_filter(config), band(config.rm_acc_low,
                                               config.rm_acc_high)
  policy, rm = [], []
  for group, trajs in _by_group(_ok(trajectories)).items():
    if group in exclude:
      stats['groups_excluded'] += 1
      continue
    found = group_tests(trajs, by_group.get(group, ()))
    if keep(accuracy[group]):
      stats['groups_used'] += 1
      gt = np.array([t.info['gt_ratio'] for t in trajs], dtype=float)
      if config.unit_test_reward == 'integrated' and found and found[3]:
        rewards = policy_rewards(gt, found[1], found[2], mode='integrated',
                                 lam=config.lam)
      else:  # 'gt', or no RM tests ran for this group
        rewards = policy_rewards(gt, mode='gt')
      _keep_nonzero([t.steps[0] for t in trajs],
                    [t.step_key(0) for t in trajs],
                    zscore(rewards, config.eps), config.eps, policy, stats)
    else:
      stats['groups_filtered'] += 1
    if not rm_keep(accuracy[group]) or group not in by_group:
      continue
    if found is None:
      stats['rm_unrun'] += 1
      continue
    gt, passes, valid, tests = found
    rewards = rm_rewards(gt >= 1.0, passes, valid)
    if rewards is None:
      stats['rm_no_correct'] += 1
      continue
    stats['rm_groups_used'] += 1
    counts = {'dropped_zero': 0}
    _keep_nonzero(tests, [(*group, 'test', j.sample) for j in tests],
                  zscore(rewards, config.eps), config.eps, rm, counts)
    stats['rm_dropped_zero'] += counts['dropped_zero']
  stats['examples'], stats['rm_examples'] = len(policy), len(rm)
  return policy, rm, stats


def unit_test_metrics(trajectories: Sequence[structs.Trajectory],
                      judgments: Sequence[structs.Judgment]
                      ) -> dict[str, float]:
  """rm/ut_accuracy, rm/detect (5.7) and judge/parse_fail_rate."""
  by_group = {}
  for j in judgments:
    by_group.setdefault(j.group, []).append(j)
  per_task = []
  for group, trajs in _by_group(_ok(trajectories)).items():
    found = group_tests(trajs, by_group.get(group, ()))
    if found is not None and found[3]:
      gt, passes, valid, _ = found
      per_task.append(ut_metrics(gt >= 1.0, passes, valid))
  out = aggregate_ut_metrics(per_task)
  out['judge/parse_fail_rate'] = _mean(not j.parsed for j in judgments)
  return out
