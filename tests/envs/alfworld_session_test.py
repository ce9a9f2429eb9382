"""KV-session rollouts (sampling.session='kv') on ALFWorld games.

The conversation stays in the sampler's cache across turns; every turn must
record the whole conversation as its prompt tokens, so that what the trainer
scores is exactly what the model conditioned on.
"""

from concurrent import futures

import ml_collections
import pytest

from configs import base
from rla_jax import chat
from rla_jax import rollout
from rla_jax import sampler
from rla_jax.envs.alfworld import environment as alfworld
from rla_jax.models import transformer

pytest.importorskip('alfworld')
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')


@pytest.fixture(scope='module')
def setting(tmp_path_factory):
  env = alfworld.AlfWorldEnv(str(tmp_path_factory.mktemp('games')),
                             num_train=2, max_receptacles=4,
                             distractors=(1, 1), answer_prefix='\\boxed{')
  tok = alfworld.make_tokenizer()
  config = transformer.ModelConfig(
      model_type='qwen2', vocab_size=len(tok), hidden_size=32,
      intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
      head_dim=16, eos_token_ids=(tok.eos_token_id,),
      pad_token_id=tok.pad_token_id)
  return env, tok, transformer.create(config, seed=0)


def _sampling(**overrides):
  section = base.sampling_section(
      temperature=0.0, max_new_tokens=3, max_prompt_len=1024,
      stop_strings=('}',), allowed_tokens=tuple('0123456789}'),
      prompt_buckets=(128, 512, 1024), batch_buckets=(4,), max_rows=4,
      cache_bucket=256)
  section.update(overrides)
  return ml_collections.ConfigDict(section)


def _rollout(setting, sampling, max_turns=4):
  env, tok, model = setting
  calls = []

  def policy(messages, seed):
    calls.append(messages)
    rows = chat.complete(model, tok, messages, sampling=sampling,
                         num_samples=1, seed=seed)
    return [r[0] for r in rows]

  tasks = [(s['id'], s, 'active') for s in env.tasks('train')]
  with futures.ThreadPoolExecutor(2) as pool:
    trajs = rollout.run(env, tasks, group_size=2, policy=policy, pool=pool,
                        seed=0, max_turns=max_turns)
  return trajs, calls


def test_turn_delta_closes_the_answer_and_opens_the_next_turn(setting):
  _, tok, _ = setting
  history = [{'role': 'system', 'content': 'sys'},
             {'role': 'user', 'content': 'obs 1'},
             {'role': 'assistant', 'content': '\\boxed{2}'}]
  new = [{'role': 'user', 'content': 'obs 2'},
         {'role': 'assistant', 'content': '\\boxed{'}]
  assert chat.turn_delta(tok, history, new) == (
      '</s><|user|>obs 2</s><|assistant|>\\boxed{')
  # The answer ended with its stop token already: not closed twice.
  assert chat.turn_delta(tok, history, new, stop_text='</s>') == (
      '<|user|>obs 2</s><|assistant|>\\boxed{')
  whole = chat.render(tok, history[:2] + [history[2]] + new)
  start = chat.render(tok, history[:2] + [
      {'role': 'assistant', 'content': '\\boxed{'}])
  assert whole == start + '2}' + chat.turn_delta(tok, history, new)


def test_kv_turns_record_the_whole_conversation(setting):
  trajs, calls = _rollout(setting, _sampling(session='kv'))
  env, tok, model = setting
  assert all(isinstance(m, chat.Turn) for m in calls[0])
  assert calls[0][0].state.restarts == 0
  for traj in trajs:
    steps = traj.steps
    assert len(steps) == 4
    for prev, step in zip(steps, steps[1:]):
      # Each turn's prompt extends the previous prompt and answer.
      held = prev.prompt_tokens + prev.response_tokens
      assert step.prompt_tokens[:len(held)] == held
      delta = tok.decode(step.prompt_tokens[len(held):])
      assert delta.startswith('</s><|user|>observation: ')
      assert delta.endswith('<|assistant|>\\boxed{')
    # The RM sees the turn in the authors' format, with its history.
    assert 'you took action:' in steps[-1].prompt
    assert steps[-1].prompt.count('You are playing a text game') == 1
    # What the trainer scores is what the sampler conditioned on: a fresh
    # prefill of the recorded prompt gives the same answer and log-probs.
    for step in steps:
      fresh = sampler.generate(
          model, [step.prompt_tokens], 3, temperature=0.0,
          stop_token_ids=chat.stop_token_ids(tok),
          allowed_token_ids=tuple(tok.convert_tokens_to_ids(c)
                                  for c in '0123456789}'),
          stop_strings=('}',), tokenizer=tok, prompt_buckets=(1024,),
          batch_buckets=(4,))
      assert fresh.tokens[0] == step.response_tokens
      assert fresh.logprobs[0] == pytest.approx(step.logprobs, abs=1e-4)
  del env


def test_kv_and_rerendered_modes_play_the_same_games(setting):
  kv, _ = _rollout(setting, _sampling(session='kv'), max_turns=2)
  plain, calls = _rollout(setting, _sampling(), max_turns=2)
  assert [len(t.steps) for t in kv] == [len(t.steps) for t in plain]
  # Turn 0 is the same prompt either way (a chat of one user turn).
  assert [t.steps[0].prompt_tokens for t in kv] == [
      t.steps[0].prompt_tokens for t in plain]
  assert calls[0][0].state.sessions == {}  # the default never holds a cache


def test_conversation_over_the_cap_restarts_compacted(setting):
  trajs, calls = _rollout(setting, _sampling(session='kv', max_prompt_len=450,
                                             prompt_buckets=(128, 512)),
                          max_turns=6)
  state = calls[0][0].state
  assert state.restarts >= 1
  cut = [s for t in trajs for s in t.steps if s.prompt_cut]
  assert cut
  for traj in trajs:
    for step in traj.steps:
      assert len(step.prompt_tokens) <= 450
  for step in cut:
    # The first exchange (the task) stays; older turns went.
    text = setting[1].decode(step.prompt_tokens)
    assert text.count('Your task is to:') == 1


def test_kv_needs_an_environment_with_turn_messages(setting):
  env, tok, model = setting

  class NoChat:
    max_turns = 2

    def __init__(self):
      self.inner = env

    def __getattr__(self, name):
      if name == 'turn_messages':
        raise AttributeError(name)
      return getattr(self.inner, name)

  def policy(messages, seed):
    rows = chat.complete(model, tok, messages, sampling=_sampling(
        session='kv'), num_samples=1, seed=seed)
    return [r[0] for r in rows]

  spec = env.tasks('train')[0]
  with futures.ThreadPoolExecutor(1) as pool:
    with pytest.raises(ValueError, match='turn_messages'):
      rollout.run(NoChat(), [(spec['id'], spec, 'active')], group_size=1,
                  policy=policy, pool=pool, seed=0, max_turns=2)
  with pytest.raises(ValueError, match='session'):
    chat.complete(model, tok, [[{'role': 'user', 'content': 'x'}]],
                  sampling=_sampling(session='disk'), num_samples=1, seed=0)
