"""The swap for FlashInfer's own tests (copied beside them by engine_tests/flashinfer/run.py).

``import flashinfer`` / ``flashinfer.sampling.chain_speculative_sampling`` resolve to
``specdec_kernels.adapters.flashinfer.chain_speculative_sampling``: the engine's test files
run unmodified. Only that kernel is swapped; any other ``flashinfer.sampling`` function is an
AttributeError (run.py selects the tests of ``chain_speculative_sampling``). Without CUDA,
their ``device="cuda:0"`` literals map to the CPU (engine_tests/device_shim.py).
"""
import sys
import types

from engine_tests import device_shim
from specdec_kernels.adapters import flashinfer as adapter

CPU_SHIM = device_shim.install()


def _only_swapped(name):
    raise AttributeError(f"flashinfer.sampling.{name}: not swapped (specdec_kernels replaces "
                         f"chain_speculative_sampling only)")


sampling = types.ModuleType("flashinfer.sampling")
sampling.chain_speculative_sampling = adapter.chain_speculative_sampling
sampling.__getattr__ = _only_swapped
flashinfer = types.ModuleType("flashinfer")
flashinfer.sampling = sampling
flashinfer.chain_speculative_sampling = adapter.chain_speculative_sampling
flashinfer.__version__ = "0.7.4 (specdec_kernels adapter)"
sys.modules["flashinfer"] = flashinfer
sys.modules["flashinfer.sampling"] = sampling


def pytest_report_header(config):
    return [f"flashinfer -> specdec_kernels.adapters.flashinfer ({adapter.ENGINE_VERSION}); "
            f"device shim {'on (no CUDA): cuda literals -> cpu' if CPU_SHIM else 'off'}"]
