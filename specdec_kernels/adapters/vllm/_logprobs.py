"""vLLM's ``LogprobsTensors`` of a V1 step: one slot per output position, from the row each
token was emitted at, in the sampler's ``logprobs_mode`` (``raw_*`` from the model's logits,
``processed_*`` from the rows as they were verified)."""
from __future__ import annotations

import torch

from ...sampling import processed_probs
from ._layout import Step
from ._types import PLACEHOLDER_TOKEN_ID, LogprobsTensors, vllm_types

PROCESSED_LOGPROBS_MODES = ("processed_logprobs", "processed_logits")
LOGITS_MODES = ("raw_logits", "processed_logits")


def logprobs_tensors(step: Step, rows, raw_rows, bitmask, params, tokens, bonus_logits, *,
                     mode: str):
    """vLLM's ``_get_logprobs_tensors`` on our rows: one slot per output position
    (``bonus_logits``: the Sampler's bonus rows, when it sampled them)."""
    slot_rows = step.slot_rows_device  # [B*(K+1)] the row each slot was emitted at
    if mode in PROCESSED_LOGPROBS_MODES:
        scores = processed_logits(rows, slot_rows, step, bitmask, params)
    else:
        scores = raw_rows[slot_rows].float()
    if bonus_logits is not None and step.bonus_slots:
        slots = torch.tensor(step.bonus_slots, dtype=torch.int64).to(scores.device,
                                                                     non_blocking=True)
        requests = torch.tensor(step.bonus_slot_requests, dtype=torch.int64).to(
            scores.device, non_blocking=True)
        scores = scores.index_copy(0, slots, bonus_logits.float()[requests])
    logprobs = scores if mode in LOGITS_MODES else scores.log_softmax(-1)
    token_ids = tokens.reshape(-1).to(torch.int64)
    token_ids = torch.where(token_ids == PLACEHOLDER_TOKEN_ID, 0, token_ids)
    return gather_logprobs(logprobs, step.max_num_logprobs, token_ids)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """vLLM's ``Sampler.gather_logprobs``: the token's logprob and rank, then the top ``n``."""
    topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
    token_ids = token_ids[:, None]
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    _, logprobs_class = vllm_types()
    return logprobs_class(torch.cat((token_ids, topk_indices), dim=1).to(torch.int32),
                          torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)


def processed_logits(rows, slot_rows, step: Step, bitmask, params) -> torch.Tensor:
    """Each slot's row as we verified it, as logits: temperature (1 for greedy rows, as
    vLLM), the filters and the bitmask as ``-inf``."""
    per_slot = step.max_spec_len + 1
    device = rows.device
    requests = torch.arange(step.batch, device=device).repeat_interleave(per_slot)
    temperature = params["temperature"]
    if isinstance(temperature, torch.Tensor):
        temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
        temperature = temperature[requests]
    else:
        temperature = 1.0

    def expand(value):
        return None if value is None else value[requests]
    z = rows[slot_rows].float()
    probs = processed_probs(z, temperature, expand(params["top_k"]), expand(params["top_p"]),
                            min_p=expand(params["min_p"]), validate=False,
                            token_bitmask=None if bitmask is None else bitmask[slot_rows])
    scale = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
    return torch.where(probs > 0, z / scale, float("-inf"))
