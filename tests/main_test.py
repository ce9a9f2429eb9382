"""`python -m rla_jax.main` on a user's mistakes: one line, exit 2, no DIR.

Each case is a command a user could type; the answer must name what is
wrong (the flag, the config key, the missing folder) in one line on stderr,
with no traceback, and leave no workdir or lock behind.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    'unknown key': (
        ['--config=configs/tiny.py', '--config.nonexistent_key=1'],
        '--config.nonexistent_key=1: configs/tiny.py has no key '
        'config.nonexistent_key (config has curator, env,'),
    'unknown nested key': (
        ['--config=configs/tiny.py', '--config.rollout.groupsize=4'],
        'has no key config.rollout.groupsize (config.rollout has group_size,'),
    'value out of range': (
        ['--config=configs/tiny.py', '--config.rollout.group_size=0'],
        'config.rollout.group_size=0: must be >= 1'),
    'value of the wrong type': (
        ['--config=configs/tiny.py', '--config.rollout.group_size=four'],
        "--config.rollout.group_size=four: invalid literal for int()"),
    'missing config file': (
        ['--config=configs/nosuch.py'],
        "--config=configs/nosuch.py does not load: FileNotFoundError"),
    'unknown option': (
        ['--config=configs/tiny.py:fulll'],
        "ValueError: unknown ablation 'fulll'"),
    'unknown setting': (
        ['--config=configs/tiny.py', '--config.env.name=nosuch'],
        "config.env.name='nosuch': no setting of that name"),
    # The design card's command on a machine without the weights.
    'missing model folder': (
        ['--config=configs/osworld.py'],
        "config.policy.path='/models/Qwen3-VL-8B-Thinking': does not exist "
        '(a model folder or .gguf file; set it with '
        '--config.policy.path=...)'),
}


def _one_line_and_nothing_left(flags, expected, workdir):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', *flags, f'--workdir={workdir}'],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
      check=False)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith('error: ') and expected in lines[0], lines[0]
  assert 'Traceback' not in proc.stdout + proc.stderr
  assert not workdir.exists()


@pytest.mark.parametrize('case', sorted(CASES))
def test_a_mistake_is_one_line_and_leaves_nothing(case, tmp_path):
  flags, expected = CASES[case]
  _one_line_and_nothing_left(flags, expected, tmp_path / 'run')


GOOD = '{"question": "Print the sum.", "tests": [["1 2", "3"]]}\n'


@pytest.mark.parametrize('line,expected', [
    (b'{"question": "caf\xe9", "tests": [["1", "1"]]}\n',
     ':2: not UTF-8 text (byte 17: invalid continuation byte)'),
    (b'{"question": "Q", "tests": [[null, "1"]]}\n',
     ':2: malformed tests (ValueError: a test input or output is null)'),
    (b'{"question": "Q", "tests": [["1"]]\n', ':2: not JSON'),
])
def test_a_bad_coding_file_is_one_line_naming_file_and_line(line, expected,
                                                             tmp_path):
  data = tmp_path / 'train.jsonl'
  data.write_bytes(GOOD.encode() + line)
  _one_line_and_nothing_left(
      ['--config=configs/coding.py:smoke',
       f'--config.env.train_data={data}'], f'{data}{expected}',
      tmp_path / 'run')


def test_a_bad_osworld_task_is_one_line_naming_file_and_step(tmp_path):
  tasks = tmp_path / 'tasks'
  tasks.mkdir()
  source = os.path.join(ROOT, 'rla_jax', 'envs', 'osworld', 'tasks',
                        'xterm-make-folder.json')
  with open(source, encoding='utf-8') as f:
    spec = json.load(f)
  spec['config'].append({'type': 'sleep', 'parameters': {'seconds': 'two'}})
  (tasks / 'bad.json').write_text(json.dumps(spec))
  _one_line_and_nothing_left(
      ['--config=configs/osworld.py:smoke', f'--config.env.task_dir={tasks}'],
      f'{tasks}/bad.json: config[{len(spec["config"]) - 1}]: "seconds" is a '
      "number in [0, 600]; got 'two'", tmp_path / 'run')


def test_a_resume_of_another_experiment_is_one_line_and_writes_nothing(
    tmp_path):
  sys.path.insert(0, ROOT)
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from rla_jax import runtime  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'config.json').write_text(
      json.dumps(runtime.as_json(tiny.get_config())))
  before = sorted(workdir.iterdir()), (workdir / 'config.json').read_text()
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(
      [sys.executable, '-m', 'rla_jax.main', '--config=configs/tiny.py:policy',
       f'--workdir={workdir}', '--config.loop.num_epochs=5'],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
      check=False)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith(
      f'error: {workdir} was run with another config: curator.enabled (true '
      '-> false), loop.train_rm (true -> false); resume with the config in '
      f'{workdir}/config.json'), lines[0]
  assert lines[0].endswith('--config.loop.allow_config_change=True')
  assert (sorted(workdir.iterdir()),
          (workdir / 'config.json').read_text()) == before  # no run.lock
