"""Sampler: parity with transformers, log-probs, stops, buckets, sessions."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rla_jax import sampler
from rla_jax import sampling
from rla_jax import sharding
from rla_jax.models import hf
from rla_jax.models import kv_cache
from rla_jax.models import transformer

N = 32  # new tokens in most tests (one static shape: fewer compiles)


def _prompts(lengths, seed=0, vocab=256):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _hf_greedy(ref, prompt, n):
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
  return out[0, len(prompt):].tolist()


@jax.jit
def _forward(model, tokens_BxT):
  return jax.nn.log_softmax(model(tokens_BxT), axis=-1)


def _teacher_forced(model, prompts, outputs, length=128):
  """Full-forward log-probs of each output after its prompt (one program)."""
  seqs = np.zeros((len(prompts), length), np.int32)  # right padding: causal
  for r, (p, t) in enumerate(zip(prompts, outputs)):
    seqs[r, :len(p) + len(t)] = p + t
  logp = np.asarray(_forward(model, jnp.asarray(seqs)))
  return [logp[r, np.arange(len(p) - 1, len(p) + len(t) - 1), t]
          for r, (p, t) in enumerate(zip(prompts, outputs))]


class CharTokenizer:
  """Stands in for a transformers tokenizer: token t is two letters."""

  def decode(self, ids, skip_special_tokens=False):
    del skip_special_tokens
    return ''.join(chr(97 + t % 26) + chr(97 + t // 26 % 26) for t in ids)


# Both layer layouts; the scanned one with 8-slot attention blocks, so the
# prefill runs blockwise and decode reads several cache blocks.
LAYOUTS = {'unrolled': {}, 'scanned': dict(scan_layers=True,
                                           attention_block=8)}


@pytest.fixture(scope='module', params=sorted(LAYOUTS))
def qwen2(tmp_path_factory, request):
  from conftest import make_hf_model  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp('qwen2')
  ref = make_hf_model(path, 'qwen2', tie_word_embeddings=True)
  options = LAYOUTS[request.param]
  return hf.load(str(path), **options)[0], ref, str(path), options


@pytest.mark.parametrize('family,layout,unroll_from', [
    ('llama', 'unrolled', 0), ('qwen2', 'unrolled', 0),
    ('qwen3', 'unrolled', 0), ('qwen3', 'scanned', 0),
    ('qwen2', 'scanned', N)])
def test_greedy_equals_transformers(hf_model_factory, family, layout,
                                    unroll_from):
  path, ref = hf_model_factory(family, tie_word_embeddings=family != 'llama')
  model, _ = hf.load(path, **LAYOUTS[layout])
  prompts = _prompts([5, 17, 11])
  before = sampler.num_traces()
  out = sampler.generate(model, prompts, N, temperature=0.0,
                         unroll_decode_from=unroll_from)
  assert sampler.num_traces() == before + 1
  for prompt, tokens in zip(prompts, out.tokens):
    assert tokens == _hf_greedy(ref, prompt, N)
  assert out.finish_reason == [sampler.LENGTH] * 3
  assert out.num_tokens == [N] * 3
  for got, want in zip(out.logprobs,
                       _teacher_forced(model, prompts, out.tokens)):
    np.testing.assert_allclose(got, want, atol=1e-4)
  # Same buckets (prompt <= 32 tokens, 3-4 prompts): no new program.
  again = sampler.generate(model, _prompts([30, 2, 9, 20], seed=1), N,
                           temperature=0.0, seed=5,
                           unroll_decode_from=unroll_from)
  assert sampler.num_traces() == before + 1
  assert again.num_tokens == [N] * 4


def test_sampled_logprobs_equal_teacher_forcing(qwen2):
  model = qwen2[0]
  prompts = _prompts([3, 20, 9])
  out = sampler.generate(model, prompts, N, temperature=0.7, seed=1,
                         num_samples=2)
  assert len(out.tokens) == 6
  want = _teacher_forced(model, [p for p in prompts for _ in range(2)],
                         out.tokens)
  for got, want_row in zip(out.logprobs, want):
    np.testing.assert_allclose(got, want_row, atol=1e-4)
  assert out.tokens[0] != out.tokens[1]  # the G samples differ
  # Deterministic per seed, and a row's stream does not depend on the rest
  # of the batch (nor on the batch bucket it falls in).
  same = sampler.generate(model, prompts, N, temperature=0.7, seed=1,
                          num_samples=2)
  assert same.tokens == out.tokens
  mixed = sampler.generate(model, prompts[:1] + _prompts([30, 2, 8], seed=9),
                           N, temperature=0.7, seed=1, num_samples=2)
  assert mixed.tokens[:2] == out.tokens[:2]
  other = sampler.generate(model, prompts, N, temperature=0.7, seed=2,
                           num_samples=2)
  assert other.tokens != out.tokens


def test_cached_decode_equals_full_forward(qwen2):
  model = qwen2[0]
  tokens = np.asarray(_prompts([12, 12], seed=3), np.int32)
  mask = np.ones((2, 12), bool)
  mask[1, :5] = False  # left padding
  full = np.asarray(jax.jit(lambda m, t, k: m(t, mask_BxT=k))(
      model, jnp.asarray(tokens), jnp.asarray(mask)))
  positions = transformer.default_positions(jnp.asarray(mask))
  decode = jax.jit(lambda m, *args, head_DxV: m.decode(*args,
                                                        head_DxV=head_DxV))
  # The stacked cache, and the per-layer one of an unrolled decode loop;
  # the head whole, transposed, or in column blocks.
  for head_DxV, per_layer in ((None, False), (model.head_weight().T, False),
                              (transformer.head_blocks(model, 48), True)):
    cache = kv_cache.init(model.config, 2, 16)
    _, cache = decode(model, tokens[:, :4], positions[:, :4], mask[:, :4],
                      cache, head_DxV=None)
    if per_layer:
      cache = kv_cache.per_layer(cache)
    for t in range(4, 12):
      logits, cache = decode(model, tokens[:, t:t + 1], positions[:, t:t + 1],
                             mask[:, t:t + 1], cache, head_DxV=head_DxV)
      real = mask[:, t]  # a padding query attends to nothing: no reference
      np.testing.assert_allclose(np.asarray(logits[real, 0]), full[real, t],
                                 atol=1e-5)
    assert kv_cache.is_per_layer(cache) == per_layer
  with pytest.raises(ValueError, match='one token a step'):
    decode(model, tokens[:, :2], positions[:, :2], mask[:, :2], cache,
           head_DxV=None)


def test_unrolled_decode_equals_the_scanned_loop(qwen2):
  """A call of unroll_decode_from new tokens or more decodes over the
  per-layer cache: the same tokens, log-probs and kept session as the
  scanned loop, one program per bucket."""
  model = qwen2[0]
  if not model.config.scan_layers:
    pytest.skip('a model without scan_layers has no scanned loop')
  prompts = _prompts([3, 20, 9])
  kwargs = dict(temperature=0.7, seed=1, num_samples=2, keep_session=True)
  ref = sampler.generate(model, prompts, N, **kwargs)
  before = sampler.num_traces()
  out = sampler.generate(model, prompts, N, unroll_decode_from=N, **kwargs)
  assert sampler.num_traces() == before + 1
  assert out.tokens == ref.tokens
  np.testing.assert_allclose(np.concatenate(out.logprobs),
                             np.concatenate(ref.logprobs), atol=1e-5)
  assert not kv_cache.is_per_layer(out.session.cache)
  np.testing.assert_allclose(out.session.cache.k, ref.session.cache.k,
                             atol=1e-5)
  # Fewer new tokens than unroll_decode_from: the scanned program.
  sampler.generate(model, prompts, N, unroll_decode_from=N + 1, **kwargs)
  assert sampler.num_traces() == before + 1
  # The kept session continues in the unrolled loop like a fresh prefill.
  observations = [[5, 6], [7], [8, 9, 10], [11], [12], [13]]
  second = sampler.generate(model, observations, N, temperature=0.0,
                            session=out.session, unroll_decode_from=1)
  whole = [p + t + o for p, t, o in zip(
      [p for p in prompts for _ in range(2)], out.tokens, observations)]
  fresh = sampler.generate(model, whole, N, temperature=0.0,
                           prompt_buckets=(128,))
  assert second.tokens == fresh.tokens


def test_greedy_and_sampled_calls_share_one_program(qwen2):
  """The temperature is an argument: evaluation (greedy) and rollouts
  (sampled) of one shape run the same compiled program."""
  model = qwen2[0]
  prompts = _prompts([5, 7])
  sampled = sampler.generate(model, prompts, N, temperature=0.9, seed=3)
  before = sampler.num_traces()
  greedy = sampler.generate(model, prompts, N, temperature=0.0)
  again = sampler.generate(model, prompts, N, temperature=0.9, seed=3)
  assert sampler.num_traces() == before
  assert again.tokens == sampled.tokens
  # Greedy rows pick the argmax of the teacher-forced logits.
  for prompt, tokens in zip(prompts, greedy.tokens):
    logits = model(jnp.asarray([list(prompt) + tokens[:-1]]))[0]
    assert tokens == np.asarray(
        jnp.argmax(logits[len(prompt) - 1:], axis=-1)).tolist()
  with pytest.raises(ValueError, match='temperature'):
    sampler.generate(model, prompts, N, temperature=-1.0)


def test_the_cpu_program_uses_xlas_dots_not_ynnpack(qwen2):
  """On CPU the generation program is compiled without YNNPACK fusions
  (sampler.CPU_COMPILER_OPTIONS: slower for decode's skinny matmuls), while
  other programs keep XLA's default."""
  model = qwen2[0]
  graphdef, params = sampler._split(model)  # pylint: disable=protected-access
  text = sampler.lower(graphdef.graphdef, params, 2, 8, 4).compile().as_text()
  assert 'dot(' in text and 'ynn_fusion' not in text
  default = jax.jit(lambda a, b: a @ b).lower(
      jnp.ones((16, 64)), jnp.ones((64, 256))).compile().as_text()
  assert 'ynn_fusion' in default  # the option is what removes them


def _copies_in_loop(hlo_text, shape):
  """How many copy instructions in the body of the module's while loops
  (and the computations they call) make a float32 array of `shape`."""
  bodies = {}
  name = None
  for line in hlo_text.splitlines():
    head = re.match(r'(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if head and not line.startswith(' '):
      name = head.group(1)
      bodies[name] = []
    elif name:
      bodies[name].append(line)
  called = lambda lines: set(re.findall(
      r'(?:body|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)',
      '\n'.join(lines)))
  todo = {c for lines in bodies.values() for c in re.findall(
      r'body=%?([\w.\-]+)', '\n'.join(lines))}
  seen = set()
  while todo:
    c = todo.pop()
    if c in seen or c not in bodies:
      continue
    seen.add(c)
    todo |= called(bodies[c])
  dims = ','.join(map(str, shape))
  pattern = re.compile(rf'= f32\[{dims}\]\S* copy\(')
  return sum(len(pattern.findall(line)) for c in seen for line in bodies[c])


def _copying_decode_loop(layers, shape):
  """A loop whose cache read is not ordered before the cache's write: XLA
  keeps the old value with a copy of each layer's cache, every step."""

  def step(state):
    i, x_BxKxD, cache = state
    new = []
    for c in cache:
      scores_BxKxS = jnp.einsum('bkd,bksd->bks', x_BxKxD, c)
      new.append(jax.lax.dynamic_update_slice(c, x_BxKxD[:, :, None],
                                              (0, 0, i, 0)))
      x_BxKxD = jnp.einsum('bks,bksd->bkd', scores_BxKxS, c)
    return i + 1, x_BxKxD, tuple(new)

  loop = jax.jit(lambda x, cache: jax.lax.while_loop(
      lambda s: s[0] < 4, step, (0, x, cache)), donate_argnums=1)
  b, k, _, d = shape
  return loop.lower(jnp.ones((b, k, d)), tuple(
      jnp.ones(shape) for _ in range(layers))).compile().as_text()


def test_decode_writes_the_cache_in_place(qwen2):
  """No decode step of a compiled generation program copies the cache:
  neither the stacked one of the scanned loop nor a layer's array of the
  unrolled loop. The check finds the per-step copies of a loop that reads
  its cache unordered with the write."""
  model = qwen2[0]
  c = model.config
  graphdef, params = sampler._split(model)  # pylint: disable=protected-access
  b, slots = 4, 16 + 8
  stacked = (c.num_layers, b, slots, c.num_kv_heads, c.head_dim)
  layer = (b, c.num_kv_heads, slots, c.head_dim)
  # A model without scan_layers always decodes over the per-layer cache.
  assert sampler.unrolled_decode(c, 8, 0) == (not c.scan_layers)
  assert sampler.unrolled_decode(c, 8, 8) and not (
      c.scan_layers and sampler.unrolled_decode(c, 8, 9))
  for unroll, shape in ((False, stacked), (True, layer))[not c.scan_layers:]:
    text = sampler.lower(graphdef.graphdef, params, b, 16, 8,
                         unroll=unroll).compile().as_text()
    assert 'while' in text and _copies_in_loop(text, shape) == 0
  copying = _copying_decode_loop(c.num_layers, layer)
  assert _copies_in_loop(copying, layer) >= c.num_layers


def test_top_k_one_is_greedy_and_filters_match_sorting(qwen2):
  model = qwen2[0]
  prompts = _prompts([4, 9, 6])
  greedy = sampler.generate(model, prompts, N, temperature=0.0)
  top1 = sampler.generate(model, prompts, N, temperature=1.3, top_k=1,
                          top_p=0.9, seed=7)
  assert top1.tokens == greedy.tokens
  # Filters against a sort-based reference; draws against the exact CDF.
  logits = np.asarray(jax.random.normal(jax.random.key(0), (64, 50)) * 2)
  u = np.asarray(jax.random.uniform(jax.random.key(1), (64,)))
  for temperature, top_k, top_p in [(0.5, 7, 1.0), (2.0, 10, 0.8)]:
    params = sampling.Params(temperature, top_p, top_k)
    got = np.asarray(jax.jit(sampling.next_token, static_argnums=2)(
        jnp.asarray(logits), jnp.asarray(u), params))
    for row, u_row, token in zip(logits, u, got):
      probs = np.exp((row - row.max()) / temperature)
      order = np.argsort(-row, kind='stable')
      keep = order[:top_k] if top_k else order
      probs_kept = probs[keep] / probs[keep].sum()
      before = np.cumsum(probs_kept) - probs_kept
      keep = keep[before < top_p * (1 - 1e-6)]
      weights = np.zeros_like(probs)
      weights[keep] = probs[keep]
      cdf = np.cumsum(weights / weights.sum())
      assert token in keep
      # u lies in the token's CDF interval (float slack at the edges).
      lo = cdf[token] - weights[token] / weights.sum()
      assert lo - 1e-5 <= u_row <= cdf[token] + 1e-5


def test_stop_tokens_and_stop_strings(qwen2):
  model = qwen2[0]
  prompts = _prompts([6, 13, 8])
  free = sampler.generate(model, prompts, N, temperature=0.0)
  stop = free.tokens[1][5]
  out = sampler.generate(model, prompts, N, temperature=0.0,
                         stop_token_ids=(stop, 255))
  for free_row, row, reason, n in zip(free.tokens, out.tokens,
                                      out.finish_reason, out.num_tokens):
    if stop in free_row:
      cut = free_row.index(stop) + 1
      assert (row, reason, n) == (free_row[:cut], sampler.STOP_TOKEN, cut)
    else:
      assert (row, reason, n) == (free_row, sampler.LENGTH, N)
  tokens, logprobs, mask = out.padded(N)
  assert mask[1].sum() == out.num_tokens[1] < N
  assert not tokens[1][~mask[1]].any() and not logprobs[1][~mask[1]].any()
  np.testing.assert_array_equal(tokens[1][mask[1]], out.tokens[1])
  # Stop strings: the text of row 0 up to its 4th token, as seen by decode.
  tok = CharTokenizer()
  target = tok.decode(free.tokens[0][2:4])[1:3]  # spans a token boundary
  strung = sampler.generate(model, prompts, N, temperature=0.0,
                            stop_strings=('@@', target), tokenizer=tok)
  assert strung.finish_reason[0] == sampler.STOP_STRING
  k = strung.num_tokens[0]
  assert k <= 4 and target in strung.texts[0]
  assert target not in tok.decode(free.tokens[0][:k - 1])
  assert strung.tokens[0] == free.tokens[0][:k]
  assert strung.logprobs[0] == free.logprobs[0][:k]
  with pytest.raises(ValueError, match='tokenizer'):
    sampler.generate(model, prompts, N, stop_strings=('x',))


def test_sessions_continue_like_a_fresh_prefill(qwen2):
  """Turn 2 from the held cache equals turn 2 prefilled from scratch."""
  model = qwen2[0]
  tok = CharTokenizer()
  prompts = _prompts([7, 19, 4])
  first = sampler.generate(model, prompts, N, temperature=0.0,
                           keep_session=True)
  # Row 1 is cut by a stop string, so its cache must drop the tail.
  stop_at = tok.decode(first.tokens[1][9:10])
  first = sampler.generate(model, prompts, N, temperature=0.0,
                           keep_session=True, stop_strings=(stop_at,),
                           tokenizer=tok)
  assert first.finish_reason[1] == sampler.STOP_STRING
  observations = [_prompts([3], seed=4)[0], None, _prompts([11], seed=5)[0]]
  second = sampler.generate(model, observations, N, temperature=0.0,
                            session=first.session, keep_session=True)
  assert second.finish_reason[1] == sampler.INACTIVE
  with pytest.raises(ValueError, match='continued already'):
    sampler.generate(model, observations, N, session=first.session)
  whole = [p + t + (o or []) for p, t, o in zip(prompts, first.tokens,
                                                  observations)]
  long = dict(temperature=0.0, prompt_buckets=(128,))  # one program for refs
  fresh = sampler.generate(model, whole, N, **long)
  assert [second.tokens[0], second.tokens[2]] == [fresh.tokens[0],
                                                  fresh.tokens[2]]
  np.testing.assert_allclose(second.logprobs[0], fresh.logprobs[0], atol=1e-4)
  assert second.session.conversations[0] == whole[0] + fresh.tokens[0]
  assert second.session.conversations[1] == whole[1]
  # Now the idle row continues; a small max_cache_length forces compaction.
  third_obs = [[5], [6, 7], [8]]
  ref = sampler.generate(model, [c + o for c, o in zip(
      second.session.conversations, third_obs)], N, **long)
  for limit in (8192, 200):  # a session is used once: continue a copy
    held = sampler.Session(jax.tree.map(jnp.copy, second.session.cache),
                           second.session.conversations)
    third = sampler.generate(model, third_obs, N, session=held,
                             max_cache_length=limit, **long)
    assert third.tokens == ref.tokens


def test_sharded_generation_equals_one_device(qwen2):
  model, _, path, options = qwen2
  mesh = sharding.make_mesh(2, 2, 2)
  sharded, _ = hf.load(path, mesh=mesh, **options)
  prompts = _prompts([5, 20, 9, 14])
  kwargs = dict(temperature=0.7, seed=3, num_samples=2)
  out = sampler.generate(sharded, prompts, N, mesh=mesh, keep_session=True,
                         **kwargs)
  ref = sampler.generate(model, prompts, N, **kwargs)
  assert out.tokens == ref.tokens
  np.testing.assert_allclose(np.concatenate(out.logprobs),
                             np.concatenate(ref.logprobs), atol=1e-5)
  # [L, B, S, K, Dh]: batch over data x fsdp, kv heads over tensor.
  k = out.session.cache.k
  assert k.addressable_shards[0].data.shape == (2, 2, k.shape[2], 1, 64 // 4)
  # The unrolled loop's per-layer cache is sharded the same way.
  unrolled = sampler.generate(sharded, prompts, N, mesh=mesh,
                              unroll_decode_from=1, **kwargs)
  assert unrolled.tokens == ref.tokens


def test_bucket_rounding():
  assert sampler._bucket(3, (1, 2, 4, 8)) == 4
  assert sampler._bucket(8, (1, 2, 4, 8)) == 8
  assert sampler._bucket(9, (1, 2, 4, 8)) == 16
  assert sampler._bucket(300, (256,)) == 512
