"""What the two tree walks share (``tree.py``: the token walk, ``traversal.py``: traversal
verification): the draft modes, the residual evaluated element-wise from per-rejection
scalars, and the race of the final token over the node's current distribution.

The residual is never stored. Both walks keep, per rejection, a few scalars in register vectors
of N_P2 entries (entry ``j``: the ``j``-th rejection) and evaluate the residual at a token or a
block of tokens by replaying them: ``r <- max(w r / m - Q, 0)`` with the node's state before
the rejection (``w = 1`` in the token walk). A gather costs ``O(k)`` flops and a pass
``O(k V)`` after ``k`` rejections; the float operations are the reference's (``div_rn``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import _rng as trng
from ._tiles import (LOGPROBS_NONE, allowed_logits, exp2_scale, load_logits, processed_prob,
                     quad_offsets, tile_best, token_logprob)
from .stats import load_raw_stats

# Draft modes of the walks (the MODE constexpr): how a node's children were drawn.
MODE_DETERMINISTIC = tl.constexpr(0)      # no draft_probs: deterministic candidates
MODE_IID = tl.constexpr(1)                # i.i.d. from draft_probs
MODE_WITHOUT_REPLACEMENT = tl.constexpr(2)
DRAFT_MODES = {"iid": MODE_IID, "without_replacement": MODE_WITHOUT_REPLACEMENT}

# Vocabulary block and warps of the walks' row passes (one program per request, so a large
# block: 4 logits per thread per iteration). With the race's register bound (maxnreg 128) both
# walks compile without spills on sm_80/sm_90 (python_tests/test_triton_compile.py);
# unbounded, ptxas settles at 80 registers and spills from 512 on.
WALK_BLOCK = 1024
WALK_WARPS = 8

# The walks' runtime arguments and their Triton types, for the compile-only resource report
# (``bench/resources.py``).
WALK_SIGNATURE = {
    "logits_ptr": "*bf16", "stride_lb": "i64", "stride_ln": "i64", "stats_ptr": "*fp32",
    "argmax_ptr": "*i32", "q_ptr": "*fp32", "stride_qb": "i64", "stride_qn": "i64",
    "ids_ptr": "*i64", "stride_ib": "i64", "parents_ptr": "*i64", "stride_pb": "i64",
    "num_nodes_ptr": "*i32", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
    "offset_ptr": "*i64", "out_ptr": "*i32", "path_ptr": "*i32", "num_accepted_ptr": "*i32",
    "V": "i32", "N": "i32", "bitmask_ptr": "*i32", "bitmask_words": "i32", "raw_ptr": "*fp32",
    "logprobs_ptr": "*fp32",
}


@triton.jit
def request_inputs(temperature_ptr, seed_ptr, offset_ptr, num_nodes_ptr, logits_ptr, stride_lb,
                   q_ptr, stride_qb, bitmask_ptr, bitmask_words, N):
    """This program's request (grid B), its scalars and row bases: ``(req, temperature, scale,
    seed, offset, num_nodes, logits, draft probabilities, token_bitmask)``, ``num_nodes``
    clamped to ``[1, N]``."""
    req = tl.program_id(0)
    req64 = req.to(tl.int64)
    temperature = tl.load(temperature_ptr + req)
    num_nodes = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + req), 1), N)
    return (req, temperature, exp2_scale(temperature), tl.load(seed_ptr + req),
            tl.load(offset_ptr + req), num_nodes, logits_ptr + req64 * stride_lb,
            q_ptr + req64 * stride_qb, bitmask_ptr + req64 * N * bitmask_words)


@triton.jit
def node_rows(logits_req, stride_ln, q_req, stride_qn, bm_req, bitmask_words, node):
    """Node ``node``'s target-logit, draft-probability and ``token_bitmask`` rows."""
    node64 = node.to(tl.int64)
    return (logits_req + node64 * stride_ln, q_req + node64 * stride_qn,
            bm_req + node64 * bitmask_words)


@triton.jit
def emit_final(out_ptr, path_ptr, num_accepted_ptr, logprobs_ptr, raw_ptr, req, N, idx, out,
               path, depth, logprobs, sampled, node, row_ptr, x_max, x_thr, norm, argmax, scale,
               greedy, LOGPROBS: tl.constexpr):
    """Store a request's outputs: ``out`` (the accepted tokens) with the final token at
    ``depth`` (the arg-max of ``node``'s row when greedy, else ``sampled``), ``path``,
    ``depth`` accepted, and with LOGPROBS ``logprobs`` (the accepted tokens') with the final
    token's from ``node``'s row (one gathered logit: the token won, so it is allowed)."""
    final = tl.where(greedy, tl.where(x_max > float("-inf"), argmax, -1), sampled)
    out = tl.where(idx == depth, final, out)
    live = idx < N
    req64 = req.to(tl.int64)
    tl.store(out_ptr + req64 * N + idx, out, mask=live)
    tl.store(path_ptr + req64 * N + idx, path, mask=live)
    tl.store(num_accepted_ptr + req, depth)
    if LOGPROBS != LOGPROBS_NONE:
        emitted = final >= 0
        raw_max, raw_log_sum = load_raw_stats(raw_ptr, req * N + node, emitted, LOGPROBS)
        final_logprob = token_logprob(
            load_logits(row_ptr, tl.maximum(final, 0), emitted), x_max, x_thr, norm, scale,
            greedy, raw_max, raw_log_sum, final, LOGPROBS)
        logprobs = tl.where(idx == depth, final_logprob, logprobs)
        tl.store(logprobs_ptr + req64 * N + idx, logprobs, mask=live)


@triton.jit
def pick(vec, idx, j):
    """``vec[j]`` of a small register vector (``idx = arange``)."""
    return tl.sum(tl.where(idx == j, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def clamp_positive(x):
    """``max(x, 0)`` keeping NaN, as the reference's ``clamp(min=0)`` does (garbage
    ``draft_probs`` then give the same tokens on both backends)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def wor_draft(q, gone, q_mass):
    """q_i(v) of without-replacement drafts: 0 once removed or once the draft is exhausted."""
    # (nested where: the interpreter cannot `|` a block with a scalar computed from loads)
    kept = tl.where(gone, 0.0, tl.math.div_rn(q, tl.where(q_mass > 0.0, q_mass, 1.0)))
    return tl.where(q_mass > 0.0, kept, 0.0)


@triton.jit
def residual(p, q, v, steps, masses, q_masses, tokens, applied, idx, WOR: tl.constexpr):
    """The token walk's residual after ``steps`` rejections at the current node, at tokens
    ``v`` (a scalar or a block) with target probabilities ``p`` and draft probabilities ``q``
    there. Returns ``(r, gone)``: the unnormalised residual and, for without-replacement
    drafts, whether ``v`` was removed from the draft by a rejection."""
    r = p
    gone = v < 0
    for j in range(0, steps):
        mass = pick(masses, idx, j)
        ok = pick(applied, idx, j) != 0
        if WOR:
            draft = wor_draft(q, gone, pick(q_masses, idx, j))
            gone = gone | (v == pick(tokens, idx, j))
        else:
            draft = q
        r = tl.where(ok, clamp_positive(tl.math.div_rn(r, mass) - draft), r)
    return r, gone


@triton.jit
def node_residual(p, q, v, node, events, ev_node, ev_weight, ev_mass, ev_q_mass, ev_token,
                  ev_applied, idx, WOR: tl.constexpr):
    """Traversal: ``node``'s current unnormalised target distribution at tokens ``v`` (``p``,
    ``q`` its original target and draft probabilities there), by replaying the rejections
    recorded at it: ``r <- max(w * r / m - Q, 0)`` with the state ``(w, m, Q)`` before each.
    Returns ``(r, gone)``, ``gone``: ``v`` left the draft (without replacement)."""
    r = p
    gone = v < 0
    for e in range(0, events):
        mine = pick(ev_node, idx, e) == node
        if WOR:
            draft = wor_draft(q, gone, pick(ev_q_mass, idx, e))
            gone = gone | (mine & (v == pick(ev_token, idx, e)))
        else:
            draft = q
        ok = mine & (pick(ev_applied, idx, e) != 0)
        step = clamp_positive(pick(ev_weight, idx, e)
                              * tl.math.div_rn(r, pick(ev_mass, idx, e)) - draft)
        r = tl.where(ok, step, r)
    return r, gone


@triton.jit
def replayed_residual(p, q, v, node, steps, masses, q_masses, tokens, applied, ev_node,
                      ev_weight, idx, MODE: tl.constexpr, REPLAY: tl.constexpr):
    """``residual`` (the token walk: ``steps`` rejections at the current node) or, under
    REPLAY, ``node_residual`` (traversal: ``steps`` events, ``masses`` .. ``applied`` the
    events' state, ``ev_node``/``ev_weight`` read only here). Returns ``(r, gone)``."""
    if REPLAY:
        r, gone = node_residual(p, q, v, node, steps, ev_node, ev_weight, masses, q_masses,
                                tokens, applied, idx, MODE == MODE_WITHOUT_REPLACEMENT)
    else:
        r, gone = residual(p, q, v, steps, masses, q_masses, tokens, applied, idx,
                           MODE == MODE_WITHOUT_REPLACEMENT)
    return r, gone


@triton.jit
def rejection_mass(row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale, weight, mass,
                   q_mass, node, steps, masses, q_masses, tokens, applied, ev_node, ev_weight,
                   idx, MODE: tl.constexpr, REPLAY: tl.constexpr, HAS_BITMASK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """After a rejection at ``node`` (i.i.d. / without-replacement drafts): one pass over its
    target and draft rows for the new residual ``max(w r / m - Q, 0)`` (``r`` the node's
    current residual, ``replayed_residual``; ``m`` its mass, ``Q`` the draft with ``q_mass``
    left; ``w = 1`` in the token walk). Returns ``(mass, has_mass)``: summed per lane and
    reduced once after the loop (no CTA-wide reduction per block). Bytes: V * (elem +
    q_elem), plus V / 8 with the bitmask."""
    lane_mass = tl.zeros([BLOCK], tl.float32)
    lane_has = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        xv = allowed_logits(load_logits(row_ptr, offs, mask), offs, mask, bm_row_ptr,
                            HAS_BITMASK)
        pv = processed_prob(xv, x_max, x_thr, norm, scale)
        qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rv, gone_v = replayed_residual(pv, qv, offs, node, steps, masses, q_masses, tokens,
                                       applied, ev_node, ev_weight, idx, MODE, REPLAY)
        if MODE == MODE_WITHOUT_REPLACEMENT:
            qv = wor_draft(qv, gone_v, q_mass)
        nv = clamp_positive(weight * tl.math.div_rn(rv, mass) - qv)
        nv = tl.where(mask, nv, 0.0)
        lane_mass += nv
        lane_has = tl.maximum(lane_has, (nv > 0.0).to(tl.int32))
    return tl.sum(lane_mass, axis=0), tl.max(lane_has, axis=0)


@triton.jit
def _final_weight(row_ptr, q_row_ptr, bm_row_ptr, offs, mask, x_max, x_thr, norm, scale, node,
                  steps, masses, q_masses, tokens, applied, ev_node, ev_weight, idx,
                  MODE: tl.constexpr, REPLAY: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """The weight the final token is raced from at tokens ``offs`` (0 where masked): the node's
    p with the rejected tokens removed (deterministic candidates), else its current residual
    (``replayed_residual``)."""
    x = allowed_logits(load_logits(row_ptr, offs, mask), offs, mask, bm_row_ptr, HAS_BITMASK)
    weight = processed_prob(x, x_max, x_thr, norm, scale)
    if MODE == MODE_DETERMINISTIC:
        # O(steps) per element; a [BLOCK, N_P2] comparison would spill for large N.
        for j in range(0, steps):
            weight = tl.where(offs == pick(tokens, idx, j), 0.0, weight)
    else:
        if steps > 0:
            qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            weight = replayed_residual(weight, qv, offs, node, steps, masses, q_masses, tokens,
                                       applied, ev_node, ev_weight, idx, MODE, REPLAY)[0]
    return tl.where(mask, weight, 0.0)


@triton.jit
def race_final_token(row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale, temperature,
                     seed, offset, node, steps, masses, q_masses, tokens, applied, ev_node,
                     ev_weight, idx, MODE: tl.constexpr, REPLAY: tl.constexpr,
                     HAS_BITMASK: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """The correction or bonus token of a sampled request, raced from ``node``'s row
    (``_final_weight``; the rejection state as there, ``ev_node``/``ev_weight`` read only
    under REPLAY): the sampled id, -1 when no weight is positive or one is NaN (garbage
    draft_probs, as in the reference). Nothing is read on a greedy row (``temperature == 0``).

    The two-level race (see ``_rng``): first the groups of GROUP tokens by their mass of the
    final weights (per-lane sums, one reduction and one Philox per group), then the tokens of
    the winning group. Bytes: one target row (plus its draft row when rejections are pending),
    and the winning group again."""
    best_group = tl.full([], -1, tl.int32)
    best_group_score = tl.full([], -1.0, tl.float32)
    has_nan = tl.full([], 0, tl.int1)
    if temperature != 0.0:
        for group_start in range(0, V, GROUP):
            lane_mass = tl.zeros([BLOCK], tl.float32)
            for start in range(group_start, tl.minimum(group_start + GROUP, V), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                lane_mass += _final_weight(row_ptr, q_row_ptr, bm_row_ptr, offs, offs < V,
                                           x_max, x_thr, norm, scale, node, steps, masses,
                                           q_masses, tokens, applied, ev_node, ev_weight, idx,
                                           MODE, REPLAY, HAS_BITMASK)
            group = group_start // GROUP
            mass = tl.sum(lane_mass, axis=0)  # NaN when a weight is
            has_nan = has_nan | (mass != mass)
            noise = trng.group_noise(seed, offset, node, trng.PURPOSE_RESAMPLE, group)
            score = tl.where(mass > 0.0, tl.math.div_rn(mass, noise), -1.0)
            best_group = tl.where(score > best_group_score, group, best_group)
            best_group_score = tl.maximum(score, best_group_score)
    # Per-lane winners (strict >: a lane's earliest offset), reduced once after the loop:
    # max score, lowest id among equal scores, with no CTA-wide reduction per block.
    # Tiles of [BLOCK // 4, 4] tokens: one Philox per four tokens (trng.token_noise).
    lane_best = tl.full([BLOCK // 4, 4], -1.0, tl.float32)
    lane_idx = tl.full([BLOCK // 4, 4], 2147483647, tl.int32)
    if best_group >= 0:
        group_start = best_group * GROUP
        for start in range(group_start, tl.minimum(group_start + GROUP, V), BLOCK):
            offs = quad_offsets(start, BLOCK // 4)
            weight = _final_weight(row_ptr, q_row_ptr, bm_row_ptr, offs, offs < V, x_max,
                                   x_thr, norm, scale, node, steps, masses, q_masses, tokens,
                                   applied, ev_node, ev_weight, idx, MODE, REPLAY, HAS_BITMASK)
            noise = trng.token_noise(seed, offset, node, trng.PURPOSE_RESAMPLE, start // 4,
                                     BLOCK // 4)
            score = tl.where(weight > 0.0, tl.math.div_rn(weight, noise), -1.0)
            take = score > lane_best
            lane_best = tl.where(take, score, lane_best)
            lane_idx = tl.where(take, offs, lane_idx)
    best, best_idx = tile_best(lane_best, lane_idx)
    # A row with no finite logit has no distribution: -1 even where an unvalidated negative q
    # gave a residual mass (contract 7).
    return tl.where((best >= 0.0) & (~has_nan) & (x_max > float("-inf")), best_idx, -1)
