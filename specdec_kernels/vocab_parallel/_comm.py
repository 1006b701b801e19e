"""The collectives of the sharded ops, in one place that counts them (contract section 17).

Every exchange of the vocabulary-parallel path goes through :class:`Comm`: an all-gather of
small float64 / int64 summaries (combined locally in the order of the shards' starts, so every
rank computes bit-identical results) or an all-reduce of int64 histograms (integer sums are
exact in any order). :func:`count_collectives` records the calls and the bytes each rank
receives, which the tests bound by ``O(rows x P)``.

Before any computation the ranks exchange one fixed-size agreement vector (:meth:`Comm.agree`):
shapes other than the vocabulary's, flags, digests of the parameters, seeds and offsets, the
shard and any local validation error. A disagreement or an error on one rank becomes the same
exception on every rank; nothing else is exchanged before it, so no rank waits on a collective
that another rank never calls.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary (contract section 17).

    ``start``: the first global token id of the rank's last dimension; ``vocab_size``: the
    true (unpadded) vocabulary; ``group``: the ``torch.distributed`` process group (``None``:
    the default group). The slice's width is the last dimension of the logits; columns past
    ``vocab_size`` are padding (never emitted, zero probability).
    """
    start: int
    vocab_size: int
    group: Optional[object] = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("start", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"vocab_shard.{name}: expected a Python int, "
                                f"got {type(value).__name__}")
        if self.start < 0:
            raise ValueError(f"vocab_shard.start: expected >= 0, got {self.start}")
        if not 1 <= self.vocab_size < 2**31:
            raise ValueError(f"vocab_shard.vocab_size: expected 1 <= V < 2**31, "
                             f"got {self.vocab_size}")


@dataclass
class CollectiveStats:
    """Collectives issued and bytes received by this rank while counting."""
    calls: int = 0
    bytes_received: int = 0
    kinds: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls += 1
        self.bytes_received += nbytes
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


AGREEMENT_SLOTS = 40  # named values of the agreement vector (the most any op sends)

_COUNTERS: list = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def count_collectives():
    """``with count_collectives() as stats:`` records every collective of the sharded ops in
    the block (``stats.calls``, ``stats.bytes_received``, ``stats.kinds``). The agreement
    collective is counted too. Bytes: an all-gather of ``n`` bytes per rank brings
    ``(P - 1) n``; an all-reduce of ``n`` bytes counts ``2 (P - 1) / P n`` (a ring's traffic)."""
    stats = CollectiveStats()
    with _LOCK:
        _COUNTERS.append(stats)
    try:
        yield stats
    finally:
        with _LOCK:
            _COUNTERS.remove(stats)


def _record(kind: str, nbytes: int) -> None:
    for stats in list(_COUNTERS):
        stats.add(kind, nbytes)


def digest(value) -> int:
    """A 62-bit digest of a small tensor's values (or of a Python value's repr): what the
    agreement vector carries instead of the values. Reads the tensor on the host."""
    if value is None:
        return 0
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(value).encode())
    return (int.from_bytes(h.digest(), "little") >> 2) + 1


class Comm:
    """The process group of one sharded call and the collectives it issues."""

    def __init__(self, shard: VocabShard, width: int, device: torch.device):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("vocab_shard: torch.distributed is not initialised "
                             "(call torch.distributed.init_process_group first)")
        self.group = shard.group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        self.shard = shard
        self.width = width
        self.order = list(range(self.world))  # ranks by shard start, set by agree()

    # -- the two collectives -------------------------------------------------------------
    def gather(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """All-gather float64 tensors (one collective for all of them): for each part a
        ``[P, *part.shape]`` tensor, ranks in the order of their shards' starts."""
        flat = torch.cat([p.to(torch.float64).reshape(-1) for p in parts]) if parts else \
            torch.zeros(0, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(out, flat.contiguous(), group=self.group)
        _record("all_gather", (self.world - 1) * flat.numel() * 8)
        stacked = torch.stack([out[r] for r in self.order])
        result, begin = [], 0
        for p in parts:
            result.append(stacked[:, begin:begin + p.numel()].reshape((self.world,) + p.shape))
            begin += p.numel()
        return result

    def reduce_sum(self, counts: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of an int64 tensor: exact and identical on every rank."""
        counts = counts.to(torch.int64).contiguous()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        _record("all_reduce", 2 * (self.world - 1) * counts.numel() * 8 // self.world)
        return counts

    # -- the agreement -------------------------------------------------------------------
    def agree(self, names: Sequence[str], values: Sequence[int],
              error: Optional[BaseException]) -> None:
        """Exchange ``values`` (named, Python ints), the shard and any local error; raise the
        same exception on every rank when a rank failed, the ranks disagree, or the shards do
        not tile ``[0, vocab_size)``. Sets :attr:`order`."""
        fixed = [0 if error is None else 1, self.shard.start, self.width,
                 self.shard.vocab_size, len(values)]
        # Fixed size whatever the op: ranks calling different ops still meet in one collective.
        padded = [int(v) for v in values] + [0] * (AGREEMENT_SLOTS - len(values))
        vec = torch.tensor(fixed + padded[:AGREEMENT_SLOTS], dtype=torch.int64,
                           device=self.device)
        table = [torch.zeros_like(vec) for _ in range(self.world)]
        dist.all_gather(table, vec, group=self.group)
        _record("agree", (self.world - 1) * vec.numel() * 8)
        rows = torch.stack(table).cpu().tolist()
        if any(r[0] for r in rows):
            messages = [None] * self.world
            mine = None if error is None else (type(error).__name__, str(error))
            dist.all_gather_object(messages, mine, group=self.group)
            _record("agree", 0)
            rank = next(r for r, m in enumerate(messages) if m is not None)
            kind, text = messages[rank]
            cls = TypeError if kind == "TypeError" else ValueError
            raise cls(f"{text} (vocab_shard: raised on rank {rank} of {self.world})")
        columns = ["vocab_size", "number of values"] + list(names)
        for i, name in enumerate(columns):
            seen = [r[3 + i] for r in rows]
            if len(set(seen)) > 1:
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
                what = "values differ" if name.endswith("(digest)") else shown
                raise ValueError(f"vocab_shard: the ranks disagree on {name} ({what}); every "
                                 f"rank must pass the same arguments but the vocabulary slice")
        spans = sorted((r[1], r[2], rank) for rank, r in enumerate(rows))
        end, vocab = 0, self.shard.vocab_size
        for start, width, rank in spans:
            if start != end:
                kind = "overlap" if start < end else "leave a gap"
                raise ValueError(
                    f"vocab_shard: the shards {kind} at global id {min(start, end)} "
                    f"(shards as (start, width) by rank: "
                    f"{[(r[1], r[2]) for r in rows]}); they must tile [0, {vocab}) in order")
            end = start + width
        if end < vocab:
            raise ValueError(f"vocab_shard: the shards cover [0, {end}), not the vocabulary "
                             f"[0, {vocab}) (shards as (start, width) by rank: "
                             f"{[(r[1], r[2]) for r in rows]})")
        self.order = [rank for _, _, rank in spans]
        self.spans = [(start, width) for start, width, _ in spans]
