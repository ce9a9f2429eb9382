"""OSWorld: a GUI agent on a desktop (RLANYTHING.md section 4).

Config: `configs/osworld.py` (Qwen3-VL-8B policy and RM, Qwen3-8B
environment LLM; `:smoke` for tests). Screenshots in, `computer_use` tool
calls out, sent as pyautogui code through OSWorld's controller API.

- environment.py: `OSWorldEnv` (the protocol of envs/base.py), episodes,
  task loading and the tokenizer of random models.
- prompts.py: the policy and judge prompts, tool-call parsing, rewrites.
- evaluators.py: the local tasks' evaluators.
- task_formats.py: the checks of OSWorld's task format (provider 'vm').
- desktops.py: the desktops episodes run on: local ones or OSWorld's VMs.
- desktop.py: the client of one local desktop (launch/desktop.sh).
- desktop_server.py, desktop_a11y.py: the desktop's controller server and
  its accessibility tree; scripts run by the system python3, not imported.
- tasks/: the project's local tasks, in OSWorld's task format.
"""

from rla_jax.envs.osworld.environment import OSWorldEnv
from rla_jax.envs.osworld.environment import from_config
from rla_jax.envs.osworld.environment import make_tokenizer
