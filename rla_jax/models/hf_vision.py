"""Qwen3-VL folders: the vision config, the tower's tensor names, the processor.

`hf.py` reads and writes the decoder; this module adds what a Qwen3-VL
checkpoint has beyond it. The processor is ours because transformers'
Qwen3VLProcessor needs torchvision (for its video half) even for images; it
uses transformers' own image processor for the pixels and expands the image
placeholder exactly as Qwen3VLProcessor does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from rla_jax.models import vision
from rla_jax.models.vision import VisionConfig

IMAGE_PLACEHOLDER = '<|image_pad|>'
# How Qwen3-VL's chat template writes an image part of a message.
IMAGE_TEXT = f'<|vision_start|>{IMAGE_PLACEHOLDER}<|vision_end|>'
_TOKEN_KEYS = ('image_token_id', 'video_token_id', 'vision_start_token_id',
               'vision_end_token_id')


def config_from_hf(hf: dict[str, Any], where: str) -> VisionConfig:
  v = hf.get('vision_config')
  if not isinstance(v, dict):
    raise ValueError(f'{where}: qwen3_vl config has no "vision_config"')
  act = v.get('hidden_act', 'gelu_pytorch_tanh')
  if act != 'gelu_pytorch_tanh':
    raise ValueError(f'{where}: vision_config.hidden_act {act!r} is not '
                     'supported (only gelu_pytorch_tanh)')
  rope = v.get('rope_parameters') or {}
  missing = [k for k in ('depth', 'hidden_size', 'intermediate_size',
                         'num_heads', 'out_hidden_size') if k not in v]
  if missing:
    raise ValueError(f'{where}: vision_config lacks {missing}')
  defaults = VisionConfig(depth=1, hidden_size=4, intermediate_size=1,
                          num_heads=1, out_hidden_size=1)
  return VisionConfig(
      depth=v['depth'], hidden_size=v['hidden_size'],
      intermediate_size=v['intermediate_size'], num_heads=v['num_heads'],
      out_hidden_size=v['out_hidden_size'],
      patch_size=v.get('patch_size', defaults.patch_size),
      temporal_patch_size=v.get('temporal_patch_size',
                                defaults.temporal_patch_size),
      in_channels=v.get('in_channels', defaults.in_channels),
      spatial_merge_size=v.get('spatial_merge_size',
                               defaults.spatial_merge_size),
      num_position_embeddings=v.get('num_position_embeddings',
                                    defaults.num_position_embeddings),
      deepstack_indexes=tuple(v.get('deepstack_visual_indexes', ())),
      rope_theta=float(rope.get('rope_theta', defaults.rope_theta)),
      **{k: int(hf.get(k, getattr(defaults, k))) for k in _TOKEN_KEYS})


def config_to_hf(c: VisionConfig) -> tuple[dict[str, Any], dict[str, int]]:
  """(vision_config, the top-level token ids) for Qwen3VLConfig."""
  return dict(
      depth=c.depth, hidden_size=c.hidden_size,
      intermediate_size=c.intermediate_size, num_heads=c.num_heads,
      out_hidden_size=c.out_hidden_size, patch_size=c.patch_size,
      temporal_patch_size=c.temporal_patch_size, in_channels=c.in_channels,
      spatial_merge_size=c.spatial_merge_size,
      num_position_embeddings=c.num_position_embeddings,
      deepstack_visual_indexes=list(c.deepstack_indexes),
      hidden_act='gelu_pytorch_tanh',
      rope_parameters={'rope_type': 'axial', 'rope_theta': c.rope_theta},
  ), {k: getattr(c, k) for k in _TOKEN_KEYS}


def param_rows(c: VisionConfig, prefix: str = 'model.visual.',
               stacked: bool = False):
  """The tower's hf._param_table entries: (our path, HF names, to ours,
  to HF)."""
  e, h, dh = c.hidden_size, c.num_heads, c.head_dim
  ident = lambda a: a
  t = lambda a: a.T
  patch_shape = (e, c.in_channels, c.temporal_patch_size, c.patch_size,
                 c.patch_size)
  rows = [
      (('patch_w',), 'patch_embed.proj.weight',
       lambda a: a.reshape(e, -1).T, lambda a: a.T.reshape(patch_shape)),
      (('patch_b',), 'patch_embed.proj.bias', ident, ident),
      (('pos_embed',), 'pos_embed.weight', ident, ident),
  ]
  # Stacked blocks (`scan_layers`): one entry per parameter, one HF name per
  # block; otherwise one entry per block and parameter.
  for i in ([None] if stacked else range(c.depth)):
    p = lambda *path, i=i: ('blocks',) + (() if i is None else (i,)) + path
    n = lambda name, i=i: tuple(f'blocks.{j}.{name}' for j in (
        range(c.depth) if i is None else (i,)))
    rows += [
        (p('norm1', 'scale'), n('norm1.weight'), ident, ident),
        (p('norm1', 'bias'), n('norm1.bias'), ident, ident),
        (p('norm2', 'scale'), n('norm2.weight'), ident, ident),
        (p('norm2', 'bias'), n('norm2.bias'), ident, ident),
        (p('wqkv'), n('attn.qkv.weight'),  # [3E, E] -> [E, 3, H, Dh]
         lambda a: a.reshape(3, h, dh, e).transpose(3, 0, 1, 2),
         lambda a: a.transpose(1, 2, 3, 0).reshape(3 * e, e)),
        (p('bqkv'), n('attn.qkv.bias'), lambda a: a.reshape(3, h, dh),
         lambda a: a.reshape(3 * e)),
        (p('wo'), n('attn.proj.weight'),  # [E, H*Dh] -> [H, Dh, E]
         lambda a: a.reshape(e, h, dh).transpose(1, 2, 0),
         lambda a: a.transpose(2, 0, 1).reshape(e, h * dh)),
        (p('bo'), n('attn.proj.bias'), ident, ident),
        (p('w_fc1'), n('mlp.linear_fc1.weight'), t, t),
        (p('b_fc1'), n('mlp.linear_fc1.bias'), ident, ident),
        (p('w_fc2'), n('mlp.linear_fc2.weight'), t, t),
        (p('b_fc2'), n('mlp.linear_fc2.bias'), ident, ident),
    ]
  mergers = [(('merger',), 'merger')] + [
      (('deepstack', k), f'deepstack_merger_list.{k}')
      for k in range(len(c.deepstack_indexes))]
  for path, name in mergers:
    rows += [
        (path + ('norm', 'scale'), f'{name}.norm.weight', ident, ident),
        (path + ('norm', 'bias'), f'{name}.norm.bias', ident, ident),
        (path + ('w_fc1',), f'{name}.linear_fc1.weight', t, t),
        (path + ('b_fc1',), f'{name}.linear_fc1.bias', ident, ident),
        (path + ('w_fc2',), f'{name}.linear_fc2.weight', t, t),
        (path + ('b_fc2',), f'{name}.linear_fc2.bias', ident, ident),
    ]
  names = lambda n: tuple(prefix + x for x in ((n,) if isinstance(n, str)
                                              else n))
  return [(('vision',) + path, names(name), a, b)
          for path, name, a, b in rows]


class Processor:
  """Text and images -> the arrays a Qwen3-VL model takes (numpy).

  `text` holds one IMAGE_PLACEHOLDER per image (in order, over all rows);
  each becomes as many image tokens as the image has merged patches.
  """

  def __init__(self, tokenizer, image_processor, config: VisionConfig):
    self.tokenizer = tokenizer
    self.image_processor = image_processor
    self.config = config
    merge = getattr(image_processor, 'merge_size', config.spatial_merge_size)
    patch = getattr(image_processor, 'patch_size', config.patch_size)
    if (merge, patch) != (config.spatial_merge_size, config.patch_size):
      raise ValueError(f'image processor merge/patch size {(merge, patch)} '
                       'differs from the model\'s '
                       f'{(config.spatial_merge_size, config.patch_size)}')

  def images(self, images: Sequence) -> dict[str, np.ndarray]:
    """pixel_values [N, P] float32 and image_grid_thw [n, 3] int32."""
    out = self.image_processor(images=list(images), return_tensors='np')
    return {'pixel_values': np.asarray(out['pixel_values'], np.float32),
            'image_grid_thw': np.asarray(out['image_grid_thw'], np.int32)}

  def expand(self, text: str, grids) -> str:
    """`text` with each placeholder repeated to its image's token count."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(grids):
      raise ValueError(f'text has {len(parts) - 1} image placeholders for '
                       f'{len(grids)} images')
    out = [parts[0]]
    for grid, part in zip(grids, parts[1:]):
      n = vision.tokens_per_image(self.config, tuple(int(v) for v in grid))
      out += [IMAGE_PLACEHOLDER * n, part]
    return ''.join(out)

  def encode(self, text: str, images: Sequence) -> tuple[list[int], Any]:
    """(token ids, structs.Images or None) of one prompt and its images."""
    from rla_jax import structs  # pylint: disable=g-import-not-at-top
    if not images:
      if IMAGE_PLACEHOLDER in text:
        raise ValueError('the text has image placeholders but no images')
      return self.tokenizer(text, add_special_tokens=False)['input_ids'], None
    arrays = self.images(images)
    text = self.expand(text, arrays['image_grid_thw'])
    ids = self.tokenizer(text, add_special_tokens=False)['input_ids']
    return ids, structs.Images(arrays['pixel_values'],
                               arrays['image_grid_thw'])

  def __call__(self, text: str | Sequence[str], images: Sequence = ()):
    rows = [text] if isinstance(text, str) else list(text)
    arrays = self.images(images) if len(images) else {}
    grids = list(arrays.get('image_grid_thw', ()))
    expanded = []
    for row in rows:
      n = row.count(IMAGE_PLACEHOLDER)
      expanded.append(self.expand(row, grids[:n]))
      grids = grids[n:]
    if grids:
      raise ValueError(f'{len(grids)} images have no placeholder in the text')
    enc = self.tokenizer(expanded, padding=True, return_tensors='np')
    return {'input_ids': np.asarray(enc['input_ids'], np.int32),
            'attention_mask': np.asarray(enc['attention_mask'], np.int32),
            **arrays}

  def save_pretrained(self, path: str):
    self.tokenizer.save_pretrained(path)
    self.image_processor.save_pretrained(path)


def load_processor(path: str, tokenizer, config: VisionConfig) -> Processor:
  """The folder's image processor (preprocessor_config.json) and tokenizer."""
  if not os.path.exists(os.path.join(path, 'preprocessor_config.json')):
    raise ValueError(f'{path}: a qwen3_vl folder needs '
                     'preprocessor_config.json (the image processor)')
  import transformers  # pylint: disable=g-import-not-at-top
  image_processor = transformers.AutoImageProcessor.from_pretrained(
      path, local_files_only=True)
  return Processor(tokenizer, image_processor, config)
