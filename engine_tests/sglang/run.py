"""``make engine-tests-sglang``: sgl-kernel's tests of ``tree_speculative_sampling_target_only``
and ``verify_tree_greedy`` against ``specdec_kernels.adapters.sglang`` (see
engine_tests/released_tests.py).

Searched: the sglang-kernel 0.4.10 wheel (the kernel package's current name: ``sgl-kernel``
stopped at 0.3.21; the import name is still ``sgl_kernel``) and the sglang 0.5.23 wheel (its
speculative kernels now in ``sglang/kernels/ops/speculative``) from the package index (no
sdist there for these versions), and ``SGL_KERNEL_TESTS`` (e.g.
``SGL_KERNEL_TESTS=~/sglang/sgl-kernel/tests/speculative``).
"""
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from engine_tests import released_tests  # noqa: E402

NOTES = [
    "note: sglang-kernel (formerly sgl-kernel, which stopped at 0.3.21) has no sdist on the "
    "package index and sglang's newest sdist is 0.5.10.post1; the sglang-kernel 0.4.10 / "
    "sglang 0.5.23 wheels ship no tests of these kernels. Both keep sgl-kernel 0.3.21's "
    "signatures (sgl_kernel/speculative.py; sglang/kernels/ops/speculative/sampling.py and "
    "tree.py, which CUDA and ROCm now route through, JIT-compiled)",
]

if __name__ == "__main__":
    sys.exit(released_tests.main(
        "sglang", ["sglang-kernel==0.4.10", "sglang==0.5.23"],
        ["tree_speculative_sampling_target_only", "verify_tree_greedy"],
        "SGL_KERNEL_TESTS", [], NOTES))
