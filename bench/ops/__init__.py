"""One module per op family. Each module defines

* ``OP``: the op name used in rows and on the command line,
* ``BYTES_FORMULA``: the minimal byte count in words (also in docs/bench.md),
* ``cases(device, preset) -> list[Case]``: its sweep (``preset`` is "quick", "cpu", "gpu" or
  "gpu_check"),
* ``min_bytes(case) -> int``: the fewest bytes the op must move for that case,
* ``make_inputs(case, device) -> dict``: one input set (the harness clones it to rotate),
* ``implementations(case, device) -> list[Impl | Skip]``: our backends and the baselines.
"""
from __future__ import annotations

import importlib

OP_MODULES = {
    "chain": "bench.ops.chain",
    "tree": "bench.ops.tree",
    "sample": "bench.ops.sample",
    "mask": "bench.ops.mask",
    "compact": "bench.ops.compact",
    "cpu": "bench.ops.cpu",
}


def load(op: str):
    return importlib.import_module(OP_MODULES[op])


def triton_backend_available(device, module: str) -> tuple[bool, str]:
    """Whether ``specdec_kernels.triton.<module>`` can serve tensors on ``device``."""
    if device.type != "cuda":
        return False, "Triton kernels need a CUDA device (TRITON_INTERPRET is for tests, not timing)"
    try:
        importlib.import_module(f"specdec_kernels.triton.{module}")
        return True, ""
    except Exception as exc:  # noqa: BLE001 -- not written yet, or broken: say which
        return False, f"specdec_kernels.triton.{module} not importable ({type(exc).__name__}: {str(exc)[:100]})"


def extension_op(op: str, device) -> tuple[bool, str, str]:
    """``(available, why_not, backend_label)`` for the compiled extension's ``op`` on ``device``.

    The label is ``cpp`` for the C++ CPU kernel and ``cuda_ext`` for the CUDA kernel."""
    label = "cuda_ext" if device.type == "cuda" else "cpp"
    try:
        ext = importlib.import_module("specdec_kernels._extension")
    except Exception as exc:  # noqa: BLE001
        return False, f"specdec_kernels._extension not importable ({type(exc).__name__})", label
    if ext.KERNELS.get((op, device.type), False):
        return True, "", label
    why = (f"specdec_kernels._C not built ({ext.IMPORT_ERROR})" if not ext.HAS_EXTENSION
           else f"specdec_kernels._C has no {device.type} kernel for {op}")
    return False, why[:200], label
