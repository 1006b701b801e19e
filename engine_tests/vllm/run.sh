#!/usr/bin/env bash
# `make engine-tests-vllm`: vLLM 0.33.0's own rejection-sampler tests against our adapter.
# Downloads at run time (nothing of vLLM is committed): the wheel (its Python sources) and the
# sdist's tests/, into build/engine-tests/vllm (git-ignored), with a venv that sees the
# project's torch/triton (.pth to its site-packages) plus vLLM's small import-chain wheels.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=${VLLM_VERSION:-0.33.0}
WORK=$ROOT/build/engine-tests/vllm
VENV=$WORK/venv
PY=$VENV/bin/python
mkdir -p "$WORK"

if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
    SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/_project_venv.pth"
fi
if ! "$PY" -m pip show vllm 2>/dev/null | grep -q "^Version: $VERSION\$"; then
    "$PY" -m pip download -q --no-deps "vllm==$VERSION" -d "$WORK/download"
    "$PY" -m pip install -q --no-deps "$WORK"/download/vllm-"$VERSION"-*.whl
fi
"$PY" -m pip install -q --no-deps -r "$ROOT/engine_tests/vllm/requirements.txt"

# The sdist's tests/: building its metadata fails (CUDA build deps), but --no-clean leaves
# the unpacked sdist in pip's temporary folder.
if [ ! -f "$WORK/src/tests/v1/sample/test_rejection_sampler.py" ]; then
    rm -rf "$WORK/tmp" && mkdir -p "$WORK/tmp"
    TMPDIR=$WORK/tmp "$PY" -m pip download -q --no-deps --no-binary :all: --no-clean \
        "vllm==$VERSION" -d "$WORK/tmp/sdist" >/dev/null 2>&1 || true
    UNPACKED=$(find "$WORK/tmp" -maxdepth 3 -type f -name PKG-INFO -path '*vllm_*' -printf '%h\n' | head -1)
    [ -n "$UNPACKED" ] || { echo "could not unpack the vllm==$VERSION sdist" >&2; exit 1; }
    rm -rf "$WORK/src" && mkdir -p "$WORK/src" && cp -r "$UNPACKED/tests" "$WORK/src/tests"
    rm -rf "$WORK/tmp"
fi

export TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES=
export PYTHONPATH=$ROOT:$WORK/src
cd "$WORK/src"
echo "== vLLM $VERSION tests/v1/sample/test_rejection_sampler.py, our RejectionSampler swapped in"
"$PY" -m pytest -p engine_tests.vllm.swap --noconftest -q -p no:cacheprovider \
    tests/v1/sample/test_rejection_sampler.py "$@"
echo "== vLLM's runner construction, forward with vLLM's own Sampler, and MRV2 against vLLM's"
"$PY" "$ROOT/engine_tests/vllm/check_vllm.py"
