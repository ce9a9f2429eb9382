"""TextWorld: generated text games whose size the curator rewrites.

The embedded default's setting (`configs/default.py`): multi-turn text games
generated offline by the textworld package, played by SmolLM2 on a laptop;
the same loop as the paper's AlfWorld setting (RLANYTHING.md section 3) on
games whose rooms, objects and quest length a rewrite turns up or down.

- environment.py: `TextWorldEnv` (the protocol of envs/base.py), episodes,
  prompts, parsing and rewrites.
- text.py: pure functions on the games' text: the observation a policy
  reads, the action an answer picks, the knobs a rewrite proposes.
"""

from rla_jax.envs.textworld.environment import TextWorldEnv
from rla_jax.envs.textworld.environment import from_config
