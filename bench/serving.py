"""Speculation under a serving load (issue 48): the continuous-batching loop
(``specdec_kernels.e2e.serving.serve``) fed Poisson arrivals at each rate (and, optionally, a
closed loop of N clients) over a mixed request set (copy, rare_terms, long), with and without
speculation. Per (load, configuration): throughput, p50/p99 time to first token and time per
output token, mean batch size, accepted drafts per step, share of steps that speculated;
their ratios to plain decoding under the same arrivals; the rate from which speculation
stops paying; one plot of latency against throughput per configuration.

    python -m bench.serving --rates 0.25,0.5,1,2 --duration 120 --threads 1

Writes ``serving.json``, ``serving.csv``, ``serving_summary.md`` and ``serving.png`` under
``bench/results/<device>-<date>/serving-<commit>/`` (``--out`` elsewhere). Sized by its
arguments: a short smoke run is ``--quick``.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import time
from pathlib import Path

import torch

from bench.e2e import cpu_info
from bench.harness import device_name, git_commit
from specdec_kernels.e2e.config import Sampling, Speculation
from specdec_kernels.e2e.load import ClosedLoop, mixed_pool, poisson_arrivals
from specdec_kernels.e2e.model import load_model
from specdec_kernels.e2e.serving import serve

CONFIGS = {
    "plain": Speculation(),
    "ngram4": Speculation("ngram", 4),
    "trie20": Speculation("ngram", 10, trie_nodes=20),
    "adaptive": Speculation("ngram", "adaptive", max_draft_tokens=16),
}
BUDGETS = {"copy": 160, "rare_terms": 96, "long": 256}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.25,0.5,1,2", help="Poisson rates, requests/s")
    p.add_argument("--clients", default="", help="closed loops of N clients, e.g. 1,4")
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds over which requests arrive (each load)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds a run may take in all (default 3x the duration)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {sorted(CONFIGS)}")
    p.add_argument("--tasks", default="copy,rare_terms,long")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="one budget for every task (default: copy 160, rare_terms 96, "
                        "long 256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--note", default="")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: rates 0.5,2, 10 s of arrivals, budgets of 8")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.duration, args.max_new_tokens = "0.5,2", 10.0, 8
    return args


def percentile(values, q):
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return None
    index = min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))
    return values[index]


def summarise(result) -> dict:
    done = [c for c in result.completions if c.finished and c.error is None]
    stats = result.stats
    ms = lambda v: None if v is None else round(1e3 * v, 1)  # noqa: E731
    return {
        "requests": len(result.completions), "completed": len(done),
        "unfinished": sum(not c.finished for c in result.completions),
        "rejected": stats.rejected, "tokens": stats.tokens, "wall_s": round(stats.wall_s, 2),
        "tokens_per_s": round(stats.tokens / stats.wall_s, 2) if stats.wall_s else None,
        "ttft_p50_ms": ms(percentile([c.ttft_s for c in done], 50)),
        "ttft_p99_ms": ms(percentile([c.ttft_s for c in done], 99)),
        "tpot_p50_ms": ms(percentile([c.tpot_s for c in done], 50)),
        "tpot_p99_ms": ms(percentile([c.tpot_s for c in done], 99)),
        "mean_batch": round(stats.mean_batch, 2), "steps": stats.steps,
        "accepted_per_step": round(stats.accepted_per_step, 3),
        "speculative_share": round(stats.speculative_share, 3),
        "profile_s": {k: round(v, 2) for k, v in stats.profile.items()},
    }


def ratios(rows: list) -> None:
    """Each row's throughput and p50 TPOT against plain decoding under the same load."""
    plain = {r["load"]: r for r in rows if r["config"] == "plain"}
    for r in rows:
        base = plain.get(r["load"])
        if base is None:
            continue
        r["throughput_vs_plain"] = (round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                                    if r["tokens_per_s"] and base["tokens_per_s"] else None)
        r["tpot_p50_vs_plain"] = (round(r["tpot_p50_ms"] / base["tpot_p50_ms"], 3)
                                  if r["tpot_p50_ms"] and base["tpot_p50_ms"] else None)


FLOOR = 0.97  # issue 48: never below 0.97x plain decoding's throughput at any rate


def stops_paying(rows: list) -> dict:
    """Per configuration: the lowest Poisson rate at which its throughput falls below
    ``FLOOR`` x plain decoding's or its p50 TPOT is no longer ahead of plain's (None: it paid
    at every rate measured). Below saturation the throughput follows the offered load
    whatever the speed, so there the p50 TPOT decides."""
    out = {}
    for config in sorted({r["config"] for r in rows} - {"plain"}):
        mine = sorted((r for r in rows if r["config"] == config and r["rate"] is not None),
                      key=lambda r: r["rate"])
        out[config] = next((r["rate"] for r in mine
                            if (r.get("throughput_vs_plain") or 1) < FLOOR
                            or (r.get("tpot_p50_vs_plain") or 0) >= 1), None)
    return out


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "tpot_p50_ms", "p50 time per output token (ms)"),
                           (axes[1], "ttft_p50_ms", "p50 time to first token (ms)")):
        for config in dict.fromkeys(r["config"] for r in rows):
            points = sorted((r["rate"], r["tokens_per_s"], r[key]) for r in rows
                            if r["config"] == config and r["rate"] is not None
                            and r[key] is not None and r["tokens_per_s"])
            if points:
                ax.plot([p[1] for p in points], [p[2] for p in points], "o-", label=config)
        ax.set_xlabel("throughput (tokens/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("latency against throughput, Poisson arrivals (one point per rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Serving bench\n\n{meta['device_name']}; {meta['cpu'].get('model', '')}; "
             f"commit {meta['git_commit'][:12]}; {meta['timestamp']}; threads "
             f"{meta['threads']}; load average {meta['loadavg_start']} -> "
             f"{meta.get('loadavg_end')}" + (f"; {meta['note']}" if meta["note"] else ""),
             "", "| load | config | tok/s | x plain | TTFT p50/p99 ms | TPOT p50/p99 ms | "
             "TPOT x plain | batch | acc/step | spec share | done |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['load']} | {r['config']} | {r['tokens_per_s']} | "
            f"{r.get('throughput_vs_plain')} | {r['ttft_p50_ms']}/{r['ttft_p99_ms']} | "
            f"{r['tpot_p50_ms']}/{r['tpot_p99_ms']} | {r.get('tpot_p50_vs_plain')} | "
            f"{r['mean_batch']} | {r['accepted_per_step']} | {r['speculative_share']} | "
            f"{r['completed']}/{r['requests']} |")
    lines += ["", f"Speculation stops paying (lowest rate below {FLOOR}x plain's throughput "
              f"or not ahead of its p50 TPOT): {report['stops_paying_at']}"]
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    fields = [k for k in report["rows"][0] if k != "profile_s"]
    with open(out / "serving.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(report["rows"])
    (out / "serving_summary.md").write_text(summary_table(report))
    plot(report["rows"], out / "serving.png")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected some of {sorted(CONFIGS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.target, device=str(device))
    tasks = args.tasks.split(",")
    budgets = {t: args.max_new_tokens or BUDGETS.get(t, 64) for t in tasks}
    pool = mixed_pool(tokenizer, tasks, max_new_tokens=budgets,
                      sampling=Sampling(args.temperature))
    commit, dirty = git_commit()
    meta = {"device_name": device_name(device), "cpu": cpu_info(),
            "git_commit": commit + ("-dirty" if dirty else ""),
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "target_model": model.name_or_path, "tasks": tasks, "budgets": budgets,
            "temperature": args.temperature, "max_batch": args.max_batch,
            "duration_s": args.duration, "seed": args.seed, "note": args.note,
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    limit = args.time_limit or 3 * args.duration
    eos = tokenizer.eos_token_id
    # Warm up every path (first calls pay one-time setup) on a few short requests.
    warm = poisson_arrivals(pool, 4.0, 1.0, seed=args.seed)[:4]
    for config in configs:
        serve(model, [a for a in warm], CONFIGS[config], eos_token_id=eos, time_limit=30)
    loads = [("poisson", float(r)) for r in args.rates.split(",") if r]
    loads += [("closed", int(c)) for c in args.clients.split(",") if c]
    rows, started = [], time.perf_counter()
    for kind, value in loads:
        for config in configs:  # the same arrivals for every configuration
            load = (poisson_arrivals(pool, value, args.duration, seed=args.seed)
                    if kind == "poisson" else
                    ClosedLoop(pool, value, args.duration, seed=args.seed))
            result = serve(model, load, CONFIGS[config], eos_token_id=eos,
                           max_batch=args.max_batch, time_limit=limit)
            row = {"load": f"{kind} {value:g}", "rate": value if kind == "poisson" else None,
                   "clients": value if kind == "closed" else None, "config": config,
                   **summarise(result), "device_name": meta["device_name"],
                   "git_commit": meta["git_commit"], "timestamp": meta["timestamp"]}
            rows.append(row)
            print(f"{row['load']:>12} {config:>9}: {row['tokens_per_s']} tok/s, TPOT p50 "
                  f"{row['tpot_p50_ms']} ms, TTFT p50 {row['ttft_p50_ms']} ms, batch "
                  f"{row['mean_batch']}, {row['completed']}/{row['requests']} done", flush=True)
    ratios(rows)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    report = {"meta": meta, "rows": rows, "stops_paying_at": stops_paying(rows)}
    date = _dt.date.today().isoformat()
    out = args.out or Path("bench/results") / f"{device.type}-{date}" / f"serving-{commit[:7]}"
    write(out, report)
    print(summary_table(report))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
