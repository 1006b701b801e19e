"""What a run is asked to do and what it reports: requests, sampling, the speculation
settings, per-run statistics (with the per-step profile) and the result."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

DEFAULT_METHOD = "token"


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    seed: int = 0
    stop_at_eos: bool = True


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def kwargs(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class Speculation:
    """What drafts and how it is verified. ``drafter``: ``"none"`` (plain decoding),
    ``"ngram"`` or ``"model"``. ``num_draft_tokens``: an int (every request drafts that many;
    an n-gram proposal may be shorter) or ``"adaptive"`` (per request, from its measured
    acceptance and the measured step costs, at most ``max_draft_tokens``). ``tree``:
    children per depth (e.g. ``(2, 2, 1)``) for a draft-model tree, with ``children``
    ``"top_k"`` (deterministic), ``"iid"`` or ``"without_replacement"`` (sampled from the
    draft's ``q``)."""
    drafter: str = "none"
    num_draft_tokens: Union[int, str] = 4
    tree: Optional[tuple[int, ...]] = None
    children: str = "top_k"
    method: str = DEFAULT_METHOD
    max_draft_tokens: int = 16
    ngram_max: int = 3

    @property
    def adaptive(self) -> bool:
        return self.num_draft_tokens == "adaptive"


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0         # process CPU time (robust to a loaded machine at 1 thread)
    draft_s: float = 0.0       # the drafter's work: its prefill, drafts, catch-up, commits
    verify_s: float = 0.0      # the target's verify forward, verification, compaction
    accepted: int = 0          # accepted draft tokens, all requests and steps
    request_steps: int = 0     # (request, step) pairs
    drafted_at: list = field(default_factory=list)   # [depth] drafted count
    accepted_at: list = field(default_factory=list)  # [depth] accepted count
    latency_s: list = field(default_factory=list)    # per request, from the batch's start

    def position(self, depth: int, drafted: int, accepted: int) -> None:
        while len(self.drafted_at) <= depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        self.drafted_at[depth] += drafted
        self.accepted_at[depth] += accepted

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.request_steps if self.request_steps else 0.0

    def merge(self, other: "Stats") -> None:
        for f in ("steps", "tokens", "wall_s", "cpu_s", "draft_s", "verify_s", "accepted",
                  "request_steps"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for depth, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            self.position(depth, d, a)
        self.latency_s.extend(other.latency_s)


@dataclass
class Result:
    tokens: list[list[int]]     # generated tokens per request (EOS included when emitted)
    stats: Stats
    caches: Optional[list] = None  # (kv_lens, cache tensors) per request when kept


def tree_size(branching: Sequence[int]) -> int:
    total, width = 1, 1
    for w in branching:
        width *= w
        total += width
    return total


def replace(spec: Speculation, **changes) -> Speculation:
    return dataclasses.replace(spec, **changes)
