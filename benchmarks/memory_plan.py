"""Compiled memory per device of the 7-8B train steps and sampler, paper meshes.

Builds the policy train step, the reward-model train step and the sampler of
each model on abstract arrays (no weights are made), compiles them for a
simulated mesh (`--xla_force_host_platform_device_count`, set here before jax
is imported) and prints `compiled.memory_analysis()` per device against the
device's HBM, with the mesh and the logical-axis rules used. bf16 compute,
float32 master weights and AdamW moments; one sequence per device per
micro-batch, as the authors train.

A row's total is what one device holds while that program runs: the
program's arguments, outputs (less those aliased to donated arguments) and
temporaries, plus the arrays that stay resident meanwhile (the other model's
TrainState; while sampling, the sampled model's AdamW moments too). The
target is 15% headroom.

Caveat: XLA:CPU compiles these programs, not XLA:TPU / XLA:GPU. Argument,
output and resident bytes are exact (they follow from shapes and shardings);
temporaries are the CPU compiler's buffer assignment, a proxy for the
accelerator's: XLA:CPU runs bf16 dots in f32 (larger temporaries), fuses
differently, and 'auto' attention compiles as 'chunked' here (cuDNN / splash
keep less).

  .venv/bin/python benchmarks/memory_plan.py  # all rows (~15 min, 2 cores)
  .venv/bin/python benchmarks/memory_plan.py --models=qwen3-8b \\
      --meshes=8xh200 --settings=osworld
  .venv/bin/python benchmarks/memory_plan.py --tiny  # seconds (tests)

Qwen3-VL-8B (pair `qwen3-vl-8b`, OSWorld only): each training sequence
holds IMAGES screenshots (the agent's 3-image history, 1920x1080 each at
Qwen3-VL's default settings: 8,160 patches, 2,040 image tokens); the train
steps and the sampler run the vision tower on them in the program.

  .venv/bin/python benchmarks/memory_plan.py --pairs=qwen3-vl-8b \
      --meshes=8xh200,v5p-64 --settings=osworld
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# name: (devices, HBM bytes per device, mesh sizes (data, fsdp, tensor)).
MESHES = {
    'v5p-64': (32, 95e9, (1, 32, 1)),  # 32 chips (64 TensorCores), 95 GB
    '8xh200': (8, 141e9, (1, 8, 1)),
    # The authors' OSWorld run: 12 nodes x 8 GPUs of 80 GB. FSDP within a
    # node, data parallel across nodes: 96-way FSDP would leave the 4,096-wide
    # embed dimension unsplit (4096 % 96 != 0), so the weights replicate.
    'paper-12x8': (96, 80e9, (12, 8, 1)),
    'tiny': (4, 2**30, (1, 2, 2)),
}
# name: (prompt tokens, response tokens) of one training sequence.
SETTINGS = {
    'osworld': (8192, 4096),
    'alfworld+coding': (2048, 2048),
    'tiny': (64, 32),
}
# name: transformer.ModelConfig fields (from the models' config.json).
MODELS = {
    'qwen2.5-7b': dict(model_type='qwen2', vocab_size=152064,
                       hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, rope_theta=1e6, qkv_bias=True),
    'qwen3-8b': dict(model_type='qwen3', vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rope_theta=1e6,
                     qk_norm=True),
    'qwen3-vl-8b': dict(model_type='qwen3_vl', vocab_size=151936,
                        hidden_size=4096, intermediate_size=12288,
                        num_layers=36, num_heads=32, num_kv_heads=8,
                        head_dim=128, rope_theta=5e6, qk_norm=True,
                        mrope_section=(24, 20, 20), vision='qwen3-vl'),
    'qwen2.5-14b': dict(model_type='qwen2', vocab_size=152064,
                        hidden_size=5120, intermediate_size=13824,
                        num_layers=48, num_heads=40, num_kv_heads=8,
                        head_dim=128, rope_theta=1e6, qkv_bias=True),
    'tiny': dict(model_type='qwen2', vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, qkv_bias=True,
                 tie_word_embeddings=True),
}
VISION = {  # vision_config of Qwen3-VL-8B-Instruct/-Thinking
    'qwen3-vl': dict(depth=27, hidden_size=1152, intermediate_size=4304,
                     num_heads=16, out_hidden_size=4096, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2,
                     num_position_embeddings=2304,
                     deepstack_indexes=(8, 16, 24)),
}
# setting: (images per sequence, patches per image) for vision models.
IMAGES = {'osworld': (3, 68 * 120)}
# (policy, reward model) trained together.
PAIRS = {
    'qwen2.5-7b': ('qwen2.5-7b', 'qwen2.5-7b'),
    'qwen3-8b': ('qwen3-8b', 'qwen3-8b'),
    'qwen2.5-7b+14b-rm': ('qwen2.5-7b', 'qwen2.5-14b'),
    'qwen3-vl-8b': ('qwen3-vl-8b', 'qwen3-vl-8b'),
    'tiny': ('tiny', 'tiny'),
}
HEADROOM = 0.15


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--pairs', default='qwen2.5-7b,qwen3-8b,'
                      'qwen2.5-7b+14b-rm')
  parser.add_argument('--meshes', default='v5p-64,8xh200')
  parser.add_argument('--settings', default='osworld,alfworld+coding')
  parser.add_argument('--remat', default='full',
                      help='train.remat of both train steps')
  parser.add_argument('--sample_rows', type=int, default=8,
                      help='sampler rows per device')
  parser.add_argument('--head_chunk', type=int, default=512)
  parser.add_argument('--tiny', action='store_true',
                      help='the tiny pair, mesh and setting (for tests)')
  args = parser.parse_args(argv)
  if args.tiny:
    args.pairs, args.meshes, args.settings = 'tiny', 'tiny', 'tiny'
  for key, table in (('pairs', PAIRS), ('meshes', MESHES),
                     ('settings', SETTINGS)):
    names = getattr(args, key).split(',')
    unknown = [n for n in names if n not in table]
    if unknown:
      parser.error(f'--{key}: unknown {unknown}; known: {sorted(table)}')
    setattr(args, key, names)
  return args


_UNIT = [2**30]  # GiB; MiB for the tiny mesh


def _gib(n: float) -> str:
  return f'{n / _UNIT[0]:7.2f}'


class Planner:
  """Compiles each (model, program, mesh, setting) once; reports per device."""

  def __init__(self, args):
    import jax  # pylint: disable=g-import-not-at-top
    from rla_jax import sharding  # pylint: disable=g-import-not-at-top
    self.args, self.jax, self.sharding = args, jax, sharding
    self.rules = sharding.DEFAULT_RULES
    self._cache = {}

  def mesh(self, name):
    devices, _, (data, fsdp, tensor) = MESHES[name]
    return self.sharding.make_mesh(data, fsdp, tensor,
                                   self.jax.devices()[:devices])

  def model_config(self, name):
    from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
    from rla_jax.models import vision  # pylint: disable=g-import-not-at-top
    fields = dict(MODELS[name])
    if 'vision' in fields:
      fields['vision'] = vision.VisionConfig(**VISION[fields['vision']])
    return transformer.ModelConfig(
        **fields, dtype='bfloat16', param_dtype='float32',
        attention='auto', scan_layers=True)

  def image_patches(self, model, setting) -> int:
    """Patches of the images of one sequence (0: a text model)."""
    if 'vision' not in MODELS[model]:
      return 0
    if setting not in IMAGES:
      raise ValueError(f'{model} has images only in settings {list(IMAGES)}')
    per_sequence, patches = IMAGES[setting]
    return per_sequence * patches

  def batch_ways(self, mesh) -> int:
    spec = self.sharding.spec(('batch',), None, mesh, self.rules)[0] or ()
    axes = (spec,) if isinstance(spec, str) else spec
    return max(1, math.prod(mesh.shape[a] for a in axes))

  def trainer(self, model, mesh_name, setting):
    import ml_collections  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from rla_jax import train  # pylint: disable=g-import-not-at-top
    from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
    prompt, response = SETTINGS[setting]
    mesh = self.mesh(mesh_name)
    micro = self.batch_ways(mesh)  # one sequence per device
    optim = ml_collections.ConfigDict(dict(
        learning_rate=1e-6, schedule='constant', warmup_steps=0,
        decay_steps=0, min_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0, reset_every_epoch=False,
        mu_dtype='float32'))
    train_config = ml_collections.ConfigDict(dict(
        micro_batch_size=micro, updates_per_epoch=1, global_batch_size=0,
        max_prompt_len=prompt, max_response_len=response,
        overlong_prompt='truncate', prompt_buckets=(prompt,),
        response_buckets=(response,), clip_eps=0.2, kl_coef=0.01,
        entropy_coef=0.0, log_ratio_clamp=10.0, aggregation='sequence',
        compute_entropy=True, head_chunk=self.args.head_chunk,
        remat=self.args.remat, shuffle=False, seed=0,
        grad_accum_dtype='float32', share_prompts=1))
    abstract = transformer.abstract_model(self.model_config(model))
    graphdef, state = nnx.split(abstract)
    trainer = train.Trainer(graphdef, optim, train_config, mesh, self.rules)
    return trainer, nnx.to_pure_dict(state), mesh, micro

  def _abstract_state(self, trainer, params):
    return self.jax.eval_shape(trainer._init, params)  # pylint: disable=protected-access

  def state_bytes(self, model, mesh_name, setting, moments_only=False):
    """Per-device bytes of a TrainState (or of its optimizer state alone)."""
    key = ('state', model, mesh_name, moments_only)
    if key not in self._cache:
      trainer, params, _, _ = self.trainer(model, mesh_name, setting)
      state = self._abstract_state(trainer, params)
      shardings = trainer._init.lower(params).compile().output_shardings  # pylint: disable=protected-access
      if moments_only:
        state, shardings = state.opt_state, shardings.opt_state
      self._cache[key] = sum(
          math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
          for leaf, sh in zip(self.jax.tree.leaves(state),
                              self.jax.tree.leaves(shardings)))
    return self._cache[key]

  def compiled(self, kind, model, mesh_name, setting):
    key = (kind, model, mesh_name, setting)
    if key not in self._cache:
      start = time.perf_counter()
      lowered = (self._lower_step if kind == 'train' else
                 self._lower_sampler)(model, mesh_name, setting)
      stats = lowered.compile().memory_analysis()
      program = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes + stats.temp_size_in_bytes
                 + stats.generated_code_size_in_bytes)
      self._cache[key] = dict(
          args=stats.argument_size_in_bytes, out=stats.output_size_in_bytes,
          alias=stats.alias_size_in_bytes, temp=stats.temp_size_in_bytes,
          program=program, seconds=time.perf_counter() - start)
    return self._cache[key]

  def _lower_step(self, model, mesh_name, setting):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from rla_jax import batching  # pylint: disable=g-import-not-at-top
    trainer, params, mesh, micro = self.trainer(model, mesh_name, setting)
    prompt, response = SETTINGS[setting]
    t = prompt + response
    sds = self.jax.ShapeDtypeStruct
    batch = batching.Batch(
        tokens_MxBxT=sds((1, micro, t), jnp.int32),
        mask_MxBxT=sds((1, micro, t), jnp.int32),
        response_mask_MxBxR=sds((1, micro, response), jnp.float32),
        advantages_MxB=sds((1, micro), jnp.float32),
        old_logp_MxBxR=sds((1, micro, response), jnp.float32),
        ref_logp_MxBxR=sds((1, micro, response), jnp.float32))
    patches = self.image_patches(model, setting)
    if patches:
      from rla_jax.models import vision  # pylint: disable=g-import-not-at-top
      config = self.model_config(model).vision
      batch = batch.replace(
          positions_MxBxTx3=sds((1, micro, t, 3), jnp.int32),
          patches=vision.abstract_patches(
              config, vision.bucket_length(config, patches),
              lead=(1, micro)))
    state = self._abstract_state(trainer, params)
    with self.sharding.use(mesh, self.rules):
      return trainer._step.lower(state, batch)  # pylint: disable=protected-access

  def _lower_sampler(self, model, mesh_name, setting):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from rla_jax import sampler  # pylint: disable=g-import-not-at-top
    from rla_jax import sampling  # pylint: disable=g-import-not-at-top
    from rla_jax.models import transformer  # pylint: disable=g-import-not-at-top
    prompt, response = SETTINGS[setting]
    mesh = self.mesh(mesh_name)
    graphdef, state = nnx.split(transformer.abstract_model(
        self.model_config(model)))
    shardings = self.sharding.param_shardings(state, mesh, self.rules)
    params = self.jax.tree.map(
        lambda a, s: self.jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(state), shardings)
    rows = self.args.sample_rows * self.batch_ways(mesh)
    return sampler.lower(graphdef, params, rows, prompt, response,
                         params_sampling=sampling.Params(0.8, 0.95),
                         stop_token_ids=(0,), mesh=mesh, rules=self.rules,
                         vision_config=self.model_config(model).vision,
                         image_patches=self.image_patches(model, setting))


def check_batch_field_names():
  """The memory plan builds Batch directly; fail loudly if it changes."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from rla_jax import batching  # pylint: disable=g-import-not-at-top
  names = {f.name for f in dataclasses.fields(batching.Batch)}
  expected = {'tokens_MxBxT', 'mask_MxBxT', 'response_mask_MxBxR',
              'advantages_MxB', 'old_logp_MxBxR', 'ref_logp_MxBxR',
              'positions_MxBxTx3', 'patches'}
  if not expected <= names or len(names - expected) > 0:
    raise RuntimeError(f'batching.Batch fields changed: {sorted(names)}')


def main(argv=None):
  args = parse_args(argv)
  devices = max(MESHES[m][0] for m in args.meshes)
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count='
                             f'{devices}')
  os.environ['JAX_PLATFORMS'] = 'cpu'
  sys.path.insert(0, os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  check_batch_field_names()
  planner = Planner(args)
  print(f'rules: {dict(planner.rules)}')
  print(f'train.remat={args.remat}, attention=auto (compiled as chunked on '
        f'CPU), scan_layers=True, sampler rows per device '
        f'{args.sample_rows}, head_chunk {args.head_chunk}')
  header = (f'{"pair":18s} {"mesh":7s} {"setting":16s} {"program":16s} '
            f'{"args":>7s} {"out":>7s} {"alias":>7s} {"temp":>7s} '
            f'{"resident":>8s} {"total":>7s} {"HBM":>7s} {"free":>6s}')
  worst = 1.0
  for mesh_name in args.meshes:
    _, hbm, sizes = MESHES[mesh_name]
    _UNIT[0] = 2**20 if hbm < 2**32 else 2**30
    print(f'\nmesh {mesh_name}: {dict(zip(("data", "fsdp", "tensor"), sizes))}'
          f', HBM {hbm / 2**30:.1f} GiB per device '
          f'({"MiB" if _UNIT[0] == 2**20 else "GiB"} below)')
    print(header)
    for setting in args.settings:
      for pair in args.pairs:
        policy, rm = PAIRS[pair]
        state = {m: planner.state_bytes(m, mesh_name, setting)
                 for m in {policy, rm}}
        moments = {m: planner.state_bytes(m, mesh_name, setting, True)
                   for m in {policy, rm}}
        programs = [
            ('policy step', 'train', policy, state[rm]),
            ('rm step', 'train', rm, state[policy]),
            ('policy sampler', 'sample', policy, moments[policy] + state[rm]),
            ('rm sampler', 'sample', rm, moments[rm] + state[policy]),
        ]
        for label, kind, model, resident in programs:
          c = planner.compiled(kind, model, mesh_name, setting)
          total = c['program'] + resident
          free = 1 - total / hbm
          worst = min(worst, free)
          flag = '' if free >= HEADROOM else '  < 15% headroom'
          print(f'{pair:18s} {mesh_name:7s} {setting:16s} {label:16s} '
                f'{_gib(c["args"])} {_gib(c["out"])} {_gib(c["alias"])} '
                f'{_gib(c["temp"])} {_gib(resident):>8s} {_gib(total)} '
                f'{_gib(hbm)} {free:6.1%}{flag}  ({model}, compiled in '
                f'{c["seconds"]:.0f} s)', flush=True)
  print(f'\nworst_headroom={worst:.3f}')
  return worst


if __name__ == '__main__':
  main()
