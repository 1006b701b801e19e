"""The top-k / top-p threshold search of a row, without a sort.

Top-k and top-p are both monotone in ``z = (x - x_max) / T`` (and ``z`` in ``x``), so the
kept set is always ``{x >= x_thr}`` for a value ``x_thr`` that is itself a logit of the row.
``filter_threshold`` finds it by a multi-pivot search over the order-preserving integer keys
of the logits (``_pivot_pass``): each pass over the row (or, once few enough tokens remain,
over a compacted candidate list) evaluates NUM_PIVOTS keys at once. The row statistics
(``stats.py``) call it after their streaming pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, interpreted, next_pow2
from ._tiles import allowed_logits

# Pivots per search pass on a GPU: each pass narrows the key interval by NUM_PIVOTS + 1.
NUM_PIVOTS = 8

# Keys of bf16 / fp16 logits widened to fp32 have this many trailing zero bits: dropping them
# makes the search interval (and the number of passes) smaller without losing any order.
KEY_SHIFTS = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}


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
def _row_keys(row_ptr, offs, V, x_max, scale, bm_row_ptr, KEY_SHIFT: tl.constexpr,
              HAS_BITMASK: tl.constexpr):
    """(key, exp(z), finite) of the allowed logits at ``offs`` (masked at V; HAS_BITMASK:
    tokens whose bit is cleared count as -inf, ``allowed_logits``).
    (load_logits and _sort_key inlined: each nested call costs the interpreter a re-patch.)"""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, float("-inf"))
    x = allowed_logits(x, offs, offs < V, bm_row_ptr, HAS_BITMASK)
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
                below_cand, bm_row_ptr, KEY_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr,
                UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr, HAS_BITMASK: tl.constexpr):
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
                key, e, finite = _row_keys(row_ptr, offs, V, x_max, scale, bm_row_ptr,
                                           KEY_SHIFT, HAS_BITMASK)
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
def _compact(row_ptr, V, x_max, scale, floor_key, lo, cand_key_ptr, cand_e_ptr, bm_row_ptr,
             KEY_SHIFT: tl.constexpr, BLOCK_C: tl.constexpr, CAP: tl.constexpr,
             HAS_BITMASK: tl.constexpr):
    """Writes the key and ``exp(z)`` of every live token with ``key >= lo`` to the row's
    candidate list (at most CAP; the caller knows how many there are) and returns their
    number and the largest live key below ``lo``. Later passes read only the list."""
    n = tl.full([], 0, tl.int32)
    lane_below = tl.full([BLOCK_C], -2147483648, tl.int32)
    for start in range(0, V, BLOCK_C):
        offs = start + tl.arange(0, BLOCK_C)
        key, e, finite = _row_keys(row_ptr, offs, V, x_max, scale, bm_row_ptr, KEY_SHIFT,
                                   HAS_BITMASK)
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
            cand_key_ptr, cand_e_ptr, bm_row_ptr, BY_MASS: tl.constexpr,
            KEY_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL_S: tl.constexpr,
            NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """The largest key ``t`` whose kept set ``{key >= t}`` still has count (top-k) or mass
    (top-p) ``>= target``, searched in ``[lo, hi]`` (keys of the row; ``lo`` qualifies and
    bounds the set from below). Returns ``t``, the count and mass of its kept set, and the
    row's candidate list (``n_cand``, ``below_cand``) for a later search.

    As soon as the kept set of ``lo`` has at most CAP tokens (often at once for top-p after
    top-k, or after a pass or two for top-k), one more pass over the row copies them to a
    candidate list and every later pass reads only that list; the answer is the same, since
    the keys left out are below every pivot still to come.

    Also returns ``lo_below``, the largest live key below the answer (``-2**31``: none): the
    largest key below the largest qualifying pivot, which is the one whose ``min_above`` the
    answer is."""
    floor_key = lo.to(tl.int32)
    lo_below = tl.full([], -2147483648, tl.int32)
    while lo < hi:
        if (n_cand < 0) & (lo_count <= CAP):
            n_cand, below_cand = _compact(row_ptr, V, x_max, scale, floor_key, lo.to(tl.int32),
                                          cand_key_ptr, cand_e_ptr, bm_row_ptr, KEY_SHIFT,
                                          BLOCK_S * UNROLL_S, CAP, HAS_BITMASK)
        pivots, count, mass, min_above, max_below = _pivot_pass(
            row_ptr, V, x_max, scale, floor_key, lo, hi, n_cand, cand_key_ptr, cand_e_ptr,
            below_cand, bm_row_ptr, KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, HAS_BITMASK)
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
        lo_below = tl.max(tl.where(ok, max_below, lo_below), axis=0)
        lo = new_lo
        hi = tl.maximum(new_hi, new_lo)
    return lo, lo_count, lo_mass, n_cand, below_cand, lo_below


@triton.jit
def _keep_probability_ties(row_ptr, V, x_max, scale, floor_key, lo, lo_count, lo_mass, lo_below,
                           n_cand, below_cand, cand_key_ptr, cand_e_ptr, bm_row_ptr,
                           KEY_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr,
                           UNROLL_S: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """Top-p keeps ``p >= tau``: where exp collapses distinct logits to one value (huge
    temperatures), logits below the threshold logit ``lo`` have its probability, and the
    boundary ties are kept (contract sections 1 and 16). The smallest key in ``[floor_key,
    lo]`` whose ``exp`` reaches the threshold's, by bisection (``exp`` is monotone in ``x``);
    when a live key lies at or above it and below ``lo`` (``lo_below``), one one-pivot pass
    counts the wider kept set and snaps ``lo`` onto a key of the row (over the candidate list
    when it holds every key that high, else over the row). Returns ``(lo, count, mass)``."""
    e_thr = tl.exp2((_key_value(lo, KEY_SHIFT) - x_max) * scale)
    tie_lo = floor_key
    tie_hi = lo
    while tie_lo < tie_hi:
        mid = tie_lo + (tie_hi - tie_lo) // 2
        if tl.exp2((_key_value(mid, KEY_SHIFT) - x_max) * scale) >= e_thr:
            tie_hi = mid
        else:
            tie_lo = mid + 1
    if tie_lo <= lo_below.to(tl.int64):
        # The list holds every live key above below_cand; a tie at or below it is in the row.
        n_read = tl.where(tie_lo > below_cand.to(tl.int64), n_cand, -1)
        _, count, mass, min_above, _ = _pivot_pass(
            row_ptr, V, x_max, scale, floor_key.to(tl.int32), tie_lo - 1, tie_lo, n_read,
            cand_key_ptr, cand_e_ptr, below_cand, bm_row_ptr, KEY_SHIFT, BLOCK_S, UNROLL_S, 1,
            HAS_BITMASK)
        lo = tl.max(min_above, axis=0).to(tl.int64)
        lo_count = tl.max(count, axis=0)
        lo_mass = tl.max(mass, axis=0)
    return lo, lo_count, lo_mass


@triton.jit
def filter_threshold(row_ptr, r, req, V, x_max, total, x_min, num_finite, greedy, scale,
                     temperature, top_k_ptr, top_p_ptr, min_p_ptr, cand_key_ptr, cand_e_ptr,
                     bm_row_ptr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
                     USE_MIN_P: tl.constexpr, KEY_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr,
                     UNROLL_S: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                     HAS_BITMASK: tl.constexpr):
    """Applies top-k, min-p, then top-p to row ``r`` (of request ``req``) given its merged statistics
    (pivot passes over the row, or over its candidate list, ``CAP`` entries per row at
    ``cand_*_ptr``, for the requests that use them). Returns ``(x_thr, norm)``: the threshold
    (``-inf``: nothing cut) and ``sum(exp(z))`` over the kept tokens."""
    cand_key_ptr += r.to(tl.int64) * CAP
    cand_e_ptr += r.to(tl.int64) * CAP
    n_cand = tl.full([], -1, tl.int32)  # no candidate list yet
    below_cand = tl.full([], -2147483648, tl.int32)
    has_finite = x_max > float("-inf")
    # The kept set is {key >= lo}; lo starts at the smallest finite key (everything kept).
    lo = _sort_key(tl.where(has_finite, x_min, 0.0), KEY_SHIFT).to(tl.int64)
    lo_mass = total
    lo_count = num_finite.to(tl.float32)
    filtered = tl.full([], 0, tl.int1)
    if USE_TOP_K:
        top_k = tl.load(top_k_ptr + req)
        if (~greedy) & (top_k > 0) & (top_k < V) & (num_finite > top_k):
            hi = _sort_key(x_max, KEY_SHIFT).to(tl.int64)
            lo, lo_count, lo_mass, n_cand, below_cand, _ = _search(
                row_ptr, V, x_max, scale, lo, hi, lo_count, lo_mass, top_k.to(tl.float32),
                n_cand, below_cand, cand_key_ptr, cand_e_ptr, bm_row_ptr, False,
                KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP, HAS_BITMASK)
            filtered = tl.full([], 1, tl.int1)
    if USE_MIN_P:
        min_p = tl.load(min_p_ptr + req)
        if (~greedy) & (min_p > 0.0) & has_finite:
            # z >= max(z) + log(min_p) is x >= x_max + T * log(min_p): a threshold known at
            # once (no search), its key rounded up onto the key grid. One pass (over the row,
            # or top-k's candidate list) counts the kept set and its mass and snaps lo onto a
            # key of the row: a one-pivot pass over the interval (cut_key - 1, cut_key].
            cut = x_max + temperature * tl.log(tl.minimum(min_p, 1.0))
            cut_key = _sort_key(cut, KEY_SHIFT)
            cut_key = tl.where(_key_value(cut_key, KEY_SHIFT) < cut, cut_key + 1, cut_key)
            if cut_key.to(tl.int64) > lo:
                _, count, mass, min_above, _ = _pivot_pass(
                    row_ptr, V, x_max, scale, lo.to(tl.int32), cut_key.to(tl.int64) - 1,
                    cut_key.to(tl.int64), n_cand, cand_key_ptr, cand_e_ptr, below_cand,
                    bm_row_ptr, KEY_SHIFT, BLOCK_S, UNROLL_S, 1, HAS_BITMASK)
                lo = tl.max(min_above, axis=0).to(tl.int64)
                lo_count = tl.max(count, axis=0)
                lo_mass = tl.max(mass, axis=0)
                filtered = tl.full([], 1, tl.int1)
    if USE_TOP_P:
        top_p = tl.load(top_p_ptr + req)
        if (~greedy) & (top_p < 1.0) & has_finite:
            hi = _sort_key(x_max, KEY_SHIFT).to(tl.int64)
            # A candidate list from top-k holds every key >= its lo <= this floor: keys
            # below it are not live here, so nothing is left out below the list.
            below_cand = tl.full([], -2147483648, tl.int32)
            floor_p = lo
            lo, lo_count, lo_mass, n_cand, below_cand, lo_below = _search(
                row_ptr, V, x_max, scale, lo, hi, lo_count, lo_mass, top_p * lo_mass,
                n_cand, below_cand, cand_key_ptr, cand_e_ptr, bm_row_ptr, True,
                KEY_SHIFT, BLOCK_S, UNROLL_S, NUM_PIVOTS, CAP, HAS_BITMASK)
            filtered = tl.full([], 1, tl.int1)
            lo, lo_count, lo_mass = _keep_probability_ties(
                row_ptr, V, x_max, scale, floor_p, lo, lo_count, lo_mass, lo_below, n_cand,
                below_cand, cand_key_ptr, cand_e_ptr, bm_row_ptr, KEY_SHIFT, BLOCK_S, UNROLL_S,
                HAS_BITMASK)
    return tl.where(filtered, _key_value(lo, KEY_SHIFT), float("-inf")), lo_mass


# ----------------------------------------------------------------------------- host side

# Blocks of BLOCK_S logits per iteration of a pivot pass on a GPU: independent loads in flight.
# (8 pivots x 4 blocks compiles without spills on sm_80/sm_90 with the candidate-list pass
# beside it; 8 blocks, or 2, spill; 16 pivots spill from 4 blocks.)
PIVOT_UNROLL = 4

# Tests set this to run the GPU's search configuration (BLOCK_S, UNROLL_S, NUM_PIVOTS) on CPU.
SEARCH_CONFIG_OVERRIDE: tuple[int, int, int] | None = None


def search_config(vocab: int, device: torch.device,
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


def candidate_capacity(filtered: bool) -> int:
    """Entries of a row's candidate list (the CAP constexpr): 0 when no filter is compiled in."""
    return SEARCH_CANDIDATES if filtered else 0
