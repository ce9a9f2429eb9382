"""Policy rollouts: G episodes per task, stepped concurrently on the host.

Every turn, all live episodes are rendered and sampled in ONE sampler batch;
the environments then step in a thread pool. An environment exception marks
that trajectory `error` (excluded from training, counted, logged) and never
stops the epoch.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from rla_jax import chat
from rla_jax import metrics
from rla_jax import structs

# (task_id, spec, source) as handed out by the curator.
TaskRef = tuple[str, dict[str, Any], str]
# messages batch -> one completion per conversation
PolicyFn = Callable[[Sequence[Sequence[dict]], int], list[chat.Completion]]


def _fail(traj: structs.Trajectory, exc: BaseException):
  traj.status = structs.ERROR
  traj.error = f'{type(exc).__name__}: {exc}'
  logging.warning('environment error in %s/%s rollout %d: %s\n%s',
                  traj.task_id, traj.source, traj.rollout, traj.error,
                  ''.join(traceback.format_exception(exc)[-3:]))


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

  def start(i):
    episodes[i] = env.make_episode(trajs[i].spec, seed * 1_000_003 + i,
                                   max_turns)
    return episodes[i].reset()

  live = []
  for i, fut in enumerate([pool.submit(start, i) for i in range(len(trajs))]):
    try:
      observations[i] = fut.result()
      live.append(i)
    except Exception as exc:  # pylint: disable=broad-except
      _fail(trajs[i], exc)

  turns: list[list[tuple[str, str]]] = [[] for _ in trajs]
  for turn in metrics.progress(range(max_turns), desc='rollout turns'):
    if not live:
      break
    messages = [env.policy_messages(trajs[i].spec, turns[i], observations[i])
                for i in live]
    completions = policy(messages, seed * 7919 + turn)
    actions = [env.parse_action(c.text, observations[i])
               for i, c in zip(live, completions)]
    results = [pool.submit(episodes[i].step, a) for i, a in zip(live, actions)]
    still_live = []
    for i, c, action, fut in zip(live, completions, actions, results):
      try:
        observation, done, outcome = fut.result()
      except Exception as exc:  # pylint: disable=broad-except
        _fail(trajs[i], exc)
        continue
      trajs[i].steps.append(structs.Step(
          prompt=c.prompt, prompt_tokens=c.prompt_tokens, response=c.text,
          response_tokens=c.tokens, logprobs=c.logprobs, action=action,
          observation=observation, finish_reason=c.finish_reason,
          prompt_cut=c.prompt_cut))
      turns[i].append((observations[i], action))
      observations[i] = observation
      if done:
        trajs[i].outcome = 1.0 if (outcome or -1.0) > 0 else -1.0
      else:
        still_live.append(i)
    live = still_live
  for i in live:  # ran out of turns without a verdict: a failure
    trajs[i].outcome = -1.0
  for traj, episode in zip(trajs, episodes):
    if episode is not None and traj.status == structs.OK:
      traj.info = dict(getattr(episode, 'info', None) or {})
  for episode in episodes:
    if episode is not None:
      try:
        episode.close()
      except Exception:  # pylint: disable=broad-except
        logging.exception('episode.close() failed')
  return trajs

