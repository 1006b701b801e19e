"""Public ``processed_probs`` and ``sample`` (contract sections 1 and 2)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _backend, _cpu, _ops, _params
from ._params import PerRequest
from ._types import SampleOutput  # the result type lives at the bottom (docs/layers.md)


def _check_logits(logits, name: str = "logits", ndim=None) -> torch.Tensor:
    _params.check_tensor(logits, name, dtypes=_params.LOGIT_DTYPES + (torch.float64,))
    if ndim is not None and logits.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {list(logits.shape)}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape [..., V] with V >= 1, got {list(logits.shape)}")
    return logits


def processed_probs(logits: torch.Tensor, temperature: PerRequest = None, top_k: PerRequest = None,
                    top_p: PerRequest = None, *, validate: bool = True,
                    min_p: PerRequest = None,
                    token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""The target distribution that verification preserves (contract sections 1 and 8).

    Per row: ``token_bitmask`` (a cleared bit makes that logit ``-inf``), ``temperature`` (0 =
    greedy: one-hot at the arg-max of the allowed tokens, lowest id among ties), then
    ``top_k`` on the scaled logits ``z`` (boundary ties kept), ``min_p`` (keep
    ``z >= max(z) + log(min_p)``), softmax, then ``top_p`` (the smallest set of most likely
    tokens reaching ``top_p``, boundary ties kept), renormalised. NaN and infinite logits are
    never sampled; a row with no finite allowed logit is all zero.

    Args:
        logits: raw logits. Shape: ``(..., vocab_size)`` (dim 0 is the request); dtype
            float32, bfloat16 or float16 (float64 accepted for exactness tests).
        temperature: Python float or ``(batch_size,)`` tensor, ``>= 0``; default 1.0.
        top_k: Python int or ``(batch_size,)`` int tensor; 0 or ``>= vocab_size`` disables.
        top_p: Python float or ``(batch_size,)`` tensor in ``(0, 1]``; 1.0 disables.
        validate: check parameter values (reads the small parameter tensors).
        min_p: Python float or ``(batch_size,)`` tensor in ``[0, 1]``; 0 disables.
        token_bitmask: allowed tokens, xgrammar's layout: bit ``v % 32`` (least significant
            first) of word ``v // 32`` set = token ``v`` allowed; bits past V ignored.
            Shape ``(..., ceil(vocab_size / 32))`` matching ``logits``; int32.

    Returns:
        probs: Shape ``logits.shape``; dtype float32 (float64 for float64 logits). Rows sum to 1
        (all zero where nothing is allowed).

    >>> import torch, specdec_kernels as sk
    >>> sk.processed_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), temperature=1.0, top_k=2)
    tensor([[0.7311, 0.2689, 0.0000, 0.0000]])
    >>> sk.processed_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), min_p=0.3,
    ...                    token_bitmask=torch.tensor([[0b1110]], dtype=torch.int32))
    tensor([[0.0000, 0.7311, 0.2689, 0.0000]])
    """
    _check_logits(logits)
    squeeze = logits.dim() == 1
    rows = logits[None] if squeeze else logits
    _params.check_token_bitmask(token_bitmask, logits.shape[:-1], logits.shape[-1],
                                logits.device, "[..., W] like logits [..., V]")
    if token_bitmask is not None and squeeze:
        token_bitmask = token_bitmask[None]
    params = _params.sampling_params(temperature, top_k, top_p, batch=rows.shape[0],
                                     vocab_size=rows.shape[-1], device=rows.device,
                                     validate=validate, min_p=min_p)
    probs = _ops.call("reference_processed_probs", rows, *_ops.params_args(params),
                      token_bitmask)
    return probs[0] if squeeze else probs


@_backend.on_input_device
def sample(logits: torch.Tensor, *, temperature: PerRequest = None, top_k: PerRequest = None,
           top_p: PerRequest = None, seed: PerRequest = None, offset: PerRequest = None,
           backend: str = "auto", validate: bool = True, min_p: PerRequest = None,
           token_bitmask: Optional[torch.Tensor] = None,
           return_logprobs: Optional[str] = None, vocab_shard=None):
    r"""Draw one token per row from :func:`processed_probs` (exactly its law).

    The noise is the ``sample`` stream of the Philox scheme keyed by ``(seed, offset)``, so a
    drafter that samples with this function has a ``q`` that verification reproduces exactly,
    and its noise never coincides with verification's.

    Args:
        logits: Shape ``(batch_size, vocab_size)``; dtype float32, bfloat16 or float16
            (float64 on the reference backend, which ``"auto"`` then picks).
        temperature, top_k, top_p, min_p: as in :func:`processed_probs`.
        seed: int or ``(batch_size,)`` int64 tensor; None draws one per request from torch's
            default generator.
        offset: int or ``(batch_size,)`` int64 tensor (per-step counter); default 0.
        backend: ``"auto"`` (Triton on CUDA, the C++ CPU path on CPU where it covers the call,
            else the reference), ``"reference"`` or ``"triton"``.
        validate: check parameter values (reads only the small tensors).
        token_bitmask: as in :func:`processed_probs`. Shape ``(batch_size,
            ceil(vocab_size / 32))``; int32.
        return_logprobs: None, ``"processed"`` (``log processed_probs`` of the token; 0.0 on
            greedy rows) or ``"raw"`` (the model's ``log_softmax(logits)`` of the token).
        vocab_shard: as in :func:`~specdec_kernels.verify_chain`: ``logits`` is this rank's
            ``[B, V/P]`` slice; every rank returns the same global ids.

    Returns:
        token_ids: Shape ``(batch_size,)``; dtype int32; ``-1`` for a row with no finite
        allowed logit. With ``return_logprobs``: ``SampleOutput(token_ids, logprobs)``,
        ``logprobs`` Shape ``(batch_size,)``; float32, NaN where the token is ``-1``.

    >>> import torch, specdec_kernels as sk
    >>> sk.sample(torch.tensor([[0.0, 5.0, 0.0]]), temperature=0.0, seed=1)
    tensor([1], dtype=torch.int32)
    >>> sk.sample(torch.tensor([[0.0, 5.0, 0.0]]), temperature=0.0, seed=1,
    ...           token_bitmask=torch.tensor([[0b101]], dtype=torch.int32), return_logprobs="raw")
    SampleOutput(token_ids=tensor([0], dtype=torch.int32), logprobs=tensor([-5.0134]))
    """
    if vocab_shard is not None:  # contract section 17
        from . import vocab_parallel
        return vocab_parallel.sample(
            logits, vocab_shard=vocab_shard, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, offset=offset, backend=backend, validate=validate, min_p=min_p,
            token_bitmask=token_bitmask, return_logprobs=return_logprobs)
    plan = _params.planned(_SAMPLE_PLANS, _sample_plan, logits, temperature, top_k, top_p,
                           min_p, backend, token_bitmask, return_logprobs)
    use_triton, cpp, params = plan
    batch, device = logits.shape[0], logits.device
    params = _params.planned_params(params, temperature, top_k, top_p, min_p, batch=batch,
                                    vocab_size=logits.shape[1], device=device,
                                    validate=validate)
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    if cpp:
        result = _cpu.sample(logits, params, seeds, offsets, token_bitmask, return_logprobs)
        return result if return_logprobs is None else SampleOutput(*result)
    op = "triton_sample" if use_triton else "reference_sample"
    tokens, *logprobs = _ops.call(op, logits, *_ops.params_args(params), seeds, offsets,
                                  token_bitmask, return_logprobs)
    return tokens if return_logprobs is None else SampleOutput(tokens, logprobs[0])


_SAMPLE_PLANS: dict = {}


def _sample_plan(logits, temperature, top_k, top_p, min_p, backend, token_bitmask,
                 return_logprobs):
    """Every host check of a ``sample`` call but the seeds' (parsed per call, last), and what
    its structure decides: ``(use_triton, cpp, params of Python numbers or None)``."""
    _check_logits(logits, ndim=2)
    batch, vocab = logits.shape
    _params.check_token_bitmask(token_bitmask, [batch], vocab, logits.device,
                                "[B, W] like logits [B, V]")
    _params.check_return_logprobs(return_logprobs)
    use_triton = _backend.resolve(backend, logits.device) == "triton"
    if use_triton and logits.dtype == torch.float64:
        if backend != "auto":
            raise TypeError("logits: the Triton backend takes float32, bfloat16 or float16 "
                            "logits, got float64 (the reference backend takes float64)")
        use_triton = False  # "auto": float64 logits take the reference path on any device
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=logits.device, validate=False, min_p=min_p,
                                     checks=[])
    params = _params.params_template(params, (temperature, top_k, top_p, min_p))
    cpp = _cpu.selected(backend, logits.device) and not use_triton and _cpu.runs_sample(logits)
    return use_triton, cpp, params
