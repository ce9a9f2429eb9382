#!/usr/bin/env bash
# Runs one RLAnything job on every host of a Cloud TPU pod slice.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a CONFIG=configs/alfworld.py \
#   WORKDIR=/mnt/shared/runs/alfworld bash launch/tpu_pod.sh [--config.x=y ...]
#
# Every host runs the same program (JAX multi-controller SPMD);
# jax.distributed.initialize() discovers the slice by itself. WORKDIR must be
# a path all hosts share (NFS/GCSFuse) for checkpoints and the task pool.
# The repo must already be checked out at REPO_DIR on every host.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}"
: "${WORKDIR:?set WORKDIR}"
REPO_DIR=${REPO_DIR:-\$HOME/rla_jax}
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all \
  --command "cd $REPO_DIR && bash launch/setup.sh && \
    .venv/bin/python -m rla_jax.main --distributed \
      --config=$CONFIG --workdir=$WORKDIR $ARGS"
