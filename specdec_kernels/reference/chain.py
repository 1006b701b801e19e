"""Reference chain verification (contract section 3), vectorised over the batch."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _rng
from .sampling import processed_probs, race, token_logprobs


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


def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 draft_probs: Optional[torch.Tensor], draft_logits: Optional[torch.Tensor],
                 num_draft_tokens: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                 min_p: Optional[torch.Tensor] = None,
                 token_bitmask: Optional[torch.Tensor] = None,
                 return_logprobs: Optional[str] = None):
    """Returns ``(output_token_ids [B, K+1] int32, num_accepted [B] int32, logprobs)``,
    ``logprobs`` float32 ``[B, K+1]`` when ``return_logprobs`` is set, else None.

    All per-request arguments are ``[B]`` tensors (parsed by the public layer). Out-of-range
    draft ids and ``num_draft_tokens`` outside ``0..K`` (possible with ``validate=False``) are
    treated as rejected drafts and clamped, never read. ``token_bitmask`` ``[B, K+1, W]``
    applies to the target rows only; ``min_p`` to the target and the draft logits.
    """
    batch, rows, vocab = target_logits.shape
    num_drafts = rows - 1
    device = target_logits.device
    p = processed_probs(target_logits, temperature, top_k, top_p, min_p,
                        token_bitmask)  # [B, K+1, V]
    if draft_logits is not None:
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
    num_accepted, weights = chain_outcome(p, q, drafts, valid, temperature == 0, u)
    final_token = race(weights, seed, offset, num_accepted, _rng.PURPOSE_RESAMPLE)

    out = torch.full((batch, rows), -1, dtype=torch.int32, device=device)
    out[:, :num_drafts] = torch.where(position < num_accepted[:, None], drafts, -1).to(torch.int32)
    out.scatter_(1, num_accepted[:, None], final_token[:, None])
    logprobs = None
    if return_logprobs is not None:  # chain: output position j was emitted at row j
        logprobs = token_logprobs(target_logits, p, torch.arange(rows, device=device).expand(
            batch, rows), out, temperature == 0, return_logprobs)
    return out, num_accepted.to(torch.int32), logprobs
