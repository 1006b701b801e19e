"""Per-request draft lengths for chains (:class:`AdaptiveLength`): measured acceptance per
draft position, measured step costs, a greedy allocation of draft positions over the batch,
and probes that bring a request left at plain decoding back when its drafter agrees again."""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence


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
                 calibrate: bool = False, contexts: bool = True, interpolate: bool = True,
                 shared_probes: bool = True, load_aware: bool = False):
        self.max_len, self.decay, self.probe_every = max_len, decay, probe_every
        # A serving loop's batch changes every step (rows join and leave): the prior follows
        # the live batch, the step costs (keyed by rows, the batch's included) are kept
        # whatever the batch, and past the largest measured row count a step's cost grows
        # in proportion to its rows (a conservative guess: compute-bound), so that drafting
        # fades as the load rises.
        self.load_aware = load_aware
        self.probe_length = probe_length  # a probe drafts this many (when the drafter has
        # them): one that accepts teaches the rates of the later positions too
        # Acceptance at position 1 before anything was checked: 1/2 for one request, less
        # for a batch (1/6 at 16), whose verify steps are compute-bound, so that a wasted
        # row costs more: a large batch starts near plain decoding and drafts where its
        # probes find agreement.
        self.fixed_prior = prior
        self.calibrate = calibrate  # first a plain step: the cost every choice is relative to
        # Contexts: what the drafter knows of a proposal (an n-gram's: how long its match
        # is, :func:`match_context`); rates are also counted per context over the batch,
        # with the request's own rates as their prior, so a long match drafts long.
        self.use_contexts = contexts
        self.interpolate = interpolate
        self.shared_probes = shared_probes
        self.probe_trials = self.probe_successes = 0.0  # over the batch, decayed
        self.context_successes: dict = {}  # context -> [position]
        self.context_trials: dict = {}
        self.clock = 0  # choices made: probes fall on every probe_every-th
        self.row_exponent = row_exponent  # before two row counts are measured
        self.draft_cost_per_level = draft_cost_per_level
        self.samples: list[tuple[int, float]] = []   # recent (rows, seconds)
        self._fit: Optional[tuple[float, float, float]] = None
        self.step_seconds: dict[int, float] = {}     # rows -> decayed mean seconds
        self.step_count: dict[int, int] = {}
        self.draft_level_seconds = 0.0
        self.batch = 0
        self.start(batch)

    def start(self, batch: int) -> None:
        """A new batch of requests: their own state starts afresh, while what was learnt of
        the drafter's contexts and the step costs is kept (a policy that lives across
        calls, as a server's would; the costs only while the batch size stays)."""
        self.prior = self.batch_prior(batch)
        self.successes = [[0.0] * self.max_len for _ in range(batch)]  # [request][position]
        self.trials = [[0.0] * self.max_len for _ in range(batch)]
        self.context = [None] * batch  # of each request's last choice
        self.idle = [0] * batch
        self.gap = [self.probe_every] * batch
        self.probing = [False] * batch
        if batch != self.batch and not self.load_aware:
            self.samples, self._fit = [], None
            self.step_seconds, self.step_count = {}, {}
        self.batch = batch

    def batch_prior(self, batch: int) -> float:
        """Acceptance at position 1 before anything was checked, for a batch of ``batch``."""
        if self.fixed_prior is not None:
            return self.fixed_prior
        return 0.5 / (1 + math.log2(max(batch, 1)) / 2)

    def add(self, count: int) -> None:
        """``count`` requests join the batch (a serving loop): fresh per-request state after
        the live rows; what was learnt of contexts and costs is kept."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count: expected an int >= 0, got {count!r}")
        self.successes += [[0.0] * self.max_len for _ in range(count)]
        self.trials += [[0.0] * self.max_len for _ in range(count)]
        self.context += [None] * count
        self.idle += [0] * count
        self.gap += [self.probe_every] * count
        self.probing += [False] * count
        self.batch = len(self.successes)

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
        overall = [min((s + 2.0 * p) / (t + 2.0), 0.99)
                   for s, t, p in zip(self.successes[b], self.trials[b], prior)]
        context = self.context[b]
        if not self.use_contexts or context not in self.context_trials:
            return overall
        return [min((s + 2.0 * p) / (t + 2.0), 0.99) for s, t, p in zip(
            self.context_successes[context], self.context_trials[context], overall)]

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
        if self.load_aware:
            top = max(self.step_seconds)
            if rows > top:
                return self.step_seconds[top] * rows / top
        if self.interpolate:  # between the nearest measured row counts on either side
            below = max((r for r in self.step_seconds if r < rows), default=None)
            above = min((r for r in self.step_seconds if r > rows), default=None)
            if below is not None and above is not None:
                w = (rows - below) / (above - below)
                return (1 - w) * self.step_seconds[below] + w * self.step_seconds[above]
        mean_x, mean_y, exponent = self._power_law()
        return math.exp(mean_y + exponent * (math.log(rows) - mean_x))

    def choose(self, available: Sequence[int], contexts: Optional[Sequence] = None,
               remaining: Optional[Sequence[int]] = None) -> list[int]:
        """Draft lengths for the live requests; ``available[b]``: the most drafts request
        ``b`` can have this step (an n-gram's proposal length; ``max_len`` for a model);
        ``contexts[b]``: the proposal's context (hashable; None: none); ``remaining[b]``:
        the most tokens request ``b`` may still emit (None: no bound): it drafts at most
        ``remaining[b] - 1``, the most it could emit with the token verification adds."""
        batch = len(available)
        if self.load_aware:
            self.prior = self.batch_prior(batch)
        self.context = list(contexts) if contexts is not None else [None] * batch
        if self.calibrate and not self.samples:  # first a plain step: the unit
            return [0] * batch
        caps = [min(int(a), self.max_len) for a in available]
        if remaining is not None:
            caps = [min(c, max(int(r) - 1, 0)) for c, r in zip(caps, remaining)]
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
        due = []
        for b in range(batch):
            if best_lengths[b]:
                self.idle[b] = 0
                continue
            if not caps[b]:  # nothing to probe with: the wait goes on
                continue
            self.idle[b] += 1
            if self.idle[b] >= self.gap[b] and probe_step:
                due.append(b)
        length = self.current_probe_length()
        if self.load_aware and len(due) > 1:
            due = self._affordable(due, best_lengths, caps, length)
        for b in due:
            self.idle[b] = 0
            self.probing[b] = True
            best_lengths[b] = min(length, caps[b])
        return best_lengths

    def _affordable(self, due, lengths, caps, length) -> list:
        """The due probes (longest idle first) whose rows together cost at most one request's
        share of the step (at batch 1 a whole step; at 16 a sixteenth); at least one. The
        others stay due for the next probe step: probes fade with the load too."""
        rows = len(lengths) + sum(lengths)
        base = self.verify_seconds(rows)
        chosen, extra = [], 0
        for b in sorted(due, key=lambda b: -self.idle[b]):
            k = min(length, caps[b])
            if chosen and self.verify_seconds(rows + extra + k) - base > base / len(lengths):
                break
            chosen.append(b)
            extra += k
        return chosen

    def current_probe_length(self) -> int:
        """``probe_length`` while probes find agreement, shorter as they fail (the batch's
        decayed rate of probes that accepted something, prior 1/2 with weight 2): where
        drafts never land, a probe costs one row."""
        if not self.shared_probes:
            return self.probe_length
        rate = (self.probe_successes + 1.0) / (self.probe_trials + 2.0)
        return max(1, min(self.probe_length, round(2 * rate * self.probe_length)))

    def observe(self, b: int, drafted: int, accepted: int) -> None:
        """Request ``b`` drafted ``drafted`` tokens and ``accepted`` of them were accepted:
        positions ``1..accepted+1`` were checked (the last of them rejected unless all were
        accepted)."""
        if drafted == 0:
            return
        counts = [(self.trials[b], self.successes[b])]
        context = self.context[b]
        if self.use_contexts and context is not None:
            if context not in self.context_trials:
                self.context_trials[context] = [0.0] * self.max_len
                self.context_successes[context] = [0.0] * self.max_len
            counts.append((self.context_trials[context], self.context_successes[context]))
        for trials, successes in counts:
            for j in range(min(accepted + 1, drafted)):
                trials[j] = self.decay * trials[j] + 1.0
                successes[j] = self.decay * successes[j] + (j < accepted)
        if self.probing[b]:
            self.probing[b] = False
            self.probe_trials = self.decay * self.probe_trials + 1.0
            self.probe_successes = self.decay * self.probe_successes + (accepted > 0)
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
        for name in ("successes", "trials", "idle", "gap", "probing", "context"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])
        if self.load_aware:
            self.batch = len(rows)


def match_context(match_length: int) -> int:
    """An n-gram proposal's context for :class:`AdaptiveLength`: its match length's bucket
    (1, 2, 3-4, 5-8, 9-16, 17+ tokens)."""
    return min(max(match_length - 1, 0).bit_length(), 5)
