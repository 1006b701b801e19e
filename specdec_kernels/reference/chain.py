"""Reference chain verification (contract sections 3 and 12), vectorised over the batch.

``method="token"`` is the token-level rule (section 3); ``method="block"`` is block
verification (Sun et al., ICLR 2025; section 12). The float operations of block verification
are the ones the traversal walk of ``reference/tree.py`` does on a chain-shaped tree (shared
helpers below), so the two give the same tokens there.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _rng
from .sampling import processed_probs, race, token_logprobs

METHODS = ("token", "block")


def sequence_weight(previous: torch.Tensor, target: torch.Tensor, draft: torch.Tensor):
    """``min(1, previous * target / draft)``: the capped cumulative ratio ``w_j`` of block and
    traversal verification. A draft probability of 0 (only with unvalidated ``draft_probs``)
    gives 1 when ``previous * target > 0``, else 0 -- what the test ``u * draft < previous *
    target`` accepts."""
    numerator = previous * target
    return torch.where(numerator >= draft, (numerator > 0).to(numerator.dtype),
                       numerator / draft)


def weighted_residual(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(weight * p - q, 0)`` along the last dimension (NaN stays NaN, never sampled)."""
    return (weight * p - q).clamp(min=0)


def rejection_weight(mass: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h = R / (R + (1 - w))`` (1 when the denominator is 0): block verification's threshold,
    and traversal's new ``w`` of a node after one of its children is rejected. ``R + (1 - w)``,
    not ``(R + 1) - w``: in float ``(R + 1) - 1 != R``."""
    denominator = mass + (1.0 - weight)
    return torch.where(denominator > 0, mass / denominator, 1.0)


def last_success(passed: torch.Tensor) -> torch.Tensor:
    """``tau = max({0} u {j : test j passed})`` (1-based) over ``[B, K]``: a later success
    overrides an earlier failure."""
    position = torch.arange(1, passed.shape[-1] + 1, device=passed.device)
    return torch.where(passed, position, 0).amax(-1) if passed.shape[-1] else \
        torch.zeros(passed.shape[:-1], dtype=torch.int64, device=passed.device)


def correction_weights(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The unnormalised law of the token after ``tau < n`` accepted drafts:
    ``max(w_tau p - q, 0)`` for the rows ``p``, ``q`` at position ``tau + 1`` (``p`` when it has
    no mass)."""
    residual = weighted_residual(weight[:, None], p, q)
    return torch.where((residual > 0).any(-1, keepdim=True), residual, p)


class BlockOutcome(NamedTuple):
    """Block verification's deterministic part, given its uniforms (what the tests inspect)."""
    num_accepted: torch.Tensor        # [B] int64: tau
    final_weights: torch.Tensor       # [B, V]: unnormalised law of the correction/bonus token
    accept_probability: torch.Tensor  # [B, K]: measure of the uniforms passing test j (h_j, w_n)
    passed: torch.Tensor              # [B, K] bool: test j passed (live drafts only)


def chain_outcome(p: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
                  valid: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor):
    """The deterministic part of a verify round, given its acceptance uniforms.

    Args: ``p`` ``[B, K+1, V]`` processed target probabilities; ``q`` ``[B, K, V]`` draft
    probabilities or None (one-hot at the draft); ``drafts`` ``[B, K]`` in-range ids;
    ``valid`` ``[B, K]`` live drafts; ``greedy`` ``[B]``; ``u`` ``[B, K]`` uniforms.

    Returns ``(num_accepted [B] int64, weights [B, V])``: the correction or bonus token is one
    sample of the unnormalised ``weights`` -- the residual ``max(p - q, 0)`` after a
    rejection (``p`` when it has no mass), ``p`` of row ``num_accepted`` otherwise. The
    exactness tests enumerate ``u`` through this function.
    """
    batch, rows, vocab = p.shape
    num_drafts = rows - 1
    p_draft = p[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, drafts[..., None])[..., 0]
    # Greedy p is one-hot at the arg-max, so p(d) > 0 means d is the arg-max.
    accept = torch.where(greedy[:, None], p_draft > 0, u * q_draft < p_draft) & valid
    num_accepted = accept.to(torch.int64).cumprod(-1).sum(-1)

    p_last = p.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab))[:, 0]
    if num_drafts == 0:
        return num_accepted, p_last
    last = num_accepted.clamp(max=num_drafts - 1)
    if q is None:
        q_last = torch.zeros_like(p_last).scatter_(-1, drafts.gather(1, last[:, None]), 1.0)
    else:
        q_last = q.gather(1, last[:, None, None].expand(batch, 1, vocab))[:, 0]
    residual = (p_last - q_last).clamp(min=0)  # NaN stays NaN and never wins the race
    rejected = valid.gather(1, last[:, None])[:, 0] & (num_accepted <= last)
    use_residual = rejected & (residual > 0).any(-1) & ~greedy
    return num_accepted, torch.where(use_residual[:, None], residual, p_last)


def without_distribution(final_token: torch.Tensor, p: torch.Tensor,
                         row: torch.Tensor) -> torch.Tensor:
    """``-1`` where the final token's row ``p[b, row[b]]`` has no finite logit (contract
    section 7), else ``final_token``. Only unvalidated input reaches this with a token: a
    draft row with negative entries (``validate=False``) gives the residual ``max(0 - q, 0)``
    mass where the target has none, and a row without a distribution emits nothing."""
    has_finite = p.gather(1, row[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0].amax(-1) > 0
    return torch.where(has_finite, final_token, -1)


def _one_hot_rows(drafts: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, K, V]`` one-hot at the drafted tokens: a deterministic drafter's q."""
    return torch.zeros(*drafts.shape, vocab, dtype=dtype, device=drafts.device).scatter_(
        -1, drafts[..., None], 1.0)


def block_outcome(p: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor,
                  valid: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor) -> BlockOutcome:
    """Block verification (contract section 12) given its acceptance uniforms ``u`` ``[B, K]``;
    arguments as :func:`chain_outcome`. The live drafts are the leading valid ones (as the
    token rule, which stops at the first invalid draft); ``n`` below is their number.

    Per request: ``w_j = min(1, w_{j-1} p_j(d_j) / q_j(d_j))``; test ``j < n`` passes when
    ``u_j < h_j = R_j / (R_j + 1 - w_j)``, ``R_j = sum(max(w_j p_{j+1} - q_{j+1}, 0))``; test
    ``n`` when ``u_n q_n(d_n) < w_{n-1} p_n(d_n)`` (``u_n < w_n``, in the token rule's form, so
    ``n = 1`` does the token rule's float operations); ``tau`` is the last passed test.
    Greedy requests take :func:`chain_outcome`'s answer.
    """
    batch, rows, vocab = p.shape
    num_drafts = rows - 1
    live = valid.to(torch.int64).cumprod(-1).bool()
    num_live = live.sum(-1)
    q_rows = _one_hot_rows(drafts, vocab, p.dtype) if q is None else q
    p_draft = p[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]
    q_draft = q_rows.gather(-1, drafts[..., None])[..., 0]

    weights = [torch.ones(batch, dtype=p.dtype, device=p.device)]  # w_0 .. w_K
    for j in range(num_drafts):
        weights.append(sequence_weight(weights[j], p_draft[:, j], q_draft[:, j]))
    w = torch.stack(weights, 1)  # [B, K+1]
    # h_j for j < n, from the rows at position j + 1 (one [B, V] pass per position).
    h = torch.stack([rejection_weight(
        weighted_residual(w[:, j, None], p[:, j], q_rows[:, j]).sum(-1), w[:, j])
        for j in range(1, num_drafts)] + [w[:, num_drafts]], 1) if num_drafts else w[:, 1:]
    last = torch.arange(1, num_drafts + 1, device=p.device) == num_live[:, None]
    passed = torch.where(last, u * q_draft < w[:, :num_drafts] * p_draft, u < h) & live
    accept_probability = torch.where(live, torch.where(last, w[:, 1:], h), 0.0)
    tau = last_success(passed)

    p_tau = p.gather(1, tau[:, None, None].expand(batch, 1, vocab))[:, 0]
    if num_drafts:
        row = tau.clamp(max=num_drafts - 1)[:, None, None].expand(batch, 1, vocab)
        corrected = correction_weights(w.gather(1, tau[:, None])[:, 0], p_tau,
                                       q_rows.gather(1, row)[:, 0])
        final = torch.where((tau < num_live)[:, None], corrected, p_tau)
    else:
        final = p_tau
    if bool(greedy.any()):
        token_accepted, token_weights = chain_outcome(p, q, drafts, valid, greedy, u)
        tau = torch.where(greedy, token_accepted, tau)
        final = torch.where(greedy[:, None], token_weights, final)
    return BlockOutcome(tau, final, accept_probability, passed)


def slotted_rows(draft: torch.Tensor, draft_slots: torch.Tensor, num_drafts: int,
                 vocab: int) -> torch.Tensor:
    """``[B, K, V]``: request ``b``'s draft rows ``draft[draft_slots[b], :K, :V]`` of an
    ``[S, K', V']`` per-slot draft tensor (a gather: the definition, not a kernel's path)."""
    slots = draft_slots.to(torch.int64).clamp(0, max(draft.shape[0] - 1, 0))
    return draft[:, :num_drafts, :vocab][slots]


def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 draft_probs: Optional[torch.Tensor], draft_logits: Optional[torch.Tensor],
                 num_draft_tokens: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                 min_p: Optional[torch.Tensor] = None,
                 token_bitmask: Optional[torch.Tensor] = None,
                 return_logprobs: Optional[str] = None, method: str = "token",
                 draft_slots: Optional[torch.Tensor] = None,
                 draft_temperature: Optional[torch.Tensor] = None):
    """Returns ``(output_token_ids [B, K+1] int32, num_accepted [B] int32, logprobs)``,
    ``logprobs`` float32 ``[B, K+1]`` when ``return_logprobs`` is set, else None.

    All per-request arguments are ``[B]`` tensors (parsed by the public layer). Out-of-range
    draft ids and ``num_draft_tokens`` outside ``0..K`` (possible with ``validate=False``) are
    treated as rejected drafts and clamped, never read. ``token_bitmask`` ``[B, K+1, W]``
    applies to the target rows only; ``min_p`` to the target and the draft logits.
    ``method`` is ``"token"`` or ``"block"``.

    ``draft_slots`` ``[B]``: the draft tensor is ``[S, K', V']`` and request ``b``'s draft
    ``j`` is its row ``[draft_slots[b], j, :V]`` (slots clamped to ``[0, S - 1]``, as
    unvalidated values are everywhere). ``draft_temperature`` ``[B]``: ``q =
    processed_probs(draft_logits)`` at that temperature with no filter (0: one-hot at the
    row's arg-max) instead of the target's parameters.
    """
    batch, rows, vocab = target_logits.shape
    num_drafts = rows - 1
    device = target_logits.device
    if draft_slots is not None:
        draft_probs, draft_logits = (
            None if draft is None else slotted_rows(draft, draft_slots, num_drafts, vocab)
            for draft in (draft_probs, draft_logits))
    p = processed_probs(target_logits, temperature, top_k, top_p, min_p,
                        token_bitmask)  # [B, K+1, V]
    if draft_logits is not None and draft_temperature is not None:
        q = processed_probs(draft_logits, draft_temperature,
                            torch.zeros_like(top_k), torch.ones_like(top_p))
    elif draft_logits is not None:
        q = processed_probs(draft_logits, temperature, top_k, top_p, min_p)
    elif draft_probs is not None:
        q = draft_probs.to(p.dtype)
    else:
        q = None  # one-hot at the drafted token

    position = torch.arange(num_drafts, device=device)
    live_drafts = num_draft_tokens.to(torch.int64).clamp(0, num_drafts)
    ids = draft_token_ids.to(torch.int64)
    valid = (position < live_drafts[:, None]) & (ids >= 0) & (ids < vocab)
    drafts = torch.where(valid, ids, 0)
    u = _rng.uniform(seed[:, None], offset[:, None], position + 1, _rng.PURPOSE_ACCEPT)
    if method == "block":
        num_accepted, weights, _, _ = block_outcome(p, q, drafts, valid, temperature == 0, u)
    else:
        num_accepted, weights = chain_outcome(p, q, drafts, valid, temperature == 0, u)
    final_token = race(weights, seed, offset, num_accepted, _rng.PURPOSE_RESAMPLE)
    final_token = without_distribution(final_token, p, num_accepted)

    out = torch.full((batch, rows), -1, dtype=torch.int32, device=device)
    out[:, :num_drafts] = torch.where(position < num_accepted[:, None], drafts, -1).to(torch.int32)
    out.scatter_(1, num_accepted[:, None], final_token[:, None])
    logprobs = None
    if return_logprobs is not None:  # chain: output position j was emitted at row j
        logprobs = token_logprobs(target_logits, p, torch.arange(rows, device=device).expand(
            batch, rows), out, temperature == 0, return_logprobs)
    return out, num_accepted.to(torch.int32), logprobs
