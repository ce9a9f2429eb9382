"""Coding setting (RLANYTHING.md 5): programs, unit tests, problem rewrites.

The policy writes one program per sample (the last ```python block of its
answer); the episode runs it on the problem's ground-truth (GT) tests in the
sandbox, once, and ends: +1 if every test passes, else -1, with per-test
results in `info`. The reward model does not judge steps: each RM sample
writes ONE unit test (`rm_messages`, `parse_unit_test`), which runs against
every program of the task (`execute`); rla_jax.feedback turns those results
into the policy's and the RM's rewards (config.feedback.mode='unit_tests').
The curator's rewrites (rewrite.py) are rejected when their tests
contradict each other, and annotated by running the old solvers on them.
"""

from __future__ import annotations

from collections.abc import Sequence
import re
import string
from typing import Any

import numpy as np

from rla_jax.envs import base
from rla_jax.envs import word_tokenizer
from rla_jax.envs.coding import data as coding_data
from rla_jax.envs.coding import rewrite as coding_rewrite
from rla_jax.envs.coding import sandbox

POLICY_PROMPT = (
    'Solve the following programming problem in Python 3. First think about '
    'the problem and an efficient approach, then write the complete program '
    'in one ```python code block. The program reads its input with input() '
    '(or sys.stdin) and writes the answer with print().')
EVAL_NOTE = (
    'Compute the output from the input the program reads; do not print the '
    'answers of the examples in the statement.')
HUMANEVAL_PROMPT = (
    'Complete the following Python function. Think first, then write the '
    'whole function (with any imports it needs) in one ```python code '
    'block.\n\n```python\n{prompt}```')
RM_PROMPT = """You are a rigorous unit-test designer for programming problems.

=== Problem ===
{question}

=== Your task ===
Write exactly ONE new test example for this problem: an input and the output \
a correct program prints for it. The test must be correct (it follows the \
input format and constraints, and the output is exactly right) and \
discriminative (it catches wrong or slow programs: edge cases, tricky \
cases). Reason step by step: design an input you can handle, compute its \
output carefully, and if you are not sure of the output, design a simpler \
input instead.

End your answer with exactly this format:
**Test Input:**
```
the input
```
**Test Output:**
```
the output
```
**Explanation:** why this output is right."""
# Statuses of tests that were not run because there was no program.
NO_PROGRAM = 'no_program'

_FENCE = re.compile(r'```([^\n`]*)\n(.*?)```', re.DOTALL)
_OPEN_FENCE = re.compile(r'```[ \t]*(?:python3?|py)[ \t]*\n', re.IGNORECASE)
_PYTHON_TAG = re.compile(r'\s*(?:python3?|py)\s*$', re.IGNORECASE)
# The RM's answer markers (5.4): bold with a colon, '**Test Input:**', or
# the colon just outside the stars ('**Test Input**:'), any letter case.
# Stars and colon are required: the reasoning and the explanation talk about
# 'the test input' in prose, and prose must never start a section.
_MARKER = r'\*\*[ \t]*%s[ \t]*(?::[ \t]*\*\*|\*\*[ \t]*:)'
_INPUT_MARKER = re.compile(_MARKER % r'test[ \t]+input', re.IGNORECASE)
_OUTPUT_MARKER = re.compile(_MARKER % r'test[ \t]+output', re.IGNORECASE)
_END_MARKER = re.compile(_MARKER % 'explanation', re.IGNORECASE)
ALPHABET = string.printable.replace('\x0b', '').replace('\x0c', '').replace(
    '\r', '')


def make_tokenizer(stage_texts: Sequence[str] = ()):
  """A character-level tokenizer over printable ASCII, for random models
  (it covers the stages' texts, `stage_texts`, as it is)."""
  del stage_texts
  return word_tokenizer.make_tokenizer(tuple(ALPHABET))


# Parsing model answers.


def extract_program(text: str) -> str:
  """The last ```python block (else the last untagged one) of `text`.

  A python block left open at the end (the answer hit its token limit)
  counts only when no block is complete. '' when there is none.
  """
  blocks = _FENCE.findall(text)
  for wanted in (lambda tag: bool(_PYTHON_TAG.match(tag)),
                 lambda tag: not tag.strip()):
    found = [body for tag, body in blocks if wanted(tag)]
    if found:
      return found[-1]
  opened = list(_OPEN_FENCE.finditer(text))
  return text[opened[-1].end():] if opened else ''


def _section(text: str) -> str:
  """The last complete fenced block of a section, else its plain text."""
  blocks = _FENCE.findall(text)
  body = blocks[-1][1] if blocks else text.replace('```', '')
  return body.replace('\r\n', '\n').replace('\r', '\n').strip('\n')


def parse_unit_test(text: str) -> tuple[str, str] | None:
  """(stdin, expected stdout) of an RM answer, None when a part is missing.

  RLANYTHING.md 5.4: the last '**Test Input:**' marker followed by a
  '**Test Output:**' marker; each part is the last fenced block after its
  marker (the input's ends at the output marker, the output's at
  '**Explanation:**' or the end), else the plain text there; CRLF -> LF,
  leading and trailing newlines stripped. Markers need their bold stars
  and colon (see _MARKER); letter case and a colon outside the stars are
  tolerated, as models write them.
  """
  text = text.replace('\r\n', '\n')
  for start in reversed(list(_INPUT_MARKER.finditer(text))):
    out = _OUTPUT_MARKER.search(text, start.end())
    if out is None:
      continue
    end = _END_MARKER.search(text, out.end())
    stdin = _section(text[start.end():out.start()])
    expected = _section(text[out.end():end.start() if end else len(text)])
    if stdin.strip() and expected.strip():
      return stdin, expected
    return None
  return None


# Running unit tests and the rewards built on them (pure numpy).


def run_unit_tests(programs: Sequence[str],
                   tests: Sequence[tuple[str, str] | None],
                   time_limit_s: float, *, limits: sandbox.Limits,
                   workers: int | None = None
                   ) -> tuple[np.ndarray, list[list[str]]]:
  """passes_PxU and statuses: every test against every program.

  One sandboxed process per program runs all U tests; None tests are
  'invalid_test' (fail everywhere), empty programs fail without running.
  Raises sandbox.SandboxError when the sandbox itself breaks.
  """
  tests = [tuple(t) if t is not None else None for t in tests]
  jobs = [i for i, p in enumerate(programs) if p and p.strip()]
  results = sandbox.run_many([(programs[i], tests) for i in jobs],
                             time_limit_s, limits=limits, workers=workers)
  statuses = [[NO_PROGRAM] * len(tests) for _ in programs]
  for i, rs in zip(jobs, results):
    statuses[i] = [r.status for r in rs]
  passes = np.array([[s == sandbox.OK for s in row] for row in statuses],
                    dtype=bool).reshape(len(programs), len(tests))
  return passes, statuses


def sandbox_counts(trajectories) -> dict[str, int]:
  """sandbox/<status>: GT test verdicts of this epoch's finished rollouts."""
  counts: dict[str, int] = {}
  for traj in trajectories:
    for status in (getattr(traj, 'info', None) or {}).get('gt_status', ()):
      counts[f'sandbox/{status}'] = counts.get(f'sandbox/{status}', 0) + 1
  return counts


# The environment.


class CodingEpisode:
  """Runs one program on the GT tests of one problem."""

  def __init__(self, spec: dict[str, Any], limits: sandbox.Limits):
    self.spec = spec
    self.limits = limits
    self.info: dict[str, Any] = {}
    self._done = False

  def reset(self) -> str:
    return self.spec['question']

  def step(self, action: str) -> tuple[str, bool, float | None]:
    if self._done:
      raise RuntimeError('step() after the episode ended')
    self._done = True
    tests = coding_data.gt_tests(self.spec)
    program = coding_data.program_for(self.spec, action)
    if action.strip():
      results = sandbox.run(program, tests, self.spec['time_limit_s'],
                            limits=self.limits)  # SandboxError: an env error
      statuses = [r.status for r in results]
    else:
      statuses = [NO_PROGRAM] * len(tests)
    passed = [s == sandbox.OK for s in statuses]
    ratio = sum(passed) / len(passed) if passed else 0.0
    self.info = {'gt_passed': passed, 'gt_status': statuses,
                 'program': program, 'gt_ratio': ratio}
    solved = bool(passed) and all(passed)
    summary = ', '.join(f'{statuses.count(s)} {s}'
                        for s in dict.fromkeys(statuses)) or 'no tests'
    return (f'passed {sum(passed)}/{len(passed)} tests ({summary})', True,
            1.0 if solved else -1.0)

  def close(self) -> None:
    pass


class CodingEnv:
  """Coding problems (see the module docstring and base.py)."""

  max_turns = 1

  def __init__(self, env_config):
    """`env_config`: config.env of configs/coding.py (keys documented there)."""
    self.config = env_config
    self.limits = sandbox.Limits(**env_config.sandbox)
    self.answer_prefix = env_config.answer_prefix
    self.judge_prefix = env_config.judge_prefix
    self._tasks: dict[str, list[dict[str, Any]]] = {}

  def tasks(self, split: str) -> list[dict[str, Any]]:
    """'train' (config.env.train_data) or an evaluation split: 'humaneval',
    'builtin' (held-out generated problems) or a name of
    config.env.eval_files (livebench, livecodebench, codecontests)."""
    if split not in self._tasks:
      specs = self._load(split)
      if split != 'train':
        specs = [{**s, 'split': split} for s in specs]
      self._tasks[split] = specs
    return self._tasks[split]

  def _load(self, split):
    c = self.config
    if split == 'train':
      data, count = c.train_data, c.num_train
    elif split in ('humaneval', 'builtin'):
      data, count = split, c.num_eval
    elif split in c.eval_files:
      data, count = c.eval_files[split], c.num_eval
      if not data:
        raise ValueError(f'config.eval.splits has {split!r} but '
                         f'config.env.eval_files.{split} is not set (a '
                         'JSONL file, see rla_jax/envs/coding/data.py)')
    else:
      raise ValueError(f'unknown coding split {split!r}: train, humaneval, '
                       f'builtin or one of {sorted(c.eval_files)}')
    if data == 'builtin':
      b = c.builtin
      return coding_data.builtin_tasks(
          'train' if split == 'train' else 'eval', count, seed=b.seed,
          num_tests=b.num_tests, levels=tuple(b.levels),
          time_limit_s=c.time_limit_s, kinds=tuple(b.kinds))
    if data == 'humaneval':
      specs = coding_data.load_humaneval(c.time_limit_s)
    elif split in ('train', 'codecontests'):
      specs = coding_data.load_codecontests(
          data, time_limit_s=c.time_limit_s, max_tests=c.max_tests)
    else:
      specs = coding_data.load_livebench(
          data, time_limit_s=c.time_limit_s, max_tests=c.max_tests)
    return specs[:count] if count else specs

  def make_episode(self, spec: dict[str, Any], seed: int,
                   max_turns: int = 1) -> CodingEpisode:
    del seed, max_turns  # fixed tests, one turn; the randomness is the policy's
    return CodingEpisode(spec, self.limits)

  def reward_cases(self) -> list[base.RewardCase]:
    """A stdin/stdout problem and a HumanEval-style assert check, each with
    a right and a wrong program, through the sandbox as rollouts run it."""
    limit = self.config.time_limit_s
    io = {'id': 'reward-check-io', 'time_limit_s': limit,
          'question': 'Read two integers and print their sum.',
          'tests': [['1 2\n', '3\n'], ['-5 7\n', '2\n'],
                    ['1000000000000 1\n', '1000000000001\n']]}
    check = {'id': 'reward-check-assert', 'time_limit_s': limit,
             'question': 'Complete add(a, b).',
             'prompt': 'def add(a, b):\n    """Returns a + b."""\n',
             'check': ('def check(candidate):\n'
                       '    assert candidate(1, 2) == 3\n'
                       '    assert candidate(-5, 7) == 2\n\n'
                       'check(add)\n')}
    read = 'a, b = map(int, input().split())\n'
    return [
        base.RewardCase('stdin/stdout: a right program', io,
                        (read + 'print(a + b)\n',), True),
        base.RewardCase('stdin/stdout: a wrong program', io,
                        (read + 'print(a - b)\n',), False),
        base.RewardCase('assert check: a right body', check,
                        ('    return a + b\n',), True),
        base.RewardCase('assert check: a wrong body', check,
                        ('    return a - b\n',), False)]

  def policy_messages(self, spec, turns, observation):
    del turns, observation  # one turn; the problem is in the spec
    if spec.get('prompt'):
      text = HUMANEVAL_PROMPT.format(prompt=spec['prompt'])
    else:
      text = f'{POLICY_PROMPT}\n\n{spec["question"]}'
      if spec.get('split', 'train') != 'train':
        text += f'\n\n{EVAL_NOTE}'
    messages = [{'role': 'user', 'content': text}]
    if self.answer_prefix:
      messages.append({'role': 'assistant', 'content': self.answer_prefix})
    return messages

  def parse_action(self, response: str, observation: str) -> str:
    del observation
    if self.answer_prefix and not response.startswith(self.answer_prefix):
      response = self.answer_prefix + response
    return extract_program(response)

  def execute(self, spec: dict[str, Any], programs: Sequence[str],
              tests: Sequence[tuple[str, str] | None]) -> np.ndarray:
    """passes_PxU of the RM's tests on the programs of a task (sandboxed)."""
    return run_unit_tests(programs, tests, spec['time_limit_s'],
                          limits=self.limits,
                          workers=self.config.workers or None)[0]

  def metrics(self, trajectories) -> dict[str, float]:
    """code (GT pass-all rate), gt_pass_ratio and sandbox_<status> counts."""
    done = [t for t in trajectories if t.info.get('gt_status') is not None]
    out = {f'sandbox_{k.split("/", 1)[1]}': float(v)
           for k, v in sandbox_counts(done).items()}
    if done:
      out['code'] = float(np.mean([t.outcome > 0 for t in done]))
      out['gt_pass_ratio'] = float(np.mean([t.info['gt_ratio'] for t in done]))
    return out

  def supports_unit_tests(self, spec: dict[str, Any]) -> bool:
    """RM tests are stdin/stdout pairs: not for assert-style problems."""
    return not spec.get('check')

  def rm_messages(self, spec: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages asking the RM for ONE new unit test (5.4)."""
    messages = [{'role': 'user',
                 'content': RM_PROMPT.format(question=spec['question'])}]
    if self.judge_prefix:
      messages.append({'role': 'assistant', 'content': self.judge_prefix})
    return messages

  def judge_messages(self, spec, policy_prompt, response, next_observation):
    """The RM prompt; per task, not per program (see rm_messages)."""
    del policy_prompt, response, next_observation
    return self.rm_messages(spec)

  def parse_judgment(self, text: str) -> tuple[str, str] | None:
    """parse_unit_test on the answer prefix + the RM's completion."""
    if self.judge_prefix and not text.startswith(self.judge_prefix):
      text = self.judge_prefix + text
    return parse_unit_test(text)

  def describe(self, spec: dict[str, Any]) -> str:
    question = ' '.join(spec['question'].split())
    if len(question) > 400:
      question = question[:400] + '...'
    return (f'A programming problem with {len(spec.get("tests", ()))} tests: '
            f'{question}')

  def difficulty(self, spec: dict[str, Any]) -> float:
    """The generator level of built-in problems, else the dataset's rating
    or the lineage's (+-1 per rewrite); 0 when unknown."""
    if 'level' in spec:
      return float(spec['level'])
    return float(spec.get('difficulty', 0.0))

  def rewrite(self, request: base.RewriteRequest, generate: base.GenerateFn,
              attempts: int) -> dict[str, Any]:
    """A harder/easier problem from the env LLM (5.8); RewriteRejected."""
    return coding_rewrite.rewrite(self, request, generate, attempts)


def from_config(env_config, workdir: str) -> CodingEnv:
  """The coding setting of `config.env` (name 'coding')."""
  del workdir
  return CodingEnv(env_config)
