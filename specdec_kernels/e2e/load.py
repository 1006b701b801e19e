"""Arrivals for the serving loop (:func:`~.serving.serve`): Poisson arrivals at a given rate, a
closed loop of ``N`` clients, or a fixed list, over a mixed request set, with a fixed seed and
bounded in time; in process (no network).

A load is an object with ``due(now)`` (the arrivals whose time the clock has passed, each
handed over once), ``next_at()`` (when the next one is due; None: none is scheduled) and
``finished(completion, now)`` (a request left: a closed-loop client sends its next one).
"""
from __future__ import annotations

import dataclasses
import heapq
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .config import Request, Sampling


@dataclass
class Arrival:
    """A request, its own sampling parameters, and when it arrives (seconds on the loop's
    clock); ``tag`` names where it came from (a task)."""
    request: Request
    sampling: Sampling = field(default_factory=Sampling)
    at: float = 0.0
    tag: str = ""


def _check_pool(pool: Sequence[Arrival]) -> None:
    if not isinstance(pool, Sequence) or not pool:
        raise ValueError("pool: expected a non-empty sequence of Arrival")
    for i, a in enumerate(pool):
        if not isinstance(a, Arrival):
            raise TypeError(f"pool[{i}]: expected an Arrival, got {type(a).__name__}")


def _draw(pool: Sequence[Arrival], rng: random.Random, index: int, at: float) -> Arrival:
    """A copy of a random pool entry arriving at ``at``, its seed made its own (``index``)."""
    chosen = pool[rng.randrange(len(pool))]
    request = dataclasses.replace(chosen.request, seed=chosen.request.seed + 7919 * index)
    return dataclasses.replace(chosen, request=request, at=at)


def poisson_arrivals(pool: Sequence[Arrival], rate: float, duration: float, *,
                     seed: int = 0) -> list[Arrival]:
    """Arrivals of a Poisson process of ``rate`` requests per second over ``[0, duration)``,
    each a random entry of ``pool`` (the same seed: the same list)."""
    _check_pool(pool)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"rate: expected requests per second > 0, got {rate!r}")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        raise ValueError(f"duration: expected seconds > 0, got {duration!r}")
    rng = random.Random(seed)
    out, at = [], rng.expovariate(rate)
    while at < duration:
        out.append(_draw(pool, rng, len(out), at))
        at += rng.expovariate(rate)
    return out


class ArrivalList:
    """A fixed list of arrivals (any order), handed over as the clock passes their times."""

    def __init__(self, arrivals: Sequence[Arrival]):
        for i, a in enumerate(arrivals):
            if not isinstance(a, Arrival):
                raise TypeError(f"arrivals[{i}]: expected an Arrival, got {type(a).__name__}")
        # (time, position): ties keep the list's order
        self._heap = [(float(a.at), i, a) for i, a in enumerate(arrivals)]
        heapq.heapify(self._heap)

    def due(self, now: float) -> list[Arrival]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def next_at(self) -> Optional[float]:
        return self._heap[0][0] if self._heap else None

    def finished(self, completion, now: float) -> None:
        pass


class ClosedLoop(ArrivalList):
    """``clients`` clients, each sending a random request of ``pool`` at time 0 and its next
    one ``think`` seconds after the last finished, until ``duration`` (no request is sent
    after it) or ``limit`` requests in all."""

    def __init__(self, pool: Sequence[Arrival], clients: int, duration: float, *,
                 think: float = 0.0, seed: int = 0, limit: Optional[int] = None):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ValueError(f"limit: expected an int >= 1 or None, got {limit!r}")
        self.limit = limit
        _check_pool(pool)
        if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
            raise ValueError(f"clients: expected an int >= 1, got {clients!r}")
        if (isinstance(duration, bool) or not isinstance(duration, (int, float))
                or not duration > 0):
            raise ValueError(f"duration: expected seconds > 0, got {duration!r}")
        if isinstance(think, bool) or not isinstance(think, (int, float)) or not think >= 0:
            raise ValueError(f"think: expected seconds >= 0, got {think!r}")
        self.pool, self.duration, self.think = pool, float(duration), float(think)
        self.rng, self.sent = random.Random(seed), 0
        first = clients if limit is None else min(clients, limit)
        super().__init__([self._next(0.0) for _ in range(first)])

    def _next(self, at: float) -> Arrival:
        self.sent += 1
        return _draw(self.pool, self.rng, self.sent - 1, at)

    def finished(self, completion, now: float) -> None:
        at = now + self.think
        if at < self.duration and (self.limit is None or self.sent < self.limit):
            arrival = self._next(at)
            heapq.heappush(self._heap, (at, self.sent, arrival))


def as_load(load):
    """A load object as is; a sequence of :class:`Arrival` as an :class:`ArrivalList`."""
    if all(hasattr(load, name) for name in ("due", "next_at", "finished")):
        return load
    if isinstance(load, Sequence) and not isinstance(load, (str, bytes)):
        return ArrivalList(load)
    raise TypeError(f"load: expected a sequence of Arrival or a load (due, next_at, finished), "
                    f"got {type(load).__name__}")


def mixed_pool(tokenizer, tasks: Sequence[str] = ("copy", "rare_terms", "long"), *,
               max_new_tokens: Optional[dict] = None, sampling: Sampling = Sampling(),
               count: Optional[int] = None) -> list[Arrival]:
    """The request sets of :mod:`.tasks` as one pool (each entry tagged with its task):
    ``max_new_tokens``: a budget per task (default the set's own), ``count``: the first
    prompts of each set."""
    from .tasks import task_requests
    budgets = max_new_tokens or {}
    pool = []
    for task in tasks:
        for request in task_requests(tokenizer, task, count, max_new_tokens=budgets.get(task)):
            pool.append(Arrival(request, sampling, tag=task))
    return pool
