"""FlashInfer's ``flashinfer.sampling.chain_speculative_sampling``, computed by our exact chain.

Follows flashinfer-python 0.7.4 (the newest release on the package index):
``flashinfer/sampling.py`` (``chain_speculative_sampling``, ``get_seed_and_offset``,
``_validate_and_convert_seed_offset``) and ``include/flashinfer/sampling.cuh``
(``ChainSpeculativeSampling``). The same positional arguments, defaults, shapes, return
tuple, in-place counters and seed/offset rules. Swap

    from flashinfer.sampling import chain_speculative_sampling
    from specdec_kernels.adapters.flashinfer import chain_speculative_sampling

As FlashInfer 0.7.4 does:
* ``seed``/``offset``: when either is None, both are drawn from ``generator`` (None: the
  device's default generator) -- on a CUDA (Philox) generator exactly as FlashInfer's
  ``get_seed_and_offset``: its seed and current offset, the offset then advanced by
  ``B * (K + 2)`` rounded up to 4; on a CPU generator (FlashInfer has no CPU path) two
  int64 words drawn from it. Otherwise each is a Python int or a 1-D int64/uint64 tensor
  on the probabilities' device of length 1 or ``B`` (FlashInfer wants both of one kind; an
  int with a tensor broadcasts here). Seeds are never drawn by a call that is then rejected (the generator
  is put back), and ``seed=None`` while capturing a CUDA graph is a ValueError (FlashInfer
  would bake one seed into the graph).
* Streams: FlashInfer keys row ``b`` by ``(seed, subsequence b, offset)``. Here a batch-wide
  seed (an int or a ``[1]`` tensor) keys row ``b`` by ``seed + b * 0x9E3779B97F4A7C15``
  (mod 2**64) with the offset unchanged: rows of one call never share a stream, and two
  calls never do unless their offsets are equal and their seeds differ by a multiple of the
  stride -- at least 2**43 apart for batches below 2**20 rows (a step counter as seed, or
  a new offset per call, never collides).
* ``maybe_output_accepted_token_num`` (FlashInfer's alignment metric): the emitted drafts
  plus the later drafts, after the first rejected one, that pass ``u * q(x) < p(x)`` with
  their own acceptance uniform -- the rejected position itself not counted again.
  ``maybe_output_emitted_draft_token_num``: the emitted drafts (correction/bonus excluded).
  Both are added to in place and returned as the same tensors; new int32 zeros when None.
* A row with no mass: a target row of zeros rejects its draft (``p(x) = 0``) and emits
  ``-1`` as its token (FlashInfer's sampler finds no positive entry and writes its
  ``last_valid_id``, ``-1``); ``emitted_num`` counts the drafts before it.

Differences, each where ours is exact and FlashInfer's is not (also in docs/engines.md):
* Per-request seeds (our extension): a ``[B]`` seed tensor is request ``b``'s own Philox
  seed, so a request's tokens depend on its seed and offset, never on its row (FlashInfer
  still mixes the row into a ``[B]`` seed's stream).
* The residual: FlashInfer samples ``max(target - draft, 0)`` of the raw inputs and, when
  that has no mass (rounding when ``p == q``, or rows that do not sum to 1), emits ``-1``;
  we sample ``norm(max(p - q, 0))`` with ``p = target_probs / sum(target_probs)`` and fall
  back to ``p`` when the residual has no mass (contract section 3) -- the target's law.
* Uniforms: ours are Philox words in ``[0, 1)`` with exact tails (contract section 11);
  FlashInfer's ``curand_uniform`` is 24-bit in ``(0, 1]`` (so it rejects ``p == q`` with
  probability 2**-24). Tokens for a given seed differ; laws agree.
* Validation: bad shapes, dtypes and devices are ValueError/TypeError naming the argument;
  token ids outside ``[0, V)`` too where reading them costs no synchronisation
  (``validate=None``: CPU tensors, eager; FlashInfer reads out of bounds).
* int64 counters are updated in place (FlashInfer's ``.int()`` copy drops their update).
* ``deterministic`` is accepted; ours is always deterministic.
* Probabilities in: ``log(target_probs)`` is fed to the kernels as logits with temperature 1
  (a zero probability becomes ``-inf``, never sampled): one elementwise pass that writes a
  float32 ``[B, K+1, V]`` copy, and one reduction over ``target_probs`` for the accepted
  count. ``draft_probs`` are read as they are. With logits at hand, ``verify_chain`` on them
  costs neither.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _cpu, _params, _rng
from ..chain import verify_chain
from ._common import (capturing_cuda_graph, check_counter, logits_from_probs,
                      restoring_generator, row_seeds, value_checks_wanted)

__all__ = ["chain_speculative_sampling"]

ENGINE_VERSION = "flashinfer-python 0.7.4"


def chain_speculative_sampling(
        draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
        maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
        maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
        deterministic: bool = True, generator: Optional[torch.Generator] = None,
        seed=None, offset=None, *, backend: str = "auto",
        validate: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Chain speculative sampling in FlashInfer 0.7.4's call shape, exact.

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
        If given, FlashInfer's alignment metric is added to it in place: the emitted drafts
        plus the drafts after the first rejected one that pass their own acceptance test
        (the chain stops at the first rejection; this count does not).
        Shape: ``(batch_size,)``; int32 or int64.
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor]
        If given, the number of emitted drafts (the bonus/correction token excluded) is
        added to it in place. Shape: ``(batch_size,)``; int32 or int64.
    deterministic: bool
        Accepted for compatibility: ours is always deterministic.
    generator: Optional[torch.Generator]
        When ``seed`` or ``offset`` is None, both are drawn from it (None: the device's
        default generator), as FlashInfer does.
    seed: Optional[Union[int, torch.Tensor]]
        With ``offset``: a Python int, or a 1-D int64/uint64 tensor of length 1 (the batch's
        seed; row ``b`` keyed by ``seed + b * 0x9E3779B97F4A7C15``) or ``batch_size``
        (request ``b``'s own seed, honoured whatever its row: our extension).
    offset: Optional[Union[int, torch.Tensor]]
        With ``seed``: a Python int or a 1-D int64/uint64 tensor of length 1 or
        ``batch_size`` (a step counter). Use a new offset (or seed) every step.
    backend:
        As in :func:`specdec_kernels.verify_chain`.
    validate: Optional[bool]
        None (default): value checks (token ids in range) only on CPU tensors, eager,
        where they cost no synchronisation; True/False force them on or off.

    Returns
    -------
    output_token_ids: torch.Tensor
        Accepted drafts, then one correction or bonus token, then ``-1``.
        Shape: ``(batch_size, num_speculate_tokens + 1)``; int32.
    output_accepted_token_num: torch.Tensor
        The counter given (updated in place) or a new int32 one. Shape: ``(batch_size,)``.
    output_emitted_draft_token_num: torch.Tensor
        The counter given (updated in place) or a new int32 one. Shape: ``(batch_size,)``.

    FlashInfer's documented example (draft 1 has ratio p/q = 2, always accepted; draft 2
    has p = 0, always rejected, and the residual is one-hot at token 0):

    >>> import torch
    >>> from specdec_kernels.adapters.flashinfer import chain_speculative_sampling
    >>> _ = torch.manual_seed(42)
    >>> draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    >>> draft_token_ids = torch.tensor([[2, 1]], dtype=torch.int32)
    >>> target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0],
    ...                               [0.7, 0.1, 0.1, 0.1]]])
    >>> output_token_ids, output_accepted_token_num, output_emitted_draft_token_num = \
    ...     chain_speculative_sampling(draft_probs, draft_token_ids, target_probs)
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
    if vocab < 1:  # else verify_chain would name target_logits, which the caller never passed
        raise ValueError(f"target_probs, draft_probs: expected V >= 1 tokens (dim 2), got "
                         f"shapes {list(target_probs.shape)} and {list(draft_probs.shape)}")
    check_counter(maybe_output_accepted_token_num, "maybe_output_accepted_token_num", batch, device)
    check_counter(maybe_output_emitted_draft_token_num, "maybe_output_emitted_draft_token_num",
                  batch, device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    values = value_checks_wanted(validate, device)
    drawing = seed is None or offset is None
    source = None
    if drawing:
        if capturing_cuda_graph(device):
            raise ValueError("seed: expected seed and offset tensors while capturing a CUDA "
                             "graph (drawn from the generator, they would be baked into it)")
        source = _default_generator(device) if generator is None else generator
    else:
        seed, offset = _checked_seed_and_offset(seed, offset, batch, device)
    with restoring_generator(source):
        if drawing:
            seed, offset = _seed_and_offset_from_generator(source, batch, num_drafts)
        seeds = seed if isinstance(seed, torch.Tensor) and seed.numel() == batch != 1 \
            else row_seeds(seed, batch, device)
        target_logits = logits_from_probs(target_probs, "target_probs")
        out = verify_chain(target_logits, draft_token_ids, draft_probs=draft_probs,
                           temperature=1.0, seed=seeds, offset=offset, backend=backend,
                           validate=values)
    accepted_num, emitted_num = _counters(maybe_output_accepted_token_num,
                                          maybe_output_emitted_draft_token_num, batch, device)
    seeds, offsets = _params.seeds_and_offsets(seeds, offset, batch=batch, device=device)
    if not _cpu.flashinfer_counts(target_probs, draft_probs, draft_token_ids, out.num_accepted,
                                  seeds, offsets, accepted_num, emitted_num):
        independent = _independently_accepted(target_probs, draft_probs, draft_token_ids,
                                              out.num_accepted, seeds, offsets)
        accepted_num.add_(independent.to(accepted_num.dtype))
        emitted_num.add_(out.num_accepted.to(emitted_num.dtype))
    return out.output_token_ids, accepted_num, emitted_num


def _counters(accepted, emitted, batch: int, device: torch.device):
    """The counters given, or new int32 zeros."""
    return tuple(torch.zeros(batch, dtype=torch.int32, device=device) if c is None else c
                 for c in (accepted, emitted))


def _default_generator(device: torch.device) -> torch.Generator:
    """FlashInfer's ``get_default_generators(device)``: the CUDA device's default generator,
    torch's CPU one for CPU tensors."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _seed_and_offset_from_generator(generator: torch.Generator, batch: int, num_drafts: int):
    """FlashInfer's ``get_seed_and_offset(B * (K + 2), generator)`` on a Philox (CUDA)
    generator: its seed and offset, the offset advanced past this call's range (rounded up
    to 4). A CPU (Mersenne Twister) generator has no offset: two int64 words drawn from it."""
    state = generator.get_state()
    if state.numel() == 16:
        seed, offset = map(int, state.view(torch.int64))
        increment = batch * (num_drafts + 2)
        generator.set_state(torch.tensor([seed, offset + (increment + 3) // 4 * 4],
                                         dtype=torch.int64).view(torch.uint8))
        return seed, offset
    words = torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, generator=generator)
    seed, offset = words.tolist()  # a CPU generator's tensor: no device synchronisation
    return seed, offset


def _checked_seed_and_offset(seed, offset, batch: int, device: torch.device):
    """FlashInfer's ``_validate_and_convert_seed_offset``: tensors 1-D int64/uint64 on
    ``device`` of length 1 or ``batch`` (uint64 read as the same 64 bits), or Python ints.
    FlashInfer refuses a tensor with an int; we take it (the int broadcasts: an extension no
    FlashInfer call meets). Returns int64 tensors (offset 0-D or ``[batch]``) or ints."""
    checked = []
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, torch.Tensor):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected a Python int or a tensor, "
                                f"got {type(value).__name__}")
            checked.append(_params._as_int64(value, name))
            continue
        if value.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {value.device}")
        if value.dtype not in (torch.int64, torch.uint64):
            raise ValueError(f"{name}: expected an int64/uint64 tensor, got dtype "
                             f"{str(value.dtype).replace('torch.', '')}")
        if value.dim() != 1 or value.shape[0] not in (1, batch):
            raise ValueError(f"{name}: expected a 1-D tensor of length 1 or {batch}, got "
                             f"shape {list(value.shape)}")
        checked.append(value.view(torch.int64) if value.dtype == torch.uint64 else value)
    seed, offset = checked
    if isinstance(offset, torch.Tensor) and offset.shape[0] == 1 != batch:
        offset = offset.reshape(())  # (a [1] offset of one request is already per request)
    return seed, offset


def _independently_accepted(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
                            seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """FlashInfer's ``output_accepted_token_num``: the emitted drafts plus the drafts after
    the first rejected one that pass ``u_j * q_j(d_j) < p_j(d_j)`` with their own acceptance
    uniform (section 2's stream). Reads one ``[B, K]`` gather and the row sums of
    ``target_probs`` (``p = target_probs / sum``, as the kernels see it)."""
    batch, num_drafts, vocab = draft_probs.shape
    if num_drafts == 0 or batch == 0:
        return num_accepted
    ids = draft_token_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < vocab)
    ids = ids.clamp(0, vocab - 1)[..., None]
    rows = target_probs[:, :num_drafts]
    p = rows.gather(-1, ids)[..., 0].double() / rows.sum(-1, dtype=torch.float64)
    q = draft_probs.gather(-1, ids)[..., 0].double()
    position = torch.arange(num_drafts, device=ids.device)
    stream = (seeds[:, None], offsets[:, None], position + 1, _rng.PURPOSE_ACCEPT)
    u = _cpu.uniform(*stream)  # (one C++ op on CPU tensors; else the torch Philox)
    if u is None:
        u = _rng.uniform(*stream)
    later = position[None] > num_accepted[:, None].to(torch.int64)
    passes = later & in_range & (u.double() * q < p)
    return num_accepted + passes.sum(-1).to(num_accepted.dtype)
