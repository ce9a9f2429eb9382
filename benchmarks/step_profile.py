"""Where one run of a compiled XLA program spends its time, by model stage.

Runs the program once under `jax.profiler` and reads the trace's thunk
events: each top-level HLO instruction the runtime executes is one event,
named as in the compiled module (an asynchronous one, such as a large
XLA:CPU dot, has a second `end: <name>` event when its worker threads
finish). Wall time is cut where events start and end; each slice goes in
equal parts to the instructions in flight, and to `host and runtime` when
none is. The compiled module's text carries each instruction's Python call
stack (its FileNames / FunctionNames / FileLocations / StackFrames tables);
`classify` maps a stack, innermost frame first, to a stage name.

Used by `train_step.py --profile` (LM head and loss, attention, MLP, norms,
optimizer, layer-scan copies, host) and `sampler.py --profile` (prefill,
and each decode stage a step).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

HOST = 'host and runtime'
_TABLE = re.compile(r'^(FileNames|FunctionNames|FileLocations|StackFrames)$')
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?[\s)]([a-z][\w\-]*)\(')
_FRAME_ID = re.compile(r'metadata=\{[^}]*stack_frame_id=(\d+)')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.\-]+) .*\{$')
_CALLS = re.compile(r'calls=%([\w.\-]+)')
# Instructions whose thunks run other thunks: their time is their body's.
_CONTROL = ('while', 'conditional', 'call')
# Instruction names (the runtime's own events are CamelCase or spaced).
_HLO_NAME = re.compile(r'^[a-z][\w\-]*(\.\d+)?$')


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
  """The module's four stack tables, id -> the rest of the line."""
  tables, current = collections.defaultdict(dict), None
  for line in hlo_text.splitlines():
    if _TABLE.match(line):
      current = line
    elif current and line.strip():
      number, _, rest = line.strip().partition(' ')
      if not number.isdigit():
        current = None
        continue
      tables[current][int(number)] = rest.strip().strip('"')
    else:
      current = None
  return tables


def stacks(hlo_text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
  """Instruction name -> (opcode, its call stack as '/path/file.py:function'
  frames, innermost first). An instruction XLA made without a source (a
  while loop's copy of its state) has the one frame '<no source: opcode>'."""
  t = _tables(hlo_text)

  def field(entry, key):
    return int(re.search(key + r'=(\d+)', entry).group(1))

  def frame(location_id):
    location = t['FileLocations'][location_id]
    path = t['FileNames'][field(location, 'file_name_id')]
    function = t['FunctionNames'][field(location, 'function_name_id')]
    return f'{path}:{function}'

  def walk(frame_id):
    out, seen = [], set()
    while frame_id and frame_id not in seen:
      seen.add(frame_id)
      entry = t['StackFrames'][frame_id]
      out.append(frame(field(entry, 'file_location_id')))
      # The text prints a frame's parent as its number plus one (0: none).
      frame_id = field(entry, 'parent_frame_id') - 1
    return tuple(out)

  # A fusion XLA:CPU built itself (a YNNPACK one) may carry no metadata of
  # its own: it takes that of its fused computation's root (else of the
  # computation's first instruction that has some). A dot or fusion with
  # neither (a custom_vjp backward's) takes the commonest of the computation
  # it is in.
  own, calls, computation_frame, computation = {}, {}, {}, None
  inside, frames_in = {}, collections.defaultdict(collections.Counter)
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    frame_id = _FRAME_ID.search(line)
    called = _CALLS.search(line)
    own[m.group(1)] = (m.group(2), frame_id and int(frame_id.group(1)))
    inside[m.group(1)] = computation
    if called:
      calls[m.group(1)] = called.group(1)
    if frame_id:
      frames_in[computation][int(frame_id.group(1))] += 1
    if frame_id and computation and (computation not in computation_frame
                                     or line.lstrip().startswith('ROOT')):
      computation_frame[computation] = int(frame_id.group(1))
  found = {}
  for name, (opcode, frame_id) in own.items():
    frame_id = frame_id or computation_frame.get(calls.get(name))
    around = frames_in[inside[name]]
    if not frame_id and opcode in ('dot', 'fusion') and around:
      frame_id = around.most_common(1)[0][0]
    found[name] = (opcode, walk(frame_id) if frame_id
                   else (f'<no source: {opcode}>',))
  return found


def _spans(events, where) -> list[tuple[str, float, float]]:
  """(instruction, start, end) in microseconds, from the runtime's events;
  not the control-flow instructions, whose bodies' events are there."""
  ends = {}
  starts = []
  for e in events:
    if e.get('ph') != 'X':
      continue
    name = e['name']
    if name.startswith('end: '):
      ends.setdefault(name[5:], []).append(e['ts'] + e['dur'])
    elif (_HLO_NAME.match(name)
          and where.get(name, ('',))[0] not in _CONTROL):
      starts.append((name, e['ts'], e['ts'] + e['dur']))
  starts.sort(key=lambda s: s[1])
  for times in ends.values():
    times.sort()
  taken = collections.Counter()
  spans = []
  for name, start, end in starts:
    later = ends.get(name, ())
    i = taken[name]
    if i < len(later) and later[i] >= start:  # async: done when it says so
      end = max(end, later[i])
      taken[name] += 1
    spans.append((name, start, end))
  return spans


def attribute(spans, begin: float, finish: float) -> collections.Counter:
  """Seconds per instruction: each slice of [begin, finish] split equally
  among the instructions in flight in it; HOST when none is."""
  edges = []
  for i, (_, start, end) in enumerate(spans):
    edges += [(max(start, begin), 1, i), (min(end, finish), -1, i)]
  edges.sort(key=lambda e: (e[0], e[1]))
  seconds = collections.Counter()
  active, last = set(), begin
  for t, kind, i in edges:
    if t > last:
      share = (t - last) / 1e6
      if active:
        for j in active:
          seconds[spans[j][0]] += share / len(active)
      else:
        seconds[HOST] += share
      last = t
    if kind > 0:
      active.add(i)
    else:
      active.discard(i)
  if finish > last:
    seconds[HOST] += (finish - last) / 1e6
  return seconds


def run(fn, hlo_text: str, classify, top: int = 8):
  """Runs fn() once under the profiler; returns ({stage: seconds}, wall
  seconds, the `top` instructions that took longest as [name, stage,
  innermost frame, seconds]).

  classify(stack) -> stage name, for a stack from `stacks` (the one frame
  '<no source: opcode>' for an instruction without a source; empty for the
  few traced names the module lacks).
  """
  import jax  # pylint: disable=g-import-not-at-top
  where = stacks(hlo_text)
  with tempfile.TemporaryDirectory(prefix='step_profile_') as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    begin = time.perf_counter()
    fn()
    wall = time.perf_counter() - begin
    jax.profiler.stop_trace()
    path, = glob.glob(os.path.join(trace_dir, '**', '*.trace.json.gz'),
                      recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)['traceEvents']
  spans = _spans(events, where)
  if not spans:
    raise RuntimeError('the trace holds no XLA thunk events')
  known = sum(name in where for name, _, _ in spans) / len(spans)
  if known < 0.95:
    raise RuntimeError(f'{known:.0%} of the traced instructions are in the '
                       'compiled module given: it is not the program that ran')
  begin_us = min(s[1] for s in spans)
  finish_us = max(s[2] for s in spans)
  per_op = attribute(spans, begin_us, finish_us)
  stages = collections.Counter()
  longest = []
  for name, seconds in per_op.most_common():
    stack = where.get(name, ('', ()))[1]
    stage = HOST if name == HOST else classify(stack)
    stages[stage] += seconds
    if len(longest) < top and name != HOST:
      frame = stack[0].rsplit('/', 1)[-1] if stack else '?'
      longest.append([name, stage, frame, seconds])
  # Before the first and after the last instruction: dispatch, transfers.
  stages[HOST] += max(0.0, wall - (finish_us - begin_us) / 1e6)
  return dict(stages), wall, longest


def by_frames(rules, default: str):
  """A classify function: the innermost frame that holds a substring of a
  (stage, substrings) rule gives the stage (the first such rule); `default`
  when no frame does."""

  def classify(stack):
    for frame in stack:
      for stage, keys in rules:
        if any(k in frame for k in keys):
          return stage
    return default

  return classify


def table(stages: dict[str, float], wall: float, longest=()) -> str:
  """One line per stage, largest first (milliseconds, share of wall), then
  the longest instructions."""
  rows = sorted(stages.items(), key=lambda kv: -kv[1])
  lines = [f'  {name:46s} {s * 1e3:9.1f} ms {s / wall:6.1%}'
           for name, s in rows]
  if longest:
    lines.append('  longest instructions:')
  lines += [f'    {name:34s} {s * 1e3:8.1f} ms  {stage}: {frame}'
            for name, stage, frame, s in longest]
  return '\n'.join(lines)
