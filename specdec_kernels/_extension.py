"""The compiled extension ``specdec_kernels._C`` (csrc/): loading it, which ops it has a
kernel for, and their fake kernels (the choice of backend is ``_backend.use_extension``).

Importing ``_C`` registers ``torch.ops.specdec.{build_tree_attention, compact_kv_cache,
compact_paged_kv_cache}`` with CPU and (when built with nvcc) CUDA kernels. The fake kernels
below give ``torch.compile`` and ``torch.library.opcheck`` the output shapes without running
anything. Nothing here touches a GPU.
"""
from __future__ import annotations

import torch

OPS = ("build_tree_attention", "compact_kv_cache", "compact_paged_kv_cache")

try:
    from . import _C  # noqa: F401  (registers the ops)
    HAS_EXTENSION = True
    IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built: every op falls back to the reference
    HAS_EXTENSION = False
    IMPORT_ERROR = exc

# (op, device type) -> whether the extension has a kernel for it. Computed once at import,
# a plain dict so that torch.compile traces the backend choice without a graph break.
KERNELS: dict[tuple[str, str], bool] = {
    (op, device_type): HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"specdec::{op}", dispatch_key)
    for op in OPS for device_type, dispatch_key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


if HAS_EXTENSION:
    @torch.library.register_fake("specdec::build_tree_attention")
    def _build_tree_attention_fake(parents, num_nodes, prefix_lens):
        batch, nodes = parents.shape
        return (parents.new_empty((batch, nodes, nodes), dtype=torch.bool),
                parents.new_empty((batch, nodes, (nodes + 31) // 32), dtype=torch.int32),
                parents.new_empty((batch, nodes), dtype=torch.int32),
                parents.new_empty((batch, nodes), dtype=torch.int64))

    @torch.library.register_fake("specdec::compact_kv_cache")
    def _compact_kv_cache_fake(caches, kv_lens, accepted_nodes, num_accepted, layout):
        return torch.empty_like(kv_lens)

    @torch.library.register_fake("specdec::compact_paged_kv_cache")
    def _compact_paged_kv_cache_fake(caches, block_tables, kv_lens, accepted_nodes, num_accepted):
        return torch.empty_like(kv_lens)
