"""Attention without a [T, S] score tensor, behind one function.

  out_BxTxHxDh = attention(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS,
                           q_offset=0, impl='auto', block=512)

Query t sits at slot `q_offset + t` of the keys and sees key s when
`mask_BxS[b, s]` and `s <= q_offset + t` (causal). A query that sees no key
(left padding) returns zeros. GQA: H query heads share K kv heads in groups of
G = H // K. Implementations (`model.attention`):

  'xla'      the plain einsum; materialises [B, H, T, S] scores (reference).
  'chunked'  online softmax over key blocks, one query block at a time, and a
             hand-written backward that recomputes each score block instead of
             storing probabilities (FlashAttention-2 in plain XLA). Key blocks
             past the causal edge or without any real key are skipped. Runs on
             every platform.
  'cudnn'    cuDNN's flash kernel via jax.nn.dot_product_attention (CUDA).
  'splash'   Pallas splash attention (TPU; interpret mode elsewhere).
  'auto'     the platform's fused kernel where it takes the call, else
             'chunked'.

The fused kernels take self-attention only (q_offset a static 0, S == T);
other calls (prefill after a held cache) and rows of branches (`branch_BxS`:
responses that share one copy of their prompt, see `attention`) run
'chunked' ('xla' where asked for). cuDNN also needs each
row's real tokens to form one contiguous run (left and/or right padding), which
the caller states with `contiguous=True`. `decode_attention` is the one-query
case: it reads the filled part of a KV cache block by block, in place.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ('auto', 'xla', 'chunked', 'cudnn', 'splash')
_SPLASH_BLOCK = 128  # splash attention's tiles are multiples of this


def check_impl(impl: str, key: str = 'model.attention'):
  """Raises a ValueError naming the config `key` for an unknown value."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'{key}={impl!r}; expected one of {IMPLEMENTATIONS}')


def _is_cuda() -> bool:
  if jax.default_backend() != 'gpu':
    return False
  return 'cuda' in jax.devices()[0].client.platform_version.lower()


def _cudnn_takes(q) -> bool:
  dh = q.shape[-1]
  return q.dtype in (jnp.bfloat16, jnp.float16) and dh % 8 == 0 and dh <= 128


def choose(impl: str, q, k, q_offset, contiguous: bool,
           branches: bool = False) -> str:
  """The implementation that runs this call (see the module docstring)."""
  check_impl(impl)
  if branches:
    return 'xla' if impl == 'xla' else 'chunked'
  self_attention = (isinstance(q_offset, int) and q_offset == 0
                    and q.shape[1] == k.shape[1])
  if impl == 'auto':
    if self_attention and contiguous and _is_cuda() and _cudnn_takes(q):
      return 'cudnn'
    if self_attention and jax.default_backend() == 'tpu':
      return 'splash'
    return 'chunked'
  if impl == 'cudnn':
    if not _is_cuda():
      raise ValueError(f"model.attention='cudnn' needs a CUDA GPU; the "
                       f'backend is {jax.default_backend()!r}')
    if not _cudnn_takes(q):
      raise ValueError("model.attention='cudnn' needs bfloat16 or float16 "
                       f'compute and head_dim % 8 == 0, <= 128 (got '
                       f'{q.dtype}, head_dim {q.shape[-1]})')
    return 'cudnn' if self_attention and contiguous else 'chunked'
  if impl == 'splash':
    return 'splash' if self_attention else 'chunked'
  return impl


def attention(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, *, q_offset=0,
              impl: str = 'auto', block: int = 512, contiguous: bool = False,
              branch_BxS=None):
  """Causal, masked, grouped-query attention; output [B, T, H, Dh].

  Args:
    q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh: queries, keys and values (RoPE done).
    mask_BxS: bool, True where the key is a real token.
    q_offset: slot of query 0 among the keys (an int, or a traced scalar for
      a chunk appended to a cache).
    impl: one of IMPLEMENTATIONS.
    block: query and key block length of the blockwise implementations.
    contiguous: every row's real tokens form one run (lets cuDNN take it).
    branch_BxS: int ids for self-attention (T == S) over rows that hold one
      prompt and several responses to it: 0 marks the shared trunk (the
      prompt), k >= 1 the k-th response. A query sees trunk keys and the keys
      of its own branch (with the causal and padding rules), so each response
      attends as if it followed the prompt alone.
  """
  impl = choose(impl, q_BxTxHxDh, k_BxSxKxDh, q_offset, contiguous,
                branch_BxS is not None)
  if impl == 'xla':
    return reference(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, q_offset,
                     branch_BxS)
  if impl == 'cudnn':
    return fused_self_attention(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS,
                                implementation='cudnn')
  if impl == 'splash':
    return splash(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, block,
                  interpret=jax.default_backend() != 'tpu')
  return chunked(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, q_offset, block,
                 branch_BxS=branch_BxS)


def rotary(x_Bx___xNxDh, angles_Bx___xF):
  """Rotary embedding, 'rotate half' layout (HF checkpoints), F = Dh / 2.

  Angles are given per position and frequency, so 1-D, multimodal (3-axis)
  and 2-D (image patch) schemes share this one rotation.
  """
  cos = jnp.cos(angles_Bx___xF)[..., None, :]
  sin = jnp.sin(angles_Bx___xF)[..., None, :]
  x1, x2 = jnp.split(x_Bx___xNxDh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_Bx___xNxDh.dtype)


def _visible(mask_BxS, t: int, q_offset, branch_BxS=None):
  """[B, T, S]: query t sees key s."""
  s = mask_BxS.shape[1]
  causal_TxS = (jnp.arange(s)[None, :]
                <= q_offset + jnp.arange(t)[:, None])
  visible = mask_BxS[:, None, :] & causal_TxS[None]
  if branch_BxS is not None:
    if t != s:
      raise ValueError('branch ids need self-attention (T == S)')
    visible &= ((branch_BxS[:, None, :] == 0)
                | (branch_BxS[:, None, :] == branch_BxS[:, :, None]))
  return visible


def reference(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, q_offset=0,
              branch_BxS=None):
  """The plain einsum ('xla'): scores and probabilities of all T x S pairs."""
  b, t, h, dh = q_BxTxHxDh.shape
  kv = k_BxSxKxDh.shape[2]
  q = q_BxTxHxDh.reshape(b, t, kv, h // kv, dh)
  scores = jnp.einsum('BTKGd,BSKd->BKGTS', q, k_BxSxKxDh,
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  visible_BxTxS = _visible(mask_BxS, t, q_offset, branch_BxS)
  scores = jnp.where(visible_BxTxS[:, None, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  seen_BxT = jnp.any(visible_BxTxS, axis=-1)
  probs = jnp.where(seen_BxT[:, None, None, :, None], probs, 0.0)
  out = jnp.einsum('BKGTS,BSKd->BTKGd', probs.astype(v_BxSxKxDh.dtype),
                   v_BxSxKxDh)
  return out.reshape(b, t, h, dh)


# ---- 'chunked': FlashAttention-2 in XLA -------------------------------------
#
# Layouts inside: queries [B, K, Tp, G, Dh] (a query block of bq tokens is
# bq * G matmul rows R, token-major), keys and values [B, K, Sp, Dh]; Tp and
# Sp are T and S padded to whole blocks (padded keys are masked).


def _blocks(n: int, block: int) -> tuple[int, int]:
  """(block length, number of blocks) covering n with the least padding."""
  count = -(-n // max(block, 1))
  size = -(-n // count)
  size = -(-size // 8) * 8 if size > 8 else size
  return size, -(-n // size)


def chunked(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxS, q_offset=0,
            block: int = 512, segment_BxS=None, branch_BxS=None):
  """The blockwise implementation (see the module docstring).

  `segment_BxS` (self-attention, T == S): query t sees key s only when both
  have the same segment id, e.g. the patches of one image in a packed row.
  Ids are nondecreasing along a row, padding (-1) only at its end; blocks
  of different segments are skipped, so packed images cost what they would
  one by one (plus block rounding).

  `branch_BxS` (self-attention): as `segment_BxS`, but keys of branch 0 (the
  shared trunk) are seen by every query (see `attention`). No blocks are
  skipped for branches: a branch's keys sit between the trunk and its
  queries.
  """
  if segment_BxS is not None and branch_BxS is not None:
    raise ValueError('pass segment ids or branch ids, not both')
  trunk = branch_BxS is not None
  if trunk:
    segment_BxS = branch_BxS
  b, t, h, dh = q_BxTxHxDh.shape
  s, kv = k_BxSxKxDh.shape[1], k_BxSxKxDh.shape[2]
  g = h // kv
  bq, nq = _blocks(t, block)
  bk, nk = _blocks(s, block)
  q = (q_BxTxHxDh * jnp.asarray(1 / math.sqrt(dh), q_BxTxHxDh.dtype))
  q = q.reshape(b, t, kv, g, dh).transpose(0, 2, 1, 3, 4)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, nq * bq - t), (0, 0), (0, 0)))
  pad_s = ((0, 0), (0, 0), (0, nk * bk - s), (0, 0))
  k = jnp.pad(k_BxSxKxDh.transpose(0, 2, 1, 3), pad_s)
  v = jnp.pad(v_BxSxKxDh.transpose(0, 2, 1, 3), pad_s)
  mask = jnp.pad(mask_BxS.astype(bool), ((0, 0), (0, nk * bk - s)))
  segments = None
  if segment_BxS is not None:
    if t != s or nq * bq != nk * bk:
      raise ValueError(f'{"branch" if trunk else "segment"} ids need '
                       'self-attention (T == S)')
    segments = jnp.pad(segment_BxS.astype(jnp.int32),
                       ((0, 0), (0, nk * bk - s)), constant_values=-1)
  out = _flash(q, k, v, mask, jnp.asarray(q_offset, jnp.int32), segments, bq,
               bk, trunk)
  return out.transpose(0, 2, 1, 3, 4)[:, :t].reshape(b, t, h, dh)


def _row_slots(i, q_offset, bq: int, g: int):
  """Slot of the query of each matmul row of query block i: [R]."""
  return q_offset + i * bq + jnp.arange(bq * g) // g


def _key_range(mask_BxSp, q_offset, i, bq: int, bk: int):
  """Key blocks [lo, hi) query block i may see: real keys, causal edge."""
  nk = mask_BxSp.shape[1] // bk
  live_J = jnp.any(mask_BxSp.reshape(mask_BxSp.shape[0], nk, bk), axis=(0, 2))
  lo = jnp.argmax(live_J)  # first block with a real key (0 if none)
  hi = jnp.clip((q_offset + (i + 1) * bq - 1) // bk + 1, 0, nk)
  return lo, hi


def _scores(q_BxKxRxDh, k_BxKxSxDh, mask_BxS, slots_R, j, bk: int,
            same_BxRxS=None):
  """f32 scores of one (query block, key block) pair; -inf where hidden."""
  s = jnp.einsum('BKRd,BKSd->BKRS', q_BxKxRxDh, k_BxKxSxDh,
                 preferred_element_type=jnp.float32)
  key_slots_S = j * bk + jnp.arange(bk)
  visible = (mask_BxS[:, None, None, :]
             & (key_slots_S[None, None, None, :]
                <= slots_R[None, None, :, None]))
  if same_BxRxS is not None:
    visible = visible & same_BxRxS[:, None]
  return jnp.where(visible, s, -jnp.inf)


def _span(segments_BxTp, start, size: int, block: int):
  """Blocks [lo, hi) holding every slot whose segment occurs in the slots
  [start, start + size) of some row (the ids are sorted, padding last);
  padding sees nothing, so a span of padding only is empty."""
  pad = jnp.iinfo(jnp.int32).max
  ids = jnp.where(segments_BxTp < 0, pad, segments_BxTp)
  first = jax.lax.dynamic_index_in_dim(ids, start, 1, keepdims=False)
  last = jax.lax.dynamic_index_in_dim(ids, start + size - 1, 1,
                                      keepdims=False)
  last = jnp.where(last == pad, jnp.max(jnp.where(ids == pad, -1, ids), 1),
                   last)  # the last real segment of the row
  find = jax.vmap(jnp.searchsorted, (0, 0, None))
  lo = jnp.min(jnp.where(first == pad, ids.shape[1], find(ids, first, 'left')))
  hi = jnp.max(jnp.where(first == pad, 0, find(ids, last, 'right')))
  return lo // block, jnp.maximum(lo // block, (hi - 1) // block + 1)


def _same_segment(segments_BxTp, i, j, bq: int, bk: int, g: int,
                  trunk: bool = False):
  """[B, R, S]: query row and key share a segment, or (trunk) the key is in
  the shared trunk, segment 0 (None: no segments)."""
  if segments_BxTp is None:
    return None
  rows_BxR = jnp.repeat(_take(segments_BxTp, i * bq, bq, 1), g, axis=1)
  keys_BxS = _take(segments_BxTp, j * bk, bk, 1)
  same = rows_BxR[:, :, None] == keys_BxS[:, None]
  return same | (keys_BxS[:, None] == 0) if trunk else same


def _take(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _forward(q, k, v, mask, q_offset, segments, bq: int, bk: int,
             trunk: bool = False):
  """(out [B, K, Tp, G, Dh], lse [B, K, Tp, G] f32) by online softmax."""
  b, kv, tp, g, dh = q.shape
  nq = tp // bq

  def query_block(i):
    q_i = _take(q, i * bq, bq, 2).reshape(b, kv, bq * g, dh)
    slots_R = _row_slots(i, q_offset, bq, g)
    lo, hi = _key_range(mask, q_offset, i, bq, bk)
    if segments is not None and not trunk:  # only its segments' key blocks
      seg_lo, seg_hi = _span(segments, i * bq, bq, bk)
      lo, hi = jnp.maximum(lo, seg_lo), jnp.minimum(hi, seg_hi)

    def key_block(j, carry):
      m_BxKxR, l_BxKxR, acc_BxKxRxDh = carry
      s = _scores(q_i, _take(k, j * bk, bk, 2), _take(mask, j * bk, bk, 1),
                  slots_R, j, bk,
                  _same_segment(segments, i, j, bq, bk, g, trunk))
      m_new = jnp.maximum(m_BxKxR, jnp.max(s, axis=-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key seen yet
      alpha = jnp.exp(m_BxKxR - m_safe)
      p = jnp.exp(s - m_safe[..., None])
      pv = jnp.einsum('BKRS,BKSd->BKRd', p.astype(v.dtype),
                      _take(v, j * bk, bk, 2),
                      preferred_element_type=jnp.float32)
      return (m_new, l_BxKxR * alpha + jnp.sum(p, axis=-1),
              acc_BxKxRxDh * alpha[..., None] + pv)

    init = (jnp.full((b, kv, bq * g), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv, bq * g), jnp.float32),
            jnp.zeros((b, kv, bq * g, dh), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), key_block, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None],
                    0.0)
    # Rows that saw nothing get lse 0: their scores are -inf, so p = 0.
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out.astype(q.dtype), lse

  out_N, lse_N = jax.lax.map(query_block, jnp.arange(nq))
  out = out_N.reshape(nq, b, kv, bq, g, dh).transpose(1, 2, 0, 3, 4, 5)
  lse = lse_N.reshape(nq, b, kv, bq, g).transpose(1, 2, 0, 3, 4)
  return out.reshape(b, kv, tp, g, dh), lse.reshape(b, kv, tp, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, mask, q_offset, segments, bq: int, bk: int, trunk: bool):
  return _forward(q, k, v, mask, q_offset, segments, bq, bk, trunk)[0]


def _flash_fwd(q, k, v, mask, q_offset, segments, bq, bk, trunk):
  out, lse = _forward(q, k, v, mask, q_offset, segments, bq, bk, trunk)
  return out, (q, k, v, mask, q_offset, segments, out, lse)


def _flash_bwd(bq, bk, trunk, residuals, dout):
  """dq, dk, dv: per key block, the query blocks that see it, recomputed."""
  q, k, v, mask, q_offset, segments, out, lse = residuals
  b, kv, tp, g, dh = q.shape
  nq, nk = tp // bq, k.shape[2] // bk
  rows = bq * g
  # D_r = sum_d dO * O, the softmax-backward row term.
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  lo = _key_range(mask, q_offset, 0, bq, bk)[0]
  hi = _key_range(mask, q_offset, nq - 1, bq, bk)[1]

  def key_block(j, carry):
    dq, dk, dv = carry
    k_j, v_j = _take(k, j * bk, bk, 2), _take(v, j * bk, bk, 2)
    mask_j = _take(mask, j * bk, bk, 1)
    # First query block whose last slot reaches this key block.
    first = jnp.maximum(0, -(-(j * bk - q_offset + 1) // bq) - 1)
    end = nq
    if segments is not None and not trunk:  # only its segments' queries
      seg_first, end = _span(segments, j * bk, bk, bq)
      first = jnp.maximum(first, seg_first)

    def query_block(i, inner):
      dq, dk_j, dv_j = inner
      q_i = _take(q, i * bq, bq, 2).reshape(b, kv, rows, dh)
      do_i = _take(dout, i * bq, bq, 2).reshape(b, kv, rows, dh)
      lse_i = _take(lse, i * bq, bq, 2).reshape(b, kv, rows)
      delta_i = _take(delta, i * bq, bq, 2).reshape(b, kv, rows)
      s = _scores(q_i, k_j, mask_j, _row_slots(i, q_offset, bq, g), j, bk,
                  _same_segment(segments, i, j, bq, bk, g, trunk))
      p = jnp.exp(s - lse_i[..., None])
      dv_j = dv_j + jnp.einsum('BKRS,BKRd->BKSd', p.astype(dout.dtype), do_i,
                               preferred_element_type=jnp.float32)
      dp = jnp.einsum('BKRd,BKSd->BKRS', do_i, v_j,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])
      dq_i = jnp.einsum('BKRS,BKSd->BKRd', ds.astype(k.dtype), k_j,
                        preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, _take(dq, i * bq, bq, 2) + dq_i.reshape(b, kv, bq, g, dh),
          i * bq, 2)
      dk_j = dk_j + jnp.einsum('BKRS,BKRd->BKSd', ds.astype(q.dtype), q_i,
                               preferred_element_type=jnp.float32)
      return dq, dk_j, dv_j

    zeros = jnp.zeros((b, kv, bk, dh), jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(first, jnp.maximum(first, end),
                                       query_block,
                                       (dq, zeros, zeros))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * bk, 2)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * bk, 2)
    return dq, dk, dv

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(v.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), key_block, init)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- fused kernels -----------------------------------------------------------


def _roll_rows(x_BxTx___, shift_B):
  """Row b shifted left by shift_B[b] (cyclically) along axis 1."""
  t = x_BxTx___.shape[1]
  index_BxT = (jnp.arange(t)[None, :] + shift_B[:, None]) % t
  index = index_BxT.reshape(index_BxT.shape + (1,) * (x_BxTx___.ndim - 2))
  return jnp.take_along_axis(x_BxTx___, index, axis=1)


def fused_self_attention(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, mask_BxT, *,
                         implementation: str = 'cudnn'):
  """jax.nn.dot_product_attention on rows whose real tokens form one run.

  cuDNN masks padding only at the end of a row (sequence lengths); a row's
  run of real tokens is rotated to its start first and the output rotated
  back. Causality is unchanged: every token of a row moves by the same amount.
  """
  t = q_BxTxHxDh.shape[1]
  mask_BxT = mask_BxT.astype(bool)
  lengths_B = jnp.sum(mask_BxT, axis=1, dtype=jnp.int32)
  start_B = jnp.where(lengths_B > 0, jnp.argmax(mask_BxT, axis=1), 0)
  roll = lambda x: _roll_rows(x, start_B)
  out = jax.nn.dot_product_attention(
      roll(q_BxTxHxDh), roll(k_BxTxKxDh), roll(v_BxTxKxDh), is_causal=True,
      query_seq_lengths=lengths_B, key_value_seq_lengths=lengths_B,
      implementation=implementation)
  out = _roll_rows(out, (t - start_B) % t)
  return jnp.where(mask_BxT[:, :, None, None], out, 0).astype(q_BxTxHxDh.dtype)


def splash(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, mask_BxT, block: int = 512, *,
           interpret: bool = False):
  """Pallas splash attention: causal mask, padding as segment ids (pad = 0)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  b, t, h, dh = q_BxTxHxDh.shape
  kv = k_BxTxKxDh.shape[2]
  whole = -(-t // _SPLASH_BLOCK) * _SPLASH_BLOCK
  tile = min(max(_SPLASH_BLOCK, block // _SPLASH_BLOCK * _SPLASH_BLOCK), whole)
  tp = -(-t // tile) * tile
  sizes = dict.fromkeys(('block_q', 'block_kv', 'block_kv_compute',
                         'block_q_dkv', 'block_kv_dkv', 'block_kv_dkv_compute',
                         'block_q_dq', 'block_kv_dq'), tile)
  kernel = sa.make_splash_mqa_single_device(
      sa.MultiHeadMask([sa.CausalMask((tp, tp))] * (h // kv)),
      block_sizes=sa.BlockSizes(**sizes), interpret=interpret)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))
  q = pad(q_BxTxHxDh * jnp.asarray(1 / math.sqrt(dh), q_BxTxHxDh.dtype))
  q_BxKxGxTxDh = q.reshape(b, tp, kv, h // kv, dh).transpose(0, 2, 3, 1, 4)
  k_BxKxTxDh = pad(k_BxTxKxDh).transpose(0, 2, 1, 3)
  v_BxKxTxDh = pad(v_BxTxKxDh).transpose(0, 2, 1, 3)
  segment_BxT = pad(mask_BxT.astype(jnp.int32))
  # One kv head (MQA) per call; vmapped over kv heads, then over the batch.
  per_row = jax.vmap(lambda q, k, v, seg: kernel(
      q, k, v, segment_ids=sa.SegmentIds(q=seg, kv=seg)), (0, 0, 0, None))
  out = jax.vmap(per_row)(q_BxKxGxTxDh, k_BxKxTxDh, v_BxKxTxDh, segment_BxT)
  out = out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, h, dh)
  return jnp.where(mask_BxT[:, :, None, None], out, 0).astype(
      q_BxTxHxDh.dtype)


# ---- one query over a KV cache -----------------------------------------------


def decode_attention(q_BxKxGxDh, cache_k, cache_v, mask_BxS, index, *,
                     layer=None, block: int = 512, new_kv=None,
                     kv_major: bool = False):
  """One query per row at slot `index`, over the cache's slots 0..index.

  The cache is [B, S, K, Dh], or [L, B, S, K, Dh] with `layer` (a scanned
  decode step's stacked cache), or with `kv_major` one layer's [B, K, S, Dh]
  (an unrolled decode step's, kv_cache.per_layer). It is read in blocks of
  `block` slots, in place, and only up to `index`. Slot-major blocks are read
  with a multiply-and-reduce in their own layout (a dot_general with (B, K)
  batch dimensions would transpose each block first); kv-major ones are
  contiguous [S, Dh] matrices per (B, K), read by batched matmuls.

  `new_kv` = (k_BxKxDh, v_BxKxDh, visible_B): the query's own key and value,
  not written to the cache yet; then the cache is read below `index` only,
  and the caller writes them after every layer has read the cache.
  """
  if kv_major:
    b, kv, s, dh = cache_k.shape
  else:
    if layer is None:
      cache_k, cache_v, layer = cache_k[None], cache_v[None], 0
    _, b, s, kv, dh = cache_k.shape
  g = q_BxKxGxDh.shape[2]
  bs = min(block, s)
  q = q_BxKxGxDh.astype(jnp.float32) / math.sqrt(dh)
  last = index if new_kv is None else index - 1  # last cache slot to read

  def read(cache, start):
    if kv_major:
      whole = bs == s
      return (cache if whole else jax.lax.dynamic_slice_in_dim(
          cache, start, bs, 2)).astype(jnp.float32)
    return jax.lax.dynamic_slice(cache, (layer, 0, start, 0, 0),
                                 (1, b, bs, kv, dh))[0].astype(jnp.float32)

  # The scores' slot axis: [B, K, S, G] kv-major (the cache block is the
  # long side of each (B, K) matmul; XLA:CPU runs these ~1.3x faster than
  # [B, K, G, S] ones), else [B, S, K, G], the slot-major cache's own order.
  slot_axis = 2 if kv_major else 1

  def scores(k_block):
    if kv_major:
      return jnp.einsum('bksd,bkgd->bksg', k_block, q)
    return jnp.sum(q[:, None] * k_block[:, :, :, None], axis=-1)

  def weighted(p_4d, v_block):  # [B, K, G, Dh]
    if kv_major:
      return jnp.einsum('bksg,bksd->bkgd', p_4d, v_block)
    return jnp.sum(p_4d[..., None] * v_block[:, :, :, None], axis=1)

  def key_block(j, carry):
    m_BxKxG, l_BxKxG, acc_BxKxGxDh = carry
    # The last block may start early (dynamic_slice clamps); slots a previous
    # block covered are hidden here.
    start = jnp.minimum(j * bs, s - bs)
    slots_S = start + jnp.arange(bs)
    visible_BxS = (jax.lax.dynamic_slice_in_dim(mask_BxS, start, bs, 1)
                   & (slots_S <= last)[None] & (slots_S >= j * bs)[None])
    visible_4d = jnp.expand_dims(visible_BxS, (1, 3) if kv_major else (2, 3))
    scores_4d = jnp.where(visible_4d, scores(read(cache_k, start)), -jnp.inf)
    m_new = jnp.maximum(m_BxKxG, jnp.max(scores_4d, axis=slot_axis))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_BxKxG - m_safe)
    p_4d = jnp.exp(scores_4d - jnp.expand_dims(m_safe, slot_axis))
    pv = weighted(p_4d, read(cache_v, start))
    return (m_new, l_BxKxG * alpha + jnp.sum(p_4d, axis=slot_axis),
            acc_BxKxGxDh * alpha[..., None] + pv)

  if new_kv is None:
    init = (jnp.full((b, kv, g), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv, g), jnp.float32),
            jnp.zeros((b, kv, g, dh), jnp.float32))
  else:  # softmax state after the query's own key alone
    k_BxKxDh, v_BxKxDh, visible_B = new_kv
    score_BxKxG = jnp.sum(q * k_BxKxDh.astype(jnp.float32)[:, :, None], -1)
    seen_Bx1x1 = visible_B[:, None, None]
    init = (jnp.where(seen_Bx1x1, score_BxKxG, -jnp.inf),
            jnp.where(seen_Bx1x1, 1.0, 0.0) * jnp.ones((b, kv, g)),
            jnp.where(seen_Bx1x1[..., None],
                      v_BxKxDh.astype(jnp.float32)[:, :, None], 0.0)
            * jnp.ones((b, kv, g, dh)))
  num_blocks = (jnp.clip(last, 0, s - 1) + bs) // bs
  if s <= bs:  # one block: no loop
    _, l, acc = key_block(0, init)
  else:
    _, l, acc = jax.lax.fori_loop(0, num_blocks, key_block, init)
  seen = l > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None],
                  0.0)
  return out.astype(q_BxKxGxDh.dtype)
