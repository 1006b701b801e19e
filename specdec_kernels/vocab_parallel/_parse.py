"""Argument checks of the sharded ops: local checks first, then one agreement collective.

A local check that fails is not raised at once: it travels in the agreement vector, so every
rank raises it (a rank that raised alone would leave the others waiting in a collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _params
from ._comm import Comm, VocabShard, digest

DTYPES = _params.LOGIT_DTYPES + (torch.float64,)  # float64: the exactness tests' rows
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
OPS = {"verify_chain": 1, "verify_chain_packed": 2, "sample": 3, "verify_tree": 4}
METHODS = ("token", "block")
LOGPROBS = (None, "processed", "raw")


def check_shard(vocab_shard) -> VocabShard:
    if not isinstance(vocab_shard, VocabShard):
        raise TypeError(f"vocab_shard: expected a specdec_kernels.VocabShard, "
                        f"got {type(vocab_shard).__name__}")
    return vocab_shard


def open_comm(vocab_shard, logits) -> Comm:
    """The call's :class:`Comm`; only a wrong ``vocab_shard`` (no group to tell) or a missing
    process group raises here, before any collective."""
    shard = check_shard(vocab_shard)
    is_tensor = isinstance(logits, torch.Tensor)
    width = int(logits.shape[-1]) if is_tensor and logits.dim() else 0
    device = logits.device if is_tensor else torch.device("cpu")
    return Comm(shard, width, device)


@dataclass
class Common:
    """The parsed arguments every sharded op shares."""
    params: object  # _params.SamplingParams (vocabulary = the true vocab_size)
    seeds: torch.Tensor
    offsets: torch.Tensor
    names: list
    values: list
    seed_drawn: bool = False  # seed=None: every rank takes the first shard's draw (agree)


def check_logits(logits, name: str, ndim: int) -> torch.Tensor:
    _params.check_tensor(logits, name, ndim=ndim, dtypes=DTYPES)
    if logits.shape[-1] < 1:
        raise ValueError(f"{name}: expected a vocabulary slice of width >= 1, "
                         f"got shape {list(logits.shape)}")
    return logits


def check_bitmask(bitmask, lead, width: int, device, what: str):
    """The shard's bitmask: ``ceil(width / 32)`` words of its own columns (bit ``c % 32`` of
    word ``c // 32`` is local column ``c``, global id ``start + c``)."""
    if bitmask is None:
        return None
    _params.check_tensor(bitmask, "token_bitmask", dtypes=(torch.int32,), device=device)
    _params.check_shape(bitmask, "token_bitmask", list(lead) + [-(-width // 32)],
                        f"{what}: ceil(width / 32) words of this shard's columns")
    return bitmask


def check_options(method: Optional[str], return_logprobs, backend, unsupported: dict) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    _params.check_return_logprobs(return_logprobs)
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend: with vocab_shard, expected 'auto' or 'reference' (the "
                         f"per-shard summaries run in PyTorch), got {backend!r}")
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"{name}: not supported with vocab_shard (pass None)")


def common(shard: VocabShard, batch: int, device, temperature, top_k, top_p, min_p, seed,
           offset, validate: bool) -> Common:
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch,
                                     vocab_size=shard.vocab_size, device=device,
                                     validate=validate, min_p=min_p)
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    drawn = seed is None
    names, values = ["batch size", "validate", "uses_top_k", "uses_top_p", "uses_min_p",
                     "seed=None"], \
        [batch, int(validate), int(params.uses_top_k), int(params.uses_top_p),
         int(params.uses_min_p), int(drawn)]
    if validate:  # digests read the small tensors on the host
        for name, value in (("temperature", params.temperature), ("top_k", params.top_k),
                            ("top_p", params.top_p), ("min_p", params.min_p),
                            ("seed", None if drawn else seeds), ("offset", offsets)):
            names.append(f"{name} (digest)")
            values.append(digest(value))
    return Common(params, seeds, offsets, names, values, drawn)


def dtype_code(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else _DTYPE_CODES.get(t.dtype, 9)


def agree(comm: Comm, parse) -> object:
    """Run ``parse()`` (returning an object with ``names``/``values``), catching its
    ValueError/TypeError, and exchange the agreement vector; returns the parsed object."""
    parsed, error = None, None
    try:
        parsed = parse()
    except (ValueError, TypeError) as err:
        error = err
    names = parsed.names if parsed is not None else []
    values = parsed.values if parsed is not None else []
    comm.agree(names, values, error)
    common = getattr(parsed, "common", parsed)
    if common.seed_drawn:  # each rank drew its own: all take the first shard's seeds
        first = comm.rank == comm.order[0]
        common.seeds = comm.reduce_sum(common.seeds * int(first))
    return parsed
