"""What a run is asked to do and what it reports: requests, sampling, the speculation
settings, per-run statistics (with the per-step profile) and the result."""
from __future__ import annotations

import dataclasses
import time
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
    draft's ``q``). ``trie_nodes``: with ``drafter="ngram"``, draft a trie of at most that
    many nodes merging the continuations of several earlier matches (depth at most
    ``num_draft_tokens``, :class:`~.drafters.NgramTrieDrafter`), verified as a tree with
    deterministic candidates; ``0``: one chain."""
    drafter: str = "none"
    num_draft_tokens: Union[int, str] = 4
    tree: Optional[tuple[int, ...]] = None
    children: str = "top_k"
    method: str = DEFAULT_METHOD
    max_draft_tokens: int = 16
    ngram_max: int = 3
    trie_nodes: int = 0

    @property
    def adaptive(self) -> bool:
        return self.num_draft_tokens == "adaptive"

    @property
    def trie(self) -> bool:
        return self.drafter == "ngram" and self.trie_nodes > 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_run(requests: Sequence[Request], sampling: Sampling, spec: Speculation,
              vocab_size: int) -> None:
    """Every argument of a run checked before anything runs: a ValueError or TypeError naming
    the field (``requests[i].prompt``, ``sampling.top_p``, ``speculation.num_draft_tokens``),
    what was expected and what was given."""
    if not isinstance(requests, Sequence) or isinstance(requests, (str, bytes)):
        raise TypeError(f"requests: expected a sequence of Request, got {type(requests).__name__}")
    if len(requests) == 0:
        raise ValueError("requests: expected at least one Request, got an empty sequence")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}]: expected a Request, got {type(r).__name__}")
        prompt = r.prompt
        if not isinstance(prompt, (list, tuple)) or not all(_is_int(t) for t in prompt):
            raise TypeError(f"requests[{i}].prompt: expected a list of int token ids, got "
                            f"{type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"requests[{i}].prompt: expected at least one token, got an "
                             f"empty prompt")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"requests[{i}].prompt: token ids must be in [0, {vocab_size}) "
                             f"(the model's vocabulary), got {bad[0]}")
        if not _is_int(r.max_new_tokens):
            raise TypeError(f"requests[{i}].max_new_tokens: expected an int, got "
                            f"{type(r.max_new_tokens).__name__}")
        if r.max_new_tokens < 1:
            raise ValueError(f"requests[{i}].max_new_tokens: expected >= 1, got "
                             f"{r.max_new_tokens}")
        if not _is_int(r.seed):
            raise TypeError(f"requests[{i}].seed: expected an int, got {type(r.seed).__name__}")
    t, k, p = sampling.temperature, sampling.top_k, sampling.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
        raise ValueError(f"sampling.temperature: expected a finite float >= 0, got {t!r}")
    if not _is_int(k) or k < 0:
        raise ValueError(f"sampling.top_k: expected an int >= 0 (0 disables), got {k!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"sampling.top_p: expected a float in (0, 1], got {p!r}")
    if spec.drafter not in ("none", "ngram", "model"):
        raise ValueError(f"drafter: expected 'none', 'ngram' or 'model', got {spec.drafter!r}")
    n, least = spec.num_draft_tokens, 0 if spec.tree or spec.drafter == "none" else 1
    if n != "adaptive" and (not _is_int(n) or n < least):  # a tree's shape is its own
        raise ValueError(f"speculation.num_draft_tokens: expected an int >= {least} or "
                         f"'adaptive', got {n!r}")
    if not _is_int(spec.max_draft_tokens) or spec.max_draft_tokens < 1:
        raise ValueError(f"speculation.max_draft_tokens: expected an int >= 1, got "
                         f"{spec.max_draft_tokens!r}")
    if not _is_int(spec.ngram_max) or spec.ngram_max < 1:
        raise ValueError(f"speculation.ngram_max: expected an int >= 1, got {spec.ngram_max!r}")
    if not _is_int(spec.trie_nodes) or spec.trie_nodes < 0:
        raise ValueError(f"speculation.trie_nodes: expected an int >= 0 (0: a chain), got "
                         f"{spec.trie_nodes!r}")
    if spec.tree is not None and (not isinstance(spec.tree, tuple) or not spec.tree
                                  or not all(_is_int(w) and w >= 1 for w in spec.tree)):
        raise ValueError(f"speculation.tree: expected a non-empty tuple of ints >= 1 "
                         f"(children per depth), got {spec.tree!r}")
    if spec.children not in ("top_k", "iid", "without_replacement"):
        raise ValueError(f"speculation.children: expected 'top_k', 'iid' or "
                         f"'without_replacement', got {spec.children!r}")


# Where a run's wall time goes (Stats.profile, seconds). "forward": the target's verify /
# decode forward without the two below; "masks": its attention masks and position ids;
# "cache_writes": the new K/V scattered into the SlotCache; "verify_op": sk.verify_chain_packed
# / sk.verify_tree / sk.sample / the greedy arg-max; "compaction": sk.compact_kv_cache and
# dropping finished requests' cache rows; "drafting": the drafter (lookups, plans, a draft
# model's forwards, its commits); "policy": the adaptive length's choice and bookkeeping;
# "prefill": the target's prompt prefill; "python": the rest of the loop (token lists,
# stopping, statistics).
PHASES = ("forward", "masks", "cache_writes", "verify_op", "compaction", "drafting", "policy",
          "prefill", "python")


class PhaseClock:
    """Charges the time since the previous lap to a phase of ``seconds``."""

    def __init__(self, seconds: dict):
        self.seconds = seconds
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def skip(self) -> None:
        """The time since the last lap was charged elsewhere (a callee's own profile)."""
        self.last = time.perf_counter()


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
    profile: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # seconds

    def profile_ms_per_step(self) -> dict:
        """Each phase's milliseconds per step (the prefill's spread over the steps too): they
        add up to the wall time per step."""
        steps = max(self.steps, 1)
        return {phase: round(1e3 * s / steps, 3) for phase, s in self.profile.items()}

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
        for phase, seconds in other.profile.items():
            self.profile[phase] = self.profile.get(phase, 0.0) + seconds


@dataclass
class Result:
    tokens: list[list[int]]     # generated tokens per request (EOS included when emitted)
    stats: Stats
    caches: Optional[list] = None  # (kv_lens, cache tensors) per request when kept
    policy: Optional[object] = None  # the AdaptiveLength (adaptive runs): generate(policy=)


def tree_size(branching: Sequence[int]) -> int:
    total, width = 1, 1
    for w in branching:
        width *= w
        total += width
    return total


def replace(spec: Speculation, **changes) -> Speculation:
    return dataclasses.replace(spec, **changes)
