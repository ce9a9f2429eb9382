"""The protocol every setting implements (structural typing, no base class).

A setting is a module under rla_jax/envs/ (a package whose `__init__.py`
re-exports its face, or one file like tiny.py) named by `config.env.name`.
It provides task specs (JSON-able dicts), episodes that step on text
actions, the prompts the policy and the reward model see, and a `rewrite`
hook the curator calls to make a task harder or easier.

Everything a setting offers is listed here: what it must have
(`SettingModule.from_config`, `Environment`, `Episode`) and every optional
hook with the default the stages use without it (`SettingModule`'s
`make_tokenizer`, `OptionalHooks`, `UnitTestHooks`). A setting imports no
stage module (curator, judge, rollout, ...): what it needs from a stage is
handed in (the stages' prompt texts reach `make_tokenizer` as an argument).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from typing import Any, Protocol

# Text in, text out: the environment LLM (prompts -> completions).
GenerateFn = Callable[[Sequence[str]], list[str]]


class DataError(ValueError):
  """A user's data (a file, a folder, a task) is malformed; the message
  names where (file and line, or file and key). main prints it as one line
  and exits 2."""


# The reason key of a RewriteRejected that names none.
OTHER = 'other'
# The spec key a rewrite hook sets (to its generator's name, e.g. 'knob') on
# a task that its own generator made, standing in for the environment LLM
# when none of the LLM's proposals was valid (coding's knob_fallback). The
# curator takes the key off, records the origin on the pending rewrite
# (structs.Rewrite.origin) and counts such rewrites apart from the LLM's.
FALLBACK_KEY = 'fallback'


class RewriteRejected(Exception):
  """The environment could not turn the LLM's proposals into a valid task.

  `reason` is a short snake_case key from a small, stable set per setting
  (coding's 'contradictory_tests', 'malformed_json', ...; OTHER when the
  raiser names none): the curator counts rejections per key
  (curator/rejected_<reason>). The message gives the particulars.
  """

  def __init__(self, message: str = '', reason: str = OTHER):
    super().__init__(message)
    self.reason = reason

  def __reduce__(self):
    return (type(self), (str(self), self.reason))


class Unparseable(ValueError):
  """parse_action found no valid action in a response.

  The rollout samples that turn again (up to the environment's
  `parse_retries`); when the retries run out it executes `fallback`, an
  action the episode records as invalid (never an environment error).
  """

  def __init__(self, reason: str, fallback: str):
    super().__init__(reason)
    self.reason, self.fallback = reason, fallback


class Observation(str):
  """Observation text that also carries images (encoded PNG/JPEG bytes).

  Text-only consumers (critique prompts, logs) see the text; a vision
  setting's prompts take `images` (a GUI setting: the screenshot now, then
  the one the last action was taken on). Pickles with its images, so it
  travels between processes like the text does.
  """

  images: tuple[bytes, ...]

  def __new__(cls, text: str, images: Sequence[bytes] = ()):
    obj = super().__new__(cls, text)
    obj.images = tuple(images)
    return obj

  def __reduce__(self):
    return (Observation, (str(self), self.images))


@dataclasses.dataclass(frozen=True)
class RewardCase:
  """A play-through whose outcome is known, for the start-up reward check.

  The run plays it through the setting's own evaluator before epoch 1
  (reward_check.py): `make_episode(spec, 0, len(actions))`, `reset`, then
  `step` on each action (what `parse_action` would return) until the
  episode ends. A known pass must end +1.0, a known fail -1.0.
  """

  name: str  # names the case in the message that stops a run
  spec: dict[str, Any]
  actions: tuple[str, ...]
  passes: bool


@dataclasses.dataclass(frozen=True)
class RewriteRequest:
  """What the curator knows when it asks for a harder or easier task.

  Each setting chooses what to build from: AlfWorld rewrites the root game
  (RLANYTHING.md 3.7), coding shows the root as the anchor (5.8).
  """

  spec: dict[str, Any]  # the slot's active version (what was rolled out)
  root: dict[str, Any]  # the slot's version 0
  direction: str  # structs.HARDER | structs.EASIER
  acc_old: float  # measured accuracy of `spec` this epoch
  critiques: Sequence[str]  # the environment LLM's notes on failures
  trajectories: Sequence[Any]  # this epoch's rollouts of `spec`
  judgments: Sequence[Any]  # the RM's judgments of those rollouts
  # Filled by the hook: the reason key (RewriteRejected.reason) of each
  # proposal it turned down, whatever the request's outcome (a valid later
  # proposal, a fallback, or RewriteRejected), for curator/rejected_<reason>.
  # A hook that leaves it empty has its RewriteRejected counted instead.
  rejected: list[str] = dataclasses.field(default_factory=list)


class Episode(Protocol):
  """One play-through of one task spec; not shared between threads."""

  # Optional (default {}): JSON-able facts about the play-through, which the
  # rollout copies into `Trajectory.info` after the episode ends.
  info: dict[str, Any]

  def reset(self) -> str:
    """Starts the episode; returns the first observation."""

  def step(self, action: str) -> tuple[str, bool, float | None]:
    """Applies an action; returns (observation, done, outcome or None).

    `outcome` is +1.0 / -1.0 once the episode is decided, else None.
    Raising marks the trajectory as an environment error.
    """

  def close(self) -> None:
    """Releases resources (processes, files)."""


class Environment(Protocol):
  """A setting: task source, episodes, prompt rendering, task rewriting."""

  max_turns: int  # policy turns per training episode

  def tasks(self, split: str) -> list[dict[str, Any]]:
    """Task specs of a split: 'train' or one of the setting's evaluation
    splits (config.eval.splits); each spec has a unique 'id'."""

  def make_episode(self, spec: dict[str, Any], seed: int,
                   max_turns: int) -> Episode:
    """A fresh episode of `spec` that ends (lost) after `max_turns` turns.

    Training uses `max_turns`; evaluation its own budget (the paper's
    AlfWorld: 40 and 60). An episode whose environment knows which actions
    progress puts `step_labels` (+1 / -1 / None per step) in its `info`, for
    the RM's process accuracy.
    """

  def policy_messages(self, spec: dict[str, Any],
                      turns: Sequence[tuple[str, str]],
                      observation: str) -> list[dict[str, str]]:
    """Chat messages for the policy's next turn.

    `turns` holds (observation, action) pairs of earlier turns. A final
    'assistant' message is an answer prefix that the response continues.
    """

  def parse_action(self, response: str, observation: str) -> str:
    """The action text to execute from the policy's response.

    May raise Unparseable: the turn is then sampled again, up to the
    environment's optional `parse_retries` (default 0) times, at a
    temperature of at least its `retry_temperature` (default 0.0).
    """

  def judge_messages(self, spec: dict[str, Any], policy_prompt: str,
                     response: str, next_observation: str) -> list[dict[str,
                                                                         str]]:
    """Chat messages asking the RM to score one step (answer in \\boxed{}).

    A final 'assistant' message is an answer prefix, as in policy_messages.
    """

  def describe(self, spec: dict[str, Any]) -> str:
    """Short task text for critique and rewrite prompts."""

  def difficulty(self, spec: dict[str, Any]) -> float:
    """A scalar difficulty for metrics (higher is harder)."""

  def rewrite(self, request: RewriteRequest, generate: GenerateFn,
              attempts: int) -> dict[str, Any]:
    """A harder/easier version of `request.spec`; raises RewriteRejected."""


class OptionalHooks(Protocol):
  """What an Environment may also have; the stages read each with getattr
  and use the default named here when it is absent."""

  # Unparseable responses are sampled again up to this many times (default
  # 0), at a temperature of at least `retry_temperature` (default 0.0).
  parse_retries: int
  retry_temperature: float

  def turn_messages(self, spec: dict[str, Any], observation: str,
                    first: bool) -> list[dict[str, str]]:
    """What one turn adds to a chat held in the sampler's KV cache.

    Needed by sampling.session='kv' (rollout.py refuses that mode without
    it). `first` is True on an episode's first turn; a final 'assistant'
    message is an answer prefix, as in policy_messages.
    """

  def metrics(self, trajectories: Sequence[Any]) -> dict[str, float]:
    """The setting's own numbers for a batch of rollouts; the loop logs
    them under rollout/ and eval/<split>/ (default: none)."""

  def close(self) -> None:
    """Releases what the setting holds (desktops, servers) when the run
    ends (default: nothing to release)."""

  def reward_cases(self) -> list[RewardCase]:
    """Known passes and known fails played through the real evaluator
    before epoch 1 (config.loop.check_rewards), at least one of each; they
    should cost seconds. Default: none, and the run warns that the
    setting's rewards are unchecked."""


class UnitTestHooks(Protocol):
  """Unit-test judges (config.feedback.mode='unit_tests', the coding
  setting) replace judge_messages with these four; judge.py refuses that
  mode for an environment without them.

  Programs come from Trajectory.info['program'], which the episode also
  fills with 'gt_ratio' (the fraction of ground-truth tests passed).
  """

  def rm_messages(self, spec: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages asking the RM for ONE unit test of `spec`."""

  def parse_judgment(self, text: str) -> Any:
    """The test in an RM answer, or None when there is none."""

  def supports_unit_tests(self, spec: dict[str, Any]) -> bool:
    """Whether RM-written tests apply to `spec`."""

  def execute(self, spec: dict[str, Any], programs: Sequence[str],
              tests: Sequence[Any]) -> Any:
    """bool [P, U]: which program passes which test (a None test fails
    everywhere)."""


class SettingModule(Protocol):
  """The module `config.env.name` names (`rla_jax.envs.<name>`)."""

  def from_config(self, env_config: Any, workdir: str) -> Environment:
    """The environment of `config.env`; `workdir` holds its caches."""

  def make_tokenizer(self, stage_texts: Sequence[str] = ()) -> Any:
    """Optional: the tokenizer of random models (`:smoke`, tests).

    `stage_texts` are the texts the stages add to prompts
    (runtime.STAGE_TEXTS: the curator's critique template), so that a
    word-level vocabulary can cover them. Without this hook a config must
    name real models.
    """
