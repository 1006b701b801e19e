"""Every public docstring's ``>>>`` example runs and prints what it says."""
import doctest
import importlib

import pytest

MODULES = ["sampling", "chain", "tree", "tree_attention", "kv_cache",
           "adapters.vllm", "adapters.flashinfer", "adapters.sglang"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"specdec_kernels.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
