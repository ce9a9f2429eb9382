"""The paper's OSWorld setting (RLANYTHING.md 4): a GUI agent on a desktop.

The policy sees screenshots (the current one and up to two before it) and
acts with one `computer_use` tool call per turn (prompts.py); the
call becomes pyautogui code sent to the desktop through the OSWorld
controller's HTTP API (execute), and the next screenshot comes back the same
way. An unparseable answer is sampled again up to `parse_retries` times
(the rollout does it); after that the step is an invalid action: recorded,
not executed, never an environment error. A step's observation carries the
screenshot after the action and the one it was taken on, so the RM (4.3)
judges each step from both. When the agent terminates or the turns run out,
the task's evaluator (evaluators.py) decides the outcome.

Tasks are OSWorld task JSONs with the RLAnything fields: `evaluators` (name
-> evaluator), `task_template` (name -> canonical instruction) and
`current_task` (the one active name -> its instruction), and optionally
`network` (true: the task's apps may reach the network; the local desktops'
jails have none by default, and no bundled task asks). Local desktops take
the local evaluators (evaluators.py) and set-up steps; provider 'vm' takes
OSWorld's own (metrics over getters, SetupController steps: task_formats.py),
and reads the authors' released `evaluator_list` as `evaluators`.

The curator's rewrite (4.5) asks the environment LLM for a one-key JSON
object: keep or switch the evaluator, add or remove hints; a proposal that
does not parse, names an unknown evaluator or changes nothing is rejected,
and when none is valid the rewrite is a logged rejection (the authors fall
back to the unchanged task silently).

Desktops (desktops.py): provider 'local' runs one desktop of this
host per concurrent episode (launch/desktop.sh), started on demand and
reset between episodes by restarting the apps; provider 'vm' runs
OSWorld's own DesktopEnv (docker, VMware, AWS, ...: the benchmark's VMs and
task files, `pip install desktop-env`). A desktop that dies mid-episode
makes that trajectory an environment error; the next episode on it starts
it again.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

from rla_jax import structs
from rla_jax.envs import base
from rla_jax.envs import word_tokenizer
from rla_jax.envs.osworld import desktop
from rla_jax.envs.osworld import desktops
from rla_jax.envs.osworld import evaluators as osworld_eval
from rla_jax.envs.osworld import prompts
from rla_jax.envs.osworld import task_formats

TASK_DIR = os.path.join(os.path.dirname(__file__), 'tasks')
SPLITS = ('train', 'eval')  # the authors evaluate on the training tasks
PROVIDERS = ('local', 'vm')  # config.env.provider (desktops.py)
CONFIG_STEPS = ('launch', 'execute', 'sleep')  # local set-up steps
INVALID = 'INVALID ACTION'  # prefix of the action a failed parse executes
VISION_TOKENS = ('<|vision_start|>', '<|image_pad|>', '<|vision_end|>',
                 '<|video_pad|>')
# What the policy's prompt shows of an earlier turn (config.env.history):
# the agent's full response, or the canonical action it parsed to.
HISTORIES = ('full', 'canonical')


def load_tasks(task_dir: str, provider: str = 'local') -> list[dict[str, Any]]:
  """Every *.json task of `task_dir`, checked for `provider`
  (config.env.provider: 'local' for the bundled tasks), sorted by id."""
  if provider not in PROVIDERS:
    raise ValueError(f'config.env.provider={provider!r}: one of {PROVIDERS}')
  if not os.path.isdir(task_dir):
    raise base.DataError(f'config.env.task_dir={task_dir!r}: no such folder')
  tasks = []
  for name in sorted(os.listdir(task_dir)):
    if not name.endswith('.json'):
      continue
    path = os.path.join(task_dir, name)
    try:
      with open(path, encoding='utf-8') as f:
        spec = json.load(f)
    except OSError as e:
      raise base.DataError(f'{path}: cannot read ({e.strerror})') from None
    except ValueError as e:  # JSON and UTF-8 errors
      raise base.DataError(f'{path}: not JSON ({e})') from None
    tasks.append(_checked(spec, path, provider))
  if not tasks:
    raise base.DataError(f'config.env.task_dir={task_dir!r}: no *.json tasks')
  ids = [t['id'] for t in tasks]
  if len(set(ids)) != len(ids):
    raise base.DataError(f'{task_dir}: duplicate task ids')
  return sorted(tasks, key=lambda t: t['id'])


def _checked(spec: Any, where: str, provider: str) -> dict[str, Any]:
  """The task with its RLAnything fields filled in and validated: OSWorld's
  formats (task_formats.py) for provider 'vm', the local ones otherwise."""
  if not isinstance(spec, dict) or not isinstance(spec.get('id'), str):
    raise base.DataError(f'{where}: a task is an object with a string "id"')
  spec = dict(spec)
  if not isinstance(spec.get('network', False), bool):
    raise base.DataError(f'{where}: "network" (whether the task\'s apps may '
                         'reach the network; default false) is true or false')
  if 'evaluator_list' in spec:  # the authors' released files' name for it
    if 'evaluators' in spec:
      raise base.DataError(f'{where}: both "evaluators" and "evaluator_list" '
                           '(the same map, by the authors\' name): keep one')
    spec['evaluators'] = spec.pop('evaluator_list')
  if 'evaluators' not in spec:  # an OSWorld benchmark task: one evaluator
    if 'evaluator' not in spec or not isinstance(spec.get('instruction'), str):
      raise base.DataError(f'{where}: needs "evaluators" (local tasks) or '
                           '"evaluator" and "instruction" (OSWorld tasks)')
    if provider != 'vm':
      raise base.DataError(f'{where}: an OSWorld task ("evaluator", no '
                           '"evaluators"): needs config.env.provider=\'vm\'')
    task_formats.check_evaluator(spec['evaluator'], f'{where}: evaluator')
    task_formats.check_steps(spec.get('config', []), f'{where}: config')
    spec.setdefault('task_template', {'default': spec['instruction']})
    spec.setdefault('current_task', {'default': spec['instruction']})
  else:
    if not isinstance(spec['evaluators'], dict) or not spec['evaluators']:
      raise base.DataError(f'{where}: "evaluators" is an object name -> '
                           'evaluator')
    for name, evaluator in spec['evaluators'].items():
      at = f'{where}: evaluators.{name}'
      if provider == 'vm':
        task_formats.check_evaluator(evaluator, at)
      elif task_formats.is_metric_evaluator(evaluator):
        raise base.DataError(f'{at}: an OSWorld metric evaluator (getters '
                             '"result" / "expected"): its task needs '
                             'config.env.provider=\'vm\'')
      else:
        osworld_eval.check(evaluator, at)
    if provider == 'vm':
      task_formats.check_steps(spec.get('config', []), f'{where}: config')
    else:
      _check_config(spec.get('config', []), where)
  template, current = spec.get('task_template'), spec.get('current_task')
  if not isinstance(template, dict) or not template:
    raise base.DataError(f'{where}: "task_template" is an object evaluator -> '
                         'instruction')
  if 'evaluators' in spec and set(template) != set(spec['evaluators']):
    raise base.DataError(f'{where}: "task_template" names {sorted(template)} '
                         f'but "evaluators" {sorted(spec["evaluators"])}')
  if (not isinstance(current, dict) or len(current) != 1
      or next(iter(current)) not in template):
    raise base.DataError(f'{where}: "current_task" must be one evaluator of '
                         f'{sorted(template)} -> its instruction')
  return spec


def _check_config(steps: Any, where: str) -> None:
  """Raises base.DataError naming the step of a task's local set-up (what
  desktops.Local runs) that a desktop could not run."""
  if not isinstance(steps, list):
    raise base.DataError(f'{where}: "config" is a list of steps')
  for k, step in enumerate(steps):
    at = f'{where}: config[{k}]'
    if isinstance(step, dict) and step.get('type') in (
        set(task_formats.SETUP_STEPS) - set(CONFIG_STEPS)):
      raise base.DataError(f'{at}: {step["type"]!r} is an OSWorld set-up '
                           'step: its task needs config.env.provider=\'vm\'')
    if not isinstance(step, dict) or step.get('type') not in CONFIG_STEPS:
      raise base.DataError(f'{at}: a step is an object with "type" one of '
                           f'{CONFIG_STEPS}; got {step!r}')
    params = step.get('parameters', {})
    if not isinstance(params, dict):
      raise base.DataError(f'{at}: "parameters" is an object')
    if step['type'] == 'sleep':
      seconds = params.get('seconds', 1.0)
      if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
          or not 0 <= seconds <= 600):
        raise base.DataError(f'{at}: "seconds" is a number in [0, 600]; '
                             f'got {seconds!r}')
      continue
    command = params.get('command')
    if not (isinstance(command, str) and command.strip() or
            isinstance(command, list) and command and
            all(isinstance(c, str) for c in command)):
      raise base.DataError(f'{at}: {step["type"]} needs a "command" (a '
                           f'string or a list of strings); got {command!r}')
    if not isinstance(params.get('shell', False), bool):
      raise base.DataError(f'{at}: "shell" is true or false')


def instruction(spec: dict[str, Any]) -> str:
  return next(iter(spec['current_task'].values()))


def evaluator_name(spec: dict[str, Any]) -> str:
  return next(iter(spec['current_task']))


def _png_image(data: bytes):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  return Image.open(io.BytesIO(data)).convert('RGB')


def _shrink(png: bytes, max_pixels: int) -> bytes:
  """The screenshot scaled down to at most max_pixels (0: as is)."""
  if not max_pixels:
    return png
  image = _png_image(png)
  w, h = image.size
  if w * h <= max_pixels:
    return png
  scale = (max_pixels / (w * h)) ** 0.5
  out = io.BytesIO()
  image.resize((max(1, int(w * scale)), max(1, int(h * scale)))).save(
      out, format='PNG')
  return out.getvalue()


def _screen_text(xml: str, max_chars: int) -> str:
  """A short text view of the screen: window names and text fields."""
  try:
    root = ET.fromstring(xml)
  except ET.ParseError:
    return ''
  windows, fields = [], []
  for node in root.iter():
    tag, name = node.tag.split('}')[-1], node.get('name') or ''
    if tag in ('frame', 'dialog', 'window') and name:
      windows.append(name)
    elif tag in ('text', 'entry', 'terminal', 'password-text') and (
        node.text or '').strip():
      fields.append(node.text.strip())
  text = 'windows: ' + (', '.join(dict.fromkeys(windows)) or '(none)')
  if fields:
    text += ' | text: ' + ' / '.join(fields)
  return text[:max_chars]


class Episode:
  """One play-through of a task on a desktop of the pool."""

  def __init__(self, env: 'OSWorldEnv', spec: dict[str, Any],
               max_turns: int):
    self.env, self.spec, self.max_turns = env, spec, max_turns
    self.desktop = None
    self.turns, self.png = 0, b''
    self.width = self.height = 0
    self.info: dict[str, Any] = {'invalid_actions': 0, 'failed_actions': 0,
                                 'terminated': None, 'step_s': []}

  def reset(self) -> str:
    self.desktop = self.env.pool.acquire()
    self.desktop.start_task(self.spec)
    self.width, self.height = self.desktop.screen_size()
    return self._observe(first=True)

  def _observe(self, first: bool = False, note: str = '') -> base.Observation:
    before = self.png
    self.png = _shrink(self.desktop.screenshot(), self.env.image_max_pixels)
    text = note or ('the task starts' if first else f'after step {self.turns}')
    if self.env.observation_chars:
      try:
        screen = _screen_text(self.desktop.accessibility(),
                              self.env.observation_chars)
      except desktop.DesktopError:
        screen = ''  # the tree is a courtesy; the screenshot decides
      text = f'{text}; {screen}' if screen else text
    return base.Observation(text, (self.png,) if first else (self.png,
                                                             before))

  def step(self, action: str):
    start = time.perf_counter()
    self.turns += 1
    terminate, note = False, ''
    if action.startswith(INVALID):
      self.info['invalid_actions'] += 1
      note = f'step {self.turns}: {action}; nothing was executed'
    else:
      args = prompts.arguments(action)
      code = prompts.pyautogui_code(args, self.width, self.height)
      if code:
        result = self.desktop.run_pyautogui(code)
        if result.get('returncode', 0) != 0:  # e.g. an unknown key name
          self.info['failed_actions'] += 1
          note = (f'step {self.turns}: the action failed: '
                  f'{(result.get("error") or "").strip()[-200:]}')
      time.sleep(self.env.settle_s)
      if args['action'] == 'terminate':
        terminate = True
        self.info['terminated'] = args['status']
    observation = self._observe(note=note)
    done = terminate or self.turns >= self.max_turns
    outcome = None
    if done:
      passed = self.desktop.evaluate(self.spec, evaluator_name(self.spec))
      outcome = 1.0 if passed else -1.0
    self.info['step_s'].append(round(time.perf_counter() - start, 3))
    return observation, done, outcome

  def close(self):
    if self.desktop is not None:
      self.env.pool.release(self.desktop)
      self.desktop = None


class OSWorldEnv:
  """The OSWorld setting over a pool of desktops."""

  def __init__(self, tasks: Sequence[dict[str, Any]], *,
               pool: desktops.Pool,
               max_turns: int, max_images: int, parse_retries: int,
               retry_temperature: float, settle_s: float,
               image_max_pixels: int, observation_chars: int,
               answer_prefix: str, judge_prefix: str, max_critiques: int,
               max_instruction_chars: int, history: str,
               judge_response_chars: int = 0, local: bool = True):
    if history not in HISTORIES:
      raise ValueError(f'config.env.history={history!r}: one of {HISTORIES}')
    self._tasks = list(tasks)
    self.local = local  # desktops of this host (provider 'local')
    self.pool, self.max_turns = pool, max_turns
    self.max_images, self.parse_retries = max_images, parse_retries
    self.retry_temperature, self.settle_s = retry_temperature, settle_s
    self.image_max_pixels = image_max_pixels
    self.observation_chars = observation_chars
    self.answer_prefix, self.judge_prefix = answer_prefix, judge_prefix
    self.max_critiques = max_critiques
    self.max_instruction_chars = max_instruction_chars
    self.judge_response_chars = judge_response_chars
    self.history = history

  def tasks(self, split: str) -> list[dict[str, Any]]:
    if split not in SPLITS:
      raise ValueError(f'OSWorld split {split!r}: one of {SPLITS}')
    return copy.deepcopy(self._tasks)

  def make_episode(self, spec, seed: int, max_turns: int) -> Episode:
    del seed  # the desktop is deterministic up to the policy's actions
    return Episode(self, spec, max_turns)

  # ---- policy --------------------------------------------------------------

  def _image(self, observation) -> dict[str, Any]:
    images = getattr(observation, 'images', ())
    if not images:
      raise ValueError('an OSWorld observation carries its screenshot; got '
                       'plain text (a step not taken on a desktop?)')
    return {'type': 'image', 'image': _png_image(images[0])}

  def policy_messages(self, spec, turns, observation) -> list[dict]:
    """System tool spec; up to max_images - 1 earlier screenshots, each
    with the agent's answer there; the current screenshot, the instruction
    and every earlier action as text (4.2).

    The answer is the agent's full response with history 'full' (the
    authors'; parse_action then hands the episode that response) or its
    canonical action with 'canonical'; the text list of earlier actions is
    compact either way (prompts.history).
    """
    messages = [{'role': 'system', 'content': prompts.SYSTEM}]
    shown = turns[len(turns) - (self.max_images - 1):] if (
        self.max_images > 1) else []
    for past, action in shown:
      messages.append({'role': 'user', 'content': [self._image(past)]})
      messages.append({'role': 'assistant', 'content': action})
    text = prompts.INSTRUCTION.format(
        instruction=instruction(spec),
        history=prompts.history([a for _, a in turns]))
    messages.append({'role': 'user', 'content': [
        self._image(observation), {'type': 'text', 'text': text}]})
    if self.answer_prefix:
      messages.append({'role': 'assistant', 'content': self.answer_prefix})
    return messages

  def _full(self, response: str) -> str:
    """The response with the answer prefix it continued."""
    return response if response.startswith(self.answer_prefix) else (
        self.answer_prefix + response)

  def parse_action(self, response: str, observation: str) -> str:
    """The canonical action of the response, or with history 'full' the
    full response itself: the rollout keeps what it returns as the turn's
    action, and later prompts show that (the episode parses it again)."""
    del observation
    full = self._full(response)
    try:
      sentence, args = prompts.parse_tool_call(full)
    except prompts.ParseError as e:
      raise base.Unparseable(str(e), f'{INVALID}: {e}') from None
    return full if self.history == 'full' else prompts.canonical(sentence,
                                                                   args)

  # ---- reward model --------------------------------------------------------

  def judge_messages(self, spec, policy_prompt: str, response: str,
                     next_observation) -> list[dict]:
    """The step, the screenshot it was taken on and the one after (4.3).

    The RM reads the policy's whole answer, its answer prefix included (as
    AlfWorld's judge): the prefix may hold the action's start.
    """
    images = getattr(next_observation, 'images', ())
    if len(images) != 2:
      raise ValueError('an OSWorld step observation carries the screenshots '
                       f'after and before the action; got {len(images)}')
    after, before = (_png_image(i) for i in images)
    head = policy_prompt.rsplit('Previous actions:\n', 1)
    history = (head[1].split('\n\nLook at the current screenshot')[0]
               if len(head) == 2 else '(none)')
    text = prompts.JUDGE.format(instruction=instruction(spec),
                                history=history,
                                response=prompts.clip_middle(
                                    self._full(response),
                                    self.judge_response_chars))
    first, rest = text.split('{before}')
    middle, last = rest.split('{after}')
    messages = [
        {'role': 'system', 'content': prompts.JUDGE_SYSTEM},
        {'role': 'user', 'content': [
            {'type': 'text', 'text': first},
            {'type': 'image', 'image': before},
            {'type': 'text', 'text': middle},
            {'type': 'image', 'image': after},
            {'type': 'text', 'text': last}]}]
    if self.judge_prefix:
      messages.append({'role': 'assistant', 'content': self.judge_prefix})
    return messages

  # ---- curator -------------------------------------------------------------

  def describe(self, spec) -> str:
    return f'{instruction(spec)} (checked by evaluator {evaluator_name(spec)})'

  def difficulty(self, spec) -> float:
    evaluator = spec.get('evaluators', {}).get(evaluator_name(spec), {})
    return float(evaluator.get('difficulty', 1.0))

  def rewrite(self, request: base.RewriteRequest, generate: base.GenerateFn,
              attempts: int) -> dict[str, Any]:
    """The first valid one-key JSON proposal of `attempts` (4.5)."""
    spec, direction = request.spec, request.direction
    if direction not in (structs.HARDER, structs.EASIER):
      raise ValueError(f'unknown direction {direction!r}')
    template = spec['task_template']
    critiques = [c for c in request.critiques if c][:self.max_critiques]
    text = prompts.REWRITE.format(
        acc=request.acc_old, direction=direction,
        current=json.dumps(spec['current_task']),
        template=json.dumps(template, indent=1),
        critiques='\n'.join(f'- {c}' for c in critiques) or '(none)',
        max_chars=self.max_instruction_chars)
    reasons = []
    for completion in generate([f'{text}\n\n(Attempt {i}/{attempts})\n'
                                for i in range(1, attempts + 1)]):
      proposal = prompts.parse_rewrite(completion, template,
                                       self.max_instruction_chars)
      if proposal is None:
        reasons.append('no valid one-key JSON object')
      elif {proposal[0]: proposal[1]} == spec['current_task']:
        reasons.append('unchanged task')
      else:
        return self._derive(spec, *proposal)
    summary = '; '.join(f'{reasons.count(r)}x {r}'
                        for r in dict.fromkeys(reasons)) or 'no completions'
    raise base.RewriteRejected(f'{direction} rewrite of {spec["id"]}: no valid '
                               f'proposal ({summary})')

  @staticmethod
  def _derive(spec, name: str, text: str) -> dict[str, Any]:
    root_id = spec.get('root_id', spec['id'])
    version = int(spec.get('version', 0)) + 1
    derived = dict(spec, root_id=root_id, version=version,
                   current_task={name: text}, instruction=text)
    digest = hashlib.sha256(json.dumps([name, text]).encode()).hexdigest()
    derived['id'] = f'{root_id}.v{version}-{digest[:6]}'
    return derived

  def reward_cases(self) -> list[base.RewardCase]:
    """On local desktops: the bundled task xterm-make-folder solved with the
    agent's own actions (a click into the terminal, `mkdir projects`), and
    its start state with the agent claiming success. OSWorld's VMs get no
    cases (their tasks ship no scripted solutions): their rewards are not
    checked."""
    if not self.local:
      return []
    spec = next(t for t in load_tasks(TASK_DIR, 'local')
                if t['id'] == 'xterm-make-folder')

    def act(sentence, **args):
      return prompts.canonical(sentence, args)

    done = act('I am done.', action='terminate', status='success')
    solution = (act('Focus the terminal.', action='left_click',
                    coordinate=[200, 200]),
                act('Make the folder.', action='type', text='mkdir projects\n'),
                done)
    return [base.RewardCase('xterm-make-folder solved', spec, solution, True),
            base.RewardCase('xterm-make-folder at its start', spec, (done,),
                            False)]

  def close(self):
    """Stops the desktops this run started."""
    self.pool.close()

  def metrics(self, trajectories) -> dict[str, float]:
    infos = [t.info for t in trajectories
             if t.status == structs.OK and t.info]
    steps = sum(len(i.get('step_s', ())) for i in infos)
    if not steps:
      return {}
    step_s = [s for i in infos for s in i['step_s']]
    return {
        'invalid_action_frac': sum(i['invalid_actions'] for i in infos) / steps,
        'failed_action_frac': sum(i['failed_actions'] for i in infos) / steps,
        'terminated_frac': sum(i['terminated'] is not None
                               for i in infos) / len(infos),
        'step_s_mean': sum(step_s) / len(step_s),
    }


def make_tokenizer(stage_texts: Sequence[str] = ()):
  """Tokenizer of random models: the words of this setting's prompts and
  tasks, single characters otherwise, and Qwen3-VL's image tokens.

  The stages' texts (`stage_texts`, the curator's critique template) add no
  words: their words outside this vocabulary are <unk> to random models.
  """
  del stage_texts
  texts = [prompts.SYSTEM, prompts.INSTRUCTION, prompts.JUDGE,
           prompts.JUDGE_SYSTEM, prompts.REWRITE]
  texts += [json.dumps(t) for t in load_tasks(TASK_DIR, 'local')]
  words = sorted({w for t in texts for w in re.findall(r'[A-Za-z_]+', t)})
  chars = tuple(word_tokenizer.ALPHABET) + ('"', '<', '>', '|', '#', '*',
                                            '&', '%')
  return word_tokenizer.make_tokenizer(tokens=chars + tuple(words),
                                       split=r'[A-Za-z_]+|\n|.',
                                       specials=VISION_TOKENS)


# config.env keys that OSWorldEnv takes as they are.
ENV_OPTIONS = ('max_turns', 'max_images', 'parse_retries', 'retry_temperature',
               'settle_s', 'image_max_pixels', 'observation_chars',
               'answer_prefix', 'judge_prefix', 'max_critiques',
               'max_instruction_chars', 'judge_response_chars', 'history')


def from_config(env_config, workdir: str) -> OSWorldEnv:
  """The setting of `config.env` (name 'osworld')."""
  del workdir
  factories = {'local': desktops.local_factory, 'vm': desktops.vm_factory}
  if env_config.provider not in factories:
    raise ValueError(f'config.env.provider={env_config.provider!r}: one of '
                     f'{sorted(factories)}')
  pool = desktops.Pool(factories[env_config.provider](env_config),
                       env_config.max_desktops, env_config.acquire_timeout_s)
  tasks = load_tasks(env_config.task_dir or TASK_DIR, env_config.provider)
  return OSWorldEnv(tasks, pool=pool,
                    local=env_config.provider == 'local',
                    **{k: env_config[k] for k in ENV_OPTIONS})
