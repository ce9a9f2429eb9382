#!/usr/bin/env bash
# A multi-process run on this one machine (what the multi-host test runs):
#
#   bash launch/local.sh NUM_PROCESSES CONFIG WORKDIR [--config.x=y ...]
#
# Starts NUM_PROCESSES JAX processes on 127.0.0.1, each with
# DEVICES_PER_PROCESS (default 4) simulated CPU devices, joined by
# jax.distributed (gloo collectives) into one global mesh. Process 0's
# output streams here; every process logs to WORKDIR/logs/process_<i>.log
# and, when it finishes, writes WORKDIR/process_<i>.json (its pool digest
# and parameter checksums). If one process fails or dies, the others are
# stopped and the exit status is non-zero; the same command resumes. Ctrl-C
# stops every process cleanly with a checkpoint.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 NUM_PROCESSES CONFIG WORKDIR [--config.x=y ...]" >&2
  exit 2
fi
N=$1 CONFIG=$2 WORKDIR=$3
shift 3
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DEVICES=${DEVICES_PER_PROCESS:-4}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket();
s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p "$WORKDIR/logs"
pids=()
for ((i = 0; i < N; i++)); do : > "$WORKDIR/logs/process_$i.log"; done
# A user's Ctrl-C / SIGTERM goes to every process: they stop together at
# the next stage boundary with a checkpoint.
forward() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap forward INT TERM
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES" \
  JAX_PLATFORMS=cpu \
    "$PYTHON" -u -m rla_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
      --coordinator="127.0.0.1:$PORT" --num_processes="$N" \
      --process_id="$i" --heartbeat_timeout_s="${HEARTBEAT_S:-20}" "$@" \
      > "$WORKDIR/logs/process_$i.log" 2>&1 &
  pids+=($!)
done
tail -n +1 -f "$WORKDIR/logs/process_0.log" &
tailer=$!
status=0
remaining=("${pids[@]}")
while [ "${#remaining[@]}" -gt 0 ]; do
  still=()
  for pid in "${remaining[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
    elif ! wait "$pid"; then
      # A failed or dead process: the rest cannot finish their collectives
      # (JAX would end them after the heartbeat timeout); end them now.
      status=1
      kill -KILL "${pids[@]}" 2>/dev/null || true
    fi
  done
  remaining=("${still[@]+"${still[@]}"}")
  sleep 0.5
done
kill "$tailer" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
  echo "local.sh: a process failed; see $WORKDIR/logs/process_*.log" >&2
fi
exit "$status"
