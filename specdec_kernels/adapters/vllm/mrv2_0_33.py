"""vLLM 0.33.0's MRV2 runner verification (``vllm/v1/worker/gpu/spec_decode/``), exact.

* :func:`rejection_sample` has the signature and outputs of vLLM's
  ``rejection_sampler_utils.rejection_sample``: ``target_logits [num_logits, V]`` (processed by
  MRV2's sampler: penalties, temperature, min-p, top-k/top-p as ``-inf``), request ``i``'s rows
  ``cu_num_logits[i] .. cu_num_logits[i+1]-1`` (its ``n_i`` draft rows, then its bonus row),
  the draft of row ``r`` at ``draft_sampled[r + 1]`` (``-1``: a rejected draft),
  ``draft_logits [max_num_reqs, K, V]`` (pre-temperature, read at ``idx_mapping[i]``) or None
  (one-hot drafts), ``temperature`` / ``seed`` ``[max_num_reqs]`` (0 = greedy). Returns
  ``(sampled [num_reqs, K+1] int64, num_sampled [num_reqs] int32)``: the accepted drafts, the
  correction or bonus token, then ``-1`` (vLLM leaves those slots unwritten).
  The law: the target's ``softmax(target_logits)``, the drafter's
  ``softmax(draft_logits / temperature)`` (MRV2's drafter samples with temperature only).
  ``use_block_verification=True`` is our block verification.
* :class:`RejectionSampler` is MRV2's class (``RejectionSampler(sampler, spec_config, device,
  *, watermark_key=None)``, ``__call__(logits, input_batch, draft_logits=None,
  invalid_drafts=None) -> SamplerOutput``): vLLM's own class with its verification step
  (``_verify``) calling :func:`rejection_sample`; everything else (MRV2's sampler features,
  chunking, logprobs, watermark contexts) is vLLM's code, so it needs vLLM.
  Swap (before the MRV2 runner imports it)::

      import vllm.v1.worker.gpu.spec_decode.rejection_sampler as mrv2
      from specdec_kernels.adapters.vllm import mrv2_0_33 as sk_mrv2
      mrv2.RejectionSampler = sk_mrv2.RejectionSampler

Lossy or vLLM-specific modes (``synthetic_conditional_rates``, FLy's ``fly_window_size > 0``,
watermarking ``contexts``) call vLLM's own ``rejection_sample`` when vLLM is importable, else
raise NotImplementedError naming the argument.

Differences from vLLM 0.33.0: randomness is our Philox stream keyed by ``seed[idx_mapping[i]]``
and the request's first position ``pos[cu_num_logits[i]]`` (a new offset every step), not
vLLM's; the same law. Everything is read in place: the target rows as packed, the draft rows
through ``idx_mapping`` (``verify_chain_packed(draft_slots=idx_mapping,
draft_temperature=temperature[idx_mapping])``: no gathered copy, the temperature applied in
the kernels). No host synchronisation: every index is computed on the device; only ``[B]``
and ``[T]`` index tensors are built.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import _cpu, _params
from ...chain import verify_chain_packed
from .._common import value_checks_wanted
from . import _delegate

__all__ = ["rejection_sample", "RejectionSampler"]


def rejection_sample(target_logits: torch.Tensor, draft_logits: Optional[torch.Tensor],
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
                     *, backend: str = "auto", validate: Optional[bool] = None):
    """MRV2's ``rejection_sample`` by our exact kernels (module docstring).

    ``validate`` (ours): None (default) runs the checks that read index values where they
    cost no synchronisation (CPU tensors, eager); True/False force them. They are:
    ``idx_mapping`` in range of ``temperature``, ``seed`` and ``draft_logits``'s slots,
    ``cu_num_logits`` starting at 0, ending at the number of logits rows, with ``1 ..
    num_speculative_steps + 1`` rows per request. Skipped, an index past the end is clamped
    to the last slot (never read out of bounds; that request's tokens are then garbage, not
    an error). Shapes -- e.g. fewer logits rows than requests -- are checked always.
    """
    vllm_only = [name for name, used in (
        ("synthetic_conditional_rates", synthetic_conditional_rates is not None),
        ("fly_window_size", bool(fly_window_size)),
        ("contexts", contexts is not None or watermarking is not None
         or watermark_key is not None)) if used]
    if vllm_only:
        try:
            from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import \
                rejection_sample as vllm_rejection_sample
        except ImportError:
            raise NotImplementedError(
                f"{vllm_only[0]}: a lossy or vLLM-specific mode of vLLM's MRV2 rejection "
                f"sampler; install vLLM to delegate to it") from None
        return vllm_rejection_sample(
            target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
            expanded_idx_mapping, expanded_local_pos, temperature, seed,
            num_speculative_steps, synthetic_conditional_rates, use_fp64,
            use_block_verification, contexts, watermarking, watermarking_skip_mask,
            watermark_key, fly_window_size, fly_entropy_threshold, fly_entropy_top_k)

    _params.check_tensor(target_logits, "target_logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = target_logits.device
    num_logits, vocab = target_logits.shape
    for name, tensor in (("draft_sampled", draft_sampled), ("cu_num_logits", cu_num_logits),
                         ("pos", pos), ("idx_mapping", idx_mapping), ("seed", seed)):
        _params.check_tensor(tensor, name, ndim=1, dtypes=_params.INDEX_DTYPES, device=device)
    _params.check_tensor(temperature, "temperature", ndim=1, device=device)
    if isinstance(num_speculative_steps, bool) or not isinstance(num_speculative_steps, int) \
            or num_speculative_steps < 0:
        raise TypeError(f"num_speculative_steps: expected a Python int >= 0, "
                        f"got {num_speculative_steps!r}")
    num_reqs = cu_num_logits.shape[0] - 1
    if num_reqs < 0 or idx_mapping.shape[0] != num_reqs:
        raise ValueError(f"idx_mapping, cu_num_logits: expected num_reqs + 1 = "
                         f"{idx_mapping.shape[0] + 1} offsets, got {cu_num_logits.shape[0]}")
    for name, tensor in (("draft_sampled", draft_sampled), ("pos", pos)):
        if tensor.shape[0] != num_logits:
            raise ValueError(f"{name}: expected {num_logits} entries (one per logits row), "
                             f"got {tensor.shape[0]}")
    if num_logits < num_reqs:
        raise ValueError(f"target_logits, cu_num_logits: expected at least one logits row per "
                         f"request (its bonus row), {num_reqs} requests, got {num_logits} rows")
    slot_sizes = {"temperature": temperature.shape[0], "seed": seed.shape[0]}
    if draft_logits is not None:
        slot_sizes["draft_logits"] = draft_logits.shape[0]
    if num_reqs and min(slot_sizes.values()) < 1:
        raise ValueError(f"{', '.join(slot_sizes)}: expected max_num_reqs >= 1 request slots, "
                         f"got {slot_sizes}")
    if draft_logits is not None:
        _params.check_tensor(draft_logits, "draft_logits", ndim=3, dtypes=_params.LOGIT_DTYPES,
                             device=device)
        if draft_logits.shape[1] < num_speculative_steps or draft_logits.shape[2] < vocab:
            raise ValueError(f"draft_logits: expected [max_num_reqs, >= {num_speculative_steps}"
                             f", >= {vocab}], got {list(draft_logits.shape)}")
    if value_checks_wanted(validate, device) and not _cpu.mrv2_indices_ok(
            cu_num_logits, idx_mapping, min(slot_sizes.values(), default=0), num_logits,
            num_speculative_steps):
        _check_indices(cu_num_logits, idx_mapping, slot_sizes, num_logits, num_speculative_steps)

    layout = packed_layout(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                           num_reqs, num_logits, min(slot_sizes.values()))
    # The drafter's rows in place: request i's draft j is draft_logits[idx_mapping[i], j, :V],
    # at temperature[idx_mapping[i]] (greedy requests ignore q).
    draft_args = {} if draft_logits is None else dict(
        draft_logits=draft_logits, draft_slots=idx_mapping, draft_temperature=layout.temperature)
    out = verify_chain_packed(
        target_logits, layout.draft_ids, layout.cu_drafts, max_draft_tokens=num_speculative_steps,
        **draft_args, temperature=layout.verify_temperature, seed=layout.seeds,
        offset=layout.first_pos,
        method="block" if use_block_verification else "token", backend=backend,
        validate=False)
    return mrv2_outputs(out.output_token_ids, out.num_accepted, zero_missing=False)


class PackedLayout(NamedTuple):
    """MRV2's step in our packed layout (``packed_layout``)."""
    cu_drafts: torch.Tensor           # [B+1] int64 exclusive draft offsets
    draft_ids: torch.Tensor           # [T] int64 (-1: a sharded cache has no row for it)
    draft_rows: torch.Tensor          # [B] int64 each request's slot, or its cache row
    temperature: torch.Tensor         # [B] float32, the requests' own (0 = greedy)
    verify_temperature: torch.Tensor  # [B] 0 for greedy, else 1 (the logits are processed)
    seeds: torch.Tensor               # [B] int64
    first_pos: torch.Tensor           # [B] int64, each request's first position: its offset


def packed_layout(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                  num_reqs: int, num_logits: int, num_slots: int, row_mapping=None,
                  num_rows: int = 0) -> PackedLayout:
    """MRV2's layout (request ``i``'s rows ``cu_num_logits[i] ..`` with its bonus row last;
    ``draft_sampled[r]`` the draft row ``r - 1`` verifies) in ours, on the device, no
    synchronisation. ``row_mapping`` (vLLM 0.34's sharded draft cache of ``num_rows`` rows):
    each request's row there, ``-1`` for none (its drafts become ``-1``: rejected).
    Unvalidated indices past the end are clamped: never a read out of bounds. CPU tensors:
    one C++ op, the same values."""
    fast = _cpu.mrv2_layout(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                            row_mapping, num_slots, num_rows)
    if fast is not None:
        return PackedLayout(*fast)
    device = draft_sampled.device
    num_packed = num_logits - num_reqs  # T: every request has one bonus row
    cu = _params.as_int64(cu_num_logits)
    cu_drafts = cu - _params.arange(num_reqs + 1, device)  # exclusive [B+1]
    packed = _params.arange(num_packed, device)
    request_of = torch.searchsorted(cu_drafts[1:], packed, right=True).clamp(
        max=max(num_reqs - 1, 0))
    draft_rows = (packed + request_of + 1).clamp(max=max(num_logits - 1, 0))
    draft_ids = _params.as_int64(draft_sampled)[draft_rows] if num_packed else \
        draft_sampled.new_zeros(0, dtype=torch.int64)
    slots = _params.as_int64(idx_mapping).clamp(0, max(num_slots - 1, 0))
    rows = slots
    if row_mapping is not None:
        rows = _params.as_int64(row_mapping)[slots].clamp(max=num_rows - 1)
        if num_packed:
            # No row on this rank: the drafter's q is unknown, so its drafts are rejected
            # and the target is sampled (exact whatever the drafts were).
            draft_ids = torch.where(rows[request_of] < 0, -1, draft_ids)
        rows = rows.clamp(min=0)
    temp = temperature[slots]
    if temp.dtype != torch.float32:
        temp = temp.float()
    first_pos = _params.as_int64(pos)[cu[:num_reqs].clamp(max=max(num_logits - 1, 0))] \
        if num_logits else pos.new_zeros(num_reqs, dtype=torch.int64)
    return PackedLayout(cu_drafts, draft_ids, rows, temp, (temp != 0).to(torch.float32),
                        _params.as_int64(seed)[slots], first_pos)


def mrv2_outputs(output_token_ids, num_accepted, zero_missing: bool):
    """``(sampled, num_sampled)``: our tokens as int64 and ``num_accepted + 1``;
    ``zero_missing`` (vLLM 0.34): a ``-1`` among the emitted tokens (a row with no finite
    logit, contract section 7) as token 0, what vLLM's kernels write there (its argmax over
    all ``-inf``). CPU tensors: one C++ op."""
    fast = _cpu.mrv2_outputs(output_token_ids, num_accepted, zero_missing)
    if fast is not None:
        return fast
    sampled, num_sampled = output_token_ids.to(torch.int64), num_accepted + 1
    if not zero_missing:
        return sampled, num_sampled
    emitted = _params.arange(sampled.shape[1], sampled.device) < num_sampled[:, None]
    return torch.where(emitted & (sampled < 0), 0, sampled), num_sampled


def _check_indices(cu_num_logits, idx_mapping, slot_sizes: dict, num_logits: int,
                   num_speculative_steps: int) -> None:
    """``validate``: the index values (one synchronisation)."""
    slots = idx_mapping.to(torch.int64)
    for name, size in slot_sizes.items():
        bad = (slots < 0) | (slots >= size)
        if bool(bad.any()):
            i = _params.first_true(bad)
            raise ValueError(f"idx_mapping: expected request slots in [0, {size}) ({name} has "
                             f"{size}), got {int(slots[i])} at [{i}]")
    cu = cu_num_logits.to(torch.int64).tolist()
    counts = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or cu[-1] != num_logits or not all(
            1 <= n <= num_speculative_steps + 1 for n in counts):
        raise ValueError(f"cu_num_logits: expected offsets from 0 to {num_logits} (the logits "
                         f"rows) with 1 to num_speculative_steps + 1 = "
                         f"{num_speculative_steps + 1} rows per request, got {cu}")


_VLLM_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
_vllm_class_kept: list = []  # a strong reference: after the swap nothing else holds it


def _vllm_mrv2_class():
    """vLLM's own MRV2 ``RejectionSampler`` (found after the swap too; ImportError without
    vLLM)."""
    return _delegate.own_class(_VLLM_MODULE, _vllm_class_kept, object)


class RejectionSampler:
    """MRV2's ``RejectionSampler`` with our verification (module docstring). Builds vLLM's
    class with ``_verify`` calling :func:`rejection_sample`; needs vLLM (the rest of the step
    is vLLM's code)."""

    def __new__(cls, sampler, spec_config, device, *, watermark_key=None):
        try:
            base = _vllm_mrv2_class()
        except ImportError as error:
            raise NotImplementedError(
                f"sampler: MRV2's RejectionSampler runs vLLM's own sampler code; install "
                f"vLLM ({error}); without it call vllm.mrv2_0_33.rejection_sample") from None
        return _adapted(base)(sampler, spec_config, device, watermark_key=watermark_key)


_ADAPTED: dict = {}


def _adapted(base: type) -> type:
    if base not in _ADAPTED:
        def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                    idx_mapping_np, expanded_idx_mapping, expanded_local_pos,
                    seq_lens_upper_bound_np, verify_draft_sampled):
            processed_logits = self.sampler.apply_sampling_params(
                logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
                expanded_local_pos, seq_lens_upper_bound_np)
            sampled, num_sampled = rejection_sample(
                processed_logits, draft_logits, verify_draft_sampled, cu_num_logits, pos,
                idx_mapping, expanded_idx_mapping, expanded_local_pos,
                self.sampler.sampling_states.temperature.gpu,
                self.sampler.sampling_states.seeds.gpu, self.num_speculative_steps,
                self.synthetic_conditional_rates, use_fp64=self.sampler.use_fp64_gumbel,
                use_block_verification=self.use_block_verification,
                fly_window_size=self.fly_window_size,
                fly_entropy_threshold=self.fly_entropy_threshold,
                fly_entropy_top_k=self.fly_entropy_top_k,
                **self._watermarking_kwargs(draft_sampled, expanded_idx_mapping,
                                            expanded_local_pos))
            return processed_logits, sampled, num_sampled
        _ADAPTED[base] = type("RejectionSampler", (base,), {
            "_verify": _verify, "_specdec_adapter": True, "__module__": __name__,
            "__doc__": RejectionSampler.__doc__})
    return _ADAPTED[base]


_delegate.keep_own_class(_VLLM_MODULE, _vllm_class_kept)
