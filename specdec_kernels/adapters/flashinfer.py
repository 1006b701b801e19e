"""FlashInfer's ``flashinfer.sampling.chain_speculative_sampling``, computed by our exact chain.

Follows ``flashinfer/sampling.py`` and ``include/flashinfer/sampling.cuh`` of
flashinfer-ai/flashinfer as read at commits ba1f2066 (Python API) and 5c8b5361 (kernel): the
same positional arguments, shapes, return tuple and in-place counter semantics. Swap

    from flashinfer.sampling import chain_speculative_sampling
    from specdec_kernels.adapters.flashinfer import chain_speculative_sampling

What differs (each also in the docstring):
* Randomness: our Philox stream keyed per request. ``seed`` may be a ``[B]`` int64 tensor (one
  seed per request, honoured: the tokens of a request depend on its own seed and offset, never
  on its row). FlashInfer takes one ``int`` for the batch and keys row ``b`` by its position;
  an int here does the same (request ``b`` uses seed ``seed + b``), so rows stay independent.
  ``generator`` (when ``seed`` is None) gives one fresh seed per request per call.
* ``deterministic`` is accepted for compatibility; ours is always deterministic (no atomics:
  the same inputs and seeds give the same tokens on every run, backend and device).
* Probabilities in: ``log(target_probs)`` is fed to the kernels as logits with temperature 1
  (a zero probability becomes ``-inf``, never sampled): one elementwise pass that writes a
  float32 ``[B, K+1, V]`` copy, and one reduction over ``target_probs`` for the accepted
  count. ``draft_probs`` are read as they are. With logits at hand, ``verify_chain`` on them
  costs neither.
* FlashInfer resamples from ``max(target - draft, 0)`` of the raw inputs; we from
  ``norm(max(p - q, 0))`` with ``p = target_probs / sum(target_probs)`` -- the same law
  when rows sum to 1, and exact when they do not.
* Counters: int32 or int64 tensors are both updated in place (FlashInfer converts with
  ``.int()``, so an int64 counter silently keeps its old value there).
* FlashInfer's annotation says ``-> torch.Tensor``; both return the 3-tuple.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _params, _rng
from ..chain import verify_chain
from ._common import check_counter, logits_from_probs, seeds_from_generator

__all__ = ["chain_speculative_sampling"]


def chain_speculative_sampling(
        draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
        maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
        maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
        deterministic: bool = True, generator: Optional[torch.Generator] = None,
        seed=None, offset=None, *, backend: str = "auto",
        validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Chain speculative sampling in FlashInfer's call shape, exact, per-request seeds.

    Parameters
    ----------
    draft_probs: torch.Tensor
        The distribution each draft token was drawn from.
        Shape: ``(batch_size, num_speculate_tokens, vocab_size)``; float32/bf16/fp16/float64.
    draft_token_ids: torch.Tensor
        The drafted tokens. Shape: ``(batch_size, num_speculate_tokens)``; int32 or int64.
    target_probs: torch.Tensor
        The target model's probabilities at each draft position and the bonus position.
        Shape: ``(batch_size, num_speculate_tokens + 1, vocab_size)``; float dtype. Taken as
        logits ``log(target_probs)`` with temperature 1 (cost: one pass writing a float32
        copy of this shape).
    maybe_output_accepted_token_num: Optional[torch.Tensor]
        If given, the number of drafts that pass their acceptance test *independently* of
        the earlier ones (FlashInfer's alignment metric: the chain stops at the first
        rejection, this count does not) is added to it in place.
        Shape: ``(batch_size,)``; int32 or int64.
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor]
        If given, the number of emitted drafts (the bonus/correction token excluded) is
        added to it in place. Shape: ``(batch_size,)``; int32 or int64.
    deterministic: bool
        Accepted for compatibility: ours is always deterministic.
    generator: Optional[torch.Generator]
        When ``seed`` is None, one seed per request is drawn from it (None: torch's default
        generator).
    seed: int or torch.Tensor
        ``(batch_size,)`` int64 tensor: request ``b``'s own Philox seed (a permuted batch
        gives permuted outputs). Python int: the batch's seed, request ``b`` keyed by
        ``seed + b`` (FlashInfer's convention: rows are independent streams).
    offset: int or torch.Tensor
        Per-request (``(batch_size,)`` int64) or shared step counter; default 0. Use a new
        offset (or seed) every step.
    backend, validate:
        As in :func:`specdec_kernels.verify_chain`.

    Returns
    -------
    output_token_ids: torch.Tensor
        Accepted drafts, then one correction or bonus token, then ``-1``.
        Shape: ``(batch_size, num_speculate_tokens + 1)``; int32.
    output_accepted_token_num: torch.Tensor
        The counter given (updated in place) or a new int32 one. Shape: ``(batch_size,)``.
    output_emitted_draft_token_num: torch.Tensor
        The counter given (updated in place) or a new int32 one. Shape: ``(batch_size,)``.

    FlashInfer's documented example (its draft 1 has ratio p/q = 2, always accepted; draft 2
    has p = 0, always rejected, and the residual is one-hot at token 0):

    >>> import torch
    >>> from specdec_kernels.adapters.flashinfer import chain_speculative_sampling
    >>> draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    >>> draft_token_ids = torch.tensor([[2, 1]], dtype=torch.int32)
    >>> target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0],
    ...                               [0.7, 0.1, 0.1, 0.1]]])
    >>> output_token_ids, output_accepted_token_num, output_emitted_draft_token_num = \
    ...     chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seed=42)
    >>> output_token_ids
    tensor([[ 2,  0, -1]], dtype=torch.int32)
    >>> output_accepted_token_num, output_emitted_draft_token_num
    (tensor([1], dtype=torch.int32), tensor([1], dtype=torch.int32))
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _params.check_tensor(draft_probs, "draft_probs", ndim=3)
    batch, num_drafts, vocab = draft_probs.shape
    device = draft_probs.device
    _params.check_tensor(target_probs, "target_probs", ndim=3, device=device)
    _params.check_shape(target_probs, "target_probs", [batch, num_drafts + 1, vocab],
                        "[B, K+1, V] from draft_probs [B, K, V]")
    check_counter(maybe_output_accepted_token_num, "maybe_output_accepted_token_num", batch, device)
    check_counter(maybe_output_emitted_draft_token_num, "maybe_output_emitted_draft_token_num",
                  batch, device)
    seeds = _request_seeds(seed, generator, batch, device)
    target_logits = logits_from_probs(target_probs, "target_probs")
    out = verify_chain(target_logits, draft_token_ids, draft_probs=draft_probs, temperature=1.0,
                       seed=seeds, offset=offset, backend=backend, validate=validate)
    # The [B] seeds the op used (drawn once, inside it) and offsets, for the count below.
    seeds, offsets = _params.seeds_and_offsets(seeds, offset, batch=batch, device=device)

    independent = _independently_accepted(target_probs, draft_probs, draft_token_ids,
                                          out.num_accepted, seeds, offsets)
    accepted_num = maybe_output_accepted_token_num
    if accepted_num is None:
        accepted_num = torch.zeros(batch, dtype=torch.int32, device=device)
    emitted_num = maybe_output_emitted_draft_token_num
    if emitted_num is None:
        emitted_num = torch.zeros(batch, dtype=torch.int32, device=device)
    accepted_num.add_(independent.to(accepted_num.dtype))
    emitted_num.add_(out.num_accepted.to(emitted_num.dtype))
    return out.output_token_ids, accepted_num, emitted_num


def _request_seeds(seed, generator, batch: int, device: torch.device):
    """The ``seed`` verify_chain takes: a tensor seed per request, an int seed FlashInfer's
    way (``seed + b``), None from ``generator`` or torch's default generator -- drawn by the op
    once it has checked its arguments (``DeferredSeeds``): a rejected call advances no
    generator."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    if seed is None:
        source = torch.default_generator if generator is None else generator
        seed = _params.DeferredSeeds(lambda: seeds_from_generator(source, batch, device))
    elif not isinstance(seed, (torch.Tensor, bool)):
        seed = _params._as_int64(seed, "seed")
        if isinstance(seed, int):  # wraps like the int64 the kernels read
            seed = torch.arange(batch, dtype=torch.int64, device=device) + seed
    return seed


def _independently_accepted(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
                            seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """FlashInfer's ``output_accepted_token_num``: the emitted drafts plus the later drafts
    that pass ``u_j * q_j(d_j) < p_j(d_j)`` with their own acceptance uniform (section 2's
    stream; the chain itself stops at the first rejection). Reads one ``[B, K]`` gather and
    the row sums of ``target_probs`` (``p = target_probs / sum``, as the kernels see it)."""
    batch, num_drafts, vocab = draft_probs.shape
    if num_drafts == 0:
        return num_accepted
    ids = draft_token_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < vocab)
    ids = ids.clamp(0, vocab - 1)[..., None]
    rows = target_probs[:, :num_drafts]
    p = rows.gather(-1, ids)[..., 0].double() / rows.sum(-1, dtype=torch.float64)
    q = draft_probs.gather(-1, ids)[..., 0].double()
    position = torch.arange(num_drafts, device=ids.device)
    u = _rng.uniform(seeds[:, None], offsets[:, None], position + 1, _rng.PURPOSE_ACCEPT)
    later = position[None] > num_accepted[:, None].to(torch.int64)
    passes = later & in_range & (u.double() * q < p)
    return num_accepted + passes.sum(-1).to(num_accepted.dtype)
