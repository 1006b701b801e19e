"""Baselines the fused kernels are measured against, written in plain torch.

* :func:`unfused_chain` -- the unfused PyTorch pipeline of issue 2: an fp32 softmax of the
  logits with temperature (a materialised ``[B, K+1, V]`` fp32 probability tensor), then the
  same speculative-sampling algorithm as the contract in torch ops, with torch's own random
  numbers instead of the Philox streams. Its law is the contract's; its tokens are not the
  kernels' tokens (other random numbers), which is fine for timing.
* :func:`vllm_style_chain` and its stages -- the pipeline an engine like vLLM runs when its
  sampler and rejection sampler are separate steps: an fp32 copy of the logits divided by the
  temperature, a statistics pass (row max and log-sum-exp), then acceptance and the
  correction/bonus sample reading one row per request. Timing each stage on its own shows
  where the unfused time goes: the copy writes 4 bytes and reads ``s`` per logit, the
  statistics pass reads 4 more, and the resample is small.
* :func:`flashinfer_chain` -- FlashInfer's ``chain_speculative_sampling`` after an fp32
  softmax, when ``flashinfer`` is importable.
* :func:`unfused_sample` / :func:`multinomial_sample` -- one token per row for ``sample()``.

Only temperature is supported (no top-k/top-p): the benchmarks sweep plain sampling and greedy.
"""
from __future__ import annotations

from typing import Optional

import torch


def _rows(batch: int, device) -> torch.Tensor:
    return torch.arange(batch, device=device)


def _race(weights: torch.Tensor) -> torch.Tensor:
    """One sample per row of unnormalised ``weights`` by the exponential race (torch RNG)."""
    noise = torch.empty_like(weights).exponential_()
    return (weights / noise).argmax(-1)


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor,
              final_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, num_drafts = draft_ids.shape
    position = torch.arange(num_drafts, device=draft_ids.device)
    out = torch.full((batch, num_drafts + 1), -1, dtype=torch.int32, device=draft_ids.device)
    out[:, :num_drafts] = torch.where(position < num_accepted[:, None], draft_ids, -1).to(torch.int32)
    out.scatter_(1, num_accepted[:, None], final_token.to(torch.int32)[:, None])
    return out, num_accepted.to(torch.int32)


def _greedy_chain(target_logits: torch.Tensor, draft_ids: torch.Tensor):
    argmax = target_logits.argmax(-1)  # [B, K+1]; lowest id among ties, as the contract says
    num_drafts = draft_ids.shape[1]
    match = (draft_ids == argmax[:, :num_drafts]).to(torch.int64)
    num_accepted = match.cumprod(-1).sum(-1)
    final = argmax.gather(1, num_accepted[:, None])[:, 0]
    return _assemble(draft_ids.to(torch.int64), num_accepted, final)


def _accept_and_resample(target_probs_at, target_row, draft_ids: torch.Tensor,
                         draft_probs: Optional[torch.Tensor]):
    """The algorithm once target probabilities are available.

    ``target_probs_at(ids)`` returns ``p_j(ids_j)`` for the K draft positions (``[B, K]``);
    ``target_row(rows)`` returns the full ``[B, V]`` target distribution at row ``rows[b]``.
    """
    batch, num_drafts = draft_ids.shape
    device = draft_ids.device
    ids = draft_ids.to(torch.int64)
    p_draft = target_probs_at(ids)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, ids[..., None])[..., 0].float()
    u = torch.rand(batch, num_drafts, device=device)
    accept = (u * q_draft < p_draft).to(torch.int64)
    num_accepted = accept.cumprod(-1).sum(-1)
    p_last = target_row(num_accepted)
    if num_drafts == 0:
        return _assemble(ids, num_accepted, _race(p_last))
    last = num_accepted.clamp(max=num_drafts - 1)
    rows = _rows(batch, device)
    if draft_probs is None:
        # scatter_ with a scalar (not an indexed assignment, which copies a CPU scalar and so
        # cannot be captured in a CUDA graph)
        q_last = torch.zeros_like(p_last).scatter_(1, ids.gather(1, last[:, None]), 1.0)
    else:
        q_last = draft_probs[rows, last].float()
    residual = (p_last - q_last).clamp(min=0)
    rejected = (num_accepted < num_drafts) & (residual.sum(-1) > 0)
    weights = torch.where(rejected[:, None], residual, p_last)
    return _assemble(ids, num_accepted, _race(weights))


def unfused_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  draft_probs: Optional[torch.Tensor] = None, temperature: float = 1.0):
    """Returns ``(output_token_ids [B, K+1] int32, num_accepted [B] int32)``."""
    if temperature == 0:
        return _greedy_chain(target_logits, draft_token_ids)
    probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, K+1, V] fp32
    num_drafts = draft_token_ids.shape[1]
    rows = _rows(probs.shape[0], probs.device)
    return _accept_and_resample(
        lambda ids: probs[:, :num_drafts].gather(-1, ids[..., None])[..., 0],
        lambda r: probs[rows, r], draft_token_ids, draft_probs)


# --- vLLM-style pipeline, stage by stage --------------------------------------------------


def vllm_fp32_temperature(target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Stage 1: the fp32 copy with temperature that an engine's sampler makes ([B, K+1, V]):
    ``logits.to(float32)`` then an in-place divide, as vLLM's sampler does (a copy always, so
    fp32 inputs are never modified)."""
    return target_logits.to(torch.float32, copy=True).div_(temperature)


def vllm_statistics(scaled: torch.Tensor) -> torch.Tensor:
    """Stage 2: log-sum-exp of each row of the fp32 copy ([B, K+1])."""
    return torch.logsumexp(scaled, dim=-1)


def vllm_accept_resample(scaled: torch.Tensor, lse: torch.Tensor, draft_token_ids: torch.Tensor,
                         draft_probs: Optional[torch.Tensor] = None):
    """Stage 3: acceptance from gathered probabilities, then one row per request resampled."""
    num_drafts = draft_token_ids.shape[1]
    rows = _rows(scaled.shape[0], scaled.device)
    return _accept_and_resample(
        lambda ids: (scaled[:, :num_drafts].gather(-1, ids[..., None])[..., 0]
                     - lse[:, :num_drafts]).exp(),
        lambda r: (scaled[rows, r] - lse[rows, r][:, None]).exp(),
        draft_token_ids, draft_probs)


def vllm_style_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: Optional[torch.Tensor] = None, temperature: float = 1.0):
    if temperature == 0:
        return _greedy_chain(target_logits, draft_token_ids)
    scaled = vllm_fp32_temperature(target_logits, temperature)
    lse = vllm_statistics(scaled)
    return vllm_accept_resample(scaled, lse, draft_token_ids, draft_probs)


# --- FlashInfer ----------------------------------------------------------------------------


def flashinfer_available() -> tuple[bool, str]:
    try:
        import flashinfer.sampling  # noqa: F401, PLC0415 -- optional dependency
        return True, ""
    except Exception as exc:  # noqa: BLE001 -- any failure means "not available here"
        return False, f"flashinfer not importable ({type(exc).__name__}: {str(exc)[:80]})"


def flashinfer_chain_from_probs(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                                target_probs: torch.Tensor):
    import flashinfer.sampling  # noqa: PLC0415
    return flashinfer.sampling.chain_speculative_sampling(draft_probs, draft_token_ids,
                                                          target_probs)


def flashinfer_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor, temperature: float = 1.0):
    """FlashInfer's kernel takes probabilities: an fp32 softmax comes first (timed with it)."""
    target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)
    return flashinfer_chain_from_probs(draft_probs, draft_token_ids, target_probs)


# --- sample() baselines --------------------------------------------------------------------


def unfused_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1).to(torch.int32)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return _race(probs).to(torch.int32)


def multinomial_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1)[:, 0].to(torch.int32)
