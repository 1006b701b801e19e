import importlib
import os

import pytest


def _triton_param(module: str):
    """The Triton backend on the CPU tensors of the API tests: only under TRITON_INTERPRET=1
    (set by the Makefile). On a GPU, test_triton_*.py run the kernels on CUDA tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return pytest.param("triton", marks=pytest.mark.skip(
            reason="CPU tensors need TRITON_INTERPRET=1 for the Triton backend"))
    try:
        importlib.import_module(module)
        return pytest.param("triton")
    except ImportError as err:  # surfaced as a skip reason, never silently
        return pytest.param("triton", marks=pytest.mark.skip(reason=f"{module}: {err}"))


CHAIN_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.chain")]
SAMPLE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.sampling")]
