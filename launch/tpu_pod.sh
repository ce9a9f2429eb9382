#!/usr/bin/env bash
# One RLAnything job on every worker of a Cloud TPU VM slice.
#
#   TPU_NAME=rla-v5p-64 ZONE=us-east5-a ACCELERATOR_TYPE=v5p-64 \
#   CONFIG=configs/alfworld.py WORKDIR=/mnt/shared/runs/alfworld \
#     bash launch/tpu_pod.sh [--config.x=y ...]
#
# Creates the slice if it does not exist (optional: PROJECT, default gcloud's
# own; RUNTIME_VERSION, default v2-alpha-tpuv5; SPOT=1 for a spot slice),
# copies this checkout to REPO_DIR on every worker (default ~/rla_jax),
# installs it with the TPU build of JAX (`launch/setup.sh tpu`), starts the
# same command on all workers (JAX finds the slice by itself) and streams
# worker 0's log; Ctrl-C stops the streaming, not the job. WORKDIR must be a
# folder every worker shares (Filestore/NFS or a gcsfuse mount): it holds the
# checkpoints, the task pool, TensorBoard logs and the run lock. To stop the
# job cleanly, send it SIGTERM (STOP=1 bash launch/tpu_pod.sh).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
cd "$(dirname "$0")/.."
REPO_DIR=${REPO_DIR:-'~/rla_jax'}
LOG=/tmp/rla_jax_$TPU_NAME.log
tpu() {
  gcloud compute tpus tpu-vm "$@" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"}
}
if [ -n "${STOP:-}" ]; then
  tpu ssh "$TPU_NAME" --worker=all \
    --command "pkill -TERM -f 'rla_jax.main' || true"
  exit 0
fi
: "${CONFIG:?set CONFIG}" "${WORKDIR:?set WORKDIR}"
if ! tpu describe "$TPU_NAME" >/dev/null 2>&1; then
  : "${ACCELERATOR_TYPE:?the slice does not exist: set ACCELERATOR_TYPE}"
  tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
    --version="${RUNTIME_VERSION:-v2-alpha-tpuv5}" ${SPOT:+--spot}
fi
# The tracked files of this checkout as they are now (uncommitted edits too).
tarball=$(mktemp -t rla_jax.XXXXXX.tar.gz)
trap 'rm -f "$tarball"' EXIT
git ls-files -z | tar -czf "$tarball" --null -T -
tpu scp "$tarball" "$TPU_NAME:/tmp/rla_jax.tar.gz" --worker=all
tpu ssh "$TPU_NAME" --worker=all --command \
  "mkdir -p $REPO_DIR && tar -xzf /tmp/rla_jax.tar.gz -C $REPO_DIR && \
   cd $REPO_DIR && bash launch/setup.sh tpu"
ARGS=$(printf ' %q' "$@")
tpu ssh "$TPU_NAME" --worker=all --command \
  "cd $REPO_DIR && nohup .venv/bin/python -u -m rla_jax.main --distributed \
     --config=$CONFIG --workdir=$WORKDIR $ARGS > $LOG 2>&1 < /dev/null &"
exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" \
  ${PROJECT:+--project="$PROJECT"} --worker=0 --command "tail -n +1 -F $LOG"
