"""The decode loop: a static batch of requests, drafted, verified by the target in one forward
per step, committed with our verify ops and ``compact_kv_cache``.

Per request the loop keeps ``kv_lens[b]`` committed positions in the target's cache and one
*pending* token (emitted, not yet in the cache). A step feeds ``[pending, drafts...]`` at
``kv_lens[b] + node`` (node 0 is the pending token, the tree's root), so row ``i`` of the
target's logits is the distribution after node ``i``'s path: exactly a chain's
``num_draft[b] + 1`` rows (the forward is packed: request ``b``'s own rows only, in
``verify_chain_packed``'s order) and ``verify_tree``'s ``N`` rows. The accepted path is
then moved to the front of the speculative region (``compact_kv_cache``, layout ``"bhsd"``;
a chain's path is already there), ``kv_lens += num_accepted + 1`` and the correction/bonus
token becomes pending.

Only the public API of :mod:`specdec_kernels` is used; a verification ``method`` is passed
through to the verify op when it takes one (see :func:`verify_methods`).
"""
from __future__ import annotations

import dataclasses
import heapq
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


def _takes_method(op) -> bool:
    return "method" in inspect.signature(op).parameters


def verify_methods(kind: str = "chain") -> tuple[str, ...]:
    """The verification methods the installed ``verify_chain_packed`` / ``verify_tree`` accept
    (``("token",)`` when the op has no ``method`` parameter), found by trying each candidate
    on a one-request problem."""
    op = sk.verify_chain_packed if kind == "chain" else sk.verify_tree
    if not _takes_method(op):
        return (DEFAULT_METHOD,)
    logits = torch.zeros(1, 2, 4)
    found = []
    for method in METHOD_CANDIDATES:
        try:
            if kind == "chain":  # the packed op: what the loop calls for chains
                op(logits[0], torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]),
                   max_draft_tokens=1, temperature=1.0, seed=0, method=method)
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
    """Per-request draft lengths from measured acceptance and measured step costs.

    Acceptance: per request and draft position ``j``, decayed counts of how often draft ``j``
    was accepted when it was checked (drafts ``1..j-1`` accepted), so ``a_j`` is a conditional
    rate: copying runs (high ``a_j`` once a run started) and one-off guesses differ. Its
    prior is the whole batch's rate at ``j`` (which leans on ``j - 1``'s), so a request with
    few trials follows its batch. ``k`` drafts are worth ``1 + sum_{j<=k} a_1 ... a_j`` tokens.

    Cost: the verify forward of a step over ``T`` rows in all (a request with ``k`` drafts
    has ``k + 1`` rows: the packed forward of :func:`~.model.forward_block` costs its rows,
    not the batch's widest chain) is a power law ``c * T^alpha`` fitted (least squares in
    logs) to the recent steps, or a row count's own decayed mean once it has ``MEASURED``
    samples. Measured here (SmolLM2-135M, 2 threads): ``alpha`` ~0.4 at batch 1 (17 rows
    cost 3x one) and ~0.55 at batch 16 (a compute-bound CPU), with two rows costing what one
    does at batch 1. Plus ``k_max`` times the drafter's measured time per draft level (a
    draft model's; an n-gram's is per step, the same for every choice).

    Choice: draft positions are added one at a time, the most valuable first (largest
    ``a_1 ... a_j`` over the batch), and the allocation with the most expected tokens per
    second along that sequence wins (none: plain decoding); positions less likely than
    ``MIN_GAIN`` to be reached and accepted are not considered. A request the choice leaves
    at ``0`` drafts probes ``probe_length`` drafts after ``probe_every`` such steps (on the
    batch's every ``probe_every``-th step: the others stay plain); a probe
    that accepts nothing doubles that gap (up to ``8 * probe_every``: a drafter that never
    agrees costs ever less), one that accepts resets it. The defaults were chosen with
    ``bench.e2e_policy`` (replays on recorded greedy answers with measured costs)."""

    MEASURED = 4   # samples of a row count before its own mean replaces the fit
    WINDOW = 64    # recent steps in the fit
    MIN_GAIN = 0.01  # a draft position less likely than this to be reached and accepted

    def __init__(self, batch: int, max_len: int, *, decay: float = 0.95, probe_every: int = 4,
                 probe_length: int = 4, row_exponent: float = 0.4,
                 draft_cost_per_level: bool = True, prior: Optional[float] = None,
                 calibrate: bool = False):
        self.max_len, self.decay, self.probe_every = max_len, decay, probe_every
        self.probe_length = probe_length  # a probe drafts this many (when the drafter has
        # them): one that accepts teaches the rates of the later positions too
        # Acceptance at position 1 before anything was checked: 1/2 for one request, less
        # for a batch (1/6 at 16), whose verify steps are compute-bound, so that a wasted
        # row costs more: a large batch starts near plain decoding and drafts where its
        # probes find agreement.
        self.prior = 0.5 / (1 + math.log2(batch) / 2) if prior is None else prior
        self.calibrate = calibrate  # first a plain step: the cost every choice is relative to
        self.successes = [[0.0] * max_len for _ in range(batch)]  # [request][position]
        self.trials = [[0.0] * max_len for _ in range(batch)]
        self.idle = [0] * batch
        self.clock = 0  # choices made: probes fall on every probe_every-th
        self.gap = [probe_every] * batch
        self.probing = [False] * batch
        self.row_exponent = row_exponent  # before two row counts are measured
        self.draft_cost_per_level = draft_cost_per_level
        self.samples: list[tuple[int, float]] = []   # recent (rows, seconds)
        self._fit: Optional[tuple[float, float, float]] = None
        self.step_seconds: dict[int, float] = {}     # rows -> decayed mean seconds
        self.step_count: dict[int, int] = {}
        self.draft_level_seconds = 0.0

    def batch_rates(self) -> list[float]:
        """The whole batch's rate at each position (position 1's prior ``prior``, position
        j's the batch's rate at j - 1; weight 2)."""
        out, prior = [], self.prior
        for j in range(self.max_len):
            successes = sum(s[j] for s in self.successes)
            trials = sum(t[j] for t in self.trials)
            prior = (successes + 2.0 * prior) / (trials + 2.0)
            out.append(prior)
        return out

    def rates(self, b: int, batch_rates: Optional[list[float]] = None) -> list[float]:
        """``a_1 .. a_max`` of request ``b``: its counts, with the batch's rates as the prior
        (weight 2)."""
        prior = self.batch_rates() if batch_rates is None else batch_rates
        return [min((s + 2.0 * p) / (t + 2.0), 0.99)
                for s, t, p in zip(self.successes[b], self.trials[b], prior)]

    def _power_law(self) -> tuple[float, float, float]:
        """(mean log rows, mean log seconds, exponent) of the recent steps (cached)."""
        if self._fit is None:
            xs = [math.log(r) for r, _ in self.samples]
            ys = [math.log(max(t, 1e-9)) for _, t in self.samples]
            mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mean_x) ** 2 for x in xs)
            exponent = self.row_exponent
            if var > 1e-6:
                slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
                exponent = min(max(slope, 0.0), 1.0)
            self._fit = (mean_x, mean_y, exponent)
        return self._fit

    def verify_seconds(self, rows: int) -> float:
        """Predicted seconds of a verify forward over ``rows`` rows (relative units before
        anything was measured)."""
        if self.step_count.get(rows, 0) >= self.MEASURED:
            return self.step_seconds[rows]
        if not self.samples:
            return float(rows) ** self.row_exponent
        mean_x, mean_y, exponent = self._power_law()
        return math.exp(mean_y + exponent * (math.log(rows) - mean_x))

    def choose(self, available: Sequence[int]) -> list[int]:
        """Draft lengths for the live requests; ``available[b]``: the most drafts request
        ``b`` can have this step (an n-gram's proposal length; ``max_len`` for a model)."""
        batch = len(available)
        if self.calibrate and not self.samples:  # first a plain step: the unit
            return [0] * batch
        caps = [min(int(a), self.max_len) for a in available]
        pooled = self.batch_rates()
        rates = [self.rates(b, pooled) if caps[b] else [] for b in range(batch)]
        lengths, best_lengths = [0] * batch, [0] * batch
        expected, rows, widest = float(batch), batch, 0
        best_value = expected / self.verify_seconds(rows)
        gains = [(-rates[b][0], b) for b in range(batch) if caps[b] > 0]  # a max-heap
        heapq.heapify(gains)
        while gains and -gains[0][0] >= self.MIN_GAIN:
            gain, b = -gains[0][0], gains[0][1]
            lengths[b] += 1
            expected += gain
            rows += 1
            widest = max(widest, lengths[b])
            seconds = (self.verify_seconds(rows) + widest * self.draft_level_seconds)
            if expected / seconds > best_value:
                best_value, best_lengths = expected / seconds, list(lengths)
            if lengths[b] < caps[b]:
                heapq.heapreplace(gains, (-gain * rates[b][lengths[b]], b))
            else:
                heapq.heappop(gains)
        # Probes: a request left at 0 drafts tries some now and then, on every probe_every-th
        # step only, so that the batch's other steps stay plain (no packed forward, no
        # verification: cheaper than their rows say).
        self.clock += 1
        probe_step = self.clock % self.probe_every == 0
        for b in range(batch):
            if best_lengths[b]:
                self.idle[b] = 0
                continue
            if not caps[b]:  # nothing to probe with: the wait goes on
                continue
            self.idle[b] += 1
            if self.idle[b] >= self.gap[b] and probe_step:
                self.idle[b] = 0
                self.probing[b] = True
                best_lengths[b] = min(self.probe_length, caps[b])
        return best_lengths

    def observe(self, b: int, drafted: int, accepted: int) -> None:
        """Request ``b`` drafted ``drafted`` tokens and ``accepted`` of them were accepted:
        positions ``1..accepted+1`` were checked (the last of them rejected unless all were
        accepted)."""
        if drafted == 0:
            return
        for j in range(min(accepted + 1, drafted)):
            self.trials[b][j] = self.decay * self.trials[b][j] + 1.0
            self.successes[b][j] = self.decay * self.successes[b][j] + (j < accepted)
        if self.probing[b]:
            self.probing[b] = False
            self.gap[b] = (self.probe_every if accepted
                           else min(2 * self.gap[b], 8 * self.probe_every))

    def observe_cost(self, rows: int, seconds: float, draft_seconds: float = 0.0,
                     widest: int = 0) -> None:
        """A step's verify forward over ``rows`` rows took ``seconds``; drafting its
        ``widest`` levels took ``draft_seconds`` (a plain step: ``rows`` = batch)."""
        self.samples = (self.samples + [(rows, seconds)])[-self.WINDOW:]
        self._fit = None
        previous = self.step_seconds.get(rows)
        self.step_seconds[rows] = seconds if previous is None else (
            0.8 * previous + 0.2 * seconds)
        self.step_count[rows] = self.step_count.get(rows, 0) + 1
        if widest and self.draft_cost_per_level:
            per_level = draft_seconds / widest
            self.draft_level_seconds = (per_level if not self.draft_level_seconds
                                        else 0.8 * self.draft_level_seconds + 0.2 * per_level)

    def select(self, rows: Sequence[int]) -> None:
        for name in ("successes", "trials", "idle", "gap", "probing"):
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
    if spec.adaptive and spec.tree:
        raise ValueError(f"num_draft_tokens: 'adaptive' is for chains; a tree's shape is "
                         f"fixed (tree={spec.tree})")
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
    # A draft model pays a forward per draft level: its probes draft one token.
    model_drafts = spec.drafter == "model"
    adaptive = (AdaptiveLength(batch, spec.max_draft_tokens, calibrate=True,
                               draft_cost_per_level=model_drafts,
                               probe_length=1 if model_drafts else 4)
                if spec.adaptive else None)
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
            # A chain's forward is packed: request b's num_draft[b] + 1 rows only.
            logits = forward_block(target, cache, nodes, kv_lens, plan.visible, plan.depth,
                                   lengths=None if plan.is_tree else plan.num_draft + 1)
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
            adaptive.observe_cost(int(plan.num_draft.sum()) + len(live), t2 - t1 - commit_s,
                                  t1 - t0 + commit_s, int(plan.num_draft.max()))
        elif adaptive is not None:
            adaptive.observe_cost(len(live), t2 - t1)
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
    cap = spec.max_draft_tokens if adaptive is not None else int(spec.num_draft_tokens)
    ngram = isinstance(drafter, NgramDrafter)
    proposals = ([drafter.propose(history[i], cap) for i in live] if ngram else None)
    if adaptive is not None:
        available = [len(p) for p in proposals] if ngram else [cap] * len(live)
        lengths = adaptive.choose(available)
    else:
        lengths = [cap] * len(live)
    if ngram:
        plan = drafter.plan([p[:k] for p, k in zip(proposals, lengths)], pending.device)
    else:
        plan = drafter.draft_chain(lengths, kv_lens, pending, seeds, offsets)
    if plan is not None and plan.tokens.shape[1] == 0:
        return None
    return plan


def pack_chain_rows(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, n, ...]`` -> the first ``lengths[b]`` rows of each request, request-major
    (``verify_chain_packed``'s layout)."""
    valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < lengths[:, None]
    return rows[valid]


def _verify(logits, plan: DraftPlan, cache: SlotCache, kv_lens, sampling: Sampling,
            spec: Speculation, seeds, offsets, planted_bug):
    """(output_token_ids, num_accepted, new kv_lens). ``logits``: a tree's ``[B, N, V]``;
    a chain's packed rows ``[sum(num_draft + 1), V]`` (``verify_chain_packed``)."""
    params = sampling.kwargs()
    if planted_bug == "rows_one_late" and not plan.is_tree:
        # Planted: draft j is checked against row j + 1, as if row 0 were the first draft's
        # (each request's last row stays its own).
        row = torch.arange(logits.shape[0], device=logits.device)
        last = torch.cumsum(plan.num_draft.to(torch.long) + 1, 0) - 1
        is_last = torch.zeros_like(row, dtype=torch.bool)
        is_last[last] = True
        logits = logits[torch.where(is_last, row, row + 1)]
    if plan.is_tree:
        out = sk.verify_tree(logits, plan.tree_tokens(), plan.parents,
                             draft_probs=plan.draft_probs, draft_sampling=plan.draft_sampling,
                             num_nodes=plan.num_nodes, seed=seeds, offset=offsets, **params,
                             **_method_kwargs(sk.verify_tree, spec.method))
        plan.accepted_nodes = out.accepted_nodes
        new_kv_lens = sk.compact_kv_cache(cache.tensors(), kv_lens, out.accepted_nodes,
                                          out.num_accepted, layout="bhsd")
        return out.output_token_ids, out.num_accepted.to(torch.long), new_kv_lens
    num_draft = plan.num_draft.to(torch.long)
    cu = torch.zeros(num_draft.numel() + 1, dtype=torch.long, device=num_draft.device)
    cu[1:] = torch.cumsum(num_draft, 0)
    draft_logits = (None if plan.draft_logits is None
                    else pack_chain_rows(plan.draft_logits, num_draft))
    out = sk.verify_chain_packed(logits, pack_chain_rows(plan.tokens, num_draft), cu,
                                 max_draft_tokens=plan.tokens.shape[1],
                                 draft_logits=draft_logits, seed=seeds, offset=offsets,
                                 **params, **_method_kwargs(sk.verify_chain_packed,
                                                            spec.method))
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
