"""vLLM V1's spec-decode sampling step on its flattened logits, by ``verify_chain_packed``.

Follows vllm-project/vllm as read at commits 7f6fc1c5 (``vllm/v1/sample/rejection_sampler.py``:
``RejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata)``), 1829ff4b
(``vllm/v1/spec_decode/metadata.py``: ``SpecDecodeMetadata``), 82ac55cf
(``vllm/v1/sample/metadata.py``: ``SamplingMetadata``) and bf17660a
(``vllm/v1/sample/logits_processor/builtin.py``: ``MinPLogitsProcessor``).

The layout, as vLLM's ``_calc_spec_decode_metadata`` builds it: ``logits`` is ``[T+B, V]``,
request ``b``'s ``n_b`` draft rows then its bonus row, requests in batch order, so
``target_logits_indices[t] = t + (request of draft t)`` and ``bonus_logits_indices[b] =
cu_num_draft_tokens[b] + b`` with vLLM's *inclusive* ``cu_num_draft_tokens [B]``. That is
contract section 10's packed layout: the rows are read in place (no gather, no padded copy).
The result is vLLM's: ``[B, max_spec_len + 1]`` int32, the accepted drafts, then the
correction or bonus token, then ``PLACEHOLDER_TOKEN_ID`` (-1), and
``RejectionSampler.parse_output`` reads it unchanged.

No vLLM import is needed: :class:`SpecDecodeMetadata` and :class:`SamplingMetadata` mirror
vLLM's field names, and vLLM's own objects are read by the same attribute names.

What differs from vLLM's ``RejectionSampler`` (each also in the docstrings):
* The bonus token is sampled in the same kernel from the bonus row (vLLM runs its full
  sampler on ``logits[bonus_logits_indices]``, a copy). Same law.
* ``min_p`` applies to every row; vLLM's draft rows get only temperature, top-k and top-p
  (``apply_sampling_constraints``), so its accepted tokens ignore ``min_p`` while its bonus
  token honours it. Ours are exactly the target's law with every parameter.
* Randomness: our Philox stream keyed by a per-request seed and offset, not
  ``torch.Generator`` objects. Without ``seed``, each request in
  ``sampling_metadata.generators`` gets one fresh seed per step drawn from its own generator
  (repeatable from the request's ``SamplingParams.seed``, as vLLM's are) and the others from
  torch's default generator. An engine may instead pass ``seed=`` (e.g. each request's
  ``SamplingParams.seed``) and ``offset=`` (any per-step counter that never repeats for a
  request, e.g. its number of output tokens so far).
* Logits processors that change values (penalties, ``logit_bias``, bad words,
  ``min_tokens``) are not applied here: apply them to ``logits`` first, in place (vLLM's
  sampler applies them to its gathered copies of the draft and bonus rows).
  ``allowed_token_ids`` and grammars go in as ``token_bitmask`` (xgrammar's int32 layout,
  one row per ``logits`` row), read in the same pass as the logits.
* Log-probabilities: not returned here (``logprobs_tensors`` is None); call
  :func:`specdec_kernels.verify_chain_packed` with ``return_logprobs`` for the emitted
  tokens' log-probabilities.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from .. import _params
from ..chain import verify_chain_packed
from ._common import seeds_from_generator

__all__ = ["PLACEHOLDER_TOKEN_ID", "SpecDecodeMetadata", "SamplingMetadata", "SamplerOutput",
           "RejectionSampler", "rejection_sample"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's placeholder for the slots after the last emitted token


@dataclass
class SpecDecodeMetadata:
    """vLLM's ``SpecDecodeMetadata`` (the fields this step reads, same names)."""
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
        """The metadata vLLM's model runner builds for these drafts (one list per request)."""
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64)
        cu_drafts = counts.cumsum(0)
        request = torch.repeat_interleave(torch.arange(len(counts)), counts)
        flat = [token for ids in draft_token_ids for token in ids]
        as_int32 = dict(dtype=torch.int32, device=device)
        return cls(draft_token_ids=torch.tensor(flat, **as_int32),
                   num_draft_tokens=num_draft_tokens,
                   cu_num_draft_tokens=cu_drafts.to(**as_int32),
                   target_logits_indices=(torch.arange(len(flat)) + request).to(**as_int32),
                   bonus_logits_indices=(cu_drafts + torch.arange(len(counts))).to(**as_int32),
                   cu_num_sampled_tokens=(cu_drafts + torch.arange(1, len(counts) + 1)
                                          ).to(**as_int32))


@dataclass
class SamplingMetadata:
    """vLLM's ``SamplingMetadata`` (the sampling fields this step reads, same names).

    ``temperature`` 0 is greedy (vLLM's ``GREEDY_TEMPERATURE``); ``top_k`` of 0 or ``>= V``
    and ``top_p`` of 1 disable; None disables for every request. vLLM keeps ``min_p`` in its
    ``MinPLogitsProcessor`` (``logitsprocs``), which is read too when this field is absent.
    """
    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    generators: dict = field(default_factory=dict)  # batch index -> torch.Generator


class SamplerOutput(NamedTuple):
    """vLLM's ``SamplerOutput`` fields."""
    sampled_token_ids: torch.Tensor  # [B, max_spec_len + 1] int32, -1 placeholders
    logprobs_tensors: None = None


def rejection_sample(metadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                     sampling_metadata, *, seed=None, offset=None,
                     token_bitmask: Optional[torch.Tensor] = None, backend: str = "auto",
                     validate: bool = True) -> torch.Tensor:
    r"""vLLM's spec-decode step: verify every request's drafts and sample its bonus token.

    Args:
        metadata: vLLM's ``SpecDecodeMetadata`` or ours: ``draft_token_ids [T]``,
            ``num_draft_tokens`` (B ints), inclusive ``cu_num_draft_tokens [B]``,
            ``target_logits_indices [T]``, ``bonus_logits_indices [B]``, ``max_spec_len``.
        draft_probs: the drafter's distributions, ``(T, vocab_size)``, or None (n-gram,
            EAGLE argmax: one-hot drafts).
        logits: the target's raw logits, as vLLM's model runner computes them.
            Shape ``(T + B, vocab_size)``; float32/bf16/fp16. Read in place, never copied.
        sampling_metadata: vLLM's ``SamplingMetadata`` or ours: ``temperature [B]`` (0 =
            greedy; None when ``all_greedy``), ``top_k``/``top_p`` ``[B]`` or None,
            ``min_p`` (or vLLM's ``MinPLogitsProcessor`` in ``logitsprocs``), and
            ``generators`` (batch index -> ``torch.Generator``) for seeded requests.
        seed, offset: optional per-request (``(B,)`` int64) or shared seeds and step
            offsets; they replace the generators (see the module docstring).
        token_bitmask: optional grammar bitmask, ``(T + B, ceil(V / 32))`` int32.
        backend, validate: as in :func:`specdec_kernels.verify_chain_packed`; ``validate``
            also checks that the logits indices are vLLM's layout.

    Returns:
        output_token_ids: Shape ``(B, max_spec_len + 1)``; int32: the accepted drafts, one
        correction or bonus token, then ``PLACEHOLDER_TOKEN_ID`` (-1).

    >>> import torch
    >>> from specdec_kernels.adapters import vllm
    >>> metadata = vllm.SpecDecodeMetadata.from_draft_token_ids([[1, 2], [], [0]])
    >>> metadata.target_logits_indices.tolist(), metadata.bonus_logits_indices.tolist()
    ([0, 1, 4], [2, 3, 5])
    >>> logits = torch.zeros(5 + 1, 4)
    >>> logits[[0, 1, 2, 3, 4, 5], [1, 3, 0, 2, 0, 1]] = 9.0  # arg-max of each row
    >>> greedy = vllm.SamplingMetadata(temperature=None, all_greedy=True, all_random=False)
    >>> vllm.rejection_sample(metadata, None, logits, greedy)
    tensor([[ 1,  3, -1],
            [ 2, -1, -1],
            [ 0,  1, -1]], dtype=torch.int32)
    """
    draft_token_ids = metadata.draft_token_ids
    cu_inclusive = metadata.cu_num_draft_tokens
    max_spec_len = getattr(metadata, "max_spec_len", None)
    if max_spec_len is None:
        max_spec_len = max(metadata.num_draft_tokens, default=0)
    _params.check_tensor(logits, "logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = logits.device
    _params.check_tensor(cu_inclusive, "cu_num_draft_tokens", ndim=1,
                         dtypes=_params.INDEX_DTYPES, device=device)
    batch = cu_inclusive.shape[0]
    # vLLM's inclusive [B] sums as the contract's exclusive [B+1] ones (a tiny device op).
    cu_exclusive = torch.nn.functional.pad(cu_inclusive, (1, 0))
    if validate:
        _check_layout(metadata, cu_inclusive, batch, device)
    seed = _request_seeds(sampling_metadata, seed, batch, device)
    temperature = sampling_metadata.temperature
    if getattr(sampling_metadata, "all_greedy", False) or temperature is None:
        temperature = 0.0
    filters = dict(temperature=temperature, top_k=sampling_metadata.top_k,
                   top_p=sampling_metadata.top_p, min_p=_min_p(sampling_metadata, batch))
    out = verify_chain_packed(logits, draft_token_ids, cu_exclusive,
                              max_draft_tokens=int(max_spec_len), draft_probs=draft_probs,
                              token_bitmask=token_bitmask, seed=seed, offset=offset,
                              backend=backend, validate=validate, **filters)
    return out.output_token_ids


class RejectionSampler(torch.nn.Module):
    """A stand-in for ``vllm.v1.sample.rejection_sampler.RejectionSampler``: built as vLLM's
    (``RejectionSampler(sampler)``), ``forward`` takes vLLM's arguments and returns a
    ``SamplerOutput`` (vLLM's class when vLLM is installed). Keyword arguments of
    :func:`rejection_sample` pass through. ``sampler`` is kept for vLLM's code that reads it;
    the bonus tokens are sampled in our kernel, so it is never called."""

    def __init__(self, sampler=None):
        super().__init__()
        self.sampler = sampler

    def forward(self, metadata, draft_probs, logits, sampling_metadata, **kwargs):
        tokens = rejection_sample(metadata, draft_probs, logits, sampling_metadata, **kwargs)
        return _sampler_output_class()(sampled_token_ids=tokens, logprobs_tensors=None)

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int) -> list:
        """vLLM's ``parse_output``: each request's emitted tokens as a list (host copy)."""
        rows = output_token_ids.cpu()
        return [row[(row != PLACEHOLDER_TOKEN_ID) & (row < vocab_size)].tolist() for row in rows]


@functools.lru_cache(maxsize=None)
def _sampler_output_class():
    """vLLM's ``SamplerOutput`` when vLLM is installed (looked up once), else ours."""
    try:
        from vllm.v1.outputs import SamplerOutput as vllm_sampler_output
    except ImportError:
        return SamplerOutput
    return vllm_sampler_output


def _check_layout(metadata, cu_inclusive: torch.Tensor, batch: int, device) -> None:
    """The logits rows vLLM's metadata names are the packed layout's (small reads, one sync)."""
    num_draft_tokens = list(metadata.num_draft_tokens)
    if len(num_draft_tokens) != batch:
        raise ValueError(f"num_draft_tokens: expected {batch} entries (one per request, as "
                         f"cu_num_draft_tokens), got {len(num_draft_tokens)}")
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    cu = counts.cumsum(0)
    request = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    expected = {"cu_num_draft_tokens": cu,
                "target_logits_indices": torch.arange(int(counts.sum()), device=device) + request,
                "bonus_logits_indices": cu + torch.arange(batch, device=device)}
    for name, want in expected.items():
        got = cu_inclusive if name == "cu_num_draft_tokens" else getattr(metadata, name)
        _params.check_tensor(got, name, ndim=1, dtypes=_params.INDEX_DTYPES, device=device)
        if got.shape != want.shape or bool((got.to(torch.int64) != want).any()):
            raise ValueError(f"{name}: expected vLLM's layout for num_draft_tokens "
                             f"{num_draft_tokens} (each request's draft rows, then its bonus "
                             f"row), {want.tolist()}, got {got.tolist()}")


def _request_seeds(sampling_metadata, seed, batch: int, device):
    """``seed`` if given; else one seed per request, drawn from its own generator where
    vLLM has one (seeded requests) and from torch's default generator otherwise -- drawn by
    the op once it has checked its arguments (``DeferredSeeds``): a rejected call advances no
    generator."""
    if seed is not None:
        return seed
    generators = getattr(sampling_metadata, "generators", None) or {}
    if not generators:
        return None  # verify_chain_packed draws from torch's default generator, last
    for index, generator in generators.items():
        if not isinstance(index, int) or not 0 <= index < batch:
            raise ValueError(f"generators: expected batch indices in [0, {batch}), got {index!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generators: expected torch.Generator values, got "
                            f"{type(generator).__name__} at batch index {index}")

    def draw() -> torch.Tensor:
        seeds = seeds_from_generator(torch.default_generator, batch, device)
        for index, generator in generators.items():
            seeds[index:index + 1] = seeds_from_generator(generator, 1, device)
        return seeds
    return _params.DeferredSeeds(draw)


def _min_p(sampling_metadata, batch: int) -> Optional[torch.Tensor]:
    """``min_p`` from the field (older vLLM, ours) or vLLM's ``MinPLogitsProcessor``."""
    min_p = getattr(sampling_metadata, "min_p", None)
    if min_p is not None:
        return min_p
    processors = getattr(sampling_metadata, "logitsprocs", None)
    for processor in getattr(processors, "argmax_invariant", None) or ():
        if hasattr(processor, "min_p_count") and hasattr(processor, "min_p"):
            # Its [B, 1] slice is current only while some request uses min_p.
            return processor.min_p.reshape(-1)[:batch] if processor.min_p_count else None
    return None
