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

The residual is never stored: after ``k`` rejections at the current node it is evaluated
element-wise from ``p(v)``, ``q(v)`` and per-rejection scalars (``tree_common.py``, shared with
``traversal.py``). Deterministic candidates need no pass at all: removing a token subtracts its
gathered ``p(x)`` from the mass, and a later duplicate is recognised from the list of removed
tokens. Same float operations as the reference (``div_rn``); sums differ only in order.

``method="traversal"`` runs ``traversal.py``'s kernel in place of the walk, after the same
statistics launch.

Memory: stats ``[B*N, 3]`` float32 + ``[B*N]`` int32; outputs. Nothing grows with ``B*N*V``.
Logits and draft probabilities are read in their own dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _rng
from . import _rng as trng
from . import traversal
from ._launch import (MAX_REGISTERS, block_size, last_dim_contiguous, launch_options, next_pow2,
                      scratch)
from ._tiles import (LOGPROBS_KINDS, LOGPROBS_NONE, LOGPROBS_RAW, allowed_logits, load_logits,
                     processed_prob, token_logprob)
from .stats import load_raw_stats, load_row_stats, row_stats
from .tree_common import (DRAFT_MODES, MODE_DETERMINISTIC, MODE_IID, MODE_WITHOUT_REPLACEMENT,
                          WALK_BLOCK, WALK_SIGNATURE, WALK_WARPS, emit_final, node_rows,
                          race_final_token, rejection_mass, request_inputs, residual, wor_draft)


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
    req, temperature, scale, seed, offset, num_nodes, logits_req, q_req, bm_req = \
        request_inputs(temperature_ptr, seed_ptr, offset_ptr, num_nodes_ptr, logits_ptr,
                       stride_lb, q_ptr, stride_qb, bitmask_ptr, bitmask_words, N)
    req64 = req.to(tl.int64)
    greedy = temperature == 0.0

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
        row_ptr, q_row_ptr, bm_row_ptr = node_rows(logits_req, stride_ln, q_req, stride_qn,
                                                   bm_req, bitmask_words, current)
        x_token = allowed_logits(load_logits(row_ptr, token, tested), token, tested, bm_row_ptr,
                                 HAS_BITMASK)
        p_x = processed_prob(x_token, x_max, x_thr, norm, scale)
        if MODE == MODE_DETERMINISTIC:
            gone = tl.max(((tokens == token) & (idx < steps)).to(tl.int32), axis=0) != 0
            p_token = tl.where(gone, 0.0, p_x)
            draft = tl.full([], 1.0, tl.float32)
        else:
            q_x = tl.load(q_row_ptr + token, mask=tested, other=0.0).to(tl.float32)
            p_token, gone = residual(p_x, q_x, token, steps, masses, q_masses, tokens, applied,
                                     idx, MODE == MODE_WITHOUT_REPLACEMENT)
            if MODE == MODE_WITHOUT_REPLACEMENT:
                draft = wor_draft(q_x, gone, q_mass)
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
                new_mass, has_mass = rejection_mass(
                    row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale, 1.0, p_mass,
                    q_mass, current, steps, masses, q_masses, tokens, applied, tokens, masses,
                    idx, MODE, False, HAS_BITMASK, BLOCK)
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
    row_ptr, q_row_ptr, bm_row_ptr = node_rows(logits_req, stride_ln, q_req, stride_qn,
                                               bm_req, bitmask_words, current)
    sampled = race_final_token(row_ptr, q_row_ptr, bm_row_ptr, V, x_max, x_thr, norm, scale,
                               temperature, seed, offset, current, steps, masses, q_masses,
                               tokens, applied, tokens, masses, idx, MODE, False, HAS_BITMASK,
                               GROUP, BLOCK)
    if MODE == MODE_DETERMINISTIC:
        # Removals left no mass (rounding only): the last removed token was all that remained.
        sampled = tl.where((sampled < 0) & (last_removed >= 0), last_removed, sampled)
    emit_final(out_ptr, path_ptr, num_accepted_ptr, logprobs_ptr, raw_ptr, req, N, idx, out, path,
               depth, logprobs, sampled, current, row_ptr, x_max, x_thr, norm, argmax, scale,
               greedy, LOGPROBS)


def verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor,
                parents: torch.Tensor, draft_probs: torch.Tensor | None, draft_sampling: str,
                num_nodes: torch.Tensor, params, seeds: torch.Tensor,
                offsets: torch.Tensor, method: str = "token", *,
                token_bitmask: torch.Tensor | None = None, return_logprobs: str | None = None):
    """Returns ``(output_token_ids [B, N] int32, accepted_nodes [B, N] int32,
    num_accepted [B] int32, logprobs)`` (float32 ``[B, N]`` with ``return_logprobs``, else
    None); arguments parsed by the public layer (``num_nodes`` int32 ``[B]``, seeds/offsets
    int64 ``[B]``, ``token_bitmask`` int32 ``[B, N, W]``; ``method="traversal"`` needs
    ``draft_probs``). Two launches (three when split rows are filtered: the statistics'
    finish kernel), no host synchronisation."""
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
        mode = DRAFT_MODES[draft_sampling]
        q = last_dim_contiguous(draft_probs)
        q_strides = (q.stride(0), q.stride(1))
    args = (target_logits, target_logits.stride(0), target_logits.stride(1), stats.stats,
            stats.argmax, q, q_strides[0], q_strides[1], ids, ids.stride(0), par, par.stride(0),
            num_nodes.to(torch.int32).contiguous(), params.temperature, seeds, offsets,
            out, path, num_accepted, vocab, nodes,
            bitmask if bitmask is not None else scratch(device, torch.int32),
            bitmask.shape[-1] if bitmask is not None else 0,
            stats.raw if kind == int(LOGPROBS_RAW) else scratch(device, torch.float32),
            logprobs if logprobs is not None else scratch(device, torch.float32))
    constexprs = dict(MODE=int(mode), N_P2=next_pow2(nodes), GROUP=_rng.RACE_GROUP,
                      BLOCK=min(block_size(vocab, device, cap_gpu=WALK_BLOCK), _rng.RACE_GROUP),
                      **stats.constexprs(), **features, **launch_options(device, WALK_WARPS))
    if method == "traversal":
        traversal.launch(batch, args, constexprs)
    else:
        _tree_walk_kernel[(batch,)](*args, **constexprs)
    return out, path, num_accepted, logprobs


# Every kernel of this module at representative constexprs, for the compile-only resource
# report (``bench/resources.py`` compiles each spec for sm_80 / sm_90 and reports registers and
# spills). ``signature`` maps each runtime argument to its Triton type; ``constexprs`` gives
# the compile-time ones. The walk's registers grow with N_P2 (per-rejection scalars).
COMPILE_SPECS = [
    {"name": f"tree_walk_{mode_name}_n{n_p2}" + (f"_stats{stats_chunks}" if stats_chunks > 1 else "")
             + ("_bitmask_raw_logprobs" if features else ""),
     "fn": _tree_walk_kernel,
     "signature": WALK_SIGNATURE,
     "constexprs": {"MODE": int(mode), "N_P2": n_p2, "GROUP": _rng.RACE_GROUP, "BLOCK": WALK_BLOCK,
                    "STATS_CHUNKS": stats_chunks, "STATS_CHUNKS_P2": stats_chunks,
                    "HAS_BITMASK": features, "LOGPROBS": int(LOGPROBS_RAW) if features else 0},
     "num_warps": WALK_WARPS,
     "maxnreg": MAX_REGISTERS}
    for mode_name, mode in (("deterministic", MODE_DETERMINISTIC), ("iid", MODE_IID),
                            ("without_replacement", MODE_WITHOUT_REPLACEMENT))
    for n_p2, stats_chunks, features in ((8, 4, False), (64, 1, False), (64, 1, True))
]
