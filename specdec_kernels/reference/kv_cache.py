"""Reference KV-cache compaction (contract section 6), vectorised over requests and path
entries; one gather and one scatter per cache tensor.

Request ``b`` moves position ``kv_lens[b] + accepted_nodes[b, k]`` to ``kv_lens[b] + k`` for
``k = 1..num_accepted[b]``. Every source is gathered (a copy) before any destination is
written, which is what makes overlapping moves (path ``[0, 2, 3]``) correct. Moves with
``accepted_nodes[b, k] == k`` (a chain prefix) are left out, so a chain moves nothing.

Entries only reachable with ``validate=False`` are skipped the way the compiled kernels skip
them: a node outside ``[0, N)``, a source or destination outside the cache (past ``S``, past
the request's block table, in a block outside the pool, or past int64), a negative
``kv_lens``;
``num_accepted`` is clamped to ``[0, N - 1]``.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

Caches = Union[torch.Tensor, Sequence[torch.Tensor]]
INT64_MAX = 2**63 - 1


def _as_list(caches: Caches) -> list[torch.Tensor]:
    return [caches] if isinstance(caches, torch.Tensor) else list(caches)


def _moves(kv_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
           device: torch.device):
    """Per (request, path entry): source and destination positions and whether it moves."""
    batch, n = accepted_nodes.shape
    entry = torch.arange(n, device=device)[None, :]
    node = accepted_nodes.to(device=device, dtype=torch.int64)
    count = num_accepted.to(device=device, dtype=torch.int64).clamp(0, n - 1)[:, None]
    start = kv_lens.to(device=device, dtype=torch.int64)[:, None]
    # A position past int64 (kv_lens near 2**63, validate=False) is outside the cache.
    fits = (start <= INT64_MAX - node) & (start <= INT64_MAX - entry)
    moves = ((entry >= 1) & (entry <= count) & (node != entry) & (node >= 0) & (node < n)
             & (start >= 0) & fits)
    return start + node, start + entry, moves


def new_lengths(kv_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor,
                device: torch.device) -> torch.Tensor:
    """``kv_lens + num_accepted + 1`` in kv_lens' dtype, on ``device``."""
    count = num_accepted.to(device=device, dtype=torch.int64).clamp(0, accepted_nodes.shape[1] - 1)
    return (kv_lens.to(device=device, dtype=torch.int64) + count + 1).to(kv_lens.dtype)


def compact_kv_cache(caches: Caches, kv_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                     num_accepted: torch.Tensor, *, layout: str = "bshd") -> torch.Tensor:
    """Contiguous caches ``[B, S, H, D]`` (``"bshd"``) or ``[B, H, S, D]`` (``"bhsd"``)."""
    caches = _as_list(caches)
    device = caches[0].device
    seq_dim = 1 if layout == "bshd" else 2
    seq_len = caches[0].shape[seq_dim]
    src, dst, moves = _moves(kv_lens, accepted_nodes, num_accepted, device)
    moves &= (src < seq_len) & (dst < seq_len)
    request, entry = moves.nonzero(as_tuple=True)
    src, dst = src[request, entry], dst[request, entry]
    for cache in caches:
        if layout == "bshd":
            cache[request, dst] = cache[request, src]
        else:
            cache[request, :, dst] = cache[request, :, src]
    return new_lengths(kv_lens, accepted_nodes, num_accepted, device)


def compact_paged_kv_cache(caches: Caches, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                           accepted_nodes: torch.Tensor,
                           num_accepted: torch.Tensor) -> torch.Tensor:
    """Paged caches ``[num_blocks, block_size, ...]``; position ``t`` of request ``b`` at block
    ``block_tables[b, t // block_size]``, slot ``t % block_size``."""
    caches = _as_list(caches)
    device = caches[0].device
    num_blocks, block_size = caches[0].shape[:2]
    tables = block_tables.to(device=device, dtype=torch.int64)
    columns = tables.shape[1]
    src, dst, moves = _moves(kv_lens, accepted_nodes, num_accepted, device)

    def locate(position: torch.Tensor):
        column = position // block_size
        inside = (position >= 0) & (column < columns)
        block = torch.gather(tables, 1, column.clamp(0, max(columns - 1, 0))) if columns else column
        inside &= (block >= 0) & (block < num_blocks)
        return block, position % block_size, inside

    src_block, src_slot, src_inside = locate(src)
    dst_block, dst_slot, dst_inside = locate(dst)
    request, entry = (moves & src_inside & dst_inside).nonzero(as_tuple=True)
    src_block, src_slot = src_block[request, entry], src_slot[request, entry]
    dst_block, dst_slot = dst_block[request, entry], dst_slot[request, entry]
    for cache in caches:
        cache[dst_block, dst_slot] = cache[src_block, src_slot]
    return new_lengths(kv_lens, accepted_nodes, num_accepted, device)
