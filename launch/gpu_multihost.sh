#!/usr/bin/env bash
# Runs one RLAnything job across several GPU hosts (one process per host,
# all local GPUs in that process). Start it on every host, e.g. from SLURM:
#
#   srun --nodes=4 --ntasks-per-node=1 bash launch/gpu_multihost.sh \
#     --config=configs/coding.py --workdir=/shared/runs/coding
#
# or by hand on each host with COORDINATOR=host0:1234 NUM_HOSTS=4 HOST_ID=i.
# WORKDIR must be shared by all hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${SLURM_PROCID:-}" ]; then
  HOST_ID=${HOST_ID:-$SLURM_PROCID}
  NUM_HOSTS=${NUM_HOSTS:-$SLURM_NTASKS}
  FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  COORDINATOR=${COORDINATOR:-$FIRST:12345}
fi
: "${COORDINATOR:?set COORDINATOR=host:port}" "${NUM_HOSTS:?set NUM_HOSTS}"
: "${HOST_ID:?set HOST_ID}"
export JAX_COORDINATOR_ADDRESS=$COORDINATOR
export JAX_NUM_PROCESSES=$NUM_HOSTS
export JAX_PROCESS_ID=$HOST_ID
# Let XLA take most of the GPU memory once, instead of growing it piecemeal.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
exec .venv/bin/python -m rla_jax.main --distributed "$@"
