#!/usr/bin/env bash
# `make engine-tests-vllm`: vLLM's own verification tests against our adapters, by release
# (VLLM_VERSIONS="0.33.0 0.34.0"; default the newest): see engine_tests/vllm/run.py.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
exec "$PYTHON" "$ROOT/engine_tests/vllm/run.py" "$@"
