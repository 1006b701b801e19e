"""vLLM 0.34.0's MRV2 verification (``vllm/v1/worker/gpu/spec_decode/``), exact.

In vLLM 0.34.0 the model runner V2 is the only runner that verifies drafts (the V1
``vllm/v1/sample/rejection_sampler.py`` is gone). What changed from 0.33.0 (:mod:`.mrv2_0_33`):
the drafter's rows come in a ``DraftLogitsCache``, ``skip_masked_vocab_blocks`` is new,
``_verify`` lost ``verify_draft_sampled`` and ``__call__`` lost ``invalid_drafts``.

* :func:`rejection_sample` has the signature and outputs of 0.34.0's
  ``rejection_sampler_utils.rejection_sample``: ``target_logits [num_logits, V]`` (processed
  by MRV2's sampler), request ``i``'s rows ``cu_num_logits[i] .. cu_num_logits[i+1]-1`` (its
  drafts' rows, then its bonus row), the draft of row ``r`` at ``draft_sampled[r + 1]``
  (``-1``: a placeholder, rejected), ``draft_logits_cache`` None (one-hot drafts) or a
  ``DraftLogitsCache``: ``.values [rows, K, V']`` pre-temperature, request ``i``'s draft ``j``
  at ``values[row, j]`` with ``row = idx_mapping[i]`` (replicated, ``.row_mapping`` None) or
  ``row = row_mapping[idx_mapping[i]]`` (sharded: only this rank's requests). ``temperature``
  / ``seed`` ``[max_num_reqs]`` (0 = greedy). Returns ``(sampled [num_reqs, K+1] int64,
  num_sampled [num_reqs] int32)``: the accepted drafts, the correction or bonus token, then
  ``-1`` (vLLM leaves those slots unwritten). A row with no finite logit (all ``-inf`` or NaN)
  emits token 0 there, what vLLM's kernels write (it never emits ``-1`` as a token). A smaller draft vocabulary ``V' < V`` (a padded
  target head) verifies over the first ``V'`` tokens, as vLLM does.
  Law: the target's ``softmax(target_logits)``, the drafter's ``softmax(values / temperature)``.
  ``use_block_verification=True`` is our block verification (a placeholder ends the block).
  ``use_fp64`` and ``skip_masked_vocab_blocks`` are accepted and change nothing: our
  exponential race is exact in float32 and never draws for a masked token.
* :data:`RejectionSampler` is vLLM 0.34.0's MRV2 class with its verification step (``_verify``)
  calling :func:`rejection_sample`: a subclass of vLLM's own (built on first access, so it needs
  vLLM; without it the name is a class whose constructor raises NotImplementedError).
  Everything else (MRV2's sampler features, chunking, logprobs, the sampling mask, trace
  replay) is vLLM's code. :func:`swap` is docs/engines.md's one line.

vLLM-only modes (``synthetic_conditional_rates``, FLy's ``fly_window_size > 0``, watermarking
``contexts`` / ``watermarking`` / ``watermark_key``) call vLLM's own ``rejection_sample``
(found even after :func:`swap` replaced it) when vLLM is importable, else raise
NotImplementedError naming the argument.

Differences from vLLM 0.34.0, each where ours is exact: randomness is our Philox stream keyed by
``seed[idx_mapping[i]]`` and the request's first position ``pos[cu_num_logits[i]]``, not vLLM's
(same law, other tokens for a given seed); an empty residual ``max(p - q, 0)`` samples ``p``
(vLLM's Gumbel argmax over all ``-inf`` returns token 0 of the block); a sharded request with
no row on this rank (``row_mapping`` ``-1``) has its drafts rejected and samples ``p`` (vLLM
reads row 0, another request's drafter). Everything is read in place (no gathered copy of the
draft rows); no host synchronisation: every index is computed on the device.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Optional

import torch

from ... import _cpu, _params
from ...chain import verify_chain_packed
from .._common import value_checks_wanted
from . import _delegate
from .mrv2_0_33 import _check_indices, mrv2_outputs, packed_layout

__all__ = ["rejection_sample", "RejectionSampler", "swap", "VLLM_VERSION"]

VLLM_VERSION = "0.34.0"
_UTILS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"


def _is_flag(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool too


def rejection_sample(target_logits: torch.Tensor, draft_logits_cache,
                     draft_sampled: torch.Tensor, cu_num_logits: torch.Tensor,
                     pos: torch.Tensor, idx_mapping: torch.Tensor,
                     expanded_idx_mapping: torch.Tensor, expanded_local_pos: torch.Tensor,
                     temperature: torch.Tensor, seed: torch.Tensor,
                     num_speculative_steps: int,
                     synthetic_conditional_rates: Optional[torch.Tensor] = None,
                     use_fp64: bool = False, use_block_verification: bool = False,
                     contexts: Optional[torch.Tensor] = None,
                     watermarking: Optional[torch.Tensor] = None,
                     watermarking_skip_mask: Optional[torch.Tensor] = None,
                     watermark_key: Optional[int] = None, fly_window_size: int = 0,
                     fly_entropy_threshold: float = 0.3, fly_entropy_top_k: int = 3,
                     skip_masked_vocab_blocks: bool = False, *, backend: str = "auto",
                     validate: Optional[bool] = None):
    """vLLM 0.34.0 MRV2's ``rejection_sample`` by our exact kernels (module docstring).

    ``validate`` (ours), as :func:`.mrv2_0_33.rejection_sample`'s: None (default) runs the
    checks that read index values where they cost no synchronisation (CPU tensors, eager);
    True/False force them: ``idx_mapping`` in range of ``temperature``, ``seed`` and the
    cache's slots (``row_mapping``'s, or ``values``' rows when replicated), a sharded
    request's row in ``[-1, rows)``, ``cu_num_logits`` from 0 to the logits rows with ``1 ..
    num_speculative_steps + 1`` rows per request. Skipped, an index past the end is clamped
    (never read out of bounds; that request's tokens are garbage, not an error).

    >>> import torch
    >>> from specdec_kernels.adapters.vllm import mrv2_0_34
    >>> logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0]])  # one draft row, one bonus
    >>> sampled, num_sampled = mrv2_0_34.rejection_sample(
    ...     logits, None, torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([5, 6]),
    ...     torch.tensor([0]), torch.tensor([0, 0]), torch.tensor([0, 1]),
    ...     torch.tensor([0.0]), torch.tensor([7]), 1)
    >>> sampled, num_sampled  # greedy: draft 1 accepted, bonus 2
    (tensor([[1, 2]]), tensor([2], dtype=torch.int32))
    """
    vllm_only = [name for name, used in (
        ("synthetic_conditional_rates", synthetic_conditional_rates is not None),
        ("fly_window_size", not isinstance(fly_window_size, bool)
         and isinstance(fly_window_size, int) and fly_window_size > 0),
        ("contexts", contexts is not None or watermarking is not None
         or watermark_key is not None)) if used]
    if vllm_only:
        try:
            theirs = vllm_rejection_sample()
        except ImportError:
            raise NotImplementedError(
                f"{vllm_only[0]}: a lossy or vLLM-specific mode of vLLM's MRV2 rejection "
                f"sampler; install vLLM {VLLM_VERSION} to delegate to it") from None
        return theirs(
            target_logits, draft_logits_cache, draft_sampled, cu_num_logits, pos,
            idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature, seed,
            num_speculative_steps, synthetic_conditional_rates, use_fp64,
            use_block_verification, contexts, watermarking, watermarking_skip_mask,
            watermark_key, fly_window_size, fly_entropy_threshold, fly_entropy_top_k,
            skip_masked_vocab_blocks)

    _params.check_tensor(target_logits, "target_logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = target_logits.device
    num_logits, vocab = target_logits.shape
    for name, tensor in (("draft_sampled", draft_sampled), ("cu_num_logits", cu_num_logits),
                         ("pos", pos), ("idx_mapping", idx_mapping), ("seed", seed),
                         ("expanded_idx_mapping", expanded_idx_mapping),
                         ("expanded_local_pos", expanded_local_pos)):
        _params.check_tensor(tensor, name, ndim=1, dtypes=_params.INDEX_DTYPES, device=device)
    _params.check_tensor(temperature, "temperature", ndim=1, device=device)
    if isinstance(num_speculative_steps, bool) or not isinstance(num_speculative_steps, int) \
            or num_speculative_steps < 0:
        raise TypeError(f"num_speculative_steps: expected a Python int >= 0, "
                        f"got {num_speculative_steps!r}")
    for name, flag in (("use_fp64", use_fp64), ("use_block_verification",
                                                 use_block_verification),
                       ("skip_masked_vocab_blocks", skip_masked_vocab_blocks)):
        if not _is_flag(flag):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    num_reqs = cu_num_logits.shape[0] - 1
    if num_reqs < 0 or idx_mapping.shape[0] != num_reqs:
        raise ValueError(f"idx_mapping, cu_num_logits: expected num_reqs + 1 = "
                         f"{idx_mapping.shape[0] + 1} offsets, got {cu_num_logits.shape[0]}")
    for name, tensor in (("draft_sampled", draft_sampled), ("pos", pos),
                         ("expanded_idx_mapping", expanded_idx_mapping),
                         ("expanded_local_pos", expanded_local_pos)):
        if tensor.shape[0] != num_logits:
            raise ValueError(f"{name}: expected {num_logits} entries (one per logits row), "
                             f"got {tensor.shape[0]}")
    if num_logits < num_reqs:
        raise ValueError(f"target_logits, cu_num_logits: expected at least one logits row per "
                         f"request (its bonus row), {num_reqs} requests, got {num_logits} rows")
    values, row_mapping = _cache_parts(draft_logits_cache, device, num_speculative_steps)
    slot_sizes = {"temperature": temperature.shape[0], "seed": seed.shape[0]}
    if values is not None:
        slot_sizes["draft_logits_cache"] = values.shape[0] if row_mapping is None else \
            row_mapping.shape[0]
    if num_reqs and min(slot_sizes.values()) < 1:
        raise ValueError(f"{', '.join(slot_sizes)}: expected max_num_reqs >= 1 request slots, "
                         f"got {slot_sizes}")
    if value_checks_wanted(validate, device) and not _cpu.mrv2_indices_ok(
            cu_num_logits, idx_mapping, min(slot_sizes.values(), default=0), num_logits,
            num_speculative_steps, row_mapping, 0 if values is None else values.shape[0]):
        _check_indices(cu_num_logits, idx_mapping, slot_sizes, num_logits, num_speculative_steps)
        if row_mapping is not None:
            _check_rows(row_mapping, idx_mapping, values.shape[0])
    if values is not None and values.shape[2] < vocab:
        # A padded target head: vLLM verifies over the draft's vocabulary (a view, no copy).
        vocab = values.shape[2]
        target_logits = target_logits[:, :vocab]
    layout = packed_layout(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                           num_reqs, num_logits, min(slot_sizes.values()),
                           *((None, 0) if values is None else (row_mapping, values.shape[0])))
    draft_args = {} if values is None else dict(
        draft_logits=values, draft_slots=layout.draft_rows, draft_temperature=layout.temperature)
    out = verify_chain_packed(
        target_logits, layout.draft_ids, layout.cu_drafts, max_draft_tokens=num_speculative_steps,
        **draft_args, temperature=layout.verify_temperature, seed=layout.seeds,
        offset=layout.first_pos,
        method="block" if use_block_verification else "token", backend=backend,
        validate=False)
    # vLLM never emits -1 as a token: a row with no finite logit gets token 0, as vLLM's.
    return mrv2_outputs(out.output_token_ids, out.num_accepted, zero_missing=True)


def _check_rows(row_mapping, idx_mapping, num_rows: int) -> None:
    """``validate``: each request's row of a sharded cache is -1 or a row (a synchronisation)."""
    rows = row_mapping.to(torch.int64)[idx_mapping.to(torch.int64)]
    bad = (rows < -1) | (rows >= num_rows)
    if bool(bad.any()):
        i = _params.first_true(bad)
        raise ValueError(f"draft_logits_cache.row_mapping: expected rows in [-1, {num_rows}) "
                         f"(the cache's values), got {int(rows[i])} for request {i}")


def _cache_parts(cache, device, num_steps: int):
    """``(values, row_mapping)`` of a ``DraftLogitsCache`` (read by attribute: vLLM's class or
    any object with ``.values`` and ``.row_mapping``), ``(None, None)`` for None; a bare
    ``[rows, K, V']`` tensor is a replicated cache (ours)."""
    if cache is None:
        return None, None
    values = cache if isinstance(cache, torch.Tensor) else getattr(cache, "values", None)
    row_mapping = None if isinstance(cache, torch.Tensor) else getattr(cache, "row_mapping",
                                                                       None)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"draft_logits_cache: expected None or a DraftLogitsCache (.values a "
                        f"[rows, K, V] tensor, .row_mapping), got {type(cache).__name__}")
    _params.check_tensor(values, "draft_logits_cache.values", ndim=3,
                         dtypes=_params.LOGIT_DTYPES, device=device)
    if values.shape[0] < 1 or values.shape[1] < num_steps or values.shape[2] < 1:
        raise ValueError(f"draft_logits_cache.values: expected [rows >= 1, K >= "
                         f"{num_steps}, V >= 1], got {list(values.shape)}")
    if row_mapping is not None:
        _params.check_tensor(row_mapping, "draft_logits_cache.row_mapping", ndim=1,
                             dtypes=_params.INDEX_DTYPES, device=device)
    return values, row_mapping


# --- vLLM's own function and class, found even after the swap -----------------------------
_own_function: list = []
_own_class: list = []


def _keep_own_function() -> None:
    module = sys.modules.get(_UTILS)
    candidate = getattr(module, "rejection_sample", None)
    if callable(candidate) and getattr(candidate, "__module__", None) == _UTILS \
            and not _own_function:
        _own_function.append(candidate)


def vllm_rejection_sample():
    """vLLM's own ``rejection_sample`` (ImportError without vLLM)."""
    importlib.import_module(_UTILS)
    _keep_own_function()
    if not _own_function:  # swapped before we were imported: a private copy of vLLM's module
        private = importlib.util.module_from_spec(importlib.util.find_spec(_UTILS))
        importlib.util.find_spec(_UTILS).loader.exec_module(private)
        _own_function.append(private.rejection_sample)
    return _own_function[0]


def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
            idx_mapping_np, expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np):
    """vLLM 0.34.0's ``RejectionSampler._verify`` with our :func:`rejection_sample`."""
    import numpy as np

    processed_logits = self.sampler.apply_sampling_params(
        logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
        expanded_local_pos, seq_lens_upper_bound_np)
    may_mask = getattr(self.sampler, "may_mask_logits", None)
    sampled, num_sampled = rejection_sample(
        processed_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
        expanded_idx_mapping, expanded_local_pos,
        self.sampler.sampling_states.temperature.gpu, self.sampler.sampling_states.seeds.gpu,
        self.num_speculative_steps, self.synthetic_conditional_rates,
        use_fp64=bool(self.sampler.use_fp64_gumbel),
        use_block_verification=bool(self.use_block_verification),
        fly_window_size=self.fly_window_size, fly_entropy_threshold=self.fly_entropy_threshold,
        fly_entropy_top_k=self.fly_entropy_top_k,
        skip_masked_vocab_blocks=bool(np.any(may_mask[idx_mapping_np]))
        if may_mask is not None else False,  # a hint only: ours is the same either way
        **self._watermarking_kwargs(draft_sampled, expanded_idx_mapping, expanded_local_pos))
    if getattr(self.sampler, "trace_replay_state", None) is not None:
        self.sampler.trace_replay_state.apply_trace_to_verified(
            sampled, num_sampled, draft_sampled, cu_num_logits, idx_mapping)
    return processed_logits, sampled, num_sampled


class _WithoutVllm:
    """vLLM 0.34.0's MRV2 ``RejectionSampler`` needs vLLM (the rest of its step is vLLM's
    code); without it, call :func:`rejection_sample`."""

    def __init__(self, sampler, spec_config, device, *, watermark_key=None):
        raise NotImplementedError(
            f"sampler: MRV2's RejectionSampler runs vLLM's own sampler code; install vLLM "
            f"{VLLM_VERSION}; without it call vllm.mrv2_0_34.rejection_sample")


def _adapted_class() -> type:
    """vLLM's own class with our ``_verify`` (cached); ImportError without vLLM."""
    if "_adapted" not in globals():
        base = _delegate.own_class(_MODULE, _own_class, object)
        globals()["_adapted"] = type("RejectionSampler", (base,), {
            "_verify": _verify, "_specdec_adapter": True, "__module__": __name__,
            "__doc__": "vLLM 0.34.0's MRV2 RejectionSampler with our verification "
                       "(specdec_kernels.adapters.vllm.mrv2_0_34)."})
    return globals()["_adapted"]


def __getattr__(name: str):
    if name == "RejectionSampler":  # built on first access: importing us never imports vLLM
        try:
            return _adapted_class()
        except ImportError:
            return _WithoutVllm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def swap() -> None:
    """docs/engines.md's swap (one call, before the MRV2 runner is built): vLLM's
    ``rejection_sampler.RejectionSampler`` and both modules' ``rejection_sample`` become
    ours; vLLM's own stay reachable for the modes we delegate."""
    utils = importlib.import_module(_UTILS)
    runner = importlib.import_module(_MODULE)
    _keep_own_function()
    _delegate.keep_own_class(_MODULE, _own_class)
    vllm_rejection_sample()
    runner.RejectionSampler = _adapted_class()
    utils.rejection_sample = runner.rejection_sample = rejection_sample


rejection_sample._specdec_adapter = True
_keep_own_function()
_delegate.keep_own_class(_MODULE, _own_class)
