"""Tiny smoke config: random 2-layer models on the built-in lock tasks.

  python -m rla_jax.main --config=configs/tiny.py --workdir=/tmp/rla_tiny

Runs every stage (rollouts, judgments, critiques, rewrites and their
acceptance, both updates, evaluation, checkpoints) in about a minute on a
2-core CPU. Used by the tests and CI. Table 1 rows: `configs/tiny.py:policy`,
`:policy_reward`, `:outcome_only` (default `:full`).
"""

from configs import base


def get_config(arg: str = 'full'):
  config = base.get_config()
  config.seed = 0
  config.env = dict(
      name='tiny',  # rla_jax/envs/tiny.py
      num_train=12,
      num_eval=6,
      max_turns=4,
      modulus_range=(1, 4),  # opening chance per turn = 1/modulus
      stages_range=(1, 3),
      max_modulus=8,
      seed=0,
      fail_task_ids=(),  # tests: ids whose episodes crash
  )
  for name, seed in (('policy', 0), ('reward_model', 1), ('env_model', 2)):
    config[name].seed = seed
  small = dict(max_prompt_len=256, prompt_buckets=(64, 128, 256),
               batch_buckets=(16, 64, 256), max_rows=256)
  config.rollout.num_tasks = 4
  config.rollout.group_size = 4
  config.rollout.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=4,
                                 **small)
  config.judge.num_samples = 2
  # A random RM rarely writes a parseable score; constrain it to the score
  # alphabet so RM training gets data.
  config.judge.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=4,
                               stop_strings=('}',),
                               allowed_tokens=('1', '-', '+', '}'), **small)
  config.curator.rewrite_attempts = 2
  config.curator.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=8,
                                 **small)
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 1e-3
    config.train[name].update(updates_per_epoch=2, micro_batch_size=8,
                              max_prompt_len=256, max_response_len=8,
                              prompt_buckets=(64, 128, 256),
                              response_buckets=(8,), head_chunk=64,
                              share_prompts=4)  # as the default does
  config.eval.update(every=2, num_tasks=4, group_size=2, max_turns=4)
  config.eval.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=4,
                              **small)
  config.loop.update(num_epochs=3, keep_checkpoints=2, env_threads=4)
  return base.apply_ablation(config, arg)
