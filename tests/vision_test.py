"""Qwen3-VL: logits, generation and checkpoints against transformers."""

import dataclasses
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rla_jax import batching
from rla_jax import chat
from rla_jax import feedback
from rla_jax import judge
from rla_jax import sampler
from rla_jax import sharding
from rla_jax import structs
from rla_jax import train
from rla_jax import train_epoch
from rla_jax.models import hf
from rla_jax.models import hf_vision
from rla_jax.models import transformer
from rla_jax.models import vision

import train_test  # pylint: disable=g-bad-import-order

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

SPECIALS = ('<pad>', '<s>', '</s>', '<unk>', '<|im_start|>', '<|im_end|>',
            '<|vision_start|>', '<|vision_end|>', '<|image_pad|>',
            '<|video_pad|>')
IMG = '<|vision_start|><|image_pad|><|vision_end|>'
SIZES = ((70, 100), (40, 64))  # (height, width) of the test images


def make_tokenizer():
  import tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {t: i for i, t in enumerate(
      SPECIALS + tuple('abcdefghijklmnopqrstuvwxyz .'))}
  tok = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r'<\|[a-z_]+\|>|.'), behavior='isolated')
  tok.decoder = tokenizers.decoders.Fuse()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token='<pad>', eos_token='<|im_end|>',
      unk_token='<unk>', additional_special_tokens=list(SPECIALS[4:]))


def hf_config(tok, deepstack=(0, 1), tie=False, depth=3):
  ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
  return transformers.Qwen3VLConfig(
      text_config=dict(
          vocab_size=len(tok), hidden_size=64, intermediate_size=96,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, eos_token_id=ids['<|im_end|>'], initializer_range=0.1,
          rope_parameters=dict(rope_type='default', rope_theta=10000.0,
                               mrope_section=[2, 3, 3],
                               mrope_interleaved=True)),
      vision_config=dict(
          depth=depth, hidden_size=32, intermediate_size=48, num_heads=2,
          patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
          out_hidden_size=64, num_position_embeddings=16,
          deepstack_visual_indexes=list(deepstack),
          initializer_range=0.3),  # large enough that GELU variants differ
      image_token_id=ids['<|image_pad|>'], video_token_id=ids['<|video_pad|>'],
      vision_start_token_id=ids['<|vision_start|>'],
      vision_end_token_id=ids['<|vision_end|>'], tie_word_embeddings=tie)


def image_processor():
  from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ip  # pylint: disable=g-import-not-at-top
  return ip.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2,
                                     merge_size=2, min_pixels=32 * 32,
                                     max_pixels=32 * 32 * 64)


def write_folder(path, deepstack=(0, 1), tie=False, seed=0):
  """A random tiny Qwen3-VL folder (weights, tokenizer, image processor)."""
  tok = make_tokenizer()
  torch.manual_seed(seed)
  model = transformers.Qwen3VLForConditionalGeneration(
      hf_config(tok, deepstack, tie)).eval()
  with torch.no_grad():  # visible norms and biases, not ones and zeros
    for name, p in model.named_parameters():
      if 'norm' in name or name.endswith('bias'):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(path)
  tok.save_pretrained(path)
  image_processor().save_pretrained(path)
  return model


def images(n):
  rng = np.random.RandomState(1)
  from PIL import Image  # pylint: disable=g-import-not-at-top
  return [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))
          for h, w in SIZES[:n]]


def torch_logits(model, arrays):
  kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
  kwargs['input_ids'] = kwargs['input_ids'].long()
  if 'image_grid_thw' in kwargs:
    kwargs['image_grid_thw'] = kwargs['image_grid_thw'].long()
    kwargs['mm_token_type_ids'] = (
        kwargs['input_ids'] == model.config.image_token_id).int()
  with torch.no_grad():
    return model(**kwargs).logits.numpy()


def ours_logits(model, arrays):
  extra = {}
  if 'pixel_values' in arrays:
    extra = dict(pixel_values=jnp.asarray(arrays['pixel_values']),
                 image_grid_thw=arrays['image_grid_thw'])
  return np.asarray(model(jnp.asarray(arrays['input_ids']),
                          mask_BxT=jnp.asarray(arrays['attention_mask']),
                          **extra))


TEXTS = {0: ['ab cd ef', 'hello there'],
         1: [f'look {IMG} at this.'],
         2: [f'a {IMG} b {IMG} c']}


@pytest.mark.parametrize('deepstack,tie', [((0, 1), False), ((), True),
                                           ((2,), False)])
@pytest.mark.parametrize('num_images', [0, 1, 2])
def test_logits_match_transformers(tmp_path, deepstack, tie, num_images):
  theirs = write_folder(str(tmp_path), deepstack, tie)
  model, processor = hf.load(str(tmp_path), dtype='float32')
  assert isinstance(processor, hf_vision.Processor)
  text = [t.replace(IMG, IMG.replace('<|image_pad|>',
                                     hf_vision.IMAGE_PLACEHOLDER))
          for t in TEXTS[num_images]]
  arrays = processor(text, images(num_images))
  if num_images:
    grids = arrays['image_grid_thw']
    assert len({tuple(g) for g in grids}) == num_images  # sizes differ
  real = arrays['attention_mask'].astype(bool)  # padding logits are noise
  np.testing.assert_allclose(ours_logits(model, arrays)[real],
                             torch_logits(theirs, arrays)[real], atol=1e-4,
                             rtol=1e-4)


def test_save_round_trip_loads_in_transformers(tmp_path):
  theirs = write_folder(str(tmp_path / 'a'), (0,), False)
  model, processor = hf.load(str(tmp_path / 'a'))
  hf.save(model, str(tmp_path / 'b'), processor)
  again = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
      str(tmp_path / 'b'), local_files_only=True).eval()
  arrays = processor(TEXTS[2][0].replace('<|image_pad|>',
                                         hf_vision.IMAGE_PLACEHOLDER),
                     images(2))
  np.testing.assert_allclose(torch_logits(again, arrays),
                             torch_logits(theirs, arrays), atol=1e-6)
  reloaded, _ = hf.load(str(tmp_path / 'b'))
  np.testing.assert_array_equal(ours_logits(reloaded, arrays),
                                ours_logits(model, arrays))
  scanned, _ = hf.load(str(tmp_path / 'a'), scan_layers=True)
  hf.save(scanned, str(tmp_path / 'c'), processor)  # stacked layers out
  again = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
      str(tmp_path / 'c'), local_files_only=True).eval()
  np.testing.assert_allclose(torch_logits(again, arrays),
                             torch_logits(theirs, arrays), atol=1e-6)


def test_sharded_equals_single_device(tmp_path):
  write_folder(str(tmp_path), (0, 1), False)
  single, processor = hf.load(str(tmp_path))
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  sharded, _ = hf.load(str(tmp_path), mesh=mesh, scan_layers=True)
  wqkv = sharded.vision.blocks.wqkv[...]  # stacked: [depth, E, 3, H, Dh]
  assert wqkv.shape[0] == 3 and len(wqkv.sharding.device_set) == 8
  assert not wqkv.sharding.is_fully_replicated
  arrays = processor(TEXTS[2][0].replace('<|image_pad|>',
                                         hf_vision.IMAGE_PLACEHOLDER),
                     images(2))
  with sharding.use(mesh):
    got = jax.jit(lambda m, ids, px: m(ids, pixel_values=px,
                                       image_grid_thw=arrays['image_grid_thw'],
                                       positions_BxT=positions))
    positions = jnp.asarray(vision.multimodal_positions(
        arrays['input_ids'], None, vision.check_grids(
            single.config.vision, arrays['image_grid_thw']),
        single.config.vision)[0])
    out = got(sharded, jnp.asarray(arrays['input_ids']),
              jnp.asarray(arrays['pixel_values']))
  np.testing.assert_allclose(np.asarray(out), ours_logits(single, arrays),
                             atol=1e-5)


@pytest.fixture(scope='module')
def folder_path(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('qwen3vl'))
  return path, write_folder(path, (0, 1), False)


@pytest.fixture(scope='module')
def folder(folder_path):
  path, theirs = folder_path
  model, processor = hf.load(path)
  return theirs, model, processor


def prompt_arrays(processor, text, num_images):
  return processor(text.replace('<|image_pad|>', hf_vision.IMAGE_PLACEHOLDER),
                   images(num_images))


def test_greedy_generation_matches_transformers(folder):
  theirs, model, processor = folder
  arrays = prompt_arrays(processor, f'look {IMG} now. ', 1)
  kwargs = {k: torch.from_numpy(v).long() for k, v in arrays.items()
            if k != 'pixel_values'}
  with torch.no_grad():
    ref = theirs.generate(
        **kwargs, pixel_values=torch.from_numpy(arrays['pixel_values']),
        mm_token_type_ids=(kwargs['input_ids']
                           == theirs.config.image_token_id).int(),
        max_new_tokens=10, do_sample=False, eos_token_id=None,
        pad_token_id=0)[0, arrays['input_ids'].shape[1]:].tolist()
  out = sampler.generate(model, [arrays['input_ids'][0].tolist()], 10,
                         temperature=0.0, images=(arrays['pixel_values'],
                                                  arrays['image_grid_thw']))
  assert out.tokens[0] == ref


def teacher_forced_logprobs(model, prompt, tokens, arrays):
  ids = np.asarray([list(prompt) + list(tokens)], np.int32)
  logits = ours_logits(model, dict(arrays, input_ids=ids,
                                   attention_mask=np.ones_like(ids)))
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  n = len(prompt)
  return np.asarray([logp[n - 1 + i, t] for i, t in enumerate(tokens)])


def test_sampler_logprobs_equal_teacher_forcing_and_no_retrace(folder):
  _, model, processor = folder
  arrays = prompt_arrays(processor, f'see {IMG} then. ', 1)
  prompt = arrays['input_ids'][0].tolist()
  letters = processor.tokenizer.convert_tokens_to_ids(list('abcdefgh'))
  run = lambda a, seed: sampler.generate(  # no image token is sampled
      model, [prompt], 6, temperature=1.0, seed=seed,
      allowed_token_ids=letters,
      images=(a['pixel_values'], a['image_grid_thw']))
  out = run(arrays, 0)
  np.testing.assert_allclose(
      out.logprobs[0], teacher_forced_logprobs(model, prompt, out.tokens[0],
                                               arrays), atol=1e-4)
  traces = sampler.num_traces()
  other = dict(arrays, pixel_values=arrays['pixel_values'][::-1].copy())
  second = run(other, 1)  # a new image of the same size
  assert sampler.num_traces() == traces
  np.testing.assert_allclose(
      second.logprobs[0], teacher_forced_logprobs(
          model, prompt, second.tokens[0], other), atol=1e-4)


def test_session_holds_image_tokens_across_turns(folder):
  _, model, processor = folder
  first = prompt_arrays(processor, f'one {IMG} two. ', 1)
  prompt = first['input_ids'][0].tolist()
  letters = processor.tokenizer.convert_tokens_to_ids(list('abcdefgh'))
  out = sampler.generate(model, [prompt], 4, temperature=0.0,
                         allowed_token_ids=letters,
                         keep_session=True,
                         images=(first['pixel_values'],
                                 first['image_grid_thw']))
  assert out.session.shifts[0] < 0  # the image took fewer positions
  turn = processor.tokenizer.encode(' more text. ')
  later = sampler.generate(model, [turn], 4, temperature=0.0,
                           session=out.session)
  whole = prompt + out.tokens[0] + turn
  fresh = sampler.generate(model, [whole], 4, temperature=0.0,
                           images=(first['pixel_values'],
                                   first['image_grid_thw']))
  assert later.tokens[0] == fresh.tokens[0]
  np.testing.assert_allclose(later.logprobs[0], fresh.logprobs[0], atol=1e-4)


def vl_examples(processor, n, seed=0):
  """Examples whose prompts hold 0, 1 or 2 images, with letter responses."""
  rng = np.random.default_rng(seed)
  letters = processor.tokenizer.convert_tokens_to_ids(list('abcdefgh'))
  out = []
  for i in range(n):
    k = i % 3
    text = ['no image here. ', f'look {IMG} here. ', f'a {IMG} b {IMG} c. '][k]
    arrays = prompt_arrays(processor, text, k)
    out.append(structs.Example(
        prompt_tokens=arrays['input_ids'][0].tolist(),
        response_tokens=rng.choice(letters, rng.integers(2, 6)).tolist(),
        advantage=float(rng.normal()),
        images=structs.Images(arrays['pixel_values'],
                              arrays['image_grid_thw']) if k else None))
  return out


def vl_trainer(model, **overrides):
  """A policy Trainer of `model` for prompts with images (up to 48 tokens)."""
  values = dict(micro_batch_size=2, updates_per_epoch=1, max_prompt_len=48,
                max_response_len=8, overlong_prompt='truncate',
                prompt_buckets=(48,), response_buckets=(8,), kl_coef=0.0,
                compute_entropy=False, head_chunk=0)
  values.update(overrides)
  return train.Trainer(nnx.split(model)[0],
                       train_test.optim_config(learning_rate=1e-3),
                       train_test.train_config(**values))


def test_train_steps_take_images(folder):
  _, model, processor = folder
  exs = vl_examples(processor, 6)
  trainer = vl_trainer(model)
  state = trainer.init_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  batch = batching.pack(exs, micro_batch_size=2, prompt_buckets=(48,),
                        response_buckets=(8,),
                        vision_config=model.config.vision)
  assert batch.patches.pixels_BxNxP.shape[:3] == (4, 2, 64)  # M, B, N
  old = np.asarray(trainer.logprobs(state.params, batch)).reshape(8, 8)
  for row, e in enumerate(exs):  # pi_old equals the plain forward
    arrays = {} if e.images is None else dict(
        pixel_values=e.images.pixel_values, image_grid_thw=e.images.grids)
    n = len(e.response_tokens)
    np.testing.assert_allclose(
        old[row, :n], teacher_forced_logprobs(
            model, e.prompt_tokens, e.response_tokens, arrays), atol=1e-4)
  batch = batch.replace(old_logp_MxBxR=old.reshape(4, 2, 8),
                        ref_logp_MxBxR=old.reshape(4, 2, 8))
  losses_seen = []
  for _ in range(2):  # the same batch: one step lowers its loss
    state, metrics = trainer.step(state, batch)
    losses_seen.append(float(metrics['loss']))
  assert losses_seen[1] < losses_seen[0] - 0.01, losses_seen
  compiled = trainer._step._cache_size()  # pylint: disable=protected-access
  other = batching.pack(vl_examples(processor, 5, seed=1)[::-1],
                        micro_batch_size=2, prompt_buckets=(48,),
                        response_buckets=(8,),
                        vision_config=model.config.vision)
  other = other.replace(old_logp_MxBxR=batch.old_logp_MxBxR,
                        ref_logp_MxBxR=batch.ref_logp_MxBxR)
  trainer.step(state, other)  # other images, the same bucket: no retrace
  assert trainer._step._cache_size() == compiled  # pylint: disable=protected-access


def sampling_config(**overrides):
  values = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=4,
                max_prompt_len=96, stop_strings=(), allowed_tokens=tuple(
                    'abcdefgh'), prompt_buckets=(32, 64, 128),
                batch_buckets=(1, 2, 4), max_rows=4, session='none',
                cache_bucket=64, unroll_decode_from=0)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def image_message(text, image, after=' now. '):
  return {'role': 'user', 'content': [
      {'type': 'text', 'text': text}, {'type': 'image', 'image': image},
      {'type': 'text', 'text': after}]}


def assert_teacher_forced(model, completion):
  arrays = {} if completion.images is None else dict(
      pixel_values=completion.images.pixel_values,
      image_grid_thw=completion.images.grids)
  np.testing.assert_allclose(
      completion.logprobs, teacher_forced_logprobs(
          model, completion.prompt_tokens, completion.tokens, arrays),
      atol=1e-4)


def test_chat_complete_with_image_messages(folder):
  _, model, processor = folder
  pictures = images(2)
  batch = [[image_message('look ', pictures[0])],
           [{'role': 'user', 'content': 'only text here.'}],
           [image_message('and ', pictures[1])]]
  rows = chat.complete(model, processor, batch, sampling=sampling_config(),
                       num_samples=2, seed=3)
  assert [len(r) for r in rows] == [2, 2, 2]
  assert rows[1][0].images is None
  for row, picture in ((rows[0], pictures[0]), (rows[2], pictures[1])):
    expected = processor.images([picture])
    np.testing.assert_array_equal(row[0].images.grids,
                                  expected['image_grid_thw'])
    image_id = model.config.vision.image_token_id
    assert row[0].prompt_tokens.count(image_id) == vision.tokens_per_image(
        model.config.vision, tuple(expected['image_grid_thw'][0]))
  for row in rows:
    assert_teacher_forced(model, row[0])
  with pytest.raises(ValueError, match='vision processor'):
    chat.complete(model, processor.tokenizer, batch[:1],
                  sampling=sampling_config(), num_samples=1, seed=0)
  with pytest.raises(ValueError, match='not cut'):
    chat.complete(model, processor, batch[:1],
                  sampling=sampling_config(max_prompt_len=8), num_samples=1,
                  seed=0)


def test_kv_session_turns_with_images(folder):
  _, model, processor = folder
  pictures = images(2)
  state = chat.ChatState()
  cfg = sampling_config(session='kv')
  turn = lambda msgs: chat.Turn(msgs, state=state, row=0, chat=lambda: msgs)
  first = chat.complete(model, processor,
                        [turn([image_message('start ', pictures[0])])],
                        sampling=cfg, num_samples=1, seed=0)[0][0]
  second = chat.complete(model, processor,
                         [turn([image_message('next ', pictures[1])])],
                         sampling=cfg, num_samples=1, seed=1)[0][0]
  assert state.restarts == 0  # the second turn continued the session
  assert second.prompt_tokens[:len(first.prompt_tokens)] == (
      first.prompt_tokens)
  assert len(second.images.grids) == 2
  assert_teacher_forced(model, first)
  assert_teacher_forced(model, second)


class _JudgeEnv:
  """judge_messages with the step's screenshot, as a GUI setting's RM has."""

  def __init__(self, picture):
    self.picture = picture

  def judge_messages(self, spec, prompt, response, observation):
    del spec, prompt, observation
    return [image_message(f'rate {response}: ', self.picture)]


def test_judge_and_feedback_carry_images(folder):
  _, model, processor = folder
  picture = images(1)[0]
  traj = structs.Trajectory(task_id='t', source='active', rollout=0, spec={})
  traj.steps.append(structs.Step(
      prompt='p', prompt_tokens=[1, 2], response='ab', response_tokens=[3],
      logprobs=[-1.0], action='ab', observation='o', finish_reason='stop'))
  judgments = judge.score(model, processor, _JudgeEnv(picture), [traj],
                          mode='steps', num_samples=2,
                          sampling=sampling_config(), seed=0)
  assert len(judgments) == 2
  for j in judgments:
    assert j.images is not None and len(j.images.grids) == 1
  judgments[0].score, judgments[1].score = 1, -1  # a step worth training on
  for j in judgments:
    j.parsed = True
  key = traj.step_key(0)
  examples, _ = feedback.rm_examples(
      [traj], feedback.judgments_by_step(judgments), {key: 1.0},
      {traj.group: 0.5}, keep=lambda acc: True, penalty=-1.0, eps=1e-6,
      exclude=())
  assert len(examples) == 2 and all(e.images is not None for e in examples)
  rm = vl_trainer(model, max_prompt_len=64, prompt_buckets=(64,))
  rm = train.Trainer(rm.graphdef, rm.optim_config, rm.train_config,
                     kind='reward')
  state = rm.init_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  state, metrics = train_epoch.update(rm, state, examples, epoch=0)
  assert metrics['steps'] == 1 and metrics['dropped'] == 0
  assert metrics['logprob_gap_mean'] < 1e-4  # sampler and trainer agree


@pytest.mark.parametrize('scan', [False, True])
def test_tower_remat_keeps_gradients(folder, folder_path, scan):
  _, model, processor = folder
  if scan:  # stacked blocks: a scan per stretch between deepstack taps
    model, _ = hf.load(folder_path[0], scan_layers=True)
  arrays = prompt_arrays(processor, f'a {IMG} b', 1)
  patches = vision.patches(model.config.vision, arrays['pixel_values'],
                           arrays['image_grid_thw'])
  state = nnx.state(model)

  def grads(remat):
    config = dataclasses.replace(model.config, remat=remat)
    graphdef = nnx.split(transformer.abstract_model(config))[0]
    loss = lambda st: jnp.sum(jnp.sin(nnx.merge(graphdef, st).encode_images(
        patches).tokens_BxMxD))
    jaxpr = str(jax.make_jaxpr(loss)(state))
    if remat == 'none':
      assert 'remat' not in jaxpr
    elif scan:  # (the printer shares the stretches' identical bodies)
      assert jaxpr.count('remat') >= 1
    else:
      assert jaxpr.count('remat') == config.vision.depth
    return jax.jit(jax.grad(loss))(state)

  want = jax.tree.leaves(grads('none'))
  for policy in ('full', 'dots_saveable'):
    for g, w in zip(jax.tree.leaves(grads(policy)), want, strict=True):
      np.testing.assert_allclose(g, w, atol=1e-6)
  if scan:  # the same tower as unrolled blocks
    tokens = lambda m: m.encode_images(patches).tokens_BxMxD
    # (float32 sums in another order: logits of ~13 differ by ~1e-5)
    np.testing.assert_allclose(tokens(model), tokens(folder[1]), rtol=2e-6,
                               atol=1e-5)
