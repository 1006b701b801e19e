"""``sample``: one token per row of logits from the processed distribution, in two launches
(``stats.row_stats`` and ``race.race``) and no probability tensor.

The kernels live with their subsystem: the row statistics in ``stats.py`` (with the
top-k/top-p threshold search of ``filters.py``), the exponential race in ``race.py``, tile
helpers shared by every kernel module in ``_tiles.py``.
"""
from __future__ import annotations

import torch

from ._launch import last_dim_contiguous
from ._tiles import LOGPROBS_KINDS, LOGPROBS_RAW
from .race import race
from .stats import row_stats


def sample(logits: torch.Tensor, params, seeds: torch.Tensor, offsets: torch.Tensor, *,
           token_bitmask: torch.Tensor | None = None, return_logprobs: str | None = None):
    """int32 ``[B]``: one token per row of ``logits`` ``[B, V]`` from the processed distribution
    (-1 for a row with no finite logit); with ``return_logprobs``, ``(tokens, logprobs)``
    (float32 ``[B]``, NaN for -1). Two launches (stats, race), plus the statistics'
    finish when rows are split and filtered (unfiltered partials are merged by the race) and
    the race's second stage when V is split; no host synchronisation. ``token_bitmask``
    ``[B, W]`` int32 is read with the logits in both."""
    rows = last_dim_contiguous(logits)[:, None, :]  # [B, 1, V]: one row per request
    out = torch.empty(rows.shape[0], dtype=torch.int32, device=logits.device)
    logprobs = None if return_logprobs is None else \
        torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if rows.shape[0] > 0:
        kind = LOGPROBS_KINDS[return_logprobs]
        bitmask = None if token_bitmask is None else token_bitmask.contiguous()
        stats = row_stats(rows, params, merge_in_consumer=True, bitmask=bitmask,
                          raw=kind == int(LOGPROBS_RAW))
        race(rows, stats, params, seeds, offsets, out[:, None], bitmask=bitmask,
             logprobs=None if logprobs is None else logprobs[:, None], logprobs_kind=kind)
    return out if return_logprobs is None else (out, logprobs)
