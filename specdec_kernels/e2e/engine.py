"""The decode loop: a static batch of requests, drafted, verified by the target in one forward
per step, committed with our verify ops and ``compact_kv_cache``.

Per request the loop keeps ``kv_lens[b]`` committed positions in the target's cache and one
*pending* token (emitted, not yet in the cache). A step feeds ``[pending, drafts...]`` at
``kv_lens[b] + node`` (node 0 is the pending token, the tree's root), so row ``i`` of the
target's logits is the distribution after node ``i``'s path: exactly ``verify_chain``'s
``K + 1`` rows and ``verify_tree``'s ``N`` rows. The accepted path is then moved to the front
of the speculative region (``compact_kv_cache``, layout ``"bhsd"``; a chain's path is already
there), ``kv_lens += num_accepted + 1`` and the correction/bonus token becomes pending.

Only the public API of :mod:`specdec_kernels` is used; a verification ``method`` is passed
through to the verify op when it takes one (see :func:`verify_methods`).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

import specdec_kernels as sk

from .drafters import DraftPlan, ModelDrafter, NgramDrafter
from .model import SlotCache, chain_visibility, forward_block

DEFAULT_METHOD = "token"
METHOD_CANDIDATES = ("token", "block", "traversal")


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
    ``"ngram"`` or ``"model"``. ``num_draft_tokens``: an int or ``"adaptive"`` (one ``K`` per
    batch, from the requests' measured acceptance, at most ``max_draft_tokens``). ``tree``:
    children per depth (e.g. ``(2, 2, 1)``) for a draft-model tree, with ``children``
    ``"top_k"`` (deterministic), ``"iid"`` or ``"without_replacement"`` (sampled from the
    draft's ``q``)."""
    drafter: str = "none"
    num_draft_tokens: Union[int, str] = 4
    tree: Optional[tuple[int, ...]] = None
    children: str = "top_k"
    method: str = DEFAULT_METHOD
    max_draft_tokens: int = 8
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


def _takes_method(op) -> bool:
    return "method" in inspect.signature(op).parameters


def verify_methods(kind: str = "chain") -> tuple[str, ...]:
    """The verification methods the installed ``verify_chain`` / ``verify_tree`` accept
    (``("token",)`` when the op has no ``method`` parameter), found by trying each candidate
    on a one-request problem."""
    op = sk.verify_chain if kind == "chain" else sk.verify_tree
    if not _takes_method(op):
        return (DEFAULT_METHOD,)
    logits = torch.zeros(1, 2, 4)
    found = []
    for method in METHOD_CANDIDATES:
        try:
            if kind == "chain":
                op(logits, torch.zeros(1, 1, dtype=torch.long), temperature=1.0, seed=0,
                   method=method)
            else:  # sampled children (traversal's condition: drafts drawn from q)
                op(logits, torch.tensor([[-1, 0]]), torch.tensor([[-1, 0]]),
                   draft_probs=torch.full((1, 2, 4), 0.25), temperature=1.0, seed=0,
                   method=method)
            found.append(method)
        except (TypeError, ValueError, NotImplementedError):
            continue
    return tuple(found)


def methods_for(spec: "Speculation") -> tuple[str, ...]:
    """The installed methods that apply to ``spec``: a chain's, or a tree's ("traversal" only
    with sampled children: it verifies children drawn from ``q``)."""
    if not spec.tree:
        return verify_methods("chain")
    return tuple(m for m in verify_methods("tree")
                 if m != "traversal" or spec.children != "top_k")


def _method_kwargs(op, method: str) -> dict:
    if _takes_method(op):
        return {"method": method}
    if method != DEFAULT_METHOD:
        raise ValueError(f"method: the installed {op.__name__} takes no method parameter, "
                         f"so only {DEFAULT_METHOD!r} runs; got {method!r}")
    return {}


class AdaptiveLength:
    """Per-request draft length from measured acceptance and measured costs.

    With per-token acceptance ``a`` (decayed counts), ``K`` drafts yield
    ``(1 - a^(K+1)) / (1 - a)`` tokens per step at a cost ``1 + K * (verify_per_token +
    draft_per_token)`` target forwards; the ``K`` in ``0..max`` with the most tokens per cost
    wins (``0``: plain decoding for that request). Costs are fitted online from the step
    timings. A request at ``K = 0`` probes ``K = 1`` after ``probe_every`` plain steps so that
    its estimate can recover; a probe that accepts nothing doubles that gap (up to
    ``8 * probe_every``: a drafter that never agrees costs ever less), one that accepts
    resets it."""

    def __init__(self, batch: int, max_len: int, *, decay: float = 0.8, probe_every: int = 8,
                 verify_per_token: float = 0.05, draft_per_token: float = 0.0,
                 calibrate: bool = False):
        self.max_len, self.decay, self.probe_every = max_len, decay, probe_every
        self.calibrate = calibrate  # first a plain step: the cost every K is relative to
        self.successes = [0.0] * batch
        self.trials = [0.0] * batch
        self.idle = [0] * batch
        self.gap = [probe_every] * batch
        self.probing = [False] * batch
        self.recent = [0] * batch  # accepted since the request's last probe
        self.verify_per_token = verify_per_token
        self.draft_per_token = draft_per_token
        self._fit: list[tuple[int, float]] = []  # (positions, seconds) of verify forwards
        self.step_seconds: dict[int, float] = {}  # positions -> decayed mean step seconds

    def rate(self, b: int) -> float:
        return (self.successes[b] + 1.0) / (self.trials[b] + 2.0)

    def verify_cost(self, positions: int) -> float:
        """A verify forward over ``positions`` relative to a one-position one: measured when
        both were seen (the cost is far from linear on a CPU: two positions cost what one
        does, three 1.4x), else the linear fit."""
        seen = self.step_seconds
        if positions in seen and 1 in seen and seen[1] > 0:
            return seen[positions] / seen[1]
        return 1 + (positions - 1) * self.verify_per_token

    def _best(self, rates: list[float]) -> int:
        """The K with the most expected tokens (summed over ``rates``) per step cost."""
        best, best_value = 0, float(len(rates))
        for k in range(1, self.max_len + 1):
            cost = self.verify_cost(k + 1) + k * self.draft_per_token
            value = sum((1 - r ** (k + 1)) / (1 - r) for r in rates) / cost
            if value > best_value:
                best, best_value = k, value
        return best

    def _plain_or_probe(self, slot: int, accepted: int) -> int:
        """0 for a plain step, 1 for a probe. ``accepted``: since the slot's last probe."""
        if self.probing[slot]:  # the previous step was a probe: adjust the gap
            self.probing[slot] = False
            self.gap[slot] = (self.probe_every if accepted
                              else min(2 * self.gap[slot], 8 * self.probe_every))
        self.idle[slot] += 1
        if self.idle[slot] < self.gap[slot]:
            return 0
        self.idle[slot] = 0
        self.probing[slot] = True
        return 1

    def choose(self, b: int) -> int:
        if self.calibrate and 1 not in self.step_seconds:
            return 0
        best = self._best([min(self.rate(b), 0.999)])
        if best:
            self.idle[b] = 0
            return best
        probe = self._plain_or_probe(b, self.recent[b])
        if probe:
            self.recent[b] = 0
        return probe

    def choose_all(self, batch: int) -> list[int]:
        """Every live request's length. A batch's verify forward is as wide as its longest
        chain, so with more than one request a request's own best ``K`` would charge the
        others for positions they do not use: one ``K`` for the batch maximises the sum of
        the requests' expected tokens over that cost (``0``: a plain step for all, with
        probes as for one request, kept in slot 0)."""
        if batch == 1:
            return [self.choose(0)]
        if self.calibrate and 1 not in self.step_seconds:
            return [0] * batch
        best = self._best([min(self.rate(b), 0.999) for b in range(batch)])
        if best:
            self.idle[0] = 0
            return [best] * batch
        probe = self._plain_or_probe(0, sum(self.recent))
        if probe:
            self.recent = [0] * batch
        return [probe] * batch

    def observe(self, b: int, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.successes[b] = self.decay * self.successes[b] + accepted
        self.trials[b] = self.decay * self.trials[b] + accepted + (accepted < drafted)
        self.recent[b] += accepted

    def observe_cost(self, positions: int, seconds: float, draft_seconds: float,
                     drafted: int) -> None:
        """Refit ``verify_per_token`` (relative cost of one more verify position) and
        ``draft_per_token`` from this step; a plain step is ``positions = 1``."""
        previous = self.step_seconds.get(positions)
        self.step_seconds[positions] = seconds if previous is None else (
            0.8 * previous + 0.2 * seconds)
        if positions == 1:
            return
        self._fit.append((positions, seconds))
        self._fit = self._fit[-64:]
        xs = [p for p, _ in self._fit]
        if len(set(xs)) >= 2:
            n = len(xs)
            mean_x = sum(xs) / n
            mean_y = sum(s for _, s in self._fit) / n
            var = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (s - mean_y) for x, s in self._fit) / var
            base = mean_y - slope * (mean_x - 1)
            if base > 0:
                self.verify_per_token = max(slope, 0.0) / base
        if drafted and seconds > 0:
            unit = seconds / self.verify_cost(positions)
            self.draft_per_token = 0.8 * self.draft_per_token + 0.2 * (draft_seconds / drafted
                                                                       / unit)

    def select(self, rows: Sequence[int]) -> None:
        for name in ("successes", "trials", "idle", "gap", "probing", "recent"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])


@dataclass
class Result:
    tokens: list[list[int]]     # generated tokens per request (EOS included when emitted)
    stats: Stats
    caches: Optional[list] = None  # (kv_lens, cache tensors) per request when kept


def _prefill(model, cache: SlotCache, prompts: list[list[int]], device) -> torch.Tensor:
    """Write each prompt but its last token; returns kv_lens (that token becomes pending)."""
    lengths = [len(p) - 1 for p in prompts]
    width = max(max(lengths), 1)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
    kv_lens = torch.zeros(len(prompts), dtype=torch.long, device=device)
    visible, depth = chain_visibility(len(prompts), width, device)
    forward_block(model, cache, tokens, kv_lens, visible, depth,
                  rows=torch.zeros(len(prompts), 1, dtype=torch.long, device=device))
    return torch.tensor(lengths, dtype=torch.long, device=device)


def generate(target, requests: Sequence[Request], sampling: Sampling = Sampling(),
             speculation: Speculation = Speculation(), *, draft_model=None,
             eos_token_id: Optional[int] = None, keep_cache: bool = False,
             planted_bug: Optional[str] = None) -> Result:
    """Generate for a static batch of requests; finished requests leave the batch.

    ``keep_cache``: return each request's committed K/V (to check them against a
    recomputation). ``planted_bug``: a deliberate error for the tests to catch
    (``"rows_one_late"``: each draft is checked against the target row one position late)."""
    device = next(target.parameters()).device
    spec = speculation
    if spec.drafter not in ("none", "ngram", "model"):
        raise ValueError(f"drafter: expected 'none', 'ngram' or 'model', got {spec.drafter!r}")
    batch = len(requests)
    max_nodes = _max_nodes(spec)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + max_nodes + 2
    stats = Stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    cache = SlotCache(batch, capacity)
    kv_lens = _prefill(target, cache, [r.prompt for r in requests], device)
    pending = torch.tensor([r.prompt[-1] for r in requests], dtype=torch.long, device=device)
    history = [list(r.prompt) for r in requests]
    generated: list[list[int]] = [[] for _ in requests]
    live = list(range(batch))           # request index of each batch row
    steps = [0] * batch                 # per request: verify calls so far (the Philox offset)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long)
    drafter = None
    t0 = time.perf_counter()
    if spec.drafter == "ngram":
        drafter = NgramDrafter(spec.ngram_max)
    elif spec.drafter == "model":
        if draft_model is None:
            raise ValueError("draft_model: expected a model for drafter='model', got None")
        drafter = ModelDrafter(draft_model, [r.prompt for r in requests], capacity, device,
                               sampling, spec, seed=requests[0].seed)
    stats.draft_s += time.perf_counter() - t0  # the draft model's prefill
    adaptive = (AdaptiveLength(batch, spec.max_draft_tokens, calibrate=True) if spec.adaptive
                else None)
    latency = [0.0] * batch
    kept = [None] * batch

    while live:
        step_seeds = seeds[live].to(device)
        offsets = torch.tensor([steps[i] for i in live], dtype=torch.long, device=device)
        t0 = time.perf_counter()
        plan = _plan(spec, drafter, adaptive, history, live, pending, kv_lens, step_seeds,
                     offsets, sampling)
        if plan is None and drafter is not None and hasattr(drafter, "skip"):
            drafter.skip(pending)
        t1 = time.perf_counter()
        commit_s = 0.0
        if plan is None:  # plain decoding
            visible, depth = chain_visibility(len(live), 1, device)
            logits = forward_block(target, cache, pending[:, None], kv_lens, visible, depth)
            if sampling.greedy:  # what sk.sample returns at temperature 0, without its pass
                emitted = logits[:, 0].argmax(-1)
            else:
                emitted = sk.sample(logits[:, 0], seed=step_seeds, offset=offsets,
                                    **sampling.kwargs())
            out = emitted[:, None].to(torch.long)
            num_accepted = torch.zeros(len(live), dtype=torch.long, device=device)
            new_kv_lens = kv_lens + 1
        else:
            nodes = torch.cat([pending[:, None], plan.tokens.clamp_min(0)], 1)
            logits = forward_block(target, cache, nodes, kv_lens, plan.visible, plan.depth)
            out, num_accepted, new_kv_lens = _verify(logits, plan, cache, kv_lens, sampling,
                                                     spec, step_seeds, offsets, planted_bug)
            if drafter is not None and hasattr(drafter, "commit"):
                t_commit = time.perf_counter()
                drafter.commit(plan, kv_lens, num_accepted, out)
                commit_s = time.perf_counter() - t_commit
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0 + commit_s
        stats.verify_s += t2 - t1 - commit_s
        stats.steps += 1
        counts = (num_accepted + 1).tolist()
        out_list = out.tolist()
        accepted_list = num_accepted.tolist()
        finished_rows = []
        for row, i in enumerate(live):
            steps[i] += 1
            stats.request_steps += 1
            stats.accepted += accepted_list[row]
            if plan is not None:
                for depth_index, drafted in enumerate(plan.drafted_by_depth(row)):
                    stats.position(depth_index, drafted, int(accepted_list[row] > depth_index))
                if adaptive is not None:
                    adaptive.observe(row, plan.num_drafted(row), accepted_list[row])
            new = out_list[row][:counts[row]]
            request = requests[i]
            done = False
            for token in new:
                generated[i].append(token)
                history[i].append(token)
                if len(generated[i]) >= request.max_new_tokens or (
                        request.stop_at_eos and token == eos_token_id):
                    done = True
                    break
            if done:
                finished_rows.append(row)
                latency[i] = time.perf_counter() - start
        if adaptive is not None and plan is not None:
            adaptive.observe_cost(plan.tokens.shape[1] + 1, t2 - t1 - commit_s,
                                  t1 - t0 + commit_s,
                                  max(plan.num_drafted(r) for r in range(len(live))))
        elif adaptive is not None:
            adaptive.observe_cost(1, t2 - t1, 0.0, 0)
        pending = out.gather(1, num_accepted[:, None]).squeeze(1).to(torch.long)
        kv_lens = new_kv_lens.to(torch.long)
        if finished_rows:
            if keep_cache:
                for row in finished_rows:  # positions past the stop were never emitted
                    i = live[row]
                    n = len(requests[i].prompt) + len(generated[i]) - 1
                    kept[i] = [t[row, :, :n].clone() for t in cache.tensors()]
            keep = [r for r in range(len(live)) if r not in set(finished_rows)]
            if keep:
                rows = torch.tensor(keep, dtype=torch.long, device=device)
                cache.select(rows)
                kv_lens, pending = kv_lens[rows], pending[rows]
                if drafter is not None and hasattr(drafter, "select"):
                    t_select = time.perf_counter()
                    drafter.select(rows)
                    stats.draft_s += time.perf_counter() - t_select
                if adaptive is not None:
                    adaptive.select(keep)
            live = [live[r] for r in keep]
    stats.wall_s = time.perf_counter() - start
    stats.cpu_s = time.process_time() - cpu_start
    stats.tokens = sum(len(g) for g in generated)
    stats.latency_s = latency
    return Result(generated, stats, kept if keep_cache else None)


def warm_up(target, requests: Sequence[Request], *, draft_model=None,
            eos_token_id: Optional[int] = None, max_new_tokens: int = 6) -> float:
    """A few tokens of plain decoding and of each drafter, greedy and sampled, before anything
    is timed: first calls pay one-time setup (thread pool, allocator, kernel choice), which
    would otherwise be charged to whichever run comes first (the plain baseline). Seconds."""
    start = time.perf_counter()
    short = [dataclasses.replace(r, max_new_tokens=max_new_tokens) for r in requests]
    specs = [Speculation(), Speculation("ngram", 2)]
    if draft_model is not None:
        specs += [Speculation("model", 2), Speculation("model", 0, tree=(2, 1))]
    for spec in specs:
        for sampling in (Sampling(), Sampling(1.0)):
            generate(target, short, sampling, spec, draft_model=draft_model,
                     eos_token_id=eos_token_id)
    return time.perf_counter() - start


def _max_nodes(spec: Speculation) -> int:
    if spec.drafter == "none":
        return 1
    if spec.tree:
        return tree_size(spec.tree)
    k = spec.max_draft_tokens if spec.adaptive else int(spec.num_draft_tokens)
    return k + 1


def tree_size(branching: Sequence[int]) -> int:
    total, width = 1, 1
    for w in branching:
        width *= w
        total += width
    return total


def _plan(spec, drafter, adaptive, history, live, pending, kv_lens, seeds, offsets,
          sampling) -> Optional[DraftPlan]:
    if drafter is None:
        return None
    if spec.tree:
        return drafter.draft_tree(spec.tree, kv_lens, pending, seeds, offsets)
    if adaptive is not None:
        lengths = adaptive.choose_all(len(live))
    else:
        lengths = [int(spec.num_draft_tokens)] * len(live)
    if isinstance(drafter, NgramDrafter):
        plan = drafter.draft([history[i] for i in live], lengths, pending.device)
    else:
        plan = drafter.draft_chain(lengths, kv_lens, pending, seeds, offsets)
    if plan is not None and plan.tokens.shape[1] == 0:
        return None
    return plan


def _verify(logits, plan: DraftPlan, cache: SlotCache, kv_lens, sampling: Sampling,
            spec: Speculation, seeds, offsets, planted_bug):
    params = sampling.kwargs()
    if planted_bug == "rows_one_late" and not plan.is_tree:
        # Planted: draft j is checked against row j + 1, as if row 0 were the first draft's.
        logits = torch.cat([logits[:, 1:], logits[:, -1:]], 1)
    if plan.is_tree:
        out = sk.verify_tree(logits, plan.tree_tokens(), plan.parents,
                             draft_probs=plan.draft_probs, draft_sampling=plan.draft_sampling,
                             num_nodes=plan.num_nodes, seed=seeds, offset=offsets, **params,
                             **_method_kwargs(sk.verify_tree, spec.method))
        plan.accepted_nodes = out.accepted_nodes
        new_kv_lens = sk.compact_kv_cache(cache.tensors(), kv_lens, out.accepted_nodes,
                                          out.num_accepted, layout="bhsd")
        return out.output_token_ids, out.num_accepted.to(torch.long), new_kv_lens
    out = sk.verify_chain(logits, plan.tokens, draft_logits=plan.draft_logits,
                          num_draft_tokens=plan.num_draft, seed=seeds, offset=offsets, **params,
                          **_method_kwargs(sk.verify_chain, spec.method))
    num_accepted = out.num_accepted.to(torch.long)
    # A chain's accepted path is nodes 0..num_accepted: already in place, nothing to move.
    return out.output_token_ids, num_accepted, kv_lens + num_accepted + 1


def replace(spec: Speculation, **changes) -> Speculation:
    return dataclasses.replace(spec, **changes)


def cache_recompute_error(target, request: Request, tokens: list[int],
                          kept: list[torch.Tensor]) -> float:
    """Max |K/V| difference between a kept committed cache and a fresh prefill of
    prompt + emitted tokens (all but the last emitted token are committed)."""
    device = next(target.parameters()).device
    sequence = list(request.prompt) + tokens
    committed = kept[0].shape[1]
    fresh = SlotCache(1, committed + 2)
    _prefill(target, fresh, [sequence[:committed + 1]], device)
    worst = 0.0
    for old, new in zip(kept, fresh.tensors()):
        worst = max(worst, float((old - new[0, :, :committed]).abs().max()))
    if not math.isfinite(worst):
        return float("inf")
    return worst
