"""Batched generation: one prefill, then a lax.while_loop decode, in one jit.

Prompts are left-padded to a bucketed length and the batch is padded with
dummy rows to a bucketed size, so calls of similar size reuse one compiled
program. All rows write the KV cache in lockstep (see kv_cache.KVCache);
a finished row keeps stepping, masked, until every row is done. Stop strings
are found on the host afterwards.

Multi-turn: `generate(..., keep_session=True)` returns the KV cache of every
conversation; passing it back as `session=` with the next observations
appends them to the cache instead of prefilling the whole conversation again.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rla_jax import sampling
from rla_jax import sharding
from rla_jax.models import kv_cache
from rla_jax.models import transformer
from rla_jax.models import vision

STOP_TOKEN = 'stop_token'
STOP_STRING = 'stop_string'
LENGTH = 'length'
INACTIVE = 'inactive'  # a session row passed as None: nothing generated

_traces = 0
# Columns per block of the transposed output projection (`transpose_head`).
# A SmolLM2-135M head (49,152 x 576, float32) against 16 rows on a 2-core
# CPU: 15.4 ms as one [V, D] matmul, 19.9 ms as one [D, V] matmul, 8.9 ms
# as 32 [D, 1536] blocks (the weight rate of the layers' own matmuls).
HEAD_COLUMNS = 1536


def num_traces() -> int:
  """How often the generation program has been traced (tests assert reuse)."""
  return _traces


@dataclasses.dataclass
class Session:
  """Conversations whose KV cache is still held on device.

  `conversations[r]` is every token of row r so far; all but its last token
  are in `cache` (the last one was sampled, never fed). Token i sits at
  position i + `shifts[r]` for every token after the row's last image (images
  take fewer positions than tokens under multimodal RoPE; 0 without images).
  Rows past `len(conversations)` are batch padding.
  """

  cache: kv_cache.KVCache
  conversations: list[list[int]]
  shifts: list[int] | None = None
  holds_images: bool = False


@dataclasses.dataclass
class Output:
  """Per row (prompt-major: the G samples of prompt 0 come first)."""

  tokens: list[list[int]]
  logprobs: list[list[float]]  # temperature-1 log-softmax of each token
  num_tokens: list[int]
  finish_reason: list[str]  # STOP_TOKEN | STOP_STRING | LENGTH | INACTIVE
  texts: list[str] | None = None  # decoded tokens, when a tokenizer is given
  session: Session | None = None  # with keep_session=True

  def padded(self, length: int):
    """(tokens [R, length] padded with 0, logprobs [R, length], mask)."""
    mask = np.arange(length)[None, :] < np.asarray(self.num_tokens)[:, None]
    tokens = np.zeros(mask.shape, np.int32)
    logprobs = np.zeros(mask.shape, np.float32)
    tokens[mask] = [t for row in self.tokens for t in row]
    logprobs[mask] = [p for row in self.logprobs for p in row]
    return tokens, logprobs, mask


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static part of one compiled generation program."""

  sampling: sampling.Params
  max_new_tokens: int
  num_samples: int
  stop_token_ids: tuple[int, ...]
  cache_length: int
  transpose_head: bool
  unroll: bool  # decode steps over a per-layer cache, the layers unrolled
  rules: tuple  # keys the jit cache; `sharding.constrain` reads the rules


@flax.struct.dataclass
class _Loop:
  step: jax.Array  # tokens generated so far (scalar)
  last_B: jax.Array  # the token fed at the next step
  positions_B: jax.Array  # its position
  done_B: jax.Array
  num_B: jax.Array  # tokens generated per row
  tokens_BxN: jax.Array  # 0 after a row is done
  logprobs_BxN: jax.Array  # 0 after a row is done
  cache: kv_cache.KVCache


_widen = jax.jit(kv_cache.widen, static_argnames='length')


def _generate(graph, params, cache, chunk_BxC, mask_BxC, start_B, live_B,
              seed, temperature, patches=None, positions_BxCx3=None, *,
              plan: _Plan):
  """Appends each row's chunk to the cache, then samples until all are done.

  The chunk's last token is fed by the first loop step, so the prefill never
  computes logits (XLA drops them). With images (`patches`), the vision
  tower encodes them once and the chunk runs at the multimodal
  `positions_BxCx3`. Returns tokens and log-probs [B*G, N], the number of
  tokens per row and the cache.
  """
  global _traces
  _traces += 1
  model = nnx.merge(graph.graphdef, params)
  b = chunk_BxC.shape[0]
  g, n = plan.num_samples, plan.max_new_tokens
  fresh = cache is None
  if fresh:
    cache = kv_cache.init(model.config, b, plan.cache_length)
  images = None
  if patches is not None:
    images = model.encode_images(patches)
    positions_BxC = positions_BxCx3
    last_position_B = positions_BxCx3[:, -1, 0]  # a text token: t = h = w
  else:
    positions_BxC = start_B[:, None] + transformer.default_positions(mask_BxC)
    last_position_B = positions_BxC[:, -1]
  if chunk_BxC.shape[1] > 1:
    _, cache = model.decode(chunk_BxC[:, :-1], positions_BxC[:, :-1],
                            mask_BxC[:, :-1], cache, fresh=fresh,
                            images=images)
  # The G samples of a prompt share its prefill.
  repeat = lambda x: jnp.repeat(x, g, axis=0)
  if g > 1:
    cache = kv_cache.map_rows(repeat, cache)
  head_DxV = (transformer.head_blocks(model, HEAD_COLUMNS)
              if plan.transpose_head else None)
  layers = None
  if plan.unroll:  # copies of the cache and of a scanned model's layers
    cache, layers = kv_cache.per_layer(cache), model.layer_list()
  stop_ids_1xK = jnp.asarray(plan.stop_token_ids, jnp.int32).reshape(1, -1)
  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(
      jax.random.key(seed), jnp.arange(b * g))
  tiny = jnp.finfo(jnp.float32).tiny

  def advance(s: _Loop) -> _Loop:
    logits_Bx1xV, cache = model.decode(
        s.last_B[:, None], s.positions_B[:, None], ~s.done_B[:, None], s.cache,
        head_DxV=head_DxV, layers=layers)
    logits_BxV = logits_Bx1xV[:, 0]
    u_B = jax.vmap(lambda k: jax.random.uniform(
        jax.random.fold_in(k, s.step), (), minval=tiny))(row_keys)
    live = ~s.done_B
    token_B = jnp.where(live, sampling.next_token(logits_BxV, u_B,
                                                  plan.sampling, temperature),
                        0)
    logprob_B = jnp.where(live, sampling.logprob(logits_BxV, token_B), 0.)
    hit_B = live & jnp.any(token_B[:, None] == stop_ids_1xK, axis=1)
    at = (0, s.step)
    return _Loop(
        step=s.step + 1, last_B=token_B, positions_B=s.positions_B + 1,
        done_B=s.done_B | hit_B, num_B=s.num_B + live.astype(jnp.int32),
        tokens_BxN=jax.lax.dynamic_update_slice(s.tokens_BxN, token_B[:, None],
                                                at),
        logprobs_BxN=jax.lax.dynamic_update_slice(s.logprobs_BxN,
                                                  logprob_B[:, None], at),
        cache=cache)

  state = _Loop(
      step=jnp.zeros((), jnp.int32), last_B=repeat(chunk_BxC[:, -1]),
      positions_B=repeat(last_position_B), done_B=repeat(~live_B),
      num_B=jnp.zeros((b * g,), jnp.int32),
      tokens_BxN=sharding.constrain(jnp.zeros((b * g, n), jnp.int32),
                                    ('batch', None)),
      logprobs_BxN=sharding.constrain(jnp.zeros((b * g, n), jnp.float32),
                                      ('batch', None)),
      cache=cache)
  state = jax.lax.while_loop(
      lambda s: (s.step < n) & ~jnp.all(s.done_B), advance, state)
  cache = kv_cache.stacked(state.cache) if plan.unroll else state.cache
  return state.tokens_BxN, state.logprobs_BxN, state.num_B, cache


# XLA:CPU's YNNPACK fusions (jaxlib 0.10.2's default) run the decode step's
# skinny matmuls (rows x weights) slower than XLA's own dots. Measured on a
# 2-core CPU (issue 36): a SmolLM2-135M decode step at 16 rows 205 -> 166 ms;
# generation 16 x (98 + 64) 72-74 -> 82-84 tok/s, tiny Qwen2 8 x (64 + 128)
# 950-1,020 -> 1,090-1,100 tok/s. Training keeps them (the tiny train step
# is 1.30x torch with them, 1.12x without). CPU only: the option names an
# XLA:CPU pass.
CPU_COMPILER_OPTIONS = {'xla_cpu_experimental_ynn_fusion_type': ''}
_JITS = {
    cpu: jax.jit(_generate, static_argnames=('graph', 'plan'),
                 donate_argnames=('cache',),
                 compiler_options=CPU_COMPILER_OPTIONS if cpu else None)
    for cpu in (True, False)}


def _generate_jit():
  """The jitted _generate for the default backend."""
  return _JITS[jax.default_backend() == 'cpu']


@dataclasses.dataclass(frozen=True, eq=False)
class _Graph:
  """A graphdef as a static jit argument hashed by identity (O(1) per call);
  equal graphdefs share one, so they share compiled programs."""

  graphdef: object


_GRAPHS: dict = {}  # graphdef -> its _Graph
# model -> (_Graph, its Variables, tree of the params pure dict). The graph
# traversal (nnx.split) runs once per model object; its Variables may be
# updated in place later, their values are read on every call.
_MODELS = weakref.WeakKeyDictionary()


def _graph(graphdef) -> _Graph:
  return _GRAPHS.setdefault(graphdef, _Graph(graphdef))


def _split(model: transformer.Transformer):
  """(graph, params pure dict) without walking the model on every call."""
  entry = _MODELS.get(model)
  if entry is None:
    graphdef, state = nnx.split(model)
    variables, treedef = jax.tree.flatten(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    pure_treedef = jax.tree.structure(nnx.to_pure_dict(state))
    entry = _MODELS[model] = (_graph(graphdef), variables, pure_treedef)
    del treedef
  graph, variables, pure_treedef = entry
  return graph, jax.tree.unflatten(pure_treedef,
                                   [v.get_value() for v in variables])


def lower(graphdef, params, batch: int, prompt_len: int, max_new_tokens: int,
          *, params_sampling: sampling.Params = sampling.Params(),
          num_samples: int = 1, stop_token_ids: Sequence[int] = (),
          transpose_head: bool = False, unroll: bool = False, mesh=None,
          rules: tuple = sharding.DEFAULT_RULES,
          vision_config: vision.VisionConfig | None = None,
          image_patches: int = 0):
  """The generation program of a fresh batch, lowered but not run.

  For memory plans and cost analyses: `params` may be ShapeDtypeStructs
  (with shardings, on a mesh); nothing is allocated. `image_patches` > 0:
  each prompt holds that many image patches (a Qwen3-VL model of
  `vision_config`), which the tower encodes in the program. `unroll`: the
  decode loop of `generate`'s `unroll_decode_from`.
  """
  plan = _Plan(dataclasses.replace(params_sampling, temperature=1.0),
               max_new_tokens, num_samples,
               tuple(stop_token_ids), prompt_len + max_new_tokens,
               transpose_head, unroll, tuple(rules))

  def arg(shape, dtype, axes):
    where = None if mesh is None else sharding.named(mesh, axes, shape, rules)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

  rows = (batch, prompt_len)
  images = ()
  if image_patches:
    patches = vision.abstract_patches(
        vision_config, vision.bucket_length(vision_config, image_patches),
        lead=(batch,))
    images = (jax.tree.map(lambda a: arg(a.shape, a.dtype, (
        'batch',) + (None,) * (a.ndim - 1)), patches),
              arg(rows + (3,), jnp.int32, ('batch', 'length', None)))
  with sharding.use(mesh, rules):
    return _generate_jit().lower(
        _graph(graphdef), params, None,
        arg(rows, jnp.int32, ('batch', 'length')),
        arg(rows, bool, ('batch', 'length')),
        arg((batch,), jnp.int32, ('batch',)), arg((batch,), bool, ('batch',)),
        np.uint32(0), np.float32(params_sampling.temperature), *images,
        plan=plan)


def unrolled_decode(config: transformer.ModelConfig, max_new_tokens: int,
                    unroll_decode_from: int) -> bool:
  """Whether `generate` decodes over a per-layer cache, the layers unrolled:
  always for a model without `scan_layers` (its layers are unrolled anyway,
  and reading slices of a stacked cache in them makes XLA copy the whole
  cache every step); on CPU from `unroll_decode_from` new tokens on."""
  on_cpu = jax.default_backend() == 'cpu'
  return not config.scan_layers or (
      on_cpu and 0 < unroll_decode_from <= max_new_tokens)


def _bucket(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= n; past the largest, a multiple of the largest."""
  fits = [b for b in buckets if b >= n]
  if fits:
    return min(fits)
  top = max(buckets)
  return -(-n // top) * top


def _stop_string_cut(tokens, tokenizer, stop_strings) -> int | None:
  """Fewest leading tokens whose text contains a stop string, or None."""

  def found(k):
    text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
    return any(s in text for s in stop_strings)

  if not found(len(tokens)):
    return None
  lo, hi = 0, len(tokens)  # found(lo) is False, found(hi) is True
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if found(mid) else (mid, hi)
  return hi


def _put(x, mesh, rules, axes):
  if mesh is None:
    return jnp.asarray(x)
  return jax.device_put(x, sharding.named(mesh, axes, x.shape, rules))


@dataclasses.dataclass
class _Rows:
  """What each row feeds this call, and the cache it is appended to."""

  chunks: list[list[int]]  # tokens each row feeds
  start: list[int]  # position of each chunk's first token
  whole: list[list[int]]  # each conversation, new prompt included
  cache: kv_cache.KVCache | None  # None: a fresh one
  origin: int  # cache slot of the chunks' first column
  width: int  # padded chunk length
  length: int  # cache slots
  batch: int  # rows before the G repeat


def _plan_rows(prompts, session, max_new_tokens, prompt_buckets,
               batch_buckets, cache_bucket, max_cache_length) -> _Rows:
  """Chunks, positions and cache for this call.

  A row feeds what its cache lacks: the last token of its conversation
  (sampled by the previous call, never fed) and the new prompt.
  """
  history = [[]] * len(prompts) if session is None else session.conversations
  for r, (h, p) in enumerate(zip(history, prompts)):
    if (p is None and session is None) or (p is not None and not h + list(p)):
      raise ValueError(f'prompt {r} is empty')
  whole = [list(h) + list(p or ()) for h, p in zip(history, prompts)]
  start = [max(len(h) - 1, 0) for h in history]
  chunks = [w[f:] for w, f in zip(whole, start)]
  width = _bucket(max(map(len, chunks)), prompt_buckets)
  if session is None:
    return _Rows(chunks, start, whole, None, 0, width, width + max_new_tokens,
                 _bucket(len(prompts), batch_buckets))
  cache = session.cache
  batch, length = cache.mask_BxS.shape  # the chunk goes to every cache row
  origin = int(cache.index)
  if origin + width + max_new_tokens > length:
    length = _bucket(origin + width + max_new_tokens, (cache_bucket,))
  if length > max_cache_length:  # compact: prefill everything again
    width = _bucket(max(map(len, whole)), prompt_buckets)
    return _Rows(whole, [0] * len(whole), whole, None, 0, width,
                 width + max_new_tokens, batch)
  if length > cache.mask_BxS.shape[1]:
    cache = _widen(cache, length)
  return _Rows(chunks, start, whole, cache, origin, width, length, batch)


def _finish(tokens, logprobs, num, prompts, g, stop_ids, stop_strings,
            tokenizer):
  """Host-side rows; also {row: tokens kept} for rows cut at a stop string."""
  tokens, logprobs, num = map(sharding.to_host, (tokens, logprobs, num))
  out = Output([], [], [], [])
  cuts = {}
  for r in range(len(prompts) * g):
    k = int(num[r])
    row = tokens[r, :k].tolist()
    if prompts[r // g] is None:
      reason = INACTIVE
    elif k and row[-1] in stop_ids:
      reason = STOP_TOKEN
    else:
      reason = LENGTH
    cut = _stop_string_cut(row, tokenizer, stop_strings) if (
        stop_strings and k) else None
    if cut is not None:
      k, reason, row, cuts[r] = cut, STOP_STRING, row[:cut], cut
    out.tokens.append(row)
    out.logprobs.append(logprobs[r, :k].tolist())
    out.num_tokens.append(k)
    out.finish_reason.append(reason)
  if tokenizer is not None:
    out.texts = [tokenizer.decode(t, skip_special_tokens=False)
                 for t in out.tokens]
  return out, cuts


def _next_session(cache, whole, out, g, cuts, last_slot, shifts,
                  holds_images):
  """Conversations extended by this call; cache slots of cut tokens masked.

  Generated token j of a row was fed at slot `last_slot + 1 + j`, where
  `last_slot` holds the last chunk token; a row cut to k tokens keeps 0..k-2.
  """
  if cuts:
    mask = np.array(cache.mask_BxS)
    for r, k in cuts.items():
      mask[r, last_slot + k:] = False
    cache = cache.replace(
        mask_BxS=jax.device_put(mask, cache.mask_BxS.sharding))
  conversations = [whole[r // g] + tokens for r, tokens in enumerate(out.tokens)]
  return Session(cache, conversations,
                 [shifts[r // g] for r in range(len(out.tokens))], holds_images)


def _image_positions(model, chunk, mask, start_B, shifts, images, rows):
  """(vision.Patches, positions [B, C, 3], new shifts) of a call.

  `start_B`: position of each chunk's first token.
  """
  config = model.config.vision
  if config is None:
    raise ValueError(f'images given to a {model.config.model_type} model, '
                     'which has no vision tower')
  pixels, grids = images
  grids = vision.check_grids(config, grids)
  relative_BxCx3, next_B, per_row = vision.multimodal_positions(
      chunk, mask, grids, config)
  ends = chunk[:len(rows.chunks), -1] == config.image_token_id
  if ends.any():
    raise ValueError(f'prompt {int(np.argmax(ends))} ends in an image token; '
                     'a prompt must end in text (the generation prompt)')
  positions = np.where(mask[..., None],
                       relative_BxCx3 + start_B[:, None, None], 0)
  new_shifts = [s + int(n) - len(c)
                for s, n, c in zip(shifts, next_B, rows.chunks)]
  return (vision.patches(config, pixels, grids, per_row),
          positions.astype(np.int32), new_shifts)


def generate(model: transformer.Transformer,
             prompts: Sequence[Sequence[int] | None],
             max_new_tokens: int, *,
             temperature: float = 1.0,
             top_p: float = 1.0,
             top_k: int = 0,
             stop_token_ids: Sequence[int] = (),
             seed: int = 0,
             allowed_token_ids: Sequence[int] = (),
             num_samples: int = 1,
             stop_strings: Sequence[str] = (),
             tokenizer=None,
             prompt_buckets: Sequence[int] = (32, 64, 128, 256, 512, 1024),
             batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
             cache_bucket: int = 128,
             max_cache_length: int = 8192,
             transpose_head: bool | None = None,
             unroll_decode_from: int = 0,
             mesh: jax.sharding.Mesh | None = None,
             rules: tuple = sharding.DEFAULT_RULES,
             session: Session | None = None,
             keep_session: bool = False,
             images=None) -> Output:
  """Samples up to `max_new_tokens` tokens after each prompt.

  Args:
    model: the policy; with `mesh`, its parameters are used in their sharding.
    prompts: token ids per row. With `session`, the tokens to append to each
      session row (e.g. an observation), or None to leave that row idle.
    max_new_tokens: generation budget per row (static: part of the program).
    temperature: 0 is greedy.
    top_p, top_k: nucleus and top-k filters (1.0 and 0 disable them).
    stop_token_ids: a row ends after sampling one of these (kept in its tokens).
    seed: the random stream of row r depends only on (seed, r): vary it per
      call.
    allowed_token_ids: constrained decoding: only these ids are sampled (the
      returned log-probs stay those of the unconstrained model, which is what
      the trainer's pi_old measures).
    num_samples: G rows per prompt, sharing one prefill of the prompt.
    stop_strings: with `tokenizer`, a row ends at the first token whose text
      completes one of these (checked on the host after decoding; the tokens
      up to that one are kept, so the text contains the stop string).
    tokenizer: a transformers tokenizer, for stop strings and `texts`.
    prompt_buckets, batch_buckets: allowed padded prompt lengths and prompt
      counts; each (prompt bucket, batch bucket) pair compiles once.
    cache_bucket: a session's cache grows in multiples of this many slots.
    max_cache_length: past this, a session re-prefills its conversations into
      a fresh, compact cache instead of growing.
    transpose_head: keep a [D, V] copy of the output projection in column
      blocks during the call (faster on CPU, costs V*D memory; see
      HEAD_COLUMNS); None: only on CPU.
    unroll_decode_from: on CPU, a call of at least this many new tokens by
      a model with `scan_layers` runs its decode steps with the layers
      unrolled over one cache array per layer (kv_cache.per_layer), the
      layer weights sliced once per call: no copy of any weight or cache
      slice per step. It costs a bigger program (compile time) and, during
      the call, a copy of the cache and of the layer weights. 0: never.
      Accelerators keep the scanned loop. See `unrolled_decode`.
    mesh, rules: shard the batch over ('data', 'fsdp') and the cache's kv heads
      over 'tensor' as the rules say.
    session: the `session` of an earlier output, to continue its rows.
    keep_session: return the cache in `Output.session`.
    images: (pixel_values [N, P], image_grid_thw [n, 3]) of the images whose
      image tokens are in this call's prompts, in order (Qwen3-VL). The
      tower runs once per image; the cache (and a kept session) holds their
      tokens, so later turns do not pass them again. Images are padded to a
      bucket of patches (vision.bucket_length): those of a known bucket do
      not compile again.

  Returns:
    An Output with one entry per row: len(prompts) * num_samples rows.
  """
  if not prompts or max_new_tokens < 1 or num_samples < 1:
    raise ValueError(f'{len(prompts)} prompts, max_new_tokens='
                     f'{max_new_tokens}, num_samples={num_samples}: all must '
                     'be >= 1')
  if stop_strings and tokenizer is None:
    raise ValueError('stop_strings need a tokenizer')
  if temperature < 0:
    raise ValueError(f'temperature={temperature} must be >= 0')
  if session is not None and len(prompts) != len(session.conversations):
    raise ValueError(f'{len(prompts)} prompts for a session of '
                     f'{len(session.conversations)} rows')
  if session is not None and session.cache is None:
    raise ValueError('this session was continued already (its cache is '
                     'donated to the call that continues it)')
  g = num_samples
  rows = _plan_rows(prompts, session, max_new_tokens, prompt_buckets,
                    batch_buckets, cache_bucket, max_cache_length)
  shifts = [0] * len(prompts)
  holds_images = images is not None
  if session is not None:
    shifts = list(session.shifts or shifts)
    holds_images |= session.holds_images
    if session.holds_images and rows.cache is None:
      raise ValueError(f'the session\'s cache would pass max_cache_length='
                       f'{max_cache_length} and be prefilled anew, which needs '
                       'the images of earlier turns; raise max_cache_length')
  if session is not None:
    session.cache = None
  chunk = np.zeros((rows.batch, rows.width), np.int32)
  mask = np.zeros((rows.batch, rows.width), bool)
  for r, c in enumerate(rows.chunks):
    chunk[r, rows.width - len(c):] = c
    mask[r, rows.width - len(c):] = True
  start = np.zeros(rows.batch, np.int32)
  start[:len(prompts)] = np.asarray(rows.start) + np.asarray(shifts)
  extra = ()
  if images is not None:
    patches, positions, shifts = _image_positions(
        model, chunk, mask, start, shifts, images, rows)
    extra = (jax.tree.map(lambda a: _put(a, mesh, rules, (
        'batch',) + (None,) * (a.ndim - 1)), patches),
             _put(positions, mesh, rules, ('batch', 'length', None)))
  live = np.zeros(rows.batch, bool)
  live[:len(prompts)] = [p is not None for p in prompts]
  on_cpu = jax.default_backend() == 'cpu'
  transpose_head = on_cpu if transpose_head is None else transpose_head
  unroll = unrolled_decode(model.config, max_new_tokens, unroll_decode_from)
  # The temperature is an argument of the program, not part of it: greedy
  # evaluation and sampled rollouts share compiled programs.
  plan = _Plan(sampling.Params(1.0, top_p, top_k,
                               tuple(int(t) for t in allowed_token_ids)),
               max_new_tokens, g,
               tuple(int(t) for t in stop_token_ids), rows.length,
               bool(transpose_head), unroll, tuple(rules))
  graph, params = _split(model)
  with sharding.use(mesh, rules):
    tokens, logprobs, num, cache = _generate_jit()(
        graph, params, rows.cache,
        _put(chunk, mesh, rules, ('batch', 'length')),
        _put(mask, mesh, rules, ('batch', 'length')),
        _put(start, mesh, rules, ('batch',)),
        _put(live, mesh, rules, ('batch',)),
        np.uint32(seed), np.float32(temperature), *extra, plan=plan)
  out, cuts = _finish(tokens, logprobs, num, prompts, g, plan.stop_token_ids,
                      stop_strings, tokenizer)
  if keep_session:
    out.session = _next_session(cache, rows.whole, out, g, cuts,
                                rows.origin + rows.width - 1, shifts,
                                holds_images)
  return out
