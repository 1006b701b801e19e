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
  from ``spec_token_ids``, stands for a token its row forbids: a ``-inf`` logit or a 0 bit of
  ``token_bitmask``); without, a sample of ``p``.
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
* Every check runs before the first write: the op's own host checks (parameter dtypes and
  shapes, ``seed``, ``offset``), the features' token ids and the histories are checked before
  the features are written into ``logits``, before the bonus ``Sampler`` runs and before any
  generator advances; a rejected call changes nothing.

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

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ... import _backend
from ...chain import verify_chain_packed
from . import _delegate
from ._features import apply_sampling_features, stand_ins_for_invalid_drafts
from ._layout import (check_op_arguments, check_values, fusable, packed_rows, parse_step,
                      replace, request_seeds, step_params)
from ._logprobs import LOGITS_MODES, PROCESSED_LOGPROBS_MODES
from ._logprobs import logprobs_tensors as logprobs_tensors_of
from ._types import PLACEHOLDER_TOKEN_ID, vllm_types

__all__ = ["RejectionSampler", "rejection_sample"]

_OUR_METHODS = {None: "token", "standard": "token", "block": "block"}
_VLLM_ONLY_METHODS = ("fly", "synthetic")
_VLLM_MODULE = "vllm.v1.sample.rejection_sampler"
_vllm_class_kept: list = []  # a strong reference: after the swap nothing else holds it


def _vllm_rejection_sampler_class():
    """vLLM's own ``RejectionSampler`` class, found even after the swap line replaced the
    module attribute with ours; None without vLLM."""
    try:
        return _delegate.own_class(_VLLM_MODULE, _vllm_class_kept, torch.nn.Module)
    except ImportError:
        return None


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
        if not isinstance(backend, str) or backend not in _backend.BACKENDS:
            raise ValueError(f"backend: expected one of {_backend.BACKENDS}, got {backend!r}")
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
        self.is_logits_logprobs_mode = self.logprobs_mode in LOGITS_MODES

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
        # Every check first: nothing is written to logits, the Sampler does not run and no
        # generator advances for a call that is then rejected.
        step = parse_step(metadata, draft_probs, logits, sampling_metadata, token_bitmask)
        params = step_params(sampling_metadata, step.batch)
        check_op_arguments(params, seed, offset, step.batch, step.vocab, logits.device)
        if self.validate:
            check_values(step, metadata, logits, sampling_metadata, offset, params)
        want_logprobs = step.max_num_logprobs is not None
        # Without a sampler we fuse what we can (unknown processors are ignored, as vLLM
        # ignores them on draft rows); with one, only a batch that uses nothing else.
        fuse = self.fused_bonus and step.has_bonus_rows and (
            self.sampler is None or fusable(sampling_metadata))
        if not fuse and self.sampler is None:
            raise ValueError("sampler: None needs the bonus rows in logits (vLLM's runner "
                             "layout) to sample the bonus tokens in our kernel")
        seeds = request_seeds(sampling_metadata, seed, step.batch, logits.device)

        bonus_output = None
        if not fuse:  # vLLM's call, so every feature of its sampler applies to the bonus
            bonus_output = self.sampler(
                logits=logits[metadata.bonus_logits_indices],
                sampling_metadata=replace(sampling_metadata,
                                          max_num_logprobs=-1 if want_logprobs else None),
                predict_bonus_token=True,
                logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode
                else "raw_logits")

        rows, bitmask = packed_rows(step, metadata, logits, token_bitmask)
        raw_rows = None
        if want_logprobs and not self.is_processed_logprobs_mode:
            raw_rows = rows.float().clone() if step.has_processors else rows
        rows = apply_sampling_features(rows, step, sampling_metadata, bonus=fuse)

        draft_ids = stand_ins_for_invalid_drafts(step, rows, draft_probs, sampling_metadata,
                                                 bitmask)
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
            logprobs_tensors = logprobs_tensors_of(step, rows, raw_rows, bitmask, params,
                                                   tokens, bonus_logits,
                                                   mode=self.logprobs_mode)
        output_class, _ = vllm_types()
        return output_class(sampled_token_ids=tokens, logprobs_tensors=logprobs_tensors)

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
    key = (method, backend, validate) if type(method) is str and type(backend) is str \
        and type(validate) is bool else None
    sampler = _SAMPLERS.get(key)
    if sampler is None:  # built once per configuration (a module's construction costs)
        sampler = RejectionSampler(None, _MethodConfig(method), fused_bonus=True,
                                   backend=backend, validate=validate)
        if key is not None:
            _SAMPLERS[key] = sampler
    return sampler(metadata, draft_probs, logits, sampling_metadata, seed=seed, offset=offset,
                   token_bitmask=token_bitmask).sampled_token_ids


_SAMPLERS: dict = {}  # rejection_sample's samplers by (method, backend, validate)


@dataclass
class _MethodConfig:
    rejection_sample_method: str = "standard"


_delegate.keep_own_class(_VLLM_MODULE, _vllm_class_kept)
