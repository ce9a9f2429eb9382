"""Qwen3-VL on this CPU: tower, screenshot prefill and decode, ours vs torch.

  .venv/bin/python benchmarks/vision.py [--rounds=3] [--new-tokens=32]

A random tiny Qwen3-VL (tower: 4 layers of width 128, deepstack after layers
1 and 2; decoder: 4 layers of width 256, 4k vocabulary) written as a Hugging
Face folder; we load it with `hf.load`, transformers with `from_pretrained`,
so both run the same float32 weights. The input is one 1920x1080 screenshot
under Qwen3-VL's default image settings (patch 16, merge 2, up to
16,777,216 pixels: the screenshot keeps its size, rounded to multiples of
32), in a short chat prompt. Timed, after a warm-up (compile excluded),
alternating sides, median of `--rounds`:
  tower    the vision tower on the screenshot's patches
  prefill  tower + decoder forward over the whole prompt (ours: one
           `sampler.generate` call with 1 new token; torch: one forward)
  decode   `--new-tokens` greedy tokens after the prompt (prefill included)
Prints the screenshot's patches and image tokens, each time, and ratios
torch_time / our_time (above 1: we are faster); the decode rate is the new
tokens over (decode - prefill) time. About 3 minutes here.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from rla_jax import sampler  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import hf  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import hf_vision  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import vision  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

SPECIALS = ['<pad>', '<|im_end|>', '<|vision_start|>', '<|vision_end|>',
            '<|image_pad|>', '<|video_pad|>']
# Qwen3-VL's preprocessor_config.json values.
IMAGE_SETTINGS = dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                      size={'shortest_edge': 65536, 'longest_edge': 16777216})


def write_model(path):
  """The random tiny Qwen3-VL folder (weights, tokenizer, image processor)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ip  # pylint: disable=g-import-not-at-top
  words = [f'w{i}' for i in range(4096 - len(SPECIALS))]
  vocab = {t: i for i, t in enumerate(SPECIALS + words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, '<pad>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r'<\|[a-z_]+\|>|w[0-9]+'), behavior='isolated')
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token='<pad>', eos_token='<|im_end|>',
      additional_special_tokens=SPECIALS[1:])
  torch.manual_seed(0)
  config = transformers.Qwen3VLConfig(
      text_config=dict(vocab_size=len(vocab), hidden_size=256,
                       intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64,
                       rope_parameters=dict(rope_type='default',
                                            rope_theta=5e6,
                                            mrope_section=[12, 10, 10],
                                            mrope_interleaved=True)),
      vision_config=dict(depth=4, hidden_size=128, intermediate_size=512,
                         num_heads=4, patch_size=16, temporal_patch_size=2,
                         spatial_merge_size=2, out_hidden_size=256,
                         num_position_embeddings=2304,
                         deepstack_visual_indexes=[1, 2]),
      image_token_id=vocab['<|image_pad|>'],
      video_token_id=vocab['<|video_pad|>'],
      vision_start_token_id=vocab['<|vision_start|>'],
      vision_end_token_id=vocab['<|vision_end|>'])
  model = transformers.Qwen3VLForConditionalGeneration(config).eval()
  model.save_pretrained(path)
  fast.save_pretrained(path)
  ip.Qwen2VLImageProcessorPil(**IMAGE_SETTINGS).save_pretrained(path)
  return model


def timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--new-tokens', type=int, default=128)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count())
  folder = tempfile.mkdtemp(prefix='vl_bench_')
  theirs = write_model(folder)
  model, processor = hf.load(folder)
  c = model.config.vision
  screenshot = Image.fromarray(
      (np.random.default_rng(0).random((1080, 1920, 3)) * 255).astype(
          np.uint8))
  text = ' '.join(f'w{i}' for i in range(40))
  arrays = processor(f'{text} {hf_vision.IMAGE_TEXT} {text}', [screenshot])
  grid = tuple(int(v) for v in arrays['image_grid_thw'][0])
  patches = grid[0] * grid[1] * grid[2]
  tokens = vision.tokens_per_image(c, grid)
  prompt = arrays['input_ids'][0].tolist()
  print(f'1920x1080 screenshot: grid (t, h, w) = {grid}, {patches} patches, '
        f'{tokens} image tokens (bucket {vision.bucket_length(c, patches)} '
        f'patches); prompt {len(prompt)} tokens')

  packed = vision.patches(c, arrays['pixel_values'], arrays['image_grid_thw'])
  graphdef, state = nnx.split(model)
  tower = jax.jit(
      lambda s, p: nnx.merge(graphdef, s).encode_images(p).tokens_BxMxD)
  pixels_t = torch.from_numpy(arrays['pixel_values'])
  grid_t = torch.from_numpy(arrays['image_grid_thw']).long()
  ids_t = torch.from_numpy(arrays['input_ids']).long()
  extra_t = dict(pixel_values=pixels_t, image_grid_thw=grid_t,
                 mm_token_type_ids=(ids_t == c.image_token_id).int())
  images = (arrays['pixel_values'], arrays['image_grid_thw'])

  sides = {
      'tower': (lambda: jax.block_until_ready(tower(state, packed)),
                lambda: theirs.model.visual(pixels_t, grid_thw=grid_t)),
      'prefill': (lambda: sampler.generate(model, [prompt], 1,
                                           temperature=0.0, images=images),
                  lambda: theirs(input_ids=ids_t, **extra_t)),
      'decode': (lambda: sampler.generate(
          model, [prompt], args.new_tokens, temperature=0.0, images=images),
                 lambda: theirs.generate(
                     input_ids=ids_t, **extra_t, do_sample=False,
                     max_new_tokens=args.new_tokens,
                     min_new_tokens=args.new_tokens)),
  }
  ratios, medians = {}, {}
  with torch.no_grad():
    for name, (ours, torch_fn) in sides.items():
      ours(), torch_fn()  # warm-up and compile
      times = {'ours': [], 'torch': []}
      for _ in range(args.rounds):
        times['ours'].append(timed(ours))
        times['torch'].append(timed(torch_fn))
      med = medians[name] = {k: statistics.median(v) for k, v in times.items()}
      ratios[name] = med['torch'] / med['ours']
      rate = ''
      if name == 'tower':
        rate = (f', {patches / med["ours"]:.0f} / {patches / med["torch"]:.0f}'
                ' patches/s')
      if name == 'decode':
        per_s = {k: args.new_tokens / max(med[k] - medians['prefill'][k], 1e-9)
                 for k in med}
        rate = f', decode {per_s["ours"]:.0f} / {per_s["torch"]:.0f} tokens/s'
      print(f'{name:8s} ours {med["ours"]:.3f} s, torch {med["torch"]:.3f} s'
            f'{rate}, ratio {ratios[name]:.2f}')
  print(' '.join(f'ratio_{k}={v:.3f}' for k, v in ratios.items()))


if __name__ == '__main__':
  main()
