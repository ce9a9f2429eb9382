"""Prompt truncation: over-long prompts lose their history, not their head."""

import ml_collections
import pytest

from configs import base
from rla_jax import chat
from rla_jax import truncation
from rla_jax.envs import word_tokenizer
from rla_jax.models import transformer


@pytest.fixture(scope='module')
def tok():
  return word_tokenizer.make_tokenizer()  # one token per character


def test_short_prompt_is_untouched(tok):
  text = 'rules. ' + truncation.cuttable('old turns. ') + 'now?'
  ids, cut, seen = truncation.encode(tok, text, 64)
  assert not cut and seen == text
  assert ids == tok(truncation.plain(text), add_special_tokens=False)['input_ids']


def test_history_loses_its_oldest_tokens_first(tok):
  head, history, tail = 'RULES:a,b. ', 'turn1 turn2 turn3 turn4 ', 'NOW: go?'
  text = head + truncation.cuttable(history) + tail
  ids, cut, seen = truncation.encode(tok, text, 30)
  assert cut and len(ids) == 30
  words = tok.decode(ids)
  assert words.startswith(head) and words.endswith(tail)
  kept = 30 - len(head) - len(tail) - len(truncation.CUT_NOTICE)
  assert words == head + truncation.CUT_NOTICE + history[-kept:] + tail
  # The text keeps the mark of what is left (a judge prompt that embeds it
  # can cut it again).
  assert seen == head + truncation.cuttable(truncation.CUT_NOTICE + history[-kept:]) + tail


def test_several_cuttable_spans_are_cut_oldest_first(tok):
  text = ('H ' + truncation.cuttable('aaaaaaaaaa') + ' M ' + truncation.cuttable('bbbbbbbbbb')
          + ' T')
  ids, cut, _ = truncation.encode(tok, text, 22)
  words = tok.decode(ids)
  assert cut and len(ids) == 22
  # 'H ' + ' M ' + ' T' = 7 fixed, notice 6 -> 9 of 20 cuttable kept.
  assert words == 'H ' + truncation.CUT_NOTICE + ' M ' + 'b' * 9 + ' T'


def test_unmarked_prompt_keeps_head_and_tail(tok):
  text = 'instructions first ' + 'x' * 100 + ' latest turn'
  ids, cut, seen = truncation.encode(tok, text, 40)
  words = tok.decode(ids)
  assert cut and len(ids) == 40 and seen == words
  assert words.startswith('instructions') and words.endswith('latest turn')
  assert truncation.CUT_NOTICE in words


def test_fixed_parts_too_long_drop_history_then_halves(tok):
  text = 'h' * 30 + truncation.cuttable('history') + 't' * 30
  ids, cut, _ = truncation.encode(tok, text, 40)
  words = tok.decode(ids)
  assert cut and len(ids) == 40 and 'history' not in words
  assert words.startswith('h' * 17) and words.endswith('t' * 17)


def test_complete_reports_cuts(tok):
  config = transformer.ModelConfig(
      model_type='qwen2', vocab_size=len(tok), hidden_size=32,
      intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
      head_dim=16)
  model = transformer.create(config, seed=0)
  sampling = ml_collections.ConfigDict(base.sampling_section(
      max_new_tokens=2, max_prompt_len=48, prompt_buckets=(64,),
      batch_buckets=(4,), stop_strings=()))
  long = [{'role': 'user', 'content': 'rules. ' + truncation.cuttable('z' * 80) +
           'go'}]
  short = [{'role': 'user', 'content': 'hi'}]
  rows = chat.complete(model, tok, [long, short], sampling=sampling,
                       num_samples=1, seed=0)
  assert [r[0].prompt_cut for r in rows] == [True, False]
  assert len(rows[0][0].prompt_tokens) == 48
  assert truncation.plain(rows[0][0].prompt).startswith('<|user|>rules. ')
