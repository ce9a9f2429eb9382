"""Plain host-side records passed between the stages of one epoch.

Everything here is JSON-friendly Python (no arrays, but for the pixels of a
vision-language prompt's `Images`), so it can be logged, checkpointed and
tested without JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

HARDER = 'harder'
EASIER = 'easier'

# Rewrite.origin values: who made a rewrite.
LLM = 'llm'  # the environment LLM's proposal
FALLBACK = 'fallback'  # the setting's generator, when no proposal was valid

TASK_LEVEL = -1  # Judgment.rollout / .step of a judgment of a whole group

# Trajectory.status values
OK = 'ok'
ERROR = 'error'  # the environment failed; excluded from training, counted

# config.feedback.mode: what the RM judges. 'steps': each policy step (agent
# settings); 'unit_tests': the RM writes tests of the task (coding).
STEPS, UNIT_TESTS = 'steps', 'unit_tests'
FEEDBACK_MODES = (STEPS, UNIT_TESTS)


@dataclasses.dataclass
class Rewrite:
  """A candidate rewrite of a task, waiting to be measured next epoch."""

  spec: dict[str, Any]
  direction: str  # HARDER | EASIER
  acc_old: float  # accuracy of the active version when the rewrite was asked
  epoch: int  # epoch in which it was created
  critiques: list[str] = dataclasses.field(default_factory=list)
  unmeasured: int = 0  # epochs in which none of its rollouts finished
  # LLM or FALLBACK (the setting marked the spec with base.FALLBACK_KEY);
  # its acceptance is counted under the same origin (curator/accepted vs
  # curator/accepted_fallback).
  origin: str = LLM


@dataclasses.dataclass
class Task:
  """One slot of the task pool: a source task, its active version, lineage."""

  task_id: str
  root: dict[str, Any]  # version 0, never changed
  active: dict[str, Any]  # the version that is rolled out
  version: int = 0
  history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  pending: Rewrite | None = None


@dataclasses.dataclass
class Images:
  """The images of one prompt, in the order of its image tokens (Qwen3-VL)."""

  pixel_values: Any  # [N, P] float32 patches, from the image processor
  grids: Any  # [n, 3] int (t, h, w) patches per image: image_grid_thw


@dataclasses.dataclass
class Step:
  """One policy turn: what it saw, what it said, what happened next."""

  prompt: str
  prompt_tokens: list[int]
  response: str
  response_tokens: list[int]
  logprobs: list[float]  # sampler log-probs of response_tokens
  action: str  # the action parsed from the response, sent to the environment
  observation: str  # the environment's reply to the action
  finish_reason: str
  prompt_cut: bool = False  # the prompt was too long and lost tokens
  images: Images | None = None  # of the prompt's image tokens
  retries: int = 0  # times the turn was sampled again (unparseable answers)


@dataclasses.dataclass
class Trajectory:
  """One rollout of one task version."""

  task_id: str
  source: str  # 'active' or 'pending' (a rewrite being measured)
  rollout: int  # 0..G-1 within the group of this task version
  spec: dict[str, Any]
  steps: list[Step] = dataclasses.field(default_factory=list)
  outcome: float = -1.0  # O: +1 success, -1 failure
  status: str = OK
  error: str | None = None
  # JSON-able facts the episode reports (its `info` dict, copied at the end),
  # e.g. per-test results of a program in the coding setting.
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def group(self) -> tuple[str, str]:
    """Rollouts of the same task version share a group (for advantages)."""
    return (self.task_id, self.source)

  def step_key(self, k: int) -> tuple[str, str, int, int]:
    """(task_id, source, rollout, k): names step k and its judgments."""
    return (self.task_id, self.source, self.rollout, k)


@dataclasses.dataclass
class Judgment:
  """One reward-model sample: of one policy step, or of a whole task version.

  Step judges (agents) score a step; unit-test judges (coding) write one test
  for the task version (rollout = step = TASK_LEVEL), run on every program.
  """

  task_id: str
  source: str
  rollout: int  # TASK_LEVEL for a judgment of the whole group
  step: int  # index into Trajectory.steps (TASK_LEVEL: none)
  sample: int  # 0..m-1
  prompt: str
  prompt_tokens: list[int]
  response: str
  response_tokens: list[int]
  logprobs: list[float]
  score: int  # S in {-1, 0, +1}; 0 when unparseable
  parsed: bool
  prompt_cut: bool = False  # the prompt was too long and lost tokens
  images: Images | None = None  # of the prompt's image tokens
  # Unit-test judges: 'test' [stdin, expected] (None: unparseable),
  # 'rollouts' and 'passed' (which programs pass it; None: not run).
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def group(self) -> tuple[str, str]:
    return (self.task_id, self.source)

  @property
  def step_key(self) -> tuple[str, str, int, int]:
    """The `Trajectory.step_key` of the step this judgment scores."""
    return (self.task_id, self.source, self.rollout, self.step)


def score(judgment: Judgment) -> int:
  """S of one judgment; an unparseable answer counts as 0."""
  return judgment.score if judgment.parsed else 0


@dataclasses.dataclass
class Example:
  """One training sequence: tokens and its scalar (sequence-level) advantage."""

  prompt_tokens: list[int]
  response_tokens: list[int]
  advantage: float
  # The sampler's log-probs of response_tokens (empty when unknown), compared
  # with the trainer's pi_old to catch sampler/trainer mismatches.
  logprobs: list[float] = dataclasses.field(default_factory=list)
  key: str = ''  # where it came from, e.g. 'task/source/rollout/step[/sample]'
  images: Images | None = None  # of the prompt's image tokens

