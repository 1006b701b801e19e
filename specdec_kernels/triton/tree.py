"""Fused tree verification (contract section 4).

Launches, both asynchronous (no host synchronisation, CUDA-graph capturable with tensor seeds):

1. ``_row_stats_kernel`` (``stats.py``, shared with the chain) over the ``B*N`` node rows:
   one streaming pass per row (plus pivot passes for rows whose top-k/top-p is active), so
   ``p(x)`` of any token is one gathered logit and three floats. Rows split over programs
   are merged by ``_row_stats_finish_kernel`` when filtered, else by the walk as it reads
   them (``load_row_stats``).
2. ``_tree_walk_kernel`` (grid B): the walk of ``reference/tree.py`` for one request, node by
   node in index order. Acceptance needs only gathered values: ``p(x)``, ``q(x)``, the
   request's uniform, and -- after rejections at the current node -- a few per-rejection
   scalars kept in registers (see below). Full rows are read only where the contract needs a
   residual: after a rejected child under i.i.d. / without-replacement drafts (one pass over
   the node's target and draft rows to get the new residual's mass), and for the final
   correction/bonus sample (one pass over the final node's row, racing exponential noise).

The residual is never stored. After ``k`` rejections at node ``u`` it is the same recursion as
the reference, evaluated element-wise from ``p(v)``, ``q(v)`` and the per-rejection scalars
(mass before the step, draft mass, rejected token, whether the step applied):
``r_j = max(r_{j-1} / m_{j-1} - q_j, 0)`` (``q_j = q`` for i.i.d.; ``q`` without the earlier
rejected tokens over its remaining mass for without-replacement drafts), so a gather costs
``O(k)`` flops and a pass ``O(k V)``. Deterministic candidates need no pass at all: removing a
token subtracts its gathered ``p(x)`` from the mass, and a later duplicate is recognised from
the list of removed tokens. Same float operations as the reference (``div_rn``); sums differ
only in order.

Memory: stats ``[B*N, 3]`` float32 + ``[B*N]`` int32; outputs. Nothing grows with ``B*N*V``.
Logits and draft probabilities are read in their own dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _rng
from . import _rng as trng
from ._launch import (MAX_REGISTERS, block_size, last_dim_contiguous, launch_options, next_pow2,
                      scratch)
from ._tiles import (LOGPROBS_KINDS, LOGPROBS_NONE, LOGPROBS_RAW, allowed_logits, exp2_scale,
                     load_logits, processed_prob, quad_offsets, tile_best, token_logprob)
from .accept import rejection_weight, sequence_weight
from .stats import load_raw_stats, load_row_stats, row_stats

# Draft modes of the walk (the MODE constexpr): how a node's children were drawn.
MODE_DETERMINISTIC = tl.constexpr(0)      # no draft_probs: deterministic candidates
MODE_IID = tl.constexpr(1)                # i.i.d. from draft_probs
MODE_WITHOUT_REPLACEMENT = tl.constexpr(2)
_MODES = {"iid": MODE_IID, "without_replacement": MODE_WITHOUT_REPLACEMENT}


@triton.jit
def _pick(vec, idx, j):
    """``vec[j]`` of a small register vector (``idx = arange``)."""
    return tl.sum(tl.where(idx == j, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _clamp_positive(x):
    """``max(x, 0)`` keeping NaN, as the reference's ``clamp(min=0)`` does (garbage
    ``draft_probs`` then give the same tokens on both backends)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _residual(p, q, v, steps, masses, q_masses, tokens, applied, idx, WOR: tl.constexpr):
    """The residual after ``steps`` rejections at the current node, at tokens ``v`` (a scalar
    or a block) with target probabilities ``p`` and draft probabilities ``q`` there. Returns
    ``(r, gone)``: the unnormalised residual and, for without-replacement drafts, whether ``v``
    was removed from the draft by a rejection."""
    r = p
    gone = v < 0
    for j in range(0, steps):
        mass = _pick(masses, idx, j)
        ok = _pick(applied, idx, j) != 0
        if WOR:
            draft = _wor_draft(q, gone, _pick(q_masses, idx, j))
            gone = gone | (v == _pick(tokens, idx, j))
        else:
            draft = q
        r = tl.where(ok, _clamp_positive(tl.math.div_rn(r, mass) - draft), r)
    return r, gone


@triton.jit
def _wor_draft(q, gone, q_mass):
    """q_i(v) of without-replacement drafts: 0 once removed or once the draft is exhausted."""
    # (nested where: the interpreter cannot `|` a block with a scalar computed from loads)
    kept = tl.where(gone, 0.0, tl.math.div_rn(q, tl.where(q_mass > 0.0, q_mass, 1.0)))
    return tl.where(q_mass > 0.0, kept, 0.0)


@triton.jit
def _final_weight(row_ptr, q_row_ptr, offs, mask, x_max, x_thr, norm, scale, steps, masses,
                  q_masses, tokens, applied, idx, bm_row_ptr, MODE: tl.constexpr,
                  HAS_BITMASK: tl.constexpr):
    """The weight the final token is raced from at tokens ``offs`` (0 where masked): the
    current node's p with the rejected tokens removed (deterministic candidates) or the
    residual after ``steps`` rejections."""
    x = allowed_logits(load_logits(row_ptr, offs, mask), offs, mask, bm_row_ptr, HAS_BITMASK)
    weight = processed_prob(x, x_max, x_thr, norm, scale)
    if MODE == MODE_DETERMINISTIC:
        # O(steps) per element; a [BLOCK, N_P2] comparison would spill for large N.
        for j in range(0, steps):
            weight = tl.where(offs == _pick(tokens, idx, j), 0.0, weight)
    else:
        if steps > 0:
            qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            weight, _ = _residual(weight, qv, offs, steps, masses, q_masses, tokens, applied,
                                  idx, MODE == MODE_WITHOUT_REPLACEMENT)
    return weight


@triton.jit
def _tree_walk_kernel(logits_ptr, stride_lb, stride_ln, stats_ptr, argmax_ptr,
                      q_ptr, stride_qb, stride_qn, ids_ptr, stride_ib, parents_ptr, stride_pb,
                      num_nodes_ptr, temperature_ptr, seed_ptr, offset_ptr,
                      out_ptr, path_ptr, num_accepted_ptr, V, N, bitmask_ptr, bitmask_words,
                      raw_ptr, logprobs_ptr,
                      MODE: tl.constexpr, N_P2: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                      STATS_CHUNKS_P2: tl.constexpr, HAS_BITMASK: tl.constexpr = False,
                      LOGPROBS: tl.constexpr = 0):
    """The walk and the final sample of one request (grid B).

    Bytes per request: per node, its parent and id (8-16 B); per tested child, 12 + 4 B of
    stats, one target logit and one draft probability; per rejected child under i.i.d. /
    without-replacement drafts, one target row and one draft row (V * (elem + q_elem)); for
    the final token, one target row (plus its draft row when residual steps are pending).
    Writes 2 * N * 4 + 4 B. Compute: O(k) flops per element of a pass after k rejections at
    the node, one Philox-4x32-10 per four tokens of the final pass. Both kinds of pass keep
    per-lane accumulators (mass, winner) and reduce across lanes once after the loop.
    HAS_BITMASK: every target logit read is masked by its node's ``token_bitmask`` word
    (rows ``[B*N, W]``; 4 B per 32 logits read). LOGPROBS (processed, raw): ``logprobs``
    like ``out``, an accepted node's at its parent's row, the final token's at the last
    accepted node's row, from the values already gathered (raw: 8 B of T = 1 statistics).
    """
    req = tl.program_id(0)
    req64 = req.to(tl.int64)
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature == 0.0
    scale = exp2_scale(temperature)
    seed = tl.load(seed_ptr + req)
    offset = tl.load(offset_ptr + req)
    num_nodes = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + req), 1), N)
    logits_req = logits_ptr + req64 * stride_lb
    q_req = q_ptr + req64 * stride_qb
    bm_req = bitmask_ptr + req64 * N * bitmask_words

    idx = tl.arange(0, N_P2)
    # Per-rejection scalars at the current node (entry j: the j-th rejection).
    masses = tl.zeros([N_P2], tl.float32)
    q_masses = tl.zeros([N_P2], tl.float32)
    tokens = tl.full([N_P2], -1, tl.int32)
    applied = tl.zeros([N_P2], tl.int32)
    # The accepted path (root first) and its tokens.
    path = tl.where(idx == 0, 0, -1)
    out = tl.full([N_P2], -1, tl.int32)
    logprobs = tl.full([N_P2], float("nan"), tl.float32)

    current = tl.full([], 0, tl.int32)
    depth = tl.full([], 0, tl.int32)
    steps = tl.full([], 0, tl.int32)
    p_mass = tl.full([], 1.0, tl.float32)
    q_mass = tl.full([], 1.0, tl.float32)
    last_removed = tl.full([], -1, tl.int32)

    for i in range(1, N):
        node = tl.zeros([], tl.int32) + i  # the interpreter's loop index is a Python int
        # Checked in the ids' own width, then narrowed (validate=False: 2**32 + 3 is no id 3).
        parent = tl.load(parents_ptr + req64 * stride_pb + node).to(tl.int64)
        token = tl.load(ids_ptr + req64 * stride_ib + node).to(tl.int64)
        real = (node < num_nodes) & (parent >= 0) & (parent < node) & (token >= 0) & (token < V)
        tested = real & (parent == current)
        token = tl.where(tested, token, 0).to(tl.int32)
        x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * N + current,
                                                    tested, scale, STATS_CHUNKS, STATS_CHUNKS_P2)
        row_ptr = logits_req + current.to(tl.int64) * stride_ln
        q_row_ptr = q_req + current.to(tl.int64) * stride_qn
        bm_row_ptr = bm_req + current.to(tl.int64) * bitmask_words
        x_token = allowed_logits(load_logits(row_ptr, token, tested), token, tested, bm_row_ptr,
                                 HAS_BITMASK)
        p_x = processed_prob(x_token, x_max, x_thr, norm, scale)
        if MODE == MODE_DETERMINISTIC:
            gone = tl.max(((tokens == token) & (idx < steps)).to(tl.int32), axis=0) != 0
            p_token = tl.where(gone, 0.0, p_x)
            draft = tl.full([], 1.0, tl.float32)
        else:
            q_x = tl.load(q_row_ptr + token, mask=tested, other=0.0).to(tl.float32)
            p_token, gone = _residual(p_x, q_x, token, steps, masses, q_masses, tokens, applied,
                                      idx, MODE == MODE_WITHOUT_REPLACEMENT)
            if MODE == MODE_WITHOUT_REPLACEMENT:
                draft = _wor_draft(q_x, gone, q_mass)
            else:
                draft = q_x
        target = tl.where(p_mass > 0.0,
                          tl.math.div_rn(p_token, tl.where(p_mass > 0.0, p_mass, 1.0)),
                          tl.where(p_token > 0.0, float("inf"), 0.0))
        u = trng.uniform(seed, offset, node, trng.PURPOSE_ACCEPT, tl.zeros([], tl.int32))
        greedy_ok = (token == argmax) & (x_max > float("-inf"))
        accept = tested & tl.where(greedy, greedy_ok, u * draft < target)
        rejected = tested & (~accept) & (~greedy)

        if MODE == MODE_DETERMINISTIC:
            p_mass = tl.where(rejected, p_mass - p_token, p_mass)
            last_removed = tl.where(rejected & (p_token > 0.0), token, last_removed)
        else:
            new_mass = tl.full([], 0.0, tl.float32)
            has_mass = tl.full([], 0, tl.int32)
            if rejected:
                # One pass over the node's rows: the mass of max(p_k - q_{k+1}, 0), summed per
                # lane and reduced once after the loop (no CTA-wide reduction per block).
                lane_mass = tl.zeros([BLOCK], tl.float32)
                lane_has = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < V
                    xv = allowed_logits(load_logits(row_ptr, offs, mask), offs, mask,
                                        bm_row_ptr, HAS_BITMASK)
                    pv = processed_prob(xv, x_max, x_thr, norm, scale)
                    qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                    rv, gone_v = _residual(pv, qv, offs, steps, masses, q_masses, tokens,
                                           applied, idx, MODE == MODE_WITHOUT_REPLACEMENT)
                    if MODE == MODE_WITHOUT_REPLACEMENT:
                        qv = _wor_draft(qv, gone_v, q_mass)
                    nv = _clamp_positive(tl.math.div_rn(rv, p_mass) - qv)
                    nv = tl.where(mask, nv, 0.0)
                    lane_mass += nv
                    lane_has = tl.maximum(lane_has, (nv > 0.0).to(tl.int32))
                new_mass = tl.sum(lane_mass, axis=0)
                has_mass = tl.max(lane_has, axis=0)
            masses = tl.where(rejected & (idx == steps), p_mass, masses)
            q_masses = tl.where(rejected & (idx == steps), q_mass, q_masses)
            applied = tl.where(rejected & (idx == steps), has_mass, applied)
            p_mass = tl.where(rejected & (has_mass != 0), new_mass, p_mass)
            if MODE == MODE_WITHOUT_REPLACEMENT:
                q_mass = tl.where(rejected, q_mass - tl.where(gone, 0.0, q_x), q_mass)
        if LOGPROBS != LOGPROBS_NONE:  # at the parent's (current) row, before the move
            raw_max, raw_log_sum = load_raw_stats(raw_ptr, req * N + current, tested, LOGPROBS)
            logprobs = tl.where(accept & (idx == depth), token_logprob(
                x_token, x_max, x_thr, norm, scale, greedy, raw_max, raw_log_sum, token,
                LOGPROBS), logprobs)
        tokens = tl.where(rejected & (idx == steps), token, tokens)
        steps = tl.where(rejected, steps + 1, steps)

        out = tl.where(accept & (idx == depth), token, out)
        depth = tl.where(accept, depth + 1, depth)
        path = tl.where(accept & (idx == depth), node, path)
        current = tl.where(accept, node, current)
        steps = tl.where(accept, 0, steps)
        p_mass = tl.where(accept, 1.0, p_mass)
        q_mass = tl.where(accept, 1.0, q_mass)
        last_removed = tl.where(accept, -1, last_removed)

    # The correction (rejections pending) or bonus token, from the current node's row.
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * N + current,
                                                tl.full([], 1, tl.int1), scale, STATS_CHUNKS,
                                                STATS_CHUNKS_P2)
    row_ptr = logits_req + current.to(tl.int64) * stride_ln
    q_row_ptr = q_req + current.to(tl.int64) * stride_qn
    bm_row_ptr = bm_req + current.to(tl.int64) * bitmask_words
    # The two-level race (see _rng): first the groups of GROUP tokens by their mass of the
    # final weights (per-lane sums, one reduction and one Philox per group), then the tokens
    # of the winning group. Greedy: the arg-max from the stats, no pass.
    best_group = tl.full([], -1, tl.int32)
    best_group_score = tl.full([], -1.0, tl.float32)
    # A NaN weight (garbage draft_probs) emits -1, as in the reference.
    has_nan = tl.full([], 0, tl.int1)
    if temperature != 0.0:
        for group_start in range(0, V, GROUP):
            lane_mass = tl.zeros([BLOCK], tl.float32)
            for start in range(group_start, tl.minimum(group_start + GROUP, V), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                lane_mass += _final_weight(row_ptr, q_row_ptr, offs, offs < V, x_max, x_thr,
                                           norm, scale, steps, masses, q_masses, tokens,
                                           applied, idx, bm_row_ptr, MODE, HAS_BITMASK)
            group = group_start // GROUP
            mass = tl.sum(lane_mass, axis=0)  # NaN when a weight is
            has_nan = has_nan | (mass != mass)
            noise = trng.group_noise(seed, offset, current, trng.PURPOSE_RESAMPLE, group)
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
            weight = _final_weight(row_ptr, q_row_ptr, offs, offs < V, x_max, x_thr, norm,
                                   scale, steps, masses, q_masses, tokens, applied, idx,
                                   bm_row_ptr, MODE, HAS_BITMASK)
            noise = trng.token_noise(seed, offset, current, trng.PURPOSE_RESAMPLE, start // 4,
                                     BLOCK // 4)
            score = tl.where(weight > 0.0, tl.math.div_rn(weight, noise), -1.0)
            take = score > lane_best
            lane_best = tl.where(take, score, lane_best)
            lane_idx = tl.where(take, offs, lane_idx)
    best, best_idx = tile_best(lane_best, lane_idx)
    sampled = tl.where((best >= 0.0) & (~has_nan), best_idx, -1)
    if MODE == MODE_DETERMINISTIC:
        # Removals left no mass (rounding only): the last removed token was all that remained.
        sampled = tl.where((sampled < 0) & (last_removed >= 0), last_removed, sampled)
    final = tl.where(greedy, tl.where(x_max > float("-inf"), argmax, -1), sampled)
    out = tl.where(idx == depth, final, out)

    live = idx < N
    tl.store(out_ptr + req64 * N + idx, out, mask=live)
    tl.store(path_ptr + req64 * N + idx, path, mask=live)
    tl.store(num_accepted_ptr + req, depth)
    if LOGPROBS != LOGPROBS_NONE:  # one gathered logit: the token won, so it is allowed
        emitted = final >= 0
        raw_max, raw_log_sum = load_raw_stats(raw_ptr, req * N + current, emitted, LOGPROBS)
        final_logprob = token_logprob(
            load_logits(row_ptr, tl.maximum(final, 0), emitted), x_max, x_thr, norm, scale,
            greedy, raw_max, raw_log_sum, final, LOGPROBS)
        logprobs = tl.where(idx == depth, final_logprob, logprobs)
        tl.store(logprobs_ptr + req64 * N + idx, logprobs, mask=live)


@triton.jit
def _node_residual(p, q, v, node, events, ev_node, ev_weight, ev_mass, ev_q_mass, ev_token,
                   ev_applied, idx, WOR: tl.constexpr):
    """``node``'s current unnormalised target distribution at tokens ``v`` (``p``, ``q`` its
    original target and draft probabilities there), by replaying the rejections recorded at
    it: ``r <- max(w * r / m - Q, 0)`` with the state ``(w, m, Q)`` before each. Returns
    ``(r, gone)``, ``gone``: ``v`` left the draft (without replacement)."""
    r = p
    gone = v < 0
    for e in range(0, events):
        mine = _pick(ev_node, idx, e) == node
        if WOR:
            draft = _wor_draft(q, gone, _pick(ev_q_mass, idx, e))
            gone = gone | (mine & (v == _pick(ev_token, idx, e)))
        else:
            draft = q
        ok = mine & (_pick(ev_applied, idx, e) != 0)
        step = _clamp_positive(_pick(ev_weight, idx, e)
                               * tl.math.div_rn(r, _pick(ev_mass, idx, e)) - draft)
        r = tl.where(ok, step, r)
    return r, gone


@triton.jit
def _traversal_kernel(logits_ptr, stride_lb, stride_ln, stats_ptr, argmax_ptr,
                      q_ptr, stride_qb, stride_qn, ids_ptr, stride_ib, parents_ptr, stride_pb,
                      num_nodes_ptr, temperature_ptr, seed_ptr, offset_ptr,
                      out_ptr, path_ptr, num_accepted_ptr, V, N,
                      WOR: tl.constexpr, N_P2: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                      STATS_CHUNKS_P2: tl.constexpr):
    """Traversal verification of one request (grid B): ``reference.tree.traverse_tree``.

    The depth-first walk runs on register vectors of N_P2 entries: the tree's first-child and
    next-sibling links, each node's ``w``, target mass and draft mass, and the rejections in
    the order they happened (node updated, its state before, the rejected token), from which
    a node's current distribution is replayed element-wise (``_node_residual``) -- nothing
    grows with V. Entering a node gathers its token's ``P``/``Q`` at its parent (stats, one
    logit, one draft probability); testing an original leaf reuses them; a rejection makes
    one pass over the parent's target and draft rows (its new mass ``S``); the final token is
    the race over the accepted node's current distribution (one pass, plus the winning group
    again). Greedy requests walk with ``w`` in {0, 1} along the arg-max path and take the
    accepted node's arg-max: the token walk's answer, with no row pass.

    Bytes per request: 2 N ids and parents; per entered node 16 B of stats, one logit and
    one draft probability; per rejection V * (elem + q_elem); for the final token one target
    and one draft row (the draft row only after rejections there). Writes 2 N * 4 + 4 B.
    Compute: O(events) per element of a pass (the replay), O(N^2) register work for the links.
    """
    req = tl.program_id(0)
    req64 = req.to(tl.int64)
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature == 0.0
    scale = exp2_scale(temperature)
    seed = tl.load(seed_ptr + req)
    offset = tl.load(offset_ptr + req)
    num_nodes = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + req), 1), N)
    logits_req = logits_ptr + req64 * stride_lb
    q_req = q_ptr + req64 * stride_qb

    idx = tl.arange(0, N_P2)
    in_range = idx < N
    parent_v = tl.load(parents_ptr + req64 * stride_pb + idx, mask=in_range, other=-1).to(tl.int64)
    token_v = tl.load(ids_ptr + req64 * stride_ib + idx, mask=in_range, other=-1).to(tl.int64)
    real = (idx > 0) & (idx < num_nodes) & (parent_v >= 0) & (parent_v < idx) & \
        (token_v >= 0) & (token_v < V)
    parents = tl.where(real, parent_v, 0).to(tl.int32)
    tokens = tl.where(real, token_v, 0).to(tl.int32)
    # Reachable nodes (every ancestor real), then the tree's first-child / next-sibling links
    # (children in increasing index: built from the last node down).
    reach = (idx == 0).to(tl.int32)
    for i in range(1, N):
        ok = (_pick(real.to(tl.int32), idx, i) != 0) & \
            (_pick(reach, idx, _pick(parents, idx, i)) != 0)
        reach = tl.where(idx == i, ok.to(tl.int32), reach)
    first_child = tl.full([N_P2], -1, tl.int32)
    next_sibling = tl.full([N_P2], -1, tl.int32)
    for k in range(1, N):
        i = N - k
        if _pick(reach, idx, i) != 0:
            parent = _pick(parents, idx, i)
            next_sibling = tl.where(idx == i, _pick(first_child, idx, parent), next_sibling)
            first_child = tl.where(idx == parent, i, first_child)
    has_children = first_child >= 0
    pending = first_child

    # Per node: w, mass of the (unnormalised) current target row, remaining draft mass.
    weight = tl.full([N_P2], 1.0, tl.float32)
    p_mass = tl.full([N_P2], 1.0, tl.float32)
    q_mass = tl.full([N_P2], 1.0, tl.float32)
    # Rejections in the order they happened: node updated, its (w, mass, draft mass) before,
    # the rejected child's token, whether the residual had mass.
    ev_node = tl.full([N_P2], -1, tl.int32)
    ev_weight = tl.zeros([N_P2], tl.float32)
    ev_mass = tl.full([N_P2], 1.0, tl.float32)
    ev_q_mass = tl.full([N_P2], 1.0, tl.float32)
    ev_token = tl.full([N_P2], -1, tl.int32)
    ev_applied = tl.zeros([N_P2], tl.int32)
    events = tl.full([], 0, tl.int32)

    current = tl.full([], 0, tl.int32)
    done = tl.full([], 0, tl.int1)
    for step in range(0, 2 * N):  # each node entered and left once, then the root
        if ~done:
            child = _pick(pending, idx, current)
            # The node being entered (child) or left (current), and the parent whose state
            # decides it.
            entering = child >= 0
            node = tl.where(entering, child, current)
            parent = tl.where(entering, current, _pick(parents, idx, current))
            token = _pick(tokens, idx, node)
            x_max, x_thr, norm, argmax = load_row_stats(
                stats_ptr, argmax_ptr, req * N + parent, tl.full([], 1, tl.int1), scale,
                STATS_CHUNKS, STATS_CHUNKS_P2)
            row_ptr = logits_req + parent.to(tl.int64) * stride_ln
            q_row_ptr = q_req + parent.to(tl.int64) * stride_qn
            p_x = processed_prob(load_logits(row_ptr, token, node > 0), x_max, x_thr, norm,
                                 scale)
            q_x = tl.load(q_row_ptr + token, mask=node > 0, other=0.0).to(tl.float32)
            r_x, gone = _node_residual(p_x, q_x, token, parent, events, ev_node, ev_weight,
                                       ev_mass, ev_q_mass, ev_token, ev_applied, idx, WOR)
            target = tl.math.div_rn(r_x, _pick(p_mass, idx, parent))
            if WOR:
                draft = _wor_draft(q_x, gone, _pick(q_mass, idx, parent))
            else:
                draft = q_x
            w_parent = _pick(weight, idx, parent)
            if entering:
                pending = tl.where(idx == current, _pick(next_sibling, idx, child), pending)
                if greedy:  # the token walk's rule: w is 1 along the arg-max path, else 0
                    match = (token == argmax) & (x_max > float("-inf"))
                    w_child = tl.where(match, w_parent, 0.0)
                else:
                    w_child = sequence_weight(w_parent, target, draft)
                weight = tl.where(idx == child, w_child, weight)
                current = child
            elif current == 0:
                done = tl.full([], 1, tl.int1)
            else:
                u = trng.uniform(seed, offset, current, trng.PURPOSE_ACCEPT,
                                 tl.zeros([], tl.int32))
                w_node = _pick(weight, idx, current)
                if greedy:
                    passed = w_node >= 1.0
                elif _pick(has_children.to(tl.int32), idx, current) != 0:
                    passed = u < w_node
                else:
                    passed = u * draft < w_parent * target
                if passed:
                    done = tl.full([], 1, tl.int1)
                else:
                    if ~greedy:
                        # One pass over the parent's rows: the mass of max(w P - Q, 0).
                        lane_mass = tl.zeros([BLOCK], tl.float32)
                        lane_has = tl.zeros([BLOCK], tl.int32)
                        mass = _pick(p_mass, idx, parent)
                        for start in range(0, V, BLOCK):
                            offs = start + tl.arange(0, BLOCK)
                            mask = offs < V
                            pv = processed_prob(load_logits(row_ptr, offs, mask), x_max, x_thr,
                                                norm, scale)
                            qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                            rv, gone_v = _node_residual(pv, qv, offs, parent, events, ev_node,
                                                        ev_weight, ev_mass, ev_q_mass, ev_token,
                                                        ev_applied, idx, WOR)
                            if WOR:
                                qv = _wor_draft(qv, gone_v, _pick(q_mass, idx, parent))
                            nv = _clamp_positive(w_parent * tl.math.div_rn(rv, mass) - qv)
                            nv = tl.where(mask, nv, 0.0)
                            lane_mass += nv
                            lane_has = tl.maximum(lane_has, (nv > 0.0).to(tl.int32))
                        new_mass = tl.sum(lane_mass, axis=0)
                        has_mass = tl.max(lane_has, axis=0)
                        slot = idx == events
                        ev_node = tl.where(slot, parent, ev_node)
                        ev_weight = tl.where(slot, w_parent, ev_weight)
                        ev_mass = tl.where(slot, mass, ev_mass)
                        ev_q_mass = tl.where(slot, _pick(q_mass, idx, parent), ev_q_mass)
                        ev_token = tl.where(slot, token, ev_token)
                        ev_applied = tl.where(slot, has_mass, ev_applied)
                        events += 1
                        weight = tl.where(idx == parent, rejection_weight(new_mass, w_parent),
                                          weight)
                        p_mass = tl.where((idx == parent) & (has_mass != 0), new_mass, p_mass)
                        if WOR:
                            q_mass = tl.where(idx == parent,
                                              q_mass - tl.where(gone, 0.0, q_x), q_mass)
                    current = parent

    # The accepted node's path and tokens, root first.
    accepted = current
    depth = tl.full([], 0, tl.int32)
    node = accepted
    for level in range(0, N):
        depth += (node > 0).to(tl.int32)
        node = tl.where(node > 0, _pick(parents, idx, node), 0)
    path = tl.full([N_P2], -1, tl.int32)
    out = tl.full([N_P2], -1, tl.int32)
    node = accepted
    for k in range(0, N):
        level = depth - k
        path = tl.where((level >= 0) & (idx == level), node, path)
        out = tl.where((level >= 1) & (idx == level - 1), _pick(tokens, idx, node), out)
        node = tl.where(node > 0, _pick(parents, idx, node), 0)

    # The final token: a race over the accepted node's current distribution.
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * N + accepted,
                                                tl.full([], 1, tl.int1), scale, STATS_CHUNKS,
                                                STATS_CHUNKS_P2)
    row_ptr = logits_req + accepted.to(tl.int64) * stride_ln
    q_row_ptr = q_req + accepted.to(tl.int64) * stride_qn
    best_group = tl.full([], -1, tl.int32)
    best_group_score = tl.full([], -1.0, tl.float32)
    has_nan = tl.full([], 0, tl.int1)
    if temperature != 0.0:
        for group_start in range(0, V, GROUP):
            lane_mass = tl.zeros([BLOCK], tl.float32)
            for start in range(group_start, tl.minimum(group_start + GROUP, V), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < V
                pv = processed_prob(load_logits(row_ptr, offs, mask), x_max, x_thr, norm, scale)
                qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                rv = _node_residual(pv, qv, offs, accepted, events, ev_node, ev_weight,
                                    ev_mass, ev_q_mass, ev_token, ev_applied, idx, WOR)[0]
                lane_mass += tl.where(mask, rv, 0.0)
            group = group_start // GROUP
            mass = tl.sum(lane_mass, axis=0)
            has_nan = has_nan | (mass != mass)
            noise = trng.group_noise(seed, offset, accepted, trng.PURPOSE_RESAMPLE, group)
            score = tl.where(mass > 0.0, tl.math.div_rn(mass, noise), -1.0)
            best_group = tl.where(score > best_group_score, group, best_group)
            best_group_score = tl.maximum(score, best_group_score)
    lane_best = tl.full([BLOCK // 4, 4], -1.0, tl.float32)
    lane_idx = tl.full([BLOCK // 4, 4], 2147483647, tl.int32)
    if best_group >= 0:
        group_start = best_group * GROUP
        for start in range(group_start, tl.minimum(group_start + GROUP, V), BLOCK):
            offs = quad_offsets(start, BLOCK // 4)
            mask = offs < V
            pv = processed_prob(load_logits(row_ptr, offs, mask), x_max, x_thr, norm, scale)
            qv = tl.load(q_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rv = _node_residual(pv, qv, offs, accepted, events, ev_node, ev_weight, ev_mass,
                                ev_q_mass, ev_token, ev_applied, idx, WOR)[0]
            rv = tl.where(mask, rv, 0.0)
            noise = trng.token_noise(seed, offset, accepted, trng.PURPOSE_RESAMPLE, start // 4,
                                     BLOCK // 4)
            score = tl.where(rv > 0.0, tl.math.div_rn(rv, noise), -1.0)
            take = score > lane_best
            lane_best = tl.where(take, score, lane_best)
            lane_idx = tl.where(take, offs, lane_idx)
    best, best_idx = tile_best(lane_best, lane_idx)
    sampled = tl.where((best >= 0.0) & (~has_nan), best_idx, -1)
    final = tl.where(greedy, tl.where(x_max > float("-inf"), argmax, -1), sampled)
    out = tl.where(idx == depth, final, out)
    live = idx < N
    tl.store(out_ptr + req64 * N + idx, out, mask=live)
    tl.store(path_ptr + req64 * N + idx, path, mask=live)
    tl.store(num_accepted_ptr + req, depth)



def verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor,
                parents: torch.Tensor, draft_probs: torch.Tensor | None, draft_sampling: str,
                num_nodes: torch.Tensor, params, seeds: torch.Tensor,
                offsets: torch.Tensor, method: str = "token", *,
                token_bitmask: torch.Tensor | None = None, return_logprobs: str | None = None):
    """Returns ``(output_token_ids [B, N] int32, accepted_nodes [B, N] int32,
    num_accepted [B] int32, logprobs)`` (float32 ``[B, N]`` with ``return_logprobs``, else
    None); arguments parsed by the public layer (``num_nodes`` int32 ``[B]``, seeds/offsets
    int64 ``[B]``, ``token_bitmask`` int32 ``[B, N, W]``; ``method="traversal"`` needs
    ``draft_probs`` and takes neither ``token_bitmask`` nor ``return_logprobs`` yet:
    NotImplementedError). Two launches (three when split rows are filtered: the statistics'
    finish kernel), no host synchronisation."""
    if method == "traversal":
        for name, used in (("token_bitmask", token_bitmask is not None),
                           ("return_logprobs", return_logprobs is not None)):
            if used:
                raise NotImplementedError(
                    f"{name}: not in the Triton traversal kernel yet (method='traversal'); "
                    f"use method='token' or backend='reference'")
    target_logits = last_dim_contiguous(target_logits)
    batch, nodes, vocab = target_logits.shape
    device = target_logits.device
    out = torch.empty((batch, nodes), dtype=torch.int32, device=device)
    path = torch.empty((batch, nodes), dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    logprobs = None if return_logprobs is None else \
        torch.empty((batch, nodes), dtype=torch.float32, device=device)
    if batch == 0:
        return out, path, num_accepted, logprobs
    ids = tree_token_ids if tree_token_ids.stride(-1) == 1 else tree_token_ids.contiguous()
    par = parents if parents.stride(-1) == 1 else parents.contiguous()
    bitmask = None if token_bitmask is None else \
        token_bitmask.reshape(batch * nodes, -1).contiguous()
    kind = LOGPROBS_KINDS[return_logprobs]
    stats = row_stats(target_logits, params, merge_in_consumer=True, bitmask=bitmask,
                      raw=kind == int(LOGPROBS_RAW))
    features = {} if bitmask is None else {"HAS_BITMASK": True}  # compiled in only when used
    if kind != int(LOGPROBS_NONE):
        features["LOGPROBS"] = kind
    if draft_probs is None:
        mode, q, q_strides = MODE_DETERMINISTIC, scratch(device, torch.float32), (0, 0)
    else:
        mode = _MODES[draft_sampling]
        q = last_dim_contiguous(draft_probs)
        q_strides = (q.stride(0), q.stride(1))
    if method == "traversal":
        _traversal_kernel[(batch,)](
            target_logits, target_logits.stride(0), target_logits.stride(1), stats.stats,
            stats.argmax, q, q_strides[0], q_strides[1], ids, ids.stride(0), par, par.stride(0),
            num_nodes.to(torch.int32).contiguous(), params.temperature, seeds, offsets,
            out, path, num_accepted, vocab, nodes,
            WOR=mode == MODE_WITHOUT_REPLACEMENT, N_P2=next_pow2(nodes), GROUP=_rng.RACE_GROUP,
            BLOCK=min(block_size(vocab, device, cap_gpu=WALK_BLOCK), _rng.RACE_GROUP),
            **stats.constexprs(), **launch_options(device, WALK_WARPS))
        return out, path, num_accepted, None
    _tree_walk_kernel[(batch,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), stats.stats,
        stats.argmax, q, q_strides[0], q_strides[1], ids, ids.stride(0), par, par.stride(0),
        num_nodes.to(torch.int32).contiguous(), params.temperature, seeds, offsets,
        out, path, num_accepted, vocab, nodes,
        bitmask if bitmask is not None else scratch(device, torch.int32),
        bitmask.shape[-1] if bitmask is not None else 0,
        stats.raw if kind == int(LOGPROBS_RAW) else scratch(device, torch.float32),
        logprobs if logprobs is not None else scratch(device, torch.float32),
        MODE=int(mode), N_P2=next_pow2(nodes), GROUP=_rng.RACE_GROUP,
        BLOCK=min(block_size(vocab, device, cap_gpu=WALK_BLOCK), _rng.RACE_GROUP),
        **stats.constexprs(), **features, **launch_options(device, WALK_WARPS))
    return out, path, num_accepted, logprobs


# Every kernel of this module at representative constexprs, for the compile-only resource
# report (``bench/resources.py`` compiles each spec for sm_80 / sm_90 and reports registers and
# spills). ``signature`` maps each runtime argument to its Triton type; ``constexprs`` gives
# the compile-time ones. The walk's registers grow with N_P2 (per-rejection scalars).
_WALK_SIGNATURE = {
    "logits_ptr": "*bf16", "stride_lb": "i64", "stride_ln": "i64", "stats_ptr": "*fp32",
    "argmax_ptr": "*i32", "q_ptr": "*fp32", "stride_qb": "i64", "stride_qn": "i64",
    "ids_ptr": "*i64", "stride_ib": "i64", "parents_ptr": "*i64", "stride_pb": "i64",
    "num_nodes_ptr": "*i32", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
    "offset_ptr": "*i64", "out_ptr": "*i32", "path_ptr": "*i32", "num_accepted_ptr": "*i32",
    "V": "i32", "N": "i32", "bitmask_ptr": "*i32", "bitmask_words": "i32", "raw_ptr": "*fp32",
    "logprobs_ptr": "*fp32",
}
# The traversal kernel takes neither the bitmask nor logprobs (yet): the walk's arguments
# without those.
_TRAVERSAL_SIGNATURE = {name: kind for name, kind in _WALK_SIGNATURE.items()
                        if name not in ("bitmask_ptr", "bitmask_words", "raw_ptr",
                                        "logprobs_ptr")}
# Vocabulary block and warps of the walk's row passes (one program per request, so a large
# block: 4 logits per thread per iteration). With the race's register bound (maxnreg 128) it
# compiles without spills on sm_80/sm_90 at 80-121 registers (python_tests/test_triton_compile.py);
# unbounded, ptxas settles at 80 and spills from 512 on.
WALK_BLOCK = 1024
WALK_WARPS = 8

COMPILE_SPECS = [
    {"name": f"tree_walk_{mode_name}_n{n_p2}" + (f"_stats{stats_chunks}" if stats_chunks > 1 else "")
             + ("_bitmask_raw_logprobs" if features else ""),
     "fn": _tree_walk_kernel,
     "signature": _WALK_SIGNATURE,
     "constexprs": {"MODE": int(mode), "N_P2": n_p2, "GROUP": _rng.RACE_GROUP, "BLOCK": WALK_BLOCK,
                    "STATS_CHUNKS": stats_chunks, "STATS_CHUNKS_P2": stats_chunks,
                    "HAS_BITMASK": features, "LOGPROBS": int(LOGPROBS_RAW) if features else 0},
     "num_warps": WALK_WARPS,
     "maxnreg": MAX_REGISTERS}
    for mode_name, mode in (("deterministic", MODE_DETERMINISTIC), ("iid", MODE_IID),
                            ("without_replacement", MODE_WITHOUT_REPLACEMENT))
    for n_p2, stats_chunks, features in ((8, 4, False), (64, 1, False), (64, 1, True))
]
COMPILE_SPECS += [
    {"name": f"traversal_{mode_name}_n{n_p2}" + (f"_stats{stats_chunks}" if stats_chunks > 1 else ""),
     "fn": _traversal_kernel,
     "signature": _TRAVERSAL_SIGNATURE,
     "constexprs": {"WOR": wor, "N_P2": n_p2, "GROUP": _rng.RACE_GROUP, "BLOCK": WALK_BLOCK,
                    "STATS_CHUNKS": stats_chunks, "STATS_CHUNKS_P2": stats_chunks},
     "num_warps": WALK_WARPS,
     "maxnreg": MAX_REGISTERS}
    for mode_name, wor in (("iid", False), ("without_replacement", True))
    for n_p2, stats_chunks in ((8, 4), (64, 1))
]
