"""Public ``processed_probs`` and ``sample`` (contract sections 1 and 2)."""
from __future__ import annotations

import torch

from . import _backend, _params
from ._params import PerRequest
from .reference import sampling as _reference


def _check_logits(logits, name: str = "logits", ndim=None) -> torch.Tensor:
    _params.check_tensor(logits, name, dtypes=_params.LOGIT_DTYPES + (torch.float64,))
    if ndim is not None and logits.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {list(logits.shape)}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape [..., V] with V >= 1, got {list(logits.shape)}")
    return logits


def processed_probs(logits: torch.Tensor, temperature: PerRequest = None, top_k: PerRequest = None,
                    top_p: PerRequest = None, *, validate: bool = True) -> torch.Tensor:
    r"""The target distribution that verification preserves (contract section 1).

    Per row: ``temperature`` (0 = greedy: one-hot at the arg-max, lowest id among ties), then
    ``top_k`` on the scaled logits (boundary ties kept), softmax, then ``top_p`` (the smallest
    set of most likely tokens reaching ``top_p``, boundary ties kept), renormalised. NaN and
    infinite logits are never sampled; a row with no finite logit is all zero.

    Args:
        logits: raw logits. Shape: ``(..., vocab_size)`` (dim 0 is the request); dtype
            float32, bfloat16 or float16 (float64 accepted for exactness tests).
        temperature: Python float or ``(batch_size,)`` tensor, ``>= 0``; default 1.0.
        top_k: Python int or ``(batch_size,)`` int tensor; 0 or ``>= vocab_size`` disables.
        top_p: Python float or ``(batch_size,)`` tensor in ``(0, 1]``; 1.0 disables.
        validate: check parameter values (reads the small parameter tensors).

    Returns:
        probs: Shape ``logits.shape``; dtype float32 (float64 for float64 logits). Rows sum to 1.

    >>> import torch, specdec_kernels as sk
    >>> sk.processed_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), temperature=1.0, top_k=2)
    tensor([[0.7311, 0.2689, 0.0000, 0.0000]])
    """
    _check_logits(logits)
    squeeze = logits.dim() == 1
    rows = logits[None] if squeeze else logits
    params = _params.sampling_params(temperature, top_k, top_p, batch=rows.shape[0],
                                     vocab_size=rows.shape[-1], device=rows.device,
                                     validate=validate)
    probs = _reference.processed_probs(rows, params.temperature, params.top_k, params.top_p)
    return probs[0] if squeeze else probs


@_backend.on_input_device
def sample(logits: torch.Tensor, *, temperature: PerRequest = None, top_k: PerRequest = None,
           top_p: PerRequest = None, seed: PerRequest = None, offset: PerRequest = None,
           backend: str = "auto", validate: bool = True) -> torch.Tensor:
    r"""Draw one token per row from :func:`processed_probs` (exactly its law).

    The noise is the ``sample`` stream of the Philox scheme keyed by ``(seed, offset)``, so a
    drafter that samples with this function has a ``q`` that verification reproduces exactly,
    and its noise never coincides with verification's.

    Args:
        logits: Shape ``(batch_size, vocab_size)``; dtype float32, bfloat16 or float16
            (float64 on the reference backend, which ``"auto"`` then picks).
        temperature, top_k, top_p: as in :func:`processed_probs`.
        seed: int or ``(batch_size,)`` int64 tensor; None draws one per request from torch's
            default generator.
        offset: int or ``(batch_size,)`` int64 tensor (per-step counter); default 0.
        backend: ``"auto"`` (Triton on CUDA, reference on CPU), ``"reference"`` or ``"triton"``.
        validate: check parameter values (reads only the small tensors).

    Returns:
        token_ids: Shape ``(batch_size,)``; dtype int32; ``-1`` for a row with no finite logit.

    >>> import torch, specdec_kernels as sk
    >>> sk.sample(torch.tensor([[0.0, 5.0, 0.0]]), temperature=0.0, seed=1)
    tensor([1], dtype=torch.int32)
    """
    _check_logits(logits, ndim=2)
    batch, vocab = logits.shape
    use_triton = _backend.resolve(backend, logits.device) == "triton"
    if use_triton and logits.dtype == torch.float64:
        if backend != "auto":
            raise TypeError("logits: the Triton backend takes float32, bfloat16 or float16 "
                            "logits, got float64 (the reference backend takes float64)")
        use_triton = False  # "auto": float64 logits take the reference path on any device
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=logits.device, validate=validate)
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=logits.device)
    if use_triton:
        from .triton import sampling as _triton
        return _triton.sample(logits, params, seeds, offsets)
    return _reference.sample(logits, params.temperature, params.top_k, params.top_p, seeds, offsets)
