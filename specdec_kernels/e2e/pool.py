"""What the serving loop keeps per row while rows join and leave: the K/V cache as a pool of
rows (:class:`SlotPool`), per-row sampling parameters (:class:`RowSampling`) and a draft
model whose cache follows the server's rows (:class:`PooledModelDrafter`)."""
from __future__ import annotations

from typing import Sequence

import torch

from .config import Sampling
from .drafters import DRAFT_SEED, ModelDrafter
from .model import SlotCache, prefill


class RowSampling:
    """Per-row sampling parameters as the verify ops take them: Python numbers when every row
    has the same value (the ops' fast paths, e.g. an all-greedy batch), else ``[B]`` tensors."""

    def __init__(self, samplings, device):
        def column(values, dtype):
            if all(v == values[0] for v in values):
                return values[0]
            return torch.tensor(values, dtype=dtype, device=device)
        self.temperature = column([s.temperature for s in samplings], torch.float32)
        self.top_k = column([s.top_k for s in samplings], torch.int32)
        self.top_p = column([s.top_p for s in samplings], torch.float32)
        self.greedy = all(s.greedy for s in samplings)

    def kwargs(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


class SlotPool:
    """Every layer's K and V ``[R, H, capacity, D]``; the live requests are rows ``0..n-1``."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []   # keys of every layer, then values
        self.rows = self.capacity = self.live = 0

    def view(self) -> SlotCache:
        """The live rows as a :class:`SlotCache` (views: the forward writes into the pool)."""
        cache = SlotCache(self.live, self.capacity)
        layers = len(self.tensors) // 2
        cache.keys = [t[:self.live] for t in self.tensors[:layers]]
        cache.values = [t[:self.live] for t in self.tensors[layers:]]
        return cache

    def add(self, fresh: SlotCache, capacity: int) -> None:
        """Append ``fresh``'s requests after the live rows (a prefill's cache)."""
        new = fresh.tensors()
        need = self.live + fresh.batch
        if not self.tensors or need > self.rows or capacity > self.capacity:
            rows = max(need, 2 * self.rows) if need > self.rows else self.rows
            capacity = max(capacity, self.capacity)
            grown = [t.new_zeros((rows, t.shape[1], capacity, t.shape[3])) for t in new]
            for old, big in zip(self.tensors, grown):
                big[:self.live, :, :self.capacity] = old[:self.live]
            self.tensors, self.rows, self.capacity = grown, rows, capacity
        for full, part in zip(self.tensors, new):
            full[self.live:need, :, :part.shape[2]] = part
        self.live = need

    def remove(self, rows: list, widths: list) -> list:
        """Free ``rows``; the last live rows move into them (``widths[r]``: row ``r``'s
        committed positions, all that is copied). Returns ``order``: the old row now at
        each row."""
        order = list(range(self.live))
        for r in sorted(set(rows), reverse=True):
            last = len(order) - 1
            if r != last:
                width = widths[order[last]]
                for t in self.tensors:
                    t[r, :, :width].copy_(t[last, :, :width])
                order[r] = order[last]
            order.pop()
        self.live = len(order)
        return order



class PooledModelDrafter(ModelDrafter):
    """:class:`~.drafters.ModelDrafter` over a :class:`SlotPool`: requests join (:meth:`add`,
    their prompts prefilled in the draft's cache) and leave (:meth:`remove`, the same row
    moves as the target's pool); ``sampling`` is set per step to the rows' own
    (:class:`RowSampling`). Chains only (a tree's sampled children draw from one generator)."""

    def __init__(self, model, spec, device):
        self.model, self.spec, self.sampling = model, spec, Sampling()
        self.pool = SlotPool()
        self.cache = self.pool.view()
        self.draft_lens = torch.zeros(0, dtype=torch.long, device=device)
        self.backlog: list[list[int]] = []
        self.generator = torch.Generator(device=device).manual_seed(DRAFT_SEED)
        self._shapes: dict = {}

    def add(self, prompts: Sequence[Sequence[int]], capacity: int, device) -> None:
        fresh = SlotCache(len(prompts), max(len(p) for p in prompts))
        written = prefill(self.model, fresh, [list(p) for p in prompts], device)
        self.pool.add(fresh, capacity)
        self.cache = self.pool.view()
        self.draft_lens = torch.cat([self.draft_lens, written])
        self.backlog += [[] for _ in prompts]

    def remove(self, rows: list) -> list:
        """The rows of finished requests leave; returns the pool's new order."""
        order = self.pool.remove(rows, self.draft_lens.tolist())
        index = torch.tensor(order, dtype=torch.long, device=self.draft_lens.device)
        self.draft_lens = self.draft_lens[index]
        self.backlog = [self.backlog[r] for r in order]
        self.cache = self.pool.view()
        return order
