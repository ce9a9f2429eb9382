"""configs/alfworld.py:smoke end to end: rollouts, RM, rewrites, resume.

Random tiny models never play ALFWorld, so the in-process runs put an oracle
behind the environment's parsers: the models' own sampled tokens are what is
trained (their log-probs stay consistent), but the action a response "means"
is the planner's next action for some rollouts and 'inventory' (no
progress) for the others, and the environment LLM's proposals "mean" goals
that fit the scene. Everything after parsing (the PDDL engine, step labels,
rewards, training, the curator, rewrites built and solved by the planner,
checkpoints) is the real code. A subprocess runs the unpatched smoke config
with KV sessions, as a user would.
"""

import collections
import json
import os
import subprocess
import sys

import pytest

from rla_jax import curator
from rla_jax import loop
from rla_jax.envs.alfworld import environment as alfworld
from rla_jax.envs.alfworld import rewrite as rewriting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from configs import alfworld as alfworld_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

pytest.importorskip('alfworld')
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')
GROUP = 3  # rollouts per task in :smoke


class Oracle:
  """What the models' answers mean.

  Training task i has 3, 1 or 0 of its 3 rollouts follow the planner by
  i % 3 (harder and easier rewrites fire, and some groups train both
  models); rewrites get 2 of 3; evaluation tasks are solved at even i.
  """

  def __init__(self):
    self.asked = collections.deque()  # (env, spec, actions) in row order
    self.first_turns = collections.Counter()
    self.view = None
    self.attempt = 0

  def solvers(self, spec):
    index = int(spec['root_id'][-4:])
    if 'valid' in spec['root_id']:
      return GROUP if index % 2 == 0 else 0
    if spec.get('goal'):
      return 2
    return (GROUP, 1, 0)[index % 3]

  def policy_messages(self, original):
    def policy_messages(env, spec, turns, observation):
      self.asked.append((env, spec, [a for _, a in turns]))
      return original(env, spec, turns, observation)
    return policy_messages

  def parse_action(self, response, observation):
    del response, observation
    env, spec, actions = self.asked.popleft()
    with open(env.game(spec)['path']) as f:
      plan = json.load(f)['walkthrough']
    if not actions:
      k = self.first_turns[spec['id']]
      self.first_turns[spec['id']] += 1
      solver = k % GROUP < self.solvers(spec)
    else:
      solver = actions == plan[:len(actions)]
    return plan[len(actions)] if solver else 'inventory'

  def rewrite(self, original):
    def rewrite(env, request, generate, attempts):
      game, traj = env.content({'game': request.root['game']})
      self.view = (traj['task_type'],
                   rewriting.scene(game['pddl_problem']))
      self.attempt = 0
      return original(env, request, generate, attempts)
    return rewrite

  def parse_tokens(self, text, known):
    del text, known
    task_type, view = self.view
    if task_type == 'look_at_obj_in_light':
      lamps = [t for t in view.capable.get('toggleable', ())]
      pairs = [(lamp, o) for lamp in lamps
               for o in sorted(view.capable['pickupable'])]
    else:
      pairs = [(o, r) for r, o in sorted(view.can_contain)
               if rewriting.check(task_type, {'obj': o, 'recep': r}, {},
                                  view) is None]
    self.attempt += 1
    return pairs[(self.attempt - 1) % len(pairs)] if pairs else None


def _run(workdir, num_epochs, monkeypatch):
  config = alfworld_config.get_config('smoke')
  config.loop.num_epochs = num_epochs
  config.rollout.num_tasks = config.env.num_train  # every pattern, each epoch
  config.env.game_dir = os.path.join(os.path.dirname(workdir), 'games')
  oracle = Oracle()
  cls = alfworld.AlfWorldEnv
  monkeypatch.setattr(cls, 'policy_messages',
                      oracle.policy_messages(cls.policy_messages))
  monkeypatch.setattr(cls, 'parse_action',
                      lambda env, text, obs: oracle.parse_action(text, obs))
  monkeypatch.setattr(cls, 'rewrite', oracle.rewrite(cls.rewrite))
  monkeypatch.setattr(rewriting, 'parse_tokens', oracle.parse_tokens)
  return loop.run(config, workdir)


@pytest.mark.slow
def test_two_epochs_train_both_models_rewrite_and_resume(tmp_path,
                                                          monkeypatch):
  workdir = str(tmp_path / 'run')
  first = _run(workdir, 1, monkeypatch)
  assert 0 < first['rollout/accuracy'] < 1
  assert first['rollout/success_pick_and_place_simple'] == 1.0
  assert first['rollout/success_pick_clean_then_place_in_recep'] == 0.0
  assert first['policy/examples'] > 0 and first['policy/steps'] > 0
  assert first['rm/examples'] > 0 and first['rm/steps'] > 0
  # Step labels from the planner: the oracle's solvers only make progress,
  # the others never do, so the RM's process accuracy is measured.
  assert first['rm/process_count'] > 0
  assert first['curator/requested'] >= 2
  assert first['curator/triggered_harder'] >= 1
  assert first['curator/triggered_easier'] >= 1
  assert first['curator/created'] >= 1
  for split in ('valid_seen', 'valid_unseen'):
    assert first[f'eval/{split}/accuracy'] == 0.5
    assert f'eval/{split}/rm_process_acc' in first
    assert f'eval/{split}/rm_outcome_acc' in first
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  pending = [t.pending for t in pool if t.pending is not None]
  assert pending and all(p.spec['goal'] for p in pending)
  last = _run(workdir, 2, monkeypatch)  # resumes from epoch 1
  assert last['policy/examples'] > 0
  pool = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  decided = [e for t in pool for e in t.history]
  assert decided and all(e['epoch'] == 2 for e in decided)
  # 2 of 3 rollouts of a rewrite win: easier (from 0) is accepted.
  assert any(e['accepted'] and e['direction'] == 'easier' for e in decided)
  accepted = [t for t in pool if t.version > 0]
  assert accepted and all(t.active.get('goal') for t in accepted)


@pytest.mark.slow
def test_smoke_command_runs_with_kv_sessions(tmp_path):
  env = dict(os.environ, XLA_FLAGS='')
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main',
       '--config=configs/alfworld.py:smoke', f'--workdir={tmp_path}',
       '--config.rollout.sampling.session=kv',
       '--config.eval.sampling.session=kv'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'epoch 1 |' in proc.stdout
  with open(os.path.join(tmp_path, 'tb', 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert any('rollout/action_missing_frac' in r for r in rows)
