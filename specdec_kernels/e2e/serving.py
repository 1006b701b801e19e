"""Continuous batching: requests join while others decode and leave when done, each with its
own sampling parameters, seed and policy state (:class:`Server`, :func:`serve`).

A joining request's prefill runs at a step boundary in a forward of its own (the arrivals of
that boundary packed together, no logits), before the next decode step; its last prompt token
is then pending and it decodes from that step on, like every other row. (Fusing it into the
decode step's forward would save a forward per admission at the price of a mixed
prefill/verify step; the separate forward is the simpler exact choice.)

The cache is one :class:`~.pool.SlotPool`: per layer ``[R, H, capacity, D]`` with the live
requests in rows ``0..n-1``, so each step's :class:`~.model.SlotCache` is a view of the first
``n`` rows (no copy) and the decode step is :func:`~.engine.generate`'s. A finished request's row
is given to the last live one (one row copied), so freed rows are reused by the next
arrivals; the pool grows (doubling) only when no row is free.

Bad input is rejected at submission (:meth:`Server.submit`: a ``ValueError`` or
``TypeError`` naming the field, ``requests[i].prompt``); nothing of it enters the batch, so
the requests in flight go on unharmed. :func:`serve` records it as a completion with
``error`` set and goes on.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

import specdec_kernels as sk

from .adaptive import AdaptiveLength
from .config import PHASES, PhaseClock, Request, Sampling, Speculation, check_run
from .drafters import NgramDrafter, NgramTrieDrafter
from .engine import check_speculation, max_nodes, plan_step
from .load import as_load
from .model import SlotCache, chain_visibility, forward_block, prefill
from .pool import PooledModelDrafter, RowSampling, SlotPool
from .verify import unpack_rows, verify_step

NAN = float("nan")


@dataclass
class Completion:
    """One request's outcome; times in seconds on the loop's clock."""
    id: int
    tokens: list = field(default_factory=list)
    arrival_s: float = 0.0
    admitted_s: float = NAN   # its prefill ran
    first_token_s: float = NAN
    finish_s: float = NAN
    finished: bool = False    # False: still in flight when the loop stopped
    error: Optional[str] = None  # rejected at submission: why
    tag: str = ""

    @property
    def ttft_s(self) -> float:
        """Time to first token: from its arrival to the step that emitted it."""
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (NaN with fewer than two)."""
        if len(self.tokens) < 2:
            return NAN
        return (self.finish_s - self.first_token_s) / (len(self.tokens) - 1)


@dataclass
class ServeStats:
    steps: int = 0
    speculative_steps: int = 0   # steps with drafts
    rows: int = 0                # live requests summed over steps (mean batch = rows / steps)
    drafted: int = 0
    accepted: int = 0            # accepted drafts, all requests and steps
    tokens: int = 0
    admissions: int = 0          # prefill forwards
    rejected: int = 0
    max_rows: int = 0            # the pool's rows at the end (its largest)
    wall_s: float = 0.0
    profile: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def mean_batch(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    @property
    def accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def speculative_share(self) -> float:
        return self.speculative_steps / self.steps if self.steps else 0.0


@dataclass
class ServeResult:
    completions: list        # [Completion] by id (submission order)
    stats: ServeStats
    policy: Optional[AdaptiveLength] = None


@dataclass
class _Row:
    id: int
    request: Request
    sampling: Sampling
    history: list
    completion: Completion
    steps: int = 0   # verify calls so far (the Philox offset)


class Server:
    """A continuous-batching loop over one target model: :meth:`submit` queues a request,
    :meth:`step` admits the queued ones (up to ``max_batch`` live) and runs one decode step.

    ``speculation``: plain decoding, n-gram chains (fixed or adaptive length), the n-gram
    trie, or draft-model chains (``draft_model``; its cache is a pool following the rows);
    draft trees are not served. ``policy``: an :class:`AdaptiveLength`
    to go on with (its per-request state starts afresh); default a new one, ``load_aware``
    (costs kept across batch sizes, the prior by the live batch)."""

    def __init__(self, target, speculation: Speculation = Speculation(), *,
                 eos_token_id: Optional[int] = None, policy: Optional[AdaptiveLength] = None,
                 max_batch: Optional[int] = None, clock=time.perf_counter, draft_model=None):
        if not isinstance(speculation, Speculation):
            raise TypeError(f"speculation: expected a Speculation, got "
                            f"{type(speculation).__name__}")
        self.vocab = target.get_input_embeddings().num_embeddings
        check_run([Request([0], 1)], Sampling(), speculation, self.vocab)
        check_speculation(speculation)
        if speculation.tree:
            raise ValueError(f"speculation.tree: the serving loop drafts chains and n-gram "
                             f"tries, not draft trees; got tree={speculation.tree}")
        if speculation.drafter == "model" and draft_model is None:
            raise ValueError("draft_model: expected a model for drafter='model', got None")
        if max_batch is not None and (isinstance(max_batch, bool) or
                                      not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch: expected an int >= 1 or None, got {max_batch!r}")
        if policy is not None and not isinstance(policy, AdaptiveLength):
            raise TypeError(f"policy: expected an AdaptiveLength, got {type(policy).__name__}")
        self.target, self.spec, self.eos = target, speculation, eos_token_id
        self.device = next(target.parameters()).device
        self.max_batch, self.clock = max_batch, clock
        spec = speculation
        self.drafter = None
        if spec.trie:
            self.drafter = NgramTrieDrafter(spec.ngram_max, spec.trie_nodes,
                                            int(spec.num_draft_tokens))
        elif spec.drafter == "ngram":
            self.drafter = NgramDrafter(spec.ngram_max)
        elif spec.drafter == "model":
            self.drafter = PooledModelDrafter(draft_model, spec, self.device)
        self.adaptive = None
        model_drafts = spec.drafter == "model"  # a forward per draft level: probes of one
        if spec.adaptive:
            self.adaptive = policy or AdaptiveLength(0, spec.max_draft_tokens, calibrate=True,
                                                     draft_cost_per_level=model_drafts,
                                                     probe_length=1 if model_drafts else 4,
                                                     load_aware=True)
            self.adaptive.start(0)
        self.pool = SlotPool()
        self.rows: list[_Row] = []
        self.kv_lens = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pending = torch.zeros(0, dtype=torch.long, device=self.device)
        self.queue: deque = deque()
        self.completions: list[Completion] = []
        self.stats = ServeStats()
        self.start = clock()
        self._clock = PhaseClock(self.stats.profile)

    def now(self) -> float:
        return self.clock() - self.start

    @property
    def busy(self) -> bool:
        """Requests live or queued."""
        return bool(self.rows or self.queue)

    def submit(self, request: Request, sampling: Sampling = Sampling(), *,
               arrival_s: Optional[float] = None, tag: str = "") -> int:
        """Queue a request (admitted at the next step boundary); returns its id. A bad request
        is a ``ValueError``/``TypeError`` naming the field (``requests[id].prompt``), recorded
        as a completion with ``error`` and never admitted."""
        rid = len(self.completions)
        completion = Completion(rid, arrival_s=self.now() if arrival_s is None else arrival_s,
                                tag=tag)
        self.completions.append(completion)
        try:
            if not isinstance(sampling, Sampling):
                raise TypeError(f"sampling: expected a Sampling, got {type(sampling).__name__}")
            check_run([request], sampling, self.spec, self.vocab)
        except (ValueError, TypeError) as error:
            message = str(error).replace("requests[0]", f"requests[{rid}]")
            completion.error, completion.finished = message, True
            self.stats.rejected += 1
            raise type(error)(message) from None
        request = Request(list(request.prompt), request.max_new_tokens, request.seed,
                          request.stop_at_eos)  # the caller's later edits do not reach it
        self.queue.append(_Row(rid, request, Sampling(sampling.temperature, sampling.top_k,
                                                      sampling.top_p),
                               list(request.prompt), completion))
        return rid

    def _admit(self) -> None:
        room = len(self.queue) if self.max_batch is None else self.max_batch - len(self.rows)
        joining = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        if not joining:
            return
        prompts = [row.request.prompt for row in joining]
        fresh = SlotCache(len(prompts), max(len(p) for p in prompts))
        written = prefill(self.target, fresh, prompts, self.device)
        need = max(len(p) + r.request.max_new_tokens for p, r in zip(prompts, joining))
        capacity = need + max_nodes(self.spec) + 2
        self.pool.add(fresh, capacity)
        if isinstance(self.drafter, PooledModelDrafter):
            self.drafter.add(prompts, capacity, self.device)
        self.kv_lens = torch.cat([self.kv_lens, written])
        self.pending = torch.cat([self.pending, torch.tensor(
            [p[-1] for p in prompts], dtype=torch.long, device=self.device)])
        now = self.now()
        for row in joining:
            row.completion.admitted_s = now
        self.rows += joining
        if self.adaptive is not None:
            self.adaptive.add(len(joining))
        self.stats.admissions += 1
        self.stats.max_rows = self.pool.rows

    def step(self) -> list[Completion]:
        """Admit what is queued, then one decode step of every live request; returns the
        completions that finished in it."""
        with torch.inference_mode():
            clock = self._clock
            clock.skip()
            self._admit()
            clock.lap("prefill")
            if not self.rows:
                return []
            return self._decode(clock)

    def _decode(self, clock: PhaseClock) -> list[Completion]:
        spec, drafter, adaptive, rows = self.spec, self.drafter, self.adaptive, self.rows
        stats, profile, device = self.stats, self.stats.profile, self.device
        batch = len(rows)
        cache = self.pool.view()
        kv_lens, pending = self.kv_lens, self.pending
        sampling = RowSampling([r.sampling for r in rows], device)
        if sampling.greedy and drafter is None:  # plain greedy decoding draws nothing
            seeds = offsets = None
        else:
            seeds = torch.tensor([r.request.seed for r in rows], dtype=torch.long, device=device)
            offsets = torch.tensor([r.steps for r in rows], dtype=torch.long, device=device)
        remaining = [r.request.max_new_tokens - len(r.completion.tokens) for r in rows]
        model_drafter = isinstance(drafter, PooledModelDrafter)
        if model_drafter:
            drafter.sampling = sampling  # the rows' own parameters for its drafts
        clock.lap("python")
        drafting_before = profile["drafting"]
        plan = plan_step(spec, drafter, adaptive, [r.history for r in rows], range(batch),
                         remaining, pending, kv_lens, seeds, offsets, clock)
        if plan is None and model_drafter:
            drafter.skip(pending)
        clock.lap("drafting")
        draft_seconds = profile["drafting"] - drafting_before  # this step's drafts
        committed_before = profile["drafting"]
        verify_start = time.perf_counter()
        if plan is None:
            visible, depth = chain_visibility(batch, 1, device)
            logits = forward_block(self.target, cache, pending[:, None], kv_lens, visible,
                                   depth, profile=profile)
            clock.skip()
            if sampling.greedy:
                out = logits[:, 0].argmax(-1)[:, None]
            else:
                out = sk.sample(logits[:, 0], seed=seeds, offset=offsets,
                                **sampling.kwargs())[:, None]
            clock.lap("verify_op")
            num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
            new_kv_lens = kv_lens + 1
        else:
            nodes = torch.cat([pending[:, None], plan.tokens.clamp_min(0)], 1)
            lengths = (plan.num_draft + 1 if not plan.is_tree
                       else plan.num_nodes if plan.depths is not None else None)
            logits = forward_block(self.target, cache, nodes, kv_lens, plan.visible,
                                   plan.depth, lengths=lengths, profile=profile)
            clock.skip()
            if plan.is_tree and lengths is not None:
                logits = unpack_rows(logits, lengths, nodes.shape[1])
            out, num_accepted, new_kv_lens = verify_step(
                logits, plan, cache, kv_lens, sampling, spec, seeds, offsets, None, profile)
            clock.skip()
            if model_drafter:
                drafter.commit(plan, kv_lens, num_accepted, out)
                clock.lap("drafting")
        commit_s = profile["drafting"] - committed_before
        verify_seconds = time.perf_counter() - verify_start - commit_s
        counts = (num_accepted + 1).tolist()
        out_list, accepted_list = out.tolist(), num_accepted.tolist()
        now = self.now()
        stats.steps += 1
        stats.rows += batch
        finished, done_rows = [], []
        for b, row in enumerate(rows):
            row.steps += 1
            tokens = row.completion.tokens
            if not tokens:
                row.completion.first_token_s = now
            if plan is not None:
                stats.drafted += plan.num_drafted(b)
                stats.accepted += accepted_list[b]
            for token in out_list[b][:counts[b]]:
                tokens.append(token)
                row.history.append(token)
                stats.tokens += 1
                if len(tokens) >= row.request.max_new_tokens or (
                        row.request.stop_at_eos and token == self.eos):
                    row.completion.finish_s, row.completion.finished = now, True
                    finished.append(row.completion)
                    done_rows.append(b)
                    break
        stats.speculative_steps += plan is not None
        clock.lap("python")
        if adaptive is not None:
            if plan is not None:
                for b in range(batch):
                    adaptive.observe(b, plan.num_drafted(b), accepted_list[b])
                adaptive.observe_cost(int(plan.num_draft.sum()) + batch, verify_seconds,
                                      draft_seconds + commit_s, int(plan.num_draft.max()))
            else:
                adaptive.observe_cost(batch, verify_seconds)
            clock.lap("policy")
        self.pending = out.gather(1, num_accepted[:, None]).squeeze(1).to(torch.long)
        self.kv_lens = new_kv_lens.to(torch.long)
        if done_rows:
            order = self.pool.remove(done_rows, self.kv_lens.tolist())
            if model_drafter and drafter.remove(done_rows) != order:
                raise RuntimeError("draft pool out of step with the target's")
            index = torch.tensor(order, dtype=torch.long, device=device)
            self.kv_lens, self.pending = self.kv_lens[index], self.pending[index]
            self.rows = [rows[r] for r in order]
            clock.lap("compaction")
            if adaptive is not None:
                adaptive.select(order)
                clock.lap("policy")
        return finished


def serve(target, load, speculation: Speculation = Speculation(), *,
          eos_token_id: Optional[int] = None, policy: Optional[AdaptiveLength] = None,
          max_batch: Optional[int] = None, time_limit: Optional[float] = None,
          clock=time.perf_counter, sleep=time.sleep, draft_model=None) -> ServeResult:
    """Serve a load (a list of :class:`~.load.Arrival` or a load object of :mod:`.load`):
    a request arrives when the loop's clock passes its time and is admitted at the next step
    boundary. Runs until nothing is live, queued or still to arrive, or ``time_limit``
    seconds (then the requests in flight are left unfinished: ``Completion.finished``)."""
    if time_limit is not None and (isinstance(time_limit, bool) or
                                   not isinstance(time_limit, (int, float)) or
                                   not time_limit > 0):
        raise ValueError(f"time_limit: expected seconds > 0 or None, got {time_limit!r}")
    load = as_load(load)
    server = Server(target, speculation, eos_token_id=eos_token_id, policy=policy,
                    max_batch=max_batch, clock=clock, draft_model=draft_model)
    limit = math.inf if time_limit is None else float(time_limit)
    while True:
        now = server.now()
        if now >= limit:
            break
        for arrival in load.due(now):
            try:
                server.submit(arrival.request, arrival.sampling, arrival_s=arrival.at,
                              tag=arrival.tag)
            except (ValueError, TypeError):  # recorded in its completion; the loop goes on
                load.finished(server.completions[-1], now)
        if server.busy:
            for completion in server.step():  # its client has the answer at finish_s
                load.finished(completion, completion.finish_s)
            continue
        next_at = load.next_at()
        if next_at is None:
            break
        sleep(max(0.0, min(next_at, limit) - now))
    server.stats.wall_s = server.now()
    return ServeResult(list(server.completions), server.stats, server.adaptive)
