"""Reference tree-attention metadata (contract section 5), vectorised over the batch.

Ancestor sets by pointer doubling: ``mask`` starts as "self or parent" and ``up`` as the
parent; each round ORs in the mask row of ``up`` and jumps ``up`` to its own ``up``, so after
round ``r`` a row holds every ancestor within ``2**r`` steps. ``ceil(log2(N))`` rounds cover
any tree of ``N`` nodes, with no data-dependent loop (so nothing synchronises).

Choices where the contract is silent (docs/extension.md):
  * a padding node (index ``>= num_nodes[b]``) is a one-node tree of its own: its mask row and
    column hold only the diagonal, its depth is 0 and its position id ``prefix_lens[b]``;
  * with ``validate=False`` a real node whose parent is not an earlier node (only reachable
    then) is treated the same way, as the root of its own subtree; ``num_nodes`` is clamped
    to ``[0, N]``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class TreeAttention(NamedTuple):
    mask: torch.Tensor          # [B, N, N] bool: mask[b, i, j] iff j is i or an ancestor of i
    packed_mask: torch.Tensor   # [B, N, ceil(N/32)] int32: bit j % 32 of word j // 32 = mask
    depth: torch.Tensor         # [B, N] int32, root 0
    position_ids: torch.Tensor  # [B, N] int64 = prefix_lens + depth


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., N]`` to int32 ``[..., ceil(N/32)]``, bit ``j % 32`` of word ``j // 32``."""
    n = mask.shape[-1]
    words = (n + 31) // 32
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, words * 32 - n))
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32, device=mask.device))
    packed = (padded.view(*mask.shape[:-1], words, 32) * weights).sum(-1)  # in [0, 2**32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def build_tree_attention(parents: torch.Tensor, *, num_nodes: Optional[torch.Tensor] = None,
                         prefix_lens: Optional[torch.Tensor] = None) -> TreeAttention:
    """``parents`` ``[B, N]``; ``num_nodes`` and ``prefix_lens`` ``[B]`` int tensors or None."""
    batch, n = parents.shape
    device = parents.device
    nodes = torch.arange(n, device=device)
    if num_nodes is None:
        real = torch.ones(batch, n, dtype=torch.bool, device=device)
    else:
        real = nodes[None, :] < num_nodes.to(torch.int64).clamp(0, n)[:, None]
    parent = parents.to(torch.int64)
    has_parent = real & (nodes[None, :] > 0) & (parent >= 0) & (parent < nodes[None, :])
    up = torch.where(has_parent, parent, nodes[None, :])  # roots point to themselves

    eye = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n)
    mask = eye | torch.nn.functional.one_hot(up, n).to(torch.bool) if n else eye.clone()
    rows = torch.arange(batch, device=device)[:, None]
    for _ in range(max(n - 1, 1).bit_length()):  # 2**rounds >= N - 1 steps
        mask = mask | mask[rows, up]
        up = torch.gather(up, 1, up)

    depth = (mask.sum(-1) - 1).to(torch.int32)
    prefix = (torch.zeros(batch, dtype=torch.int64, device=device) if prefix_lens is None
              else prefix_lens.to(torch.int64))
    position_ids = prefix[:, None] + depth.to(torch.int64)
    return TreeAttention(mask, pack_mask(mask), depth, position_ids)
