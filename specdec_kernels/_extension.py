"""The compiled extension ``specdec_kernels._C`` (csrc/): loading it, which ops it has a
kernel for (the choice of backend is ``_backend.use_extension``; the ops' fake kernels are
in ``_ops``).

Importing ``_C`` registers ``torch.ops.specdec.{build_tree_attention, compact_kv_cache,
compact_paged_kv_cache}`` with CPU and (when built with nvcc) CUDA kernels, and the C++ CPU
path's ``specdec::cpu_*`` ops. Nothing here touches a GPU.
"""
from __future__ import annotations

import warnings

import torch

OPS = ("build_tree_attention", "compact_kv_cache", "compact_paged_kv_cache")

try:
    from . import _C  # noqa: F401  (registers the ops)
    HAS_EXTENSION = True
    IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built: every op falls back to the reference
    HAS_EXTENSION = False
    IMPORT_ERROR = exc
    # Once per process (the module is imported once): say what runs instead.
    warnings.warn(f"specdec_kernels: the compiled extension is not available ({exc}); the "
                  f"C++ CPU path and the extension's kernels are off, the Triton and "
                  f"reference backends run", RuntimeWarning, stacklevel=2)

# (op, device type) -> whether the extension has a kernel for it. Computed once at import,
# a plain dict so that torch.compile traces the backend choice without a graph break.
KERNELS: dict[tuple[str, str], bool] = {
    (op, device_type): HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"specdec::{op}", dispatch_key)
    for op in OPS for device_type, dispatch_key in (("cpu", "CPU"), ("cuda", "CUDA"))
}

