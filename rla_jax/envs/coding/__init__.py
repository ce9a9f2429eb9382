"""Coding: programs judged by unit tests (RLANYTHING.md section 5).

Config: `configs/coding.py` (CodeContests -> LiveBench with Qwen2.5-7B,
HumanEval offline; `:smoke` for tests). The RM writes unit tests instead of
judging steps (config.feedback.mode='unit_tests').

- environment.py: `CodingEnv` (the protocol of envs/base.py, with the
  unit-test hooks), program and test parsing, episodes.
- data.py: problem loaders (JSONL, HumanEval, the built-in set).
- rewrite.py: problem rewrites (5.8), checked by running their tests.
- sandbox.py: runs untrusted programs and tests under bubblewrap;
  sandbox_harness.py is the script that runs inside it.
"""

from rla_jax.envs.coding.environment import CodingEnv
from rla_jax.envs.coding.environment import from_config
from rla_jax.envs.coding.environment import make_tokenizer
