"""Tests for the task pool, rewrite triggers, critiques and acceptance."""

import copy
import dataclasses
import importlib
import json
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from rla_jax import curator
from rla_jax import structs
from rla_jax import truncation
from rla_jax.envs import base

HARDER, EASIER = structs.HARDER, structs.EASIER


def make_config(**overrides):
  config = ml_collections.ConfigDict(dict(
      num_tasks=2, alpha_low=0.2, alpha_high=0.8, rewrite_attempts=3,
      pending_max_tries=2, critique_max_chars=40, critiques=True,
      critique_observation_chars=0, easier_strict=False))
  config.update(overrides)
  return config


class FakeEnv:
  """Records rewrite calls; level +-1 per rewrite; some ids fail.

  Ids in `fallback` get their rewrite from a stand-in generator (marked
  base.FALLBACK_KEY) after the LLM's proposals fail for `proposal_reasons`.
  """

  def __init__(self, reject=(), crash=(), unchanged=(), fallback=(),
               proposal_reasons=()):
    self.reject, self.crash, self.unchanged = reject, crash, unchanged
    self.fallback, self.proposal_reasons = fallback, proposal_reasons
    self.calls = []

  def describe(self, spec):
    return f'Put the {spec["id"]} away (level {spec["level"]}).'

  def difficulty(self, spec):
    return float(spec['level'])

  def rewrite(self, request, generate, attempts):
    spec, direction = request.spec, request.direction
    self.calls.append(dict(spec=spec, direction=direction,
                           critiques=list(request.critiques),
                           attempts=attempts, generate=generate,
                           request=request))
    if spec['id'] in self.reject or spec['id'] in self.fallback:
      request.rejected.extend(self.proposal_reasons)
    if spec['id'] in self.reject:
      raise base.RewriteRejected('no valid candidate')
    if spec['id'] in self.crash:
      raise RuntimeError('hook bug')
    if spec['id'] in self.unchanged:
      return dict(spec)
    new = dict(spec, level=spec['level'] + (1 if direction == HARDER else -1))
    if spec['id'] in self.fallback:
      new[base.FALLBACK_KEY] = 'knob'
    return new


class FakeGenerate:
  """Answers prompt i with a boxed critique, or unboxed text if i in `bad`."""

  def __init__(self, bad=(), fail=False):
    self.bad, self.fail = bad, fail
    self.calls = []

  def __call__(self, prompts):
    self.calls.append(list(prompts))
    if self.fail:
      raise RuntimeError('LLM down')
    return ['thinking... no box' if i in self.bad else
            f'It looped. \\boxed{{critique {len(self.calls)}.{i} {{ok}}}}'
            for i in range(len(prompts))]


def specs(n):
  return [{'id': f't{i}', 'level': 5} for i in range(n)]


def traj(task, r, outcome, num_steps=2, source='active', status=structs.OK):
  steps = [structs.Step(prompt='', prompt_tokens=[],
                        response=f'I will go {k} because ' + 'x' * 50,
                        response_tokens=[], logprobs=[], action=f'go {k}',
                        observation=f'room {k}', finish_reason='stop')
           for k in range(num_steps)]
  return structs.Trajectory(task_id=task, source=source, rollout=r, spec={},
                            steps=steps, outcome=outcome, status=status)


def judgment(task, r, k, j, s, source='active'):
  return structs.Judgment(task_id=task, source=source, rollout=r, step=k,
                          sample=j, prompt='', prompt_tokens=[],
                          response=f'judge {j} of step {k}: S={s}',
                          response_tokens=[], logprobs=[], score=s or 0,
                          parsed=s is not None)


def with_pending(pool, task_id, direction, acc_old, level=6, unmeasured=0):
  rewrite = structs.Rewrite(
      spec={'id': task_id, 'level': level}, direction=direction,
      acc_old=acc_old, epoch=1, critiques=['c'], unmeasured=unmeasured)
  return [dataclasses.replace(t, pending=rewrite) if t.task_id == task_id
          else t for t in pool]


def test_build_pool():
  pool = curator.build_pool(specs(3))
  assert [t.task_id for t in pool] == ['t0', 't1', 't2']
  for task, spec in zip(pool, specs(3)):
    assert task.root == task.active == spec and task.version == 0
    assert task.pending is None and task.history == []
  with pytest.raises(ValueError):
    curator.build_pool(specs(2) + specs(1))


def _order(seed, n):
  """A seeded endless stream of slot indices, reshuffled each pass."""
  rng = np.random.default_rng(seed)
  while True:
    yield from rng.permutation(n)


def test_sample_batch_follows_order_and_includes_pending():
  pool = with_pending(curator.build_pool(specs(6)), 't3', HARDER, 1.0, level=9)
  first = curator.sample_batch(pool, 3, iter([3, 5, 5, 0, 2, 1]))
  assert [b.task_id for b in first] == ['t5', 't0', 't2', 't3']
  assert first[-1] == ('t3', {'id': 't3', 'level': 9}, 'pending')
  assert curator.sample_batch(pool, 3, _order(7, 6)) == curator.sample_batch(
      pool, 3, _order(7, 6))
  # More slots asked than free: all free ones, no repeats.
  batch = curator.sample_batch(pool, 10, _order(0, 6))
  assert sorted(b.task_id for b in batch if b.source == 'active') == [
      't0', 't1', 't2', 't4', 't5']
  # One pass of a shuffled stream visits every free slot.
  order = _order(1, 6)
  drawn = [b.task_id for _ in range(5)
           for b in curator.sample_batch(pool, 1, order)
           if b.source == 'active']
  assert sorted(drawn) == ['t0', 't1', 't2', 't4', 't5']


def test_triggers_table():
  accs = [1.0, 0.8, 0.79, 0.5, 0.21, 0.2, 0.0, None, 1.0]
  pool = curator.build_pool(specs(len(accs)))
  pool = with_pending(pool, 't8', EASIER, 0.0)
  accuracy = {(f't{i}', 'active'): a for i, a in enumerate(accs)}
  accuracy[('t8', 'pending')] = 1.0  # pending groups never trigger
  fired = curator.triggers(pool, accuracy, 0.2, 0.8)
  assert fired == {'t0': HARDER, 't1': HARDER, 't5': EASIER, 't6': EASIER}
  assert curator.triggers(pool, {('t3', 'active'): 4 / 5}, 0.2, 0.8) == {
      't3': HARDER}


@pytest.mark.parametrize('setting, fires', [('coding', False),
                                            ('alfworld', True),
                                            ('osworld', True)])
def test_easier_trigger_at_the_edge_follows_the_setting(setting, fires):
  # Issue 32.4: coding's easier trigger is acc < 0.2 (5.8, 6), the others'
  # acc <= 0.2; the configs carry the difference (curator.easier_strict).
  config = importlib.import_module(f'configs.{setting}').get_config().curator
  config.critiques = False
  pool = curator.build_pool(specs(2))
  accuracy = {('t0', 'active'): 1 / 5, ('t1', 'active'): 0.1875}
  env = FakeEnv()
  _, stats = curator.request_rewrites(pool, env, [], [], accuracy,
                                      FakeGenerate(), 1, config)
  fired = [c['spec']['id'] for c in env.calls]
  assert fired == (['t0', 't1'] if fires else ['t1'])
  assert stats['curator/triggered_easier'] == len(fired)
  assert all(c['direction'] == EASIER for c in env.calls)
  strict = curator.triggers(pool, accuracy, 0.2, 0.8, easier_strict=True)
  assert strict == {'t1': EASIER}


@pytest.mark.parametrize('direction, acc_old, acc_new, expected', [
    (HARDER, 1.0, 0.5, True),
    (HARDER, 1.0, 0.2, True),  # lower edge inclusive
    (HARDER, 1.0, 0.125, False),  # too hard
    (HARDER, 0.875, 0.875, False),  # equal: not harder
    (HARDER, 0.8, 1.0, False),  # easier instead
    (HARDER, 0.8, 0.75, True),
    (HARDER, 1.0, 0.0, False),  # acc_new = 0
    (EASIER, 0.0, 0.5, True),
    (EASIER, 0.0, 0.8, True),  # upper edge inclusive
    (EASIER, 0.0, 0.875, False),  # too easy
    (EASIER, 0.125, 0.125, False),  # equal: not easier
    (EASIER, 0.2, 0.125, False),  # harder instead
    (EASIER, 0.0, 0.0, False),  # acc_new = 0
    (EASIER, 0.2, 0.25, True),
])
def test_accept_table(direction, acc_old, acc_new, expected):
  assert curator.accept(direction, acc_old, acc_new, 0.2, 0.8) is expected


def test_accept_requires_a_success_even_with_alpha_low_zero():
  assert not curator.accept(HARDER, 0.5, 0.0, 0.0, 0.8)
  with pytest.raises(ValueError):
    curator.accept('sideways', 0.5, 0.4, 0.2, 0.8)


def test_judge_pending_accept_reject_and_lineage():
  pool = curator.build_pool(specs(3))
  pool = with_pending(pool, 't0', HARDER, 1.0, level=6)
  pool = with_pending(pool, 't1', EASIER, 0.0, level=4)
  before = copy.deepcopy(pool)
  accuracy = {('t0', 'pending'): 0.5, ('t1', 'pending'): 0.875,
              ('t2', 'active'): 0.5}
  new_pool, events, stats = curator.judge_pending(pool, accuracy, 2,
                                                  make_config())
  assert pool == before  # inputs untouched
  t0, t1, t2 = new_pool
  assert t0.active == {'id': 't0', 'level': 6} and t0.version == 1
  assert t0.root == {'id': 't0', 'level': 5} and t0.pending is None
  assert t0.history == [dict(
      task_id='t0', epoch=2, created_epoch=1, direction=HARDER, acc_old=1.0,
      acc_new=0.5, accepted=True, reason='accepted', version=1,
      spec={'id': 't0', 'level': 6}, critiques=['c'], origin='llm')]
  assert t1.active == {'id': 't1', 'level': 5} and t1.version == 0
  assert t1.pending is None and t1.history[0]['accepted'] is False
  assert t1.history[0]['acc_new'] == 0.875
  assert t2 == pool[2]
  assert stats['curator/accepted'] == 1 and stats['curator/rejected'] == 1
  assert curator.rejected_groups(events) == {('t1', 'pending')}


def test_unmeasured_pending_waits_then_is_dropped():
  pool = with_pending(curator.build_pool(specs(1)), 't0', HARDER, 1.0)
  config = make_config(pending_max_tries=2)
  pool, events, stats = curator.judge_pending(pool, {}, 2, config)
  assert not events and stats['curator/undecided'] == 1
  assert pool[0].pending.unmeasured == 1
  pool, events, stats = curator.judge_pending(
      pool, {('t0', 'pending'): None}, 3, config)
  assert pool[0].pending is None and pool[0].version == 0
  assert events[0]['reason'] == 'unmeasured' and events[0]['acc_new'] is None
  assert stats['curator/dropped_unmeasured'] == 1
  assert not curator.rejected_groups(events)


def rollouts_for_rewrite():
  trajectories = [
      # t0: 4/5 successes -> HARDER; one failed rollout.
      *[traj('t0', r, 1.0) for r in range(4)], traj('t0', 4, -1.0),
      # t1: 0/3 -> EASIER; two failed rollouts, one error (no critique).
      traj('t1', 0, -1.0, num_steps=3), traj('t1', 1, -1.0),
      traj('t1', 2, -1.0, status=structs.ERROR),
      # t2: 1/2 -> nothing.
      traj('t2', 0, 1.0), traj('t2', 1, -1.0),
  ]
  judgments = [
      # t1 rollout 0: step 1 is high-risk (all -1); step 2 has an unparsed one.
      judgment('t1', 0, 0, 0, 1), judgment('t1', 0, 0, 1, -1),
      judgment('t1', 0, 1, 0, -1), judgment('t1', 0, 1, 1, -1),
      judgment('t1', 0, 2, 0, -1), judgment('t1', 0, 2, 1, None),
      judgment('t0', 4, 0, 0, -1), judgment('t0', 4, 0, 1, -1),
  ]
  accuracy = {('t0', 'active'): 0.8, ('t1', 'active'): 0.0,
              ('t2', 'active'): 0.5}
  return trajectories, judgments, accuracy


def test_critiques_reach_the_rewrite_hook():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  env, generate = FakeEnv(), FakeGenerate(bad=(2,))
  new_pool, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, generate, 4, make_config())
  assert len(generate.calls) == 1  # one batched call for the epoch
  prompts = generate.calls[0]
  assert len(prompts) == 3  # t0 rollout 4, t1 rollouts 0 and 1
  assert 'Put the t1 away (level 5).' in prompts[1]
  plain = [truncation.plain(p) for p in prompts]
  assert 'Step 3\n  action: go 2\n  observation: room 2' in plain[1]
  assert 'scored them -1): 2\n' in plain[1]
  assert 'scored them -1): 1\n' in plain[0]
  assert 'scored them -1): none' in plain[2]
  # A high-risk step shows the agent's response and one RM rationale,
  # clipped to critique_max_chars (40).
  clipped = ('I will go 1 because ' + 'x' * 50)[:37] + '...'
  assert ('and why the reward model objected:\nStep 2\n  agent: '
          f'{clipped}\n  reward model: judge 0 of step 1: S=-1\n') in plain[1]
  assert '  agent:' not in plain[2]
  # The history is the cuttable middle; task and question stay fixed.
  assert prompts[1].index(truncation.CUT_BEGIN) > prompts[1].index('t1 away')
  assert prompts[1].rindex(truncation.CUT_END) < prompts[1].index('two sent')
  assert '\\boxed{}' in prompts[0]
  # Long observations can be clipped (critique_observation_chars).
  clip_generate = FakeGenerate(bad=(2,))
  curator.request_rewrites(pool, FakeEnv(), trajectories, judgments, accuracy,
                           clip_generate, 4,
                           make_config(critique_observation_chars=5))
  assert ('Step 3\n  action: go 2\n  observation: ro...' in
          truncation.plain(clip_generate.calls[0][1]))
  assert [c['spec']['id'] for c in env.calls] == ['t0', 't1']
  assert env.calls[0]['critiques'] == ['critique 1.0 {ok}']
  assert env.calls[1]['critiques'] == ['critique 1.1 {ok}']  # 1.2 unparsed
  assert env.calls[0]['direction'] == HARDER
  assert env.calls[1]['direction'] == EASIER
  assert env.calls[0]['attempts'] == 3 and env.calls[0]['generate'] is generate
  request = env.calls[1]['request']
  assert request.acc_old == 0.0 and request.root == pool[1].root
  assert [(t.task_id, t.rollout) for t in request.trajectories] == [
      ('t1', 0), ('t1', 1), ('t1', 2)]
  assert {j.task_id for j in request.judgments} == {'t1'}
  t0, t1, t2 = new_pool
  assert t0.pending == structs.Rewrite(
      spec={'id': 't0', 'level': 6}, direction=HARDER, acc_old=0.8, epoch=4,
      critiques=['critique 1.0 {ok}'])
  assert t1.pending.spec == {'id': 't1', 'level': 4}
  assert t1.pending.critiques == ['critique 1.1 {ok}']
  assert t2.pending is None and t0.active == pool[0].active
  assert stats['curator/requested'] == 2 and stats['curator/created'] == 2
  assert stats['curator/critiques'] == 2
  assert stats['curator/critique_parse_fail'] == 1
  assert stats['curator/triggered_harder'] == 1
  assert stats['curator/triggered_easier'] == 1
  assert pool[0].pending is None  # input untouched


def test_failing_hooks_are_counted_not_raised():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  accuracy[('t2', 'active')] = 0.2
  env = FakeEnv(reject=('t0',), crash=('t1',))
  new_pool, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, FakeGenerate(), 1,
      make_config())
  assert [t.pending is None for t in new_pool] == [True, True, False]
  assert stats['curator/rewrite_rejected'] == 1
  assert stats['curator/rewrite_errors'] == 1
  assert stats['curator/rewrite_failures'] == 2
  assert stats['curator/created'] == 1


def test_unchanged_rewrite_and_failed_critique_call():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  env = FakeEnv(unchanged=('t0',))
  new_pool, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, FakeGenerate(fail=True), 1,
      make_config())
  assert stats['curator/critique_errors'] == 3
  assert [c['critiques'] for c in env.calls] == [[], []]
  assert new_pool[0].pending is None and new_pool[1].pending is not None
  assert stats['curator/rewrite_unchanged'] == 1


def test_no_failures_means_no_llm_call():
  pool = curator.build_pool(specs(1))
  generate = FakeGenerate()
  _, stats = curator.request_rewrites(
      pool, FakeEnv(), [traj('t0', 0, 1.0)], [], {('t0', 'active'): 1.0},
      generate, 1, make_config())
  assert not generate.calls and stats['curator/created'] == 1


@pytest.mark.parametrize('text, expected', [
    (r'blah \boxed{It never opened the fridge.}',
     'It never opened the fridge.'),
    (r'\boxed{a} \boxed{ b {c} }', 'b {c}'),
    ('no box', ''),
    (r'\boxed{unclosed', ''),
])
def test_parse_critique(text, expected):
  assert curator.parse_critique(text) == expected


def two_epoch_pool():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  pool, _ = curator.request_rewrites(pool, FakeEnv(), trajectories, judgments,
                                     accuracy, FakeGenerate(), 1, make_config())
  pool, _, _ = curator.judge_pending(pool, {('t0', 'pending'): 0.5}, 2,
                                     make_config())
  return pool


def test_epoch_cycle_lineage_and_metrics():
  pool = two_epoch_pool()
  assert pool[0].version == 1 and pool[0].active['level'] == 6
  assert pool[0].history[0]['critiques'] == ['critique 1.0 {ok}']
  assert pool[1].pending is not None  # t1 not measured yet (max tries 2)
  batch = curator.sample_batch(pool, 5, _order(0, 3))
  assert ('t1', {'id': 't1', 'level': 4}, 'pending') in batch
  active = sorted(b.task_id for b in batch if b.source == 'active')
  assert active == ['t0', 't2']
  metrics = curator.metrics(pool, FakeEnv())
  assert metrics == {'curator/pool_size': 3, 'curator/pending': 1,
                     'curator/mean_version': pytest.approx(1 / 3),
                     'curator/accepted_total': 1,
                     'curator/accepted_fallback_total': 0,
                     'curator/pool_difficulty': pytest.approx(16 / 3)}


def test_jsonl_and_state_round_trip(tmp_path):
  pool = two_epoch_pool()
  path = str(tmp_path / 'pool.jsonl')
  curator.save_jsonl(pool, path)
  with open(path, encoding='utf-8') as f:
    assert len(f.readlines()) == 3
  assert curator.load_jsonl(path) == pool
  saved = json.loads(json.dumps(curator.state(pool)))
  restored = curator.from_state(saved)
  assert restored == pool
  assert isinstance(restored[1].pending, structs.Rewrite)


def test_curator_does_not_import_jax():
  code = ('import sys, rla_jax.curator; '
          'assert "jax" not in sys.modules, "jax imported"')
  subprocess.run([sys.executable, '-c', code], check=True)


def test_discard_pending_logs_and_clears():
  pool = with_pending(curator.build_pool(specs(2)), 't1', EASIER, 0.0)
  new_pool, events = curator.discard_pending(pool, 5)
  assert all(t.pending is None for t in new_pool)
  assert [e['reason'] for e in events] == ['discarded']
  assert events[0]['task_id'] == 't1' and events[0]['epoch'] == 5
  assert new_pool[1].history == events and new_pool[1].version == 0
  assert pool[1].pending is not None  # input untouched


def test_critiques_can_be_switched_off():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  env, generate = FakeEnv(), FakeGenerate()
  new_pool, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, generate, 4,
      make_config(critiques=False))
  assert not generate.calls  # no critique prompts
  assert [c['critiques'] for c in env.calls] == [[], []]
  assert stats['curator/created'] == 2 and new_pool[0].pending is not None


def test_fallback_rewrites_are_counted_apart_from_the_llms():
  # Issue 32.5: a rewrite the setting's generator made (no valid proposal)
  # is the fallback's when created and when accepted, never the LLM's.
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  accuracy[('t2', 'active')] = 1.0
  env = FakeEnv(fallback=('t0', 't2'))
  pool, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, FakeGenerate(), 1,
      make_config(critiques=False))
  assert stats['curator/requested'] == 3
  assert stats['curator/created'] == 1  # t1: the LLM's
  assert stats['curator/created_fallback'] == 2
  assert [t.pending.origin for t in pool] == [structs.FALLBACK, structs.LLM,
                                              structs.FALLBACK]
  assert base.FALLBACK_KEY not in pool[0].pending.spec  # the mark is off
  assert pool[0].pending.spec == {'id': 't0', 'level': 6}
  restored = curator.from_state(json.loads(json.dumps(curator.state(pool))))
  assert restored == pool  # the origin survives a checkpoint
  measured = {('t0', 'pending'): 0.5, ('t1', 'pending'): 0.5,
              ('t2', 'pending'): 0.5}
  pool, events, stats = curator.judge_pending(restored, measured, 2,
                                              make_config())
  assert [e['accepted'] for e in events] == [True, True, True]
  assert [e['origin'] for e in events] == ['fallback', 'llm', 'fallback']
  assert stats['curator/accepted'] == 1
  assert stats['curator/accepted_fallback'] == 2
  metrics = curator.metrics(pool, env)
  assert metrics['curator/accepted_total'] == 1
  assert metrics['curator/accepted_fallback_total'] == 2


def test_old_pending_rewrites_are_the_llms():
  # A pool saved before Rewrite.origin existed loads as the LLM's.
  pool = with_pending(curator.build_pool(specs(1)), 't0', HARDER, 1.0)
  data = curator.state(pool)
  del data[0]['pending']['origin']
  assert curator.from_state(data)[0].pending.origin == structs.LLM


def test_rejection_reasons_are_counted_per_key():
  pool = curator.build_pool(specs(3))
  trajectories, judgments, accuracy = rollouts_for_rewrite()
  accuracy[('t2', 'active')] = 1.0
  reasons = ('contradictory_tests', 'malformed_json', 'contradictory_tests')
  env = FakeEnv(reject=('t0',), fallback=('t2',), proposal_reasons=reasons)
  _, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, FakeGenerate(), 1,
      make_config(critiques=False))
  # t0's three proposals and t2's three (before its fallback) are counted.
  assert stats['curator/rejected_contradictory_tests'] == 4
  assert stats['curator/rejected_malformed_json'] == 2
  assert stats['curator/rewrite_rejected'] == 1
  # A hook that does not itemise its proposals: its RewriteRejected's reason
  # (OTHER unless it names one).
  env = FakeEnv(reject=('t0', 't1'))
  _, stats = curator.request_rewrites(
      pool, env, trajectories, judgments, accuracy, FakeGenerate(), 1,
      make_config(critiques=False))
  assert stats['curator/rejected_other'] == 2
  assert stats['curator/rewrite_rejected'] == 2
  assert not [k for k in stats if k.startswith('curator/rejected_')
              and k != 'curator/rejected_other']


@pytest.mark.parametrize('reason, key', [
    ('contradictory tests', 'contradictory_tests'),
    ('Malformed-JSON', 'malformed_json'), ('', 'other'), ('a:b', 'a_b')])
def test_reason_key(reason, key):
  assert curator.reason_key(reason) == key


def test_rewrite_rejected_carries_its_reason():
  e = base.RewriteRejected('tests 1 and 2 clash', reason='contradictory_tests')
  assert str(e) == 'tests 1 and 2 clash' and e.reason == 'contradictory_tests'
  assert base.RewriteRejected('x').reason == base.OTHER
  import pickle  # pylint: disable=g-import-not-at-top
  again = pickle.loads(pickle.dumps(e))
  assert (str(again), again.reason) == (str(e), e.reason)
