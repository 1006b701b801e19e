"""Public chain verification (contract section 3)."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _backend, _cpu, _ops, _params
from ._params import PerRequest
from ._rng import MAX_POSITION
from ._types import ChainVerifyOutput  # the result type lives at the bottom (docs/layers.md)
from .reference import chain as _reference


METHODS = _reference.METHODS  # contract sections 3 and 12: ("token", "block")


@_backend.on_input_device
def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, *,
                 draft_probs: Optional[torch.Tensor] = None,
                 draft_logits: Optional[torch.Tensor] = None,
                 num_draft_tokens: PerRequest = None, temperature: PerRequest = None,
                 top_k: PerRequest = None, top_p: PerRequest = None, seed: PerRequest = None,
                 offset: PerRequest = None, method: str = "token", backend: str = "auto",
                 validate: bool = True, min_p: PerRequest = None,
                 token_bitmask: Optional[torch.Tensor] = None,
                 return_logprobs: Optional[str] = None,
                 draft_slots: Optional[torch.Tensor] = None,
                 draft_temperature: PerRequest = None,
                 vocab_shard=None) -> ChainVerifyOutput:
    r"""Verify a batch of draft chains exactly (speculative sampling, Leviathan et al. / Chen et al.).

    For request ``b`` with ``n = num_draft_tokens[b]`` drafts: greedy requests
    (``temperature == 0``) accept drafts while they equal the target arg-max and then emit the
    arg-max. Sampled requests, ``method="token"``: accept draft ``j`` when
    ``u_j * q_j(d_j) < p_j(d_j)`` and emit, at the first rejection, a sample of
    ``norm(max(p_j - q_j, 0))`` (``p_j`` if no mass is left), or, when all ``n`` were accepted,
    a bonus sample of ``p_{n+1}``. ``method="block"`` (block verification, Sun et al. 2025):
    with ``w_0 = 1``, ``w_j = min(1, w_{j-1} p_j(d_j) / q_j(d_j))``,
    ``R_j = sum(max(w_j p_{j+1} - q_{j+1}, 0))``, ``h_j = R_j / (R_j + 1 - w_j)`` (``j < n``)
    and ``h_n = w_n``, accept the first ``tau = max({0} u {j : u_j < h_j})`` drafts (a later
    success overrides an earlier failure) and emit a sample of
    ``norm(max(w_tau p_{tau+1} - q_{tau+1}, 0))`` (``p_{tau+1}`` if no mass is left), or the
    bonus when ``tau = n``. Both are exact: the emitted tokens are distributed as tokens
    sampled one by one from the processed target distribution; block accepts at least as many
    drafts on average, has the token rule's law for one-hot drafts, and gives the token
    rule's tokens for greedy requests and ``n <= 1``.

    Args:
        target_logits: raw target logits at the K draft positions and the bonus position.
            Shape ``(batch_size, K + 1, vocab_size)``; dtype float32, bfloat16 or float16.
            (K is the padded number of drafts; ``num_draft_tokens`` the live ones.)
        draft_token_ids: the drafted tokens; entries at ``j >= num_draft_tokens[b]`` are ignored
            (``-1`` padding allowed). Shape ``(batch_size, K)``; int32 or int64.
        draft_probs: the exact distribution each draft token was drawn from.
            Shape ``(batch_size, K, vocab_size)``; float dtype.
        draft_logits: instead of ``draft_probs``: ``q = processed_probs(draft_logits, same
            parameters)``. Shape and dtype as ``draft_probs``. Neither given: the drafter was
            deterministic and ``q`` is one-hot at the drafted token. Both: ``ValueError``.
        num_draft_tokens: int or ``(batch_size,)`` int tensor in ``0..K``; default K.
        temperature, top_k, top_p, min_p: per request, as in :func:`processed_probs`
            (``min_p`` also processes ``draft_logits``).
        seed, offset: per request, as in :func:`sample`; the acceptance uniforms and the
            correction noise are separate Philox streams keyed by them.
        method: ``"token"`` (default) or ``"block"``.
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ CPU path for CPU tensors where
            it covers the call, else the reference),
            ``"reference"`` or ``"triton"`` (CPU tensors need ``TRITON_INTERPRET=1``).
        validate: check ids, lengths and parameter values (reads only those small tensors).
        token_bitmask: allowed tokens of each target row (a grammar's mask, xgrammar's
            layout): bit ``v % 32`` of word ``v // 32`` set = token ``v`` allowed.
            Shape ``(batch_size, K + 1, ceil(vocab_size / 32))``; int32.
            Target rows only, never the draft distribution.
        return_logprobs: None, ``"processed"`` or ``"raw"``: also return the log-probability
            of each emitted token under the processed target row it was emitted at (row ``j``
            for output position ``j``; 0.0 on greedy requests) or under the model's own
            ``log_softmax`` of that row.
        draft_slots: read the draft rows in place from an engine's per-slot buffer:
            ``draft_probs`` / ``draft_logits`` are then Shape ``(S, K', V')`` with ``K' >= K``,
            ``V' >= vocab_size`` (any strides), and draft ``j`` of request ``b`` is row
            ``[draft_slots[b], j, :vocab_size]`` (no copy). Shape ``(batch_size,)``; int32 or
            int64, values in ``[0, S)`` (clamped when ``validate=False``).
        draft_temperature: with ``draft_logits`` only: the drafter sampled
            ``softmax(draft_logits / draft_temperature)`` (temperature only: no top-k,
            top-p, min-p or bitmask), instead of the target's parameters; 0 means the
            drafter took the row's arg-max (q one-hot there, lowest id among ties). Per
            request, float, finite and >= 0. Greedy requests ignore q, as always.
        vocab_shard: a :class:`~specdec_kernels.VocabShard`: this rank's vocabulary slice of
            a tensor-parallel group (the last dimension of every ``[.., V]`` tensor is the
            slice; ids are global); every rank returns the unsharded op's outputs
            (docs/vocab_parallel.md). None: the whole vocabulary (default).

    Returns:
        ChainVerifyOutput with
        ``output_token_ids``: Shape ``(batch_size, K + 1)``; int32: the accepted
        drafts, then one correction or bonus token, then ``-1``.
        ``num_accepted``: Shape ``(batch_size,)``; int32; the request emits
        ``num_accepted + 1`` tokens.
        ``logprobs``: Shape ``(batch_size, K + 1)``; float32, NaN where the
        token is ``-1``; None without ``return_logprobs``.

    >>> import torch, specdec_kernels as sk
    >>> logits = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]])
    >>> sk.verify_chain(logits, torch.tensor([[1, 2]]), temperature=0.0)
    ChainVerifyOutput(output_token_ids=tensor([[ 1,  0, -1]], dtype=torch.int32), num_accepted=tensor([1], dtype=torch.int32), logprobs=None)
    >>> out = sk.verify_chain(logits, torch.tensor([[1, 2]]), temperature=0.0,
    ...                       token_bitmask=torch.tensor([[[6], [6], [6]]], dtype=torch.int32),
    ...                       return_logprobs="raw")
    >>> out.output_token_ids, out.logprobs  # token 0 is masked: row 1 emits 1 (tied with 2)
    (tensor([[ 1,  1, -1]], dtype=torch.int32), tensor([[-2.4673e-04, -9.0002e+00,         nan]]))
    """
    if vocab_shard is not None:  # contract section 17
        from . import vocab_parallel
        return vocab_parallel.verify_chain(
            target_logits, draft_token_ids, vocab_shard=vocab_shard, draft_probs=draft_probs,
            draft_logits=draft_logits, num_draft_tokens=num_draft_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
            method=method, backend=backend, validate=validate, min_p=min_p,
            token_bitmask=token_bitmask, return_logprobs=return_logprobs,
            draft_slots=draft_slots, draft_temperature=draft_temperature)
    # An engine calls with the same shapes and parameter kinds every step: the host checks
    # and the parsing of Python numbers run once per structure (``_params.call_key``).
    plan = _params.planned(_CHAIN_PLANS, _chain_plan, target_logits, draft_token_ids,
                           draft_probs, draft_logits, num_draft_tokens, temperature, top_k,
                           top_p, min_p, method, backend, validate, token_bitmask,
                           return_logprobs, draft_slots, draft_temperature)
    batch, device = plan.batch, plan.device
    values: list = []  # the tensors whose values a validated call checks, in one read
    params = _call_params(plan, temperature, top_k, top_p, min_p, validate, values)
    num_drafts = plan.rows - 1
    counts = plan.num_draft_tokens
    if counts is None:
        counts = _params.per_request(num_draft_tokens, "num_draft_tokens", batch, device,
                                     torch.int32, num_drafts)
    values += (draft_token_ids, None if plan.count is not None else counts)
    slots, draft_temp = _call_drafts(plan, draft_slots, draft_temperature, values)
    if validate:
        _params.check_values("verify_chain", values,
                             [num_drafts, plan.vocab, -1 if plan.count is None else plan.count,
                              plan.num_slots])
    counts = _params.narrow_int32(counts, 0, num_drafts)
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    return _run_chain(plan.use_triton, target_logits, draft_token_ids, draft_probs,
                      draft_logits, counts, params, seeds, offsets, token_bitmask,
                      return_logprobs, method=method, cpp=plan.cpp, draft_slots=slots,
                      draft_temperature=draft_temp)


def _call_params(plan, temperature, top_k, top_p, min_p, validate, values: list):
    """The call's parameters from its plan's template (their tensors appended to ``values``
    for the call's one read)."""
    return _params.planned_params(plan.params, temperature, top_k, top_p, min_p,
                                  batch=plan.batch, vocab_size=plan.vocab, device=plan.device,
                                  validate=validate, checks=values)


def _call_drafts(plan, draft_slots, draft_temperature, values: list):
    """``(draft_slots, draft_temperature)`` parsed for the op (None where not given; a
    Python-number draft temperature from the plan); appends their tensors to ``values``."""
    slots = None
    if draft_slots is not None:  # (S may be 0 at B = 0)
        slots = _params.draft_slots(draft_slots, plan.num_slots, plan.batch, plan.device, True,
                                    values)
    else:
        values.append(None)
    if draft_temperature is not None and plan.draft_temperature is not None:
        values.append(None)
        return slots, plan.draft_temperature
    return slots, _params.draft_temperature(draft_temperature, plan.batch, plan.device, True,
                                            values)


class _ChainPlan(NamedTuple):
    """What a chain call's structure decides (``_chain_plan``): None where a tensor argument
    is parsed per call."""
    batch: int
    rows: int
    vocab: int
    device: torch.device
    use_triton: bool
    cpp: bool                   # the C++ CPU path runs the call
    params: Optional[object]    # SamplingParams template (_params.params_template)
    count: Optional[int]        # num_draft_tokens as a Python number (None: a tensor)
    num_draft_tokens: Optional[torch.Tensor]  # its [B] tensor
    num_slots: int              # S with draft_slots, else 0
    draft_temperature: Optional[torch.Tensor]  # parsed, for a Python number


_CHAIN_PLANS: dict = {}


def _chain_plan(target_logits, draft_token_ids, draft_probs, draft_logits, num_draft_tokens,
                temperature, top_k, top_p, min_p, method, backend, validate, token_bitmask,
                return_logprobs, draft_slots, draft_temperature) -> _ChainPlan:
    """Every host check of a chain call, in the contract's order (the checks of tensor values
    come later, per call), and what the structure decides."""
    batch, rows, vocab = _params.check_verify_logits(target_logits, "target_logits", "K+1")
    device = target_logits.device
    num_drafts = rows - 1  # K
    _params.check_tensor(draft_token_ids, "draft_token_ids", dtypes=_params.INDEX_DTYPES,
                         device=device)
    _params.check_shape(draft_token_ids, "draft_token_ids", [batch, num_drafts],
                        "[B, K] from target_logits [B, K+1, V]")
    slotted = _check_drafts(draft_probs, draft_logits, [batch, num_drafts, vocab],
                            "[B, K, V] from target_logits [B, K+1, V]", device, draft_slots,
                            draft_temperature, batch, num_drafts, "K")
    _params.check_token_bitmask(token_bitmask, [batch, rows], vocab, device,
                                "[B, K+1, W] like target_logits [B, K+1, V]")
    _params.check_return_logprobs(return_logprobs)
    check_method(method)
    use_triton = _backend.resolve(backend, device) == "triton"
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=device, validate=validate, min_p=min_p, checks=[])
    params = _params.params_template(params, (temperature, top_k, top_p, min_p))
    count = _host_count(num_draft_tokens, num_drafts)
    counts = _params.per_request(num_draft_tokens, "num_draft_tokens", batch, device,
                                 torch.int32, num_drafts)
    slots, draft_temp, num_slots = _draft_arguments(
        slotted, draft_probs, draft_logits, draft_slots, draft_temperature, batch, device, [])
    cpp = not use_triton and _cpu.selected(backend, device) and \
        _cpu.runs_chain(target_logits, draft_probs, method)
    return _ChainPlan(batch, rows, vocab, device, use_triton, cpp, params, count,
                      counts if count is not None else None, num_slots,
                      None if isinstance(draft_temperature, torch.Tensor) else draft_temp)


@_backend.on_input_device
def verify_chain_packed(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                        cu_num_draft_tokens: torch.Tensor, *, max_draft_tokens: int,
                        draft_probs: Optional[torch.Tensor] = None,
                        draft_logits: Optional[torch.Tensor] = None,
                        temperature: PerRequest = None, top_k: PerRequest = None,
                        top_p: PerRequest = None, min_p: PerRequest = None,
                        token_bitmask: Optional[torch.Tensor] = None, seed: PerRequest = None,
                        offset: PerRequest = None, method: str = "token",
                        return_logprobs: Optional[str] = None, backend: str = "auto",
                        validate: bool = True, draft_slots: Optional[torch.Tensor] = None,
                        draft_temperature: PerRequest = None,
                        vocab_shard=None) -> ChainVerifyOutput:
    r""":func:`verify_chain` on the packed (flattened) layout engines keep (vLLM's sampler).

    Request ``b`` has ``n_b = cu[b+1] - cu[b]`` drafts (``cu = cu_num_draft_tokens``, ``T =
    cu[B]`` in all). Its target rows are ``cu[b] + b .. cu[b+1] + b`` of ``target_logits``: its
    ``n_b`` draft positions, then its bonus position; its drafts (and their ``draft_probs`` /
    ``draft_logits`` rows) are ``cu[b] .. cu[b+1] - 1``. The answer is token for token
    :func:`verify_chain`'s on the padded equivalent with ``num_draft_tokens = n_b``. The rows are
    read in place (no padded copy of the logits).

    Args:
        target_logits: Shape ``(T + batch_size, vocab_size)``; float32, bfloat16 or float16.
        draft_token_ids: Shape ``(T,)``; int32 or int64.
        cu_num_draft_tokens: exclusive prefix sums of the draft counts, ``cu[0] = 0``.
            Shape ``(batch_size + 1,)``; int32 or int64, on the logits' device.
        max_draft_tokens: Python int K >= every ``n_b``: the output has K + 1 columns.
        draft_probs, draft_logits: Shape ``(T, vocab_size)``, packed like the drafts.
        temperature, top_k, top_p, min_p, seed, offset: per request, as in
            :func:`verify_chain`.
        token_bitmask: Shape ``(T + batch_size, ceil(vocab_size / 32))``; int32, one row per
            target row.
        method: ``"token"`` (contract section 3) or ``"block"`` (section 12), as in
            :func:`verify_chain`.
        return_logprobs, backend, validate: as in :func:`verify_chain`.
        draft_slots: as in :func:`verify_chain`: ``draft_probs`` / ``draft_logits`` are then
            Shape ``(S, K', V')`` with ``K' >= max_draft_tokens``, ``V' >= vocab_size``, and
            draft ``j`` of request ``b`` (packed draft ``cu[b] + j``) is read in place at
            ``[draft_slots[b], j, :vocab_size]`` (vLLM MRV2's ``idx_mapping`` layout).
            Shape ``(batch_size,)``; int32 or int64.
        draft_temperature: as in :func:`verify_chain` (with ``draft_logits`` only).
        vocab_shard: as in :func:`verify_chain` (vLLM's ``[T+B, V/P]`` rows before the
            tensor-parallel gather).

    Returns:
        ChainVerifyOutput as :func:`verify_chain`: ``output_token_ids`` Shape
        ``(batch_size, max_draft_tokens + 1)``; int32, ``-1`` padded; ``num_accepted`` Shape
        ``(batch_size,)``; int32; ``logprobs`` Shape ``(batch_size, max_draft_tokens + 1)``;
        float32 or None.

    >>> import torch, specdec_kernels as sk
    >>> logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])
    >>> out = sk.verify_chain_packed(logits, torch.tensor([1]), torch.tensor([0, 1, 1]),
    ...                              max_draft_tokens=2, temperature=0.0)
    >>> out.output_token_ids, out.num_accepted  # request 0: draft 1, bonus 2; request 1: 0
    (tensor([[ 1,  2, -1],
            [ 0, -1, -1]], dtype=torch.int32), tensor([1, 0], dtype=torch.int32))
    """
    if vocab_shard is not None:  # contract section 17
        from . import vocab_parallel
        return vocab_parallel.verify_chain_packed(
            target_logits, draft_token_ids, cu_num_draft_tokens,
            max_draft_tokens=max_draft_tokens, vocab_shard=vocab_shard, draft_probs=draft_probs,
            draft_logits=draft_logits, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, token_bitmask=token_bitmask, seed=seed, offset=offset, method=method,
            return_logprobs=return_logprobs, backend=backend, validate=validate,
            draft_slots=draft_slots, draft_temperature=draft_temperature)
    plan = _params.planned(_PACKED_PLANS, _packed_plan, target_logits, draft_token_ids,
                           cu_num_draft_tokens, max_draft_tokens, draft_probs, draft_logits,
                           temperature, top_k, top_p, min_p, token_bitmask, method,
                           return_logprobs, backend, validate, draft_slots, draft_temperature)
    batch, device = plan.batch, plan.device
    values: list = []  # the tensors whose values a validated call checks, in one read
    params = _call_params(plan, temperature, top_k, top_p, min_p, validate, values)
    values += (draft_token_ids, cu_num_draft_tokens)
    slots, draft_temp = _call_drafts(plan, draft_slots, draft_temperature, values)
    if validate:
        _params.check_values("verify_chain_packed", values,
                             [max_draft_tokens, plan.vocab, plan.num_slots])
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    if plan.cpp:  # the C++ op derives each request's rows from the offsets, in place
        return ChainVerifyOutput(*_cpu.verify_chain(
            target_logits, draft_token_ids, draft_probs, draft_logits, None, params, seeds,
            offsets, token_bitmask, (cu_num_draft_tokens, max_draft_tokens), method,
            return_logprobs, draft_slots=slots, draft_temperature=draft_temp))
    # Triton reads the packed rows in place; the reference's definition is the padded layout.
    op = "triton_verify_chain_packed" if plan.use_triton else "reference_verify_chain_packed"
    out, accepted, *logprobs = _ops.call(
        op,
        target_logits, draft_token_ids, cu_num_draft_tokens, max_draft_tokens, draft_probs,
        draft_logits, *_ops.params_args(params), seeds, offsets, token_bitmask, method,
        return_logprobs, slots, draft_temp)
    return ChainVerifyOutput(out, accepted, _ops.logprobs_or_none(logprobs))


class _PackedPlan(NamedTuple):
    """What a packed call's structure decides (``_packed_plan``): None where a tensor
    argument is parsed per call."""
    batch: int
    vocab: int
    device: torch.device
    use_triton: bool
    cpp: bool                   # the C++ CPU path runs the call
    params: Optional[object]    # SamplingParams template (_params.params_template)
    num_slots: int              # S with draft_slots, else 0
    draft_temperature: Optional[torch.Tensor]  # parsed, for a Python number


_PACKED_PLANS: dict = {}


def _packed_plan(target_logits, draft_token_ids, cu_num_draft_tokens, max_draft_tokens,
                 draft_probs, draft_logits, temperature, top_k, top_p, min_p, token_bitmask,
                 method, return_logprobs, backend, validate, draft_slots,
                 draft_temperature) -> _PackedPlan:
    """Every host check of a packed call, in the contract's order (the checks of tensor
    values come later, per call), and what the structure decides."""
    _params.check_tensor(target_logits, "target_logits", ndim=2, dtypes=_params.LOGIT_DTYPES)
    device = target_logits.device
    total_rows, vocab = target_logits.shape
    if vocab < 1:
        raise ValueError(f"target_logits: expected shape [T+B, V] with V >= 1, "
                         f"got {list(target_logits.shape)}")
    _params.check_tensor(draft_token_ids, "draft_token_ids", ndim=1,
                         dtypes=_params.INDEX_DTYPES, device=device)
    _params.check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", ndim=1,
                         dtypes=_params.INDEX_DTYPES, device=device)
    if cu_num_draft_tokens.shape[0] < 1:
        raise ValueError("cu_num_draft_tokens: expected shape [B+1] with B >= 0, got [0]")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int):
        raise TypeError(f"max_draft_tokens: expected a Python int (K), "
                        f"got {type(max_draft_tokens).__name__}")
    if not 0 <= max_draft_tokens < MAX_POSITION:
        raise ValueError(f"max_draft_tokens: expected 0 <= K < {MAX_POSITION}, "
                         f"got {max_draft_tokens}")
    batch = cu_num_draft_tokens.shape[0] - 1
    num_packed = draft_token_ids.shape[0]
    if total_rows != num_packed + batch:
        raise ValueError(f"cu_num_draft_tokens, target_logits: expected T + B = {num_packed} + "
                         f"{batch} rows (T = len(draft_token_ids), B = len(cu_num_draft_tokens)"
                         f" - 1), got target_logits of shape {list(target_logits.shape)}")
    slotted = _check_drafts(draft_probs, draft_logits, [num_packed, vocab],
                            "[T, V], packed like draft_token_ids [T]", device, draft_slots,
                            draft_temperature, batch, max_draft_tokens, "max_draft_tokens",
                            vocab)
    _params.check_token_bitmask(token_bitmask, [total_rows], vocab, device,
                                "[T+B, W] like target_logits [T+B, V]")
    check_method(method)
    _params.check_return_logprobs(return_logprobs)
    use_triton = _backend.resolve(backend, device) == "triton"
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=device, validate=validate, min_p=min_p, checks=[])
    params = _params.params_template(params, (temperature, top_k, top_p, min_p))
    slots, draft_temp, num_slots = _draft_arguments(
        slotted, draft_probs, draft_logits, draft_slots, draft_temperature, batch, device, [])
    cpp = not use_triton and _cpu.PACKED and _cpu.selected(backend, device) and \
        _cpu.runs_chain(target_logits, draft_probs, method)
    return _PackedPlan(batch, vocab, device, use_triton, cpp, params, num_slots,
                       None if isinstance(draft_temperature, torch.Tensor) else draft_temp)


def check_method(method) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def _check_drafts(draft_probs, draft_logits, shape, what: str, device, draft_slots=None,
                  draft_temperature=None, batch: int = 0, num_drafts: int = 0,
                  drafts_name: str = "K", vocab: Optional[int] = None) -> bool:
    """The draft tensors' dtypes and shapes (no synchronisation): ``shape`` without
    ``draft_slots``, ``[S, >= K, >= V]`` with them. Returns whether the call is slotted."""
    if draft_probs is not None and draft_logits is not None:
        raise ValueError("draft_probs, draft_logits: expected at most one of them, got both")
    if draft_temperature is not None and draft_logits is None:
        raise ValueError("draft_temperature: applies to draft_logits only (draft_probs are "
                         "the drafter's law as given; one-hot drafts have none)")
    if draft_slots is not None and draft_probs is None and draft_logits is None:
        raise ValueError("draft_slots: expected draft_probs or draft_logits [S, K', V'] to "
                         "read through the slots, got neither")
    vocab = shape[-1] if vocab is None else vocab
    for name, draft in (("draft_probs", draft_probs), ("draft_logits", draft_logits)):
        if draft is not None:
            dtypes = _params.LOGIT_DTYPES if name == "draft_logits" else \
                _params.LOGIT_DTYPES + (torch.float64,)
            _params.check_tensor(draft, name, dtypes=dtypes, device=device)
            if draft_slots is None:
                _params.check_shape(draft, name, shape, what)
            elif draft.dim() != 3 or draft.shape[1] < num_drafts or draft.shape[2] < vocab \
                    or (batch > 0 and draft.shape[0] < 1):
                raise ValueError(
                    f"{name}: with draft_slots expected shape [S, K', V'] with S >= 1, K' >= "
                    f"{drafts_name} = {num_drafts} and V' >= V = {vocab} (row "
                    f"[draft_slots[b], j, :V] is request b's draft j), got {list(draft.shape)}")
    return draft_slots is not None


def _draft_arguments(slotted: bool, draft_probs, draft_logits, draft_slots, draft_temperature,
                     batch: int, device, values: list):
    """``(draft_slots, draft_temperature, S)`` parsed for the ops (None where not given; S the
    slots' range, 0 without slots); appends the tensors whose values a validated call checks
    (the slots, the draft temperatures) to ``values``."""
    slots, num_slots = None, 0
    if slotted:
        draft = draft_logits if draft_logits is not None else draft_probs
        num_slots = draft.shape[0]
        slots = _params.draft_slots(draft_slots, num_slots, batch, device, True, values)
    else:
        values.append(None)
    temperature = _params.draft_temperature(draft_temperature, batch, device, True, values)
    return slots, temperature, num_slots


def _host_count(num_draft_tokens, num_drafts: int):
    """The draft count when it is a Python number or None (K), else None (a tensor)."""
    if num_draft_tokens is None:
        return num_drafts
    if isinstance(num_draft_tokens, (int, float)) and not isinstance(num_draft_tokens, bool) \
            and math.isfinite(num_draft_tokens) and num_draft_tokens == int(num_draft_tokens):
        return int(num_draft_tokens)
    return None


def _run_chain(use_triton, target_logits, draft_token_ids, draft_probs, draft_logits,
               num_draft_tokens, params, seeds, offsets, token_bitmask, return_logprobs,
               method: str = "token", cpp: bool = False, draft_slots=None,
               draft_temperature=None) -> ChainVerifyOutput:
    """The parsed padded call on its backend's op (``_ops``): Triton, the C++ CPU path where
    it covers the call (``cpp``, ``_cpu``), else the reference."""
    if cpp and not use_triton and _cpu.runs_chain(target_logits, draft_probs, method):
        return ChainVerifyOutput(*_cpu.verify_chain(
            target_logits, draft_token_ids, draft_probs, draft_logits, num_draft_tokens, params,
            seeds, offsets, token_bitmask, None, method, return_logprobs,
            draft_slots=draft_slots, draft_temperature=draft_temperature))
    op = "triton_verify_chain" if use_triton else "reference_verify_chain"
    out, accepted, *logprobs = _ops.call(
        op,
        target_logits, draft_token_ids, draft_probs, draft_logits, num_draft_tokens,
        *_ops.params_args(params), seeds, offsets, token_bitmask, method, return_logprobs,
        draft_slots, draft_temperature)
    return ChainVerifyOutput(out, accepted, _ops.logprobs_or_none(logprobs))


@_params.check_family("verify_chain_packed")
def _packed_checks(tensors, ints) -> list:
    """Contract section 10's bad offsets, then the ids, then the slots and draft temperatures
    (the parameters' checks first)."""
    t, k, p, m, draft_token_ids, cu, slots, draft_temperature = tensors
    max_draft_tokens, vocab, num_slots = ints
    others = (_params.slot_checks([slots], [num_slots])
              + _params.draft_temperature_checks([draft_temperature], []))
    if _cpu.packed_layout_ok(cu, draft_token_ids, max_draft_tokens, vocab):
        return _params.sampling_checks(t, k, p, m) + others  # (one C++ pass on CPU tensors)
    cu = cu.to(torch.int64)
    batch = cu.shape[0] - 1
    counts = cu[1:] - cu[:batch]
    num_packed = draft_token_ids.shape[0]
    ids = draft_token_ids.to(torch.int64)
    bad_first = cu[:1] != 0
    bad_order = counts < 0
    bad_count = counts > max_draft_tokens
    bad_last = cu[batch:] != num_packed
    out_of_range = (ids < 0) | (ids >= vocab)

    def first_error():
        raise ValueError(f"cu_num_draft_tokens: expected cu[0] = 0, got {int(cu[0])}")

    def order_error():
        b = _params.first_true(bad_order)
        raise ValueError(f"cu_num_draft_tokens: expected non-decreasing offsets, got "
                         f"cu[{b}] = {int(cu[b])} > cu[{b + 1}] = {int(cu[b + 1])}")

    def count_error():
        b = _params.first_true(bad_count)
        raise ValueError(f"cu_num_draft_tokens: expected at most max_draft_tokens = "
                         f"{max_draft_tokens} drafts per request, got {int(counts[b])} for "
                         f"request {b}")

    def last_error():
        raise ValueError(f"cu_num_draft_tokens: expected cu[B] = len(draft_token_ids) = "
                         f"{num_packed}, got cu[{batch}] = {int(cu[batch])}")

    def ids_error():
        j = _params.first_true(out_of_range)
        raise ValueError(f"draft_token_ids: expected ids in [0, {vocab}), got {int(ids[j])} "
                         f"at [{j}]")
    return (_params.sampling_checks(t, k, p, m)
            + [(bad_first, first_error), (bad_order, order_error), (bad_count, count_error),
               (bad_last, last_error), (out_of_range, ids_error)]
            + others)


@_params.check_family("verify_chain")
def _chain_checks(tensors, ints) -> list:
    """The parameters, ``num_draft_tokens`` in ``0..K`` (a tensor; a Python count is checked
    on the host), the live drafts' ids in ``[0, V)``, the slots, the draft temperatures."""
    t, k, p, m, draft_token_ids, num_draft_tokens, slots, draft_temperature = tensors
    num_drafts, vocab, count, num_slots = ints
    checks = _params.sampling_checks(t, k, p, m)
    if num_draft_tokens is not None:
        bad_count = (num_draft_tokens < 0) | (num_draft_tokens > num_drafts)
        live = torch.arange(num_drafts, device=num_draft_tokens.device) < \
            num_draft_tokens[:, None]
        out_of_range = live & ((draft_token_ids < 0) | (draft_token_ids >= vocab))

        def count_error():
            b = _params.first_true(bad_count)
            raise ValueError(f"num_draft_tokens: expected values in 0..{num_drafts} (K), "
                             f"got {int(num_draft_tokens[b])} for request {b}")
        checks.append((bad_count, count_error))
    else:  # a Python count: every request has its first `count` drafts live
        if draft_token_ids.shape[0] and not 0 <= count <= num_drafts:
            def count_error(given=count):
                raise ValueError(f"num_draft_tokens: expected values in 0..{num_drafts} (K), "
                                 f"got {given} for request 0")
            checks.append((torch.ones(1, dtype=torch.bool), count_error))
            count = min(max(count, 0), num_drafts)
        live_ids = draft_token_ids if count == num_drafts else draft_token_ids[:, :count]
        out_of_range = (live_ids < 0) | (live_ids >= vocab)

    def ids_error():
        b = _params.first_true(out_of_range.any(1))
        j = _params.first_true(out_of_range[b])
        raise ValueError(f"draft_token_ids: expected ids in [0, {vocab}) for the first "
                         f"num_draft_tokens[b] entries, got {int(draft_token_ids[b, j])} "
                         f"at [{b}, {j}]")
    if out_of_range.numel():
        checks.append((out_of_range, ids_error))
    return (checks + _params.slot_checks([slots], [num_slots])
            + _params.draft_temperature_checks([draft_temperature], []))
