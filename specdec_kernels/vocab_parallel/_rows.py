"""The processed distribution (contract sections 1 and 8) of rows held as vocabulary shards.

:func:`process` takes blocks of rows (a call's target rows, its draft-logit rows), each the
shard's columns of every row, and computes on every rank the same whole-row statistics the
reference's ``processed_probs`` uses, from per-shard summaries:

- max, arg-max (lowest id among ties), the raw max: one all-gather of ``[rows, 3]``;
- the top-k threshold (the k-th largest ``z``, ties kept): a radix search over the float
  bits of ``z``, one all-reduce of ``[rows, 256]`` integer counts per 8 bits;
- the normaliser ``W`` (and the raw one) with the owners' values at the queried ids: one
  all-gather of ``[rows, 1 + Q]`` (``2 + 2Q`` with raw logprobs);
- the top-p threshold: the same radix search over the bits of ``p`` with integer
  (fixed-point ``2**-62``) masses, so every rank sums the same integers;
- the renormaliser after top-k/top-p: one all-gather of ``[rows]``.
Nothing is ``O(V)`` per row. A shard's ``p`` is then ``probs()``, the queried ``p(id)``
``query_probs``, computed by the same float operations as the reference's.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference.sampling import min_p_log_threshold, sanitised_logits
from ._comm import Comm

BITS_PER_ROUND = 8
BINS = 1 << BITS_PER_ROUND
FIXED_POINT = 2.0 ** 62  # top-p masses as integers: p <= 1, so a row's sum stays < 2**63


def ordered_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys whose signed order is the float order of ``values`` (float32 or float64;
    -0.0 just below +0.0, which compare equal as floats and are kept together)."""
    if values.dtype == torch.float64:
        bits = values.view(torch.int64)
        return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
    bits = values.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def key_values(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`ordered_keys`."""
    if dtype == torch.float64:
        return torch.where(keys >= 0, keys, keys ^ 0x7FFFFFFFFFFFFFFF).view(torch.float64)
    bits = torch.where(keys >= 0, keys, keys ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32)


def radix_search(comm: Comm, keys: torch.Tensor, weights: torch.Tensor, good, nbits: int):
    """The largest key ``t`` (int64 ``[R]``) with ``good(S(t))`` where ``S(t)`` is the
    summed integer ``weights`` of the elements with key ``>= t`` over every shard; ``good``
    maps int64 ``[R, BINS]`` sums to bool, monotone (true for small ``t``). One all-reduce of
    ``[R, BINS]`` per ``BITS_PER_ROUND`` bits. Also returns ``found`` ``[R]``: False where
    ``good`` holds for no key (then ``t`` is the smallest key)."""
    rows = keys.shape[0]
    prefix = torch.zeros(rows, dtype=torch.int64, device=keys.device)
    above = torch.zeros_like(prefix)
    found = torch.ones(rows, dtype=torch.bool, device=keys.device)
    for shift in range(nbits - BITS_PER_ROUND, -1, -BITS_PER_ROUND):
        top = shift + BITS_PER_ROUND == nbits
        digit = (keys >> shift) & (BINS - 1)
        if top:
            digit = digit ^ (BINS >> 1)  # signed keys: the top digit in unsigned order
            inside = torch.ones_like(keys, dtype=torch.bool)
        else:
            inside = (keys >> (shift + BITS_PER_ROUND)) == \
                (prefix >> (shift + BITS_PER_ROUND))[:, None]
        hist = torch.zeros(rows, BINS, dtype=torch.int64, device=keys.device).scatter_add_(
            1, digit, torch.where(inside, weights, 0))
        hist = comm.reduce_sum(hist)
        suffix = hist.flip(1).cumsum(1).flip(1)  # sum over bins >= c
        ok = good(above[:, None] + suffix)
        chosen = ok.sum(1) - 1
        found &= chosen >= 0
        chosen = chosen.clamp(min=0)
        above = above + suffix.gather(1, chosen[:, None])[:, 0] - hist.gather(
            1, chosen[:, None])[:, 0]
        if top:
            signed = chosen ^ (BINS >> 1)
            signed = torch.where(signed >= BINS >> 1, signed - BINS, signed)
            prefix = signed << shift
        else:
            prefix = prefix | (chosen << shift)
    return prefix, found


class Block:
    """One block of rows of a call on this shard: logits ``[R, W]`` (the shard's columns),
    per-row parameters ``[R]``, an optional allowed mask ``[R, W]`` (the bitmask), the
    reference's batch-level flags, and the global ids ``queries`` ``[R, Q]`` (``-1``: none)
    whose ``p`` every rank needs."""

    def __init__(self, logits: torch.Tensor, temperature, top_k, top_p, min_p,
                 allowed: Optional[torch.Tensor], filtered: bool, use_min_p: bool,
                 queries: torch.Tensor, start: int, vocab: int, raw: bool):
        self.x_raw = sanitised_logits(logits)
        self.compute = self.x_raw.dtype
        width = logits.shape[-1]
        self.global_ids = start + torch.arange(width, device=logits.device)
        self.valid = self.global_ids < vocab  # padding past V: never a token
        self.x_raw = torch.where(self.valid, self.x_raw, -torch.inf)
        x = self.x_raw if allowed is None else torch.where(allowed, self.x_raw, -torch.inf)
        self.x, self.start, self.vocab, self.raw = x, start, vocab, raw
        self.temperature = temperature.to(self.compute)
        self.top_k, self.top_p = top_k.to(torch.int64), top_p.to(self.compute)
        self.min_p = None if min_p is None else min_p.to(self.compute)
        self.filtered, self.use_min_p = filtered, use_min_p
        self.queries = queries.to(torch.int64)
        local = self.queries - start
        self.owned = (local >= 0) & (local < width) & (self.queries < vocab)
        self.local_q = torch.where(self.owned, local, 0)

    # round 1: the maxima --------------------------------------------------------------
    def max_summary(self) -> torch.Tensor:
        x_max, arg = self.x.max(-1)
        raw_max = self.x_raw.amax(-1)
        return torch.stack([x_max.double(), (arg + self.start).double(), raw_max.double()], -1)

    def take_max(self, g: torch.Tensor) -> None:
        x_max = g[..., 0].amax(0)
        ids = torch.where(g[..., 0] == x_max, g[..., 1], torch.inf).amin(0)
        self.x_max = x_max.to(self.compute)
        self.argmax = ids.to(torch.int64)
        self.raw_max = g[..., 2].amax(0).to(self.compute)
        self.has_finite = self.x_max > -torch.inf
        self.greedy = self.temperature == 0
        safe = torch.where(self.greedy, 1.0, self.temperature)[:, None]
        finite = self.x > -torch.inf
        self.exponent = torch.where(finite, (self.x - self.x_max[:, None]) / safe, -torch.inf)
        self.z = torch.where(finite, self.x / safe, -torch.inf) \
            if (self.filtered or self.use_min_p) else None
        self.safe = safe[:, 0]
        if self.use_min_p:
            z_max = torch.where(self.has_finite, self.x_max / self.safe, -torch.inf)
            cut = z_max + min_p_log_threshold(self.min_p)
            self.exponent = torch.where(self.z >= cut[:, None], self.exponent, -torch.inf)

    # rounds 2: the top-k threshold ----------------------------------------------------
    def topk_active(self) -> torch.Tensor:
        return (self.top_k > 0) & (self.top_k < self.vocab)

    def take_kth(self, key: torch.Tensor) -> None:
        kth = key_values(key, self.compute)
        searched = self.topk_active() & ~self.greedy
        keep = ~searched[:, None] | (self.z >= kth[:, None])
        self.exponent = torch.where(keep, self.exponent, -torch.inf)

    # round 3: the normalisers and the owners' values -----------------------------------
    def sum_summary(self) -> torch.Tensor:
        self.e = torch.exp(self.exponent)
        parts = [self.e.sum(-1, keepdim=True).double(), self._owned(self.e)]
        if self.raw:
            shifted = torch.exp(self.x_raw - self.raw_max[:, None]).sum(-1, keepdim=True)
            parts += [shifted.double(), self._owned(self.x_raw)]
        return torch.cat(parts, -1)

    def _owned(self, values: torch.Tensor) -> torch.Tensor:
        picked = values.gather(-1, self.local_q).double()
        return torch.where(self.owned, picked, 0.0)

    def take_sum(self, g: torch.Tensor) -> None:
        total = g.sum(0)  # ranks in shard order; only the owner's entries are non-zero
        q = self.queries.shape[-1]
        self.W = total[:, 0].to(self.compute)
        self.e_q = total[:, 1:1 + q].to(self.compute)
        self.p1 = self.e / self.W[:, None]
        if self.raw:
            self.raw_log_norm = torch.log(total[:, 1 + q])  # float64
            self.raw_q = total[:, 2 + q:]

    # rounds 4: the top-p threshold ----------------------------------------------------
    def topp_active(self) -> torch.Tensor:
        return self.top_p < 1

    def take_tau(self, key: torch.Tensor, found: torch.Tensor) -> None:
        self.tau = torch.where(found, key_values(key, self.compute), 0.0)

    # round 5: the renormaliser ----------------------------------------------------------
    def _kept(self, p1: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return torch.where((self.top_p >= 1)[:, None] | (p1 >= tau), p1, 0.0)

    def renorm_summary(self) -> torch.Tensor:
        self.kept = self._kept(self.p1, self.tau[:, None])
        return self.kept.sum(-1).double()

    def take_renorm(self, g: torch.Tensor) -> None:
        self.S2 = g.sum(0).to(self.compute)

    # the results ---------------------------------------------------------------------
    def probs(self) -> torch.Tensor:
        """This shard's columns of the processed rows ``[R, W]`` (the reference's values)."""
        p = self.p1
        if self.filtered:
            p = self.kept / self.S2[:, None]
        one_hot = (self.global_ids == self.argmax[:, None]).to(p.dtype)
        p = torch.where(self.greedy[:, None], one_hot, p)
        return torch.where(self.has_finite[:, None], p, 0.0)

    def query_probs(self) -> torch.Tensor:
        """``p`` at the queried global ids ``[R, Q]`` (0 for ``-1`` or padding ids)."""
        p = self.e_q / self.W[:, None]
        if self.filtered:
            p = self._kept(p, self.tau[:, None]) / self.S2[:, None]
        one_hot = (self.queries == self.argmax[:, None]).to(p.dtype)
        p = torch.where(self.greedy[:, None], one_hot, p)
        in_vocab = (self.queries >= 0) & (self.queries < self.vocab)
        return torch.where(self.has_finite[:, None] & in_vocab, p, 0.0)

    def raw_logprob(self, x: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of the raw row at a token whose raw logit is ``x`` ``[R, M]``."""
        return (x.double() - self.raw_max[:, None].double() - self.raw_log_norm[:, None])


def process(comm: Comm, blocks: list[Block]) -> None:
    """Run the rounds over every block at once (one collective per round for all blocks)."""
    for block, g in zip(blocks, comm.gather([b.max_summary() for b in blocks])):
        block.take_max(g)
    nbits = 64 if any(b.compute == torch.float64 for b in blocks) else 32
    searching = [b for b in blocks if b.filtered]
    # Only the rows a threshold changes take part in its search (greedy rows are one-hot
    # whatever it is): the histograms' bytes follow the filtered rows, not the batch.
    topk_rows = torch.cat([b.topk_active() & ~b.greedy for b in searching]) if searching \
        else None
    if searching and bool(topk_rows.any()):
        rows = topk_rows.nonzero()[:, 0]
        keys = torch.cat([ordered_keys(b.z) for b in searching])[rows]
        weights = torch.cat([b.valid.expand_as(b.z).to(torch.int64) for b in searching])[rows]
        need = torch.cat([b.top_k for b in searching])[rows]
        found, _ = radix_search(comm, keys, weights, lambda s: s >= need[:, None], nbits)
        key = torch.zeros(topk_rows.shape[0], dtype=torch.int64, device=keys.device)
        key[rows] = found
        for b, k in zip(searching, key.split([b.z.shape[0] for b in searching])):
            b.take_kth(k)  # rows outside the search keep every token (take_kth's mask)
    # The normalisers' round also carries any block's ``extra`` owner values (q(d_j) of
    # draft_probs): each rank fills its own entries, zeros elsewhere, so the sum is exact.
    extras = [b for b in blocks if getattr(b, "extra", None) is not None]
    gathered = comm.gather([b.sum_summary() for b in blocks] + [b.extra for b in extras])
    for block, g in zip(blocks, gathered):
        block.take_sum(g)
    for block, g in zip(extras, gathered[len(blocks):]):
        block.extra_sum = g.sum(0)
    if searching:
        for b in searching:
            b.tau = torch.zeros_like(b.W)
        topp_rows = torch.cat([b.topp_active() & ~b.greedy for b in searching])
        if bool(topp_rows.any()):
            rows = topp_rows.nonzero()[:, 0]
            p1 = [torch.nan_to_num(b.p1, nan=0.0) for b in searching]
            keys = torch.cat([ordered_keys(p) for p in p1])[rows]
            weights = torch.cat([(p.double() * FIXED_POINT).to(torch.int64) for p in p1])[rows]
            top_p = torch.cat([b.top_p.double() for b in searching])[rows]
            exact = torch.cat([torch.full_like(b.top_p, b.compute == torch.float64,
                                               dtype=torch.bool) for b in searching])[rows]

            def reaches(sums):
                mass = sums.double() / FIXED_POINT
                # The reference compares its (double-accumulated) cumulative sum in the
                # compute dtype: round as it does.
                mass = torch.where(exact[:, None], mass, mass.float().double())
                return mass >= top_p[:, None]
            searched, hit = radix_search(comm, keys, weights, reaches, nbits)
            key = torch.zeros(topp_rows.shape[0], dtype=torch.int64, device=keys.device)
            found = torch.zeros(topp_rows.shape[0], dtype=torch.bool, device=keys.device)
            key[rows], found[rows] = searched, hit  # elsewhere tau = 0: every token kept
            sizes = [b.W.shape[0] for b in searching]
            for b, k, f in zip(searching, key.split(sizes), found.split(sizes)):
                b.take_tau(k, f)
        for b, g in zip(searching, comm.gather([b.renorm_summary() for b in searching])):
            b.take_renorm(g)
