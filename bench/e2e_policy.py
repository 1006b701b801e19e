"""``python -m bench.e2e_policy``: draft-length policies for the n-gram drafter, compared on
recorded greedy runs, without timing noise.

Greedy speculation emits plain greedy decoding's tokens whatever the draft lengths, so one
plain run of a request set fixes, at every point of every answer, the n-gram proposal and how
many of its tokens the target accepts (the longest common prefix of the proposal and the
answer). A policy (fixed ``K``, :class:`~specdec_kernels.e2e.adaptive.AdaptiveLength`, or the
oracle that drafts exactly what will be accepted) is replayed on that record; each step costs
a packed verify forward over its rows, measured once per row count on the real model
(median of a few forwards) and interpolated between them. What it leaves out: the time of
drafting and verification outside the forward, and the cost's dependence on how many
requests share the rows. Timings on a shared 2-core machine vary by 20% from run to run;
a replay compares policies on the same record and costs, so its ratios do not.

    python -m bench.e2e_policy                    # copy and rare_terms, batch 1, 4 and 16
    python -m bench.e2e_policy --out DIR          # also writes DIR/e2e_policy.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from specdec_kernels.e2e.config import Request, Sampling, Speculation
from specdec_kernels.e2e.engine import generate
from specdec_kernels.e2e.adaptive import AdaptiveLength, match_context
from specdec_kernels.e2e.drafters import NgramDrafter
from specdec_kernels.e2e.model import SlotCache, chain_visibility, forward_block, prefill

MAX_DRAFT = 16
SETS = (("copy", 1, 4, 128), ("rare_terms", 1, 2, None), ("copy", 4, 4, 96),
        ("copy", 16, 16, 96), ("rare_terms", 16, 16, 48))  # (task, batch, prompts, budget)

Policy = Union[int, str]  # K, "adaptive" or "oracle"


def record(model, requests: Sequence[Request], eos: Optional[int]) -> list[dict]:
    """Plain greedy answers of ``requests``: [{prompt, answer}]."""
    result = generate(model, requests, Sampling(), Speculation(), eos_token_id=eos)
    return [{"prompt": list(r.prompt), "answer": a} for r, a in zip(requests, result.tokens)]


def measure_costs(model, batch: int, context: int = 300, rounds: int = 5) -> dict[int, float]:
    """Seconds of a packed verify forward over ``T`` rows for a batch of ``batch`` requests
    (rows spread evenly), at a few ``T`` from ``batch`` to ``batch * (MAX_DRAFT + 1)``:
    the median of ``rounds`` rounds that each visit every ``T`` once (the machine's speed
    drifts, and a drift then moves every ``T`` alike)."""
    width = MAX_DRAFT + 1
    totals = sorted({batch * m for m in (1, 2, 3, 5, 9, width)} | {batch + 1, batch + 2}
                    if batch > 1 else set(range(1, 9)) | {10, 12, 14, width})
    cache = SlotCache(batch, context + width + 1)
    kv_lens = prefill(model, cache, [[5] * (context + 1)] * batch, "cpu")
    tokens = torch.full((batch, width), 7)
    visible, depth = chain_visibility(batch, width, "cpu")
    times: dict[int, list[float]] = {total: [] for total in totals}
    for round_index in range(rounds + 1):  # round 0 warms every shape up
        for total in totals:
            lengths = torch.tensor([total // batch + (b < total % batch)
                                    for b in range(batch)])
            start = time.perf_counter()
            forward_block(model, cache, tokens, kv_lens, visible, depth, lengths=lengths)
            if round_index:
                times[total].append(time.perf_counter() - start)
    return {total: statistics.median(t) for total, t in times.items()}


def interpolate(costs: dict[int, float], rows: int) -> float:
    keys = sorted(costs)
    if rows in costs:
        return costs[rows]
    lower = max((k for k in keys if k < rows), default=keys[0])
    upper = min((k for k in keys if k > rows), default=keys[-1])
    if lower == upper:
        return costs[lower] * (rows / lower) ** 0.5
    w = (rows - lower) / (upper - lower)
    return (1 - w) * costs[lower] + w * costs[upper]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(records: list[dict], batch: int, policy: Policy,
           cost: Callable[[int], float], ngram_max: int = 3,
           adaptive_options: Optional[dict] = None) -> dict:
    """Replays ``policy`` on the recorded answers in static batches of ``batch``; returns
    tokens/s (modelled), steps and accepted drafts."""
    drafter = NgramDrafter(ngram_max)
    seconds, tokens, steps, accepted = 0.0, 0, 0, 0
    options = dict(adaptive_options or {})
    persist = options.pop("persist", True)  # one policy for every batch (a server's)
    adaptive = None
    for start in range(0, len(records), batch):
        chunk = records[start:start + batch]
        done = [0] * len(chunk)
        live = list(range(len(chunk)))
        if policy == "adaptive" and (adaptive is None or not persist):
            adaptive = AdaptiveLength(len(chunk), MAX_DRAFT, calibrate=True,
                                      draft_cost_per_level=False, **options)
        elif adaptive is not None:
            adaptive.start(len(chunk))
        while live:
            found = [drafter.propose_with_match(
                chunk[i]["prompt"] + chunk[i]["answer"][:done[i]], MAX_DRAFT) for i in live]
            proposals = [p for p, _ in found]
            will_accept = [_common_prefix(p, chunk[i]["answer"][done[i]:])
                           for p, i in zip(proposals, live)]
            if adaptive is not None:
                lengths = adaptive.choose([len(p) for p in proposals],
                                          [match_context(m) for _, m in found],
                                          [len(chunk[i]["answer"]) - done[i] for i in live])
            elif policy == "oracle":
                lengths = will_accept
            else:
                lengths = [min(int(policy), len(p)) for p in proposals]
            rows = len(live) + sum(lengths)
            step = cost(rows)
            seconds, steps = seconds + step, steps + 1
            finished = []
            for row, i in enumerate(live):
                got = min(lengths[row], will_accept[row])
                accepted += got
                if adaptive is not None:
                    adaptive.observe(row, lengths[row], got)
                done[i] += got + 1
                if done[i] >= len(chunk[i]["answer"]):
                    finished.append(row)
            if adaptive is not None:
                adaptive.observe_cost(rows, step, 0.0, max(lengths))
            keep = [r for r in range(len(live)) if r not in finished]
            if adaptive is not None and finished:
                adaptive.select(keep)
            live = [live[r] for r in keep]
        tokens += sum(len(r["answer"]) for r in chunk)
    return {"tokens_per_s": tokens / seconds, "steps": steps, "accepted": accepted}


def compare(records: list[dict], batch: int, cost: Callable[[int], float],
            policies: Sequence[Policy] = (2, 4, 8, 16, "adaptive", "oracle"),
            adaptive_options: Optional[dict] = None) -> dict:
    """Each policy's tokens/s over plain decoding's (K = 0) on the same record and costs."""
    plain = replay(records, batch, 0, cost)["tokens_per_s"]
    return {"plain_tokens_per_s": plain,
            **{str(p): replay(records, batch, p, cost, adaptive_options=adaptive_options)
               ["tokens_per_s"] / plain for p in policies}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.e2e_policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--records", type=Path, default=None, help="a JSON file of recorded "
                    "answers: read when it exists (no plain runs), else written")
    ap.add_argument("--costs-from", type=Path, default=None, help="an e2e_policy.json whose "
                    "measured costs_s to use (no cost measurement)")
    args = ap.parse_args(argv)
    from specdec_kernels.e2e.model import load_model
    from specdec_kernels.e2e.tasks import task_requests
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.target)
    rows, costs_by_batch = [], {}
    if args.costs_from:
        costs_by_batch = {int(b): {int(t): v for t, v in c.items()} for b, c in
                          json.loads(args.costs_from.read_text())["costs_s"].items()}
    saved = (json.loads(args.records.read_text()) if args.records and args.records.exists()
             else {})
    for task, batch, prompts, max_new in SETS:
        extra = {"max_new_tokens": max_new} if max_new else {}
        key = f"{task}/{prompts}/{max_new}"
        if key not in saved:
            requests = task_requests(tokenizer, task, prompts, **extra)
            saved[key] = record(model, requests, tokenizer.eos_token_id)
            if args.records:
                args.records.write_text(json.dumps(saved))
        records = saved[key]
        if batch not in costs_by_batch:
            costs_by_batch[batch] = measure_costs(model, batch)
        costs = costs_by_batch[batch]
        result = compare(records, batch, lambda r: interpolate(costs, r))
        rows.append({"task": task, "batch": batch, **result})
        print(task, f"b{batch}", "  ".join(f"{k}: {v:.3g}" for k, v in result.items()),
              flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "e2e_policy.json").write_text(json.dumps(
            {"rows": rows, "costs_s": {str(b): {str(t): s for t, s in c.items()}
                                       for b, c in costs_by_batch.items()},
             "threads": args.threads, "max_draft": MAX_DRAFT,
             "costs_from": str(args.costs_from) if args.costs_from else None}, indent=1))


if __name__ == "__main__":
    main()
