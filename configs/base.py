"""Defaults shared by every setting; each configs/<name>.py starts from here.

Values follow the authors' AlfWorld setting (RLANYTHING.md section 6) unless
a comment says otherwise. Not a runnable config on its own (no env/models).
"""

import ml_collections

# Table 1 rows of the paper, selectable as `--config=configs/x.py:<row>`.
ABLATIONS = ('full', 'policy', 'policy_reward', 'outcome_only')


def model_section(path: str = '') -> ml_collections.ConfigDict:
  """policy / reward_model / env_model: where the weights come from."""
  return ml_collections.ConfigDict(dict(
      path=path,  # HF folder or .gguf file; '' = random model of `random`
      dtype='float32',  # compute dtype ('bfloat16' on accelerators)
      param_dtype='float32',  # master weights
      seed=0,  # init seed of a random model
      # 'auto' (the platform's fused kernel: cuDNN on GPU, splash on TPU;
      # else 'chunked') | 'chunked' (blockwise, no [T, S] tensor) | 'xla'
      # (plain einsum) | 'cudnn' | 'splash'; see rla_jax/models/attention.py
      attention='auto',
      attention_block=512,  # query/key block of the blockwise attention
      scan_layers=True,  # layers stacked and run by lax.scan (compile time
                         # and program size independent of depth)
      random=ml_collections.ConfigDict(dict(  # used only when path == ''
          model_type='qwen2', hidden_size=64, intermediate_size=128,
          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
          tie_word_embeddings=True)),
  ))


# The authors' vLLM stop strings for the text settings (RLANYTHING.md 2.2).
# They drop the stop string and never train an EOS; we keep the stop token
# (or string) in the response and train it, so the policy learns to end its
# turn (the sampler's stop_token_ids come from the tokenizer).
AUTHORS_STOP_STRINGS = ('</answer>', 'User:', 'Human:', 'Assistant:',
                        '<|im_end|>', '<|endoftext|>')


def sampling_section(**overrides) -> ml_collections.ConfigDict:
  """Arguments of rla_jax.chat.complete / rla_jax.sampler.generate."""
  section = dict(
      temperature=0.8,
      top_p=0.95,
      top_k=0,  # 0 = off
      max_new_tokens=2000,
      max_prompt_len=2048,  # longer prompts lose the middle of their
                            # history (rla_jax/truncation.py), counted in
                            # <stage>/prompt_cut_frac
      stop_strings=AUTHORS_STOP_STRINGS,  # the response ends at the first;
                                          # it stays in the trained tokens
      allowed_tokens=(),  # constrained decoding: only these tokens (strings)
      prompt_buckets=(64, 128, 256, 512, 1024, 2048),  # padded prompt lengths
      batch_buckets=(8, 16, 32, 64, 128, 256),  # padded batch sizes
      max_rows=256,  # rows per sampler call; bigger batches are split
      # Multi-turn policy rollouts: 'none' re-renders and prefills the whole
      # history every turn (the authors' prompt) | 'kv' keeps each
      # conversation in the sampler's KV cache as a chat and appends only
      # the new turn (rla_jax/chat.py); single prompts (RM, curator) are
      # sampled as usual either way.
      session='none',
      cache_bucket=512,  # 'kv': the cache grows in multiples of this many
                         # slots (each size compiles once)
      # On CPU, calls of at least this many new tokens decode with unrolled
      # layers over a per-layer KV cache (rla_jax/sampler.py): SmolLM2-135M
      # at 16 rows, 153 -> 87 ms a step, for ~2.7x the compile time of the
      # call's program (2.3 -> 6.3 s) and a copy of the layer weights while
      # it runs; short generations (scores, one-line actions) keep the
      # scanned loop. 0 = never. Accelerators keep the scanned loop.
      unroll_decode_from=64,
  )
  section.update(overrides)
  return ml_collections.ConfigDict(section)


def optim_section(**overrides) -> ml_collections.ConfigDict:
  """rla_jax.optim.make_optimizer: AdamW + schedule + clipping."""
  section = dict(
      learning_rate=1e-6,
      schedule='constant',  # 'constant' | 'cosine' | 'linear' (B2: ours is real)
      warmup_steps=0,
      decay_steps=0,  # cosine/linear horizon in optimizer steps (0 = none)
      min_lr_ratio=0.0,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      weight_decay=0.0,
      max_grad_norm=1.0,  # on the true averaged gradient (B3 fixed)
      mu_dtype='float32',  # Adam's first moment: 'float32' | 'bfloat16'
                           # (saves a quarter of the optimizer memory)
      reset_every_epoch=False,  # True = the authors' fresh Adam per RL step
  )
  section.update(overrides)
  return ml_collections.ConfigDict(section)


def train_section(**overrides) -> ml_collections.ConfigDict:
  """rla_jax.train: loss, batching and update schedule of one model."""
  section = dict(
      updates_per_epoch=4,  # optimizer steps per RL epoch (update_per_step)
      global_batch_size=0,  # sequences per optimizer step; 0 = split the
                            # epoch's data into updates_per_epoch steps
      micro_batch_size=8,  # sequences per micro-batch (gradient accumulation)
      max_prompt_len=0,  # 0 = the sampler's (rollout / judge max_prompt_len)
      max_response_len=0,  # 0 = the sampler's max_new_tokens; longer
                           # responses are truncated
      overlong_prompt='truncate',  # 'truncate' (keep the end) | 'drop'; the
                                   # triple stays aligned either way (B1)
      prompt_buckets=(256, 512, 1024, 2048),  # padded prompt lengths
      response_buckets=(64, 256, 1024, 2048),  # padded response lengths
      clip_eps=0.2,
      kl_coef=0.01,  # k3 KL against kl_reference
      kl_reference='pi_old',  # 'pi_old' (the authors: the pre-update weights
                              # of each epoch) | 'initial' (a frozen copy of
                              # the starting weights; one more model copy)
      logprob_gap_warn=0.05,  # warn when mean |sampler - trainer| log-prob
                              # over response tokens exceeds this
      log_ratio_clamp=10.0,
      entropy_coef=0.0,
      compute_entropy=True,  # report the policy entropy (~4% of a step)
      aggregation='sequence',  # 'sequence' (paper) | 'token'
      head_chunk=512,  # tokens per chunk of the output head (memory)
      share_prompts=1,  # up to this many responses with the same prompt
                        # share one row and one pass over the prompt (the
                        # G first turns of a task, the m judgments of a
                        # step); > 1 runs the 'chunked' attention kernel on
                        # those steps (batching.pack)
      grad_accum_dtype='float32',  # the running gradient sum over micro-
                                   # batches: 'float32' | 'bfloat16' (half
                                   # that buffer; each micro-batch's gradient
                                   # is still float32)
      remat='none',  # what the backward pass recomputes of each layer:
                     # 'none' | 'full' (keep only layer inputs) |
                     # 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
                     # (keep matmul outputs); with scan_layers it cuts
                     # activation memory on CPU too
      shuffle=True,  # seeded grain shuffle before splitting into steps
                     # (the authors don't shuffle)
      max_nonfinite_steps=8,  # a step with a non-finite loss or gradient
                              # norm is skipped; this many in a row (across
                              # epochs and resumes) stop the run
      seed=0,
  )
  section.update(overrides)
  return ml_collections.ConfigDict(section)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 10086

  # Device mesh ('data', 'fsdp', 'tensor'); one size may be -1 (the rest).
  config.mesh = dict(data=1, fsdp=-1, tensor=1, rules=())

  config.env = ml_collections.ConfigDict()  # set by each setting's config

  config.policy = model_section()
  config.reward_model = model_section()
  config.env_model = model_section()  # frozen; critiques and rewrites

  config.rollout = dict(
      num_tasks=16,  # sampled task slots per epoch (+ all pending rewrites)
      group_size=8,  # rollouts per task (G)
      sampling=sampling_section(),
  )
  config.judge = dict(
      num_samples=3,  # m RM judgments per policy step
      sampling=sampling_section(max_new_tokens=4000, max_prompt_len=4096),
  )
  config.feedback = dict(
      mode='steps',  # 'steps': the RM judges every step, integrated
                     # feedback (agents) | 'unit_tests': the RM writes unit
                     # tests run on every program (coding, RLANYTHING.md 5)
      lam=1.0,  # R = O + lam * mean_j S_j; 0 = outcome-only GRPO
      eps=1e-8,  # std below this -> advantage 0
      singleton='zero',  # one rollout at a step index: 'zero' | 'raw' (B11)
      parse_penalty=-2.0,  # RM reward for an unparseable score
      policy_filter='mixed',  # policy data only from groups where 'mixed':
                              # some but not all rollouts won (any G) |
                              # 'band': accuracy in [low, high] below
      policy_acc_low=0.125,
      policy_acc_high=0.875,
      rm_acc_low=0.2,  # RM data only from tasks in this band
      rm_acc_high=0.8,
      unit_test_reward='gt',  # mode 'unit_tests': the policy's reward is the
                              # GT pass ratio ('gt', the authors) or plus lam
                              # x the share of correct-looking RM tests passed
                              # ('integrated', the paper's claim, B5)
  )
  config.curator = dict(
      enabled=True,
      critiques=True,  # the env LLM explains failed rollouts for rewrites
                       # (coding: the tests' pass rates are the critique)
      alpha_low=0.2,  # acc <= alpha_low -> easier
      easier_strict=False,  # True: acc < alpha_low -> easier (coding, 5.8)
      alpha_high=0.8,  # acc >= alpha_high -> harder
      rewrite_attempts=8,  # env-LLM proposals per rewrite
      pending_max_tries=2,  # epochs a rewrite may go unmeasured (its
                            # rollouts all errored) before it is dropped
      critique_max_chars=300,  # agent response / RM rationale per high-risk
                               # step shown in a critique prompt
      critique_observation_chars=0,  # each step's observation there is
                                     # clipped to this (0: whole)
      answer_prefix='',  # pre-fills the env LLM's answers (small models)
      sampling=sampling_section(max_new_tokens=8192, max_prompt_len=8192),
  )
  config.optim = dict(policy=optim_section(), reward_model=optim_section())
  config.train = dict(policy=train_section(),
                      reward_model=train_section(
                          prompt_buckets=(256, 512, 1024, 2048, 4096),
                          response_buckets=(64, 256, 1024, 4096)))
  config.eval = dict(
      every=5,  # epochs between evaluations (0 = never); also before/after
      splits=('eval',),  # evaluation splits of the environment, each logged
                         # as eval/<split>/...
      num_tasks=32,  # held-out tasks per split
      group_size=1,
      max_turns=60,  # turn budget of an evaluation episode (AlfWorld: 60
                     # vs 40 in training)
      judge=True,  # the RM judges evaluation rollouts: eval/<split>/rm_*
      sampling=sampling_section(),
  )
  config.loop = dict(
      num_epochs=200,
      train_rm=True,  # False = frozen RM (Table 1 "Policy" row)
      checkpoint_every=1,
      keep_checkpoints=3,
      env_threads=8,  # concurrent environment steps on the host
      compilation_cache_dir='~/.cache/rla_jax/xla',  # '' = no persistent cache
      compilation_cache_min_s=0.0,  # cache programs that took this long to
                                    # compile (0: all; a tiny run 10% faster)
      check_rewards=True,  # before epoch 1, play the setting's known-pass
                           # and known-fail cases through its evaluator
                           # (reward_check.py); a wrong outcome stops the run
      preempt_grace_s=30.0,  # SIGTERM/SIGINT: seconds to stop cleanly with
                             # a checkpoint before exiting anyway; keep it
                             # below the cluster's kill delay
      allow_config_change=False,  # resume a workdir whose config.json
                                  # differs in a key of the experiment
                                  # (runtime.RESUMABLE_KEYS are always free)
  )
  return config


def split_options(arg: str, options: tuple[str, ...]
                  ) -> tuple[list[str], list[str]]:
  """`arg` after the colon -> (every option given, its Table-1 rows).

  `options` are the config's own switches (e.g. 'smoke'); the rest are rows
  for apply_ablation, 'full' when none is given.
  """
  given = [a for a in (arg or 'full').split(',') if a]
  return given, [a for a in given if a not in options] or ['full']


def apply_ablation(config: ml_collections.ConfigDict, row: str):
  """Switches for the paper's Table 1 rows (and outcome-only GRPO)."""
  if row not in ABLATIONS:
    raise ValueError(f'unknown ablation {row!r}; choose from {ABLATIONS}')
  if row in ('policy', 'outcome_only'):
    config.loop.train_rm = False
  if row in ('policy', 'policy_reward', 'outcome_only'):
    config.curator.enabled = False
  if row == 'outcome_only':
    config.feedback.lam = 0.0
  return config
