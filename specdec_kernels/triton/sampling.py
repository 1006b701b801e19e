"""Fused sampling kernels: per-row statistics of the processed target distribution, the
exponential race that draws one token per request, and ``sample``.

A row of logits ``x`` (any of fp32/bf16/fp16, read in its own dtype) is described by four
numbers, so no probability tensor is ever materialised:

* ``x_max``   the largest finite logit (NaN and +-inf count as -inf);
* ``x_thr``   the top-k/top-p cut: token i is kept iff ``x_i >= x_thr`` (``-inf``: no cut);
* ``norm``    ``sum(exp(z_i))`` over the kept tokens, ``z_i = (x_i - x_max) / T``;
* ``argmax``  the lowest token id among the largest logits (greedy rows).

so ``p_i = exp(z_i) / norm`` for kept tokens and 0 otherwise. Because top-k and top-p are both
monotone in ``z`` (and ``z`` in ``x``), the kept set is always ``{x >= x_thr}`` for a value
``x_thr`` that is itself a logit of the row: the thresholds are found by a multi-pivot search
over the order-preserving integer keys of the logits (no sort), see ``_pivot_pass``.

Rounding differs from the reference only in the last ulp of ``norm`` (summation order), of
``z`` (``* (1/T)`` instead of ``/ T``) and of ``exp``/``log``; tokens differ only when a
decision falls within that rounding of its threshold (measured in the tests).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._params import scratch
from .. import _rng
from .._rng import PURPOSE_RESAMPLE, PURPOSE_SAMPLE
from . import _rng as trng
from ._launch import cdiv, interpreted, next_pow2, num_sms

# Pivots per search pass: each pass narrows the key interval by NUM_PIVOTS + 1.
NUM_PIVOTS = 8
FLT_MAX = tl.constexpr(3.4028234663852886e38)
LOG2E = tl.constexpr(1.4426950408889634)

# Q modes of the race kernel (what the residual max(p - q, 0) subtracts).
Q_NONE, Q_ONE_HOT, Q_PROBS, Q_LOGITS = 0, 1, 2, 3

# Keys of bf16 / fp16 logits widened to fp32 have this many trailing zero bits: dropping them
# makes the search interval (and the number of passes) smaller without losing any order.
_KEY_SHIFT = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}


# ----------------------------------------------------------------------------- helpers

@triton.jit
def load_logits(ptr, offs, mask):
    """Logits as float32 with NaN and +-inf mapped to -inf (never sampled); ``mask`` None
    for a full tile."""
    if mask is None:
        x = tl.load(ptr + offs).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    # |NaN| < inf is false, so one comparison keeps exactly the finite logits.
    return tl.where(tl.abs(x) < float("inf"), x, float("-inf"))


@triton.jit
def exp2_scale(temperature):
    """``log2(e) / T``, so that ``exp(z) = exp2((x - x_max) * scale)`` with ``z = (x - x_max) / T``
    (one multiply per logit, and exp2 is the hardware's exponential). Greedy rows take T = 1
    (their z is x - x_max, as in the reference). Clamped so that a denormal T never turns
    ``0 * scale`` into NaN."""
    greedy = temperature == 0.0
    safe = tl.where(greedy, 1.0, temperature)
    inv = tl.math.div_rn(tl.full([], LOG2E, tl.float32) + tl.zeros_like(safe), safe)
    return tl.minimum(inv, FLT_MAX)


@triton.jit
def processed_prob(x, x_max, x_thr, norm, scale):
    """p(x) of a row described by (x_max, x_thr, norm) for sanitised float32 logits ``x``,
    divided correctly rounded (acceptance tests compare it with ``u * q``)."""
    kept = (x > float("-inf")) & (x >= x_thr)
    e = tl.exp2((x - x_max) * scale)
    return tl.where(kept, tl.math.div_rn(tl.where(kept, e, 0.0), norm), 0.0)


@triton.jit
def _sort_key(x, KEY_SHIFT: tl.constexpr):
    """Order-preserving int32 key of float32 ``x`` (-0.0 and +0.0 share key 0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x == 0.0, 0, key)
    return key >> KEY_SHIFT


@triton.jit
def _key_value(key, KEY_SHIFT: tl.constexpr):
    """Inverse of ``_sort_key``: the float32 value whose key is ``key``."""
    key = key.to(tl.int32)
    low = tl.where(key < 0, (1 << KEY_SHIFT) - 1, 0)
    k32 = (key << KEY_SHIFT) | low
    bits = tl.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_keys(row_ptr, offs, V, x_max, scale, KEY_SHIFT: tl.constexpr):
    """(key, exp(z), finite) of the logits at ``offs`` (masked at V).
    (load_logits and _sort_key inlined: each nested call costs the interpreter a re-patch.)"""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(x == 0.0, 0, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)) >> KEY_SHIFT
    finite = x > float("-inf")
    return key, tl.where(finite, tl.exp2((x - x_max) * scale), 0.0), finite


@triton.jit
def _pivot_accumulate(key, e, live, pivots32, count, mass, min_above, max_below):
    """Folds a block of live keys into the per-(lane, pivot) accumulators."""
    ge = key[:, None] >= pivots32
    above = ge & live[:, None]
    below = (~ge) & live[:, None]
    count += above.to(tl.float32)
    mass += tl.where(above, e[:, None], 0.0)
    min_above = tl.minimum(min_above, tl.where(above, key[:, None], 2147483647))
    max_below = tl.maximum(max_below, tl.where(below, key[:, None], -2147483648))
    return count, mass, min_above, max_below


@triton.jit
def _pivot_pass(row_ptr, V, x_max, scale, floor_key, lo, hi, n_cand, cand_key_ptr, cand_e_ptr,
                below_cand, KEY_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr,
                UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """One pass evaluating NUM_PIVOTS keys spread over ``(lo, hi]`` at once.

    For each pivot, over the finite tokens with ``key >= floor_key``: the count and the mass
    ``sum(exp(z))`` of those with ``key >= pivot`` (non-increasing in the pivot: the same
    reduction tree adds non-negative terms), the smallest key ``>= pivot`` and the largest key
    ``< pivot``. The last two snap the search interval onto keys that occur in the row, so the
    number of passes follows the number of distinct values rather than the key span.

    The pass reads the row, or, once the row's candidates are compacted (``n_cand >= 0``:
    every live key ``>= `` some earlier ``lo``, see ``_compact``), only those candidates, with
    ``below_cand`` the largest live key left out below them.
    """
    steps = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    span = hi - lo
    pivots = lo + (span * steps + NUM_PIVOTS) // (NUM_PIVOTS + 1)  # ceil: in (lo, hi]
    pivots32 = pivots.to(tl.int32)[None, :]
    # Per-(token lane, pivot) accumulators, merged once after the loop: no CTA-wide reduction
    # (and no barrier) per block.
    count = tl.zeros([BLOCK_S, NUM_PIVOTS], tl.float32)
    mass = tl.zeros([BLOCK_S, NUM_PIVOTS], tl.float32)
    min_above = tl.full([BLOCK_S, NUM_PIVOTS], 2147483647, tl.int32)
    max_below = tl.full([BLOCK_S, NUM_PIVOTS], -2147483648, tl.int32)
    if n_cand < 0:
        # UNROLL_S independent [BLOCK_S] blocks per iteration: more loads in flight per warp.
        for start in range(0, V, BLOCK_S * UNROLL_S):
            for part in tl.static_range(UNROLL_S):
                offs = start + part * BLOCK_S + tl.arange(0, BLOCK_S)
                key, e, finite = _row_keys(row_ptr, offs, V, x_max, scale, KEY_SHIFT)
                count, mass, min_above, max_below = _pivot_accumulate(
                    key, e, finite & (key >= floor_key), pivots32, count, mass, min_above,
                    max_below)
        below_cand = tl.full([], -2147483648, tl.int32)
    else:
        for start in range(0, n_cand, BLOCK_S):
            offs = start + tl.arange(0, BLOCK_S)
            in_list = offs < n_cand
            key = tl.load(cand_key_ptr + offs, mask=in_list, other=-2147483648)
            e = tl.load(cand_e_ptr + offs, mask=in_list, other=0.0)
            count, mass, min_above, max_below = _pivot_accumulate(
                key, e, in_list & (key >= floor_key), pivots32, count, mass, min_above,
                max_below)
    return (pivots, tl.sum(count, axis=0), tl.sum(mass, axis=0), tl.min(min_above, axis=0),
            tl.maximum(tl.max(max_below, axis=0), below_cand))


@triton.jit
def _compact(row_ptr, V, x_max, scale, floor_key, lo, cand_key_ptr, cand_e_ptr,
             KEY_SHIFT: tl.constexpr, BLOCK_C: tl.constexpr, CAP: tl.constexpr):
    """Writes the key and ``exp(z)`` of every live token with ``key >= lo`` to the row's
    candidate list (at most CAP; the caller knows how many there are) and returns their
    number and the largest live key below ``lo``. Later passes read only the list."""
    n = tl.full([], 0, tl.int32)
    lane_below = tl.full([BLOCK_C], -2147483648, tl.int32)
    for start in range(0, V, BLOCK_C):
        offs = start + tl.arange(0, BLOCK_C)
        key, e, finite = _row_keys(row_ptr, offs, V, x_max, scale, KEY_SHIFT)
        live = finite & (key >= floor_key)
        keep = live & (key >= lo)
        lane_below = tl.maximum(lane_below, tl.where(live & (key < lo), key, -2147483648))
        position = n + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(cand_key_ptr + position, key, mask=keep & (position < CAP))
        tl.store(cand_e_ptr + position, e, mask=keep & (position < CAP))
        n += tl.sum(keep.to(tl.int32), axis=0)
    # Later passes read the list from other threads: make its stores visible to the CTA
    # (today's reductions already put a barrier here; this does not rely on them).
    tl.debug_barrier()
    return tl.minimum(n, CAP), tl.max(lane_below, axis=0)


@triton.jit
def _search(row_ptr, V, x_max, scale, lo, hi, lo_count, lo_mass, target, n_cand, below_cand,
            cand_key_ptr, cand_e_ptr, BY_MASS: tl.constexpr, KEY_SHIFT: tl.constexpr,
            BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
            CAP: tl.constexpr):
    """The largest key ``t`` whose kept set ``{key >= t}`` still has count (top-k) or mass
    (top-p) ``>= target``, searched in ``[lo, hi]`` (keys of the row; ``lo`` qualifies and
    bounds the set from below). Returns ``t``, the count and mass of its kept set, and the
    row's candidate list (``n_cand``, ``below_cand``) for a later search.

    As soon as the kept set of ``lo`` has at most CAP tokens (often at once for top-p after
    top-k, or after a pass or two for top-k), one more pass over the row copies them to a
    candidate list and every later pass reads only that list; the answer is the same, since
    the keys left out are below every pivot still to come."""
    floor_key = lo.to(tl.int32)
    while lo < hi:
        if (n_cand < 0) & (lo_count <= CAP):
            n_cand, below_cand = _compact(row_ptr, V, x_max, scale, floor_key, lo.to(tl.int32),
                                          cand_key_ptr, cand_e_ptr, KEY_SHIFT,
                                          BLOCK_S * UNROLL_S, CAP)
        pivots, count, mass, min_above, max_below = _pivot_pass(
            row_ptr, V, x_max, scale, floor_key, lo, hi, n_cand, cand_key_ptr, cand_e_ptr,
            below_cand, KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS)
        if BY_MASS:
            ok = mass >= target
            exact = ok & (mass < 0.0)  # a mass target is never met exactly on purpose
        else:
            ok = count >= target
            exact = ok & (count == target)  # the k-th largest key is the smallest one kept
        # ok is a prefix of the pivots. The answer is >= the smallest key kept by a qualifying
        # pivot, < every failing pivot (so <= the largest key below it), and equal to the
        # smallest key kept by a pivot that keeps exactly k tokens.
        new_lo = tl.max(tl.where(ok, min_above, lo), axis=0).to(tl.int64)
        new_hi = tl.min(tl.where(ok, hi, max_below), axis=0).to(tl.int64)
        new_hi = tl.minimum(new_hi, tl.min(tl.where(exact, min_above, hi), axis=0).to(tl.int64))
        lo_count = tl.min(tl.where(ok, count, lo_count), axis=0)
        lo_mass = tl.min(tl.where(ok, mass, lo_mass), axis=0)
        lo = new_lo
        hi = tl.maximum(new_hi, new_lo)
    return lo, lo_count, lo_mass, n_cand, below_cand


# ----------------------------------------------------------------------------- row statistics

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
def _stats_step(row_ptr, offs, end_v, scale, lane_max, lane_sum, lane_arg, lane_min, lane_count,
                MASKED: tl.constexpr, TRACK_RANGE: tl.constexpr):
    """One [LANES, R] tile of ``_stream_stats``."""
    if MASKED:
        x = load_logits(row_ptr, offs, offs < end_v)
    else:
        x = load_logits(row_ptr, offs, None)
    tile_max = tl.max(x, axis=1)
    tile_arg = tl.min(tl.where(x == tile_max[:, None], offs, 2147483647), axis=1)
    new_max = tl.maximum(lane_max, tile_max)
    # Offsets increase along a lane, so a strict > keeps the lane's earliest arg-max.
    lane_arg = tl.where(tile_max > lane_max, tile_arg, lane_arg)
    # Exponents are taken from a finite base (0 while the lane has seen no finite logit), so
    # a -inf logit gives exactly 0 without a per-logit test. An unchanged max rescales by
    # exactly 1; a lane leaving -inf rescales its sum 0 by 0.
    base = tl.where(new_max > float("-inf"), new_max, 0.0)
    rescale = tl.where(lane_max == new_max, 1.0, tl.exp2((lane_max - base) * scale))
    lane_sum = lane_sum * rescale + tl.sum(tl.exp2((x - base[:, None]) * scale), axis=1)
    if TRACK_RANGE:
        finite = x > float("-inf")
        lane_min = tl.minimum(lane_min, tl.min(tl.where(finite, x, float("inf")), axis=1))
        lane_count += tl.sum(finite.to(tl.int32), axis=1)
    return new_max, lane_sum, lane_arg, lane_min, lane_count


@triton.jit
def _stream_stats(row_ptr, start_v, end_v, scale, TRACK_RANGE: tl.constexpr,
                  BLOCK: tl.constexpr, R: tl.constexpr):
    """One streaming pass over tokens [start_v, end_v) of a row, in [BLOCK // R, R] tiles.

    Lane l of the tile keeps its own running max, online-softmax sum, earliest arg-max and
    (TRACK_RANGE, for the filters' search) finite min and count over its R logits per
    iteration: one rescaling exp per R logits instead of one per logit, and an element-wise
    loop body (no CTA-wide reduction, no barrier). The lanes are merged once at the end.
    Full tiles load without a mask (so R logits are one vector load); only the last, partial
    tile is masked.
    """
    LANES: tl.constexpr = BLOCK // R
    lane_max = tl.full([LANES], float("-inf"), tl.float32)
    lane_sum = tl.zeros([LANES], tl.float32)
    lane_arg = tl.full([LANES], 2147483647, tl.int32)
    lane_min = tl.full([LANES], float("inf"), tl.float32)
    lane_count = tl.zeros([LANES], tl.int32)
    tile = tl.arange(0, LANES)[:, None] * R + tl.arange(0, R)[None, :]
    full_end = start_v + (end_v - start_v) // BLOCK * BLOCK
    for start in range(start_v, full_end, BLOCK):
        lane_max, lane_sum, lane_arg, lane_min, lane_count = _stats_step(
            row_ptr, start + tile, end_v, scale, lane_max, lane_sum, lane_arg, lane_min,
            lane_count, False, TRACK_RANGE)
    if full_end < end_v:
        lane_max, lane_sum, lane_arg, lane_min, lane_count = _stats_step(
            row_ptr, full_end + tile, end_v, scale, lane_max, lane_sum, lane_arg, lane_min,
            lane_count, True, TRACK_RANGE)
    return _combine_stats(lane_max, lane_sum, lane_arg, lane_min, lane_count, scale)


@triton.jit
def _finish_row(row_ptr, r, req, V, x_max, total, best, x_min, num_finite, greedy, scale,
                top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr, cand_key_ptr, cand_e_ptr,
                USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, KEY_SHIFT: tl.constexpr,
                BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                CAP: tl.constexpr):
    """Applies top-k then top-p to a row's merged statistics (pivot passes over the row, or
    over its candidate list, ``CAP`` entries per row at ``cand_*_ptr``, for the requests that
    use them) and stores ``(x_max, x_thr, norm)`` and the arg-max."""
    cand_key_ptr += r.to(tl.int64) * CAP
    cand_e_ptr += r.to(tl.int64) * CAP
    n_cand = tl.full([], -1, tl.int32)  # no candidate list yet
    below_cand = tl.full([], -2147483648, tl.int32)
    has_finite = x_max > float("-inf")
    best = tl.where(has_finite, best, 0)  # a row with no finite logit: id 0, never emitted
    # The kept set is {key >= lo}; lo starts at the smallest finite key (everything kept).
    lo = _sort_key(tl.where(has_finite, x_min, 0.0), KEY_SHIFT).to(tl.int64)
    lo_mass = total
    lo_count = num_finite.to(tl.float32)
    filtered = tl.full([], 0, tl.int1)
    if USE_TOP_K:
        top_k = tl.load(top_k_ptr + req)
        if (~greedy) & (top_k > 0) & (top_k < V) & (num_finite > top_k):
            hi = _sort_key(x_max, KEY_SHIFT).to(tl.int64)
            lo, lo_count, lo_mass, n_cand, below_cand = _search(
                row_ptr, V, x_max, scale, lo, hi, lo_count, lo_mass, top_k.to(tl.float32),
                n_cand, below_cand, cand_key_ptr, cand_e_ptr, False,
                KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP)
            filtered = tl.full([], 1, tl.int1)
    if USE_TOP_P:
        top_p = tl.load(top_p_ptr + req)
        if (~greedy) & (top_p < 1.0) & has_finite:
            hi = _sort_key(x_max, KEY_SHIFT).to(tl.int64)
            # A candidate list from top-k holds every key >= its lo <= this floor: keys
            # below it are not live here, so nothing is left out below the list.
            below_cand = tl.full([], -2147483648, tl.int32)
            lo, lo_count, lo_mass, n_cand, below_cand = _search(
                row_ptr, V, x_max, scale, lo, hi, lo_count, lo_mass, top_p * lo_mass,
                n_cand, below_cand, cand_key_ptr, cand_e_ptr, True,
                KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP)
            filtered = tl.full([], 1, tl.int1)
    x_thr = tl.where(filtered, _key_value(lo, KEY_SHIFT), float("-inf"))
    tl.store(stats_ptr + r * 3 + 0, x_max)
    tl.store(stats_ptr + r * 3 + 1, x_thr)
    tl.store(stats_ptr + r * 3 + 2, lo_mass)
    tl.store(argmax_ptr + r, best)


@triton.jit
def _stats_row(r, logits_ptr, stride_req, stride_row, rows_per_req, temperature_ptr):
    """Row ``r`` of the statistics: its request, the row's pointer, whether the request is
    greedy and its ``exp2_scale``."""
    req = r // rows_per_req
    row_ptr = (logits_ptr + req.to(tl.int64) * stride_req
               + (r % rows_per_req).to(tl.int64) * stride_row)
    temperature = tl.load(temperature_ptr + req)
    return req, row_ptr, temperature == 0.0, exp2_scale(temperature)


@triton.jit
def _row_stats_kernel(logits_ptr, stride_req, stride_row, rows_per_req,
                      temperature_ptr, top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr,
                      part_f_ptr, part_i_ptr, cand_key_ptr, cand_e_ptr, V, chunk_size,
                      USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, KEY_SHIFT: tl.constexpr,
                      NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr,
                      BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                      CAP: tl.constexpr):
    """Per-row statistics of the processed distribution; grid (rows, NUM_CHUNKS), program
    (r, c) streams tokens ``[c * chunk_size, (c + 1) * chunk_size)`` of row r.

    NUM_CHUNKS == 1: the program finishes its row (top-k/top-p and the stores). Otherwise it
    writes its chunk's partial statistics and ``_row_stats_finish_kernel`` merges them: a
    row split over programs keeps every SM busy when B * (K + 1) rows are fewer than SMs.

    Bytes: reads V * elem_size once per row; writes 16 B per row (3 float32 + 1 int32), or
    20 B of partials per program; plus V * elem_size per pivot pass for a row whose top-k or
    top-p is active (~log_9(key span) passes each, <= 6 for bf16, <= 11 for fp32); rows with
    the filters off (and greedy rows) do no pass beyond the first.
    """
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    req, row_ptr, greedy, scale = _stats_row(r, logits_ptr, stride_req, stride_row,
                                             rows_per_req, temperature_ptr)
    start_v = chunk * chunk_size
    end_v = tl.minimum(start_v + chunk_size, V)
    x_max, total, best, x_min, num_finite = _stream_stats(
        row_ptr, start_v, end_v, scale, USE_TOP_K or USE_TOP_P, BLOCK, R)
    if NUM_CHUNKS == 1:
        _finish_row(row_ptr, r, req, V, x_max, total, best, x_min, num_finite, greedy, scale,
                    top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr, cand_key_ptr, cand_e_ptr,
                    USE_TOP_K, USE_TOP_P, KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP)
    else:
        part = r * NUM_CHUNKS + chunk
        tl.store(part_f_ptr + part * 3 + 0, x_max)
        tl.store(part_f_ptr + part * 3 + 1, total)
        tl.store(part_f_ptr + part * 3 + 2, x_min)
        tl.store(part_i_ptr + part * 2 + 0, best)
        tl.store(part_i_ptr + part * 2 + 1, num_finite)


@triton.jit
def _row_stats_finish_kernel(logits_ptr, stride_req, stride_row, rows_per_req,
                             temperature_ptr, top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr,
                             part_f_ptr, part_i_ptr, cand_key_ptr, cand_e_ptr, V,
                             USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                             KEY_SHIFT: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                             CHUNKS_P2: tl.constexpr, BLOCK_S: tl.constexpr,
                             UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                             CAP: tl.constexpr):
    """Merges the NUM_CHUNKS partial statistics of one row (grid rows), then finishes it as
    ``_row_stats_kernel`` does. Bytes: reads 20 B per chunk (plus the pivot passes of rows
    whose filters are active), writes 16 B."""
    r = tl.program_id(0)
    req, row_ptr, greedy, scale = _stats_row(r, logits_ptr, stride_req, stride_row,
                                             rows_per_req, temperature_ptr)
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
                top_k_ptr, top_p_ptr, stats_ptr, argmax_ptr, cand_key_ptr, cand_e_ptr,
                USE_TOP_K, USE_TOP_P, KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP)


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


# ----------------------------------------------------------------------------- the race

@triton.jit
def _block_best(score, offs):
    top = tl.max(score, axis=0)
    return top, tl.min(tl.where(score == top, offs, 2147483647), axis=0)


@triton.jit
def _tile_best(score, offs):
    """``_block_best`` of a 2-D tile."""
    top = tl.max(tl.max(score, axis=1), axis=0)
    return top, tl.min(tl.min(tl.where(score == top, offs, 2147483647), axis=1), axis=0)


@triton.jit
def quad_offsets(start, QUADS: tl.constexpr):
    """Token ids ``start + [0, 4*QUADS)`` as a ``[QUADS, 4]`` tile, the shape of
    ``trng.token_noise`` (``start`` a multiple of 4): one Philox per row of the tile."""
    return start + tl.arange(0, QUADS)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _race_prob(x, x_base, x_thr, inv_norm, scale):
    """p(x) for the race: ``processed_prob`` with ``* (1 / norm)`` for the division (within an
    ulp of it; the race only ranks scores). ``x_base`` is x_max, or 0 for a row with no
    finite logit, so -inf logits give exactly 0 without a test."""
    return tl.where(x >= x_thr, tl.exp2((x - x_base) * scale), 0.0) * inv_norm


@triton.jit
def _race_weights(row_ptr, q_ptr, offs, mask, x_base, x_thr, inv_norm, scale,
                  q_base, q_thr, q_inv_norm, draft_token,
                  Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr):
    """The race's weights at tokens ``offs`` (``mask`` None for a full tile): ``(p, w, nan)``
    with ``w`` the residual ``max(p - q, 0)`` and ``nan`` where ``p - q`` is NaN when
    RESIDUAL, else ``w = p`` (never NaN). Masked-off tokens weigh 0."""
    x = load_logits(row_ptr, offs, mask)
    p = _race_prob(x, x_base, x_thr, inv_norm, scale)
    if RESIDUAL:
        if Q_MODE == 1:
            q = tl.where(offs == draft_token, 1.0, 0.0)
        elif Q_MODE == 2:
            if mask is None:
                q = tl.load(q_ptr + offs).to(tl.float32)
            else:
                q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            q = _race_prob(load_logits(q_ptr, offs, mask), q_base, q_thr, q_inv_norm, scale)
        diff = p - q
        return p, tl.where(diff > 0, diff, 0.0), diff != diff
    return p, p, p != p  # never NaN


@triton.jit
def _group_step(row_ptr, q_ptr, offs, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
                q_inv_norm, draft_token, lane_p, lane_r, lane_nan, MASKED: tl.constexpr,
                Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr):
    """One tile of ``_race_groups``: adds the tile's weights to the per-lane sums."""
    p, w, nan = _race_weights(row_ptr, q_ptr, offs, offs < end_v if MASKED else None,
                              x_base, x_thr, inv_norm, scale, q_base, q_thr, q_inv_norm,
                              draft_token, Q_MODE, RESIDUAL)
    return lane_p + p, lane_r + w, tl.maximum(lane_nan, nan.to(tl.int32))


@triton.jit
def _race_groups(row_ptr, q_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                 q_base, q_thr, q_inv_norm, draft_token, seed, offset, position,
                 PURPOSE: tl.constexpr, Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr):
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
                inv_norm, scale, q_base, q_thr, q_inv_norm, draft_token, lane_p, lane_r,
                lane_nan, False, Q_MODE, RESIDUAL)
        if full_end < group_end:
            lane_p, lane_r, lane_nan = _group_step(
                row_ptr, q_ptr, full_end + tl.arange(0, BLOCK), group_end, x_base, x_thr,
                inv_norm, scale, q_base, q_thr, q_inv_norm, draft_token, lane_p, lane_r,
                lane_nan, True, Q_MODE, RESIDUAL)
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
                q_inv_norm, draft_token, seed, offset, position, lane_best, lane_idx,
                MASKED: tl.constexpr, PURPOSE: tl.constexpr, Q_MODE: tl.constexpr,
                RESIDUAL: tl.constexpr, QUADS: tl.constexpr):
    """One ``[QUADS, 4]`` tile of ``_race_tokens``: per-lane winners, strict ``>``."""
    offs = quad_offsets(start, QUADS)
    _, w, _ = _race_weights(row_ptr, q_ptr, offs, offs < end_v if MASKED else None, x_base,
                            x_thr, inv_norm, scale, q_base, q_thr, q_inv_norm, draft_token,
                            Q_MODE, RESIDUAL)
    noise = trng.token_noise(seed, offset, position, PURPOSE, start // 4, QUADS)
    score = tl.where(w > 0, w / noise, -1.0)
    take = score > lane_best
    return tl.where(take, score, lane_best), tl.where(take, offs, lane_idx)


@triton.jit
def _race_tokens(row_ptr, q_ptr, group, V, x_base, x_thr, inv_norm, scale,
                 q_base, q_thr, q_inv_norm, draft_token, seed, offset, position,
                 PURPOSE: tl.constexpr, Q_MODE: tl.constexpr, RESIDUAL: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK: tl.constexpr):
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
            q_inv_norm, draft_token, seed, offset, position, lane_best, lane_idx, False,
            PURPOSE, Q_MODE, RESIDUAL, QUADS)
    if full_end < end_v:
        lane_best, lane_idx = _token_step(
            row_ptr, q_ptr, full_end, end_v, x_base, x_thr, inv_norm, scale, q_base, q_thr,
            q_inv_norm, draft_token, seed, offset, position, lane_best, lane_idx, True,
            PURPOSE, Q_MODE, RESIDUAL, QUADS)
    best, idx = _tile_best(lane_best, lane_idx)
    return tl.where(best >= 0, idx, -1)


@triton.jit
def _accept_drafts(req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr,
                   q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr,
                   stride_ids, num_draft, greedy, scale, seed, offset, V, K,
                   Q_MODE: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                   STATS_CHUNKS_P2: tl.constexpr, Q_STATS_CHUNKS: tl.constexpr,
                   Q_STATS_CHUNKS_P2: tl.constexpr):
    """The chain's acceptance loop for request ``req`` (contract section 3): returns
    ``(num_accepted, rejected)``, ``rejected`` when a live, in-range draft was rejected (its
    residual is sampled next). Reads, per live draft, the id, 16 B of stats, one target
    logit and one draft probability, or one draft logit and 12 B of its stats (12 B per
    chunk where ``row_stats`` left partials). Out-of-range ids (validate=False) are rejected
    without being read through, and leave no residual: they were never drawn from q. The
    loads of all ``num_draft`` drafts are issued whatever the verdicts (at most ~30 B per
    draft past the first rejection)."""
    ids_row = draft_ids_ptr + req.to(tl.int64) * stride_ids
    logits_row = logits_ptr + req.to(tl.int64) * stride_req
    q_row = q_ptr + req.to(tl.int64) * stride_q_req
    accepting = num_draft > 0
    num_accepted = tl.full([], 0, tl.int32)
    rejected = tl.full([], 0, tl.int1)
    for j in range(0, K):
        j64 = tl.zeros([], tl.int64) + j  # the interpreter's loop index is a Python int
        # Loads do not wait for the previous draft's verdict (a few bytes more past the first
        # rejection, but one memory latency for the loop instead of one per draft).
        live = j < num_draft
        draft = tl.load(ids_row + j, mask=live, other=0).to(tl.int64)
        valid = live & (draft >= 0) & (draft < V)
        token = tl.where(valid, draft, 0)
        x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * (K + 1) + j,
                                                    valid, scale, STATS_CHUNKS, STATS_CHUNKS_P2)
        p = processed_prob(load_logits(logits_row + j64 * stride_row, token, valid),
                           x_max, x_thr, norm, scale)
        if Q_MODE == 2:
            q = tl.load(q_row + j64 * stride_q_row + token, mask=valid, other=0.0).to(tl.float32)
        elif Q_MODE == 3:
            q_max, q_thr, q_norm, _ = load_row_stats(q_stats_ptr, q_argmax_ptr, req * K + j,
                                                     valid, scale, Q_STATS_CHUNKS,
                                                     Q_STATS_CHUNKS_P2)
            q = processed_prob(load_logits(q_row + j64 * stride_q_row, token, valid),
                               q_max, q_thr, q_norm, scale)
        else:  # one-hot drafts
            q = tl.full([], 1.0, tl.float32)
        u = trng.uniform(seed, offset, j64 + 1, trng.PURPOSE_ACCEPT, tl.zeros([], tl.int32))
        # Greedy p is one-hot at the arg-max (zero everywhere on a row with no finite logit).
        greedy_ok = (token == argmax) & (x_max > float("-inf"))
        accepted = valid & tl.where(greedy, greedy_ok, u * q < p)
        rejected = rejected | (accepting & valid & ~accepted)
        accepting = accepting & accepted
        num_accepted += accepting.to(tl.int32)
    return num_accepted, rejected


@triton.jit
def _store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids, num_accepted, token,
                     K, K_P2: tl.constexpr):
    """Row ``req`` of ``output_token_ids`` in one store: the accepted drafts, ``token`` at
    ``num_accepted``, then -1."""
    positions = tl.arange(0, K_P2)
    drafts = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + positions,
                     mask=positions < num_accepted, other=-1).to(tl.int32)
    row = tl.where(positions < num_accepted, drafts, tl.where(positions == num_accepted, token, -1))
    tl.store(out_ptr + req.to(tl.int64) * stride_out + positions, row, mask=positions < K + 1)


@triton.jit
def _sampled_row(req, num_accepted_ptr, num_draft_ptr, draft_ids_ptr, stride_ids, V, K,
                 IS_CHAIN: tl.constexpr):
    """(row within the request, whether a draft was rejected there) as the race kernel left
    them: a chain samples row ``num_accepted``, from the residual after a rejection of a live,
    in-range draft; ``sample`` samples row 0."""
    if IS_CHAIN:
        num_accepted = tl.load(num_accepted_ptr + req)
        num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + req), 0), K)
        # A rejection of a live, in-range draft leaves a residual; an out-of-range id
        # (validate=False) was never drawn from q, so its request samples p.
        live = num_accepted < num_draft
        rejected_id = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + num_accepted,
                              mask=live, other=-1).to(tl.int64)
        rejected = live & (rejected_id >= 0) & (rejected_id < V)
    else:
        num_accepted = tl.full([], 0, tl.int32)
        rejected = tl.full([], 0, tl.int1)
    return num_accepted, rejected


# Stages of the race kernel: both levels in one program per request (V in one chunk), or the
# first level split over chunks of V (partial winners per chunk) and then, one program per
# request, their reduction and the second level.
STAGE_BOTH, STAGE_GROUPS, STAGE_TOKENS = 0, 1, 2


@triton.jit
def _race_kernel(logits_ptr, stride_req, stride_row, rows_per_req, stats_ptr, argmax_ptr,
                 q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr,
                 draft_ids_ptr, stride_ids, num_draft_ptr, num_accepted_ptr,
                 temperature_ptr, seed_ptr, offset_ptr, out_ptr, stride_out,
                 part_score_ptr, part_index_ptr, V, K, chunk_size,
                 PURPOSE: tl.constexpr, IS_CHAIN: tl.constexpr, Q_MODE: tl.constexpr,
                 STAGE: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                 STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                 Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                 GROUP: tl.constexpr, MASS_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                 K_P2: tl.constexpr):
    """One correction/bonus (chain) or sample token per request, by the two-level race over
    row ``num_accepted`` (chain) or 0 of the request.

    STAGE_BOTH (grid B) and STAGE_GROUPS (grid B x NUM_CHUNKS, program c racing the groups of
    tokens ``[c * chunk_size, (c + 1) * chunk_size)``) first replay the request's acceptance
    (``_accept_drafts``: a few gathered values per draft, cheaper than a launch of its own),
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
    of it: the arg-max comes from the statistics.
    """
    req = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature == 0.0
    scale = exp2_scale(temperature)
    seed = tl.load(seed_ptr + req)
    offset = tl.load(offset_ptr + req)
    if STAGE == 2:  # STAGE_TOKENS
        num_accepted, rejected = _sampled_row(req, num_accepted_ptr, num_draft_ptr,
                                              draft_ids_ptr, stride_ids, V, K, IS_CHAIN)
    elif IS_CHAIN:
        num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + req), 0), K)
        num_accepted, rejected = _accept_drafts(
            req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr, q_ptr, stride_q_req,
            stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr, stride_ids, num_draft,
            greedy, scale, seed, offset, V, K, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2,
            Q_STATS_CHUNKS, Q_STATS_CHUNKS_P2)
        if STAGE == 1:  # STAGE_GROUPS
            if chunk == 0:  # the token itself follows from STAGE_TOKENS
                _store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids,
                                 num_accepted, -1, K, K_P2)
                tl.store(num_accepted_ptr + req, num_accepted)
    else:
        num_accepted = tl.full([], 0, tl.int32)
        rejected = tl.full([], 0, tl.int1)
    row = req * rows_per_req + num_accepted
    row_ptr = (logits_ptr + req.to(tl.int64) * stride_req
               + num_accepted.to(tl.int64) * stride_row)
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, row,
                                                tl.full([], 1, tl.int1), scale,
                                                STATS_CHUNKS, STATS_CHUNKS_P2)
    x_base = tl.where(x_max > float("-inf"), x_max, 0.0)
    inv_norm = tl.where(norm > 0.0, 1.0 / norm, 0.0)

    use_residual = rejected & (~greedy)
    # The draft distribution at the rejected position.
    last = tl.minimum(num_accepted, tl.maximum(K - 1, 0))
    draft_token = tl.full([], 0, tl.int32)
    q_row_ptr = q_ptr
    q_base = tl.full([], 0.0, tl.float32)
    q_thr = tl.full([], 0.0, tl.float32)
    q_inv_norm = tl.full([], 1.0, tl.float32)
    if Q_MODE == 1:
        d = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + last,
                    mask=use_residual, other=0).to(tl.int64)
        draft_token = tl.where((d >= 0) & (d < V), d, 0).to(tl.int32)
    if Q_MODE >= 2:
        q_row_ptr = q_ptr + req.to(tl.int64) * stride_q_req + last.to(tl.int64) * stride_q_row
    if Q_MODE == 3:
        q_max, q_thr, q_norm, _ = load_row_stats(q_stats_ptr, q_argmax_ptr, req * K + last,
                                                 use_residual, scale, Q_STATS_CHUNKS,
                                                 Q_STATS_CHUNKS_P2)
        q_base = tl.where(q_max > float("-inf"), q_max, 0.0)
        q_inv_norm = tl.where(q_norm > 0.0, 1.0 / q_norm, 0.0)

    if STAGE == 2:  # STAGE_TOKENS
        chunks = tl.arange(0, CHUNKS_P2)
        valid = chunks < NUM_CHUNKS
        part = req * NUM_CHUNKS + chunks
        # Chunks are in group order: max score, lowest group among equal scores.
        best_p, group_p = _block_best(
            tl.load(part_score_ptr + part * 2 + 0, mask=valid, other=-2.0),
            tl.load(part_index_ptr + part * 3 + 0, mask=valid, other=2147483647))
        best_r, group_r = _block_best(
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
            if Q_MODE != 0:
                if use_residual:
                    best_p, group_p, best_r, group_r, has_nan = _race_groups(
                        row_ptr, q_row_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                        q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                        PURPOSE, Q_MODE, True, GROUP, MASS_BLOCK)
                else:
                    best_p, group_p, best_r, group_r, has_nan = _race_groups(
                        row_ptr, q_row_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                        q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                        PURPOSE, Q_MODE, False, GROUP, MASS_BLOCK)
            else:
                best_p, group_p, best_r, group_r, has_nan = _race_groups(
                    row_ptr, q_row_ptr, start_v, end_v, x_base, x_thr, inv_norm, scale,
                    q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                    PURPOSE, Q_MODE, False, GROUP, MASS_BLOCK)
        if STAGE == 1:  # STAGE_GROUPS
            part = req * NUM_CHUNKS + chunk
            tl.store(part_score_ptr + part * 2 + 0, best_p)
            tl.store(part_score_ptr + part * 2 + 1, best_r)
            tl.store(part_index_ptr + part * 3 + 0, group_p)
            tl.store(part_index_ptr + part * 3 + 1, group_r)
            tl.store(part_index_ptr + part * 3 + 2, has_nan)

    if STAGE != 1:  # not STAGE_GROUPS
        # The token: greedy arg-max; else the residual's race when it has mass (a NaN in the
        # residual gives -1, as the reference's amax does); else the race over p; -1 when
        # the winning race had no positive weight. Always -1 or a raced index, so in [0, V).
        token = tl.where(x_max > float("-inf"), argmax, -1)
        if temperature != 0.0:
            token = tl.full([], -1, tl.int32)
            if Q_MODE != 0:
                if use_residual & (best_r >= 0):
                    if has_nan == 0:
                        token = _race_tokens(
                            row_ptr, q_row_ptr, group_r, V, x_base, x_thr, inv_norm, scale,
                            q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                            PURPOSE, Q_MODE, True, GROUP, BLOCK)
                elif best_p >= 0:
                    token = _race_tokens(
                        row_ptr, q_row_ptr, group_p, V, x_base, x_thr, inv_norm, scale,
                        q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                        PURPOSE, Q_MODE, False, GROUP, BLOCK)
            elif best_p >= 0:
                token = _race_tokens(
                    row_ptr, q_row_ptr, group_p, V, x_base, x_thr, inv_norm, scale,
                    q_base, q_thr, q_inv_norm, draft_token, seed, offset, num_accepted,
                    PURPOSE, Q_MODE, False, GROUP, BLOCK)
        if IS_CHAIN:
            if STAGE == 0:  # STAGE_BOTH
                _store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids,
                                 num_accepted, token, K, K_P2)
                tl.store(num_accepted_ptr + req, num_accepted)
            else:
                tl.store(out_ptr + req.to(tl.int64) * stride_out + num_accepted, token)
        else:
            tl.store(out_ptr + req.to(tl.int64) * stride_out, token)


# ----------------------------------------------------------------------------- launchers

def block_size(vocab: int, device: torch.device, cap_gpu: int = 2048, cap_cpu: int = 8192) -> int:
    """A power of two covering V up to a cap: no huge padded blocks for small V."""
    cap = cap_cpu if interpreted(device) else cap_gpu
    return max(16, min(next_pow2(vocab), cap))


# Blocks of BLOCK_S logits per iteration of a pivot pass on a GPU: independent loads in flight.
# (8 pivots x 4 blocks compiles without spills on sm_80/sm_90 with the candidate-list pass
# beside it; 8 blocks, or 2, spill; 16 pivots spill from 4 blocks.)
PIVOT_UNROLL = 4

# Tests set this to run the GPU's search configuration (BLOCK_S, UNROLL_S, NUM_PIVOTS) on CPU.
SEARCH_CONFIG_OVERRIDE: tuple[int, int, int] | None = None


def _search_config(vocab: int, device: torch.device,
                   warps: int = 8) -> tuple[int, int, int]:
    """(BLOCK_S, UNROLL_S, NUM_PIVOTS) of the pivot passes of a program of ``warps`` warps.
    The GPU keeps [BLOCK_S, NUM_PIVOTS] accumulators in registers (BLOCK_S = 16 logits per
    warp) and streams UNROLL_S blocks per iteration; the interpreter pays per operation, not
    per element, so it takes one large block and more pivots."""
    if SEARCH_CONFIG_OVERRIDE is not None:
        return SEARCH_CONFIG_OVERRIDE
    if interpreted(device):
        return max(16, min(next_pow2(vocab), 2048)), 1, 256
    block_s = max(16, min(next_pow2(vocab), 16 * warps))
    return block_s, min(PIVOT_UNROLL, next_pow2(cdiv(vocab, block_s))), NUM_PIVOTS


# Candidate list of a filtered row (key and exp(z) per entry, 8 B): once the kept set of the
# search's lower bound has at most this many tokens, the remaining pivot passes read only the
# list instead of the row (see _search). Tests shrink it to exercise both paths.
SEARCH_CANDIDATES = 2048

# Warps of the finish kernel when it searches (filters compiled in): it runs when rows are
# few, one program per row, so each program streams twice the statistics kernel's 1024
# logits per pass iteration (BLOCK_S 256 x 8 blocks; no spills on sm_80/sm_90).
FINISH_SEARCH_WARPS = 16


# Vocabulary block of the statistics' streaming pass on a GPU (8 warps: 16 logits per thread
# per iteration), as tiles of STATS_R logits per lane: one rescaling exp per STATS_R logits, and
# STATS_R = 8 bf16 logits are one 16-byte load. The tile's accumulators are BLOCK / STATS_R per
# program, so the block costs few registers (python_tests/test_triton_compile.py: no spills).
STATS_BLOCK = 4096
STATS_R = 8

# At most this many programs per row: the finish kernel merges them as one vector (32
# spills in ptxas's allocation with the filters on; 16 and below do not).
MAX_STATS_CHUNKS = 16

# Tests set this to force the split-row path of the statistics on small vocabularies.
STATS_CHUNK_OVERRIDE: int | None = None


def stats_chunks(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(chunk_size, num_chunks, BLOCK) of the statistics pass: rows split over programs until
    there are about 8 programs per SM (a shape-only choice, so no synchronisation)."""
    block = block_size(vocab, device, cap_gpu=STATS_BLOCK)
    if STATS_CHUNK_OVERRIDE is not None:
        block = min(block, max(16, next_pow2(STATS_CHUNK_OVERRIDE)))
        chunk = STATS_CHUNK_OVERRIDE
    elif interpreted(device):
        chunk = vocab
    else:
        chunk = cdiv(vocab, min(cdiv(8 * num_sms(device), rows), MAX_STATS_CHUNKS))
    chunk = cdiv(max(chunk, block), block) * block
    return chunk, cdiv(vocab, chunk), block


class RowStats(NamedTuple):
    """What ``row_stats`` leaves for the kernels that consume it (``load_row_stats``)."""
    stats: torch.Tensor   # float32 [rows, 3] (x_max, x_thr, norm); partials: [rows, chunks, 3]
    argmax: torch.Tensor  # int32 [rows]; partials: [rows, chunks, 2] (arg-max, finite count)
    chunks: int           # 1: finished rows; > 1: unmerged partials (the STATS_CHUNKS constexpr)

    def constexprs(self, prefix: str = "") -> dict:
        """The consumer's constexprs (``Q_`` prefix: the draft logits' statistics)."""
        return {f"{prefix}STATS_CHUNKS": self.chunks,
                f"{prefix}STATS_CHUNKS_P2": next_pow2(self.chunks)}


def row_stats(logits: torch.Tensor, params, rows_per_req: int, stride_req: int,
              stride_row: int, *, merge_in_consumer: bool = False) -> RowStats:
    """Launch ``_row_stats_kernel`` (and ``_row_stats_finish_kernel`` when rows are split)
    over ``rows`` = numel / V rows of ``logits`` (``[..., V]``, last dim contiguous), request
    ``row // rows_per_req``.

    ``merge_in_consumer``: when rows are split and no filter is on, the finish kernel would
    only merge the partials; skip its launch and return the partials, which the consuming
    kernel merges as it reads a row (``load_row_stats``). Filtered rows are always finished
    here (their threshold search runs in the finish kernel)."""
    vocab = logits.shape[-1]
    rows = logits.numel() // vocab
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
    finish = num_chunks > 1 and (use_top_k or use_top_p or not merge_in_consumer)
    if num_chunks == 1 or finish:
        stats = torch.empty((rows, 3), dtype=torch.float32, device=device)
        argmax = torch.empty(rows, dtype=torch.int32, device=device)
    else:
        stats, argmax = scratch(device, torch.float32), scratch(device, torch.int32)
    cap = SEARCH_CANDIDATES if (use_top_k or use_top_p) else 0
    if cap > 0:
        cand_key = torch.empty((rows, cap), dtype=torch.int32, device=device)
        cand_e = torch.empty((rows, cap), dtype=torch.float32, device=device)
    else:
        cand_key, cand_e = scratch(device, torch.int32), scratch(device, torch.float32)
    filters = dict(USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, KEY_SHIFT=_KEY_SHIFT[logits.dtype],
                   NUM_CHUNKS=num_chunks, CAP=cap)
    args = (logits, stride_req, stride_row, rows_per_req, params.temperature, params.top_k,
            params.top_p, stats, argmax, part_f, part_i, cand_key, cand_e, vocab)
    options = dict(num_warps=1 if interpreted(device) else 8)
    block_s, unroll_s, num_pivots = _search_config(vocab, device, options["num_warps"])
    _row_stats_kernel[(rows, num_chunks)](
        *args, chunk, BLOCK=block, R=STATS_R, BLOCK_S=block_s, UNROLL_S=unroll_s,
        NUM_PIVOTS=num_pivots, **options, **filters)
    if num_chunks == 1:
        return RowStats(stats, argmax, 1)
    if not finish:
        return RowStats(part_f, part_i, num_chunks)
    if cap > 0 and not interpreted(device):
        options = dict(num_warps=FINISH_SEARCH_WARPS)
    block_s, unroll_s, num_pivots = _search_config(vocab, device, options["num_warps"])
    _row_stats_finish_kernel[(rows,)](
        *args, CHUNKS_P2=next_pow2(num_chunks), BLOCK_S=block_s, UNROLL_S=unroll_s,
        NUM_PIVOTS=num_pivots, **options, **filters)
    return RowStats(stats, argmax, 1)


# Register bound (PTX .maxnreg) of the race on a GPU. Without one, ptxas settles at 80
# registers for the race with draft logits on sm_80 and spills 24 B; bounded at 128 it takes
# 96 and spills nothing. (A bound makes ptxas use more registers, so the statistics kernels,
# which do not spill, go without.)
MAX_REGISTERS = 128


def launch_options(device: torch.device, num_warps: int) -> dict:
    """``num_warps`` and the register bound on a GPU; one warp, no options, in the interpreter."""
    if interpreted(device):
        return dict(num_warps=1)
    return dict(num_warps=num_warps, maxnreg=MAX_REGISTERS)


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


def race(logits: torch.Tensor, stride_req: int, stride_row: int, rows_per_req: int,
         stats: RowStats, params, seeds: torch.Tensor,
         offsets: torch.Tensor, out: torch.Tensor, stride_out: int, *, purpose: int,
         q: torch.Tensor | None = None, q_mode: int = Q_NONE, q_strides=(0, 0),
         q_stats: RowStats | None = None, draft_ids: torch.Tensor | None = None,
         num_draft: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None,
         num_drafts: int = 0) -> None:
    """Launch the race: one launch when V is one chunk, else the first level over chunks and
    the second per request; writes ``out[b * stride_out + (num_accepted[b] or 0)]``."""
    batch = params.temperature.shape[0]
    vocab = logits.shape[-1]
    device = logits.device
    if batch == 0:
        return
    chunk, num_chunks, group, mass_block, block = race_chunks(batch, vocab, device)
    is_chain = num_accepted is not None
    dummy_f, dummy_i = scratch(device, torch.float32), scratch(device, torch.int32)
    part_score = torch.empty((batch, num_chunks, 2), dtype=torch.float32, device=device) \
        if num_chunks > 1 else dummy_f
    part_index = torch.empty((batch, num_chunks, 3), dtype=torch.int32, device=device) \
        if num_chunks > 1 else dummy_i
    args = (logits, stride_req, stride_row, rows_per_req, stats.stats, stats.argmax,
            q if q is not None else dummy_f, q_strides[0], q_strides[1],
            q_stats.stats if q_stats is not None else dummy_f,
            q_stats.argmax if q_stats is not None else dummy_i,
            draft_ids if draft_ids is not None else dummy_i,
            draft_ids.stride(0) if draft_ids is not None else 0,
            num_draft if num_draft is not None else dummy_i,
            num_accepted if num_accepted is not None else dummy_i,
            params.temperature, seeds, offsets, out, stride_out, part_score, part_index,
            vocab, num_drafts, chunk)
    constexprs = dict(PURPOSE=purpose, IS_CHAIN=is_chain, Q_MODE=q_mode, NUM_CHUNKS=num_chunks,
                      CHUNKS_P2=next_pow2(num_chunks), GROUP=group, MASS_BLOCK=mass_block,
                      BLOCK=block, K_P2=next_pow2(num_drafts + 1), **stats.constexprs(),
                      **(q_stats or RowStats(dummy_f, dummy_i, 1)).constexprs("Q_"),
                      **launch_options(device, 4))
    if num_chunks == 1:
        _race_kernel[(batch, 1)](*args, STAGE=STAGE_BOTH, **constexprs)
    else:
        _race_kernel[(batch, num_chunks)](*args, STAGE=STAGE_GROUPS, **constexprs)
        _race_kernel[(batch, 1)](*args, STAGE=STAGE_TOKENS, **constexprs)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def sample(logits: torch.Tensor, params, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int32 ``[B]``: one token per row of ``logits`` ``[B, V]`` from the processed distribution
    (-1 for a row with no finite logit). Two launches (stats, race), plus the statistics'
    finish when rows are split and filtered (unfiltered partials are merged by the race) and
    the race's second stage when V is split; no host synchronisation."""
    logits = _last_dim_contiguous(logits)
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    if batch == 0:
        return out
    stats = row_stats(logits, params, 1, logits.stride(0), 0, merge_in_consumer=True)
    race(logits, logits.stride(0), 0, 1, stats, params, seeds, offsets, out, 1,
         purpose=PURPOSE_SAMPLE)
    return out


# ----------------------------------------------------------------------------- compile registry

_STATS_SIGNATURE = dict(
    stride_req="i32", stride_row="i32", rows_per_req="i32", temperature_ptr="*fp32",
    top_k_ptr="*i32", top_p_ptr="*fp32", stats_ptr="*fp32", argmax_ptr="*i32",
    part_f_ptr="*fp32", part_i_ptr="*i32", cand_key_ptr="*i32", cand_e_ptr="*fp32", V="i32")


def _stats_spec(dtype: str, key_shift: int, filters: bool, chunks: int = 1) -> dict:
    return dict(
        name=f"row_stats[{dtype}{',top_k+top_p' if filters else ''}"
             f"{',chunks=%d' % chunks if chunks > 1 else ''}]",
        kernel=_row_stats_kernel,
        signature=dict(logits_ptr=f"*{dtype}", **_STATS_SIGNATURE, chunk_size="i32"),
        constexprs=dict(USE_TOP_K=filters, USE_TOP_P=filters, KEY_SHIFT=key_shift,
                        NUM_CHUNKS=chunks, BLOCK=STATS_BLOCK, R=STATS_R, BLOCK_S=128, UNROLL_S=PIVOT_UNROLL,
                        NUM_PIVOTS=NUM_PIVOTS, CAP=SEARCH_CANDIDATES if filters else 0),
        num_warps=8)


def _stats_finish_spec(dtype: str, key_shift: int, filters: bool, chunks: int) -> dict:
    warps = FINISH_SEARCH_WARPS if filters else 8
    return dict(
        name=f"row_stats_finish[{dtype}{',top_k+top_p' if filters else ''},chunks={chunks}]",
        kernel=_row_stats_finish_kernel,
        signature=dict(logits_ptr=f"*{dtype}", **_STATS_SIGNATURE),
        constexprs=dict(USE_TOP_K=filters, USE_TOP_P=filters, KEY_SHIFT=key_shift,
                        NUM_CHUNKS=chunks, CHUNKS_P2=next_pow2(chunks), BLOCK_S=16 * warps,
                        UNROLL_S=PIVOT_UNROLL, NUM_PIVOTS=NUM_PIVOTS,
                        CAP=SEARCH_CANDIDATES if filters else 0),
        num_warps=warps)


def _race_spec(dtype: str, q_dtype: str, q_mode: int, chunks: int, is_chain: bool = True,
               stage: int | None = None, stats_chunks: int = 1, q_stats_chunks: int = 1) -> dict:
    mode = ["p", "one_hot", "draft_probs", "draft_logits"][q_mode]
    if stage is None:
        stage = STAGE_BOTH if chunks == 1 else STAGE_GROUPS
    stage_name = ["", ",groups", ",tokens"][stage]
    stats_name = (f",stats_chunks={stats_chunks}" if stats_chunks > 1 else "") + \
        (f",q_stats_chunks={q_stats_chunks}" if q_stats_chunks > 1 else "")
    return dict(
        name=f"race[{dtype},{mode}{',chunks=%d' % chunks if chunks > 1 else ''}{stage_name}"
             f"{stats_name}]",
        kernel=_race_kernel,
        signature=dict(logits_ptr=f"*{dtype}", stride_req="i32", stride_row="i32",
                       rows_per_req="i32", stats_ptr="*fp32", argmax_ptr="*i32",
                       q_ptr=f"*{q_dtype}", stride_q_req="i32", stride_q_row="i32",
                       q_stats_ptr="*fp32", q_argmax_ptr="*i32", draft_ids_ptr="*i64",
                       stride_ids="i32",
                       num_draft_ptr="*i32", num_accepted_ptr="*i32", temperature_ptr="*fp32",
                       seed_ptr="*i64", offset_ptr="*i64", out_ptr="*i32", stride_out="i32",
                       part_score_ptr="*fp32", part_index_ptr="*i32", V="i32", K="i32",
                       chunk_size="i32"),
        constexprs=dict(PURPOSE=PURPOSE_RESAMPLE if is_chain else PURPOSE_SAMPLE,
                        IS_CHAIN=is_chain, Q_MODE=q_mode, STAGE=stage, NUM_CHUNKS=chunks,
                        CHUNKS_P2=next_pow2(chunks), STATS_CHUNKS=stats_chunks,
                        STATS_CHUNKS_P2=next_pow2(stats_chunks), Q_STATS_CHUNKS=q_stats_chunks,
                        Q_STATS_CHUNKS_P2=next_pow2(q_stats_chunks), GROUP=_rng.RACE_GROUP,
                        MASS_BLOCK=1024, BLOCK=512, K_P2=8 if is_chain else 1),
        num_warps=4, maxnreg=MAX_REGISTERS)


# (kernel, argument types, constexprs, num_warps) of every kernel here, in the configurations
# the launchers use on a GPU: compiled for sm_80/sm_90 by bench/resources.py and the tests.
COMPILE_SPECS = [
    _stats_spec("bf16", 16, False), _stats_spec("bf16", 16, True),
    _stats_spec("fp16", 13, True), _stats_spec("fp32", 0, False), _stats_spec("fp32", 0, True),
    _stats_spec("bf16", 16, False, chunks=4), _stats_spec("bf16", 16, True, chunks=4),
    _stats_finish_spec("bf16", 16, False, 4), _stats_finish_spec("bf16", 16, True, 16),
    _stats_finish_spec("fp32", 0, True, 2), _stats_finish_spec("fp16", 13, True, 8),
    _race_spec("bf16", "fp32", Q_NONE, 1, is_chain=False, stats_chunks=16),
    _race_spec("bf16", "fp32", Q_ONE_HOT, 8, stats_chunks=4),
    _race_spec("bf16", "fp32", Q_PROBS, 1),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stats_chunks=4, q_stats_chunks=4),
    _race_spec("fp32", "fp32", Q_LOGITS, 1),
    _race_spec("bf16", "fp32", Q_PROBS, 8, stats_chunks=4),
    _race_spec("bf16", "fp32", Q_PROBS, 8, stage=STAGE_TOKENS, stats_chunks=4),
    _race_spec("bf16", "bf16", Q_LOGITS, 8, stage=STAGE_TOKENS, stats_chunks=4,
               q_stats_chunks=4),
]
