"""One run's state between epochs (`Run`): built from a config, validated.

`setup` loads the three models, builds both trainers, the environment and
the task pool; `validate` rejects inconsistent configs naming the key.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import json
from concurrent import futures
import os
from typing import Any

import grain
import jax
from flax import nnx

from rla_jax import curator
from rla_jax import feedback
from rla_jax import metrics
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train
from rla_jax.models import loading
from rla_jax.models import transformer

KL_REFERENCES = ('pi_old', 'initial')
# Texts the stages put into prompts (the environment LLM sees critiques in
# the curator's template), handed to a setting's make_tokenizer hook.
STAGE_TEXTS = (curator.CRITIQUE_TEMPLATE,)
# Which sampler section feeds which model's training data.
_SAMPLED_BY = {'policy': 'rollout', 'reward_model': 'judge'}


@dataclasses.dataclass
class Run:
  """Everything one run holds between epochs (host side)."""

  config: Any
  workdir: str
  mesh: Any
  rules: tuple
  env: Any
  tokenizers: dict[str, Any]
  graphdefs: dict[str, Any]
  trainers: dict[str, train.Trainer]
  states: dict[str, train.TrainState]
  env_params: Any  # frozen environment-LLM parameters
  ref_params: dict[str, Any]  # frozen KL references (kl_reference='initial')
  pool: list[structs.Task]
  order: Any  # grain iterator over slot indices (checkpointed position)
  writer: metrics.Writer
  executor: futures.ThreadPoolExecutor
  chief: bool
  saved_epoch: int = 0  # newest epoch with a committed checkpoint
  eval_pending: bool = False  # its evaluation was skipped by a stop


def train_limits(config, name: str) -> tuple[int, int]:
  """(max_prompt_len, max_response_len) of model `name`'s training data.

  0 in config.train.<name> means the limit of the sampler that produced the
  data (rollout for the policy, judge for the RM), so by default nothing is
  trained on a context it was not sampled from.
  """
  sampled = config[_SAMPLED_BY[name]].sampling
  limits = config.train[name]
  return (limits.max_prompt_len or sampled.max_prompt_len,
          limits.max_response_len or sampled.max_new_tokens)


class ConfigError(ValueError):
  """A config value the user must fix; the message names the key (main
  prints it as one line and exits 2)."""


def _check(config, ok: bool, key: str, why: str):
  if not ok:
    raise ConfigError(f'config.{key}={lookup(config, key)!r}: {why}')


def check_paths(config) -> None:
  """ConfigError for a model path that names nothing on this machine."""
  for name in ('policy', 'reward_model', 'env_model'):
    path = config[name].path
    _check(config, not path or os.path.exists(path), f'{name}.path',
           'does not exist (a model folder or .gguf file; set it with '
           f'--config.{name}.path=...)')


def validate(config) -> None:
  """Rejects inconsistent values with the config key that is wrong.

  Reads nothing but the config (check_paths looks at the files); runs
  before anything is loaded or written, so a bad value leaves no workdir
  behind.
  """
  check = functools.partial(_check, config)
  check(importlib.util.find_spec(f'rla_jax.envs.{config.env.name}')
        is not None, 'env.name', 'no setting of that name in rla_jax/envs/')

  check(config.loop.num_epochs >= 0, 'loop.num_epochs', 'must be >= 0')
  check(config.rollout.num_tasks >= 1, 'rollout.num_tasks', 'must be >= 1')
  check(config.rollout.group_size >= 1, 'rollout.group_size', 'must be >= 1')
  check(config.judge.num_samples >= 1, 'judge.num_samples', 'must be >= 1')
  check(0 <= config.curator.alpha_low < config.curator.alpha_high <= 1,
        'curator.alpha_low', 'need 0 <= alpha_low < alpha_high <= 1')
  check(config.curator.pending_max_tries >= 1, 'curator.pending_max_tries',
        'must be >= 1 (epochs a rewrite may go without a measurement)')
  check(config.feedback.singleton in ('raw', 'zero'), 'feedback.singleton',
        "must be 'raw' or 'zero'")
  check(config.feedback.policy_filter in feedback.POLICY_FILTERS,
        'feedback.policy_filter', f'must be one of {feedback.POLICY_FILTERS}')
  check(config.feedback.mode in structs.FEEDBACK_MODES, 'feedback.mode',
        f'must be one of {structs.FEEDBACK_MODES}')
  check(config.feedback.unit_test_reward in feedback.UNIT_TEST_REWARDS,
        'feedback.unit_test_reward',
        f'must be one of {feedback.UNIT_TEST_REWARDS}')
  check(config.loop.checkpoint_every >= 1, 'loop.checkpoint_every',
        'must be >= 1')
  check(config.eval.max_turns >= 1, 'eval.max_turns', 'must be >= 1')
  check(bool(config.eval.splits) or not config.eval.every, 'eval.splits',
        'name at least one evaluation split (or set eval.every=0)')
  trained = ('policy', 'reward_model') if config.loop.train_rm else (
      'policy',)
  for name in ('policy', 'reward_model'):
    check(config.train[name].kl_reference in KL_REFERENCES,
          f'train.{name}.kl_reference', f'must be one of {KL_REFERENCES}')
    check(config.train[name].logprob_gap_warn >= 0,
          f'train.{name}.logprob_gap_warn', 'must be >= 0')
    transformer.check_remat(config.train[name].remat,
                            f'config.train.{name}.remat')
  for name in trained:
    sampled = f'{_SAMPLED_BY[name]}.sampling'
    prompt, response = train_limits(config, name)
    for key, limit, sampler_key in (
        ('max_prompt_len', prompt, 'max_prompt_len'),
        ('max_response_len', response, 'max_new_tokens')):
      have = lookup(config, f'{sampled}.{sampler_key}')
      check(limit >= have, f'train.{name}.{key}',
            f'shorter than config.{sampled}.{sampler_key}={have}: {name} '
            'training would see cut contexts it never sampled from; raise '
            'it (and its buckets) or set it to 0 (= the sampler\'s)')


def lookup(config, key: str):
  for part in key.split('.'):
    config = config[part]
  return config


# ---- a resumed run's config against the one its workdir was run with -------

# Keys a resume may change without changing the experiment (fnmatch patterns
# over dotted keys): how long it runs, how it is checkpointed, compiled,
# stopped and laid out on the devices, and memory knobs that compute the
# same update. Every other key (models, the setting env.*, the Table-1
# switches loop.train_rm / curator.enabled / feedback.lam, seeds, optimisers,
# samplers, evaluation tasks) is the experiment: changing it on resume needs
# loop.allow_config_change=True.
RESUMABLE_KEYS = (
    'loop.num_epochs',  # the total; raise it to train on
    'loop.allow_config_change',
    'loop.checkpoint_every',
    'loop.keep_checkpoints',
    'loop.compilation_cache_dir',
    'loop.compilation_cache_min_s',
    'loop.env_threads',
    'loop.check_rewards',  # a start-up check only
    'loop.preempt_grace_s',
    'eval.every',  # evaluation draws its own seeds; training is unchanged
    'mesh.*',  # another machine or slice
    'train.*.micro_batch_size',  # gradient accumulation of the same batch
    'train.*.remat',
    'train.*.head_chunk',
    'train.*.logprob_gap_warn',  # a warning threshold
)


class ConfigChangeError(ConfigError):
  """The config differs from the workdir's run in a key of the experiment."""


def _flat(tree, prefix: str = '') -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flat(value, f'{prefix}{key}.'))
  return flat


def as_json(config) -> dict[str, Any]:
  """The config as the workdir's config.json holds it.

  Through JSON (tuples become lists), with the training limits that are 0
  (= the sampler's) resolved, as `setup` resolves them before writing it.
  """
  tree = json.loads(config.to_json_best_effort())
  for name in _SAMPLED_BY:
    limits = tree['train'][name]
    limits['max_prompt_len'], limits['max_response_len'] = train_limits(
        config, name)
  return tree


def config_changes(previous: dict[str, Any], config
                   ) -> list[tuple[str, Any, Any]]:
  """(key, previous value, new value) of each experiment key that differs.

  `previous` is a run's config.json. Keys in RESUMABLE_KEYS are not
  compared, nor keys only one side has (a key added to the code since keeps
  the old behaviour at its default).
  """
  old, new = _flat(previous), _flat(as_json(config))
  return [(key, old[key], new[key]) for key in sorted(old.keys() & new.keys())
          if old[key] != new[key]
          and not any(fnmatch.fnmatchcase(key, p) for p in RESUMABLE_KEYS)]


def make_env(config, workdir: str):
  """The setting's module (a package under rla_jax/envs/, or tiny.py) and
  its environment. `validate` has checked that the module exists."""
  try:
    module = importlib.import_module(f'rla_jax.envs.{config.env.name}')
  except ModuleNotFoundError as e:
    raise ConfigError(f'config.env.name={config.env.name!r}: the setting '
                      f'needs a package that is not installed ({e})') from e
  return module, module.from_config(config.env, workdir)


def setup(config, workdir: str) -> Run:
  chief = jax.process_index() == 0
  mesh = sharding.mesh_from_config(config.mesh)
  rules = sharding.resolve_rules(config.mesh.rules)
  env_module, env = make_env(config, workdir)
  make_tokenizer = getattr(env_module, 'make_tokenizer', None)
  if make_tokenizer is not None:
    # Word-level vocabularies cover the texts the stages add to prompts.
    make_tokenizer = functools.partial(make_tokenizer, STAGE_TEXTS)
  graphdefs, params, tokenizers = {}, {}, {}
  with sharding.use(mesh, rules):
    for name in ('policy', 'reward_model', 'env_model'):
      model, tokenizers[name] = loading.from_config(
          config[name], name=name, mesh=mesh, rules=rules,
          make_tokenizer=make_tokenizer)
      graphdefs[name], state = nnx.split(model)
      params[name] = nnx.to_pure_dict(state)
  trainers, states, ref_params = {}, {}, {}
  for name, kind in (('policy', train.POLICY), ('reward_model', train.REWARD)):
    limits = config.train[name]
    # 0 = the sampler's limit (train_limits); resolved once, so the written
    # config.json and the trainer see the numbers in use.
    limits.max_prompt_len, limits.max_response_len = train_limits(config,
                                                                  name)
    trainers[name] = train.Trainer(graphdefs[name], config.optim[name],
                                   limits, mesh, rules, kind=kind)
    if limits.kl_reference == 'initial':
      # A frozen copy of the starting weights (one more copy of the model in
      # memory). The train state's arrays are donated at every step, so the
      # reference must not share buffers with them. On resume the weights are
      # loaded from the same path again, so the reference is unchanged.
      ref_params[name] = jax.tree.map(lambda x: x.copy(), params[name])
    # The state holds its own copy; dropping the loaded one here keeps one
    # copy of each model's weights in memory at a time during set-up.
    states[name] = trainers[name].init_state(params.pop(name))
  pool = curator.build_pool(env.tasks('train'))
  order = iter(grain.MapDataset.range(len(pool)).shuffle(seed=config.seed)
               .repeat().to_iter_dataset())
  return Run(config=config, workdir=workdir, mesh=mesh, rules=rules, env=env,
             tokenizers=tokenizers, graphdefs=graphdefs, trainers=trainers,
             states=states, env_params=params['env_model'],
             ref_params=ref_params, pool=pool, order=order,
             writer=metrics.Writer(os.path.join(workdir, 'tb'), enabled=chief),
             executor=futures.ThreadPoolExecutor(config.loop.env_threads),
             chief=chief)
