"""Helpers to cut whole-row tensors into a rank's vocabulary shard (tests, engines, benches).

``shard_columns`` cuts the last dimension of logits / probabilities, padding past the true
vocabulary with a fill value; ``shard_bitmask`` re-packs an xgrammar bitmask (``ceil(V/32)``
words, bit ``v % 32`` of word ``v // 32``) into the shard's own words: bit ``c % 32`` of word
``c // 32`` is the shard's column ``c`` (global id ``start + c``). When ``start`` is a
multiple of 32 (engines' shards start at multiples of 32 or 64) these are exactly the global
words ``start // 32 ..`` with the bits past ``vocab_size`` cleared, so an engine can slice the
matcher's bitmask instead of calling this.
"""
from __future__ import annotations

import torch

from ..reference.sampling import allowed_tokens


def even_shards(vocab_size: int, world: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``(start, width)`` per rank: equal widths rounded up to ``multiple`` (vLLM pads the
    vocabulary the same way), the last shard running past ``vocab_size`` into padding."""
    width = -(-vocab_size // world)
    width = -(-width // multiple) * multiple
    return [(r * width, width) for r in range(world)]


def shard_columns(x: torch.Tensor, start: int, width: int, fill: float) -> torch.Tensor:
    """Columns ``start .. start + width - 1`` of ``x`` ``[..., V]``, ``fill`` past ``V``."""
    vocab = x.shape[-1]
    part = x[..., start:min(start + width, vocab)]
    missing = width - part.shape[-1]
    if missing:
        pad = torch.full(x.shape[:-1] + (missing,), fill, dtype=x.dtype, device=x.device)
        part = torch.cat([part, pad], -1)
    return part.contiguous()


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(W/32)]`` words of a bool ``[..., W]`` mask (bit ``c % 32`` of word
    ``c // 32``)."""
    width = allowed.shape[-1]
    words = -(-width // 32)
    bits = torch.nn.functional.pad(allowed.to(torch.int64), (0, words * 32 - width))
    bits = bits.view(*allowed.shape[:-1], words, 32)
    value = (bits << torch.arange(32, device=allowed.device)).sum(-1)
    value = torch.where(value >= 2**31, value - 2**32, value)  # as int32's two's complement
    return value.to(torch.int32)


def shard_bitmask(bitmask: torch.Tensor, start: int, width: int,
                  vocab_size: int) -> torch.Tensor:
    """The shard's bitmask ``[..., ceil(width/32)]`` from the whole-row bitmask."""
    allowed = allowed_tokens(bitmask, vocab_size)
    return pack_bits(shard_columns(allowed, start, width, False))
