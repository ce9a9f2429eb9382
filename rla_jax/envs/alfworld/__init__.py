"""ALFWorld: the paper's text-game benchmark (RLANYTHING.md section 3).

Config: `configs/alfworld.py` (Qwen2.5-7B; `:smollm2` on a CPU, `:smoke`
for tests). Games come from an official ALFWorld data folder or are
generated offline from the alfworld package's scenes.

- environment.py: `AlfWorldEnv` (the protocol of envs/base.py).
- games.py: the games: the official layout, offline generation, caches.
- play.py: episodes on TextWorld's PDDL engine, planner step labels.
- prompts.py: the authors' policy and judge prompts, action parsing, and
  the word-level tokenizer of random models.
- rewrite.py: rewrites of a root game's goal (3.7), checked by the planner.
"""

from rla_jax.envs.alfworld.environment import AlfWorldEnv
from rla_jax.envs.alfworld.environment import from_config
from rla_jax.envs.alfworld.prompts import make_tokenizer
