"""The curator's rewrites of coding problems (RLANYTHING.md 5.8, and more).

The environment LLM sees the root problem and its GT tests, the active
problem with the pass rate of each of its tests over this epoch's programs
(the authors show 0.0 for every test, bug B15), and the RM's tests with
their pass rates (the critic feedback; they may be wrong). It answers with
ONE JSON object. Beyond the authors (who check only the JSON's shape), a
proposal whose tests contradict each other, or a harder one that changes an
old test's answer, is rejected, and the programs that solved the old version
are run on the new tests to annotate it (see `check_consistency`). Every
rejection carries a reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

import numpy as np

from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs.coding import data as coding_data
from rla_jax.envs.coding import sandbox

# The reasons of a rewrite rejected by check_consistency: they start the
# RewriteRejected message, so the rewrite log (and the knob fallback's
# 'rejected_proposals') tells these apart from malformed proposals.
CONTRADICTION = 'contradictory tests'
CHANGED_ANSWER = 'changed an old answer'
# RewriteRejected.reason keys (curator/rejected_<reason>, one per proposal).
NO_JSON = 'no_json'  # no JSON object in the answer
MALFORMED_JSON = 'malformed_json'  # a JSON object that does not decode
INVALID_FIELDS = 'invalid_fields'  # a field missing, of a wrong type or size
TOO_FEW_TESTS = 'too_few_tests'  # fewer distinct tests than num_unit_tests
CONTRADICTORY_TESTS = 'contradictory_tests'  # check_consistency: CONTRADICTION
CHANGED_OLD_ANSWER = 'changed_old_answer'  # check_consistency: CHANGED_ANSWER
ASSERT_STYLE = 'assert_style'  # the problem is not rewritten (no proposals)
NO_PROPOSAL = 'no_proposal'  # the env LLM gave no completions
# The spec mark (base.FALLBACK_KEY) of a problem knob_rewrite made.
KNOB = 'knob'
_JSON_FENCE = re.compile(r'```(?:json)?[ \t]*\n(.*?)```', re.DOTALL)
_GOALS = {
    structs.HARDER: 'HARDER: the model solves it too often. Make it require '
                    'more insight or care (a trickier rule, larger '
                    'constraints that need a faster algorithm, more cases).',
    structs.EASIER: 'EASIER: the model rarely solves it. Make it simpler '
                    '(fewer rules, smaller constraints, fewer corner cases).',
}


def rewrite(env, request: base.RewriteRequest, generate: base.GenerateFn,
            attempts: int) -> dict[str, Any]:
  """The first of `attempts` proposals that parses, validates and checks.

  Each rejected proposal's reason key goes to `request.rejected`. When none
  is valid, a built-in problem moves a level with `rc.knob_fallback`
  (`knob_rewrite`; the spec is marked base.FALLBACK_KEY = KNOB, so the
  curator counts it as the fallback's, not the LLM's); else RewriteRejected.
  """
  spec, direction = request.spec, request.direction
  if direction not in _GOALS:
    raise ValueError(f'unknown direction {direction!r}')
  if spec.get('check'):
    raise base.RewriteRejected(f'{spec["id"]}: assert-style problems are not '
                               'rewritten', reason=ASSERT_STYLE)
  rc = env.config.rewrite
  prompt = rewrite_prompt(request, rc)
  completions = generate([f'{prompt}\n(Attempt {i}/{attempts})'
                          for i in range(1, attempts + 1)])
  reasons = []
  for text in completions:
    try:
      candidate = parse_proposal(text, spec, direction, rc)
      candidate['consistency'] = check_consistency(
          candidate, spec, request.trajectories, rc, env.limits)
      return candidate
    except base.RewriteRejected as e:
      reasons.append(str(e))
      request.rejected.append(e.reason)
  summary = '; '.join(f'{i}: {r}' for i, r in enumerate(reasons, 1))
  logging.info('%s rewrite of %s: all %d proposals rejected (%s)', direction,
               spec['id'], len(completions), summary or 'no completions')
  if rc.knob_fallback and spec.get('source') == 'builtin':
    fallback = knob_rewrite(spec, direction, env.config)
    if fallback is not None:
      fallback['rejected_proposals'] = reasons
      fallback[base.FALLBACK_KEY] = KNOB
      return fallback
  raise base.RewriteRejected(
      f'{direction} rewrite of {spec["id"]}: no valid proposal in '
      f'{len(completions)} completions ({summary or "none"})',
      reason=NO_PROPOSAL if not completions else base.OTHER)


# The prompt.


def gt_pass_rates(spec: dict[str, Any], trajectories) -> list[float | None]:
  """Per GT test, the fraction of this epoch's programs that passed it."""
  rows = []
  for traj in trajectories:
    info = getattr(traj, 'info', None) or {}
    passed = info.get('gt_passed')
    if getattr(traj, 'status', structs.OK) == structs.OK and passed is not None:
      if len(passed) == len(spec.get('tests', ())):
        rows.append(passed)
  if not rows:
    return [None] * len(spec.get('tests', ()))
  return [float(x) for x in np.mean(np.asarray(rows, dtype=float), axis=0)]


def rm_tests(judgments) -> list[tuple[str, str, float | None]]:
  """The RM's unit tests with their pass rates, duplicates merged.

  Reads `judgment.info['test']` ([stdin, expected] or None) and
  `judgment.info['passed']` (one bool per program, or None).
  """
  merged: dict[tuple[str, str], list[bool]] = {}
  for judgment in judgments:
    info = getattr(judgment, 'info', None) or {}
    test = info.get('test')
    if not test:
      continue
    key = (str(test[0]), str(test[1]))
    merged.setdefault(key, []).extend(info.get('passed') or ())
  return [(i, o, float(np.mean(p)) if p else None)
          for (i, o), p in merged.items()]


def _test_lines(tests, rates, rc) -> list[str]:
  """Tests as JSON lines; pairs with a side over the limit are left out."""
  lines, dropped = [], 0
  for (stdin, out), rate in zip(tests, rates):
    if max(len(stdin), len(out)) > rc.prompt_test_chars:
      dropped += 1
      continue
    if len(lines) == rc.prompt_tests:
      break
    entry = {'input': stdin, 'output': out}
    if rate is not None:
      entry['pass_rate'] = round(rate, 2)
    lines.append(json.dumps(entry))
  if dropped:
    lines.append(f'({dropped} long tests not shown)')
  return lines or ['(none shown)']


def rewrite_prompt(request: base.RewriteRequest, rc) -> str:
  """The environment LLM's prompt, without the attempt suffix."""
  spec, root = request.spec, request.root
  lines = [
      'You write programming problems that train an AI model to code. '
      'Rewrite the problem below to make it ' + _GOALS[request.direction],
      '', '=== Original problem (stay close to it) ===', root['question']]
  if spec['id'] != root['id']:
    root_tests = root.get('tests', ())
    lines += ['', 'Its tests:', *_test_lines(root_tests,
                                             [None] * len(root_tests), rc),
              '', '=== Current version (the one to rewrite) ===',
              spec['question']]
  rates = gt_pass_rates(spec, request.trajectories)
  lines += ['', f'The model solved {request.acc_old:.0%} of its attempts at '
            'the current version. Its tests, with the fraction of the '
            "model's programs that passed each:",
            *_test_lines(spec.get('tests', ()), rates, rc)]
  reviewed = rm_tests(request.judgments)
  if reviewed:
    lines += ['', 'Tests written by a reviewer model, with the fraction of '
              "the model's programs that passed each (they may be wrong):",
              *_test_lines([(i, o) for i, o, _ in reviewed],
                           [r for _, _, r in reviewed], rc)]
  notes = [c.strip() for c in request.critiques if c and c.strip()]
  if notes:
    lines += ['', 'Notes on failed attempts:',
              *[f'- {n}' for n in notes[:rc.prompt_tests]]]
  lines += [
      '', 'Requirements: keep the topic, skills and input/output style of '
      'the original problem, stay close to its constraints, and change only '
      'the difficulty. '
      'The statement must be self-contained and unambiguous and give the '
      'input and output format. Every test output must be exactly what a '
      'correct program prints for the test input.',
      '', 'Answer with ONLY a JSON object, no other text:',
      '{"question": "<the new statement>", "test_method": "stdio", '
      f'"test_time_limit": {rc.time_limit_s:g}, "test_input": ["<input 1>", '
      '...], "test_output": ["<output 1>", ...]}',
      f'with test_input and test_output of equal length, at least '
      f'{rc.num_unit_tests} tests.']
  return '\n'.join(lines)


# Parsing and validating a proposal.


def parse_json_object(text: str) -> dict[str, Any]:
  """The JSON object of an answer: a fenced block, the whole text, or the
  span from its first '{' to its last '}'. No repairs of broken JSON."""
  text = text.strip()
  fenced = _JSON_FENCE.findall(text)
  candidates = [fenced[-1].strip()] if fenced else []
  candidates.append(text)
  if '{' in text and '}' in text:
    candidates.append(text[text.index('{'):text.rindex('}') + 1])
  error, reason = None, NO_JSON
  for candidate in candidates:
    try:
      value = json.loads(candidate)
    except json.JSONDecodeError as e:
      if '{' in candidate and error is None:
        error = (f'malformed JSON ({e.msg} at line {e.lineno} '
                 f'column {e.colno})')
        reason = MALFORMED_JSON
      continue
    if isinstance(value, dict):
      return value
    error, reason = f'a JSON {type(value).__name__}, not an object', NO_JSON
  raise base.RewriteRejected(error or 'no JSON object', reason=reason)


def _as_text(value, what: str) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, int) and not isinstance(value, bool):
    return str(value)
  raise base.RewriteRejected(f'{what} is a {type(value).__name__}, not a '
                             'string', reason=INVALID_FIELDS)


def _key(text: str) -> str:
  return ' '.join(text.split())


def parse_proposal(text: str, spec: dict[str, Any], direction: str,
                   rc) -> dict[str, Any]:
  """The new problem spec of an env-LLM answer; RewriteRejected with why."""
  answer = parse_json_object(text)
  question = answer.get('question')
  if not isinstance(question, str) or not question.strip():
    raise base.RewriteRejected('no question', reason=INVALID_FIELDS)
  method = answer.get('test_method', 'stdio')
  if method != 'stdio':
    raise base.RewriteRejected(f'test_method {method!r} is not "stdio"',
                               reason=INVALID_FIELDS)
  inputs, outputs = answer.get('test_input'), answer.get('test_output')
  if not isinstance(inputs, list) or not isinstance(outputs, list):
    raise base.RewriteRejected('test_input and test_output must be lists',
                               reason=INVALID_FIELDS)
  if len(inputs) != len(outputs):
    raise base.RewriteRejected(f'{len(inputs)} test inputs but '
                               f'{len(outputs)} outputs',
                               reason=INVALID_FIELDS)
  tests, seen = [], set()
  for i, (stdin, out) in enumerate(zip(inputs, outputs), 1):
    stdin = _as_text(stdin, f'test input {i}')
    out = _as_text(out, f'test output {i}')
    if len(stdin) > rc.max_test_chars or len(out) > rc.max_test_chars:
      raise base.RewriteRejected(f'test {i} is over {rc.max_test_chars} '
                                 'characters', reason=INVALID_FIELDS)
    if not out.strip():
      raise base.RewriteRejected(f'test {i} has an empty output',
                                 reason=INVALID_FIELDS)
    key = (_key(stdin), _key(out))
    if key in seen:
      continue  # an exact duplicate adds nothing; conflicts: check_consistency
    seen.add(key)
    tests.append([stdin, out])
  if len(tests) < rc.num_unit_tests:
    raise base.RewriteRejected(f'{len(tests)} distinct tests, need at least '
                               f'{rc.num_unit_tests}', reason=TOO_FEW_TESTS)
  limit = answer.get('test_time_limit', rc.time_limit_s)
  if (not isinstance(limit, (int, float)) or isinstance(limit, bool) or
      not 0 < limit <= rc.max_time_limit_s):
    raise base.RewriteRejected(f'test_time_limit {limit!r} is not in (0, '
                               f'{rc.max_time_limit_s:g}]',
                               reason=INVALID_FIELDS)
  return derive(spec, direction, question.strip(), tests, float(limit))


def derive(spec: dict[str, Any], direction: str, question: str,
           tests: list[list[str]], time_limit_s: float) -> dict[str, Any]:
  """A rewritten spec in the lineage of `spec`."""
  root_id = spec.get('root_id', spec['id'])
  version = int(spec.get('version', 0)) + 1
  digest = hashlib.sha1(json.dumps([question, tests]).encode()).hexdigest()
  step = 1.0 if direction == structs.HARDER else -1.0
  base_difficulty = float(spec.get('level', spec.get('difficulty', 0.0)))
  return {'id': f'{root_id}.v{version}-{digest[:6]}', 'root_id': root_id,
          'version': version, 'source': 'rewrite', 'parent_id': spec['id'],
          'direction': direction, 'question': question, 'tests': tests,
          'time_limit_s': time_limit_s,
          'difficulty': base_difficulty + step}


# Running the new tests.


def solved_programs(trajectories, limit: int) -> list[str]:
  """Distinct programs that passed every GT test of the old version."""
  programs = []
  for traj in trajectories:
    info = getattr(traj, 'info', None) or {}
    passed = info.get('gt_passed')
    if (getattr(traj, 'status', structs.OK) == structs.OK and passed and
        all(passed) and info.get('program') and
        info['program'] not in programs):
      programs.append(info['program'])
  return programs[:limit]


def contradiction(tests) -> str | None:
  """Why `tests` contradict each other: the same input (up to whitespace)
  with different outputs; None when they do not.

  The one contradiction the tests show by themselves: stdin/stdout problems
  are functions of their input, whatever their new rules are.
  """
  first: dict[str, int] = {}
  for i, (stdin, out) in enumerate(tests):
    j = first.setdefault(_key(stdin), i)
    if _key(tests[j][1]) != _key(out):
      return (f'tests {j + 1} and {i + 1} have the same input but different '
              'outputs')
  return None


def changed_answer(tests, old_tests) -> str | None:
  """Which of `tests` gives an input of `old_tests` (up to whitespace)
  another output (up to whitespace); None when none does."""
  old: dict[str, int] = {}
  for j, (stdin, _) in enumerate(old_tests):
    old.setdefault(_key(stdin), j)
  for i, (stdin, out) in enumerate(tests):
    j = old.get(_key(stdin))
    if j is not None and _key(old_tests[j][1]) != _key(out):
      return (f'test {i + 1} has the input of old test {j + 1} but another '
              'output')
  return None


def check_consistency(candidate: dict[str, Any], old: dict[str, Any],
                      trajectories, rc, limits: sandbox.Limits) -> str:
  """RewriteRejected when the new tests contradict each other or, in a
  harder rewrite, the old version `old`; else what running the old
  version's solvers on them found.

  Rejects (issue 32.3) the same input with two outputs (`contradiction`,
  CONTRADICTORY_TESTS), and a harder rewrite's test on an input of an old
  test with another output (`changed_answer`, CHANGED_OLD_ANSWER). The old
  tests' inputs are the part of the old constraints a machine can tell, and
  a harder rewrite generalises ('the sum' -> 'the sum mod 1e9+7, values up
  to 1e18' keeps every old answer). This is "a witness fails a test inside
  the old constraints" made exact: a witness passed every old test by the
  same whitespace-collapsed comparison, so it fails exactly these, and the
  check needs neither witnesses nor the sandbox. An easier rewrite may drop
  a rule, which changes old answers, so only its acceptance judges it. A
  witness failing any other test says nothing (its input may lie outside
  the old constraints): the witnesses annotate the rewrite, 'consistent'
  when one passes every new test, 'unverified' otherwise, 'no witnesses'
  when no program solved the old version, 'not checked' with
  `rc.consistency_check` off.
  """
  why = contradiction(candidate['tests'])
  if why:
    raise base.RewriteRejected(f'{CONTRADICTION}: {why}',
                               reason=CONTRADICTORY_TESTS)
  why = (candidate['direction'] == structs.HARDER and
         changed_answer(candidate['tests'], old.get('tests', ())))
  if why:
    raise base.RewriteRejected(f'{CHANGED_ANSWER}: {why}',
                               reason=CHANGED_OLD_ANSWER)
  if not rc.consistency_check:
    return 'not checked'
  witnesses = solved_programs(trajectories, rc.max_witnesses)
  if not witnesses:
    return 'no witnesses'
  tests = [tuple(t) for t in candidate['tests']]
  results = sandbox.run_many([(p, tests) for p in witnesses],
                             candidate['time_limit_s'], limits=limits,
                             workers=rc.workers or None)
  if any(all(r.passed for r in rs) for rs in results):
    return 'consistent'
  return 'unverified'


def knob_rewrite(spec: dict[str, Any], direction: str,
                 env_config) -> dict[str, Any] | None:
  """A built-in problem one level up or down (None at the end of the range).

  A stand-in for the env LLM when none of its proposals is valid, so runs
  with small models still rewrite their built-in problems.
  """
  level = spec['level'] + (1 if direction == structs.HARDER else -1)
  if not 1 <= level <= coding_data.MAX_LEVEL:
    return None
  root_id = spec.get('root_id', spec['id'])
  version = int(spec.get('version', 0)) + 1
  new = coding_data.builtin_problem(
      spec['kind'], level, f'{spec["seed"]}/v{version}',
      spec_id=f'{root_id}.v{version}-L{level}',
      num_tests=env_config.builtin.num_tests,
      time_limit_s=spec['time_limit_s'])
  new.update(root_id=root_id, version=version, parent_id=spec['id'],
             direction=direction, rewrite='knob')
  return new
