"""vLLM's types, mirrored by field name: what vLLM 0.33.0 passes to and takes back from
its rejection samplers (``vllm/v1/spec_decode/metadata.py``, ``vllm/v1/sample/metadata.py``,
``vllm/v1/outputs.py``). vLLM's own objects are read by the same names, and vLLM's own output
classes are returned when vLLM is loaded."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch

__all__ = ["PLACEHOLDER_TOKEN_ID", "MAX_SPEC_LEN", "SpecDecodeMetadata", "SamplingMetadata",
           "LogprobsTensors", "LogprobsLists", "SamplerOutput", "vllm_types"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's placeholder for the slots after the last emitted token
MAX_SPEC_LEN = 128         # vLLM's limit on drafts per request in one step
SAMPLING_EPS = 1e-5        # vLLM's sampler: a temperature below this is greedy


@dataclass
class SpecDecodeMetadata:
    """vLLM's ``SpecDecodeMetadata`` (``vllm/v1/spec_decode/metadata.py``), same fields."""
    draft_token_ids: torch.Tensor        # [T] int32, request after request
    num_draft_tokens: list               # [B] Python ints
    cu_num_draft_tokens: torch.Tensor    # [B] int32, inclusive prefix sums
    target_logits_indices: torch.Tensor  # [T] rows of logits holding the draft positions
    bonus_logits_indices: torch.Tensor   # [B] rows of logits holding the bonus positions
    cu_num_sampled_tokens: Optional[torch.Tensor] = None  # [B] inclusive sums of n_b + 1
    logits_indices: Optional[torch.Tensor] = None         # [T+B] hidden-state rows (unused)
    max_spec_len: int = field(init=False)

    def __post_init__(self):
        self.max_spec_len = max(self.num_draft_tokens, default=0)

    @classmethod
    def from_draft_token_ids(cls, draft_token_ids: Sequence[Sequence[int]],
                             device="cpu") -> "SpecDecodeMetadata":
        """The metadata vLLM's model runner builds for these drafts (one list per request):
        ``logits`` rows in its ``[T+B, V]`` layout."""
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64)
        cu_drafts = counts.cumsum(0)
        request = torch.repeat_interleave(torch.arange(len(counts)), counts)
        flat = [int(token) for ids in draft_token_ids for token in ids]
        as_int32 = dict(dtype=torch.int32, device=device)
        return cls(draft_token_ids=torch.tensor(flat, **as_int32),
                   num_draft_tokens=num_draft_tokens,
                   cu_num_draft_tokens=cu_drafts.to(**as_int32),
                   target_logits_indices=(torch.arange(len(flat)) + request).to(**as_int32),
                   bonus_logits_indices=(cu_drafts + torch.arange(len(counts))).to(**as_int32),
                   cu_num_sampled_tokens=(cu_drafts + torch.arange(1, len(counts) + 1)
                                          ).to(**as_int32),
                   logits_indices=torch.arange(len(flat) + len(counts)).to(**as_int32))

    make_dummy = from_draft_token_ids  # vLLM's name (vLLM's own leaves the indices zero)


@dataclass
class SamplingMetadata:
    """vLLM's ``SamplingMetadata`` (``vllm/v1/sample/metadata.py``), the fields this step reads.

    ``temperature`` 0 is greedy (None when ``all_greedy``); ``top_k`` 0 or ``>= V`` and
    ``top_p`` 1 disable. ``output_token_ids`` / ``spec_token_ids`` (host lists, one per
    request) are the history of penalties and bad words; ``allowed_token_ids_mask`` is
    ``[>= B, V]`` bool, True = disallowed; ``logitsprocs`` holds vLLM's builtin processors
    (``MinPLogitsProcessor``: ``min_p``/``min_p_count``; ``LogitBiasLogitsProcessor``:
    ``biases``; ``MinTokensLogitsProcessor``: ``min_toks``), read by attribute name.
    ``min_p`` ``[B]`` may be given directly instead.
    """
    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    generators: dict = field(default_factory=dict)  # batch index -> torch.Generator
    max_num_logprobs: Optional[int] = None
    no_penalties: bool = True
    prompt_token_ids: Optional[torch.Tensor] = None  # [B, P], padded with V
    frequency_penalties: Optional[torch.Tensor] = None
    presence_penalties: Optional[torch.Tensor] = None
    repetition_penalties: Optional[torch.Tensor] = None
    output_token_ids: list = field(default_factory=list)
    allowed_token_ids_mask: Optional[torch.Tensor] = None
    bad_words_token_ids: dict = field(default_factory=dict)
    logitsprocs: Any = None
    logprob_token_ids: Optional[dict] = None
    spec_token_ids: Optional[list] = None
    thinking_budget_state_holder: Any = None
    min_p: Optional[torch.Tensor] = None


class LogprobsLists(NamedTuple):
    """vLLM's ``LogprobsLists`` (``vllm/v1/outputs.py``)."""
    logprob_token_ids: Any
    logprobs: Any
    sampled_token_ranks: Any
    cu_num_generated_tokens: Optional[list] = None


class LogprobsTensors(NamedTuple):
    """vLLM's ``LogprobsTensors``: per emitted slot the token and the top-``n`` ids
    ``[N, n+1]`` int32, their logprobs ``[N, n+1]`` float32 and the token's rank ``[N]``
    (1 + the number of tokens with a larger logprob, ties counted)."""
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    cu_num_generated_tokens: Optional[list] = None

    def filter(self, mask) -> "LogprobsTensors":
        mask = torch.as_tensor(mask)
        return LogprobsTensors(self.logprob_token_ids[mask], self.logprobs[mask],
                               self.selected_token_ranks[mask])

    def tolists(self, cu_num_generated_tokens=None) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.cpu().numpy(), self.logprobs.cpu().numpy(),
                             self.selected_token_ranks.cpu().numpy(),
                             cu_num_generated_tokens if cu_num_generated_tokens is not None
                             else self.cu_num_generated_tokens)


class SamplerOutput(NamedTuple):
    """vLLM's ``SamplerOutput`` fields."""
    sampled_token_ids: torch.Tensor  # [B, max_spec_len + 1] int32, -1 placeholders
    logprobs_tensors: Optional[LogprobsTensors] = None


def vllm_types():
    """vLLM's ``SamplerOutput`` / ``LogprobsTensors`` when vLLM's ``vllm.v1.outputs`` is loaded
    (an engine that calls us has imported it), else ours. Looked up in ``sys.modules``, not
    imported: an import inside the step would break ``torch.compile``'s graph."""
    outputs = sys.modules.get("vllm.v1.outputs")
    if outputs is None:
        return SamplerOutput, LogprobsTensors
    return outputs.SamplerOutput, outputs.LogprobsTensors
