"""``python -m bench.e2e``: speculative generation on a real model, side by side with plain
decoding and transformers' own decoding, in one run.

    python -m bench.e2e                         # the CPU sweep (<= ~16 min on 2 idle CPU threads)
    python -m bench.e2e --preset full           # every K, both drafters, more prompts (hours)
    python -m bench.e2e --preset quick          # a few seconds of generation per row
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from bench.harness import device_name, git_commit
from specdec_kernels.e2e.config import Sampling, Speculation, Stats, replace
from specdec_kernels.e2e.engine import cache_recompute_error, generate, warm_up as loop_warm_up
from specdec_kernels.e2e.verify import methods_for, verify_methods
from specdec_kernels.e2e.model import early_exit_draft, load_model
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


def _dm(k, tree=None, children="top_k", methods=("token",)):
    return Speculation("model", k, tree=tree, children=children), methods


ALL_PEERS = ("hf_plain", "hf_prompt_lookup", "hf_assisted")

PRESETS = {
    # Ordered by what matters most, so a time budget drops the least important runs.
    # Estimated (scaled from a 16-token run of every group, 1 thread, load ~2; upper bounds,
    # every request at its full budget): 0: 5.5 min, 1: 4, 2: 0.7, 3: 0.8, 4 (10,240 tokens and
    # the recomputation): 2.5, 5: 0.3, 6: 0.3, 7: 0.9, law checks 0.3, load + warm-up 0.5;
    # ~16 min in all, less on 2 idle threads.
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
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no new group after this")
    ap.add_argument("--exactness-samples", type=int, default=20000,
                    help="samples for the first-two-tokens law (0: skip)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--note", default="", help="free text stored in meta (e.g. machine load)")
    return ap.parse_args(argv)


def _percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def run_ours(model, requests, batch, sampling, spec, draft, eos, keep_cache=False):
    """Requests in chunks of ``batch`` (static batches); (tokens, merged stats, kept)."""
    tokens, stats, kept = [], Stats(), []
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        result = generate(model, chunk, sampling, spec, draft_model=draft, eos_token_id=eos,
                          keep_cache=keep_cache)
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
    return spec.num_draft_tokens


def _row(meta, group, spec, method, stats, baselines, identical, extra):
    tokens_per_s = stats.tokens / stats.wall_s if stats.wall_s else float("nan")
    plain = baselines.get("plain", float("nan"))
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
        "speedup_vs_plain": round(tokens_per_s / plain, 3) if plain == plain else None,
        "mean_accepted": round(stats.mean_accepted, 4),
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
        "draft_share": round(stats.draft_s / stats.wall_s, 4) if stats.wall_s else None,
        "steps": stats.steps,
        "p50_ms": round(1e3 * _percentile(stats.latency_s, 0.5), 1),
        "p99_ms": round(1e3 * _percentile(stats.latency_s, 0.99), 1),
        "greedy_identical": identical, "device_name": meta["device_name"],
        "git_commit": meta["git_commit"], "timestamp": _now(), **extra,
    }


def _plain_again(model, requests, group, sampling, eos, first: Stats, baselines: dict,
                 rows: list) -> None:
    """Plain decoding once more after the group's speculative runs: this machine's speed
    drifts by ~20% within minutes, so ``plain`` is both runs' tokens over both runs'
    seconds (``plain_first``, ``plain_last``: each run's own) and the group's speedups are
    recomputed against it."""
    _, last, _ = run_ours(model, requests, group.batch, sampling, Speculation(), None, eos)
    baselines["plain_first"] = round(first.tokens / first.wall_s, 3)
    baselines["plain_last"] = round(last.tokens / last.wall_s, 3)
    baselines["plain"] = round((first.tokens + last.tokens) / (first.wall_s + last.wall_s), 3)
    for row in rows:  # every row of the group shares this baselines dict
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / baselines["plain"], 3)


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


def summary_table(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# End-to-end speculative generation\n",
             f"{meta['device_name']}; target {meta['target_model']}; draft "
             f"{meta['draft_model']}; commit {meta['git_commit'][:12]}; {meta['timestamp']}"
             + (f"; {meta['note']}" if meta.get("note") else "") + "\n",
             "| task | batch | T | drafter | method | K | tok/s | plain | x plain | "
             "hf_plain | hf_prompt_lookup | hf_assisted | accepted/step | draft share | "
             "p50 ms | p99 ms | greedy = plain |",
             "|" + "---|" * 17]
    for r in report["rows"]:
        b = r["baselines"]
        cells = [r["task"], r["batch"], f"{r['temperature']:g}", r["drafter"], r["method"],
                 r["K"], _cell(r["tokens_per_s"]), _cell(b.get("plain")),
                 _cell(r["speedup_vs_plain"], ".2f")]
        cells += [_cell(b.get(p)) for p in ALL_PEERS]
        cells += [_cell(r["mean_accepted"], ".2f"), _cell(r["draft_share"], ".2f"),
                  _cell(r["p50_ms"], ".0f"), _cell(r["p99_ms"], ".0f"),
                  "" if r["greedy_identical"] is None else r["greedy_identical"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for name, check in report.get("checks", {}).items():
        lines.append(f"\n{name}: {json.dumps(check)}")
    return "\n".join(lines)


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
    eos = tokenizer.eos_token_id
    commit, dirty = git_commit()
    date = _dt.date.today().isoformat()
    out = args.out or Path("bench/results") / f"{device.type}-{date}"
    meta = {"device_name": device_name(device), "target_model": model.name_or_path,
            "draft_model": getattr(draft, "name_or_path", "draft"),
            "git_commit": commit + ("-dirty" if dirty else ""), "timestamp": _now(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "preset": args.preset, "methods": args.methods or "per spec",
            "groups": args.groups or "all", "max_new_tokens": args.max_new_tokens,
            "load_s": round(load_s, 1),
            "loadavg_start": os.getloadavg(), "note": args.note}
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
            print(f"time budget reached: skipped {group.task} batch {group.batch}")
            continue
        group_start, group_cpu = time.perf_counter(), time.process_time()
        sampling = Sampling(group.temperature, group.top_k)
        requests = task_requests(tokenizer, group.task, group.prompts,
                                 max_new_tokens=args.max_new_tokens or group.max_new_tokens)
        plain_tokens, baselines, group_rows = None, {}, []
        if group.plain:
            plain_tokens, plain_stats, _ = run_ours(model, requests, group.batch, sampling,
                                                    Speculation(), None, eos)
            baselines["plain"] = round(plain_stats.tokens / plain_stats.wall_s, 3)
        if group.batch == 1:
            for peer in group.peers:
                peer_tokens, wall = hf_generate(model, requests, sampling, peer,
                                                draft_model=draft, eos_token_id=eos)
                baselines[peer] = round(sum(map(len, peer_tokens)) / wall, 3)
        for spec, spec_methods in tqdm(group.specs, desc=group.label, leave=False):
            for method in _methods(spec, args.methods or spec_methods):
                if args.time_budget and time.perf_counter() - started > args.time_budget:
                    break
                spec_m = replace(spec, method=method)
                tokens, stats, kept = run_ours(model, requests, group.batch, sampling, spec_m,
                                               draft, eos, keep_cache=group.keep_cache)
                identical = (tokens == plain_tokens) if sampling.greedy and group.plain \
                    else None
                extra = {}
                if group.keep_cache:
                    worst = max(cache_recompute_error(model, r, t, k)
                                for r, t, k in zip(requests, tokens, kept))
                    extra["kv_recompute_max_abs_diff"] = worst
                    report["checks"]["kv_cache_vs_recompute"] = {
                        "task": group.task, "batch": group.batch, "drafter": spec.drafter,
                        "tokens": stats.tokens, "requests": len(requests),
                        "max_abs_diff": worst, "passed": worst < 1e-4}
                group_rows.append(_row(meta, group, spec_m, method, stats, baselines,
                                       identical, extra))
                report["rows"].append(group_rows[-1])
                write_outputs(out, report, plots=False)
        if group.plain and group_rows:
            _plain_again(model, requests, group, sampling, eos, plain_stats, baselines,
                         group_rows)
            write_outputs(out, report, plots=False)
        report.setdefault("group_seconds", {})[f"{index}: {group.label}"] = {
            "wall_s": round(time.perf_counter() - group_start, 1),
            "cpu_s": round(time.process_time() - group_cpu, 1)}
    if args.exactness_samples and not (args.time_budget and time.perf_counter() - started
                                       > args.time_budget):
        from specdec_kernels.e2e.exactness import first_two_tokens_test
        from specdec_kernels.e2e.tasks import encode
        prompt = encode(tokenizer, "Name a colour.")
        checks = {}
        for drafter, method, bug in (("ngram", "token", None), ("model", "token", None),
                                     ("model", "block", None),
                                     ("ngram", "token", "rows_one_late")):
            if method not in verify_methods("chain"):
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
