"""The environment curator: task pool, rewrite triggers, critiques, acceptance.

Host-side Python over `list[structs.Task]` (RLANYTHING.md 3.2, 3.7, 4.5, 5.8).
Functions return new pools and never modify their inputs. No JAX here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
import copy
import dataclasses
import json
import os
import re
from typing import Any, NamedTuple

from absl import logging
import numpy as np

from rla_jax import boxed
from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base

Group = tuple[str, str]
Accuracy = Mapping[Group, float | None]

ACTIVE = 'active'
PENDING = 'pending'
_BAND_TOL = 1e-9  # slack on inclusive thresholds, so that 0.8 equals 4/5

CRITIQUE_TEMPLATE = """\
An AI agent attempted the task below and failed. Review its attempt.

Task:
{task}

Trajectory ({num_steps} steps):
{trajectory}

High-risk steps (every reward-model judgment scored them -1): {risky}
{reasons}
In at most two sentences, explain why the agent failed and what it should \
have done instead. Put the explanation inside \\boxed{{}}."""


class BatchItem(NamedTuple):
  """One task version to roll out this epoch."""

  task_id: str
  spec: dict[str, Any]
  source: str  # ACTIVE or PENDING


def build_pool(specs: Iterable[Mapping[str, Any]]) -> list[structs.Task]:
  """One slot per source task: root = active = spec, version 0."""
  pool = []
  for spec in specs:
    spec = copy.deepcopy(dict(spec))
    pool.append(structs.Task(task_id=str(spec['id']), root=spec,
                             active=copy.deepcopy(spec)))
  ids = [t.task_id for t in pool]
  if len(set(ids)) != len(ids):
    raise ValueError('task ids are not unique')
  return pool


def sample_batch(pool: Sequence[structs.Task], num_tasks: int,
                 order: Iterator[int]) -> list[BatchItem]:
  """`num_tasks` distinct non-pending slots drawn from `order` + all pending.

  `order` yields slot indices (the loop feeds an endless, seeded, per-pass
  reshuffled grain stream whose position is checkpointed, so every slot is
  visited once per pass and a resumed run draws the same batches). Pending
  and repeated slots are skipped. Active items come first in drawn order,
  then the pending rewrites in pool order. Fewer free slots than `num_tasks`
  -> all of them.
  """
  free = {i for i, t in enumerate(pool) if t.pending is None}
  want = min(num_tasks, len(free))
  chosen: list[int] = []
  while len(chosen) < want:
    i = int(next(order))
    if i in free and i not in chosen:
      chosen.append(i)
  batch = [BatchItem(pool[i].task_id, copy.deepcopy(pool[i].active), ACTIVE)
           for i in chosen]
  batch += [BatchItem(t.task_id, copy.deepcopy(t.pending.spec), PENDING)
            for t in pool if t.pending is not None]
  return batch


def triggers(pool: Sequence[structs.Task], accuracy: Accuracy,
             alpha_low: float, alpha_high: float, *,
             easier_strict: bool = False) -> dict[str, str]:
  """task_id -> HARDER if acc >= alpha_high, EASIER if acc <= alpha_low
  (acc < alpha_low with `easier_strict`: the authors' coding trigger, 5.8,
  where AlfWorld and OSWorld fire at the edge too).

  Only slots without a pending rewrite and with a measured active group.
  """
  fired = {}
  for task in pool:
    acc = accuracy.get((task.task_id, ACTIVE))
    if task.pending is not None or acc is None:
      continue
    if acc >= alpha_high - _BAND_TOL:
      fired[task.task_id] = structs.HARDER
    elif (acc < alpha_low - _BAND_TOL if easier_strict
          else acc <= alpha_low + _BAND_TOL):
      fired[task.task_id] = structs.EASIER
  return fired


def accept(direction: str, acc_old: float, acc_new: float, alpha_low: float,
           alpha_high: float) -> bool:
  """Acceptance of a measured rewrite (inclusive band edges, as the authors).

  HARDER: acc_new > 0 and alpha_low <= acc_new < acc_old.
  EASIER: acc_new > 0 and acc_old < acc_new <= alpha_high.
  """
  if acc_new <= 0:
    return False
  if direction == structs.HARDER:
    return alpha_low - _BAND_TOL <= acc_new < acc_old
  if direction == structs.EASIER:
    return acc_old < acc_new <= alpha_high + _BAND_TOL
  raise ValueError(f'unknown direction {direction!r}')


def _event(task: structs.Task, epoch: int, acc_new: float | None,
           accepted: bool, reason: str, version: int) -> dict[str, Any]:
  """The lineage record of a decision on the slot's pending rewrite."""
  pending = task.pending
  return {
      'task_id': task.task_id, 'epoch': epoch, 'created_epoch': pending.epoch,
      'direction': pending.direction, 'acc_old': pending.acc_old,
      'acc_new': acc_new, 'accepted': accepted, 'reason': reason,
      'version': version, 'spec': copy.deepcopy(pending.spec),
      'critiques': list(pending.critiques), 'origin': pending.origin,
  }


def judge_pending(
    pool: Sequence[structs.Task], accuracy: Accuracy, epoch: int, config
) -> tuple[list[structs.Task], list[dict[str, Any]], dict[str, float]]:
  """Accepts or rejects last epoch's rewrites from their measured accuracy.

  acc_new is the accuracy of the group (task_id, 'pending'). Accepted ->
  active = rewrite, version + 1; rejected -> dropped. A rewrite that has no
  accuracy (all its rollouts errored, or it was not rolled out) stays pending
  and is dropped after `config.pending_max_tries` such epochs. Every decision
  appends a lineage event to the slot's history.

  Returns (pool, events, stats); events carry 'task_id', 'origin' and
  'reason' in {'accepted', 'rejected', 'unmeasured'}. `curator/accepted`
  counts the environment LLM's rewrites only, `curator/accepted_fallback`
  those a setting's generator made (structs.Rewrite.origin);
  `curator/rejected` and `dropped_unmeasured` count both.
  """
  new_pool, events = [], []
  undecided = 0
  for task in pool:
    pending = task.pending
    if pending is None:
      new_pool.append(task)
      continue
    acc_new = accuracy.get((task.task_id, PENDING))
    if acc_new is None:
      tries = pending.unmeasured + 1
      if tries < config.pending_max_tries:
        undecided += 1
        pending = dataclasses.replace(pending, unmeasured=tries)
        new_pool.append(dataclasses.replace(task, pending=pending))
        continue
      accepted, reason = False, 'unmeasured'
    else:
      accepted = accept(pending.direction, pending.acc_old, acc_new,
                        config.alpha_low, config.alpha_high)
      reason = 'accepted' if accepted else 'rejected'
    version = task.version + 1 if accepted else task.version
    event = _event(task, epoch, acc_new, accepted, reason, version)
    events.append(event)
    new_pool.append(dataclasses.replace(
        task, active=copy.deepcopy(pending.spec) if accepted else task.active,
        version=version, history=[*task.history, event], pending=None))
  taken = [e['origin'] for e in events if e['reason'] == 'accepted']
  stats = {
      'curator/accepted': sum(o != structs.FALLBACK for o in taken),
      'curator/accepted_fallback': sum(o == structs.FALLBACK for o in taken),
      'curator/rejected': sum(e['reason'] == 'rejected' for e in events),
      'curator/dropped_unmeasured': sum(
          e['reason'] == 'unmeasured' for e in events),
      'curator/undecided': undecided,
  }
  return new_pool, events, stats


def discard_pending(
    pool: Sequence[structs.Task], epoch: int
) -> tuple[list[structs.Task], list[dict[str, Any]]]:
  """Drops every pending rewrite undecided (the curator is switched off).

  Without this, a run resumed with the curator disabled (or an ablation
  started from a full run's workdir) would roll out and train on rewrites
  that no one ever accepts or rejects. Each one leaves a 'discarded' event.
  """
  new_pool, events = [], []
  for task in pool:
    if task.pending is None:
      new_pool.append(task)
      continue
    event = _event(task, epoch, None, False, 'discarded', task.version)
    events.append(event)
    new_pool.append(dataclasses.replace(
        task, history=[*task.history, event], pending=None))
  return new_pool, events


def rejected_groups(events: Iterable[Mapping[str, Any]]) -> set[Group]:
  """Groups of rewrites that were measured and rejected (not to be trained)."""
  return {(e['task_id'], PENDING) for e in events if e['reason'] == 'rejected'}


def high_risk_steps(traj: structs.Trajectory,
                    judgments: Iterable[structs.Judgment]) -> list[int]:
  """Indices of the steps of `traj` whose judgments all scored -1."""
  scores = {}
  for j in judgments:
    if j.step_key == traj.step_key(j.step):
      scores.setdefault(j.step, []).append(structs.score(j))
  return sorted(k for k, s in scores.items() if s and all(x == -1 for x in s))


def rationale(judgments: Iterable[structs.Judgment], k: int) -> str:
  """The first RM answer that scored step `k` as -1 ('' if none)."""
  for j in sorted(judgments, key=lambda j: j.sample):
    if j.step == k and structs.score(j) == -1:
      return j.response.strip()
  return ''


def _clip(text: str, max_chars: int) -> str:
  text = ' '.join(text.split())
  return text if len(text) <= max_chars else text[:max_chars - 3] + '...'


def critique_prompt(description: str, traj: structs.Trajectory,
                    risky: Sequence[int],
                    judgments: Sequence[structs.Judgment] = (),
                    max_chars: int = 300,
                    observation_chars: int = 0) -> str:
  """Prompt asking the environment LLM why a rollout failed (steps 1-based).

  Each step's observation is clipped to `observation_chars` (0: whole). For
  every high-risk step it also shows the agent's response and one RM
  rationale for the -1, each clipped to `max_chars`. The trajectory and
  those reasons are the prompt's cuttable middle (truncation.cuttable): an
  over-long prompt loses its oldest steps, never the task or the question.
  """
  lines = []
  for i, step in enumerate(traj.steps, start=1):
    observation = (_clip(step.observation, observation_chars)
                   if observation_chars else step.observation)
    lines.append(f'Step {i}\n  action: {step.action}\n'
                 f'  observation: {observation}')
  reasons = []
  for k in risky:
    reasons.append(
        f'Step {k + 1}\n  agent: {_clip(traj.steps[k].response, max_chars)}\n'
        '  reward model: '
        f'{_clip(rationale(judgments, k), max_chars) or "(no reason)"}')
  return CRITIQUE_TEMPLATE.format(
      task=description, num_steps=len(traj.steps),
      trajectory=truncation.cuttable('\n'.join(lines)) or '(no steps)',
      risky=', '.join(str(k + 1) for k in risky) or 'none',
      reasons=truncation.cuttable(
          'What the agent said there, and why the reward model objected:\n'
          + '\n'.join(reasons) + '\n') if reasons else '')


def parse_critique(text: str) -> str:
  """Content of the last brace-balanced \\boxed{} in `text`, '' if none."""
  return (boxed.last_boxed(text) or '').strip()


def critiques(
    pool: Sequence[structs.Task], fired: Mapping[str, str], env,
    trajectories: Sequence[structs.Trajectory],
    judgments: Sequence[structs.Judgment], generate: base.GenerateFn,
    max_chars: int = 300, observation_chars: int = 0
) -> tuple[dict[str, list[str]], dict[str, float]]:
  """Critiques of the failed active rollouts of fired tasks, one LLM call.

  Returns task_id -> non-empty critiques (rollout order) and stats.
  """
  by_id = {t.task_id: t for t in pool}
  failed = [t for t in trajectories
            if t.source == ACTIVE and t.task_id in fired
            and t.status != structs.ERROR and t.outcome < 0]
  judged = [j for j in judgments if j.source == ACTIVE and j.task_id in fired]
  prompts = []
  for t in failed:
    own = [j for j in judged if j.step_key == t.step_key(j.step)]
    prompts.append(critique_prompt(env.describe(by_id[t.task_id].active), t,
                                   high_risk_steps(t, own), own, max_chars,
                                   observation_chars))
  stats = {'curator/critiques': 0, 'curator/critique_parse_fail': 0,
           'curator/critique_errors': 0}
  out = {task_id: [] for task_id in fired}
  if not prompts:
    return out, stats
  try:
    texts = list(generate(prompts))
    if len(texts) != len(prompts):
      raise ValueError(f'{len(texts)} completions for {len(prompts)} prompts')
  except Exception:  # pylint: disable=broad-exception-caught
    logging.exception('critique generation failed; rewriting without them')
    stats['curator/critique_errors'] = len(prompts)
    return out, stats
  for traj, text in zip(failed, texts):
    critique = parse_critique(text)
    if critique:
      out[traj.task_id].append(critique)
      stats['curator/critiques'] += 1
    else:
      stats['curator/critique_parse_fail'] += 1
  return out, stats


def request_rewrites(
    pool: Sequence[structs.Task], env,
    trajectories: Sequence[structs.Trajectory],
    judgments: Sequence[structs.Judgment], accuracy: Accuracy,
    generate: base.GenerateFn, epoch: int, config
) -> tuple[list[structs.Task], dict[str, float]]:
  """Asks the environment to rewrite fired tasks; successes become pending.

  Any exception from `env.rewrite` (RewriteRejected or other) is counted and
  logged and leaves the slot without a pending rewrite, as does a rewrite
  equal to the active spec.

  Counts: `curator/created` the environment LLM's rewrites,
  `curator/created_fallback` those the setting's generator made when no
  proposal was valid (the spec carried base.FALLBACK_KEY; the pending
  rewrite keeps the origin for its acceptance). `curator/rewrite_rejected`
  counts requests that ended in RewriteRejected; `curator/rejected_<reason>`
  the proposals the hook turned down, per reason key (request.rejected),
  whatever became of the request, or the request's RewriteRejected.reason
  when the hook itemised none.
  """
  fired = triggers(pool, accuracy, config.alpha_low, config.alpha_high,
                   easier_strict=config.easier_strict)
  if config.critiques:
    notes, stats = critiques(pool, fired, env, trajectories, judgments,
                             generate, config.critique_max_chars,
                             config.critique_observation_chars)
  else:
    notes, stats = {task_id: [] for task_id in fired}, {}
  stats.update({
      'curator/triggered_harder': sum(
          d == structs.HARDER for d in fired.values()),
      'curator/triggered_easier': sum(
          d == structs.EASIER for d in fired.values()),
      'curator/requested': 0, 'curator/created': 0,
      'curator/created_fallback': 0, 'curator/rewrite_rejected': 0,
      'curator/rewrite_errors': 0, 'curator/rewrite_unchanged': 0,
  })
  new_pool = []
  for task in pool:
    direction = fired.get(task.task_id)
    if direction is None:
      new_pool.append(task)
      continue
    stats['curator/requested'] += 1
    request = base.RewriteRequest(
        spec=copy.deepcopy(task.active), root=copy.deepcopy(task.root),
        direction=direction,
        acc_old=float(accuracy[(task.task_id, ACTIVE)]),
        critiques=list(notes[task.task_id]),
        trajectories=[t for t in trajectories
                      if (t.task_id, t.source) == (task.task_id, ACTIVE)],
        judgments=[j for j in judgments
                   if (j.task_id, j.source) == (task.task_id, ACTIVE)])
    spec, origin = _rewrite(env, task, request, generate,
                            config.rewrite_attempts, stats)
    for reason in request.rejected:
      key = f'curator/rejected_{reason_key(reason)}'
      stats[key] = stats.get(key, 0) + 1
    if spec is None:
      new_pool.append(task)
      continue
    stats['curator/created' if origin == structs.LLM else
          'curator/created_fallback'] += 1
    pending = structs.Rewrite(
        spec=spec, direction=direction, acc_old=request.acc_old, epoch=epoch,
        critiques=list(notes[task.task_id]), origin=origin)
    new_pool.append(dataclasses.replace(task, pending=pending))
  stats['curator/rewrite_failures'] = (stats['curator/rewrite_rejected'] +
                                       stats['curator/rewrite_errors'])
  return new_pool, stats


def reason_key(reason: str) -> str:
  """A rejection reason as a metric-name part: snake case, 'other' if empty."""
  key = re.sub(r'[^0-9a-z]+', '_', str(reason).lower()).strip('_')
  return key or base.OTHER


def _rewrite(env, task, request, generate, attempts, stats):
  """env.rewrite with every failure counted: (new spec or None, origin).

  The origin is structs.FALLBACK when the hook marked the spec with
  base.FALLBACK_KEY (taken off the returned copy), else structs.LLM.
  """
  direction = request.direction
  try:
    spec = env.rewrite(request, generate, attempts=attempts)
  except base.RewriteRejected as e:
    logging.info('rewrite of %s (%s) rejected: %s', task.task_id, direction, e)
    stats['curator/rewrite_rejected'] += 1
    if not request.rejected:  # the hook did not itemise its proposals
      request.rejected.append(getattr(e, 'reason', base.OTHER))
    return None, None
  except Exception:  # pylint: disable=broad-exception-caught
    logging.exception('rewrite hook failed for %s (%s)', task.task_id,
                      direction)
    stats['curator/rewrite_errors'] += 1
    return None, None
  if not isinstance(spec, dict):
    logging.error('rewrite of %s returned %s, not a dict', task.task_id,
                  type(spec).__name__)
    stats['curator/rewrite_errors'] += 1
    return None, None
  spec = copy.deepcopy(spec)
  generator = spec.pop(base.FALLBACK_KEY, None)
  if spec == task.active:
    stats['curator/rewrite_unchanged'] += 1
    return None, None
  if generator is not None:
    logging.info('rewrite of %s (%s) made by the fallback generator %r',
                 task.task_id, direction, generator)
    return spec, structs.FALLBACK
  return spec, structs.LLM


def metrics(pool: Sequence[structs.Task], env) -> dict[str, float]:
  """Pool-level metrics: size, pending, versions, active difficulty.

  `accepted_total` counts the environment LLM's accepted rewrites in the
  pool's lineage, `accepted_fallback_total` the fallback generator's.
  """
  accepted = [e.get('origin', structs.LLM) for t in pool for e in t.history
              if e['accepted']]
  return {
      'curator/pool_size': len(pool),
      'curator/pending': sum(t.pending is not None for t in pool),
      'curator/mean_version': _mean(t.version for t in pool),
      'curator/accepted_total': sum(o != structs.FALLBACK for o in accepted),
      'curator/accepted_fallback_total': sum(
          o == structs.FALLBACK for o in accepted),
      'curator/pool_difficulty': _mean(env.difficulty(t.active) for t in pool),
  }


def task_to_dict(task: structs.Task) -> dict[str, Any]:
  return dataclasses.asdict(task)


def task_from_dict(data: Mapping[str, Any]) -> structs.Task:
  data = copy.deepcopy(dict(data))
  if data['pending'] is not None:
    data['pending'] = structs.Rewrite(**data['pending'])
  return structs.Task(**data)


def save_jsonl(pool: Sequence[structs.Task], path: str) -> None:
  """One Task per line (pending rewrite included); atomic (write + rename)."""
  tmp = f'{path}.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for task in pool:
      f.write(json.dumps(task_to_dict(task), ensure_ascii=False) + '\n')
    # On disk before the rename, so a crash never leaves a truncated pool.
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def load_jsonl(path: str) -> list[structs.Task]:
  with open(path, encoding='utf-8') as f:
    return [task_from_dict(json.loads(line)) for line in f if line.strip()]


def state(pool: Sequence[structs.Task]) -> list[dict[str, Any]]:
  """JSON-able checkpoint of the pool."""
  return [task_to_dict(t) for t in pool]


def from_state(data: Sequence[Mapping[str, Any]]) -> list[structs.Task]:
  """Inverse of `state`."""
  return [task_from_dict(t) for t in data]


def _mean(values: Iterable[float]) -> float:
  values = [float(v) for v in values]
  return float(np.mean(values)) if values else float('nan')
