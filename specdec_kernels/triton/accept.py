"""The chain's acceptance replay inside the race kernel: the token rule's loop over the drafts
(contract section 3) and block verification's (section 12), from the row statistics and one
gathered logit / draft probability per draft; the race kernel (``race.py``) then samples the
correction or bonus token. Also the Q modes every kernel reading draft inputs shares."""
import triton
import triton.language as tl

from . import _rng as trng
from ._tiles import (LOGPROBS_NONE, allowed_logits, exp2_scale, load_logits, processed_prob,
                     token_logprob)
from .stats import load_raw_stats, load_row_stats, packed_request

# Q modes of the race kernel: what the residual max(p - q, 0) subtracts. Q_NONE: no draft
# (``sample``, or a chain with K = 0); the residual variant is then not compiled in.
Q_NONE = tl.constexpr(0)
Q_ONE_HOT = tl.constexpr(1)  # draft_probs=None: q one-hot at the draft token
Q_PROBS = tl.constexpr(2)    # draft_probs [B, K, V]
Q_LOGITS = tl.constexpr(3)   # draft_logits [B, K, V], with their own row statistics
# draft_logits at their own temperature (``draft_temperature``, no filter): their statistics
# at that temperature, q's scale from it, and q one-hot at the row's arg-max where it is 0.
Q_LOGITS_T = tl.constexpr(4)


# ------------------------------------------------------------------------- the acceptance replay

@triton.jit
def load_num_draft_tokens(num_draft_tokens_ptr, req, K):
    """Request ``req``'s live drafts, clamped to ``[0, K]`` (validate=False)."""
    return tl.minimum(tl.maximum(tl.load(num_draft_tokens_ptr + req), 0), K)


@triton.jit
def draft_slot(slots_ptr, req, num_slots):
    """Request ``req``'s slot of the per-slot draft rows (``draft_slots``), clamped to
    ``[0, num_slots - 1]`` (validate=False)."""
    return tl.minimum(tl.maximum(tl.load(slots_ptr + req).to(tl.int64), 0), num_slots - 1)


@triton.jit
def chain_rows(req, num_draft_tokens_ptr, cu_ptr, num_packed, logits_ptr, stride_row, q_ptr,
               stride_q_req, stride_q_row, draft_ids_ptr, bitmask_ptr, bitmask_words, K,
               slots_ptr, num_slots, PACKED: tl.constexpr, SLOTTED: tl.constexpr):
    """``(num_draft_tokens, logits_ptr, q_ptr, draft_ids_ptr, bitmask_ptr)`` of chain request
    ``req``: padded, the clamped count and the pointers unchanged; PACKED, the request's
    count from ``cu_num_draft_tokens`` and the pointers moved to its first rows (the
    launcher passes zero request strides), the bitmask so that statistics row
    ``req * (K + 1) + j`` addresses packed row ``first + req + j``. SLOTTED
    (``draft_slots``): ``q_ptr`` moved so that ``q_ptr + req * stride_q_req`` is the request's
    slot (``q`` ``[S, K', V']``, the launcher passes its strides), padded or packed."""
    if PACKED:
        first, num_draft_tokens = packed_request(cu_ptr, req, num_packed, K)
        logits_ptr += (first + req) * stride_row
        if not SLOTTED:
            q_ptr += first * stride_q_row
        draft_ids_ptr += first
        bitmask_ptr += (first + req - req.to(tl.int64) * (K + 1)) * bitmask_words
    else:
        num_draft_tokens = load_num_draft_tokens(num_draft_tokens_ptr, req, K)
    if SLOTTED:
        q_ptr += (draft_slot(slots_ptr, req, num_slots) - req.to(tl.int64)) * stride_q_req
    return num_draft_tokens, logits_ptr, q_ptr, draft_ids_ptr, bitmask_ptr


@triton.jit
def draft_scale(scale, q_temperature, Q_MODE: tl.constexpr):
    """The ``exp2_scale`` of the draft logits: the target's, or (Q_LOGITS_T) their own."""
    if Q_MODE == Q_LOGITS_T:
        return exp2_scale(q_temperature)
    return scale


@triton.jit
def draft_terms(req, j64, num_draft_tokens, ids_row, logits_row, stride_row, stats_ptr,
                 argmax_ptr, q_row, stride_q_row, q_stats_ptr, q_argmax_ptr, scale,
                 q_temperature, V, K,
                 bitmask_ptr, bitmask_words, Q_MODE: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                 STATS_CHUNKS_P2: tl.constexpr, Q_STATS_CHUNKS: tl.constexpr,
                 Q_STATS_CHUNKS_P2: tl.constexpr, HAS_BITMASK: tl.constexpr):
    """Draft ``j`` (0-based) of request ``req``: ``(token, valid, p_j(d_j), q_j(d_j), x,
    x_max, x_thr, norm, argmax)`` (flat: Triton 3.6's dependency finder rejects nested
    assignment targets), ``valid`` when it is live and its id in ``[0, V)`` (else
    token 0, nothing read through), ``x`` its allowed target logit (HAS_BITMASK: -inf, so
    ``p = 0``, where its bit is cleared; statistics row ``req * (K + 1) + j``). Reads the id,
    16 B of stats, one target logit (and its bitmask word) and one draft probability, or one
    draft logit and 12 B of its stats (12 B per chunk where ``row_stats`` left partials).
    Q_LOGITS_T: q at the draft's own temperature ``q_temperature`` (one-hot at the draft
    row's arg-max where it is 0)."""
    live = j64 < num_draft_tokens
    draft = tl.load(ids_row + j64, mask=live, other=0).to(tl.int64)
    valid = live & (draft >= 0) & (draft < V)
    token = tl.where(valid, draft, 0)
    x_max, x_thr, norm, argmax = load_row_stats(stats_ptr, argmax_ptr, req * (K + 1) + j64,
                                                valid, scale, STATS_CHUNKS, STATS_CHUNKS_P2)
    x = allowed_logits(load_logits(logits_row + j64 * stride_row, token, valid), token, valid,
                       bitmask_ptr + (req * (K + 1) + j64) * bitmask_words, HAS_BITMASK)
    p = processed_prob(x, x_max, x_thr, norm, scale)
    if Q_MODE == Q_PROBS:
        q = tl.load(q_row + j64 * stride_q_row + token, mask=valid, other=0.0).to(tl.float32)
    elif Q_MODE >= Q_LOGITS:
        q_scale = draft_scale(scale, q_temperature, Q_MODE)
        q_max, q_thr, q_norm, q_arg = load_row_stats(q_stats_ptr, q_argmax_ptr, req * K + j64,
                                                     valid, q_scale, Q_STATS_CHUNKS,
                                                     Q_STATS_CHUNKS_P2)
        q = processed_prob(load_logits(q_row + j64 * stride_q_row, token, valid),
                           q_max, q_thr, q_norm, q_scale)
        if Q_MODE == Q_LOGITS_T:  # T_q = 0: the drafter took the row's arg-max
            one_hot = tl.where((token == q_arg) & (q_max > float("-inf")), 1.0, 0.0)
            q = tl.where(q_temperature == 0.0, one_hot, q)
    else:  # Q_ONE_HOT
        q = tl.full([], 1.0, tl.float32)
    return token, valid, p, q, x, x_max, x_thr, norm, argmax


@triton.jit
def accept_drafts(req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr,
                   q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr,
                   stride_ids, num_draft_tokens, greedy, scale, q_temperature, seed, offset, V,
                   K, bitmask_ptr, bitmask_words, raw_ptr, Q_MODE: tl.constexpr,
                   STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                   Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                   HAS_BITMASK: tl.constexpr, LOGPROBS: tl.constexpr, K_P2: tl.constexpr):
    """The chain's acceptance loop for request ``req`` (contract section 3): returns
    ``(num_accepted, rejected, draft_logprobs)`` (the ``[K_P2]`` logprobs of the drafts from
    the values already gathered, with LOGPROBS; else zeros), ``rejected`` when a live,
    in-range draft was rejected (its residual is sampled next). Reads ``draft_terms`` per
    live draft. Out-of-range ids (validate=False) are rejected without being read through,
    and leave no residual: they were never drawn from q. The loads of all
    ``num_draft_tokens`` drafts are issued whatever the verdicts (at most ~30 B per draft past
    the first rejection)."""
    ids_row = draft_ids_ptr + req.to(tl.int64) * stride_ids
    logits_row = logits_ptr + req.to(tl.int64) * stride_req
    q_row = q_ptr + req.to(tl.int64) * stride_q_req
    accepting = num_draft_tokens > 0
    num_accepted = tl.full([], 0, tl.int32)
    rejected = tl.full([], 0, tl.int1)
    positions = tl.arange(0, K_P2)
    draft_logprobs = tl.zeros([K_P2], tl.float32)
    for j in range(0, K):
        j64 = tl.zeros([], tl.int64) + j  # the interpreter's loop index is a Python int
        # Loads do not wait for the previous draft's verdict (a few bytes more past the first
        # rejection, but one memory latency for the loop instead of one per draft).
        token, valid, p, q, x, x_max, x_thr, norm, argmax = draft_terms(
            req, j64, num_draft_tokens, ids_row, logits_row, stride_row, stats_ptr, argmax_ptr,
            q_row, stride_q_row, q_stats_ptr, q_argmax_ptr, scale, q_temperature, V, K,
            bitmask_ptr, bitmask_words, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2, Q_STATS_CHUNKS,
            Q_STATS_CHUNKS_P2, HAS_BITMASK)
        u = trng.uniform(seed, offset, j64 + 1, trng.PURPOSE_ACCEPT, tl.zeros([], tl.int32))
        # Greedy p is one-hot at the arg-max (zero everywhere on a row with no finite logit).
        greedy_ok = (token == argmax) & (x_max > float("-inf"))
        accepted = valid & tl.where(greedy, greedy_ok, u * q < p)
        rejected = rejected | (accepting & valid & ~accepted)
        accepting = accepting & accepted
        num_accepted += accepting.to(tl.int32)
        if LOGPROBS != LOGPROBS_NONE:  # an accepted draft is allowed: x is its logit as given
            raw_max, raw_log_sum = load_raw_stats(raw_ptr, req * (K + 1) + j, valid, LOGPROBS)
            draft_logprobs = tl.where(positions == j, token_logprob(
                x, x_max, x_thr, norm, scale, greedy, raw_max, raw_log_sum, token, LOGPROBS),
                draft_logprobs)
    return num_accepted, rejected, draft_logprobs


# ------------------------------------------------------------------------- block verification

@triton.jit
def sequence_weight(previous, target, draft):
    """``min(1, previous * target / draft)``, block and traversal verification's capped
    cumulative ratio, in ``reference.chain.sequence_weight``'s operations (a draft
    probability of 0 gives 1 when ``previous * target > 0``, else 0)."""
    numerator = previous * target
    # (0 is replaced only to keep the unused division quiet; NaN stays NaN, as in torch)
    return tl.where(numerator >= draft, tl.where(numerator > 0.0, 1.0, 0.0),
                    tl.math.div_rn(numerator, tl.where(draft == 0.0, 1.0, draft)))


@triton.jit
def rejection_weight(mass, weight):
    """``R / (R + (1 - w))``, 1 when the denominator is 0 (``reference.chain``)."""
    denominator = mass + (1.0 - weight)
    return tl.where(denominator > 0.0,
                    tl.math.div_rn(mass, tl.where(denominator > 0.0, denominator, 1.0)), 1.0)


@triton.jit
def prefix_weight(req, count, num_draft_tokens, ids_row, logits_row, stride_row, stats_ptr,
                  argmax_ptr, q_row, stride_q_row, q_stats_ptr, q_argmax_ptr, scale,
                  q_temperature, V, K,
                  bitmask_ptr, bitmask_words, Q_MODE: tl.constexpr,
                  STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                  Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                  HAS_BITMASK: tl.constexpr):
    """``(w_count, live)``: block verification's weight after the first ``count`` drafts, and
    whether all of them are live and in range (``count`` gathers of ``draft_terms``)."""
    weight = tl.full([], 1.0, tl.float32)
    live = tl.full([], 1, tl.int1)
    for i in range(0, count):
        i64 = tl.zeros([], tl.int64) + i
        _, valid, p, q, _, _, _, _, _ = draft_terms(
            req, i64, num_draft_tokens, ids_row, logits_row, stride_row, stats_ptr, argmax_ptr,
            q_row, stride_q_row, q_stats_ptr, q_argmax_ptr, scale, q_temperature, V, K,
            bitmask_ptr, bitmask_words, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2, Q_STATS_CHUNKS,
            Q_STATS_CHUNKS_P2, HAS_BITMASK)
        live = live & valid
        weight = sequence_weight(weight, p, q)
    return weight, live


@triton.jit
def block_accept(req, logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr,
                  q_ptr, stride_q_req, stride_q_row, q_stats_ptr, q_argmax_ptr, draft_ids_ptr,
                  stride_ids, mass_ptr, num_draft_tokens, scale, q_temperature, seed, offset,
                  V, K, bitmask_ptr, bitmask_words, Q_MODE: tl.constexpr,
                  STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr,
                  Q_STATS_CHUNKS: tl.constexpr, Q_STATS_CHUNKS_P2: tl.constexpr,
                  MASS_CHUNKS: tl.constexpr, MASS_CHUNKS_P2: tl.constexpr,
                  HAS_BITMASK: tl.constexpr):
    """Block verification's acceptance (contract section 12; ``reference.chain.block_outcome``)
    for a sampled request: ``(tau, rejected, w_tau)``. The live drafts are the leading valid
    ones (``n`` of them); test ``j < n`` is ``u_j < h_j = R_j / (R_j + 1 - w_j)`` with ``R_j``
    summed from ``block.residual_masses``' partials in chunk order, test ``n`` is
    ``u_n q_n(d_n) < w_{n-1} p_n(d_n)``; ``tau`` is the last passed test. Reads
    ``draft_terms`` per draft, the next draft's id, and ``MASS_CHUNKS * 4`` B per draft."""
    ids_row = draft_ids_ptr + req.to(tl.int64) * stride_ids
    logits_row = logits_ptr + req.to(tl.int64) * stride_req
    q_row = q_ptr + req.to(tl.int64) * stride_q_req
    live = tl.full([], 1, tl.int1)
    weight = tl.full([], 1.0, tl.float32)
    tau = tl.full([], 0, tl.int32)
    tau_weight = tl.full([], 1.0, tl.float32)
    num_live = tl.full([], 0, tl.int32)
    chunks = tl.arange(0, MASS_CHUNKS_P2)
    for j in range(0, K):
        j64 = tl.zeros([], tl.int64) + j
        _, valid, p, q, _, _, _, _, _ = draft_terms(
            req, j64, num_draft_tokens, ids_row, logits_row, stride_row, stats_ptr, argmax_ptr,
            q_row, stride_q_row, q_stats_ptr, q_argmax_ptr, scale, q_temperature, V, K,
            bitmask_ptr, bitmask_words, Q_MODE, STATS_CHUNKS, STATS_CHUNKS_P2, Q_STATS_CHUNKS,
            Q_STATS_CHUNKS_P2, HAS_BITMASK)
        live = live & valid
        previous = weight
        weight = sequence_weight(previous, p, q)
        next_id = tl.load(ids_row + j64 + 1, mask=j64 + 1 < num_draft_tokens,
                          other=-1).to(tl.int64)
        last = live & ~((next_id >= 0) & (next_id < V))
        has_mass = (chunks < MASS_CHUNKS) & (j64 < K - 1)
        mass = tl.sum(tl.load(mass_ptr + (req.to(tl.int64) * (K - 1) + j64) * MASS_CHUNKS
                              + chunks, mask=has_mass, other=0.0), axis=0)
        u = trng.uniform(seed, offset, j64 + 1, trng.PURPOSE_ACCEPT, tl.zeros([], tl.int32))
        passed = live & tl.where(last, u * q < previous * p, u < rejection_weight(mass, weight))
        tau = tl.where(passed, j + 1, tau)
        tau_weight = tl.where(passed, weight, tau_weight)
        num_live += live.to(tl.int32)
    return tau, tau < num_live, tau_weight


@triton.jit
def store_chain_row(out_ptr, stride_out, req, draft_ids_ptr, stride_ids, num_accepted, token,
                     K, K_P2: tl.constexpr):
    """Row ``req`` of ``output_token_ids`` in one store: the accepted drafts, ``token`` at
    ``num_accepted``, then -1."""
    positions = tl.arange(0, K_P2)
    drafts = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + positions,
                     mask=positions < num_accepted, other=-1).to(tl.int32)
    row = tl.where(positions < num_accepted, drafts, tl.where(positions == num_accepted, token, -1))
    tl.store(out_ptr + req.to(tl.int64) * stride_out + positions, row, mask=positions < K + 1)


@triton.jit
def store_logprob_row(logprobs_ptr, stride_lp, req, draft_logprobs, num_accepted, final, K,
                       K_P2: tl.constexpr):
    """Row ``req`` of ``logprobs`` in one store: the accepted drafts', ``final`` at
    ``num_accepted`` (NaN until the token is known), then NaN."""
    positions = tl.arange(0, K_P2)
    row = tl.where(positions < num_accepted, draft_logprobs,
                   tl.where(positions == num_accepted, final, float("nan")))
    tl.store(logprobs_ptr + req.to(tl.int64) * stride_lp + positions, row,
             mask=positions < K + 1)


@triton.jit
def sampled_row(req, num_accepted_ptr, num_draft_tokens, draft_ids_ptr, stride_ids, V,
                 IS_CHAIN: tl.constexpr):
    """(row within the request, whether a draft was rejected there) as the race kernel left
    them: a chain samples row ``num_accepted``, from the residual after a rejection of a live,
    in-range draft; ``sample`` samples row 0."""
    if IS_CHAIN:
        num_accepted = tl.load(num_accepted_ptr + req)
        # A rejection of a live, in-range draft leaves a residual; an out-of-range id
        # (validate=False) was never drawn from q, so its request samples p.
        live = num_accepted < num_draft_tokens
        rejected_id = tl.load(draft_ids_ptr + req.to(tl.int64) * stride_ids + num_accepted,
                              mask=live, other=-1).to(tl.int64)
        rejected = live & (rejected_id >= 0) & (rejected_id < V)
    else:
        num_accepted = tl.full([], 0, tl.int32)
        rejected = tl.full([], 0, tl.int1)
    return num_accepted, rejected
