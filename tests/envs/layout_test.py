"""The settings' layout: one package each, no import up into the stages.

A setting (rla_jax/envs/) may use the plain records and text helpers the
stages share (structs, boxed, truncation) and other modules of envs/; it
never imports a stage (curator, judge, rollout, ...). Every hook the stages
look up on a setting is documented in envs/base.py.
"""

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

from rla_jax import envs
from rla_jax.envs import base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
ENVS_DIR = os.path.join(ROOT, 'rla_jax', 'envs')
# What a setting may import from rla_jax outside rla_jax.envs.
ALLOWED = {'rla_jax.structs', 'rla_jax.boxed', 'rla_jax.truncation'}
# The stage modules (and the loop that orders them).
STAGES = {'rla_jax.' + m for m in (
    'curator', 'judge', 'loop', 'rollout', 'feedback', 'train',
    'train_epoch', 'chat', 'sampler', 'runtime', 'main')}
# Scripts the system python3 runs (the desktop's server, with pyatspi and
# Xlib), not importable in the training environment.
SCRIPTS = {f'rla_jax.envs.osworld.desktop_{m}'
           for m in ('server', 'a11y', 'setup', 'files', 'windows')}
SETTINGS = ('tiny', 'textworld', 'alfworld', 'coding', 'osworld')


def _sources():
  for folder, _, files in os.walk(ENVS_DIR):
    for name in sorted(files):
      if name.endswith('.py'):
        yield os.path.join(folder, name)


def _module_name(path):
  rel = os.path.relpath(path, ROOT)[:-len('.py')].split(os.sep)
  return '.'.join(rel[:-1] if rel[-1] == '__init__' else rel)


def imported(path):
  """Every rla_jax module a file imports, at any depth (lazy imports too)."""
  tree = ast.parse(open(path, encoding='utf-8').read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        # `from rla_jax import x` imports module x; `from m import name`
        # imports from m.
        names.add(full if _is_module(full) else node.module)
  return {n for n in names if n == 'rla_jax' or n.startswith('rla_jax.')}


def _is_module(name):
  parts = name.split('.')
  path = os.path.join(ROOT, *parts)
  return os.path.isdir(path) or os.path.isfile(path + '.py')


def upward(path):
  return sorted(m for m in imported(path)
                if m not in ALLOWED and not m.startswith('rla_jax.envs'))


def test_no_setting_module_imports_a_stage():
  sources = list(_sources())
  assert len(sources) >= 25  # every file of every setting is read
  found = {os.path.relpath(p, ROOT): upward(p) for p in sources}
  assert {p: m for p, m in found.items() if m} == {}


def test_the_check_sees_lazy_and_aliased_imports(tmp_path):
  # The failure the check exists for: the import that alfworld's tokenizer
  # once made inside a function, to read the curator's template.
  bad = tmp_path / 'bad.py'
  bad.write_text('def make_tokenizer():\n'
                 '  from rla_jax import curator as c\n'
                 '  import rla_jax.judge\n'
                 '  from rla_jax.feedback import score\n'
                 '  from rla_jax import structs\n'
                 '  return c, score\n')
  assert upward(str(bad)) == ['rla_jax.curator', 'rla_jax.feedback',
                              'rla_jax.judge']


def test_importing_every_setting_module_loads_no_stage():
  names = sorted(
      m.name for m in pkgutil.walk_packages(envs.__path__, 'rla_jax.envs.')
      if m.name not in SCRIPTS)
  assert {f'rla_jax.envs.{s}' for s in SETTINGS} <= set(names)
  code = ('import importlib, json, sys\n'
          f'for name in {names!r}:\n'
          '  importlib.import_module(name)\n'
          'print(json.dumps(sorted(m for m in sys.modules\n'
          '                        if m.startswith("rla_jax"))))\n')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
  assert set(names) <= loaded
  assert loaded & STAGES == set()
  assert {m for m in loaded if not m.startswith('rla_jax.envs')} <= (
      ALLOWED | {'rla_jax', 'rla_jax.envs'})


@pytest.mark.parametrize('name', SETTINGS)
def test_each_setting_has_a_public_face(name):
  module = importlib.import_module(f'rla_jax.envs.{name}')
  assert callable(module.from_config)
  assert module.__doc__ and len(module.__doc__.splitlines()) >= 3
  if name != 'textworld':  # textworld runs real models only
    tok = module.make_tokenizer(('a critique of the trajectories',))
    assert tok.decode(tok.encode('a b', add_special_tokens=False)) == 'a b'


def _documented():
  names = set()
  for proto in (base.Environment, base.Episode, base.OptionalHooks,
                base.UnitTestHooks, base.SettingModule):
    names |= {n for n in vars(proto) if not n.startswith('_')}
    names |= set(getattr(proto, '__annotations__', {}))
  return names


def _looked_up(tree):
  """Hook names the stages read from an environment, episode or setting
  module: `getattr(env, 'x', ...)`, `hasattr(env, 'x')`, and the names a
  `for m in (...): hasattr(env, m)` loop checks."""
  def lookups(node):
    for n in ast.walk(node):
      if (isinstance(n, ast.Call) and len(n.args) >= 2 and
          getattr(n.func, 'id', '') in ('getattr', 'hasattr') and
          ast.unparse(n.args[0]).endswith(('env', 'episode', 'env_module'))):
        yield n.args[1]

  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
      if any(isinstance(a, ast.Name) for a in lookups(node)):
        names |= {e.value for e in node.iter.elts
                  if isinstance(e, ast.Constant)}
  names |= {a.value for a in lookups(tree) if isinstance(a, ast.Constant)}
  return names


def test_every_hook_the_stages_use_is_documented_in_base():
  looked_up = set()
  for name in os.listdir(os.path.join(ROOT, 'rla_jax')):
    if name.endswith('.py'):
      path = os.path.join(ROOT, 'rla_jax', name)
      looked_up |= _looked_up(ast.parse(open(path, encoding='utf-8').read()))
  # What the stages read today; a new one must be documented in base.py.
  assert {'turn_messages', 'parse_retries', 'retry_temperature', 'metrics',
          'close', 'make_tokenizer', 'info', 'rm_messages', 'parse_judgment',
          'execute'} <= looked_up
  assert looked_up - _documented() == set()
