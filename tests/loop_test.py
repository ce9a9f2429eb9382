"""End to end: configs/tiny.py through main, resume, SIGKILL, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rla_jax import checkpoint
from rla_jax import curator
from rla_jax import loop
from rla_jax import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _main(workdir, *flags, **popen):
  env = dict(os.environ)
  env['XLA_FLAGS'] = ''  # one CPU device, like a user's laptop
  cmd = [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py',
         f'--workdir={workdir}', *flags]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **popen)


def _events(workdir):
  tb = os.path.join(workdir, 'tb')
  return [f for f in os.listdir(tb) if f.startswith('events.out.tfevents')]


def _scalars(workdir):
  with open(os.path.join(workdir, 'tb', 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _read_tb_scalars(workdir, tag):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, 'tb'))
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope='module')
def two_epochs(tmp_path_factory):
  """configs/tiny.py for 2 epochs in-process on the 8-device mesh."""
  workdir = str(tmp_path_factory.mktemp('tiny'))
  config = tiny.get_config()
  config.loop.num_epochs = 2
  start = time.time()
  last = loop.run(config, workdir)
  print(f'2 tiny epochs in {time.time() - start:.1f} s: {last}')
  return workdir, config, last


@pytest.mark.slow
def test_two_epochs_write_events_pool_and_checkpoint(two_epochs):
  workdir, _, last = two_epochs
  assert _events(workdir)
  steps = _read_tb_scalars(workdir, 'rollout/accuracy')
  assert [s for s, _ in steps] == [1, 2]
  for key in ('policy/loss', 'policy/kl', 'curator/pool_difficulty',
              'time/rollout_s', 'judge/parse_fail_rate', 'eval/eval/accuracy',
              'eval/eval/rm_outcome_acc', 'eval/eval/rm_process_acc',
              'rollout/prompt_cut_frac', 'judge/prompt_cut_frac'):
    assert key in last, key
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  assert len(pool) == 12
  assert checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 2).latest_epoch() == 2
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['loop']['num_epochs'] == 2


@pytest.mark.slow
def test_rewrites_are_requested_and_judged(two_epochs):
  workdir, _, _ = two_epochs
  rows = _scalars(workdir)
  # The tiny setting's random env LLM rarely writes a valid \boxed{} answer,
  # so most rewrites are its knob fallback's (curator/*_fallback).
  assert sum(r.get('curator/created', 0) + r.get('curator/created_fallback', 0)
             for r in rows) > 0
  decided = sum(r.get('curator/accepted', 0) +
                r.get('curator/accepted_fallback', 0) +
                r.get('curator/rejected', 0) for r in rows)
  assert decided > 0
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  events = [e for t in pool for e in t.history]
  assert len(events) == decided
  for e in events:
    assert e['critiques'] is not None and e['direction'] in ('harder',
                                                             'easier')


@pytest.mark.slow
def test_second_invocation_resumes_at_epoch_three(two_epochs, tmp_path):
  workdir, _, _ = two_epochs
  proc = _main(workdir, '--config.loop.num_epochs=3')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  assert 'resumed from epoch 2 checkpoint; starting epoch 3' in out
  assert 'epoch 1:' not in out and 'epoch 3 |' in out
  assert [r['step'] for r in _scalars(workdir)
          if 'rollout/accuracy' in r] == [1, 2, 3]
  # The end-of-run table (rla_jax/report.py) closes the run's output.
  table = out[out.index('eval accuracy (eval) [95% CI]'):]
  for row in ('(epoch 0)', '(epoch 3)', 'RM outcome acc (eval rollouts)',
              'rewrites requested / accepted / rejected', 'peak RSS',
              'time rollout', 'time rm_update',
              f'TensorBoard: tensorboard --logdir {workdir}/tb'):
    assert row in table, row
  assert os.path.exists(os.path.join(workdir, 'report.png'))


@pytest.mark.slow
def test_sigkill_mid_epoch_resumes_with_same_pool_and_step(tmp_path):
  workdir = str(tmp_path / 'killed')
  proc = _main(workdir, '--config.loop.num_epochs=1')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  meta = ckpt.meta(1)
  # Epoch 2 is killed while the policy is being updated.
  proc = _main(workdir, '--config.loop.num_epochs=2')
  for line in proc.stdout:
    if line.startswith('epoch 2: policy_update'):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert ckpt.latest_epoch() == 1
  proc = _main(workdir, '--config.loop.num_epochs=2')
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  expected = (f'resumed from epoch 1 checkpoint; starting epoch 2 '
              f'(pool {loop.pool_digest(meta["pool"])}, '
              f'policy step {meta["steps"]["policy"]})')
  assert expected in out, out
  assert ckpt.latest_epoch() == 2


@pytest.mark.slow
def test_checkpoint_of_another_config_fails_clearly(two_epochs):
  workdir, _, _ = two_epochs
  config = tiny.get_config()
  config.loop.num_epochs = 4
  config.policy.random.intermediate_size = 96
  config.loop.allow_config_change = True  # else refused before set-up
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r'policy\.params\.layers\.mlp\.w_down has shape '
                     r'\(2, 128, 64\) in the checkpoint but the config builds '
                     r'\(2, 96, 64\)'):
    loop.run(config, workdir)


def test_malformed_config_key_is_named(tmp_path):
  proc = _main(str(tmp_path), '--config.rollout.temprature=0.5')
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert 'temprature' in out


def test_bad_value_and_missing_model_path_are_named(tmp_path):
  config = tiny.get_config()
  config.curator.alpha_low = 0.9
  with pytest.raises(ValueError, match=r'config.curator.alpha_low=0.9'):
    loop.run(config, str(tmp_path / 'a'))
  config = tiny.get_config()
  config.policy.path = str(tmp_path / 'no_such_model')
  with pytest.raises(ValueError, match=r'config.policy.path=.*no_such_model.*'
                     'does not exist'):
    loop.run(config, str(tmp_path / 'b'))


def test_environment_errors_become_error_trajectories(tmp_path):
  config = tiny.get_config()
  config.env.fail_task_ids = tuple(f'train{i:04d}' for i in range(12))
  config.rollout.num_tasks = 2
  config.loop.num_epochs = 1
  config.eval.every = 0
  last = loop.run(config, str(tmp_path))
  assert last['rollout/errors'] == last['rollout/trajectories'] > 0
  assert last['feedback/error_trajectories'] == last['rollout/errors']
  assert last['policy/examples'] == 0


# ---- method fidelity at the seams between stages ---------------------------


@pytest.fixture(scope='module')
def one_try_run(tmp_path_factory):
  """configs/tiny.py, 3 epochs, rewrites get one epoch to be measured.

  Also records the seed of every environment-LLM sampler call.
  """
  workdir = str(tmp_path_factory.mktemp('one_try'))
  config = tiny.get_config()
  config.curator.pending_max_tries = 1
  seeds = []
  complete = loop.chat.complete

  def recording(model, tokenizer, messages, *, sampling, **kwargs):
    if sampling is config.curator.sampling:
      seeds.append(kwargs['seed'])
    return complete(model, tokenizer, messages, sampling=sampling, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(loop.chat, 'complete', recording)
    loop.run(config, workdir)
  return workdir, seeds


@pytest.mark.slow
def test_rewrites_are_measured_in_the_epoch_after_they_are_made(one_try_run):
  # Judging pending rewrites before they were rolled out made every one of
  # them 'unmeasured' with pending_max_tries=1 (and nothing was ever accepted).
  workdir, _ = one_try_run
  events = [e for t in curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
            for e in t.history]
  assert events
  assert {e['reason'] for e in events} & {'accepted', 'rejected'}
  assert all(e['reason'] != 'unmeasured' for e in events)
  for e in events:
    assert e['epoch'] == e['created_epoch'] + 1
  rows = [r for r in _scalars(workdir) if 'curator/undecided' in r]
  assert all(r['curator/undecided'] == 0 for r in rows)


@pytest.mark.slow
def test_every_environment_llm_call_draws_its_own_stream(one_try_run):
  _, seeds = one_try_run
  assert len(seeds) >= 2
  assert len(set(seeds)) == len(seeds)


@pytest.mark.slow
def test_disabled_curator_discards_pending_rewrites(tmp_path):
  workdir = str(tmp_path)
  config = tiny.get_config()
  config.loop.num_epochs = 1
  config.eval.every = 0
  loop.run(config, workdir)
  pending = [t.task_id for t in curator.load_jsonl(
      os.path.join(workdir, 'pool.jsonl')) if t.pending is not None]
  assert pending  # epoch 1 left rewrites to be measured in epoch 2
  config = tiny.get_config('policy_reward')  # curator off, same workdir
  config.loop.num_epochs = 2
  config.eval.every = 0
  config.loop.allow_config_change = True
  last = loop.run(config, workdir)
  assert last['curator/discarded'] == len(pending)
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  assert all(t.pending is None for t in pool)
  discarded = [e for t in pool for e in t.history if e['reason'] ==
               'discarded']
  assert sorted(e['task_id'] for e in discarded) == sorted(pending)
  # Only active versions were rolled out: 4 tasks x 4 rollouts.
  assert last['rollout/trajectories'] == 16


@pytest.mark.slow
def test_initial_kl_reference_stays_frozen(tmp_path):
  config = tiny.get_config()
  config.train.policy.kl_reference = 'initial'
  config.eval.every = 0
  run = runtime.setup(config, str(tmp_path))
  with loop.sharding.use(run.mesh, run.rules):
    initial = jax.tree.map(np.asarray, run.ref_params['policy'])
    for epoch in (1, 2):
      values = loop._epoch(run, epoch)  # pylint: disable=protected-access
  assert 'reward_model' not in run.ref_params
  after = jax.tree.map(np.asarray, run.ref_params['policy'])
  jax.tree.map(np.testing.assert_array_equal, after, initial)
  trained = jax.tree.map(np.asarray, run.states['policy'].params)
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(trained), jax.tree.leaves(initial)))
  assert values['policy/kl'] > 0
  run.executor.shutdown()
  run.writer.close()


def test_training_limits_follow_the_sampler_and_shorter_ones_fail(tmp_path):
  config = tiny.get_config()
  config.train.reward_model.max_prompt_len = 0
  assert runtime.train_limits(config, 'reward_model') == (256, 8)  # its own response limit
  config.train.reward_model.max_prompt_len = 128
  with pytest.raises(ValueError, match=(
      r'config.train.reward_model.max_prompt_len=128: shorter than '
      r'config.judge.sampling.max_prompt_len=256')):
    runtime.validate(config)
  config = tiny.get_config()
  config.train.policy.max_response_len = 2
  with pytest.raises(ValueError, match=(
      r'config.train.policy.max_response_len=2: shorter than '
      r'config.rollout.sampling.max_new_tokens=4')):
    runtime.validate(config)
  config = tiny.get_config()
  config.curator.pending_max_tries = 0
  with pytest.raises(ValueError, match='curator.pending_max_tries=0'):
    runtime.validate(config)


def test_base_config_uses_the_authors_stop_strings():
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  for section in (config.rollout, config.judge, config.curator):
    assert '<|im_end|>' in section.sampling.stop_strings
    assert 'User:' in section.sampling.stop_strings
  # The base limits train on what was sampled (0 = the sampler's).
  assert runtime.train_limits(config, 'policy') == (2048, 2000)
  assert runtime.train_limits(config, 'reward_model') == (4096, 4000)


# main with the policy's pi_old log-probs set to NaN in the first policy step
# (argv[1] == 'first') or in all of them ('all'): a real non-finite loss.
NAN_POLICY_STEPS = """
import runpy, sys
import jax.numpy as jnp
from rla_jax import train
real, mode, poisoned = train.Trainer.step, sys.argv.pop(1), []

def step(self, state, batch, **kwargs):
  if self.kind == train.POLICY and (mode == 'all' or not poisoned):
    poisoned.append(1)
    batch = batch.replace(
        advantages_MxB=jnp.full_like(batch.advantages_MxB, jnp.nan))
  return real(self, state, batch, **kwargs)

train.Trainer.step = step
sys.argv = ['main', *sys.argv[1:]]
runpy.run_module('rla_jax.main', run_name='__main__')
"""


def _nan_main(workdir, mode, *flags):
  env = dict(os.environ, XLA_FLAGS='', PYTHONPATH=ROOT)
  cmd = [sys.executable, '-c', NAN_POLICY_STEPS, mode,
         '--config=configs/tiny.py', f'--workdir={workdir}',
         '--config.loop.num_epochs=2', '--config.eval.every=0', *flags]
  return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=600,
                        check=False)


@pytest.mark.slow
def test_non_finite_step_is_skipped_counted_and_logged(tmp_path):
  workdir = str(tmp_path)
  proc = _nan_main(workdir, 'first')
  assert proc.returncode == 0, proc.stdout
  rows = {r['step']: r for r in _scalars(workdir) if 'policy/steps' in r}
  assert [(rows[e]['policy/skipped_steps'], rows[e]['policy/steps'])
          for e in (1, 2)] == [(1, 1), (0, 2)]
  assert checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                 2).meta(2)['steps']['policy'] == 3
  logged = [line for line in proc.stdout.splitlines()
            if 'skipped policy update 1/2 of epoch 1 (at step 0): loss=nan' in
            line]
  assert len(logged) == 1, proc.stdout
  keys = logged[0].split('examples: ')[1].split()
  assert keys and all(k.startswith('train') and k.count('/') >= 3
                      for k in keys), keys


@pytest.mark.slow
def test_non_finite_steps_in_a_row_stop_the_run_across_a_resume(tmp_path):
  workdir = str(tmp_path)
  limit = '--config.train.policy.max_nonfinite_steps=3'
  proc = _nan_main(workdir, 'all', limit)
  # Epoch 1 skips its 2 steps; the first of epoch 2 is the 3rd in a row.
  assert proc.returncode == 1, proc.stdout
  assert ('error: 3 non-finite policy train steps in a row '
          '(train.max_nonfinite_steps=3), the last policy update 1/2 of epoch '
          '2') in proc.stdout, proc.stdout
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), 2)
  assert ckpt.latest_epoch() == 1
  assert ckpt.meta(1)['nonfinite_streak'] == {'policy': 2, 'reward_model': 0}
  # The count is part of the run: a resume goes on from 2, not from 0.
  proc = _nan_main(workdir, 'all', limit)
  assert proc.returncode == 1, proc.stdout
  assert 'resumed from epoch 1 checkpoint' in proc.stdout
  assert 'error: 3 non-finite policy train steps in a row' in proc.stdout
