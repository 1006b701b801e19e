"""vLLM 0.33.0's V1 spec-decode sampling step (``vllm/v1/sample/rejection_sampler.py``), exact.

A drop-in for ``vllm.v1.sample.rejection_sampler.RejectionSampler`` of vLLM 0.33.0 (the wheel
and sdist on the package index): the same constructor ``RejectionSampler(sampler,
spec_config=None, device=None)``, ``forward(metadata, draft_probs, logits,
sampling_metadata) -> SamplerOutput`` and ``parse_output(output_token_ids, vocab_size,
discard_req_indices=(), logprobs_tensors=None) -> (lists, LogprobsLists | None)``; vLLM's own
unit tests (``tests/v1/sample/test_rejection_sampler.py``) run unchanged against it
(``make engine-tests``). No vLLM import is needed: :class:`SpecDecodeMetadata`,
:class:`SamplingMetadata`, :class:`LogprobsTensors` and :class:`SamplerOutput` mirror vLLM's
types by field name, vLLM's own objects are read by the same names, and vLLM's classes are
returned when vLLM is importable.

The step, as vLLM does it:
* The bonus tokens come from the ``Sampler`` the class was built with, called as vLLM calls
  it (``predict_bonus_token=True``), so every feature of vLLM's sampler applies to the
  bonus row. ``RejectionSampler(..., fused_bonus=True)`` samples them in our kernel instead
  (same law, no second sampling pass) whenever the batch uses only what we fuse
  (temperature, top-k, top-p, min-p, penalties, bad words, ``allowed_token_ids``,
  ``logit_bias``, ``min_tokens``, logprobs); otherwise it falls back to the sampler.
* The drafts are verified by :func:`specdec_kernels.verify_chain_packed` on vLLM's own
  layout: ``logits [T+B, V]``, request ``b``'s ``n_b`` draft rows then its bonus row (what
  ``GPUModelRunner._calc_spec_decode_metadata`` builds). That layout is read in place, no
  gather and no padded copy; its indices are trusted (checking them would read the
  device). Any other shape (vLLM's unit tests pass only the ``T`` target rows, with
  arbitrary ``target_logits_indices``) is first gathered through the indices into that
  layout (one copy).
* Draft row ``j`` of request ``b`` gets the sampling features vLLM's sampler would apply to a
  token generated there, with drafts ``1..j-1`` counted as output (vLLM's
  ``_combine_outputs_with_spec_tokens``): repetition/frequency/presence penalties and bad
  words on that history, ``allowed_token_ids_mask``, ``logit_bias`` and ``min_tokens``
  (stop tokens masked while ``len(output) + j < min_tokens``). They are applied in place on
  the rows of ``logits`` (vLLM's ``forward`` allows it: "``logits`` can be updated in place")
  when ``logits`` is float32, else on a float32 copy; the bonus rows are left as they are
  unless the bonus is fused. Then temperature, top-k, min-p, top-p and the optional grammar
  ``token_bitmask`` are fused in the kernel.
* A draft id of ``-1`` (vLLM's scheduler pads grammar-invalid drafts with it) is a rejected
  draft: the request stops there and emits a correction token, never an error. With
  ``draft_probs`` the correction is vLLM's residual ``max(p - q, 0)`` (the first ``-1``, known
  from ``spec_token_ids``, stands for a ``-inf`` token of its row); without, a sample of ``p``.
* ``sampling_metadata.max_num_logprobs`` set: ``logprobs_tensors`` is vLLM's
  ``LogprobsTensors`` over every output slot (``[B * (max_spec_len + 1), n + 1]`` ids and
  logprobs, the emitted token first, and its rank), in the sampler's ``logprobs_mode``:
  ``raw_*`` from the model's logits, ``processed_*`` from the rows as they were verified.
* ``spec_config.rejection_sample_method``: ``"standard"`` (and None) is our token rule,
  ``"block"`` our ``method="block"`` (block verification, exact); ``"fly"`` and
  ``"synthetic"`` (lossy, vLLM-specific) construct vLLM's own class when vLLM is importable,
  else raise NotImplementedError at construction.
* No host synchronisation on the default path: every check reads Python values and tensor
  shapes only (vLLM's metadata carries ``num_draft_tokens``, ``output_token_ids`` and
  ``spec_token_ids`` as host lists), host-built indices go to the device without a wait,
  the op runs with ``validate=False``, and no Python branch depends on a tensor's values.

Deliberate differences from vLLM 0.33.0, each where ours is exact and vLLM's is not:
* ``min_p`` applies to the draft rows too (vLLM's ``apply_sampling_constraints`` gives the
  draft rows temperature, top-k and top-p only, so its accepted tokens ignore ``min_p``).
* ``logit_bias`` applies to the draft rows (vLLM applies only ``MinTokensLogitsProcessor`` of
  the non-argmax-invariant processors there), and the processors run in the order of
  vLLM's ``Sampler`` (allowed ids, bad words, min-tokens / logit bias, penalties), the order
  a token generated without speculation gets.
* Fused bonus: ``min_tokens`` masks the bonus row while ``len(output) + n_b < min_tokens``
  (vLLM's sampler masks it whenever ``len(output) < min_tokens``, ignoring the drafts).
* Randomness: our Philox stream keyed by a per-request seed and offset, not vLLM's
  ``torch.Generator`` draws: a request in ``sampling_metadata.generators`` gets one fresh
  seed per step from its own generator (repeatable from ``SamplingParams.seed``), the others
  from the device's default generator (no host round trip). ``forward(..., seed=, offset=)``
  passes them explicitly.
* Processed logprobs are those of the law we verify with (with ``min_p`` and
  ``logit_bias`` as above; a greedy row's are at temperature 1, as vLLM's).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import numbers
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch

from .. import _params
from ..chain import verify_chain_packed
from ..sampling import processed_probs
from ._common import seeds_from_generator

__all__ = ["PLACEHOLDER_TOKEN_ID", "MAX_SPEC_LEN", "SpecDecodeMetadata", "SamplingMetadata",
           "LogprobsTensors", "LogprobsLists", "SamplerOutput", "RejectionSampler",
           "rejection_sample"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's placeholder for the slots after the last emitted token
MAX_SPEC_LEN = 128         # vLLM's limit on drafts per request in one step
_SAMPLING_EPS = 1e-5       # vLLM's sampler: a temperature below this is greedy
PROCESSED_LOGPROBS_MODES = ("processed_logprobs", "processed_logits")
_LOGITS_MODES = ("raw_logits", "processed_logits")
_OUR_METHODS = {None: "token", "standard": "token", "block": "block"}
_VLLM_ONLY_METHODS = ("fly", "synthetic")


# --------------------------------------------------------------------------------------------
# vLLM's types, mirrored by field name (vLLM's own are used when vLLM is importable)

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


def _vllm_types():
    """vLLM's ``SamplerOutput`` / ``LogprobsTensors`` when vLLM's ``vllm.v1.outputs`` is loaded
    (an engine that calls us has imported it), else ours. Looked up in ``sys.modules``, not
    imported: an import inside the step would break ``torch.compile``'s graph."""
    outputs = sys.modules.get("vllm.v1.outputs")
    if outputs is None:
        return SamplerOutput, LogprobsTensors
    return outputs.SamplerOutput, outputs.LogprobsTensors


_VLLM_MODULE = "vllm.v1.sample.rejection_sampler"
_vllm_class_kept: list = []  # a strong reference: after the swap nothing else holds it


def _keep_vllm_class() -> None:
    """Keep vLLM's own class while its module still names it (the swap line imports vLLM's
    module, then ours, then replaces the attribute)."""
    module = sys.modules.get(_VLLM_MODULE)
    candidate = getattr(module, "RejectionSampler", None)
    if isinstance(candidate, type) and candidate.__module__ == _VLLM_MODULE \
            and not _vllm_class_kept:
        _vllm_class_kept.append(candidate)


def _vllm_rejection_sampler_class():
    """vLLM's own ``RejectionSampler`` class, found even after the swap line replaced the
    module attribute with ours; None without vLLM."""
    try:
        module = importlib.import_module(_VLLM_MODULE)
    except ImportError:
        return None
    _keep_vllm_class()
    if _vllm_class_kept:
        return _vllm_class_kept[0]
    for cls in torch.nn.Module.__subclasses__():  # still alive, not yet collected
        if cls.__module__ == _VLLM_MODULE and cls.__name__ == "RejectionSampler":
            _vllm_class_kept.append(cls)
            return cls
    # Swapped before we were imported and collected since: a private copy of vLLM's module.
    spec = importlib.util.find_spec(_VLLM_MODULE)
    private = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(private)
    _vllm_class_kept.append(private.RejectionSampler)
    return private.RejectionSampler


# --------------------------------------------------------------------------------------------
# The sampler

class RejectionSampler(torch.nn.Module):
    """vLLM 0.33.0's ``RejectionSampler``, computed by our exact kernels (module docstring).

    Args:
        sampler: vLLM's ``Sampler`` (its ``logprobs_mode`` is read; it samples the bonus
            tokens unless they are fused). May be None with ``fused_bonus=True``.
        spec_config: vLLM's ``SpeculativeConfig`` or None; ``rejection_sample_method`` picks
            the rule (``"standard"``/``"block"`` ours, ``"fly"``/``"synthetic"`` vLLM's own
            class, built and returned instead of ours; NotImplementedError without vLLM).
        device: the device (kept for vLLM's code; tensors decide where we run).
        fused_bonus: sample the bonus tokens in our kernel when the batch allows it.
        backend, validate: passed to :func:`specdec_kernels.verify_chain_packed`
            (``validate=True`` adds device reads of the ids and offsets: a synchronisation).
    """

    def __new__(cls, sampler=None, spec_config=None, device=None, **kwargs):
        method = getattr(spec_config, "rejection_sample_method", None)
        if isinstance(method, str) and method in _VLLM_ONLY_METHODS:
            vllm_class = _vllm_rejection_sampler_class()
            if vllm_class is None:
                raise NotImplementedError(
                    f"rejection_sample_method: {method!r} (lossy, vLLM-specific) is vLLM's "
                    f"own; install vLLM to delegate to it (ours: 'standard', 'block')")
            return vllm_class(sampler, spec_config, device)  # vLLM's object, vLLM's __init__
        return super().__new__(cls)

    def __init__(self, sampler=None, spec_config=None, device=None, *,
                 fused_bonus: bool = False, backend: str = "auto", validate: bool = False):
        super().__init__()
        method = getattr(spec_config, "rejection_sample_method", None)
        if method not in _OUR_METHODS:
            raise NotImplementedError(f"rejection_sample_method: expected one of "
                                      f"{sorted(m for m in _OUR_METHODS if m)} or "
                                      f"{list(_VLLM_ONLY_METHODS)}, got {method!r}")
        if sampler is None and not fused_bonus:
            raise ValueError("sampler: expected vLLM's Sampler (it samples the bonus tokens), "
                             "got None; pass fused_bonus=True to sample them in our kernel")
        self.sampler = sampler
        self.spec_config = spec_config
        self.device = device
        self.method = _OUR_METHODS[method]
        self.fused_bonus = bool(fused_bonus)
        self.backend = backend
        self.validate = bool(validate)
        logprobs_mode = getattr(sampler, "logprobs_mode", "raw_logprobs")
        self.logprobs_mode = logprobs_mode if isinstance(logprobs_mode, str) else "raw_logprobs"
        self.is_processed_logprobs_mode = self.logprobs_mode in PROCESSED_LOGPROBS_MODES
        self.is_logits_logprobs_mode = self.logprobs_mode in _LOGITS_MODES

    def forward(self, metadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                sampling_metadata, *, seed=None, offset=None,
                token_bitmask: Optional[torch.Tensor] = None):
        """vLLM's ``forward``: verify every request's drafts, emit its bonus token.

        Args:
            metadata: vLLM's ``SpecDecodeMetadata`` (or ours).
            draft_probs: ``[T, V]`` the drafter's distributions, or None (one-hot drafts).
            logits: ``[T+B, V]`` the target's logits in vLLM's layout (read in place; the
                draft rows are updated in place by the sampling features, as vLLM allows).
            sampling_metadata: vLLM's ``SamplingMetadata`` (or ours).
            seed, offset: optional per-request ``[B]`` int64 (or int) Philox keys.
            token_bitmask: optional grammar bitmask, one ``ceil(V/32)`` int32 row per
                ``logits`` row (xgrammar's layout), read in the kernel's pass.

        Returns:
            vLLM's ``SamplerOutput``: ``sampled_token_ids [B, max_spec_len + 1]`` int32 (the
            accepted drafts, a correction or bonus token, then -1) and ``logprobs_tensors``.
        """
        step = _parse_step(metadata, draft_probs, logits, sampling_metadata, token_bitmask)
        if self.validate:
            _check_values(step, metadata, logits, sampling_metadata, offset)
        want_logprobs = step.max_num_logprobs is not None
        # Without a sampler we fuse what we can (unknown processors are ignored, as vLLM
        # ignores them on draft rows); with one, only a batch that uses nothing else.
        fuse = self.fused_bonus and step.has_bonus_rows and (
            self.sampler is None or _fusable(sampling_metadata))
        if not fuse and self.sampler is None:
            raise ValueError("sampler: None needs the bonus rows in logits (vLLM's runner "
                             "layout) to sample the bonus tokens in our kernel")
        seeds = _request_seeds(sampling_metadata, seed, step.batch, logits.device)

        bonus_output = None
        if not fuse:  # vLLM's call, so every feature of its sampler applies to the bonus
            bonus_output = self.sampler(
                logits=logits[metadata.bonus_logits_indices],
                sampling_metadata=_replace(sampling_metadata,
                                           max_num_logprobs=-1 if want_logprobs else None),
                predict_bonus_token=True,
                logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode
                else "raw_logits")

        rows, bitmask = _packed_rows(step, metadata, logits, token_bitmask)
        raw_rows = None
        if want_logprobs and not self.is_processed_logprobs_mode:
            raw_rows = rows.float().clone() if step.has_processors else rows
        rows = _apply_sampling_features(rows, step, sampling_metadata, bonus=fuse)

        params = _sampling_params(sampling_metadata, step.batch)
        draft_ids = _stand_ins_for_invalid_drafts(step, rows, draft_probs, sampling_metadata)
        out = verify_chain_packed(
            rows, draft_ids, step.cu_exclusive, max_draft_tokens=step.max_spec_len,
            draft_probs=draft_probs, token_bitmask=bitmask, seed=seeds, offset=offset,
            method=self.method, backend=self.backend, validate=False, **params)
        tokens = out.output_token_ids
        if not fuse:
            bonus = bonus_output.sampled_token_ids.reshape(-1)
            if bonus.shape[0] != step.batch:
                raise ValueError(f"sampler: expected {step.batch} bonus tokens (one per "
                                 f"request), got shape {list(bonus_output.sampled_token_ids.shape)}")
            columns = torch.arange(step.max_spec_len + 1, device=tokens.device)
            all_accepted = out.num_accepted == step.num_drafts_device
            at_bonus = (columns[None, :] == step.num_drafts_device[:, None]) & all_accepted[:, None]
            tokens = torch.where(at_bonus, bonus.to(tokens.device, torch.int32)[:, None], tokens)

        logprobs_tensors = None
        if want_logprobs:
            bonus_logits = None
            if bonus_output is not None and getattr(bonus_output, "logprobs_tensors", None) \
                    is not None:
                bonus_logits = bonus_output.logprobs_tensors.logprobs
            logprobs_tensors = self._logprobs_tensors(step, rows, raw_rows, bitmask, params,
                                                      tokens, bonus_logits)
        output_class, _ = _vllm_types()
        return output_class(sampled_token_ids=tokens, logprobs_tensors=logprobs_tensors)

    def _logprobs_tensors(self, step, rows, raw_rows, bitmask, params, tokens, bonus_logits):
        """vLLM's ``_get_logprobs_tensors`` on our rows: one slot per output position."""
        slot_rows = step.slot_rows_device  # [B*(K+1)] the row each slot was emitted at
        if self.is_processed_logprobs_mode:
            scores = _processed_logits(rows, slot_rows, step, bitmask, params)
        else:
            scores = raw_rows[slot_rows].float()
        if bonus_logits is not None and step.bonus_slots:
            slots = torch.tensor(step.bonus_slots, dtype=torch.int64).to(scores.device,
                                                                         non_blocking=True)
            requests = torch.tensor(step.bonus_slot_requests, dtype=torch.int64).to(
                scores.device, non_blocking=True)
            scores = scores.index_copy(0, slots, bonus_logits.float()[requests])
        logprobs = scores if self.is_logits_logprobs_mode else scores.log_softmax(-1)
        token_ids = tokens.reshape(-1).to(torch.int64)
        token_ids = torch.where(token_ids == PLACEHOLDER_TOKEN_ID, 0, token_ids)
        return gather_logprobs(logprobs, step.max_num_logprobs, token_ids)

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int,
                     discard_req_indices: Sequence[int] = (),
                     logprobs_tensors=None):
        """vLLM's ``parse_output``: each request's emitted tokens (host lists) and, with
        ``logprobs_tensors``, their ``LogprobsLists`` (placeholders filtered out)."""
        ids = output_token_ids.cpu().numpy()
        valid = (ids != PLACEHOLDER_TOKEN_ID) & (ids < vocab_size)
        output_logprobs = None
        if logprobs_tensors is not None:
            cu_num_tokens = [0] + valid.sum(axis=1).cumsum().tolist()
            filtered = logprobs_tensors.filter(torch.from_numpy(valid.flatten()))
            output_logprobs = filtered.tolists(cu_num_tokens)
        if len(discard_req_indices) > 0:
            valid[list(discard_req_indices)] = False
        return [row[valid[i]].tolist() for i, row in enumerate(ids)], output_logprobs


def rejection_sample(metadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                     sampling_metadata, *, seed=None, offset=None,
                     token_bitmask: Optional[torch.Tensor] = None, backend: str = "auto",
                     validate: bool = True, method: str = "standard") -> torch.Tensor:
    r"""The whole step with the bonus fused (no ``Sampler``): vLLM's runner layout in,
    ``[B, max_spec_len + 1]`` int32 token ids out (``-1`` placeholders).

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
    config = _MethodConfig(method)
    sampler = RejectionSampler(None, config, fused_bonus=True, backend=backend,
                               validate=validate)
    return sampler(metadata, draft_probs, logits, sampling_metadata, seed=seed, offset=offset,
                   token_bitmask=token_bitmask).sampled_token_ids


@dataclass
class _MethodConfig:
    rejection_sample_method: str = "standard"


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """vLLM's ``Sampler.gather_logprobs``: the token's logprob and rank, then the top ``n``."""
    topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
    token_ids = token_ids[:, None]
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    _, logprobs_class = _vllm_types()
    return logprobs_class(torch.cat((token_ids, topk_indices), dim=1).to(torch.int32),
                          torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)


# --------------------------------------------------------------------------------------------
# Parsing (host only: Python values and tensor shapes)

class _Step(NamedTuple):
    batch: int
    num_draft_tokens: list
    max_spec_len: int
    num_packed: int                  # T
    draft_token_ids: torch.Tensor
    cu_exclusive: torch.Tensor       # [B+1] on the device, from the host list
    num_drafts_device: torch.Tensor  # [B] int64
    in_place: bool                   # logits is vLLM's [T+B, V] runner layout
    has_bonus_rows: bool
    vocab: int
    row_request: list                # per packed row
    row_position: list
    slot_rows_device: Optional[torch.Tensor]
    bonus_slots: list
    bonus_slot_requests: list
    max_num_logprobs: Optional[int]
    has_processors: bool


def _parse_step(metadata, draft_probs, logits, sampling_metadata, token_bitmask) -> _Step:
    """Every check the step needs, on Python values and shapes only (no device read)."""
    if metadata is None or not all(hasattr(metadata, name) for name in (
            "draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens",
            "target_logits_indices", "bonus_logits_indices")):
        raise TypeError(f"metadata: expected vLLM's SpecDecodeMetadata (draft_token_ids, "
                        f"num_draft_tokens, cu_num_draft_tokens, target_logits_indices, "
                        f"bonus_logits_indices), got {type(metadata).__name__}")
    if sampling_metadata is None or not hasattr(sampling_metadata, "all_greedy"):
        raise TypeError(f"sampling_metadata: expected vLLM's SamplingMetadata, "
                        f"got {type(sampling_metadata).__name__}")
    _params.check_tensor(logits, "logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = logits.device
    vocab = logits.shape[1]
    num_draft_tokens = _host_counts(metadata.num_draft_tokens, "num_draft_tokens")
    batch = len(num_draft_tokens)
    num_packed = sum(num_draft_tokens)
    max_spec_len = max(num_draft_tokens, default=0)
    declared = getattr(metadata, "max_spec_len", max_spec_len)
    if isinstance(declared, bool) or not isinstance(declared, numbers.Integral) \
            or int(declared) != max_spec_len:
        raise ValueError(f"max_spec_len: expected max(num_draft_tokens) = {max_spec_len}, "
                         f"got {declared!r}")
    if max_spec_len > MAX_SPEC_LEN:
        raise ValueError(f"num_draft_tokens: expected at most MAX_SPEC_LEN = {MAX_SPEC_LEN} "
                         f"drafts per request, got {max_spec_len}")
    draft_token_ids = metadata.draft_token_ids
    _params.check_tensor(draft_token_ids, "draft_token_ids", ndim=1,
                         dtypes=_params.INDEX_DTYPES, device=device)
    if draft_token_ids.shape[0] != num_packed:
        raise ValueError(f"draft_token_ids: expected sum(num_draft_tokens) = {num_packed} "
                         f"ids, got {draft_token_ids.shape[0]}")
    cu = metadata.cu_num_draft_tokens
    _params.check_tensor(cu, "cu_num_draft_tokens", ndim=1, dtypes=_params.INDEX_DTYPES)
    if cu.shape[0] != batch:
        raise ValueError(f"cu_num_draft_tokens: expected {batch} entries (one per request, "
                         f"as num_draft_tokens), got {cu.shape[0]}")
    target_indices, bonus_indices = metadata.target_logits_indices, metadata.bonus_logits_indices
    for name, index, sizes in (("target_logits_indices", target_indices, (num_packed,)),
                               ("bonus_logits_indices", bonus_indices, (batch, 0))):
        _params.check_tensor(index, name, ndim=1, dtypes=_params.INDEX_DTYPES)
        if index.shape[0] not in sizes:
            raise ValueError(f"{name}: expected {' or '.join(map(str, sizes))} entries, "
                             f"got {index.shape[0]}")
    has_bonus_rows = bonus_indices.shape[0] == batch
    in_place = has_bonus_rows and logits.shape[0] == num_packed + batch
    if draft_probs is not None:
        _params.check_tensor(draft_probs, "draft_probs", ndim=2,
                             dtypes=_params.LOGIT_DTYPES + (torch.float64,), device=device)
        if list(draft_probs.shape) != [num_packed, vocab]:
            raise ValueError(f"draft_probs: expected shape [T, V] = [{num_packed}, {vocab}], "
                             f"got {list(draft_probs.shape)}")
    if token_bitmask is not None:
        _params.check_token_bitmask(token_bitmask, [logits.shape[0]], vocab, device,
                                    "[rows of logits, ceil(V/32)]")
    _check_sampling(sampling_metadata, batch, vocab, device)
    max_num_logprobs = getattr(sampling_metadata, "max_num_logprobs", None)
    if max_num_logprobs is not None and (isinstance(max_num_logprobs, bool) or not isinstance(
            max_num_logprobs, numbers.Integral) or not 0 <= max_num_logprobs <= vocab):
        raise ValueError(f"max_num_logprobs: expected None or an int in [0, {vocab}], "
                         f"got {max_num_logprobs!r}")

    row_request, row_position = [], []
    for b, n in enumerate(num_draft_tokens):
        row_request += [b] * (n + 1)
        row_position += list(range(n + 1))
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    cu_exclusive = _to_device(starts, device)
    num_drafts_device = _to_device(num_draft_tokens, device)
    slot_rows_device, bonus_slots, bonus_slot_requests = None, [], []
    if max_num_logprobs is not None:
        slot_rows = []
        for b, n in enumerate(num_draft_tokens):
            for j in range(max_spec_len + 1):
                slot_rows.append(starts[b] + b + min(j, n))
                if j == n:
                    bonus_slots.append(b * (max_spec_len + 1) + j)
                    bonus_slot_requests.append(b)
        slot_rows_device = _to_device(slot_rows, device)
    return _Step(batch, num_draft_tokens, max_spec_len, num_packed, draft_token_ids,
                 cu_exclusive, num_drafts_device, in_place, has_bonus_rows, vocab,
                 row_request, row_position, slot_rows_device, bonus_slots,
                 bonus_slot_requests, max_num_logprobs, _has_processors(sampling_metadata))


def _check_values(step: _Step, metadata, logits, sm, offset) -> None:
    """``validate=True``: the device values too (a synchronisation): draft ids in ``[-1, V)``,
    vLLM's runner layout (or in-range indices), the sampling parameters' ranges."""
    device = logits.device
    ids = step.draft_token_ids.to(torch.int64)
    bad = (ids < PLACEHOLDER_TOKEN_ID) | (ids >= step.vocab)
    if bool(bad.any()):
        t = _params.first_true(bad)
        raise ValueError(f"draft_token_ids: expected ids in [0, {step.vocab}) or -1 (a "
                         f"rejected draft), got {int(ids[t])} at [{t}]")
    rows = logits.shape[0]
    starts = step.cu_exclusive.tolist()
    cu = metadata.cu_num_draft_tokens.to(torch.int64).tolist()
    if cu != starts[1:]:
        raise ValueError(f"cu_num_draft_tokens: expected the inclusive sums of "
                         f"num_draft_tokens {starts[1:]}, got {cu}")
    for name in ("target_logits_indices", "bonus_logits_indices"):
        index = getattr(metadata, name).to(torch.int64)
        if step.in_place:
            want = [r for r, (b, j) in enumerate(zip(step.row_request, step.row_position))
                    if (j < step.num_draft_tokens[b]) == (name == "target_logits_indices")]
            if index.tolist() != want:
                raise ValueError(f"{name}: expected vLLM's layout for num_draft_tokens "
                                 f"{step.num_draft_tokens} (each request's draft rows, then "
                                 f"its bonus row), {want}, got {index.tolist()}")
        elif index.numel() and bool(((index < 0) | (index >= rows)).any()):
            raise ValueError(f"{name}, cu_num_draft_tokens: expected row indices in "
                             f"[0, {rows}) (logits has {rows} rows), got {index.tolist()}")
    params = _sampling_params(sm, step.batch)
    _params.sampling_params(params["temperature"], params["top_k"], params["top_p"],
                            batch=step.batch, vocab_size=step.vocab, device=device,
                            validate=True, min_p=params["min_p"])
    _params.per_request(_params._as_int64(offset, "offset"), "offset", step.batch, device,
                        torch.int64, 0)


def _host_counts(values, name: str) -> list:
    """A host list of non-negative Python ints (vLLM's ``num_draft_tokens``)."""
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a list of Python ints (one per request), "
                        f"got {type(values).__name__}")
    counts = []
    for b, n in enumerate(values):
        if type(n) is int and n >= 0:  # the common case, cheaply
            counts.append(n)
            continue
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name}: expected Python ints, got {n!r} "
                            f"({type(n).__name__}) for request {b}")
        if n < 0:
            raise ValueError(f"{name}: expected counts >= 0, got {n} for request {b}")
        counts.append(int(n))
    return counts


def _check_sampling(sm, batch: int, vocab: int, device) -> None:
    temperature = getattr(sm, "temperature", None)
    if temperature is None:
        if not getattr(sm, "all_greedy", False):
            raise ValueError("temperature: expected a [B] tensor unless all_greedy, got None")
    else:
        _check_per_request(temperature, "temperature", batch, device)
    for name in ("top_k", "top_p", "min_p"):
        value = getattr(sm, name, None)
        if value is not None:
            _check_per_request(value, name, batch, device)
    generators = getattr(sm, "generators", None) or {}
    if not isinstance(generators, dict):
        raise TypeError(f"generators: expected a dict batch index -> torch.Generator, "
                        f"got {type(generators).__name__}")
    for index, generator in generators.items():
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) \
                or not 0 <= index < batch:
            raise ValueError(f"generators: expected batch indices in [0, {batch}), "
                             f"got {index!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generators: expected torch.Generator values, got "
                            f"{type(generator).__name__} at batch index {index}")
    penalised = not getattr(sm, "no_penalties", True)
    bad_words = getattr(sm, "bad_words_token_ids", None) or {}
    if penalised or bad_words:
        spec = getattr(sm, "spec_token_ids", None)
        output = getattr(sm, "output_token_ids", None)
        for name, lists in (("spec_token_ids", spec), ("output_token_ids", output)):
            if lists is None or isinstance(lists, torch.Tensor) or len(lists) < batch:
                raise ValueError(f"{name}: expected one host list per request ({batch}) for "
                                 f"penalties and bad words, got {type(lists).__name__}"
                                 + ("" if lists is None else f" of length {len(lists)}"))
    if penalised:
        if getattr(sm, "prompt_token_ids", None) is None:
            raise ValueError("prompt_token_ids: expected a [B, P] tensor with penalties, "
                             "got None")
        for name in ("frequency_penalties", "presence_penalties", "repetition_penalties"):
            _check_per_request(getattr(sm, name, None), name, batch, device)
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None:
        _params.check_tensor(mask, "allowed_token_ids_mask", ndim=2, dtypes=(torch.bool,),
                             device=device)
        if mask.shape[0] < batch or mask.shape[1] != vocab:
            raise ValueError(f"allowed_token_ids_mask: expected shape [>= {batch}, {vocab}], "
                             f"got {list(mask.shape)}")


def _check_per_request(value, name: str, batch: int, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a [B] tensor, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {value.device}")
    if value.reshape(-1).shape[0] < batch:
        raise ValueError(f"{name}: expected {batch} entries (one per request), "
                         f"got shape {list(value.shape)}")


def _to_device(values: list, device, dtype=torch.int64) -> torch.Tensor:
    """A host list on ``device`` without waiting (pinned staging where CUDA is involved)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _replace(sampling_metadata, **changes):
    if dataclasses.is_dataclass(sampling_metadata):
        return dataclasses.replace(sampling_metadata, **changes)
    clone = copy.copy(sampling_metadata)
    for name, value in changes.items():
        setattr(clone, name, value)
    return clone


# --------------------------------------------------------------------------------------------
# The sampling features on the packed rows

def _processors(sm, kind: str) -> list:
    return list(getattr(getattr(sm, "logitsprocs", None), kind, None) or ())


def _is_min_tokens(p) -> bool:
    return hasattr(p, "min_toks") and hasattr(p, "apply_with_spec_decode")


def _is_logit_bias(p) -> bool:
    return isinstance(getattr(p, "biases", None), dict)


def _is_min_p(p) -> bool:
    return hasattr(p, "min_p_count") and hasattr(p, "min_p")


def _thinking_budget(sm):
    holder = getattr(sm, "thinking_budget_state_holder", None)
    return holder if holder is not None and holder.has_tracked_requests() else None


def _has_processors(sm) -> bool:
    return bool(not getattr(sm, "no_penalties", True)
                or getattr(sm, "allowed_token_ids_mask", None) is not None
                or getattr(sm, "bad_words_token_ids", None)
                or any(_is_min_tokens(p) and p.min_toks or _is_logit_bias(p) and p.biases
                       for p in _processors(sm, "non_argmax_invariant"))
                or _thinking_budget(sm) is not None)


def _fusable(sm) -> bool:
    """Whether every feature this batch uses for its bonus token is one we fuse."""
    if getattr(sm, "logprob_token_ids", None) or _thinking_budget(sm) is not None:
        return False
    if not all(_is_min_tokens(p) or _is_logit_bias(p)
               for p in _processors(sm, "non_argmax_invariant")):
        return False
    return all(_is_min_p(p) for p in _processors(sm, "argmax_invariant"))


def _packed_rows(step: _Step, metadata, logits, token_bitmask):
    """``logits`` itself in vLLM's runner layout; otherwise its rows gathered into it."""
    if step.in_place:
        return logits, token_bitmask
    device = logits.device
    target_rows = [r for r, j in enumerate(step.row_position)
                   if j < step.num_draft_tokens[step.row_request[r]]]
    bonus_rows = [r for r, j in enumerate(step.row_position)
                  if j == step.num_draft_tokens[step.row_request[r]]]
    target_rows, bonus_rows = _to_device(target_rows, device), _to_device(bonus_rows, device)
    sources = [(target_rows, metadata.target_logits_indices.to(device, torch.int64))]
    if step.has_bonus_rows:
        sources.append((bonus_rows, metadata.bonus_logits_indices.to(device, torch.int64)))

    def gather(x):
        packed = x.new_zeros((step.num_packed + step.batch,) + tuple(x.shape[1:]))
        if x is token_bitmask:
            packed.fill_(-1)  # rows without a source allow every token
        for rows, source in sources:
            packed.index_copy_(0, rows, x[source])
        return packed
    return gather(logits), None if token_bitmask is None else gather(token_bitmask)


def _apply_sampling_features(rows: torch.Tensor, step: _Step, sm, *, bonus: bool) -> torch.Tensor:
    """vLLM's sampling features on the draft rows (and the bonus rows when ``bonus``), each row
    with its draft-aware history, in place. In the order of vLLM's ``Sampler``."""
    if not step.has_processors:
        return rows
    if rows.dtype != torch.float32:
        rows = rows.float()  # vLLM processes float32 logits; a copy, as vLLM's
    device, vocab = rows.device, rows.shape[1]
    spec = getattr(sm, "spec_token_ids", None) or []
    output = getattr(sm, "output_token_ids", None) or []
    # Rows that get the features: (packed row, request, position, history).
    live = [(r, b, j) for r, (b, j) in enumerate(zip(step.row_request, step.row_position))
            if j < step.num_draft_tokens[b] or bonus]

    def history(b, j):
        return row_history(output, spec, b, j)

    # Per packed row: its request and whether it gets the features (elementwise ops over
    # all rows with neutral values elsewhere: in place, no gathered copy of the rows).
    is_live = _to_device([j < step.num_draft_tokens[b] or bonus
                          for b, j in zip(step.row_request, step.row_position)], device,
                         torch.bool)
    all_requests = _to_device(step.row_request, device)
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None and live:
        rows.masked_fill_(mask[all_requests] & is_live[:, None], float("-inf"))

    bad_words = getattr(sm, "bad_words_token_ids", None) or {}
    if bad_words:
        banned_rows, banned_tokens = [], []
        for r, b, j in live:
            words = bad_words.get(b)
            if not words:
                continue
            past = history(b, j)
            for word in words:
                prefix = len(word) - 1
                if prefix > len(past):
                    continue
                if prefix == 0 or list(past[-prefix:]) == list(word[:prefix]):
                    banned_rows.append(r)
                    banned_tokens.append(word[-1])
        if banned_rows:
            rows.index_put_((_to_device(banned_rows, device), _to_device(banned_tokens, device)),
                            torch.tensor(float("-inf"), device=device))

    for processor in _processors(sm, "non_argmax_invariant"):
        if _is_min_tokens(processor) and processor.min_toks:
            _apply_min_tokens(rows, processor.min_toks, live, device)
        elif _is_logit_bias(processor) and processor.biases:
            biased_rows, biased_tokens, biases = [], [], []
            for r, b, _ in live:
                for token, bias in (processor.biases.get(b) or {}).items():
                    biased_rows.append(r)
                    biased_tokens.append(token)
                    biases.append(bias)
            if biased_rows:
                rows.index_put_((_to_device(biased_rows, device),
                                 _to_device(biased_tokens, device)),
                                _to_device(biases, device, torch.float32), accumulate=True)

    if not getattr(sm, "no_penalties", True) and live:
        _apply_penalties(rows, sm, step, bonus, is_live, all_requests, history, vocab)

    holder = _thinking_budget(sm)
    if holder is not None:  # vLLM's own code on the draft rows (a gathered copy)
        drafts = [r for r, b, j in live if j < step.num_draft_tokens[b]]
        if drafts:
            index = _to_device(drafts, device)
            updated = holder.apply_to_logits(rows[index], predict_bonus_token=False,
                                             spec_token_ids=getattr(sm, "spec_token_ids", None))
            rows.index_copy_(0, index, updated)
    return rows


def row_history(output_token_ids, spec_token_ids, request: int, position: int) -> list:
    """The output a token generated at ``position`` of ``request``'s chain follows: its
    output so far, then its drafts ``1..position`` (vLLM's ``_combine_outputs_with_spec_tokens``
    for draft rows; the bonus row, position ``n``, follows every draft)."""
    past = list(output_token_ids[request]) if request < len(output_token_ids) else []
    if request < len(spec_token_ids):
        past += list(spec_token_ids[request][:position])
    return past


def _stand_ins_for_invalid_drafts(step: _Step, rows, draft_probs, sm) -> torch.Tensor:
    """The draft ids the kernel verifies. A ``-1`` draft replaced a grammar-invalid token ``x``
    that the drafter sampled from ``q``; its exact correction is the residual
    ``max(p - q, 0)``, what rejecting ``x`` (``p(x) = 0``) gives. With ``draft_probs``, the
    first ``-1`` of a request (known from the host list ``spec_token_ids``) becomes a token
    of its row with logit ``-inf`` (surely rejected, same residual); a row without one keeps
    ``-1`` (the kernel then samples ``p``). One-hot drafters need nothing: their residual
    is ``p``. Device ops on the few rows concerned, no synchronisation."""
    spec = getattr(sm, "spec_token_ids", None)
    if draft_probs is None or not isinstance(spec, (list, tuple)) or len(spec) < step.batch:
        return step.draft_token_ids
    packed, packed_rows, start = [], [], 0
    for b, n in enumerate(step.num_draft_tokens):
        drafts = list(spec[b])[:n]
        if PLACEHOLDER_TOKEN_ID in drafts:
            j = drafts.index(PLACEHOLDER_TOKEN_ID)
            packed.append(start + j)
            packed_rows.append(start + b + j)
        start += n
    if not packed:
        return step.draft_token_ids
    device = rows.device
    lowest, token = rows[_to_device(packed_rows, device)].float().min(-1)
    stand_in = torch.where(torch.isneginf(lowest), token, PLACEHOLDER_TOKEN_ID)
    ids = step.draft_token_ids.clone()
    ids[_to_device(packed, device)] = stand_in.to(ids.dtype)
    return ids


def _apply_min_tokens(rows, min_toks: dict, live, device) -> None:
    """Stop tokens masked at position ``j`` while ``len(output) + j < min_tokens``; for
    structured-output requests restored where masking would leave no token (vLLM's rule)."""
    masked_rows, masked_tokens, restore_rows, restore_tokens = [], [], [], []
    for r, b, j in live:
        entry = min_toks.get(b)
        if entry is None:
            continue
        minimum, past, stop = entry[0], entry[1], entry[2]
        structured = bool(entry[3]) if len(entry) > 3 else False
        if len(past) + j >= minimum or not stop:
            continue
        for token in stop:
            masked_rows.append(r)
            masked_tokens.append(token)
            if structured:
                restore_rows.append(r)
                restore_tokens.append(token)
    if not masked_rows:
        return
    restore = None
    if restore_rows:
        restore = (_to_device(restore_rows, device), _to_device(restore_tokens, device))
        saved = rows[restore]
    rows.index_put_((_to_device(masked_rows, device), _to_device(masked_tokens, device)),
                    torch.tensor(float("-inf"), device=device))
    if restore is not None:
        empty = torch.isneginf(rows[restore[0]]).all(-1)
        rows.index_put_(restore, torch.where(empty & torch.isfinite(saved), saved,
                                             rows[restore]))


def _apply_penalties(rows, sm, step: _Step, bonus: bool, is_live, all_requests, history,
                     vocab) -> None:
    """vLLM's ``apply_penalties`` arithmetic (repetition scaling, then frequency and presence),
    each live row with its draft-aware output history, in place over all rows (the others get
    neutral values: a factor of 1, penalties of 0, exact)."""
    device = rows.device
    pasts = [[vocab if t == -1 else int(t) for t in history(b, j)]
             if j < step.num_draft_tokens[b] or bonus else []
             for b, j in zip(step.row_request, step.row_position)]
    width = max(1, max((len(p) for p in pasts), default=0))
    output = _to_device([p + [vocab] * (width - len(p)) for p in pasts], device)
    prompt = sm.prompt_token_ids.to(device, torch.int64)[all_requests]
    prompt = torch.where(is_live[:, None], prompt, vocab)

    def counts(tokens):
        bins = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.int32, device=device)
        bins.scatter_add_(1, tokens.clamp(0, vocab), torch.ones_like(tokens, dtype=torch.int32))
        return bins[:, :vocab]
    output_counts = counts(output)
    output_mask = output_counts > 0
    prompt_mask = counts(prompt) > 0

    def per_row(name, neutral):
        value = getattr(sm, name).reshape(-1).to(device, torch.float32)[all_requests]
        return torch.where(is_live, value, neutral)[:, None]
    penalties = torch.where(prompt_mask | output_mask, per_row("repetition_penalties", 1.0), 1.0)
    rows.mul_(torch.where(rows > 0, 1.0 / penalties, penalties))
    rows.sub_(per_row("frequency_penalties", 0.0) * output_counts)
    rows.sub_(per_row("presence_penalties", 0.0) * output_mask)


# --------------------------------------------------------------------------------------------
# Parameters and seeds

def _sampling_params(sm, batch: int) -> dict:
    temperature = getattr(sm, "temperature", None)
    if getattr(sm, "all_greedy", False) or temperature is None:
        temperature = 0.0
    else:  # vLLM's greedy rows: temperature 0 (or below its epsilon)
        temperature = temperature.reshape(-1)[:batch]
        temperature = torch.where(temperature < _SAMPLING_EPS,
                                  torch.zeros_like(temperature), temperature)

    def first(name):
        value = getattr(sm, name, None)
        return None if value is None else value.reshape(-1)[:batch]
    return dict(temperature=temperature, top_k=first("top_k"), top_p=first("top_p"),
                min_p=_min_p(sm, batch))


def _min_p(sm, batch: int) -> Optional[torch.Tensor]:
    """``min_p`` from the field (ours) or vLLM's ``MinPLogitsProcessor``."""
    min_p = getattr(sm, "min_p", None)
    if min_p is not None:
        return min_p.reshape(-1)[:batch]
    for processor in _processors(sm, "argmax_invariant"):
        if _is_min_p(processor):
            # Its [B, 1] slice is current only while some request uses min_p.
            return processor.min_p.reshape(-1)[:batch] if processor.min_p_count else None
    return None


def _request_seeds(sm, seed, batch: int, device):
    """``seed`` if given; else one seed per request, from its own generator where vLLM has
    one (seeded requests) and from the device's default generator otherwise -- drawn by the
    op once it has checked its arguments (``DeferredSeeds``): a rejected call advances no
    generator, and nothing is read back to the host."""
    if seed is not None:
        return seed
    generators = getattr(sm, "generators", None) or {}

    def draw() -> torch.Tensor:
        seeds = torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=device)
        for index, generator in generators.items():
            seeds[index:index + 1] = seeds_from_generator(generator, 1, device)
        return seeds
    return _params.DeferredSeeds(draw)


def _processed_logits(rows, slot_rows, step: _Step, bitmask, params) -> torch.Tensor:
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


_keep_vllm_class()
