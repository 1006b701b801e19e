"""``python -m bench.e2e``: speculative generation on a real model, side by side with plain
decoding and transformers' own decoding, in one run.

    python -m bench.e2e                         # the CPU sweep (<= ~16 min on 2 idle CPU threads)
    python -m bench.e2e --preset full           # every K, both drafters, more prompts (hours)
    python -m bench.e2e --preset quick          # a few seconds of generation per row
    python -m bench.e2e --preset issue26 --repeats 3 --threads 1   # issue 26's targets
    python -m bench.e2e --target FOLDER [--draft FOLDER | --draft-layers 8]

Writes into ``--out`` (default ``bench/results/<device>-<date>``): ``e2e.json`` (meta, one
row per configuration, the exactness checks), ``e2e.csv``, ``e2e_summary.md``,
``e2e_speedup_vs_k.png`` and ``e2e_acceptance_by_position.png``; rows are rewritten after
every run, so a stopped run keeps what it measured.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from bench.harness import device_name, git_commit
from specdec_kernels.e2e.config import Sampling, Speculation, Stats, replace
from specdec_kernels.e2e.engine import cache_recompute_error, generate, warm_up as loop_warm_up
from specdec_kernels.e2e.verify import methods_for, verify_methods
from specdec_kernels.e2e.model import early_exit_draft, load_model
from specdec_kernels.e2e.small_rows import row_paths_in_use
from specdec_kernels.e2e.peers import hf_generate
from specdec_kernels.e2e.tasks import task_requests


@dataclass
class Group:
    """Runs that share requests and sampling, hence one plain baseline."""
    task: str
    batch: int
    temperature: float
    prompts: int
    specs: list
    peers: tuple = ()
    max_new_tokens: Optional[int] = None
    keep_cache: bool = False
    top_k: int = 0
    plain: bool = True  # False: no plain baseline (the long KV-cache check alone)

    @property
    def label(self) -> str:
        return f"{self.task} b{self.batch} T{self.temperature:g}"


ALL_METHODS = "all"  # a spec's methods: every installed one that applies (methods_for)


def _ng(k, methods=("token",)):
    """(spec, methods): n-gram drafts have a one-hot q, so "block" is the token law."""
    return Speculation("ngram", k), methods


def _trie(nodes, depth, methods=("token",)):
    """An n-gram trie of ``nodes`` draft nodes, depth ``depth``."""
    return Speculation("ngram", depth, trie_nodes=nodes), methods


def _dm(k, tree=None, children="top_k", methods=("token",)):
    return Speculation("model", k, tree=tree, children=children), methods


ALL_PEERS = ("hf_plain", "hf_prompt_lookup", "hf_assisted")

PRESETS = {
    # Issue 26's targets, sized for 3 interleaved repeats on a shared 2-core machine at one
    # thread: copy b1 greedy (against transformers' prompt lookup), copy b1 sampled, copy
    # b16, rare_terms b1/b4/b16 (adaptive never slower than plain), and our plain decoding
    # against transformers' plain generate on short (rare_terms) and long (copy) prompts.
    "issue26": [
        Group("copy", 1, 0.0, 2, [_ng(4), _ng(8), _ng("adaptive"), _trie(16, 8),
                                  _trie(20, 10), _trie(24, 12)],
              ("hf_plain", "hf_prompt_lookup"), max_new_tokens=64),
        Group("rare_terms", 1, 0.0, 2, [_ng("adaptive")], ("hf_plain",), max_new_tokens=40),
        Group("copy", 16, 0.0, 16, [_ng(4), _ng("adaptive")], max_new_tokens=40),
        Group("rare_terms", 16, 0.0, 16, [_ng("adaptive")], max_new_tokens=24),
        Group("rare_terms", 4, 0.0, 4, [_ng("adaptive")], max_new_tokens=32),
        Group("copy", 1, 1.0, 2, [_ng(4), _ng("adaptive"), _trie(20, 10)], max_new_tokens=64),
    ],
    "cpu": [
        Group("copy", 1, 0.0, 4, [_ng(2), _ng(4), _ng(8), _ng("adaptive"), _dm(2),
                                  _dm(0, tree=(2, 2, 1))], ALL_PEERS, max_new_tokens=128),
        Group("copy", 1, 1.0, 2, [_ng("adaptive"), _dm(2, methods=ALL_METHODS),
                                  _dm(0, tree=(2, 2, 1), children="without_replacement",
                                      methods=ALL_METHODS)],
              ("hf_plain", "hf_prompt_lookup"), max_new_tokens=128),
        Group("rare_terms", 1, 0.0, 2, [_ng("adaptive"), _dm("adaptive")],
              ("hf_plain", "hf_prompt_lookup")),
        Group("copy", 16, 0.0, 16, [_ng(4), _ng("adaptive")], max_new_tokens=96),
        Group("long", 16, 0.0, 16, [_ng("adaptive")], keep_cache=True, max_new_tokens=640,
              plain=False),
        Group("copy", 4, 0.0, 4, [_ng("adaptive")], max_new_tokens=96),
        Group("rare_terms", 16, 0.0, 16, [_ng("adaptive")], max_new_tokens=48),
        Group("long", 1, 0.0, 1, [_ng("adaptive")], max_new_tokens=512),
    ],
    "full": [
        Group("copy", 1, 0.0, 4, [_ng(1), _ng(2), _ng(4), _ng(8), _ng("adaptive"), _dm(2),
                                  _dm(4), _dm("adaptive"), _dm(0, tree=(2, 2, 1))],
              ALL_PEERS),
        Group("rare_terms", 1, 0.0, 2, [_ng(4), _ng("adaptive"), _dm(2), _dm("adaptive")],
              ALL_PEERS),
        Group("copy", 16, 0.0, 16, [_ng(4), _ng("adaptive")]),
        Group("copy", 1, 1.0, 4, [_ng(4, ALL_METHODS), _ng("adaptive"),
                                  _dm(2, methods=ALL_METHODS),
                                  _dm(0, tree=(2, 2, 1), children="iid", methods=ALL_METHODS),
                                  _dm(0, tree=(2, 2, 1), children="without_replacement",
                                      methods=ALL_METHODS)],
              ("hf_plain", "hf_prompt_lookup")),
        Group("long", 16, 0.0, 16, [_ng("adaptive")], keep_cache=True),
        Group("copy", 4, 0.0, 4, [_ng(4), _ng("adaptive")]),
        Group("rare_terms", 16, 0.0, 16, [_ng("adaptive")]),
        Group("rare_terms", 4, 0.0, 4, [_ng("adaptive"), _dm("adaptive")]),
        Group("long", 1, 0.0, 1, [_ng("adaptive"), _dm("adaptive")], ("hf_plain",
                                                                       "hf_prompt_lookup")),
    ],
    # What fits in a few minutes: the batch-1 copy and rare_terms targets, copy at batch 16.
    "short": [
        Group("copy", 1, 0.0, 1, [_ng(4), _ng("adaptive")], ("hf_plain", "hf_prompt_lookup"),
              max_new_tokens=128),
        Group("rare_terms", 1, 0.0, 1, [_ng("adaptive")], max_new_tokens=64),
        Group("copy", 16, 0.0, 16, [_ng("adaptive")], max_new_tokens=32),
        Group("copy", 1, 1.0, 1, [_ng("adaptive")], max_new_tokens=128),
    ],
    "quick": [
        Group("copy", 1, 0.0, 1, [_ng(4), _ng("adaptive"), _dm(2), _dm(0, tree=(2, 1))],
              ALL_PEERS, max_new_tokens=24),
        Group("copy", 4, 1.0, 4, [_ng("adaptive"), _dm(2, methods=ALL_METHODS),
                                  _dm(0, tree=(2, 1), children="iid", methods=ALL_METHODS)],
              max_new_tokens=16, keep_cache=True),
    ],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--target", default=None, help="model folder, FOLDER/file.gguf, or the "
                    "embedded SmolLM2-135M-Instruct (default)")
    ap.add_argument("--draft", default=None, help="draft model folder (same tokenizer); "
                    "default: the target's first --draft-layers layers")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--methods", default=None, help="verification methods for every spec "
                    "(comma-separated, or 'all': every installed one that applies; default: "
                    "each spec's own, 'token' unless the preset says otherwise)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override every "
                    "group's token budget (short checks and time estimates)")
    ap.add_argument("--groups", default=None, help="comma-separated indices of the preset's "
                    "groups to run (default: all, in order)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every "
                    "group's runs (rows report medians and the spread)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no new group after this")
    ap.add_argument("--exactness-samples", type=int, default=20000,
                    help="samples for the first-two-tokens law (0: skip)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--note", default="", help="free text stored in meta (e.g. machine load)")
    return ap.parse_args(argv)


def cpu_info() -> dict:
    """The CPU's model, cores and widest vector ISA (from /proc/cpuinfo's flags)."""
    info = {"model": None, "cores": os.cpu_count(), "isa": None}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and info["model"] is None:
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            for isa in ("avx512_bf16", "avx512f", "avx2", "avx", "sse4_2"):
                if isa in flags:
                    info["isa"] = isa
                    break
            info["amx"] = any(f.startswith("amx") for f in flags)
            break
    return info


def _percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def run_ours(model, requests, batch, sampling, spec, draft, eos, keep_cache=False):
    """Requests in chunks of ``batch`` (static batches); (tokens, merged stats, kept)."""
    tokens, stats, kept, policy = [], Stats(), [], None
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        # An adaptive policy goes on from one batch to the next (a server's would).
        result = generate(model, chunk, sampling, spec, draft_model=draft, eos_token_id=eos,
                          keep_cache=keep_cache, policy=policy)
        policy = result.policy
        tokens += result.tokens
        stats.merge(result.stats)
        if keep_cache:
            kept += result.caches
    return tokens, stats, kept


def _methods(spec: Speculation, methods) -> tuple:
    """The methods to run for a spec: ``"all"`` or a comma list / tuple, kept to those the
    installed ops take for it."""
    applicable = methods_for(spec)
    if methods == ALL_METHODS:
        return applicable
    if isinstance(methods, str):
        methods = tuple(methods.split(","))
    dropped = [m for m in methods if m not in applicable]
    if dropped:
        print(f"[e2e] {spec.drafter} K={spec.num_draft_tokens} tree={spec.tree}: "
              f"{', '.join(dropped)} not run (applies: {', '.join(applicable)})", flush=True)
    return tuple(m for m in methods if m in applicable)


def warm_up(model, draft, tokenizer) -> float:
    """Our loop's paths (the loop's warm_up) and transformers' generate, before anything is timed."""
    start = time.perf_counter()
    requests = task_requests(tokenizer, "copy", 2, max_new_tokens=6)
    loop_warm_up(model, requests, draft_model=draft, eos_token_id=tokenizer.eos_token_id)
    hf_generate(model, requests[:1], Sampling(), "hf_plain",
                eos_token_id=tokenizer.eos_token_id)
    return time.perf_counter() - start


def _k_label(spec: Speculation):
    if spec.tree:
        return "tree" + "x".join(map(str, spec.tree))
    if spec.trie:
        return f"trie{spec.trie_nodes}d{spec.num_draft_tokens}"
    if spec.drafter == "none":
        return 0
    return spec.num_draft_tokens


def _row(meta, group, spec, method, stats, baselines, identical, extra, *,
         tokens_per_s: Optional[float] = None, speedup: Optional[float] = None):
    """One configuration's row; ``tokens_per_s`` and ``speedup`` default to ``stats``'
    own rate and its ratio to ``baselines["plain"]``."""
    if tokens_per_s is None:
        tokens_per_s = stats.tokens / stats.wall_s if stats.wall_s else float("nan")
    plain = baselines.get("plain", float("nan"))
    if speedup is None and plain == plain:
        speedup = tokens_per_s / plain
    return {
        "task": group.task, "drafter": spec.drafter, "method": method, "K": _k_label(spec),
        "tree": list(spec.tree) if spec.tree else None,
        "children": spec.children if spec.tree else None,
        "batch": group.batch, "temperature": group.temperature, "top_k": group.top_k,
        "target_model": meta["target_model"],
        "draft_model": meta["draft_model"] if spec.drafter == "model" else None,
        "requests": group.prompts, "tokens": stats.tokens, "wall_s": round(stats.wall_s, 3),
        "cpu_s": round(stats.cpu_s, 3),
        "tokens_per_s": round(tokens_per_s, 3), "baselines": baselines,
        "speedup_vs_plain": round(speedup, 3) if speedup is not None else None,
        "trie_nodes": spec.trie_nodes or None,
        "mean_accepted": round(stats.mean_accepted, 4),
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
        "draft_share": round(stats.draft_s / stats.wall_s, 4) if stats.wall_s else None,
        "steps": stats.steps,
        "p50_ms": round(1e3 * _percentile(stats.latency_s, 0.5), 1),
        "p99_ms": round(1e3 * _percentile(stats.latency_s, 0.99), 1),
        "profile_ms_per_step": stats.profile_ms_per_step(),
        "wall_ms_per_step": round(1e3 * stats.wall_s / max(stats.steps, 1), 3),
        "greedy_identical": identical, "device_name": meta["device_name"],
        "git_commit": meta["git_commit"], "timestamp": _now(), **extra,
    }


def _now():
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_outputs(out: Path, report: dict, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    rows = report["rows"]
    if rows:
        fields = [k for k in rows[0] if k != "baselines"]
        peers = sorted({p for r in rows for p in r["baselines"]})
        with open(out / "e2e.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(fields + [f"baseline_{p}" for p in peers])
            for r in rows:
                writer.writerow([json.dumps(r[k]) if isinstance(r[k], (list, dict)) else r[k]
                                 for k in fields] + [r["baselines"].get(p, "") for p in peers])
    (out / "e2e_summary.md").write_text(summary_table(report) + "\n")
    if plots and rows:
        from bench import e2e_plots
        e2e_plots.speedup_vs_k(rows, out / "e2e_speedup_vs_k.png")
        e2e_plots.acceptance_by_position(rows, out / "e2e_acceptance_by_position.png")


def _cell(value, spec=".1f") -> str:
    return "" if value is None else format(value, spec)


def _ranged(value, spread) -> str:
    if value is None:
        return ""
    if not spread or spread.get("min") == spread.get("max"):
        return f"{value:.2f}"
    return f"{value:.2f} [{spread['min']:.2f}-{spread['max']:.2f}]"


def _row_paths(model) -> dict:
    """The matmul path of each small row count the model's linears take (``{}``: stock)."""
    return {str(rows): path for rows, path in row_paths_in_use(model).items()}


def summary_table(report: dict) -> str:
    meta = report["meta"]
    lines = ["# End-to-end speculative generation\n",
             f"{meta['device_name']}; target {meta['target_model']}; draft "
             f"{meta['draft_model']}; commit {meta['git_commit'][:12]}; {meta['timestamp']}"
             + (f"; {meta['note']}" if meta.get("note") else "")
             + (f"; rows by W @ x^T: {meta['small_row_paths']}" if meta.get("small_row_paths")
                else "") + "\n",
             "| task | batch | T | drafter | method | K | tok/s | plain | x plain [min-max] | "
             "hf_plain | hf_prompt_lookup | hf_assisted | x hf_prompt_lookup [min-max] | "
             "x hf_plain | accepted/step | draft share | p50 ms | p99 ms | greedy = plain |",
             "|" + "---|" * 19]
    for r in report["rows"]:
        b = r["baselines"]
        speedups = r.get("speedups") or {}
        cells = [r["task"], r["batch"], f"{r['temperature']:g}", r["drafter"], r["method"],
                 r["K"], _cell(r["tokens_per_s"]), _cell(b.get("plain")),
                 _ranged(r["speedup_vs_plain"], speedups.get("plain"))]
        cells += [_cell(b.get(p)) for p in ALL_PEERS]
        pl = speedups.get("hf_prompt_lookup")
        cells += [_ranged(pl and pl["median"], pl),
                  _ranged((speedups.get("hf_plain") or {}).get("median"),
                          speedups.get("hf_plain")),
                  _cell(r["mean_accepted"], ".2f"), _cell(r["draft_share"], ".2f"),
                  _cell(r["p50_ms"], ".0f"), _cell(r["p99_ms"], ".0f"),
                  "" if r["greedy_identical"] is None else r["greedy_identical"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    from specdec_kernels.e2e.config import PHASES
    lines += ["\nWhere a step's time goes (ms per step, all repeats; `python`: the loop's own "
              "bookkeeping):\n",
              "| task | batch | T | drafter | K | ms/step | " + " | ".join(PHASES) + " |",
              "|" + "---|" * (6 + len(PHASES))]
    for r in report["rows"]:
        profile = r.get("profile_ms_per_step") or {}
        lines.append("| " + " | ".join(str(c) for c in [
            r["task"], r["batch"], f"{r['temperature']:g}", r["drafter"], r["K"],
            _cell(r.get("wall_ms_per_step"), ".1f")] + [_cell(profile.get(p), ".2f")
                                                        for p in PHASES]) + " |")
    for name, check in report.get("checks", {}).items():
        lines.append(f"\n{name}: {json.dumps(check)}")
    return "\n".join(lines)


def _spread(values: list) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "runs": [round(v, 3) for v in values]}


def run_group(model, draft, tokenizer, group: Group, args, meta: dict, report: dict, out: Path,
              started: float, tqdm=lambda x, **_: x) -> None:
    """The group's runs, ``--repeats`` times interleaved: each repeat runs plain decoding,
    transformers' peers and every spec once, in that order, and plain decoding runs once
    more at the end, so each repeat's speculative runs lie between two plain runs (its
    ``plain``: both runs' tokens over both runs' seconds; this machine drifts by ~20% within
    minutes). A row's ``tokens_per_s``, baselines and speedups are medians over the repeats
    (``speedups``: median, min, max and each repeat's ratio, each against the same repeat's
    baselines)."""
    eos = tokenizer.eos_token_id
    sampling = Sampling(group.temperature, group.top_k)
    requests = task_requests(tokenizer, group.task, group.prompts,
                             max_new_tokens=args.max_new_tokens or group.max_new_tokens)
    configs = [(spec, method) for spec, spec_methods in group.specs
               for method in _methods(spec, args.methods or spec_methods)]
    peers = group.peers if group.batch == 1 else ()
    repeats = max(1, args.repeats)
    plain_runs: list = []      # (tokens, Stats) of each plain run
    peer_rates: dict = {p: [] for p in peers}
    runs: dict = {i: [] for i in range(len(configs))}  # per config: (tokens, Stats, extra)

    def plain_run():
        tokens, stats, _ = run_ours(model, requests, group.batch, sampling, Speculation(),
                                    None, eos)
        plain_runs.append((tokens, stats))

    for repeat in range(repeats):
        if args.time_budget and time.perf_counter() - started > args.time_budget and repeat:
            print(f"time budget reached: {group.label} after {repeat} repeats")
            break
        if group.plain:
            plain_run()
        for peer in peers:
            peer_tokens, wall = hf_generate(model, requests, sampling, peer,
                                            draft_model=draft, eos_token_id=eos)
            peer_rates[peer].append(sum(map(len, peer_tokens)) / wall)
        for i, (spec, method) in enumerate(tqdm(configs, desc=group.label, leave=False)):
            spec_m = replace(spec, method=method)
            keep = group.keep_cache and repeat == 0
            tokens, stats, kept = run_ours(model, requests, group.batch, sampling, spec_m,
                                           draft, eos, keep_cache=keep)
            extra = {}
            if keep:
                worst = max(cache_recompute_error(model, r, t, k)
                            for r, t, k in zip(requests, tokens, kept))
                extra["kv_recompute_max_abs_diff"] = worst
                report["checks"]["kv_cache_vs_recompute"] = {
                    "task": group.task, "batch": group.batch, "drafter": spec.drafter,
                    "tokens": stats.tokens, "requests": len(requests),
                    "max_abs_diff": worst, "passed": worst < 1e-4}
            runs[i].append((tokens, stats, extra))
    done = min([len(r) for r in runs.values()] + [len(peer_rates[p]) for p in peers]
               or [repeats])
    if group.plain:
        plain_run()
    # Each repeat's plain rate: the plain runs before and after it.
    plain_rates = []
    for r in range(min(done, len(plain_runs) - 1) if group.plain else 0):
        (_, before), (_, after) = plain_runs[r], plain_runs[r + 1]
        plain_rates.append((before.tokens + after.tokens) / (before.wall_s + after.wall_s))
    baselines = {}
    if plain_rates:
        baselines["plain"] = round(statistics.median(plain_rates), 3)
        baselines["plain_runs"] = [round(s.tokens / s.wall_s, 3) for _, s in plain_runs]
    for peer in peers:
        if peer_rates[peer]:
            baselines[peer] = round(statistics.median(peer_rates[peer]), 3)
    plain_tokens = plain_runs[0][0] if plain_runs else None
    rows = []
    if group.plain and plain_runs:  # our plain decoding itself, against transformers'
        merged = Stats()
        for _, stats in plain_runs:
            merged.merge(stats)
        rates = [s.tokens / s.wall_s for _, s in plain_runs]
        rows.append(_row(meta, group, Speculation(), "token", merged, baselines, None,
                         {"repeats": len(plain_runs), "tokens_per_s_runs":
                          [round(v, 3) for v in rates],
                          "speedups": {p: _spread([rates[r] / peer_rates[p][r] for r in
                                                   range(len(peer_rates[p]))])
                                       for p in peers if peer_rates[p]}},
                         tokens_per_s=statistics.median(rates)))
    for i, (spec, method) in enumerate(configs):
        if not runs[i]:
            continue
        merged, rates = Stats(), []
        for _, stats, _ in runs[i][:done]:
            merged.merge(stats)
            rates.append(stats.tokens / stats.wall_s)
        identical = (all(t == plain_tokens for t, _, _ in runs[i])
                     if sampling.greedy and plain_tokens is not None else None)
        speedups = {}
        if plain_rates:
            speedups["plain"] = _spread([rates[r] / plain_rates[r]
                                         for r in range(min(len(rates), len(plain_rates)))])
        for peer in peers:
            if peer_rates[peer]:
                speedups[peer] = _spread([rates[r] / peer_rates[peer][r] for r in
                                          range(min(len(rates), len(peer_rates[peer])))])
        extra = dict(runs[i][0][2], repeats=len(rates),
                     tokens_per_s_runs=[round(v, 3) for v in rates], speedups=speedups)
        rows.append(_row(meta, group, replace(spec, method=method), method, merged, baselines,
                         identical, extra, tokens_per_s=statistics.median(rates),
                         speedup=speedups["plain"]["median"] if plain_rates else None))
    report["rows"].extend(rows)
    write_outputs(out, report, plots=False)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t_load = time.perf_counter()
    model, tokenizer = load_model(args.target, device=str(device))
    if args.draft:
        draft, _ = load_model(args.draft, device=str(device))
    else:
        draft = early_exit_draft(model, args.draft_layers)
    load_s = time.perf_counter() - t_load
    commit, dirty = git_commit()
    date = _dt.date.today().isoformat()
    out = args.out or Path("bench/results") / f"{device.type}-{date}"
    meta = {"device_name": device_name(device), "target_model": model.name_or_path,
            "draft_model": getattr(draft, "name_or_path", "draft"),
            "git_commit": commit + ("-dirty" if dirty else ""), "timestamp": _now(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "preset": args.preset, "methods": args.methods or "per spec",
            "groups": args.groups or "all", "max_new_tokens": args.max_new_tokens,
            "load_s": round(load_s, 1), "cpu": cpu_info(), "repeats": args.repeats,
            "loadavg_start": os.getloadavg(), "note": args.note,
            "small_row_paths": _row_paths(model)}
    report = {"meta": meta, "rows": [], "checks": {}}
    started = time.perf_counter()
    groups = PRESETS[args.preset]
    if args.groups:
        groups = [groups[int(i)] for i in args.groups.split(",")]
    meta["warm_up_s"] = round(warm_up(model, draft, tokenizer), 1)
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        def tqdm(x, **_):
            return x
    for index, group in enumerate(tqdm(groups, desc="groups")):
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            print(f"time budget reached: skipped {group.label}")
            continue
        group_start, group_cpu = time.perf_counter(), time.process_time()
        run_group(model, draft, tokenizer, group, args, meta, report, out, started, tqdm)
        report.setdefault("group_seconds", {})[f"{index}: {group.label}"] = {
            "wall_s": round(time.perf_counter() - group_start, 1),
            "cpu_s": round(time.process_time() - group_cpu, 1)}
    if args.exactness_samples:
        from specdec_kernels.e2e.exactness import first_two_tokens_test
        from specdec_kernels.e2e.tasks import encode
        prompt = encode(tokenizer, "Name a colour.")
        checks = {}
        for drafter, method, bug in (("ngram", "token", None), ("ngram_trie", "token", None),
                                     ("model", "token", None), ("model", "block", None),
                                     ("ngram", "token", "rows_one_late"),
                                     ("ngram_trie", "token", "rows_one_late")):
            if method not in verify_methods("chain"):
                continue
            if args.time_budget and time.perf_counter() - started > 1.1 * args.time_budget:
                print(f"time budget reached: skipped the law check {drafter}/{method}")
                continue
            t0 = time.perf_counter()
            result = first_two_tokens_test(  # block differs from token from 2 drafts on
                model, draft, prompt, drafter=drafter, samples=args.exactness_samples,
                planted_bug=bug, method=method, num_draft=2 if method == "block" else None)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            checks[f"{drafter}/{method}{'+' + bug if bug else ''}"] = result
        report["checks"]["first_two_tokens_law"] = checks
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    write_outputs(out, report, plots=not args.no_plots)
    print(summary_table(report))
    print(f"\nwrote {out}/e2e.json")
    return report


if __name__ == "__main__":
    main()
