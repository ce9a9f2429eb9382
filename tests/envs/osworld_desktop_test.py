"""The OSWorld setting against local desktops: tasks, evaluators, the loop.

Every task of rla_jax/envs/osworld/tasks is set up on a real local desktop
(launch/desktop.sh), fails its evaluator, is solved by a scripted sequence
of the agent's own actions (computer_use calls through the controller), and
then passes every evaluator variant. The smoke config runs 2 epochs end to
end, resumes, and survives a desktop that dies mid-episode.
"""

import os
import re
import shutil
import sys

import pytest

from rla_jax import curator
from rla_jax import loop
from rla_jax import reward_check
from rla_jax.envs.osworld import desktops
from rla_jax.envs.osworld import environment as osworld

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from configs import osworld as osworld_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.skipif(
    not all(shutil.which(b) for b in ('Xvfb', 'openbox', 'mousepad', 'zenity',
                                      'xterm', 'bwrap')),
    reason='the local desktop needs Xvfb, openbox, mousepad, zenity, xterm '
           'and bwrap (.ci/run installs them)')


def act(action, **args):
  return {'action': action, **args}


def click_on(name):
  """A click on the accessibility node called `name` (0-999 grid)."""
  def solve(episode):
    xml = episode.desktop.accessibility()
    match = re.search(r'name="%s"[^>]*cp:screencoord="\((\d+), (\d+)\)"'
                      r'[^>]*cp:size="\((\d+), (\d+)\)"' % re.escape(name),
                      xml)
    assert match, f'no node {name!r} on the screen'
    x, y, w, h = map(int, match.groups())
    return [act('left_click', coordinate=[
        round((x + w / 2) * 999 / (episode.width - 1)),
        round((y + h / 2) * 999 / (episode.height - 1))])]
  return solve


TERMINAL = [act('left_click', coordinate=[200, 200])]
SAVE = [act('key', keys=['ctrl', 's']), act('wait', time=1)]
SOLUTIONS = {
    'mousepad-write-note': [act('type', text='hello world'), *SAVE],
    'mousepad-append-line': [act('key', keys=['ctrl', 'end']),
                             act('type', text='milk'), *SAVE],
    'mousepad-replace-text': [act('key', keys=['ctrl', 'a']),
                              act('type', text='final version'), *SAVE],
    'mousepad-fix-word': [act('key', keys=['ctrl', 'a']),
                          act('type', text='the dog sat'), *SAVE],
    'zenity-entry-name': [act('type', text='Ada'), act('key', keys=['enter'])],
    'zenity-question-yes': [click_on('Yes')],
    'zenity-list-color': [click_on('blue'), click_on('OK')],
    'zenity-form-city': [act('type', text='Paris'), act('key', keys=['tab']),
                         act('type', text='France'), click_on('OK')],
    'xterm-create-file': [*TERMINAL, act('type', text='echo hi > hello.txt\n')],
    'xterm-rename-file': [*TERMINAL, act('type', text='mv old.txt new.txt\n')],
    'xterm-make-folder': [*TERMINAL, act('type', text='mkdir projects\n')],
    'xterm-delete-file': [*TERMINAL, act('type', text='rm junk.txt\n')],
}


@pytest.fixture(scope='module')
def env():
  config = osworld_config.get_config('full')
  config.env.update(screen_size=(1280, 800), max_desktops=1,
                    acquire_timeout_s=30.0, settle_s=0.3)
  made = osworld.from_config(config.env, '')
  yield made
  made.close()


def run_actions(env, episode, actions):
  import json  # pylint: disable=g-import-not-at-top
  for args in actions:
    if callable(args):
      run_actions(env, episode, args(episode))
      continue
    response = ('Action: scripted.\n<tool_call>\n' + json.dumps(
        {'name': 'computer_use', 'arguments': args}) + '\n</tool_call>')
    observation, done, _ = episode.step(env.parse_action(response, ''))
    assert not done
    assert len(observation.images) == 2


def test_every_task_fails_before_and_passes_after_its_solution(env):
  assert sorted(SOLUTIONS) == sorted(t['id'] for t in env.tasks('train'))
  for spec in env.tasks('train'):
    episode = env.make_episode(spec, 0, max_turns=50)
    try:
      first = episode.reset()
      assert len(first.images) == 1
      name = osworld.evaluator_name(spec)
      assert not episode.desktop.evaluate(spec, name), spec['id']
      run_actions(env, episode, SOLUTIONS[spec['id']])
      for name in spec['evaluators']:  # every variant passes
        assert episode.desktop.evaluate(spec, name), (spec['id'], name)
    finally:
      episode.close()


def test_reward_check_solves_a_task_and_catches_a_lying_evaluator(
    env, monkeypatch):
  cases, seconds = reward_check.check(env, 'osworld')
  assert cases == 2 and seconds < 60
  monkeypatch.setattr(desktops.Local, 'evaluate', lambda *_: True)
  with pytest.raises(reward_check.RewardCheckFailed,
                     match="case 'xterm-make-folder at its start' .a known "
                           'fail. scored [+]1'):
    reward_check.check(env, 'osworld')


def test_typed_text_shows_in_the_accessibility_tree(env):
  spec = next(t for t in env.tasks('train')
              if t['id'] == 'zenity-entry-name')
  episode = env.make_episode(spec, 0, max_turns=5)
  try:
    episode.reset()
    run_actions(env, episode, [act('type', text='Grace')])
    assert '>Grace<' in episode.desktop.accessibility()
    observation, _, _ = episode.step(env.parse_action(
        'Action: x.\n<tool_call>{"name": "computer_use", "arguments": '
        '{"action": "wait", "time": 0}}</tool_call>', ''))
    assert 'Grace' in observation  # the text view of the screen
  finally:
    episode.close()


def test_apps_and_the_terminal_shell_are_sandboxed(env):
  spec = next(t for t in env.tasks('train') if t['id'] == 'xterm-make-folder')
  episode = env.make_episode(spec, 0, max_turns=5)
  try:
    episode.reset()
    outside = [os.path.expanduser('~/rla_sandbox_escape'),
               '/etc/rla_sandbox_escape']
    for path in outside:
      if os.path.exists(path):
        os.remove(path)
    run_actions(env, episode, [
        *TERMINAL, act('type', text=''.join(f'touch {p}; ' for p in outside)
                       + 'echo done > sandbox.txt\n'), act('wait', time=0.5)])
    client = episode.desktop.client
    assert client.file('~/sandbox.txt') == b'done\n'
    for path in outside:
      assert not os.path.exists(path)
    # Every app and command of the desktop sees the host read-only.
    touched = client.execute(f'touch {outside[1]}', shell=True)
    assert touched['returncode'] != 0 and not os.path.exists(outside[1])
  finally:
    episode.close()


def smoke_config(num_epochs):
  config = osworld_config.get_config('smoke')
  config.loop.num_epochs = num_epochs
  config.eval.max_turns = 3  # tells evaluation episodes from training ones
  return config


@pytest.mark.slow
def test_smoke_two_epochs_resume_and_a_dying_desktop(tmp_path, monkeypatch,
                                                      capsys):
  workdir = str(tmp_path / 'run')
  killed = []
  step = osworld.Episode.step

  def dying_step(episode, action):
    # The first training episode's desktop dies before its first action.
    if not killed and episode.max_turns == 2 and episode.turns == 0:
      killed.append(episode.spec['id'])
      episode.desktop.desktop.stop()
    return step(episode, action)

  monkeypatch.setattr(osworld.Episode, 'step', dying_step)
  first = loop.run(smoke_config(1), workdir)
  assert killed and first['rollout/errors'] == 1
  assert first['rollout/trajectories'] == 4
  assert first['policy/examples'] > 0
  assert 'rollout/invalid_action_frac' in first
  assert 'eval/eval/accuracy' in first
  monkeypatch.setattr(osworld.Episode, 'step', step)
  pool_before = curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))
  capsys.readouterr()
  last = loop.run(smoke_config(2), workdir)  # resumes after epoch 1
  assert 'resumed from epoch 1 checkpoint; starting epoch 2' in (
      capsys.readouterr().out)
  assert last['rollout/errors'] == 0  # the dead desktop came back
  # Adaptation runs after a resume (B9): all-failed tasks ask for easier
  # versions (a random environment LLM's proposals are logged rejections).
  assert last['curator/requested'] > 0
  assert last['curator/rewrite_rejected'] == last['curator/requested']
  assert last['policy/examples'] > 0
  assert len(curator.load_jsonl(os.path.join(workdir, 'pool.jsonl'))) == len(
      pool_before)
