"""Block verification's residual masses (contract section 12, ``verify_chain(method="block")``).

Block verification needs, for every live draft ``j < n`` of a sampled request,
``R_j = sum_x max(w_j p_{j+1}(x) - q_{j+1}(x), 0)``: a full pass over target row ``j + 1``
and draft row ``j + 1`` scaled by ``w_j``, which depends on the earlier drafts' gathered
``p_i(d_i) / q_i(d_i)``. It cannot ride along the statistics pass: ``p_{j+1}(x)`` needs
row ``j + 1``'s normaliser, known only at the end of that pass, and ``w_j`` the normalisers of
rows ``1..j`` (other programs), while the ``max`` does not factor out of the sum. So it is one
extra launch between the statistics and the race, grid ``B x (K-1) x chunks``: program
``(b, j, c)`` replays ``w_{j+1}`` from ``j + 1`` gathers (the statistics are in place, so this
costs a few cached loads) and streams chunk ``c`` of its two rows, writing one float32.

Bytes per request: ``(n - 1) * V * (elem + q_elem)`` read (``q_elem = 0`` for one-hot drafts,
whose q is the drafted id; ``n`` the live drafts: rows that block verification does not use,
greedy requests and ``w_j = 0`` with one-hot or logit drafts are skipped), plus ``O(K^2)``
gathered values (~30 B each), and ``(K - 1) * chunks * 4`` B written; the race then reads those
partials (the same bytes) and, for its final residual, nothing more than the token rule does.
In all, block verification reads the target and draft logits about once more than ``"token"``
(the statistics pass reads them once too); with ``n <= 1`` for every request (``K <= 1``) or
all requests greedy the launch is skipped and the token path runs, which gives the same tokens
there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch_options, row_chunks, scratch
from ._tiles import allowed_logits, exp2_scale, load_logits, processed_prob
from .accept import (Q_LOGITS, Q_LOGITS_T, Q_ONE_HOT, Q_PROBS, chain_rows, draft_scale,
                     prefix_weight)
from .race import draft_arguments
from .stats import PackedRows, RowStats, load_row_stats, row_layout


@triton.jit
def _residual_mass_kernel(logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr,
                          q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr,
                          draft_ids_ptr, stride_ids, num_draft_tokens_ptr, temperature_ptr,
                          mass_ptr, V, K, chunk_size, bitmask_ptr, bitmask_words, cu_ptr,
                          num_packed, q_temperature_ptr, slots_ptr, num_slots,
                          Q_MODE: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                          STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                          Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                          BLOCK: tl.constexpr, HAS_BITMASK: tl.constexpr = False,
                          PACKED: tl.constexpr = False, SLOTTED: tl.constexpr = False):
    """Program (b, j, c): chunk c of ``R_{j+1}`` of request b (``j`` in ``0..K-2``, 0-based
    draft index), 0 where block verification does not read it (draft ``j`` not live or the
    last live one, greedy requests, ``w = 0`` with one-hot or logit drafts, whose residual
    mass is 0 anyway; unvalidated ``draft_probs`` may be negative, and ``max(0 - q, 0)`` is
    summed as the reference sums it).
    HAS_BITMASK: p of the target rows honours ``token_bitmask`` (as in the statistics and
    the race). PACKED, SLOTTED, Q_LOGITS_T: the rows are read in place and q is processed as
    the race kernel reads them."""
    req = tl.program_id(0)
    j = tl.program_id(1)
    chunk = tl.program_id(2)
    temperature = tl.load(temperature_ptr + req)
    scale = exp2_scale(temperature)
    q_temperature = temperature
    if Q_MODE == Q_LOGITS_T:
        q_temperature = tl.load(q_temperature_ptr + req)
    q_scale = draft_scale(scale, q_temperature, Q_MODE)
    num_draft_tokens, logits_ptr, q_ptr, draft_ids_ptr, bitmask_ptr = chain_rows(
        req, num_draft_tokens_ptr, cu_ptr, num_packed, logits_ptr, stride_row, q_ptr,
        stride_q_req, stride_q_row, draft_ids_ptr, bitmask_ptr, bitmask_words, K, slots_ptr,
        num_slots, PACKED, SLOTTED)
    ids_row = draft_ids_ptr + req.to(tl.int64) * stride_ids
    logits_row = logits_ptr + req.to(tl.int64) * stride_req
    q_row = q_ptr + req.to(tl.int64) * stride_q_req
    row = j.to(tl.int64) + 1
    weight, live = prefix_weight(req, row, num_draft_tokens, ids_row, logits_row, stride_row,
                                 stats_ptr, argmax_ptr, q_row, stride_q_row, q_stats_ptr,
                                 q_argmax_ptr, scale, q_temperature, V, K, bitmask_ptr,
                                 bitmask_words,
                                 Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2, Q_STATS_CHUNKS,
                                 Q_STATS_CHUNKS_P2, HAS_BITMASK)
    next_id = tl.load(ids_row + row, mask=row < num_draft_tokens, other=-1).to(tl.int64)
    needed = live & (next_id >= 0) & (next_id < V) & (temperature != 0.0)
    if Q_MODE != Q_PROBS:  # q >= 0 there: w = 0 leaves max(0 - q, 0) = 0
        needed = needed & (weight > 0.0)
    total = tl.full([], 0.0, tl.float32)
    if needed:
        x_max, x_thr, norm, _ = load_row_stats(stats_ptr, argmax_ptr, req * (K + 1) + row,
                                               tl.full([], 1, tl.int1), scale, STATS_CHUNKS,
                                               STATS_CHUNKS_P2)
        q_max = tl.full([], 0.0, tl.float32)
        q_thr = tl.full([], 0.0, tl.float32)
        q_norm = tl.full([], 1.0, tl.float32)
        q_arg = tl.full([], -1, tl.int32)
        if Q_MODE >= Q_LOGITS:
            q_max, q_thr, q_norm, q_arg = load_row_stats(
                q_stats_ptr, q_argmax_ptr, req * K + row, tl.full([], 1, tl.int1), q_scale,
                Q_STATS_CHUNKS, Q_STATS_CHUNKS_P2)
            if Q_MODE == Q_LOGITS_T:  # T_q = 0: q one-hot at the draft row's arg-max
                q_arg = tl.where((q_temperature == 0.0) & (q_max > float("-inf")), q_arg, -1)
        # Per-lane sums, reduced once after the loop.
        lane = tl.zeros([BLOCK], tl.float32)
        bm_row_ptr = bitmask_ptr + (req.to(tl.int64) * (K + 1) + row) * bitmask_words
        start_v = chunk * chunk_size
        end_v = tl.minimum(start_v + chunk_size, V)
        for start in range(start_v, end_v, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < end_v
            x = allowed_logits(load_logits(logits_row + row * stride_row, offs, mask), offs,
                               mask, bm_row_ptr, HAS_BITMASK)
            p = processed_prob(x, x_max, x_thr, norm, scale)
            if Q_MODE == Q_ONE_HOT:
                q = tl.where(offs == next_id, 1.0, 0.0)
            elif Q_MODE == Q_PROBS:
                q = tl.load(q_row + row * stride_q_row + offs, mask=mask,
                            other=0.0).to(tl.float32)
            else:
                q = processed_prob(load_logits(q_row + row * stride_q_row, offs, mask),
                                   q_max, q_thr, q_norm, q_scale)
                if Q_MODE == Q_LOGITS_T:
                    q = tl.where(q_temperature == 0.0, tl.where(offs == q_arg, 1.0, 0.0), q)
            residual = tl.maximum(weight * p - q, 0.0, propagate_nan=tl.PropagateNan.ALL)
            lane += tl.where(mask, residual, 0.0)
        total = tl.sum(lane, axis=0)
    tl.store(mass_ptr + (req.to(tl.int64) * (K - 1) + j) * NUM_CHUNKS + chunk, total)


# Tests set this to split the residual masses' rows on small vocabularies.
MASS_CHUNK_OVERRIDE: int | None = None
MASS_BLOCK = 1024   # logits per iteration on a GPU (4 warps: 8 per thread)
MAX_MASS_CHUNKS = 16


def mass_chunks(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(chunk_size, num_chunks, BLOCK): rows split until about 4 programs per SM."""
    return row_chunks(rows, vocab, device, cap_gpu=MASS_BLOCK, programs_per_sm=4,
                      max_chunks=MAX_MASS_CHUNKS, override=MASS_CHUNK_OVERRIDE)


def residual_masses(target_logits: torch.Tensor, stats: RowStats, drafts, params,
                    bitmask: torch.Tensor | None = None, packed: PackedRows | None = None
                    ) -> tuple[torch.Tensor, int]:
    """Launch ``_residual_mass_kernel`` for a chain (``target_logits`` ``[B, K+1, V]``, last dim
    contiguous, K >= 2; ``drafts`` the race's ``DraftInputs``; ``bitmask`` and ``packed`` as
    in ``race.race``). Returns the partials ``[B, K-1, chunks]`` float32 and ``chunks``; the
    race sums them in chunk order."""
    batch, rows, vocab, strides = row_layout(target_logits, packed)
    num_drafts = rows - 1
    device = target_logits.device
    chunk, num_chunks, block = mass_chunks(batch * (num_drafts - 1), vocab, device)
    masses = torch.empty((batch, num_drafts - 1, num_chunks), dtype=torch.float32,
                         device=device)
    dummy_f, dummy_i = scratch(device, torch.float32), scratch(device, torch.int32)
    # (one-hot drafts: q never read)
    q_args, q_extra, features = draft_arguments(drafts, packed, dummy_f, dummy_i)
    q_stats = drafts.q_stats or RowStats(dummy_f, dummy_i, 1)
    # compiled in only when used
    if bitmask is not None:
        features["HAS_BITMASK"] = True
    if packed is not None:
        features["PACKED"] = True
    _residual_mass_kernel[(batch, num_drafts - 1, num_chunks)](
        target_logits, *strides, stats.stats,
        stats.argmax, *q_args, q_stats.stats, q_stats.argmax,
        drafts.token_ids, drafts.token_ids.stride(0) if packed is None else 0,
        drafts.num_draft_tokens, params.temperature, masses, vocab, num_drafts, chunk,
        bitmask if bitmask is not None else dummy_i,
        bitmask.shape[-1] if bitmask is not None else 0,
        packed.cu_num_draft_tokens if packed is not None else dummy_i,
        packed.num_packed if packed is not None else 0, *q_extra,
        Q_MODE=int(drafts.q_mode), NUM_CHUNKS=num_chunks, BLOCK=block, **stats.constexprs(),
        **q_stats.constexprs("Q_"), **features, **launch_options(device, 4))
    return masses, num_chunks


COMPILE_SPECS = [
    dict(name=f"residual_mass[bf16,{mode_name}{',bitmask,packed' if features else ''}"
              f"{',slotted' if slotted else ''}]",
         kernel=_residual_mass_kernel,
         signature=dict(logits_ptr="*bf16", stride_req="i32", stride_row="i32",
                        stats_ptr="*fp32", argmax_ptr="*i32", q_ptr=f"*{q_dtype}",
                        stride_q_req="i32", stride_q_row="i32", q_stats_ptr="*fp32",
                        q_argmax_ptr="*i32", draft_ids_ptr="*i64", stride_ids="i32",
                        num_draft_tokens_ptr="*i32", temperature_ptr="*fp32",
                        mass_ptr="*fp32", V="i32", K="i32", chunk_size="i32",
                        bitmask_ptr="*i32", bitmask_words="i32", cu_ptr="*i64",
                        num_packed="i32", q_temperature_ptr="*fp32", slots_ptr="*i64",
                        num_slots="i32"),
         constexprs=dict(Q_MODE=int(q_mode), NUM_CHUNKS=4, STATS_CHUNKS=4, STATS_CHUNKS_P2=4,
                         Q_STATS_CHUNKS=4 if q_mode >= Q_LOGITS else 1,
                         Q_STATS_CHUNKS_P2=4 if q_mode >= Q_LOGITS else 1, BLOCK=MASS_BLOCK,
                         HAS_BITMASK=features, PACKED=features, SLOTTED=slotted),
         num_warps=4, maxnreg=128)
    for mode_name, q_mode, q_dtype, features, slotted in (
        ("one_hot", Q_ONE_HOT, "fp32", False, False),
        ("draft_probs", Q_PROBS, "fp32", False, False),
        ("draft_logits", Q_LOGITS, "bf16", False, False),
        ("draft_logits", Q_LOGITS, "bf16", True, False),
        ("draft_logits_t", Q_LOGITS_T, "bf16", True, True),  # vLLM MRV2's layout
        ("draft_probs", Q_PROBS, "fp32", True, True))
]
