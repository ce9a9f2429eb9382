"""Attention implementations against the plain einsum; memory of the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rla_jax.models import attention

B, H, K, DH = 2, 6, 2, 16  # GQA: 3 query heads per kv head


def _qkv(t, s=None, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  s = s or t
  q = rng.normal(size=(B, t, H, DH))
  k = rng.normal(size=(B, s, K, DH))
  v = rng.normal(size=(B, s, K, DH))
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _masks(t):
  """Left padding (row 1), right padding (row 0), and a whole padded row."""
  both = np.ones((B, t), bool)
  both[0, t - 5:] = False
  both[1, :9] = False
  empty = both.copy()
  empty[1] = False  # every query of row 1 sees nothing
  return {'padded': jnp.asarray(both), 'empty_row': jnp.asarray(empty)}


def _einsum(q, k, v, mask_BxS, q_offset=0):
  """Independent reference: per-head numpy-style loops over GQA groups."""
  t, s, g = q.shape[1], k.shape[1], H // K
  k = jnp.repeat(k, g, axis=2)
  v = jnp.repeat(v, g, axis=2)
  scores = jnp.einsum('bthd,bshd->bhts', q, k) / np.sqrt(DH)
  visible = mask_BxS[:, None, None, :] & (
      jnp.arange(s)[None, :] <= q_offset + jnp.arange(t)[:, None])[None, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  probs = jnp.where(jnp.any(visible, -1, keepdims=True), probs, 0.0)
  return jnp.einsum('bhts,bshd->bthd', probs, v)


def _real(mask_BxT):
  return np.asarray(mask_BxT)[:, :, None, None]


@pytest.mark.parametrize('block', [8, 13, 512])
@pytest.mark.parametrize('case', ['padded', 'empty_row'])
def test_chunked_and_xla_match_einsum_with_gradients(block, case):
  t = 37  # not a multiple of any block: padded blocks are exercised
  q, k, v = _qkv(t)
  mask = _masks(t)[case]
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w)
  want = _einsum(q, k, v, mask)
  want_grads = jax.grad(loss(lambda q, k, v: _einsum(q, k, v, mask)),
                        argnums=(0, 1, 2))(q, k, v)
  for impl in ('xla', 'chunked'):
    fn = lambda q, k, v, impl=impl: attention.attention(
        q, k, v, mask, impl=impl, block=block)
    got = jax.jit(fn)(q, k, v)
    # Every query that sees a key, padding queries included, and zeros for
    # queries that see none.
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert np.all(np.isfinite(got))
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
    for name, g, g_want in zip('qkv', grads, want_grads):
      np.testing.assert_allclose(g, g_want, atol=1e-5, err_msg=f'd{name}')


def test_chunked_with_a_cache_offset():
  """A chunk of 7 queries appended at slot 13 of a 50-slot cache with holes."""
  q, k, v = _qkv(7, 50, seed=2)
  mask = jnp.asarray(np.random.default_rng(3).random((B, 50)) > 0.3)
  want = _einsum(q, k, v, mask, q_offset=13)
  for offset in (13, jnp.int32(13)):  # static and traced
    got = jax.jit(lambda q, k, v, o: attention.chunked(q, k, v, mask, o, 8))(
        q, k, v, offset)
    np.testing.assert_allclose(got, want, atol=2e-6)
  grads = jax.grad(lambda k: jnp.sum(attention.chunked(q, k, v, mask, 13, 8)))
  want_grads = jax.grad(lambda k: jnp.sum(_einsum(q, k, v, mask, 13)))
  np.testing.assert_allclose(grads(k), want_grads(k), atol=1e-5)


@pytest.mark.parametrize('index', [0, 6, 23, 49])
def test_decode_reads_stacked_cache_in_blocks(index):
  _, k, v = _qkv(1, 50, seed=4)
  q = _qkv(1, seed=5)[0]
  mask = jnp.asarray(np.random.default_rng(6).random((B, 50)) > 0.2)
  # Layer 1 of a 3-layer cache; blocks of 16 (the last one starts early).
  stacked_k = jnp.stack([v, k, v])
  stacked_v = jnp.stack([k, v, k])
  got = jax.jit(lambda i: attention.decode_attention(
      q.reshape(B, K, H // K, DH), stacked_k, stacked_v, mask, i,
      layer=jnp.int32(1), block=16))(jnp.int32(index))
  want = _einsum(q, k, v, mask, q_offset=index)
  np.testing.assert_allclose(got.reshape(B, 1, H, DH), want, atol=2e-6)


@pytest.mark.parametrize('index', [0, 6, 23, 49])
@pytest.mark.parametrize('block', [16, 64])
def test_decode_reads_one_layers_kv_major_cache(index, block):
  """The unrolled decode step's layout [B, K, S, Dh], in blocks of 16 (the
  last one starts early) or as one block of all 50 slots."""
  _, k, v = _qkv(1, 50, seed=4)
  q = _qkv(1, seed=5)[0]
  mask = jnp.asarray(np.random.default_rng(6).random((B, 50)) > 0.2)
  kv_major = lambda a: jnp.swapaxes(a, 1, 2)
  got = jax.jit(lambda i: attention.decode_attention(
      q.reshape(B, K, H // K, DH), kv_major(k), kv_major(v), mask, i,
      block=block, kv_major=True))(jnp.int32(index))
  want = _einsum(q, k, v, mask, q_offset=index)
  np.testing.assert_allclose(got.reshape(B, 1, H, DH), want, atol=2e-6)


def test_fused_self_attention_rolls_padding_to_the_end():
  """The cuDNN wrapper's rotation, checked with XLA's kernel behind it."""
  t = 37
  q, k, v = _qkv(t, seed=7)
  mask = _masks(t)['padded']
  got = attention.fused_self_attention(q, k, v, mask, implementation='xla')
  want = _einsum(q, k, v, mask)
  np.testing.assert_allclose(got * _real(mask), want * _real(mask), atol=2e-6)
  grads = jax.grad(lambda q: jnp.sum(attention.fused_self_attention(
      q, k, v, mask, implementation='xla') * _real(mask)))(q)
  want_grads = jax.grad(lambda q: jnp.sum(_einsum(q, k, v, mask)
                                          * _real(mask)))(q)
  np.testing.assert_allclose(grads, want_grads, atol=1e-5)


def test_splash_kernel_in_interpret_mode():
  t = 130  # padded to two 128-token tiles
  q, k, v = _qkv(t, seed=8)
  mask = _masks(t)['padded']
  got = attention.splash(q, k, v, mask, block=128, interpret=True)
  want = _einsum(q, k, v, mask)
  np.testing.assert_allclose(got * _real(mask), want * _real(mask), atol=2e-5)
  grad = jax.grad(lambda v: jnp.sum(attention.splash(
      q, k, v, mask, block=128, interpret=True) * _real(mask)))(v)
  want_grad = jax.grad(lambda v: jnp.sum(_einsum(q, k, v, mask)
                                         * _real(mask)))(v)
  np.testing.assert_allclose(grad, want_grad, atol=2e-5)


def test_choice_of_implementation():
  q, k, _ = _qkv(8)
  assert attention.choose('auto', q, k, 0, True) == 'chunked'  # on CPU
  assert attention.choose('splash', q, k, 0, False) == 'splash'
  assert attention.choose('splash', q, k, jnp.int32(3), False) == 'chunked'
  with pytest.raises(ValueError, match="model.attention='cudnn' needs a CUDA"):
    attention.choose('cudnn', q, k, 0, True)
  with pytest.raises(ValueError, match=r"model.attention='flash'; expected"):
    attention.choose('flash', q, k, 0, True)


def _temp_bytes(impl, t):
  q, k, v = _qkv(t, seed=9)
  mask = jnp.ones((B, t), bool)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.attention(
      q, k, v, mask, impl=impl, block=128) ** 2), argnums=(0, 1, 2)))
  return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_backward_does_not_store_probabilities():
  t = 1024
  probs_bytes = B * H * t * t * 4  # one f32 [B, H, T, S] tensor
  xla, chunked = _temp_bytes('xla', t), _temp_bytes('chunked', t)
  print(f'temp bytes at T={t}: xla {xla / 2**20:.1f} MiB, chunked '
        f'{chunked / 2**20:.1f} MiB (probabilities {probs_bytes / 2**20:.0f}'
        ' MiB)')
  assert xla >= probs_bytes
  assert chunked < probs_bytes / 4


@pytest.mark.parametrize('block', [8, 512])
def test_chunked_segments_are_bidirectional_blocks(block):
  """The vision tower's call: packed images, each attending within itself."""
  t = 37
  q, k, v = _qkv(t, seed=3)
  segment = np.full((B, t), -1, np.int32)  # -1: padding
  segment[0, :9], segment[0, 9:20], segment[0, 20:30] = 0, 1, 2
  segment[1, :11], segment[1, 11:35] = 0, 1
  mask = jnp.asarray(segment >= 0)
  w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

  def reference(q, k, v):  # each segment on its own, no causal mask
    out = jnp.zeros_like(q)
    for b in range(B):
      for s in range(segment[b].max() + 1):
        idx = np.flatnonzero(segment[b] == s)
        one = lambda x: x[b:b + 1, idx]
        full = jnp.ones((1, len(idx)), bool)
        out = out.at[b, idx].set(_einsum(one(q), one(k), one(v), full,
                                         q_offset=len(idx))[0])
    return out

  fn = lambda q, k, v: attention.chunked(
      q, k, v, mask, q_offset=t - 1, block=block,
      segment_BxS=jnp.asarray(segment))
  real = _real(mask)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)) * real,
                             np.asarray(reference(q, k, v)) * real, atol=2e-6)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w * real)
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for name, g, g_want in zip('qkv', got, want):
    np.testing.assert_allclose(g, g_want, atol=1e-5, err_msg=f'd{name}')


@pytest.mark.parametrize('block', [8, 13, 512])
def test_branches_see_the_shared_prompt_and_themselves(block):
  """Rows of one prompt and several responses (batching.pack's shared
  prompts): each response attends as it would after the prompt alone."""
  t = 41
  q, k, v = _qkv(t, seed=5)
  branch = np.zeros((B, t), np.int32)
  mask = np.zeros((B, t), bool)
  # Row 0: a left-padded 13-slot prompt and three 8-slot responses of 5, 8
  # and 0 real tokens (the rest padding); row 1: a 17-slot prompt, all real,
  # and three responses of 3, 1 and 8 tokens.
  for row, (p, lengths) in enumerate(((13, (5, 8, 0)), (17, (3, 1, 8)))):
    mask[row, 4 if row == 0 else 0:p] = True
    for i, n in enumerate(lengths):
      branch[row, p + 8 * i:p + 8 * (i + 1)] = i + 1
      mask[row, p + 8 * i:p + 8 * i + n] = True
  mask = jnp.asarray(mask)
  w = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), jnp.float32)

  def reference(q, k, v):  # the prompt followed by one response at a time
    out = jnp.zeros_like(q)
    for b in range(B):
      for i in range(1, branch[b].max() + 1):
        idx = np.flatnonzero((branch[b] == 0) | (branch[b] == i))
        one = lambda x: x[b:b + 1, idx]
        mine = _einsum(one(q), one(k), one(v), mask[b:b + 1, idx])[0]
        keep = (branch[b, idx] == i) | (i == 1)  # the prompt's once
        out = out.at[b, idx[keep]].set(mine[keep])
    return out

  real = _real(mask)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w * real)
  want = np.asarray(reference(q, k, v)) * real
  want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for impl in ('xla', 'chunked', 'auto', 'splash'):
    fn = lambda q, k, v, impl=impl: attention.attention(
        q, k, v, mask, impl=impl, block=block,
        branch_BxS=jnp.asarray(branch))
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)) * real, want,
                               atol=2e-6, err_msg=impl)
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
    for name, g, g_want in zip('qkv', grads, want_grads):
      np.testing.assert_allclose(g, g_want, atol=1e-5,
                                 err_msg=f'{impl} d{name}')
  with pytest.raises(ValueError, match='branch ids need self-attention'):
    attention.attention(q, k[:, :t - 1], v[:, :t - 1], mask[:, :t - 1],
                        impl='xla', branch_BxS=jnp.asarray(branch))
