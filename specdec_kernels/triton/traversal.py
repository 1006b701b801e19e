"""Traversal verification on Triton (contract section 12, ``verify_tree(method="traversal")``;
``reference.tree.traverse_tree`` is the definition).

Launched by ``tree.verify_tree`` after the same statistics launch as the token walk
(``stats.py``), with the walk's arguments: one program per request walks the tree depth first
on register vectors of N_P2 entries and races the final token (``tree_common.py``, shared with
the token walk). Nothing grows with ``V``; no host synchronisation.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _rng
from . import _rng as trng
from ._launch import MAX_REGISTERS
from ._tiles import (LOGPROBS_NONE, LOGPROBS_RAW, allowed_logits, load_logits, processed_prob,
                     token_logprob)
from .accept import rejection_weight, sequence_weight
from .stats import load_raw_stats, load_row_stats
from .tree_common import (MODE_IID, MODE_WITHOUT_REPLACEMENT, WALK_BLOCK, WALK_SIGNATURE,
                          WALK_WARPS, emit_final, node_residual, node_rows, pick,
                          race_final_token, rejection_mass, request_inputs, wor_draft)


@triton.jit
def _traversal_kernel(logits_ptr, stride_lb, stride_ln, stats_ptr, argmax_ptr,
                      q_ptr, stride_qb, stride_qn, ids_ptr, stride_ib, parents_ptr, stride_pb,
                      num_nodes_ptr, temperature_ptr, seed_ptr, offset_ptr,
                      out_ptr, path_ptr, num_accepted_ptr, V, N, bitmask_ptr, bitmask_words,
                      raw_ptr, logprobs_ptr, MODE: tl.constexpr, N_P2: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                      STATS_CHUNKS_P2: tl.constexpr, HAS_BITMASK: tl.constexpr = False,
                      LOGPROBS: tl.constexpr = 0):
    """Traversal verification of one request (grid B): ``reference.tree.traverse_tree``.

    The depth-first walk runs on register vectors of N_P2 entries: the tree's first-child and
    next-sibling links, each node's ``w``, target mass and draft mass, and the rejections in
    the order they happened (node updated, its state before, the rejected token), from which
    a node's current distribution is replayed element-wise (``node_residual``) -- nothing
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
    HAS_BITMASK: every target logit read is masked by its row's ``token_bitmask`` word, in the
    same reads (4 B per 32 logits). LOGPROBS (processed, raw): ``logprobs`` like ``out``, an
    accepted node's at its parent's row, the final token's at the accepted node's row: per
    emitted token its row's statistics and one logit gathered again after the walk (raw: 8 B
    of T = 1 statistics; an accepted token is allowed, so no bitmask word). Kept out of the
    walk's registers: a per-node vector there spills under Triton 3.8.
    """
    req, temperature, scale, seed, offset, num_nodes, logits_req, q_req, bm_req = \
        request_inputs(temperature_ptr, seed_ptr, offset_ptr, num_nodes_ptr, logits_ptr,
                       stride_lb, q_ptr, stride_qb, bitmask_ptr, bitmask_words, N)
    req64 = req.to(tl.int64)
    greedy = temperature == 0.0

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
        ok = (pick(real.to(tl.int32), idx, i) != 0) & \
            (pick(reach, idx, pick(parents, idx, i)) != 0)
        reach = tl.where(idx == i, ok.to(tl.int32), reach)
    first_child = tl.full([N_P2], -1, tl.int32)
    next_sibling = tl.full([N_P2], -1, tl.int32)
    for k in range(1, N):
        i = N - k
        if pick(reach, idx, i) != 0:
            parent = pick(parents, idx, i)
            next_sibling = tl.where(idx == i, pick(first_child, idx, parent), next_sibling)
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
            child = pick(pending, idx, current)
            # The node being entered (child) or left (current), and the parent whose state
            # decides it.
            entering = child >= 0
            node = tl.where(entering, child, current)
            parent = tl.where(entering, current, pick(parents, idx, current))
            token = pick(tokens, idx, node)
            x_max, x_thr, norm, argmax = load_row_stats(
                stats_ptr, argmax_ptr, req * N + parent, tl.full([], 1, tl.int1), scale,
                STATS_CHUNKS, STATS_CHUNKS_P2)
            row_ptr, q_row_ptr, bm_row_ptr = node_rows(logits_req, stride_ln, q_req, stride_qn,
                                                       bm_req, bitmask_words, parent)
            x_token = allowed_logits(load_logits(row_ptr, token, node > 0), token, node > 0,
                                     bm_row_ptr, HAS_BITMASK)
            p_x = processed_prob(x_token, x_max, x_thr, norm, scale)
            q_x = tl.load(q_row_ptr + token, mask=node > 0, other=0.0).to(tl.float32)
            r_x, gone = node_residual(p_x, q_x, token, parent, events, ev_node, ev_weight,
                                      ev_mass, ev_q_mass, ev_token, ev_applied, idx,
                                      MODE == MODE_WITHOUT_REPLACEMENT)
            target = tl.math.div_rn(r_x, pick(p_mass, idx, parent))
            if MODE == MODE_WITHOUT_REPLACEMENT:
                draft = wor_draft(q_x, gone, pick(q_mass, idx, parent))
            else:
                draft = q_x
            w_parent = pick(weight, idx, parent)
            if entering:
                pending = tl.where(idx == current, pick(next_sibling, idx, child), pending)
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
                w_node = pick(weight, idx, current)
                if greedy:
                    passed = w_node >= 1.0
                elif pick(has_children.to(tl.int32), idx, current) != 0:
                    passed = u < w_node
                else:
                    passed = u * draft < w_parent * target
                if passed:
                    done = tl.full([], 1, tl.int1)
                else:
                    if ~greedy:
                        mass = pick(p_mass, idx, parent)
                        new_mass, has_mass = rejection_mass(
                            row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale,
                            w_parent, mass, pick(q_mass, idx, parent), parent, events,
                            ev_mass, ev_q_mass, ev_token, ev_applied, ev_node, ev_weight, idx,
                            MODE, True, HAS_BITMASK, BLOCK)
                        slot = idx == events
                        ev_node = tl.where(slot, parent, ev_node)
                        ev_weight = tl.where(slot, w_parent, ev_weight)
                        ev_mass = tl.where(slot, mass, ev_mass)
                        ev_q_mass = tl.where(slot, pick(q_mass, idx, parent), ev_q_mass)
                        ev_token = tl.where(slot, token, ev_token)
                        ev_applied = tl.where(slot, has_mass, ev_applied)
                        events += 1
                        weight = tl.where(idx == parent, rejection_weight(new_mass, w_parent),
                                          weight)
                        p_mass = tl.where((idx == parent) & (has_mass != 0), new_mass, p_mass)
                        if MODE == MODE_WITHOUT_REPLACEMENT:
                            q_mass = tl.where(idx == parent,
                                              q_mass - tl.where(gone, 0.0, q_x), q_mass)
                    current = parent

    # The accepted node's path and tokens, root first.
    accepted = current
    depth = tl.full([], 0, tl.int32)
    node = accepted
    for level in range(0, N):
        depth += (node > 0).to(tl.int32)
        node = tl.where(node > 0, pick(parents, idx, node), 0)
    path = tl.full([N_P2], -1, tl.int32)
    out = tl.full([N_P2], -1, tl.int32)
    logprobs = tl.full([N_P2], float("nan"), tl.float32)
    node = accepted
    for k in range(0, N):
        level = depth - k
        path = tl.where((level >= 0) & (idx == level), node, path)
        out = tl.where((level >= 1) & (idx == level - 1), pick(tokens, idx, node), out)
        if LOGPROBS != LOGPROBS_NONE:  # the node's token at its parent's row, gathered again
            held = level >= 1
            row = pick(parents, idx, node)
            token = pick(tokens, idx, node)
            x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * N + row,
                                                        held, scale, STATS_CHUNKS,
                                                        STATS_CHUNKS_P2)
            raw_max, raw_log_sum = load_raw_stats(raw_ptr, req * N + row, held, LOGPROBS)
            x_token = load_logits(logits_req + row.to(tl.int64) * stride_ln, token, held)
            logprobs = tl.where(held & (idx == level - 1), token_logprob(
                x_token, x_max, x_thr, norm, scale, greedy, raw_max, raw_log_sum, token,
                LOGPROBS), logprobs)
        node = tl.where(node > 0, pick(parents, idx, node), 0)

    # The final token: a race over the accepted node's current distribution.
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * N + accepted,
                                                tl.full([], 1, tl.int1), scale, STATS_CHUNKS,
                                                STATS_CHUNKS_P2)
    row_ptr, q_row_ptr, bm_row_ptr = node_rows(logits_req, stride_ln, q_req, stride_qn,
                                               bm_req, bitmask_words, accepted)
    sampled = race_final_token(row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale,
                               temperature, seed, offset, accepted, events, ev_mass, ev_q_mass,
                               ev_token, ev_applied, ev_node, ev_weight, idx, MODE, True,
                               HAS_BITMASK, GROUP, BLOCK)
    emit_final(out_ptr, path_ptr, num_accepted_ptr, logprobs_ptr, raw_ptr, req, N, idx, out, path,
               depth, logprobs, sampled, accepted, row_ptr, x_max, x_thr, norm, argmax, scale,
               greedy, LOGPROBS)


def launch(batch: int, args: tuple, constexprs: dict) -> None:
    """Launch ``_traversal_kernel`` over ``batch`` requests with the token walk's arguments
    (``tree.verify_tree``: ``MODE`` iid or without replacement)."""
    _traversal_kernel[(batch,)](*args, **constexprs)


# The kernel at representative constexprs, for the compile-only resource report
# (``bench/resources.py``): registers grow with N_P2 (links, per-node state, events).
COMPILE_SPECS = [
    {"name": f"traversal_{mode_name}_n{n_p2}" + (f"_stats{stats_chunks}" if stats_chunks > 1 else "")
             + ("_bitmask_raw_logprobs" if features else ""),
     "fn": _traversal_kernel,
     "signature": WALK_SIGNATURE,
     "constexprs": {"MODE": int(mode), "N_P2": n_p2, "GROUP": _rng.RACE_GROUP,
                    "BLOCK": WALK_BLOCK, "STATS_CHUNKS": stats_chunks,
                    "STATS_CHUNKS_P2": stats_chunks, "HAS_BITMASK": features,
                    "LOGPROBS": int(LOGPROBS_RAW) if features else 0},
     "num_warps": WALK_WARPS,
     "maxnreg": MAX_REGISTERS}
    for mode_name, mode in (("iid", MODE_IID), ("without_replacement", MODE_WITHOUT_REPLACEMENT))
    for n_p2, stats_chunks, features in ((8, 4, False), (64, 1, False), (64, 1, True))
]
