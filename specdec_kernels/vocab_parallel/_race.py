"""The two-level sampling race of ``reference.sampling.race`` on vocabulary shards.

The race's noise is keyed by global token id (token noise at the id, group noise at
``GROUP_INDEX_BASE + g``), so every rank draws the whole row's numbers for its own ids and
nothing random is exchanged. Round 1 (only when the row has more than one group): each rank
sends, per row and per candidate weighting, its best group wholly inside its shard (score
``mass / E_g``, group id) and the partial masses of the at most two groups it shares with a
neighbour, and whether it holds any positive weight; every rank sums the shared groups'
partials in shard order and takes the best score, lowest group id among ties. Round 2: the
token race inside the winning group, each rank's best ``w / E`` and its id (and the values
the caller wants carried with the winner). So two all-gathers of ``O(rows x P)`` numbers.

Two weightings travel together (the residual and the plain row: whether the residual has any
mass is itself a reduction), and round 2 races the one each row chooses.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import _rng
from ._comm import Comm


def _scores(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return torch.where(weights > 0, weights / noise, -1.0)


def _best(scores: torch.Tensor, ids: torch.Tensor):
    """Max score, then lowest id, along dim 1 of ``[R, C]`` (ids ``[R, C]``, float64)."""
    top = scores.amax(1)
    winner = torch.where(scores == top[:, None], ids, torch.inf).amin(1)
    return top, winner


class Layout:
    """Which race groups this shard holds whole and which it shares."""

    def __init__(self, start: int, width: int, vocab: int):
        group = _rng.RACE_GROUP
        self.num_groups = -(-vocab // group)
        self.group = group if self.num_groups > 1 else vocab
        self.lo, self.hi = min(start, vocab), min(start + width, vocab)
        self.start, self.vocab = start, vocab
        if self.hi <= self.lo:
            self.first = self.last = 0
            self.whole = []
            self.shared = []
            return
        self.first, self.last = self.lo // group, (self.hi - 1) // group
        ends = [min((g + 1) * group, vocab) for g in range(self.first, self.last + 1)]
        inside = [g * group >= self.lo and end <= self.hi
                  for g, end in zip(range(self.first, self.last + 1), ends)]
        self.whole = [g for g, ok in zip(range(self.first, self.last + 1), inside) if ok]
        self.shared = [g for g, ok in zip(range(self.first, self.last + 1), inside) if not ok]


def _group_masses(layout: Layout, weights: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` masses of the groups ``first..last`` this shard touches (zeros outside its
    columns), each summed as the reference sums a group: one contiguous row of
    ``RACE_GROUP`` values."""
    group = _rng.RACE_GROUP
    cols = weights[:, :layout.hi - layout.start] if layout.hi > layout.lo else weights[:, :0]
    left = layout.lo - layout.first * group
    right = (layout.last + 1) * group - layout.hi
    padded = torch.nn.functional.pad(cols, (left, right))
    return padded.view(weights.shape[0], layout.last - layout.first + 1, group).sum(-1)


def sharded_race(comm: Comm, layout: Layout, variants: Sequence[torch.Tensor],
                 choose, seed: torch.Tensor, offset: torch.Tensor, position, purpose: int,
                 carry: Sequence[torch.Tensor] = ()):
    """One sample per row of one of ``variants`` (``[B, W]`` unnormalised weights on this
    shard, padding columns 0) by the reference's race; ``choose(any_positive)`` maps the
    ``[B, len(variants)]`` bool table of which weightings have any positive weight to the
    ``[B]`` int64 index of the weighting to race. Returns ``(token int32 [B], carried)`` with
    ``-1`` where the chosen weighting has no positive weight, and ``carried`` the values of
    ``carry`` (``[B, W]`` tensors on this shard) at the token (0 where ``-1``)."""
    batch = variants[0].shape[0]
    device = variants[0].device
    seed, offset = seed[:, None], offset[:, None]
    position = torch.as_tensor(position, device=device)
    position = position[:, None] if position.dim() == 1 else position
    # Per weighting: any positive weight here (the choice, NaN ignored as the reference's
    # ``(w > 0).any()``), and any NaN here (the reference's race then gives -1).
    any_local = torch.cat([torch.stack([(v > 0).any(-1) for v in variants], -1),
                           torch.stack([v.isnan().any(-1) for v in variants], -1)], -1)
    count = len(variants)
    multi = layout.num_groups > 1
    if multi:
        group_noise = _rng.token_exponential(seed, offset, position, purpose, layout.num_groups,
                                             start=_rng.GROUP_INDEX_BASE)
        parts = [any_local.double()]
        for v in variants:
            parts.append(_group_summary(layout, v, group_noise))
        gathered = comm.gather(parts)
        flags = gathered[0].amax(0) > 0
        any_positive, any_nan = flags[:, :count], flags[:, count:]
        chosen = choose(any_positive)
        winners = [_combine_groups(comm.layouts, g, group_noise, variants[0].dtype)
                   for g in gathered[1:]]
        winner = torch.stack(winners, -1).gather(1, chosen[:, None])[:, 0]
    else:
        chosen = None
        winner = torch.zeros(batch, dtype=torch.int64, device=device)
    # Round 2 (round 1 with one group: the flags travel with the candidates).
    first = winner * _rng.RACE_GROUP
    noise = _rng.token_exponential(seed, offset, position, purpose, layout.group,
                                   start=first[:, None])
    index = (layout.start - first)[:, None] + torch.arange(variants[0].shape[1], device=device)
    member = (index >= 0) & (index < layout.group) & (index + first[:, None] < layout.vocab)
    token_noise = noise.gather(1, index.clamp(0, layout.group - 1))
    candidates = []
    for v in variants if not multi else [None]:
        weights = v if v is not None else torch.stack(variants, 0).gather(
            0, chosen[None, :, None].expand(1, batch, variants[0].shape[1]))[0]
        scores = torch.where(member, _scores(weights, token_noise), -1.0)
        best, arg = scores.max(-1)
        values = [c.gather(1, arg[:, None])[:, 0].double() for c in carry]
        candidates.append(torch.stack([best.double(), (arg + layout.start).double()] + values,
                                      -1))
    parts = candidates if multi else [any_local.double()] + candidates
    gathered = comm.gather(parts)
    if not multi:
        flags = gathered[0].amax(0) > 0
        any_positive, any_nan = flags[:, :count], flags[:, count:]
        chosen = choose(any_positive)
        table = torch.stack(gathered[1:], 0)  # [variants, P, B, 2 + carry]
        table = table.gather(0, chosen[None, None, :, None].expand(1, *table.shape[1:]))[0]
    else:
        table = gathered[0]
    scores, ids = table[..., 0].t(), table[..., 1].t()  # [B, P]
    _, token = _best(scores, ids)
    rank = (ids == token[:, None]) & (scores == scores.amax(1, keepdim=True))
    rank = rank.to(torch.int64).argmax(1)
    carried = [table[..., 2 + i].t().gather(1, rank[:, None])[:, 0] for i in range(len(carry))]
    has = (any_positive & ~any_nan).gather(1, chosen[:, None])[:, 0]
    token = torch.where(has, token, -1.0).to(torch.int32)
    carried = [torch.where(has, c, 0.0) for c in carried]
    return token, carried


def _group_summary(layout: Layout, weights: torch.Tensor, group_noise: torch.Tensor):
    """``[B, 4]``: best whole group's score and id, the shared groups' partial masses (at most
    two: the shard's first and last group)."""
    batch = weights.shape[0]
    out = torch.full((batch, 4), -1.0, dtype=torch.float64, device=weights.device)
    out[:, 2:] = 0.0
    if layout.hi <= layout.lo:
        return out
    masses = _group_masses(layout, weights)
    if layout.whole:
        cols = torch.tensor([g - layout.first for g in layout.whole], device=weights.device)
        ids = torch.tensor(layout.whole, device=weights.device)
        scores = _scores(masses[:, cols], group_noise[:, ids])
        best, arg = scores.max(-1)
        out[:, 0], out[:, 1] = best.double(), ids[arg].double()
    for slot, g in zip((2, 3), _shared_slots(layout)):
        if g is not None:
            out[:, slot] = masses[:, g - layout.first].double()
    return out


def _shared_slots(layout: Layout):
    """The shard's shared groups in two slots: (first group or None, last group or None)."""
    first = layout.first if layout.first in layout.shared else None
    last = layout.last if layout.last in layout.shared and layout.last != first else None
    return first, last


def _combine_groups(layouts: Sequence[Layout], g: torch.Tensor, group_noise: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The winning group ``[B]`` from every rank's ``[P, B, 4]`` group summary (``layouts``:
    the ranks' shards in shard order)."""
    scores = [g[r, :, 0] for r in range(len(layouts))]
    ids = [g[r, :, 1] for r in range(len(layouts))]
    shared: dict = {}
    for r, lay in enumerate(layouts):
        for slot, gid in zip((2, 3), _shared_slots(lay)):
            if gid is not None:
                shared.setdefault(gid, []).append(g[r, :, slot])
    for gid, partials in sorted(shared.items()):
        mass = torch.stack(partials, 0).sum(0).to(dtype)  # float64 in shard order, rounded
        scores.append(_scores(mass, group_noise[:, gid]).double())
        ids.append(torch.full_like(mass, gid, dtype=torch.float64))
    scores, ids = torch.stack(scores, 1), torch.stack(ids, 1)
    ids = torch.where(scores > -1, ids, torch.inf)
    top, winner = _best(scores, ids)
    return torch.where(torch.isfinite(winner), winner, 0.0).to(torch.int64)
