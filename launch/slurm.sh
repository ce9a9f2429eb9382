#!/usr/bin/env bash
#SBATCH --job-name=rla_jax
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# A multi-node GPU job under SLURM: one process per node with all its GPUs.
#
#   sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sh \
#     --config=configs/coding.py --workdir=/shared/runs/coding [--config.x=y]
#
# Process 0 runs on the first node of the allocation and coordinates
# (PORT, default 12345). Set up the shared checkout once with
# `bash launch/setup.sh cuda` (the CUDA build of JAX at the locked version).
# The workdir must be on a filesystem all nodes share. `scancel` sends
# SIGTERM: the job stops at the next stage boundary with a checkpoint, and
# the same sbatch command resumes it. Outside SLURM, start
# `python -m rla_jax.main --coordinator=HOST0:PORT --num_processes=N
# --process_id=I ...` on every host by hand.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
: "${SLURM_JOB_NODELIST:?run this with sbatch (or inside salloc)}"
FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export RLA_COORDINATOR="$FIRST:${PORT:-12345}"
# Let XLA take most of the GPU memory once, instead of growing it piecemeal.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
  'exec .venv/bin/python -u -m rla_jax.main --coordinator="$RLA_COORDINATOR" \
     --num_processes="$SLURM_NTASKS" --process_id="$SLURM_PROCID" "$@"' \
  rla_jax "$@"
