"""One RLAnything run; `_epoch` is the only code that orders the stages.

epoch: policy rollouts (sampled tasks + last epoch's rewrites) -> RM
judgments -> acceptance of last epoch's rewrites from their rollouts ->
critiques and new rewrites -> feedback -> policy update -> RM update ->
(periodic) evaluation on held-out splits -> checkpoint.

A SIGTERM/SIGINT stops the run at the next stage boundary (`_Timer`, and
before evaluation and checkpoint) with a consistent checkpoint: what is kept at
each point is in rla_jax/preemption.py.

Resume: a workdir run with another experiment is refused, and a complete
run started again says so without loading a model (resume.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from rla_jax import chat
from rla_jax import checkpoint
from rla_jax import curator
from rla_jax import distributed
from rla_jax import feedback
from rla_jax import judge
from rla_jax import metrics
from rla_jax import preemption
from rla_jax import report
from rla_jax import resume
from rla_jax import reward_check
from rla_jax import rollout
from rla_jax import runtime
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train_epoch

SUMMARY_KEYS = ('rollout/accuracy', 'judge/parse_fail_rate', 'policy/loss',
                'policy/kl', 'rm/loss', 'curator/accepted', 'curator/rejected',
                'curator/pending', 'eval/*/accuracy', 'time/epoch_s')


def _seed(config, *keys: int) -> int:
  """A 31-bit seed from (config.seed, *keys), e.g. (epoch, stage, call)."""
  return int(np.random.SeedSequence([config.seed, *keys])
             .generate_state(1)[0] & 0x7FFFFFFF)


def _model(run: runtime.Run, name: str):
  """The NNX model viewing the run's current arrays (no copy)."""
  params = run.env_params if name == 'env_model' else run.states[name].params
  return nnx.merge(run.graphdefs[name], params)


def _sample_fn(run: runtime.Run, name: str, sampling) -> rollout.PolicyFn:
  """messages batch, seed -> one completion each, from model `name`."""

  def sample(messages, seed, min_temperature=0.0):
    section = sampling
    if section.temperature < min_temperature:
      section = ml_collections.ConfigDict(sampling.to_dict())
      section.temperature = min_temperature
    rows = chat.complete(_model(run, name), run.tokenizers[name], messages,
                         sampling=section, num_samples=1, seed=seed,
                         mesh=run.mesh, rules=run.rules)
    return [row[0] for row in rows]

  return sample


def _generate_fn(run: runtime.Run, epoch: int, cuts: list[int]):
  """The environment LLM as text -> text (critiques, rewrite proposals).

  `curator.answer_prefix` pre-fills each answer (small models then answer in
  the asked format); the returned text includes it. Every call draws its own
  random stream (the epoch's seed folded with a call counter), so attempt i
  of one task and of another are different samples. `cuts` accumulates
  [prompts, prompts cut].
  """
  sample = _sample_fn(run, 'env_model', run.config.curator.sampling)
  prefix = run.config.curator.answer_prefix
  tail = [{'role': 'assistant', 'content': prefix}] if prefix else []
  calls = itertools.count()

  def generate(prompts):
    completions = sample(
        [[{'role': 'user', 'content': p}, *tail] for p in prompts],
        _seed(run.config, epoch, 3, next(calls)))
    cuts[0] += len(completions)
    cuts[1] += sum(c.prompt_cut for c in completions)
    return [prefix + c.text for c in completions]

  return generate


class _Timer:
  """Times the stages of an epoch; entering one is a stop point."""

  def __init__(self, values: dict[str, float], epoch: int, chief: bool):
    self.values, self.epoch, self.chief = values, epoch, chief

  @contextlib.contextmanager
  def __call__(self, stage: str):
    stopper = preemption.current()
    if stopper is not None:  # may drop the epoch (raises Preempted)
      stopper.boundary(f'epoch {self.epoch}: {stage}')
    if self.chief:
      print(f'epoch {self.epoch}: {stage}', flush=True)
    start = time.perf_counter()
    yield
    self.values[f'time/{stage}_s'] = time.perf_counter() - start
    _stage_done(self.values, self.epoch, stage, self.chief)


def _stage_done(values: dict[str, float], epoch: int, stage: str,
                chief: bool, label: str = ''):
  """After timed stage `stage` (`time/<stage>_s`): free heap pages go back to
  the OS, the peak RSS is recorded, and (process 0) a line with the stage's
  time and that peak, named `label` (default: the stage)."""
  metrics.release_free_memory()
  rss = values['memory/peak_rss_gb'] = metrics.peak_rss_gb()
  seconds = values[f'time/{stage}_s']
  if chief and seconds >= 1:
    print(f'epoch {epoch}: {label or stage} done in {seconds:.0f} s (peak '
          f'RSS {rss:.1f} GB)', flush=True)


def _env_metrics(run: runtime.Run, trajs, prefix: str) -> dict[str, float]:
  """The setting's own metrics of a batch of rollouts (optional hook)."""
  metrics_fn = getattr(run.env, 'metrics', None)
  if metrics_fn is None:
    return {}
  return {prefix + k: v for k, v in metrics_fn(trajs).items()}


def _needs_judge(config) -> bool:
  return (config.feedback.lam != 0 or config.loop.train_rm
          or config.curator.enabled)


def _log_events(run: runtime.Run, epoch: int, events):
  for event in events:
    run.writer.text(epoch, 'curator/decisions', json.dumps(event))


def _epoch(run: runtime.Run, epoch: int) -> dict[str, float]:
  config = run.config
  values: dict[str, float] = {}
  timer = _Timer(values, epoch, run.chief)
  start = time.perf_counter()
  if not config.curator.enabled:
    # Nobody will decide pending rewrites (an ablation, or a resume with the
    # curator off): drop them instead of training on them forever.
    run.pool, events = curator.discard_pending(run.pool, epoch)
    values['curator/discarded'] = len(events)
    _log_events(run, epoch, events)

  with timer('rollout'):
    batch = curator.sample_batch(run.pool, config.rollout.num_tasks, run.order)
    trajs = rollout.run(
        run.env, batch, group_size=config.rollout.group_size,
        policy=_sample_fn(run, 'policy', config.rollout.sampling),
        pool=run.executor, seed=_seed(config, epoch, 1),
        max_turns=run.env.max_turns)
  accuracy = feedback.task_accuracy(trajs)
  acc = {g: a.accuracy for g, a in accuracy.items()}
  values.update(rollout.batch_metrics(trajs, accuracy,
                                      values['time/rollout_s']))
  values.update(_env_metrics(run, trajs, 'rollout/'))

  judgments = []
  if _needs_judge(config):
    with timer('judge'):
      judgments = judge.score(
          _model(run, 'reward_model'), run.tokenizers['reward_model'],
          run.env, trajs, mode=config.feedback.mode,
          num_samples=config.judge.num_samples,
          sampling=config.judge.sampling, seed=_seed(config, epoch, 2),
          mesh=run.mesh, rules=run.rules)
    values.update(feedback.rm_metrics(trajs, judgments,
                                      config.feedback.mode))
    values['judge/prompt_cut_frac'] = rollout.cut_frac(judgments)

  exclude = set()
  if config.curator.enabled:
    with timer('curator'):
      # Last epoch's rewrites were rolled out above: decide them first, then
      # ask for new ones (a rewrite is measured in the epoch after it is
      # made, never in the epoch that made it).
      run.pool, events, stats = curator.judge_pending(run.pool, acc, epoch,
                                                      config.curator)
      values.update(stats)
      exclude = curator.rejected_groups(events)
      _log_events(run, epoch, events)
      cuts = [0, 0]
      run.pool, stats = curator.request_rewrites(
          run.pool, run.env, trajs, judgments, acc,
          _generate_fn(run, epoch, cuts), epoch, config.curator)
      values.update(stats)
      values['curator/prompt_cut_frac'] = (cuts[1] / cuts[0] if cuts[0]
                                           else float('nan'))
  values.update(curator.metrics(run.pool, run.env))

  with timer('feedback'):
    policy_examples, rm_examples, stats = feedback.integrate(
        trajs, judgments, config.feedback, exclude)
    values.update(stats)

  with timer('policy_update'):
    run.states['policy'], stats = train_epoch.update(
        run.trainers['policy'], run.states['policy'], policy_examples,
        epoch=epoch, ref_params=run.ref_params.get('policy'))
    values.update({f'policy/{k}': v for k, v in stats.items()})
  if config.loop.train_rm:
    with timer('rm_update'):
      run.states['reward_model'], stats = train_epoch.update(
          run.trainers['reward_model'], run.states['reward_model'],
          rm_examples, epoch=epoch,
          ref_params=run.ref_params.get('reward_model'))
      values.update({f'rm/{k}': v for k, v in stats.items()})

  if run.chief:
    _log_samples(run, epoch, trajs, judgments, accuracy)
  values['time/epoch_s'] = time.perf_counter() - start
  return values


def _log_samples(run: runtime.Run, epoch: int, trajs, judgments, accuracy):
  writer = run.writer
  writer.histogram(epoch, 'rollout/task_accuracy',
                   [a.accuracy for a in accuracy.values()
                    if a.accuracy is not None])
  ok = [t for t in trajs if t.status == structs.OK and t.steps]
  for t in ok[:2]:
    text = '\n'.join(f'[{k}] {s.response!r} -> {s.observation!r}'
                     for k, s in enumerate(t.steps))
    writer.text(epoch, 'rollout/sample',
                f'{t.task_id} ({t.source}) O={t.outcome:+.0f}\n{text}')
  for j in judgments[:2]:
    writer.text(epoch, 'judge/sample', f'S={j.score}\n{j.response}')
  for t in trajs:
    if t.status == structs.ERROR:
      writer.text(epoch, 'rollout/error', f'{t.task_id}: {t.error}')
      break
  for task in run.pool:
    if task.pending is not None and task.pending.epoch == epoch:
      writer.text(epoch, 'curator/rewrites', json.dumps(
          {'task_id': task.task_id, 'direction': task.pending.direction,
           'acc_old': task.pending.acc_old, 'from': task.active,
           'to': task.pending.spec, 'critiques': task.pending.critiques}))


def _evaluate(run: runtime.Run, epoch: int) -> dict[str, float]:
  """Held-out accuracy per split (`eval/<split>/...`), and the RM on it.

  Each split in config.eval.splits is rolled out with the evaluation turn
  budget (config.eval.max_turns); with config.eval.judge the RM judges those
  rollouts too, so its outcome and process accuracy are measured on the
  evaluation tasks, as the paper reports them.
  """
  config = run.config
  values: dict[str, float] = {}
  if run.chief:
    print(f'epoch {epoch}: evaluation', flush=True)
  start = time.perf_counter()
  for i, split in enumerate(config.eval.splits):
    specs = run.env.tasks(split)[:config.eval.num_tasks]
    if not specs:
      continue
    trajs = rollout.run(
        run.env, [(s['id'], s, curator.ACTIVE) for s in specs],
        group_size=config.eval.group_size,
        policy=_sample_fn(run, 'policy', config.eval.sampling),
        pool=run.executor, seed=_seed(config, epoch, 9, i),
        max_turns=config.eval.max_turns)
    ok = [t for t in trajs if t.status == structs.OK]
    prefix = f'eval/{split}/'
    values.update({
        prefix + 'accuracy': rollout.win_rate(ok),
        prefix + 'episodes': len(ok),
        prefix + 'errors': len(trajs) - len(ok),
        prefix + 'prompt_cut_frac': rollout.cut_frac(
            s for t in ok for s in t.steps),
        **_env_metrics(run, trajs, prefix),
    })
    if config.eval.judge:
      judgments = judge.score(
          _model(run, 'reward_model'), run.tokenizers['reward_model'],
          run.env, trajs, mode=config.feedback.mode,
          num_samples=config.judge.num_samples,
          sampling=config.judge.sampling, seed=_seed(config, epoch, 10, i),
          mesh=run.mesh, rules=run.rules)
      values.update({prefix + k.replace('/', '_'): v for k, v in
                     feedback.rm_metrics(trajs, judgments,
                                         config.feedback.mode).items()})
  values['time/eval_s'] = time.perf_counter() - start
  _stage_done(values, epoch, 'eval', run.chief, 'evaluation')
  return values


def pool_digest(pool_state) -> str:
  """Short fingerprint of a pool state (logged on resume)."""
  blob = json.dumps(pool_state, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:12]


def _save_pool(run: runtime.Run, pool):
  if run.chief:
    curator.save_jsonl(pool, os.path.join(run.workdir, 'pool.jsonl'))


def _report(run: runtime.Run, epoch: int, values: dict[str, float]):
  """Epoch scalars to TensorBoard/JSONL and the summary line (process 0)."""
  if run.chief:
    run.writer.scalars(epoch, values)
    run.writer.flush()
    print(metrics.summary_line(epoch, values, SUMMARY_KEYS), flush=True)


def _stopped(run: runtime.Run, ckpt, stopper, resume_command: str):
  if run.chief:
    print(stopper.summary(ckpt.path(run.saved_epoch) if run.saved_epoch
                          else '', run.eval_pending, resume_command),
          flush=True)


def run(config, workdir: str, *, resume_command: str = '') -> dict[str, float]:
  """Trains for config.loop.num_epochs epochs (resuming if possible).

  Returns the last epoch's scalars; on SIGTERM/SIGINT it checkpoints and
  returns early, printing `resume_command`. One run per workdir (a lock).
  A workdir this call made is removed again when set-up fails (a bad data
  file, a missing model), so nothing half-made is left behind. A workdir
  run with another experiment (config.json) raises ConfigChangeError before
  anything is written; a complete run with no epochs left returns its last
  evaluation's scalars without loading a model.
  """
  runtime.validate(config)
  runtime.check_paths(config)
  preemption.check_keys(config)
  distributed.check_devices(config.mesh)
  chief = jax.process_index() == 0
  resume.check_config_change(config, workdir, chief)
  if chief:
    print(distributed.describe(), flush=True)
  made = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  with preemption.guard(workdir, config.loop.preempt_grace_s,
                        chief=chief) as stopper:
    # Process 0 decides, so every process takes the same path.
    done = distributed.broadcast(
        resume.complete(config, workdir) if chief else None)
    if done is not None:
      return resume.say_complete(config, workdir, done) if chief else {}
    if chief:  # from here on the workdir's run is not complete
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(workdir, resume.COMPLETE))
    if config.loop.compilation_cache_dir:
      # Restarts and later runs reuse compiled programs instead of recompiling.
      jax.config.update('jax_compilation_cache_dir',
                        os.path.expanduser(config.loop.compilation_cache_dir))
      jax.config.update('jax_persistent_cache_min_compile_time_secs',
                        config.loop.compilation_cache_min_s)
    try:
      state = runtime.setup(config, workdir)
      if config.loop.check_rewards:
        _check_rewards(state)
    except BaseException:
      if made and chief:
        shutil.rmtree(workdir, ignore_errors=True)
      raise
    # The lock is held, so unfinished saves in the folder are dead ones.
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                   config.loop.keep_checkpoints,
                                   clean_tmp=True)
    try:
      with sharding.use(state.mesh, state.rules):
        last = _epochs(state, ckpt, stopper, resume_command)
        _write_process_report(state)
        stopped = stopper.requested()  # on every process: a collective
        if state.chief and not stopped:
          print(report.write(workdir), flush=True)
          resume.write_complete(state, ckpt)
        return last
    finally:
      ckpt.close()
      state.writer.close()
      state.executor.shutdown()
      if hasattr(state.env, 'close'):  # e.g. desktops, sandboxes
        state.env.close()


def _check_rewards(run: runtime.Run):
  """The setting's known outcomes through its evaluator (reward_check.py);
  a wrong one stops the run before epoch 1, closing what set-up opened."""
  try:
    cases, seconds = reward_check.check(run.env, run.config.env.name)
  except BaseException:
    run.writer.close()
    run.executor.shutdown()
    if hasattr(run.env, 'close'):
      run.env.close()
    raise
  if run.chief and cases:
    print(f'reward check: {cases} known outcomes of {run.config.env.name!r} '
          f'right in {seconds:.1f} s', flush=True)


def _write_process_report(run: runtime.Run):
  """WORKDIR/process_<i>.json: what this process ended with.

  The pool digest and on-device checksums of both models' parameters; every
  process of a run must write the same values (launch/local.sh compares
  them).
  """
  summary = {
      'process': jax.process_index(), 'processes': jax.process_count(),
      'devices': jax.device_count(), 'epoch': run.saved_epoch,
      'pool_digest': pool_digest(curator.state(run.pool)),
      'steps': {n: int(s.step) for n, s in run.states.items()},
      'params': {n: distributed.checksum(s.params)
                 for n, s in run.states.items()},
      'param_stats': {n: distributed.param_stats(s.params)
                      for n, s in run.states.items()},
  }
  path = os.path.join(run.workdir, f'process_{jax.process_index()}.json')
  with open(path + '.tmp', 'w') as f:
    json.dump(summary, f, indent=1)
  os.replace(path + '.tmp', path)


def _epochs(state: runtime.Run, ckpt, stopper, resume_command: str):
  """Resume, then epochs until the last or a stop; returns the last scalars."""
  config = state.config
  latest = checkpoint.restore_run(ckpt, state)
  if state.chief:
    # Once the checkpoint restored into this config (the next start compares
    # against it); whole or not at all.
    path = os.path.join(state.workdir, 'config.json')
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + '.tmp', path)
  if latest:
    line = (f'resumed from epoch {latest} checkpoint; starting epoch '
            f'{latest + 1} (pool {pool_digest(curator.state(state.pool))}, '
            f'policy step {int(state.states["policy"].step)})')
    logging.info('%s in %s', line, ckpt.directory)
    if state.chief:
      print(line, flush=True)
  last: dict[str, float] = {}
  if stopper.requested():  # a signal during set-up
    _stopped(state, ckpt, stopper, resume_command)
    return last
  if config.eval.every and (latest == 0 or state.eval_pending):
    stopper.where = f'epoch {latest}: evaluation'
    values = _evaluate(state, latest)
    if stopper.requested():  # not reported: it runs again on resume
      _stopped(state, ckpt, stopper, resume_command)
      return last
    state.eval_pending = False
    _report(state, latest, values)
  for epoch in range(latest + 1, config.loop.num_epochs + 1):
    start = checkpoint.run_meta(state, epoch - 1)
    start_states = dict(state.states)
    # The epoch can be dropped while the states are those it started from.
    stopper.abandonable = lambda held=start_states: all(
        state.states[n] is s for n, s in held.items())
    try:
      values = _epoch(state, epoch)
    except preemption.Preempted:
      if state.saved_epoch < epoch - 1:
        checkpoint.save_run(ckpt, state, epoch - 1, start)
      _save_pool(state, curator.from_state(start['pool']))
      _stopped(state, ckpt, stopper, resume_command)
      return last
    finally:
      stopper.abandonable = lambda: False
    # Process 0 decides the curator (the others computed the same).
    state.pool = distributed.broadcast(state.pool)
    if distributed.is_multiprocess():
      values.update({f'distributed/{kind}_bytes': float(n) for kind, n in
                     distributed.take_traffic().items()})
    is_last = epoch == config.loop.num_epochs
    stop = stopper.requested()
    if config.eval.every and (epoch % config.eval.every == 0 or is_last):
      state.eval_pending = stop
      if not stop:
        stopper.where = f'epoch {epoch}: evaluation'
        values.update(_evaluate(state, epoch))
    stop = stopper.requested()
    if epoch % config.loop.checkpoint_every == 0 or is_last or stop:
      stopper.where = f'epoch {epoch}: checkpoint'
      checkpoint.save_run(ckpt, state, epoch)
    _save_pool(state, state.pool)
    _report(state, epoch, values)
    last = values
    if stopper.requested():
      if state.saved_epoch < epoch:  # the signal came after the save
        checkpoint.save_run(ckpt, state, epoch)
      _stopped(state, ckpt, stopper, resume_command)
      return last
  return last
