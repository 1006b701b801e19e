"""``make engine-tests-sglang``: sgl-kernel's tests of ``tree_speculative_sampling_target_only``
and ``verify_tree_greedy`` against ``specdec_kernels.adapters.sglang`` (see
engine_tests/released_tests.py).

Searched: the sgl-kernel 0.3.21 and sglang 0.5.23 wheels from the package index (neither
has an sdist there for these versions), and ``SGL_KERNEL_TESTS`` (e.g.
``SGL_KERNEL_TESTS=~/sglang/sgl-kernel/tests/speculative``).
"""
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from engine_tests import released_tests  # noqa: E402

NOTES = [
    "note: sgl-kernel has no sdist on the package index (pip: 'from versions: none' with "
    "--no-binary) and sglang's newest sdist is 0.5.10.post1; the 0.3.21 / 0.5.23 wheels ship "
    "no tests of these kernels",
]

if __name__ == "__main__":
    sys.exit(released_tests.main(
        "sglang", ["sgl-kernel==0.3.21", "sglang==0.5.23"],
        ["tree_speculative_sampling_target_only", "verify_tree_greedy"],
        "SGL_KERNEL_TESTS", [], NOTES))
