import importlib

import pytest


def _triton_param(module: str):
    """The Triton backend runs on CPU tensors under TRITON_INTERPRET=1 (set by the Makefile)."""
    try:
        importlib.import_module(module)
        return pytest.param("triton")
    except ImportError as err:  # surfaced as a skip reason, never silently
        return pytest.param("triton", marks=pytest.mark.skip(reason=f"{module}: {err}"))


CHAIN_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.chain")]
SAMPLE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.sampling")]
