"""Public chain verification (contract section 3)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _backend, _params
from ._params import PerRequest
from .reference import chain as _reference


class ChainVerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, K+1] int32: accepted drafts, correction/bonus, then -1
    num_accepted: torch.Tensor      # [B] int32


@_backend.on_input_device
def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, *,
                 draft_probs: Optional[torch.Tensor] = None,
                 draft_logits: Optional[torch.Tensor] = None,
                 num_draft_tokens: PerRequest = None, temperature: PerRequest = None,
                 top_k: PerRequest = None, top_p: PerRequest = None, seed: PerRequest = None,
                 offset: PerRequest = None, backend: str = "auto",
                 validate: bool = True) -> ChainVerifyOutput:
    r"""Verify a batch of draft chains exactly (speculative sampling, Leviathan et al. / Chen et al.).

    For request ``b`` with ``n = num_draft_tokens[b]`` drafts: greedy requests
    (``temperature == 0``) accept drafts while they equal the target arg-max and then emit the
    arg-max; sampled requests accept draft ``j`` when ``u_j * q_j(d_j) < p_j(d_j)`` and emit,
    at the first rejection, a sample of ``norm(max(p_j - q_j, 0))`` (``p_j`` if no mass is left),
    or, when all ``n`` were accepted, a bonus sample of ``p_{n+1}``. The emitted tokens are
    distributed exactly as tokens sampled one by one from the processed target distribution.

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
        temperature, top_k, top_p: per request, as in :func:`processed_probs`.
        seed, offset: per request, as in :func:`sample`; the acceptance uniforms and the
            correction noise are separate Philox streams keyed by them.
        backend: ``"auto"`` (Triton for CUDA tensors, reference for CPU tensors),
            ``"reference"`` or ``"triton"`` (CPU tensors need ``TRITON_INTERPRET=1``).
        validate: check ids, lengths and parameter values (reads only those small tensors).

    Returns:
        ChainVerifyOutput with
        ``output_token_ids``: Shape ``(batch_size, K + 1)``; int32: the accepted
        drafts, then one correction or bonus token, then ``-1``.
        ``num_accepted``: Shape ``(batch_size,)``; int32; the request emits
        ``num_accepted + 1`` tokens.

    >>> import torch, specdec_kernels as sk
    >>> logits = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]])
    >>> sk.verify_chain(logits, torch.tensor([[1, 2]]), temperature=0.0)
    ChainVerifyOutput(output_token_ids=tensor([[ 1,  0, -1]], dtype=torch.int32), num_accepted=tensor([1], dtype=torch.int32))
    """
    batch, rows, vocab = _params.check_verify_logits(target_logits, "target_logits", "K+1")
    device = target_logits.device
    num_drafts = rows - 1  # K
    _params.check_tensor(draft_token_ids, "draft_token_ids", dtypes=_params.INDEX_DTYPES,
                         device=device)
    _params.check_shape(draft_token_ids, "draft_token_ids", [batch, num_drafts],
                        "[B, K] from target_logits [B, K+1, V]")
    if draft_probs is not None and draft_logits is not None:
        raise ValueError("draft_probs, draft_logits: expected at most one of them, got both")
    for name, draft in (("draft_probs", draft_probs), ("draft_logits", draft_logits)):
        if draft is not None:
            dtypes = _params.LOGIT_DTYPES if name == "draft_logits" else \
                _params.LOGIT_DTYPES + (torch.float64,)
            _params.check_tensor(draft, name, dtypes=dtypes, device=device)
            _params.check_shape(draft, name, [batch, num_drafts, vocab],
                                "[B, K, V] from target_logits [B, K+1, V]")
    use_triton = _backend.resolve(backend, device) == "triton"
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=device, validate=validate)
    num_draft_tokens = _params.per_request(num_draft_tokens, "num_draft_tokens", batch, device,
                                           torch.int32, num_drafts)
    if validate:
        _check_chain_values(draft_token_ids, num_draft_tokens, num_drafts, vocab)
    num_draft_tokens = _params.narrow_int32(num_draft_tokens, 0, num_drafts)
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)

    if use_triton:
        from .triton import chain as _triton
        out, accepted = _triton.verify_chain(target_logits, draft_token_ids, draft_probs,
                                             draft_logits, num_draft_tokens, params, seeds,
                                             offsets)
    else:
        out, accepted = _reference.verify_chain(target_logits, draft_token_ids, draft_probs,
                                                draft_logits, num_draft_tokens, params.temperature,
                                                params.top_k, params.top_p, seeds, offsets)
    return ChainVerifyOutput(out, accepted)


def _check_chain_values(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                        num_drafts: int, vocab: int) -> None:
    bad = (num_draft_tokens < 0) | (num_draft_tokens > num_drafts)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"num_draft_tokens: expected values in 0..{num_drafts} (K), "
                         f"got {int(num_draft_tokens[b])} for request {b}")
    live = torch.arange(num_drafts, device=num_draft_tokens.device) < num_draft_tokens[:, None]
    out_of_range = live & ((draft_token_ids < 0) | (draft_token_ids >= vocab))
    if bool(out_of_range.any()):
        b, j = (int(i) for i in out_of_range.nonzero()[0])
        raise ValueError(f"draft_token_ids: expected ids in [0, {vocab}) for the first "
                         f"num_draft_tokens[b] entries, got {int(draft_token_ids[b, j])} "
                         f"at [{b}, {j}]")
