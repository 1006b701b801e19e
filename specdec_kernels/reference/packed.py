"""The packed chain layout of ``verify_chain_packed`` (vLLM's sampler): where each request's
rows are, and the padded equivalent of packed inputs (the reference's definition of the
layout; the C++ path reads the rows in place through the same ``PackedLayout``)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PackedLayout(NamedTuple):
    """Where request ``b``'s rows of a packed chain are, computed on the device from
    ``cu_num_draft_tokens`` (no synchronisation, graph-capturable). Unvalidated offsets are
    clamped so that every index is in range: ``n_b`` to ``0..min(K, T - start_b)``."""
    target_rows: torch.Tensor       # [B, K+1] int64: row of position j (j > n_b: the bonus row)
    draft_rows: torch.Tensor        # [B, K] int64: packed index of draft j (j >= n_b: T, padding)
    num_draft_tokens: torch.Tensor  # [B] int32: n_b
    num_packed: int                 # T


def packed_layout(cu_num_draft_tokens: torch.Tensor, num_packed: int,
                  max_draft_tokens: int) -> PackedLayout:
    cu = cu_num_draft_tokens.to(torch.int64)
    batch = cu.shape[0] - 1
    start = cu[:batch].clamp(0, num_packed)
    live_drafts = torch.minimum((cu[1:] - cu[:batch]).clamp(0, max_draft_tokens),
                                num_packed - start)
    position = torch.arange(max_draft_tokens + 1, device=cu.device)
    request = torch.arange(batch, device=cu.device)
    target_rows = (start + request)[:, None] + torch.minimum(position, live_drafts[:, None])
    draft_position = position[:max_draft_tokens]
    draft_rows = torch.where(draft_position < live_drafts[:, None],
                             start[:, None] + draft_position, num_packed)
    return PackedLayout(target_rows, draft_rows, live_drafts.to(torch.int32), num_packed)


def padded_inputs(layout: PackedLayout, target_logits, draft_token_ids, draft_probs,
                  draft_logits, token_bitmask):
    """The padded ``[B, K+1, ...]`` / ``[B, K, ...]`` equivalents of packed inputs (a copy:
    the reference's definition of the packed layout, never the kernels' path). Draft padding
    is id -1 and zero draft rows."""
    def drafts_of(packed):
        if packed is None:
            return None
        padding = packed.new_zeros((1,) + tuple(packed.shape[1:]))
        return torch.cat([packed, padding])[layout.draft_rows]
    ids = torch.cat([draft_token_ids, draft_token_ids.new_full((1,), -1)])[layout.draft_rows]
    bitmask = None if token_bitmask is None else token_bitmask[layout.target_rows]
    return (target_logits[layout.target_rows], ids, drafts_of(draft_probs),
            drafts_of(draft_logits), bitmask)
