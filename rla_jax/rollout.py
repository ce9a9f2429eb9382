"""Policy rollouts: G episodes per task, stepped concurrently on the host.

Every turn, all live episodes are rendered and sampled in ONE sampler batch;
the environments then step in a thread pool. An environment exception marks
that trajectory `error` (excluded from training, counted, logged) and never
stops the epoch.

Each turn's messages are a `chat.Turn`: the environment's prompt with the
whole history (rendered and prefilled again every turn, the default), which
with sampling.session='kv' is instead continued as a chat held in the
sampler's KV cache (the environment's optional `turn_messages(spec,
observation, first)` gives the messages one turn adds). Either way each
Step records the exact prompt tokens and response the model saw.

Multi-host: the sampler is one program over the global mesh (every process
calls it with the same prompts), while episode i lives on the process that
owns it (`distributed.owns(i)`): only that process resets and steps it, and
the results of all episodes are gathered after every turn, so every process
ends with the same trajectories.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from rla_jax import chat
from rla_jax import distributed
from rla_jax import metrics
from rla_jax import structs
from rla_jax.envs import base

# (task_id, spec, source) as handed out by the curator.
TaskRef = tuple[str, dict[str, Any], str]
# (messages batch, seed[, min_temperature=]) -> one completion per
# conversation; min_temperature raises the sampling temperature to at least
# that (retries of unparseable turns).
PolicyFn = Callable[..., list[chat.Completion]]


class _Failed:
  """An environment exception, as it travels between processes."""

  def __init__(self, exc: BaseException):
    self.error = f'{type(exc).__name__}: {exc}'
    self.trace = ''.join(traceback.format_exception(exc)[-3:])


def _fail(traj: structs.Trajectory, failed: _Failed):
  traj.status = structs.ERROR
  traj.error = failed.error
  logging.warning('environment error in %s/%s rollout %d: %s\n%s',
                  traj.task_id, traj.source, traj.rollout, traj.error,
                  failed.trace)


def _on_owners(pool: futures.Executor, fn, items: dict[int, Any]):
  """{i: fn(items[i]) or _Failed} for every i, each run by its owner.

  This process runs its own items in the thread pool; the others' results
  arrive by one gather (nothing is exchanged with one process).
  """
  mine = {i: pool.submit(fn, i, x) for i, x in items.items()
          if distributed.owns(i)}
  results = {}
  for i, fut in mine.items():
    try:
      results[i] = fut.result()
    except Exception as exc:  # pylint: disable=broad-except
      results[i] = _Failed(exc)
  return distributed.gather_owned(results)


def _turn_messages(env, spec, observation, first):
  """The messages a turn adds to a held conversation (sessions only)."""
  hook = getattr(env, 'turn_messages', None)
  if hook is None:
    raise ValueError(f'sampling.session=\'kv\' needs an environment with '
                     f'turn_messages(); {type(env).__name__} has none')
  return hook(spec, observation, first)


def _parsed(env, policy: PolicyFn, messages, completions, observations,
            seed: int):
  """(completions, actions, retries per row) of one turn's live rows.

  A response the environment cannot parse (base.Unparseable) is sampled
  again from the same messages, re-rendered, up to env.parse_retries times
  at a temperature of at least env.retry_temperature (the authors' GUI
  agent: 5 retries at >= 0.2); when they run out the row executes the
  exception's fallback, an action the episode records as invalid. Every
  process parses every row, so all agree on which rows retry.
  """
  retries = getattr(env, 'parse_retries', 0)
  completions, actions = list(completions), [None] * len(completions)
  used, failures, pending = [0] * len(completions), {}, range(len(completions))
  for attempt in range(retries + 1):
    if attempt:
      again = policy([list(messages[j]) for j in pending],
                     seed * 31 + attempt,
                     min_temperature=getattr(env, 'retry_temperature', 0.0))
      for j, c in zip(pending, again):
        completions[j], used[j] = c, attempt
    still = []
    for j in pending:
      try:
        actions[j] = env.parse_action(completions[j].text, observations[j])
      except base.Unparseable as e:
        failures[j] = e
        still.append(j)
    pending = still
    if not pending:
      break
  for j in pending:
    actions[j] = failures[j].fallback
  return completions, actions, used


def run(env, tasks: Sequence[TaskRef], *, group_size: int,
        policy: PolicyFn, pool: futures.Executor, seed: int,
        max_turns: int) -> list[structs.Trajectory]:
  """Rolls out every task `group_size` times; returns all trajectories."""
  trajs, episodes, observations = [], [], []
  for task_id, spec, source in tasks:
    for g in range(group_size):
      trajs.append(structs.Trajectory(task_id=task_id, source=source,
                                      rollout=g, spec=spec))
      episodes.append(None)
      observations.append('')

  def start(i, spec):
    episodes[i] = env.make_episode(spec, seed * 1_000_003 + i, max_turns)
    return episodes[i].reset()

  live = []
  started = _on_owners(pool, start, {i: t.spec for i, t in enumerate(trajs)})
  for i in range(len(trajs)):
    if isinstance(started[i], _Failed):
      _fail(trajs[i], started[i])
    else:
      observations[i] = started[i]
      live.append(i)

  turns: list[list[tuple[str, str]]] = [[] for _ in trajs]
  state = chat.ChatState()
  for turn in metrics.progress(range(max_turns), desc='rollout turns'):
    if not live:
      break
    messages = [chat.Turn(
        env.policy_messages(trajs[i].spec, turns[i], observations[i]),
        state=state, row=i,
        chat=functools.partial(_turn_messages, env, trajs[i].spec,
                               observations[i], turn == 0))
                for i in live]
    completions, actions, retries = _parsed(
        env, policy, messages, policy(messages, seed * 7919 + turn),
        [observations[i] for i in live], seed * 7919 + turn)
    results = _on_owners(pool, lambda i, a: episodes[i].step(a),
                         dict(zip(live, actions)))
    still_live = []
    for i, c, action, retried in zip(live, completions, actions, retries):
      if isinstance(results[i], _Failed):
        _fail(trajs[i], results[i])
        continue
      observation, done, outcome = results[i]
      trajs[i].steps.append(structs.Step(
          prompt=c.prompt, prompt_tokens=c.prompt_tokens, response=c.text,
          response_tokens=c.tokens, logprobs=c.logprobs, action=action,
          observation=observation, finish_reason=c.finish_reason,
          prompt_cut=c.prompt_cut, images=c.images, retries=retried))
      turns[i].append((observations[i], action))
      observations[i] = observation
      if done:
        trajs[i].outcome = 1.0 if (outcome or -1.0) > 0 else -1.0
      else:
        still_live.append(i)
    live = still_live
  for i in live:  # ran out of turns without a verdict: a failure
    trajs[i].outcome = -1.0
  infos = distributed.gather_owned({
      i: dict(getattr(episode, 'info', None) or {})
      for i, episode in enumerate(episodes) if episode is not None})
  for i, traj in enumerate(trajs):
    if i in infos and traj.status == structs.OK:
      traj.info = infos[i]
  for episode in episodes:
    if episode is not None:
      try:
        episode.close()
      except Exception:  # pylint: disable=broad-except
        logging.exception('episode.close() failed')
  return trajs


def win_rate(ok_trajs) -> float:
  """Fraction of (non-error) rollouts that succeeded; NaN when none."""
  return (float(np.mean([t.outcome > 0 for t in ok_trajs])) if ok_trajs
          else float('nan'))


def cut_frac(items) -> float:
  """Fraction of steps / judgments whose prompt was cut (NaN for none)."""
  items = list(items)
  return (float(np.mean([i.prompt_cut for i in items])) if items
          else float('nan'))


def batch_metrics(trajs, accuracy, seconds: float) -> dict[str, float]:
  """The rollout/* metrics of one rollout stage: `trajs` it made in
  `seconds`, and the groups' accuracies (feedback.task_accuracy)."""
  ok = [t for t in trajs if t.status == structs.OK]
  steps = [s for t in ok for s in t.steps]
  measured = [a.accuracy for a in accuracy.values() if a.accuracy is not None]
  return {
      'rollout/accuracy': win_rate(ok),
      'rollout/task_accuracy_mean': float(np.mean(measured))
                                    if measured else float('nan'),
      'rollout/trajectories': len(trajs),
      'rollout/errors': sum(t.status == structs.ERROR for t in trajs),
      'rollout/turns_mean': float(np.mean([len(t.steps) for t in ok]))
                            if ok else 0.0,
      'rollout/response_tokens_mean': float(np.mean(
          [len(s.response_tokens) for s in steps])) if steps else 0.0,
      'rollout/truncated_frac': float(np.mean(
          [s.finish_reason == 'length' for s in steps])) if steps else 0.0,
      'rollout/prompt_cut_frac': cut_frac(steps),
      'rollout/parse_retries': sum(s.retries for s in steps),
      'rollout/tokens_per_s': sum(len(s.response_tokens) for t in trajs
                                  for s in t.steps) / max(seconds, 1e-9),
  }
