"""Fused chain verification (contract section 3).

Launches, all asynchronous (no host synchronisation, CUDA-graph capturable with tensor seeds):

1. ``_row_stats_kernel`` over the ``B*(K+1)`` target rows (and again over the ``B*K`` draft
   rows when ``draft_logits`` is given): one streaming pass per row, split over programs when
   rows are few, plus pivot passes for rows whose top-k/top-p is active (``stats.py``,
   ``filters.py``).
   Split rows are merged by ``_row_stats_finish_kernel`` when filters are on (it runs their
   search); unfiltered rows, target and draft, are merged by the race as it reads them
   (``load_row_stats``), one launch less each.
2. ``_race_kernel``: each program replays its request's acceptance loop (``accept_drafts``:
   one gathered logit, and one draft probability or draft logit, per draft tested), then
   runs the two-level race (``_rng``) over row ``num_accepted`` for the correction or bonus
   token; writes the accepted drafts, the token, ``-1`` padding and ``num_accepted``. Grid B
   when V is one chunk; else grid B x chunks for the first level (the groups' masses) and
   then grid B for the reduction of the chunks' winners and the second level (the tokens of
   the winning group).

``method="block"`` (block verification, contract section 12) adds one launch between the two,
``block.residual_masses`` (the masses ``R_j``; its header counts the bytes), and the race
replays block verification's acceptance from them (``accept.block_accept``) and samples
``max(w_tau p - q, 0)``. With ``K <= 1`` or every request greedy, block verification gives
the token rule's tokens, so those calls take the token path.

No kernel of its own: they are in ``stats.py``, ``race.py`` and ``block.py`` (their
``COMPILE_SPECS`` cover the chain).

Memory: the stats are ``[B*(K+1), 3]`` float32 + ``[B*(K+1)]`` int32 (and the same for draft
rows); the race partials ``[B, chunks, 5]``. Nothing grows with ``B*K*V``.
"""
from __future__ import annotations

import dataclasses

import torch

from ._launch import last_dim_contiguous, scratch
from ._tiles import LOGPROBS_KINDS, LOGPROBS_RAW
from .block import residual_masses
from .accept import Q_LOGITS, Q_LOGITS_T, Q_NONE, Q_ONE_HOT, Q_PROBS
from .race import DraftInputs, race
from .stats import PackedRows, SlotRows, row_stats


def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, draft_logits: torch.Tensor | None,
                 num_draft_tokens: torch.Tensor, params, seeds: torch.Tensor,
                 offsets: torch.Tensor, method: str = "token", *,
                 token_bitmask: torch.Tensor | None = None, return_logprobs: str | None = None,
                 packed: tuple[torch.Tensor, int] | None = None,
                 draft_slots: torch.Tensor | None = None,
                 draft_temperature: torch.Tensor | None = None):
    """Returns ``(output_token_ids [B, K+1] int32, num_accepted [B] int32, logprobs)``
    (``logprobs`` float32 ``[B, K+1]`` with ``return_logprobs``, else None); arguments parsed
    by the public layer (``num_draft_tokens`` int32 ``[B]``, seeds/offsets int64 ``[B]``,
    ``method`` ``"token"`` or ``"block"``, ``token_bitmask`` int32 ``[B, K+1, W]`` of the
    target rows: the draft logits never take it).

    ``packed = (cu_num_draft_tokens, K)``: the inputs are in the packed layout
    (``verify_chain_packed``: ``target_logits [T+B, V]``, ``draft_token_ids [T]``, draft rows
    ``[T, V]``, bitmask ``[T+B, W]``), read in place: every kernel finds a request's rows
    through ``cu_num_draft_tokens`` itself (``num_draft_tokens`` is not read).

    ``draft_slots`` ``[B]``: the draft probs/logits are ``[S, K', V']`` per-slot rows, read
    in place at ``[draft_slots[b], j, :V]`` (padded or packed; any strides but a unit
    vocabulary stride). ``draft_temperature`` float32 ``[B]``: the draft logits' statistics
    and q at that temperature, no filter (``Q_LOGITS_T``)."""
    target_logits = last_dim_contiguous(target_logits)
    if packed is None:
        batch, rows, vocab = target_logits.shape
        target_rows = draft_rows = None
    else:
        batch, rows = packed[0].shape[0] - 1, packed[1] + 1
        target_rows = PackedRows(packed[0].contiguous(), draft_token_ids.shape[0], rows, 1)
        draft_rows = target_rows._replace(rows_per_req=rows - 1, live_extra=0)
    num_drafts = rows - 1  # K
    device = target_logits.device
    out = torch.empty((batch, rows), dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    logprobs = None if return_logprobs is None else \
        torch.empty((batch, rows), dtype=torch.float32, device=device)
    if batch == 0:
        return out, num_accepted, logprobs
    draft_ids = draft_token_ids if draft_token_ids.stride(-1) == 1 or num_drafts <= 1 \
        else draft_token_ids.contiguous()
    if num_drafts == 0 or draft_ids.numel() == 0:  # never read: no draft is live
        draft_ids = scratch(device, torch.int32)

    bitmask = None if token_bitmask is None else \
        token_bitmask.reshape(-1, token_bitmask.shape[-1]).contiguous()
    kind = LOGPROBS_KINDS[return_logprobs]
    stats = row_stats(target_logits, params, merge_in_consumer=True, bitmask=bitmask,
                      raw=kind == int(LOGPROBS_RAW), packed=target_rows)
    q, q_stats = None, None
    slotted = None if draft_slots is None else \
        SlotRows(draft_slots, batch, num_drafts, target_logits.shape[-1])
    if draft_logits is not None:
        q_mode = Q_LOGITS if draft_temperature is None else Q_LOGITS_T
        q = last_dim_contiguous(draft_logits)
        if num_drafts > 0 and q.numel() > 0:  # (the draft logits never take the bitmask)
            q_stats = row_stats(q, params if draft_temperature is None else
                                draft_params(params, draft_temperature), merge_in_consumer=True,
                                packed=draft_rows, slotted=slotted)
    elif draft_probs is not None:
        q_mode = Q_PROBS
        q = last_dim_contiguous(draft_probs)
    else:
        q_mode = Q_ONE_HOT
    if num_drafts == 0 or (q is not None and q.numel() == 0):
        q_mode, q = Q_NONE, None  # no live draft: the race is a bonus sample of p
    num_draft = scratch(device, torch.int32) if packed is not None else \
        num_draft_tokens.to(torch.int32).contiguous()
    drafts = DraftInputs(draft_ids, num_draft, num_accepted, q_mode, q, q_stats,
                         slots=draft_slots, q_temperature=draft_temperature)
    if method == "block" and num_drafts >= 2 and not params.all_greedy and q_mode != Q_NONE:
        masses, chunks = residual_masses(target_logits, stats, drafts, params, bitmask=bitmask,
                                         packed=target_rows)
        drafts = drafts._replace(masses=masses, mass_chunks=chunks)
    race(target_logits, stats, params, seeds, offsets, out, drafts, bitmask=bitmask,
         logprobs=logprobs, logprobs_kind=kind, packed=target_rows)
    return out, num_accepted, logprobs


def draft_params(params, draft_temperature: torch.Tensor):
    """The draft logits' parameters with ``draft_temperature``: that temperature, no filter
    (its greedy rows, T = 0, give their arg-max: q one-hot there). ``params``: the parsed
    target parameters (a ``SamplingParams``, a type this layer does not import); the filters'
    tensors are scratch, never read with their ``uses_*`` False."""
    device = draft_temperature.device
    return dataclasses.replace(
        params, temperature=draft_temperature, top_k=scratch(device, torch.int32),
        top_p=scratch(device, torch.float32), min_p=None, uses_top_k=False, uses_top_p=False,
        all_greedy=False, uses_min_p=False)
