"""``make engine-tests-flashinfer``: FlashInfer's tests of ``chain_speculative_sampling``
against ``specdec_kernels.adapters.flashinfer`` (see engine_tests/released_tests.py).

Searched: the flashinfer-python 0.7.4 wheel from the package index, and ``FLASHINFER_TESTS``
(e.g. ``FLASHINFER_TESTS=~/flashinfer/tests/utils/test_sampling.py``). Selected: the tests
named ``*chain_speculative_sampling*``; without CUDA also without their largest cases
(vocab 128256, batch 989: 4 GB inputs each, minutes per case on two CPU cores).
"""
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from engine_tests import released_tests  # noqa: E402

NOTES = [
    "note: the flashinfer-python 0.7.4 sdist (inspected by hand, 2026-12-01) holds tests/ with "
    "10 files, none about sampling; pip cannot fetch it without building it (its build "
    "backend needs the CUDA toolchain), so run.py searches the wheel only",
]

if __name__ == "__main__":
    selection = "chain_speculative_sampling"
    if not torch.cuda.is_available():
        selection += " and not 128256 and not 989"
    sys.exit(released_tests.main(
        "flashinfer", ["flashinfer-python==0.7.4"], ["chain_speculative_sampling"],
        "FLASHINFER_TESTS", ["-k", selection], NOTES))
