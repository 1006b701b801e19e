"""The exponential race that draws one token per request, and the chain's acceptance replay
that the race kernel fuses.

A token of the processed distribution ``p`` (or of the residual ``max(p - q, 0)`` after a
rejected draft) is ``argmax_i w_i / E_i`` with ``E_i`` Exp(1) Philox noise, raced in two
levels (``_rng``): groups of RACE_GROUP tokens by their masses, then the tokens of the
winning group. ``w`` is computed from the row statistics (``stats.py``), never stored.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _rng
from .._rng import PURPOSE_RESAMPLE, PURPOSE_SAMPLE
from . import _rng as trng
from ._launch import block_size, cdiv, interpreted, launch_options, next_pow2, num_sms, scratch
from ._tiles import (LOGPROBS_NONE, LOGPROBS_RAW, allowed_logits, block_best, exp2_scale,
                     load_logits, processed_prob, quad_offsets, tile_best, token_logprob)
from .accept import (Q_LOGITS, Q_LOGITS_T, Q_NONE, Q_ONE_HOT, Q_PROBS, accept_drafts,
                     block_accept, chain_rows, draft_scale, prefix_weight, sampled_row,
                     store_chain_row, store_logprob_row)
from .stats import (PackedRows, RowStats, load_raw_stats, load_row_stats, packed_request,
                    row_layout)


# Stages of the race kernel: both levels in one program per request (V in one chunk), or the
# first level split over chunks of V (partial winners per chunk) and then, one program per
# request, their reduction and the second level.
STAGE_BOTH = tl.constexpr(0)
STAGE_GROUPS = tl.constexpr(1)
STAGE_TOKENS = tl.constexpr(2)


# ----------------------------------------------------------------------------- the race

@triton.jit
def _race_prob(x, x_base, x_thr, inv_norm, scale):
    """p(x) for the race: ``processed_prob`` with ``* (1 / norm)`` for the division (within an
    ulp of it; the race only ranks scores). ``x_base`` is x_max, or 0 for a row with no
    finite logit, so -inf logits give exactly 0 without a test."""
    return tl.where(x >= x_thr, tl.exp2((x - x_base) * scale), 0.0) * inv_norm


@triton.jit
def _race_weights(row_ptr, q_ptr, offs, mask, x_base, x_thr, inv_norm, scale,
                  q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, bm_row_ptr,
                  Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """The race's weights at tokens ``offs`` (``mask`` None for a full tile): ``(p, w, nan)``
    with ``w`` the residual ``max(p_weight * p - q, 0)`` (``p_weight``: block verification's
    ``w_tau``, else 1, which multiplies exactly) and ``nan`` where it is NaN when RESIDUAL,
    else ``w = p`` (never NaN). Masked-off tokens (and, HAS_BITMASK, tokens whose bit is
    cleared) weigh 0; the draft's q never takes the bitmask. Q_LOGITS_T: q one-hot at
    ``draft_token`` where it is >= 0 (a draft temperature of 0: the launcher zeroes
    ``q_inv_norm`` then)."""
    x = allowed_logits(load_logits(row_ptr, offs, mask), offs, mask, bm_row_ptr, HAS_BITMASK)
    p = _race_prob(x, x_base, x_thr, inv_norm, scale)
    if RESIDUAL:
        if Q_MODE == Q_ONE_HOT:
            q = tl.where(offs == draft_token, 1.0, 0.0)
        elif Q_MODE == Q_PROBS:
            if mask is None:
                q = tl.load(q_ptr + offs).to(tl.float32)
            else:
                q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:  # Q_LOGITS, Q_LOGITS_T
            q = _race_prob(load_logits(q_ptr, offs, mask), q_base, q_thr, q_inv_norm, q_scale)
            if Q_MODE == Q_LOGITS_T:
                q = tl.where(offs == draft_token, 1.0, q)
        diff = p_weight * p - q
        return p, tl.where(diff > 0, diff, 0.0), diff != diff
    return p, p, p != p  # never NaN


@triton.jit
def _group_step(row_ptr, q_ptr, offs, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
                q_inv_norm, q_scale, draft_token, p_weight, lane_p, lane_r, lane_nan, bm_row_ptr,
                MASKED: tl.constexpr, Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                HAS_BITMASK: tl.constexpr):
    """One tile of ``_race_groups``: adds the tile's weights to the per-lane sums."""
    p, w, nan = _race_weights(row_ptr, q_ptr, offs, offs < end_v if MASKED else None,
                              x_base, x_thr, inv_norm, scale, q_base, q_thr, q_inv_norm,
                              q_scale, draft_token, p_weight, bm_row_ptr, Q_MODE, RESIDUAL,
                              HAS_BITMASK)
    return lane_p + p, lane_r + w, tl.maximum(lane_nan, nan.to(tl.int32))


@triton.jit
def _race_groups(row_ptr, q_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                 q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                 position,
                 bm_row_ptr,
                 PURPOSE: tl.constexpr, Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """First level of the race (``_rng``: two-level race) over the token groups in
    ``[start_v, end_v)`` (``start_v`` a multiple of GROUP): each group's mass of p and, when
    RESIDUAL, of the residual, divided by the group's Exp(1) noise. Returns
    ``(best_p, group_p, best_r, group_r, has_nan)``: the best scores (-1: no positive mass)
    and their groups (the lowest among equal scores), and whether the residual had a NaN.

    One streaming pass with no Philox per token: per-lane sums over the group's tiles (full
    tiles unmasked), one reduction and one Philox per group."""
    best_p = tl.full([], -1.0, tl.float32)
    group_p = tl.full([], 2147483647, tl.int32)
    best_r = tl.full([], -1.0, tl.float32)
    group_r = tl.full([], 2147483647, tl.int32)
    has_nan = tl.full([], 0, tl.int32)
    for group_start in range(start_v, end_v, GROUP):
        group_end = tl.minimum(group_start + GROUP, end_v)
        lane_p = tl.zeros([BLOCK], tl.float32)
        lane_r = tl.zeros([BLOCK], tl.float32)
        lane_nan = tl.zeros([BLOCK], tl.int32)
        full_end = group_start + (group_end - group_start) // BLOCK * BLOCK
        for start in range(group_start, full_end, BLOCK):
            lane_p, lane_r, lane_nan = _group_step(
                row_ptr, q_ptr, start + tl.arange(0, BLOCK), group_end, x_base, x_thr,
                inv_norm, scale, q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight,
                lane_p, lane_r,
                lane_nan, bm_row_ptr, False, Q_MODE, RESIDUAL, HAS_BITMASK)
        if full_end < group_end:
            lane_p, lane_r, lane_nan = _group_step(
                row_ptr, q_ptr, full_end + tl.arange(0, BLOCK), group_end, x_base, x_thr,
                inv_norm, scale, q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight,
                lane_p, lane_r,
                lane_nan, bm_row_ptr, True, Q_MODE, RESIDUAL, HAS_BITMASK)
        group = group_start // GROUP
        noise = trng.group_noise(seed, offset, position, PURPOSE, group)
        mass_p = tl.sum(lane_p, axis=0)
        score_p = tl.where(mass_p > 0, mass_p / noise, -1.0)
        group_p = tl.where(score_p > best_p, group, group_p)  # strict >: the lowest group
        best_p = tl.maximum(score_p, best_p)
        if RESIDUAL:
            mass_r = tl.sum(lane_r, axis=0)
            score_r = tl.where(mass_r > 0, mass_r / noise, -1.0)
            group_r = tl.where(score_r > best_r, group, group_r)
            best_r = tl.maximum(score_r, best_r)
            has_nan = tl.maximum(has_nan, tl.max(lane_nan, axis=0))
    return best_p, group_p, best_r, group_r, has_nan


@triton.jit
def _token_step(row_ptr, q_ptr, start, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
                q_inv_norm, q_scale, draft_token, p_weight, seed, offset, position, lane_best,
                lane_idx,
                bm_row_ptr, MASKED: tl.constexpr, PURPOSE: tl.constexpr, Q_MODE: tl.constexpr,
                RESIDUAL: tl.constexpr, QUADS: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """One ``[QUADS, 4]`` tile of ``_race_tokens``: per-lane winners, strict ``>``."""
    offs = quad_offsets(start, QUADS)
    _, w, _ = _race_weights(row_ptr, q_ptr, offs, offs < end_v if MASKED else None, x_base,
                            x_thr, inv_norm, scale, q_base, q_thr, q_inv_norm, q_scale,
                            draft_token, p_weight, bm_row_ptr, Q_MODE, RESIDUAL, HAS_BITMASK)
    noise = trng.token_noise(seed, offset, position, PURPOSE, start // 4, QUADS)
    score = tl.where(w > 0, w / noise, -1.0)
    take = score > lane_best
    return tl.where(take, score, lane_best), tl.where(take, offs, lane_idx)


@triton.jit
def _race_tokens(row_ptr, q_ptr, group, V, x_base, x_thr, inv_norm, scale,
                 q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                 position,
                 bm_row_ptr,
                 PURPOSE: tl.constexpr, Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """Second level of the race: ``argmax w_i / E_i`` over the tokens of ``group`` (lowest id
    among equal scores), ``w`` the residual when RESIDUAL, else p, and ``E_i`` the tokens'
    Philox Exp(1) noise, four tokens per Philox: ``[BLOCK // 4, 4]`` tiles, each thread owning
    whole rows of four. -1 when no weight is positive. Scores divide with the fast ``/``
    (within 2 ulp): a winner can change only between scores that close, which the tests
    bound."""
    QUADS: tl.constexpr = BLOCK // 4
    start_v = group * GROUP
    end_v = tl.minimum(start_v + GROUP, V)
    # Per-lane winners across iterations (strict >: a lane's earliest offset among equal
    # scores), reduced once after the loop (max score, lowest id among the lanes holding it).
    lane_best = tl.full([QUADS, 4], -1.0, tl.float32)
    lane_idx = tl.full([QUADS, 4], 2147483647, tl.int32)
    full_end = start_v + (end_v - start_v) // BLOCK * BLOCK
    for start in range(start_v, full_end, BLOCK):
        lane_best, lane_idx = _token_step(
            row_ptr, q_ptr, start, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
            q_inv_norm, q_scale, draft_token, p_weight, seed, offset, position, lane_best,
            lane_idx,
            bm_row_ptr, False, PURPOSE, Q_MODE, RESIDUAL, QUADS, HAS_BITMASK)
    if full_end < end_v:
        lane_best, lane_idx = _token_step(
            row_ptr, q_ptr, full_end, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
            q_inv_norm, q_scale, draft_token, p_weight, seed, offset, position, lane_best,
            lane_idx,
            bm_row_ptr, True, PURPOSE, Q_MODE, RESIDUAL, QUADS, HAS_BITMASK)
    best, idx = tile_best(lane_best, lane_idx)
    return tl.where(best >= 0, idx, -1)


# ----------------------------------------------------------------------------- the race kernel

@triton.jit
def _race_kernel(logits_ptr, stride_req, stride_row, rows_per_req, stats_ptr, argmax_ptr,
                 q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr,
                 draft_ids_ptr, stride_ids, num_draft_tokens_ptr, num_accepted_ptr,
                 temperature_ptr, seed_ptr, offset_ptr, out_ptr, stride_out,
                 part_score_ptr, part_index_ptr, mass_ptr, V, K, chunk_size, bitmask_ptr,
                 bitmask_words, raw_ptr, logprobs_ptr, stride_lp, cu_ptr, num_packed,
                 q_temperature_ptr, slots_ptr, num_slots,
                 PURPOSE: tl.constexpr, IS_CHAIN: tl.constexpr, Q_MODE: tl.constexpr,
                 STAGE: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                 STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                 Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                 GROUP: tl.constexpr, MASS_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                 K_P2: tl.constexpr, BLOCK_METHOD: tl.constexpr, MASS_CHUNKS: tl.constexpr,
                 MASS_CHUNKS_P2: tl.constexpr, HAS_BITMASK: tl.constexpr = False,
                 LOGPROBS: tl.constexpr = 0, PACKED: tl.constexpr = False,
                 SLOTTED: tl.constexpr = False):
    """One correction/bonus (chain) or sample token per request, by the two-level race over
    row ``num_accepted`` (chain) or 0 of the request.

    STAGE_BOTH (grid B) and STAGE_GROUPS (grid B x NUM_CHUNKS, program c racing the groups of
    tokens ``[c * chunk_size, (c + 1) * chunk_size)``) first replay the request's acceptance
    (``accept_drafts``: a few gathered values per draft, cheaper than a launch of its own),
    then race the groups (``_race_groups``); STAGE_GROUPS stores each chunk's winners, and its
    chunk 0 writes the accepted drafts, ``num_accepted`` and the -1 padding. STAGE_TOKENS
    (grid B) reduces the chunks' winners. STAGE_BOTH and STAGE_TOKENS then race the tokens of
    the winning group (``_race_tokens``) and write the token.

    Bytes per request: reads one target row (V * elem_size), plus one draft row (V * elem_size
    of draft_probs / draft_logits) only when the request rejected a draft and is not greedy,
    plus the winning group's GROUP tokens of them again; ~64 B of stats/ids/parameters per
    program and the acceptance's gathers; writes (K + 1) * 4 + 4 B (chain) or 4 B (sample),
    and 20 B of partial winners per program of STAGE_GROUPS. Compute: ~10 operations per
    token of the row and one Philox per group for the first level; one Philox-4x32-10 per
    four tokens and a log per token for the winning group only. Greedy requests read none
    of it: the arg-max comes from the statistics. HAS_BITMASK: every target logit read is
    masked by its row's ``token_bitmask`` word (4 B per 32 logits read; rows ``[B*(K+1), W]``).
    LOGPROBS (processed, raw): also writes ``logprobs`` like the tokens, from the statistics
    already loaded and one gathered logit per emitted token (raw: 8 B of T = 1 statistics
    per row). PACKED (``verify_chain_packed``): the request's rows are read in place, found
    through ``cu_num_draft_tokens`` (``packed_request``; the launcher passes zero request
    strides and the kernel moves the base pointers to the request's first rows). SLOTTED
    (``draft_slots``): the draft rows are read in place at the request's slot
    (``chain_rows``). Q_LOGITS_T: the draft logits at the request's ``draft_temperature``.
    """
    req = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature == 0.0
    scale = exp2_scale(temperature)
    q_temperature = temperature
    if Q_MODE == Q_LOGITS_T:
        q_temperature = tl.load(q_temperature_ptr + req)
    q_scale = draft_scale(scale, q_temperature, Q_MODE)
    seed = tl.load(seed_ptr + req)
    offset = tl.load(offset_ptr + req)
    draft_logprobs = tl.zeros([K_P2], tl.float32)
    num_draft_tokens = tl.full([], 0, tl.int32)
    if IS_CHAIN:
        num_draft_tokens, logits_ptr, q_ptr, draft_ids_ptr, bitmask_ptr = chain_rows(
            req, num_draft_tokens_ptr, cu_ptr, num_packed, logits_ptr, stride_row, q_ptr,
            stride_q_req, stride_q_row, draft_ids_ptr, bitmask_ptr, bitmask_words, K,
            slots_ptr, num_slots, PACKED, SLOTTED)
    # Block verification (BLOCK_METHOD, sampled requests): the residual is
    # max(w_tau p - q, 0); p_weight is 1 otherwise (an exact multiply).
    p_weight = tl.full([], 1.0, tl.float32)
    if STAGE == STAGE_TOKENS:
        num_accepted, rejected = sampled_row(req, num_accepted_ptr, num_draft_tokens,
                                              draft_ids_ptr, stride_ids, V, IS_CHAIN)
        if BLOCK_METHOD:
            if ~greedy:
                p_weight, _ = prefix_weight(
                    req, num_accepted, num_draft_tokens,
                    draft_ids_ptr + req.to(tl.int64) * stride_ids,
                    logits_ptr + req.to(tl.int64) * stride_req, stride_row, stats_ptr,
                    argmax_ptr, q_ptr + req.to(tl.int64) * stride_q_req, stride_q_row,
                    q_stats_ptr, q_argmax_ptr, scale, q_temperature, V, K, bitmask_ptr,
                    bitmask_words,
                    Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2, Q_STATS_CHUNKS, Q_STATS_CHUNKS_P2,
                    HAS_BITMASK)
    elif IS_CHAIN:
        # The token rule's loop also gives the drafts' logprobs (the same values for block:
        # the logprob of an emitted token depends only on its row).
        num_accepted, rejected, draft_logprobs = accept_drafts(
            req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr, q_ptr, stride_q_req,
            stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr, stride_ids,
            num_draft_tokens, greedy, scale, q_temperature, seed, offset, V, K,
            bitmask_ptr, bitmask_words, raw_ptr, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2,
            Q_STATS_CHUNKS, Q_STATS_CHUNKS_P2, HAS_BITMASK, LOGPROBS, K_P2)
        if BLOCK_METHOD:
            if ~greedy:  # greedy requests keep the token rule's answer (section 12)
                num_accepted, rejected, p_weight = block_accept(
                    req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr, q_ptr,
                    stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr,
                    stride_ids, mass_ptr, num_draft_tokens, scale, q_temperature, seed, offset,
                    V, K, bitmask_ptr, bitmask_words, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2,
                    Q_STATS_CHUNKS, Q_STATS_CHUNKS_P2, MASS_CHUNKS, MASS_CHUNKS_P2,
                    HAS_BITMASK)
        if STAGE == STAGE_GROUPS:
            if chunk == 0:  # the token itself follows from STAGE_TOKENS
                store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids,
                                 num_accepted, -1, K, K_P2)
                tl.store(num_accepted_ptr + req, num_accepted)
                if LOGPROBS != LOGPROBS_NONE:
                    store_logprob_row(logprobs_ptr, stride_lp, req, draft_logprobs,
                                       num_accepted, float("nan"), K, K_P2)
    else:
        num_accepted = tl.full([], 0, tl.int32)
        rejected = tl.full([], 0, tl.int1)
    row = req * rows_per_req + num_accepted
    row_ptr = (logits_ptr + req.to(tl.int64) * stride_req
               + num_accepted.to(tl.int64) * stride_row)
    bm_row_ptr = bitmask_ptr + row.to(tl.int64) * bitmask_words
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, row,
                                                tl.full([], 1, tl.int1), scale,
                                                STATS_CHUNKS, STATS_CHUNKS_P2)
    x_base = tl.where(x_max > float("-inf"), x_max, 0.0)
    inv_norm = tl.where(norm > 0.0, 1.0 / norm, 0.0)

    # Whether the race is over the residual. With no draft (Q_NONE) the ``and`` below is a
    # compile-time False, so only the race over p is compiled in.
    use_residual = rejected & (~greedy)
    # The draft distribution at the rejected position.
    last = tl.minimum(num_accepted, tl.maximum(K - 1, 0))
    draft_token = tl.full([], 0, tl.int32)
    q_row_ptr = q_ptr
    q_base = tl.full([], 0.0, tl.float32)
    q_thr = tl.full([], 0.0, tl.float32)
    q_inv_norm = tl.full([], 1.0, tl.float32)
    if Q_MODE == Q_ONE_HOT:
        d = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + last,
                    mask=use_residual, other=0).to(tl.int64)
        draft_token = tl.where((d >= 0) & (d < V), d, 0).to(tl.int32)
    if (Q_MODE == Q_PROBS) or (Q_MODE >= Q_LOGITS):
        q_row_ptr = q_ptr + req.to(tl.int64) * stride_q_req + last.to(tl.int64) * stride_q_row
    if Q_MODE >= Q_LOGITS:
        q_max, q_thr, q_norm, q_arg = load_row_stats(q_stats_ptr, q_argmax_ptr, req * K + last,
                                                     use_residual, q_scale, Q_STATS_CHUNKS,
                                                     Q_STATS_CHUNKS_P2)
        q_base = tl.where(q_max > float("-inf"), q_max, 0.0)
        q_inv_norm = tl.where(q_norm > 0.0, 1.0 / q_norm, 0.0)
        if Q_MODE == Q_LOGITS_T:  # T_q = 0: q one-hot at the draft row's arg-max
            q_greedy = q_temperature == 0.0
            draft_token = tl.where(q_greedy & (q_max > float("-inf")), q_arg, -1)
            q_inv_norm = tl.where(q_greedy, 0.0, q_inv_norm)

    if STAGE == STAGE_TOKENS:
        chunks = tl.arange(0, CHUNKS_P2)
        valid = chunks < NUM_CHUNKS
        part = req * NUM_CHUNKS + chunks
        # Chunks are in group order: max score, lowest group among equal scores.
        best_p, group_p = block_best(
            tl.load(part_score_ptr + part * 2 + 0, mask=valid, other=-2.0),
            tl.load(part_index_ptr + part * 3 + 0, mask=valid, other=2147483647))
        best_r, group_r = block_best(
            tl.load(part_score_ptr + part * 2 + 1, mask=valid, other=-2.0),
            tl.load(part_index_ptr + part * 3 + 1, mask=valid, other=2147483647))
        has_nan = tl.max(tl.load(part_index_ptr + part * 3 + 2, mask=valid, other=0), axis=0)
    else:
        start_v = chunk * chunk_size
        end_v = tl.minimum(start_v + chunk_size, V)
        best_p = tl.full([], -1.0, tl.float32)
        group_p = tl.full([], 2147483647, tl.int32)
        best_r = tl.full([], -1.0, tl.float32)
        group_r = tl.full([], 2147483647, tl.int32)
        has_nan = tl.full([], 0, tl.int32)
        if temperature != 0.0:  # greedy requests take the arg-max from the stats: no pass
            if (Q_MODE != Q_NONE) and use_residual:
                best_p, group_p, best_r, group_r, has_nan = _race_groups(
                    row_ptr, q_row_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                    q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                    num_accepted,
                    bm_row_ptr, PURPOSE, Q_MODE, True, GROUP, MASS_BLOCK, HAS_BITMASK)
            else:
                best_p, group_p, best_r, group_r, has_nan = _race_groups(
                    row_ptr, q_row_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                    q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                    num_accepted,
                    bm_row_ptr, PURPOSE, Q_MODE, False, GROUP, MASS_BLOCK, HAS_BITMASK)
        if STAGE == STAGE_GROUPS:
            part = req * NUM_CHUNKS + chunk
            tl.store(part_score_ptr + part * 2 + 0, best_p)
            tl.store(part_score_ptr + part * 2 + 1, best_r)
            tl.store(part_index_ptr + part * 3 + 0, group_p)
            tl.store(part_index_ptr + part * 3 + 1, group_r)
            tl.store(part_index_ptr + part * 3 + 2, has_nan)

    if STAGE != STAGE_GROUPS:
        # The token: greedy arg-max; else the residual's race when it has mass (a NaN in the
        # residual gives -1, as the reference's amax does); else the race over p; -1 when
        # the winning race had no positive weight. Always -1 or a raced index, so in [0, V).
        token = tl.where(x_max > float("-inf"), argmax, -1)
        if temperature != 0.0:
            token = tl.full([], -1, tl.int32)
            if (Q_MODE != Q_NONE) and (use_residual & (best_r >= 0)):
                if has_nan == 0:
                    token = _race_tokens(
                        row_ptr, q_row_ptr, group_r, V, x_base, x_thr, inv_norm, scale,
                        q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                        num_accepted, bm_row_ptr, PURPOSE, Q_MODE, True, GROUP, BLOCK, HAS_BITMASK)
            elif best_p >= 0:
                token = _race_tokens(
                    row_ptr, q_row_ptr, group_p, V, x_base, x_thr, inv_norm, scale,
                    q_base, q_thr, q_inv_norm, q_scale, draft_token, p_weight, seed, offset,
                    num_accepted,
                    bm_row_ptr, PURPOSE, Q_MODE, False, GROUP, BLOCK, HAS_BITMASK)
            # A row with no finite logit has no distribution: -1 even where an unvalidated
            # negative q gave the residual max(0 - q, 0) mass (contract 7).
            token = tl.where(x_max > float("-inf"), token, -1)
        final_logprob = tl.full([], float("nan"), tl.float32)
        if LOGPROBS != LOGPROBS_NONE:  # one gathered logit: the token won, so it is allowed
            emitted = token >= 0
            raw_max, raw_log_sum = load_raw_stats(raw_ptr, row, emitted, LOGPROBS)
            final_logprob = token_logprob(
                load_logits(row_ptr, tl.maximum(token, 0), emitted), x_max, x_thr, norm, scale,
                greedy, raw_max, raw_log_sum, token, LOGPROBS)
        if IS_CHAIN:
            if STAGE == STAGE_BOTH:
                store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids,
                                 num_accepted, token, K, K_P2)
                tl.store(num_accepted_ptr + req, num_accepted)
                if LOGPROBS != LOGPROBS_NONE:
                    store_logprob_row(logprobs_ptr, stride_lp, req, draft_logprobs,
                                       num_accepted, final_logprob, K, K_P2)
            else:
                tl.store(out_ptr + req.to(tl.int64) * stride_out + num_accepted, token)
                if LOGPROBS != LOGPROBS_NONE:
                    tl.store(logprobs_ptr + req.to(tl.int64) * stride_lp + num_accepted,
                             final_logprob)
        else:
            tl.store(out_ptr + req.to(tl.int64) * stride_out, token)
            if LOGPROBS != LOGPROBS_NONE:
                tl.store(logprobs_ptr + req.to(tl.int64) * stride_lp, final_logprob)


# ----------------------------------------------------------------------------- launcher

# Tests set this to force the split-V path of the race on small vocabularies.
RACE_CHUNK_OVERRIDE: int | None = None


def race_chunks(batch: int, vocab: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(chunk_size, num_chunks, GROUP, MASS_BLOCK, BLOCK) of the race: chunks of whole token
    groups, enough of them to fill the GPU when B is small (a shape-only choice, so no
    synchronisation); tiles of the first level (MASS_BLOCK: 8 logits per thread of 4 warps,
    one 16-byte load of bf16) and of the second (BLOCK), neither larger than a group."""
    group = _rng.RACE_GROUP
    mass_block = min(block_size(vocab, device, cap_gpu=1024), group)
    block = min(block_size(vocab, device, cap_gpu=512), group)
    if RACE_CHUNK_OVERRIDE is not None:
        chunk = RACE_CHUNK_OVERRIDE
    elif interpreted(device):
        chunk = vocab
    else:
        want = max(1, cdiv(4 * num_sms(device), batch))
        chunk = cdiv(vocab, want)
    chunk = cdiv(max(chunk, 1), group) * group
    return chunk, cdiv(vocab, chunk), group, mass_block, block


class DraftInputs(NamedTuple):
    """What a chain's race reads of its drafts: the acceptance it replays and the residual it
    samples after a rejection (``sample`` passes none)."""
    token_ids: torch.Tensor         # [B, K] int32/int64, last dim contiguous (K = 0: any)
    num_draft_tokens: torch.Tensor  # [B] int32 (clamped to [0, K] by the kernel)
    num_accepted: torch.Tensor      # [B] int32, written
    q_mode: int                     # Q_ONE_HOT, Q_PROBS, Q_LOGITS(_T); Q_NONE when K = 0
    q: torch.Tensor | None = None   # [B, K, V] draft_probs (Q_PROBS) or draft_logits (Q_LOGITS)
    q_stats: RowStats | None = None  # row_stats of the draft logits (Q_LOGITS)
    # Block verification: ``block.residual_masses``' partials [B, K-1, chunks] and chunks.
    masses: torch.Tensor | None = None
    mass_chunks: int = 1
    slots: torch.Tensor | None = None  # draft_slots [B]: q is [S, K', V'], read at the slots
    q_temperature: torch.Tensor | None = None  # draft_temperature [B] float32 (Q_LOGITS_T)


def draft_arguments(drafts: DraftInputs, packed, dummy_f: torch.Tensor,
                    dummy_i: torch.Tensor) -> tuple:
    """``(q, stride_q_req, stride_q_row)`` and ``(q_temperature_ptr, slots_ptr, num_slots)``
    of the kernels reading ``drafts``, and their constexprs (``SLOTTED``)."""
    q = drafts.q if drafts.q is not None else dummy_f
    if drafts.q is None:
        strides = (0, 0)
    elif packed is None or drafts.slots is not None:
        strides = (q.stride(0), q.stride(1))
    else:
        strides = (0, q.stride(0))
    slotted = drafts.slots is not None and drafts.q is not None
    extra = (drafts.q_temperature if drafts.q_temperature is not None else dummy_f,
             drafts.slots if slotted else dummy_i, q.shape[0] if slotted else 0)
    return (q, *strides), extra, ({"SLOTTED": True} if slotted else {})


def race(logits: torch.Tensor, stats: RowStats, params, seeds: torch.Tensor,
         offsets: torch.Tensor, out: torch.Tensor, drafts: DraftInputs | None = None,
         bitmask: torch.Tensor | None = None, logprobs: torch.Tensor | None = None,
         logprobs_kind: int = 0, packed: PackedRows | None = None) -> None:
    """Launch the race over ``logits`` ``[B, K + 1, V]`` (last dim contiguous) with their
    ``row_stats``: one launch when V is one chunk, else the first level over chunks and the
    second per request. Writes ``out[b, num_accepted[b]]`` of ``out`` ``[B, K + 1]`` (and, with
    ``drafts``, the accepted drafts, the -1 padding and ``num_accepted``); without drafts
    (``sample``: K = 0) one token per request into ``out[b, 0]``. ``bitmask``: int32
    ``[B * (K + 1), W]`` ``token_bitmask`` rows of the target logits (contiguous); None
    compiles it out. ``logprobs``: float32 like ``out``, written at the same places with
    ``logprobs_kind`` (``LOGPROBS_KINDS``; raw reads ``stats.raw``). ``packed``: ``logits``
    are the packed rows ``[T + B, V]`` (``drafts.q`` ``[T, V]``, ids ``[T]``, bitmask
    ``[T + B, W]``), read in place."""
    batch, rows_per_req, vocab, strides = row_layout(logits, packed)
    device = logits.device
    if batch == 0:
        return
    num_drafts = rows_per_req - 1
    chunk, num_chunks, group, mass_block, block = race_chunks(batch, vocab, device)
    dummy_f, dummy_i = scratch(device, torch.float32), scratch(device, torch.int32)
    part_score = torch.empty((batch, num_chunks, 2), dtype=torch.float32, device=device) \
        if num_chunks > 1 else dummy_f
    part_index = torch.empty((batch, num_chunks, 3), dtype=torch.int32, device=device) \
        if num_chunks > 1 else dummy_i
    is_chain = drafts is not None
    if not is_chain:
        drafts = DraftInputs(dummy_i, dummy_i, dummy_i, Q_NONE)
    q_args, q_extra, q_constexprs = draft_arguments(drafts, packed, dummy_f, dummy_i)
    q_stats = drafts.q_stats or RowStats(dummy_f, dummy_i, 1)
    args = (logits, *strides, rows_per_req, stats.stats, stats.argmax,
            *q_args, q_stats.stats, q_stats.argmax,
            drafts.token_ids, drafts.token_ids.stride(0) if packed is None else 0,
            drafts.num_draft_tokens,
            drafts.num_accepted, params.temperature, seeds, offsets, out, out.stride(0),
            part_score, part_index, drafts.masses if drafts.masses is not None else dummy_f,
            vocab, num_drafts, chunk,
            bitmask if bitmask is not None else dummy_i,
            bitmask.shape[-1] if bitmask is not None else 0,
            stats.raw if logprobs_kind == int(LOGPROBS_RAW) else dummy_f,
            logprobs if logprobs is not None else dummy_f,
            logprobs.stride(0) if logprobs is not None else 0,
            packed.cu_num_draft_tokens if packed is not None else dummy_i,
            packed.num_packed if packed is not None else 0, *q_extra)
    constexprs = dict(**q_constexprs, PURPOSE=PURPOSE_RESAMPLE if is_chain else PURPOSE_SAMPLE,
                      IS_CHAIN=is_chain, Q_MODE=int(drafts.q_mode), NUM_CHUNKS=num_chunks,
                      CHUNKS_P2=next_pow2(num_chunks), GROUP=group, MASS_BLOCK=mass_block,
                      BLOCK=block, K_P2=next_pow2(num_drafts + 1), **stats.constexprs(),
                      **q_stats.constexprs("Q_"), BLOCK_METHOD=drafts.masses is not None,
                      MASS_CHUNKS=drafts.mass_chunks,
                      MASS_CHUNKS_P2=next_pow2(drafts.mass_chunks), **launch_options(device, 4))
    if bitmask is not None:  # compiled in only when used
        constexprs["HAS_BITMASK"] = True
    if logprobs_kind != int(LOGPROBS_NONE):
        constexprs["LOGPROBS"] = logprobs_kind
    if packed is not None:
        constexprs["PACKED"] = True
    if num_chunks == 1:
        _race_kernel[(batch, 1)](*args, STAGE=int(STAGE_BOTH), **constexprs)
    else:
        _race_kernel[(batch, num_chunks)](*args, STAGE=int(STAGE_GROUPS), **constexprs)
        _race_kernel[(batch, 1)](*args, STAGE=int(STAGE_TOKENS), **constexprs)
