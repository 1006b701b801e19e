"""Per-row statistics of the processed target distribution, in one streaming pass.

A row of logits ``x`` (any of fp32/bf16/fp16, read in its own dtype) is described by four
numbers, so no probability tensor is ever materialised:

* ``x_max``   the largest finite logit (NaN and +-inf count as -inf);
* ``x_thr``   the top-k/top-p cut: token i is kept iff ``x_i >= x_thr`` (``-inf``: no cut;
  found by ``filters.py``);
* ``norm``    ``sum(exp(z_i))`` over the kept tokens, ``z_i = (x_i - x_max) / T``;
* ``argmax``  the lowest token id among the largest logits (greedy rows).

so ``p_i = exp(z_i) / norm`` for kept tokens and 0 otherwise (``_tiles.processed_prob``).
The race (``race.py``) and the tree walk (``tree.py``) read them with ``load_row_stats``.

Rounding differs from the reference only in the last ulp of ``norm`` (summation order), of
``z`` (``* (1/T)`` instead of ``/ T``) and of ``exp``/``log``; tokens differ only when a
decision falls within that rounding of its threshold (measured in the tests).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import filters
from ._launch import MAX_REGISTERS, interpreted, next_pow2, row_chunks, scratch
from ._tiles import LOG2E, LOGPROBS_RAW, allowed_logits, exp2_scale, load_logits
from .filters import filter_threshold


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _merge_max_sum(lane_max, lane_sum, lane_arg, scale):
    """Merges per-lane (or per-chunk) online-softmax statistics: the row max, ``sum(exp(z))``
    relative to it and the lowest arg-max id (2**31 - 1 without a finite logit)."""
    x_max = tl.max(lane_max, axis=0)
    # Lanes without a finite logit hold sum 0 at max -inf (skipped: -inf - -inf is NaN).
    lane_live = lane_max > float("-inf")
    lane_scale = tl.exp2(tl.where(lane_live, lane_max - x_max, 0.0) * scale)
    total = tl.sum(tl.where(lane_live, lane_sum * lane_scale, 0.0), axis=0)
    best = tl.min(tl.where(lane_live & (lane_max == x_max), lane_arg, 2147483647), axis=0)
    return x_max, total, best


@triton.jit
def _combine_stats(lane_max, lane_sum, lane_arg, lane_min, lane_count, scale):
    """``_merge_max_sum``, and the finite min and count (the filters' search range)."""
    x_max, total, best = _merge_max_sum(lane_max, lane_sum, lane_arg, scale)
    return x_max, total, best, tl.min(lane_min, axis=0), tl.sum(lane_count, axis=0)


@triton.jit
def _online_sum(lane_max, lane_sum, x, tile_max, scale):
    """One tile of an online softmax sum per lane: the new running max and
    ``sum(exp2((x - max) * scale))`` rescaled to it."""
    new_max = tl.maximum(lane_max, tile_max)
    # Exponents are taken from a finite base (0 while the lane has seen no finite logit), so
    # a -inf logit gives exactly 0 without a per-logit test. An unchanged max rescales by
    # exactly 1; a lane leaving -inf rescales its sum 0 by 0.
    base = tl.where(new_max > float("-inf"), new_max, 0.0)
    rescale = tl.where(lane_max == new_max, 1.0, tl.exp2((lane_max - base) * scale))
    return new_max, lane_sum * rescale + tl.sum(tl.exp2((x - base[:, None]) * scale), axis=1)


@triton.jit
def _stats_step(row_ptr, offs, end_v, scale, lane_max, lane_sum, lane_arg, lane_min, lane_count,
                bm_row_ptr, lane_raw_max, lane_raw_sum, MASKED: tl.constexpr,
                TRACK_RANGE: tl.constexpr, HAS_BITMASK: tl.constexpr, RAW: tl.constexpr):
    """One [LANES, R] tile of ``_stream_stats``."""
    if MASKED:
        x = load_logits(row_ptr, offs, offs < end_v)
    else:
        x = load_logits(row_ptr, offs, None)
    if RAW:  # the model's own row: T = 1, before the bitmask
        lane_raw_max, lane_raw_sum = _online_sum(lane_raw_max, lane_raw_sum, x,
                                                 tl.max(x, axis=1), LOG2E)
    x = allowed_logits(x, offs, offs < end_v if MASKED else None, bm_row_ptr, HAS_BITMASK)
    tile_max = tl.max(x, axis=1)
    tile_arg = tl.min(tl.where(x == tile_max[:, None], offs, 2147483647), axis=1)
    # Offsets increase along a lane, so a strict > keeps the lane's earliest arg-max.
    lane_arg = tl.where(tile_max > lane_max, tile_arg, lane_arg)
    new_max, lane_sum = _online_sum(lane_max, lane_sum, x, tile_max, scale)
    if TRACK_RANGE:
        finite = x > float("-inf")
        lane_min = tl.minimum(lane_min, tl.min(tl.where(finite, x, float("inf")), axis=1))
        lane_count += tl.sum(finite.to(tl.int32), axis=1)
    return new_max, lane_sum, lane_arg, lane_min, lane_count, lane_raw_max, lane_raw_sum


@triton.jit
def _stream_stats(row_ptr, start_v, end_v, scale, bm_row_ptr, TRACK_RANGE: tl.constexpr,
                  BLOCK: tl.constexpr, R: tl.constexpr, HAS_BITMASK: tl.constexpr,
                  RAW: tl.constexpr):
    """One streaming pass over tokens [start_v, end_v) of a row, in [BLOCK // R, R] tiles.

    Lane l of the tile keeps its own running max, online-softmax sum, earliest arg-max and
    (TRACK_RANGE, for the filters' search) finite min and count over its R logits per
    iteration: one rescaling exp per R logits instead of one per logit, and an element-wise
    loop body (no CTA-wide reduction, no barrier). The lanes are merged once at the end.
    Full tiles load without a mask (so R logits are one vector load); only the last, partial
    tile is masked. HAS_BITMASK: the row's ``token_bitmask`` words are read with the logits
    (tokens whose bit is cleared count as -inf). RAW: also the max and sum of the unmasked
    row at T = 1 (raw logprobs), returned after the five statistics (else 0, 0).
    """
    LANES: tl.constexpr = BLOCK // R
    lane_max = tl.full([LANES], float("-inf"), tl.float32)
    lane_sum = tl.zeros([LANES], tl.float32)
    lane_arg = tl.full([LANES], 2147483647, tl.int32)
    lane_min = tl.full([LANES], float("inf"), tl.float32)
    lane_count = tl.zeros([LANES], tl.int32)
    lane_raw_max = tl.full([LANES], float("-inf"), tl.float32)
    lane_raw_sum = tl.zeros([LANES], tl.float32)
    tile = tl.arange(0, LANES)[:, None] * R + tl.arange(0, R)[None, :]
    full_end = start_v + (end_v - start_v) // BLOCK * BLOCK
    for start in range(start_v, full_end, BLOCK):
        lane_max, lane_sum, lane_arg, lane_min, lane_count, lane_raw_max, lane_raw_sum = \
            _stats_step(row_ptr, start + tile, end_v, scale, lane_max, lane_sum, lane_arg,
                        lane_min, lane_count, bm_row_ptr, lane_raw_max, lane_raw_sum, False,
                        TRACK_RANGE, HAS_BITMASK, RAW)
    if full_end < end_v:
        lane_max, lane_sum, lane_arg, lane_min, lane_count, lane_raw_max, lane_raw_sum = \
            _stats_step(row_ptr, full_end + tile, end_v, scale, lane_max, lane_sum, lane_arg,
                        lane_min, lane_count, bm_row_ptr, lane_raw_max, lane_raw_sum, True,
                        TRACK_RANGE, HAS_BITMASK, RAW)
    x_max, total, best, x_min, num_finite = _combine_stats(lane_max, lane_sum, lane_arg,
                                                           lane_min, lane_count, scale)
    raw_max = tl.full([], 0.0, tl.float32)
    raw_sum = tl.full([], 0.0, tl.float32)
    if RAW:
        raw_max, raw_sum, _ = _merge_max_sum(lane_raw_max, lane_raw_sum, lane_arg, LOG2E)
    return x_max, total, best, x_min, num_finite, raw_max, raw_sum



@triton.jit
def _finish_row(row_ptr, r, req, V, x_max, total, best, x_min, num_finite, greedy, scale,
                temperature, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, argmax_ptr,
                cand_key_ptr, cand_e_ptr, bm_row_ptr, USE_TOP_K: tl.constexpr,
                USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr, KEY_SHIFT: tl.constexpr,
                BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                CAP: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """Applies top-k, min-p, then top-p to a row's merged statistics (``filter_threshold``) and stores
    ``(x_max, x_thr, norm)`` and the arg-max."""
    # A row with no finite logit: id 0, never emitted.
    best = tl.where(x_max > float("-inf"), best, 0)
    x_thr, norm = filter_threshold(row_ptr, r, req, V, x_max, total, x_min, num_finite, greedy,
                                   scale, temperature, top_k_ptr, top_p_ptr, min_p_ptr,
                                   cand_key_ptr, cand_e_ptr, bm_row_ptr, USE_TOP_K, USE_TOP_P,
                                   USE_MIN_P, KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP,
                                   HAS_BITMASK)
    tl.store(stats_ptr + r * 3 + 0, x_max)
    tl.store(stats_ptr + r * 3 + 1, x_thr)
    tl.store(stats_ptr + r * 3 + 2, norm)
    tl.store(argmax_ptr + r, best)


@triton.jit
def packed_request(cu_ptr, req, num_packed, K):
    """``(first draft, number of drafts)`` of request ``req`` in the packed layout
    (``verify_chain_packed``: ``cu[req]`` and ``cu[req+1] - cu[req]``), read from
    ``cu_num_draft_tokens`` itself. Clamped so that unvalidated offsets never address a row
    out of range: the first draft to ``0..T``, the count to ``0..min(K, T - first)``. Its
    first target row is ``first + req``."""
    lo = tl.load(cu_ptr + req).to(tl.int64)
    hi = tl.load(cu_ptr + req + 1).to(tl.int64)
    first = tl.minimum(tl.maximum(lo, 0), num_packed)
    count = tl.minimum(tl.minimum(tl.maximum(hi - lo, 0), K), num_packed - first)
    return first, count.to(tl.int32)


@triton.jit
def _stats_row(r, logits_ptr, stride_req, stride_row, rows_per_req, temperature_ptr,
               bitmask_ptr, bitmask_words, cu_ptr, num_packed, live_extra, slots_ptr,
               num_slots, PACKED: tl.constexpr, SLOTTED: tl.constexpr):
    """Row ``r`` of the statistics: its request, the row's pointer, whether the request is
    greedy, its ``exp2_scale``, its temperature, its ``token_bitmask`` row (only read with
    HAS_BITMASK) and whether it is live.

    PACKED (``verify_chain_packed``): statistics row ``r = req * rows_per_req + j`` is row
    ``first + req * live_extra + j`` of the packed rows (``packed_request``), live while
    ``j < n + live_extra`` (``live_extra`` 1 for target rows: the drafts, then the bonus row;
    0 for draft rows); the bitmask rows are the packed rows. Dead rows (the padding of shorter
    requests) stream nothing. Otherwise row ``r`` of ``[B, R, V]`` and of the bitmask
    ``[B * R, W]``, always live. SLOTTED (draft rows of ``draft_slots``, padded or packed):
    the row is ``logits[slot, j]`` of ``[S, K', V']`` (slot clamped to ``[0, S - 1]``)."""
    req = r // rows_per_req
    j = r % rows_per_req
    if PACKED:
        first, count = packed_request(cu_ptr, req, num_packed, rows_per_req - live_extra)
        row = first + req * live_extra + j
        row_ptr = logits_ptr + row * stride_row
        live = j < count + live_extra
    else:
        row = r.to(tl.int64)
        row_ptr = logits_ptr + req.to(tl.int64) * stride_req + j.to(tl.int64) * stride_row
        live = j >= 0
    if SLOTTED:
        slot = tl.minimum(tl.maximum(tl.load(slots_ptr + req).to(tl.int64), 0), num_slots - 1)
        row_ptr = logits_ptr + slot * stride_req + j.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + req)
    return (req, row_ptr, temperature == 0.0, exp2_scale(temperature), temperature,
            bitmask_ptr + row * bitmask_words, live)


@triton.jit
def _row_stats_kernel(logits_ptr, stride_req, stride_row, rows_per_req,
                      temperature_ptr, top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr,
                      part_f_ptr, part_i_ptr, cand_key_ptr, cand_e_ptr, V, min_p_ptr,
                      bitmask_ptr, bitmask_words, raw_ptr, cu_ptr, num_packed, live_extra,
                      slots_ptr, num_slots, chunk_size,
                      USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, KEY_SHIFT: tl.constexpr,
                      NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr,
                      BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                      CAP: tl.constexpr, USE_MIN_P: tl.constexpr = False,
                      HAS_BITMASK: tl.constexpr = False, RAW: tl.constexpr = False,
                      PACKED: tl.constexpr = False, SLOTTED: tl.constexpr = False):
    """Per-row statistics of the processed distribution; grid (rows, NUM_CHUNKS), program
    (r, c) streams tokens ``[c * chunk_size, (c + 1) * chunk_size)`` of row r.

    NUM_CHUNKS == 1: the program finishes its row (top-k/min-p/top-p and the stores). Otherwise it
    writes its chunk's partial statistics and ``_row_stats_finish_kernel`` merges them: a
    row split over programs keeps every SM busy when B * (K + 1) rows are fewer than SMs.

    Bytes: reads V * elem_size once per row; writes 16 B per row (3 float32 + 1 int32), or
    20 B of partials per program; plus V * elem_size per pivot pass for a row whose top-k or
    top-p is active (~log_9(key span) passes each, <= 6 for bf16, <= 11 for fp32); rows with
    the filters off (and greedy rows) do no pass beyond the first; one pass for a row whose
    min-p is active (over top-k's candidates when it has them). HAS_BITMASK: V / 8 B more of
    ``token_bitmask`` words per pass. RAW (raw logprobs): 8 B more per row or program (the
    T = 1 max and sum of the unmasked row, to ``raw_ptr``: ``[rows, 2]`` finished, then the
    ``[rows, NUM_CHUNKS, 2]`` partials).
    """
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    req, row_ptr, greedy, scale, temperature, bm_row_ptr, live = _stats_row(
        r, logits_ptr, stride_req, stride_row, rows_per_req, temperature_ptr, bitmask_ptr,
        bitmask_words, cu_ptr, num_packed, live_extra, slots_ptr, num_slots, PACKED, SLOTTED)
    start_v = chunk * chunk_size
    end_v = tl.where(live, tl.minimum(start_v + chunk_size, V), start_v)
    x_max, total, best, x_min, num_finite, raw_max, raw_sum = _stream_stats(
        row_ptr, start_v, end_v, scale, bm_row_ptr, USE_TOP_K or USE_TOP_P or USE_MIN_P, BLOCK,
        R, HAS_BITMASK, RAW)
    if NUM_CHUNKS == 1:
        _finish_row(row_ptr, r, req, V, x_max, total, best, x_min, num_finite, greedy, scale,
                    temperature, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, argmax_ptr,
                    cand_key_ptr, cand_e_ptr, bm_row_ptr, USE_TOP_K, USE_TOP_P, USE_MIN_P,
                    KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP, HAS_BITMASK)
        if RAW:
            tl.store(raw_ptr + r * 2 + 0, raw_max)
            tl.store(raw_ptr + r * 2 + 1, raw_sum)
    else:
        part = r * NUM_CHUNKS + chunk
        tl.store(part_f_ptr + part * 3 + 0, x_max)
        tl.store(part_f_ptr + part * 3 + 1, total)
        tl.store(part_f_ptr + part * 3 + 2, x_min)
        tl.store(part_i_ptr + part * 2 + 0, best)
        tl.store(part_i_ptr + part * 2 + 1, num_finite)
        if RAW:  # the partials after the finished rows, merged by the finish kernel
            raw_parts = raw_ptr + tl.num_programs(0).to(tl.int64) * 2
            tl.store(raw_parts + part * 2 + 0, raw_max)
            tl.store(raw_parts + part * 2 + 1, raw_sum)


@triton.jit
def _row_stats_finish_kernel(logits_ptr, stride_req, stride_row, rows_per_req,
                             temperature_ptr, top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr,
                             part_f_ptr, part_i_ptr, cand_key_ptr, cand_e_ptr, V,
                             min_p_ptr, bitmask_ptr, bitmask_words, raw_ptr, cu_ptr,
                             num_packed, live_extra, slots_ptr, num_slots,
                             USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                             KEY_SHIFT: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                             CHUNKS_P2: tl.constexpr, BLOCK_S: tl.constexpr,
                             UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                             CAP: tl.constexpr, USE_MIN_P: tl.constexpr = False,
                             HAS_BITMASK: tl.constexpr = False, RAW: tl.constexpr = False,
                             PACKED: tl.constexpr = False, SLOTTED: tl.constexpr = False):
    """Merges the NUM_CHUNKS partial statistics of one row (grid rows), then finishes it as
    ``_row_stats_kernel`` does. Bytes: reads 20 B per chunk (plus the pivot passes of rows
    whose filters are active), writes 16 B."""
    r = tl.program_id(0)
    req, row_ptr, greedy, scale, temperature, bm_row_ptr, live = _stats_row(
        r, logits_ptr, stride_req, stride_row, rows_per_req, temperature_ptr, bitmask_ptr,
        bitmask_words, cu_ptr, num_packed, live_extra, slots_ptr, num_slots, PACKED, SLOTTED)
    chunks = tl.arange(0, CHUNKS_P2)
    valid = chunks < NUM_CHUNKS
    part = r * NUM_CHUNKS + chunks
    x_max, total, best, x_min, num_finite = _combine_stats(
        tl.load(part_f_ptr + part * 3 + 0, mask=valid, other=float("-inf")),
        tl.load(part_f_ptr + part * 3 + 1, mask=valid, other=0.0),
        tl.load(part_i_ptr + part * 2 + 0, mask=valid, other=2147483647),
        tl.load(part_f_ptr + part * 3 + 2, mask=valid, other=float("inf")),
        tl.load(part_i_ptr + part * 2 + 1, mask=valid, other=0), scale)
    _finish_row(row_ptr, r, req, V, x_max, total, best, x_min, num_finite, greedy, scale,
                temperature, top_k_ptr, top_p_ptr, min_p_ptr, stats_ptr, argmax_ptr,
                cand_key_ptr, cand_e_ptr, bm_row_ptr, USE_TOP_K, USE_TOP_P, USE_MIN_P,
                KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP, HAS_BITMASK)
    if RAW:
        raw_parts = raw_ptr + tl.num_programs(0).to(tl.int64) * 2
        raw_max, raw_sum, _ = _merge_max_sum(
            tl.load(raw_parts + part * 2 + 0, mask=valid, other=float("-inf")),
            tl.load(raw_parts + part * 2 + 1, mask=valid, other=0.0), chunks, LOG2E)
        tl.store(raw_ptr + r * 2 + 0, raw_max)
        tl.store(raw_ptr + r * 2 + 1, raw_sum)


@triton.jit
def load_raw_stats(raw_ptr, row, mask, LOGPROBS: tl.constexpr):
    """``(max, log(sum(exp(x - max))))`` of statistics row ``row`` at T = 1 without filters or
    bitmask (``row_stats(raw=True)``); only read when LOGPROBS is raw (else 0, 0)."""
    if LOGPROBS == LOGPROBS_RAW:
        raw_max = tl.load(raw_ptr + row * 2 + 0, mask=mask, other=0.0)
        raw_log_sum = tl.log(tl.load(raw_ptr + row * 2 + 1, mask=mask, other=1.0))
    else:
        raw_max = tl.full([], 0.0, tl.float32)
        raw_log_sum = tl.full([], 0.0, tl.float32)
    return raw_max, raw_log_sum


@triton.jit
def load_row_stats(stats_ptr, argmax_ptr, row, mask, scale, STATS_CHUNKS: tl.constexpr,
                   STATS_CHUNKS_P2: tl.constexpr):
    """``(x_max, x_thr, norm, argmax)`` of statistics row ``row`` for a kernel that consumes
    ``row_stats`` (``(-inf, 0, 1, -1)`` where ``mask`` is false).

    STATS_CHUNKS == 1: the row as ``_finish_row`` stored it. Otherwise ``stats_ptr`` and
    ``argmax_ptr`` hold the STATS_CHUNKS partials of an unfiltered row (``row_stats`` with
    ``merge_in_consumer``), merged here with the finish kernel's operations in its order, so
    the result is the same to the bit and the finish kernel's launch is saved. Reads 12 B per
    chunk."""
    if STATS_CHUNKS == 1:
        x_max = tl.load(stats_ptr + row * 3 + 0, mask=mask, other=float("-inf"))
        x_thr = tl.load(stats_ptr + row * 3 + 1, mask=mask, other=0.0)
        norm = tl.load(stats_ptr + row * 3 + 2, mask=mask, other=1.0)
        argmax = tl.load(argmax_ptr + row, mask=mask, other=-1)
    else:
        chunks = tl.arange(0, STATS_CHUNKS_P2)
        valid = (chunks < STATS_CHUNKS) & mask
        part = row * STATS_CHUNKS + chunks
        x_max, total, best = _merge_max_sum(
            tl.load(stats_ptr + part * 3 + 0, mask=valid, other=float("-inf")),
            tl.load(stats_ptr + part * 3 + 1, mask=valid, other=0.0),
            tl.load(argmax_ptr + part * 2 + 0, mask=valid, other=2147483647), scale)
        x_thr = tl.where(mask, float("-inf"), 0.0)
        norm = tl.where(mask, total, 1.0)
        # A row with no finite logit: id 0, never emitted (as _finish_row).
        argmax = tl.where(mask, tl.where(x_max > float("-inf"), best, 0), -1)
    return x_max, x_thr, norm, argmax



# ----------------------------------------------------------------------------- launcher

# Vocabulary block of the statistics' streaming pass on a GPU (8 warps: 16 logits per thread
# per iteration), as tiles of STATS_R logits per lane: one rescaling exp per STATS_R logits, and
# STATS_R = 8 bf16 logits are one 16-byte load. The tile's accumulators are BLOCK / STATS_R per
# program, so the block costs few registers (python_tests/test_triton_compile.py: no spills).
STATS_BLOCK = 4096
STATS_R = 8

# At most this many programs per row: the finish kernel merges them as one vector (32
# spills in ptxas's allocation with the filters on; 16 and below do not).
MAX_STATS_CHUNKS = 16

# Warps of the finish kernel when it searches (filters compiled in): it runs when rows are
# few, one program per row, so each program streams twice the statistics kernel's 1024
# logits per pass iteration (BLOCK_S 256 x 8 blocks; no spills on sm_80/sm_90).
FINISH_SEARCH_WARPS = 16

# Tests set this to force the split-row path of the statistics on small vocabularies.
STATS_CHUNK_OVERRIDE: int | None = None


def stats_chunks(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(chunk_size, num_chunks, BLOCK) of the statistics pass: rows split until there are
    about 8 programs per SM."""
    return row_chunks(rows, vocab, device, cap_gpu=STATS_BLOCK, programs_per_sm=8,
                      max_chunks=MAX_STATS_CHUNKS, override=STATS_CHUNK_OVERRIDE)


class PackedRows(NamedTuple):
    """Statistics rows read in place from the packed layout (``verify_chain_packed``, see
    ``_stats_row``): ``B * rows_per_req`` rows of ``[rows, V]`` found through
    ``cu_num_draft_tokens``."""
    cu_num_draft_tokens: torch.Tensor  # [B+1] int32/int64, on the device
    num_packed: int                    # T
    rows_per_req: int                  # K + 1 (target rows) or K (draft rows)
    live_extra: int                    # 1: target rows (drafts and bonus); 0: draft rows


class SlotRows(NamedTuple):
    """Draft rows read in place through ``draft_slots``: ``logits`` is ``[S, K', V']`` and
    statistics row ``b * K + j`` is ``logits[slots[b], j, :V]``."""
    slots: torch.Tensor  # [B] int32/int64 (clamped by the kernel)
    batch: int           # B
    rows_per_req: int    # K
    vocab: int           # V (the target's)


def row_layout(logits: torch.Tensor, packed: PackedRows | None,
               slotted: SlotRows | None = None):
    """``(B, rows per request, V, (request stride, row stride))`` of ``logits`` ``[B, R, V]``,
    or of the packed rows ``[N, V]`` read through ``packed`` (request stride 0: the kernels
    find each request's first row themselves), or of the per-slot rows ``[S, K', V']`` of
    ``slotted`` (slot stride, position stride)."""
    if slotted is not None:
        return (slotted.batch, slotted.rows_per_req, slotted.vocab,
                (logits.stride(0), logits.stride(1)))
    if packed is None:
        batch, rows_per_req, vocab = logits.shape
        return batch, rows_per_req, vocab, (logits.stride(0), logits.stride(1))
    return (packed.cu_num_draft_tokens.shape[0] - 1, packed.rows_per_req, logits.shape[-1],
            (0, logits.stride(0)))


class RowStats(NamedTuple):
    """What ``row_stats`` leaves for the kernels that consume it (``load_row_stats``)."""
    stats: torch.Tensor   # float32 [rows, 3] (x_max, x_thr, norm); partials: [rows, chunks, 3]
    argmax: torch.Tensor  # int32 [rows]; partials: [rows, chunks, 2] (arg-max, finite count)
    chunks: int           # 1: finished rows; > 1: unmerged partials (the STATS_CHUNKS constexpr)
    raw: torch.Tensor | None = None  # float32 [rows, 2]: T = 1 (max, sum) with raw=True

    def constexprs(self, prefix: str = "") -> dict:
        """The consumer's constexprs (``Q_`` prefix: the draft logits' statistics)."""
        return {f"{prefix}STATS_CHUNKS": self.chunks,
                f"{prefix}STATS_CHUNKS_P2": next_pow2(self.chunks)}


def row_stats(logits: torch.Tensor, params, *, merge_in_consumer: bool = False,
              bitmask: torch.Tensor | None = None, raw: bool = False,
              packed: PackedRows | None = None, slotted: SlotRows | None = None) -> RowStats:
    """Launch ``_row_stats_kernel`` (and ``_row_stats_finish_kernel`` when rows are split)
    over the ``B * R`` rows of ``logits`` ``[B, R, V]`` (last dim contiguous, any strides
    otherwise), statistics row ``b * R + r``, request ``b``.

    ``merge_in_consumer``: when rows are split and no filter is on, the finish kernel would
    only merge the partials; skip its launch and return the partials, which the consuming
    kernel merges as it reads a row (``load_row_stats``). Filtered rows (top-k, top-p, min-p)
    are always finished here (their threshold search runs in the finish kernel).
    ``bitmask``: int32 ``[B * R, W]`` ``token_bitmask`` rows (contiguous), read in the same
    passes; None compiles it out. ``raw``: also the T = 1 statistics of the unmasked rows
    (``RowStats.raw``, for raw logprobs; rows split are then finished here too).
    ``packed``: ``logits`` are the packed rows ``[T + B, V]`` (or ``[T, V]`` of draft logits),
    found through ``cu_num_draft_tokens``; the bitmask rows are the packed rows. ``slotted``:
    draft rows read in place at their requests' slots (``SlotRows``; with ``packed`` too,
    which then gives only the live rows)."""
    batch, rows_per_req, vocab, strides = row_layout(logits, packed, slotted)
    rows = batch * rows_per_req
    device = logits.device
    if rows == 0:
        return RowStats(torch.empty((0, 3), dtype=torch.float32, device=device),
                        torch.empty(0, dtype=torch.int32, device=device), 1)
    chunk, num_chunks, block = stats_chunks(rows, vocab, device)
    if num_chunks > 1:
        part_f = torch.empty((rows, num_chunks, 3), dtype=torch.float32, device=device)
        part_i = torch.empty((rows, num_chunks, 2), dtype=torch.int32, device=device)
    else:
        part_f, part_i = scratch(device, torch.float32), scratch(device, torch.int32)
    use_top_k = bool(params.uses_top_k) and not params.all_greedy
    use_top_p = bool(params.uses_top_p) and not params.all_greedy
    use_min_p = bool(params.uses_min_p) and not params.all_greedy
    finish = num_chunks > 1 and (use_top_k or use_top_p or use_min_p or raw
                                 or not merge_in_consumer)
    if num_chunks == 1 or finish:
        stats = torch.empty((rows, 3), dtype=torch.float32, device=device)
        argmax = torch.empty(rows, dtype=torch.int32, device=device)
    else:
        stats, argmax = scratch(device, torch.float32), scratch(device, torch.int32)
    cap = filters.candidate_capacity(use_top_k or use_top_p)
    if cap > 0:
        cand_key = torch.empty((rows, cap), dtype=torch.int32, device=device)
        cand_e = torch.empty((rows, cap), dtype=torch.float32, device=device)
    else:
        cand_key, cand_e = scratch(device, torch.int32), scratch(device, torch.float32)
    constexprs = dict(USE_TOP_K=use_top_k, USE_TOP_P=use_top_p,
                      KEY_SHIFT=filters.KEY_SHIFTS[logits.dtype], NUM_CHUNKS=num_chunks, CAP=cap)
    args = (logits, *strides, rows_per_req, params.temperature,
            params.top_k, params.top_p, stats, argmax, part_f, part_i, cand_key, cand_e, vocab,
            params.min_p if use_min_p else scratch(device, torch.float32),
            bitmask if bitmask is not None else scratch(device, torch.int32),
            bitmask.shape[-1] if bitmask is not None else 0)
    raw_stats = None
    if raw:  # finished [rows, 2], then the [rows, chunks, 2] partials when split
        raw_stats = torch.empty(rows * 2 * (1 + (num_chunks if num_chunks > 1 else 0)),
                                dtype=torch.float32, device=device)
        constexprs["RAW"] = True
    args += (raw_stats if raw_stats is not None else scratch(device, torch.float32),
             packed.cu_num_draft_tokens if packed is not None else scratch(device, torch.int32),
             packed.num_packed if packed is not None else 0,
             packed.live_extra if packed is not None else 0,
             slotted.slots if slotted is not None else scratch(device, torch.int32),
             logits.shape[0] if slotted is not None else 0)
    if packed is not None:
        constexprs["PACKED"] = True
    if slotted is not None:
        constexprs["SLOTTED"] = True
    # Contract section 8's features, compiled in only when used (a plain call pays nothing).
    if use_min_p:
        constexprs["USE_MIN_P"] = True
    if bitmask is not None:
        constexprs["HAS_BITMASK"] = True
    options = dict(num_warps=1 if interpreted(device) else 8)
    if (use_top_k or use_top_p or use_min_p or bitmask is not None or raw or packed is not None
            or slotted is not None) and not interpreted(device):
        # With a filter or a feature compiled in, ptxas settles at 80 registers and spills
        # (40 B on sm_80 with every feature; 28 B on sm_90 with top-k+top-p since the top-p
        # tie pass); bounded as the race is, it takes more registers and spills nothing.
        options["maxnreg"] = MAX_REGISTERS
    block_s, unroll_s, num_pivots = filters.search_config(vocab, device, options["num_warps"])
    _row_stats_kernel[(rows, num_chunks)](
        *args, chunk, BLOCK=block, R=STATS_R, BLOCK_S=block_s, UNROLL_S=unroll_s,
        NUM_PIVOTS=num_pivots, **options, **constexprs)
    raw_rows = None if raw_stats is None else raw_stats[:rows * 2].view(rows, 2)
    if num_chunks == 1:
        return RowStats(stats, argmax, 1, raw_rows)
    if not finish:
        return RowStats(part_f, part_i, num_chunks)
    if not interpreted(device):  # (no register bound: the finish kernel does not spill)
        options = dict(num_warps=FINISH_SEARCH_WARPS if cap > 0 or use_min_p else 8)
    block_s, unroll_s, num_pivots = filters.search_config(vocab, device, options["num_warps"])
    _row_stats_finish_kernel[(rows,)](
        *args, CHUNKS_P2=next_pow2(num_chunks), BLOCK_S=block_s, UNROLL_S=unroll_s,
        NUM_PIVOTS=num_pivots, **options, **constexprs)
    return RowStats(stats, argmax, 1, raw_rows)


# ----------------------------------------------------------------------------- compile registry

_STATS_SIGNATURE = dict(
    stride_req="i32", stride_row="i32", rows_per_req="i32", temperature_ptr="*fp32",
    top_k_ptr="*i32", top_p_ptr="*fp32", stats_ptr="*fp32", argmax_ptr="*i32",
    part_f_ptr="*fp32", part_i_ptr="*i32", cand_key_ptr="*i32", cand_e_ptr="*fp32", V="i32",
    min_p_ptr="*fp32", bitmask_ptr="*i32", bitmask_words="i32", raw_ptr="*fp32", cu_ptr="*i64",
    num_packed="i32", live_extra="i32", slots_ptr="*i64", num_slots="i32")


def _features(on: bool) -> dict:
    """Contract section 8-9's constexprs of a spec: all on, or all off (their defaults)."""
    return dict(USE_MIN_P=on, HAS_BITMASK=on, RAW=on, PACKED=on, SLOTTED=False)


def _slotted_features() -> dict:
    """The draft rows of vLLM MRV2's layout: packed, read through ``draft_slots``, no filter."""
    return dict(USE_MIN_P=False, HAS_BITMASK=False, RAW=False, PACKED=True, SLOTTED=True)


def _stats_spec(dtype: str, key_shift: int, filtered: bool, chunks: int = 1,
                features: bool = False, slotted: bool = False) -> dict:
    return dict(
        name=f"row_stats[{dtype}{',top_k+top_p' if filtered else ''}"
             f"{',chunks=%d' % chunks if chunks > 1 else ''}"
             f"{',min_p+bitmask+raw' if features else ''}{',packed+slotted' if slotted else ''}]",
        kernel=_row_stats_kernel,
        signature=dict(logits_ptr=f"*{dtype}", **_STATS_SIGNATURE, chunk_size="i32"),
        constexprs=dict(USE_TOP_K=filtered, USE_TOP_P=filtered, KEY_SHIFT=key_shift,
                        NUM_CHUNKS=chunks, BLOCK=STATS_BLOCK, R=STATS_R, BLOCK_S=128,
                        UNROLL_S=filters.PIVOT_UNROLL, NUM_PIVOTS=filters.NUM_PIVOTS,
                        CAP=filters.candidate_capacity(filtered),
                        **(_slotted_features() if slotted else _features(features))),
        num_warps=8, **({"maxnreg": MAX_REGISTERS} if filtered or features or slotted else {}))


def _stats_finish_spec(dtype: str, key_shift: int, filtered: bool, chunks: int,
                       features: bool = False) -> dict:
    warps = FINISH_SEARCH_WARPS if filtered or features else 8
    return dict(
        name=f"row_stats_finish[{dtype}{',top_k+top_p' if filtered else ''},chunks={chunks}"
             f"{',min_p+bitmask+raw' if features else ''}]",
        kernel=_row_stats_finish_kernel,
        signature=dict(logits_ptr=f"*{dtype}", **_STATS_SIGNATURE),
        constexprs=dict(USE_TOP_K=filtered, USE_TOP_P=filtered, KEY_SHIFT=key_shift,
                        NUM_CHUNKS=chunks, CHUNKS_P2=next_pow2(chunks), BLOCK_S=16 * warps,
                        UNROLL_S=filters.PIVOT_UNROLL, NUM_PIVOTS=filters.NUM_PIVOTS,
                        CAP=filters.candidate_capacity(filtered), **_features(features)),
        num_warps=warps)


# (kernel, argument types, constexprs, num_warps) of every kernel here, in the configurations
# the launchers use on a GPU: compiled for sm_80/sm_90 by bench/resources.py and the tests.
COMPILE_SPECS = [
    _stats_spec("bf16", 16, False), _stats_spec("bf16", 16, True),
    _stats_spec("fp16", 13, True), _stats_spec("fp32", 0, False), _stats_spec("fp32", 0, True),
    _stats_spec("bf16", 16, False, chunks=4), _stats_spec("bf16", 16, True, chunks=4),
    _stats_finish_spec("bf16", 16, False, 4), _stats_finish_spec("bf16", 16, True, 16),
    _stats_finish_spec("fp32", 0, True, 2), _stats_finish_spec("fp16", 13, True, 8),
    _stats_spec("bf16", 16, True, features=True), _stats_spec("fp32", 0, False, features=True),
    _stats_spec("bf16", 16, True, chunks=4, features=True),
    _stats_finish_spec("bf16", 16, True, 16, features=True),
    _stats_finish_spec("bf16", 16, False, 4, features=True),
    _stats_spec("bf16", 16, False, slotted=True),
    _stats_spec("bf16", 16, False, chunks=4, slotted=True),
]
