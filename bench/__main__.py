"""``python -m bench``: run the benchmarks and write rows, a summary and plots.

    python -m bench                                  # every op, the sweep for this device
    python -m bench --ops chain,sample --quick       # a tiny sweep (seconds)
    python -m bench --device cuda --preset gpu_check --out $OUT/bench   # gpu_check.sh's shapes

Writes into ``--out`` (default ``bench/out/<device>-<date>``): ``results.json`` and
``results.csv`` (one row per measurement, rewritten after every case so a killed run keeps
what it measured), ``summary.md``, ``meta.json``, ``latency_vs_batch.png``,
``roofline_vs_vocab.png`` and, with ``model``, ``spec_model.{json,csv,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from pathlib import Path

ALL_OPS = ("chain", "tree", "sample", "mask", "compact", "cpu", "extension", "model")
PRESETS = ("quick", "cpu", "gpu", "gpu_check")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(ALL_OPS),
                    help=f"comma-separated subset of {','.join(ALL_OPS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the test's sweep)")
    ap.add_argument("--preset", choices=PRESETS, default=None,
                    help="sweep: default 'quick' with --quick, else 'gpu' on CUDA, 'cpu' on CPU")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    ap.add_argument("--out", type=Path, default=None, help="output folder")
    ap.add_argument("--backends", default=None, help="only these backends (comma-separated)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no new case after this (rows so far are kept)")
    ap.add_argument("--model-batch", type=int, default=None,
                    help="trials per position for the speculation model (default 4096; 256 with --quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's; 1 with --quick). On a loaded "
                         "machine one thread gives steadier numbers")
    ap.add_argument("--no-compiled", action="store_true",
                    help="no torch.compile variants (default: chain and tree at B = 1, except "
                         "with --quick)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def _fmt(x, digits=1):
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def _speedup(row) -> str:
    x = row.get("speedup_vs_baseline", float("nan"))
    return "" if x != x or row["backend"] == row.get("baseline") else f"{x:.2f}x ({row['baseline']})"


def summary_table(rows: list[dict]) -> str:
    lines = ["| op | shape | dtype | mode | backend | stage | variant | median us | GB/s | % copy bw "
             "| speedup (vs) | status |", "|" + "---|" * 12]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['note']}"
        lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['mode']} | {r['backend']} "
                     f"| {r['stage']} | {r['variant']} | {_fmt(r['median_us'])} | {_fmt(r['gbps'])} "
                     f"| {_fmt(r['pct_copy_bw'])} | {_speedup(r)} "
                     f"| {status} |")
    return "\n".join(lines)


def run_model(out: Path, quick: bool, batch, env) -> None:
    from . import harness, spec_model  # noqa: PLC0415
    batch = batch or (256 if quick else 4096)
    num_drafts = 4 if quick else 8
    vocab = 64 if quick else 256
    t0 = time.perf_counter()
    measured, rows = spec_model.run(num_drafts=num_drafts, batch=batch, vocab=vocab)
    for r in rows:
        r.update({"trials": batch, "vocab": vocab, "git_commit": env.git_commit,
                  "timestamp": env.timestamp})
    harness.write_results(rows, out, stem="spec_model")
    (out / "spec_model_measured.json").write_text(json.dumps(measured, indent=1))
    text = spec_model.summary(measured, rows)
    (out / "spec_model.md").write_text(text + "\n")
    spec_model.plot(rows, out / "spec_model.png")
    print(f"\nSpeculation model ({batch} trials per position, V={vocab}, "
          f"{time.perf_counter() - t0:.1f} s):\n{text}")
    for level, m in measured.items():
        print(f"  {level}: K={num_drafts} chain mean accepted {m['chain_mean_accepted']:.3f}, "
              f"model E_K - 1 = {m['model_mean_accepted']:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # noqa: PLC0415 -- torch is imported here, not for --help
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.quick or args.preset == "quick" else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads_before)


def _main(args) -> int:
    import os  # noqa: PLC0415
    from . import harness, plots  # noqa: PLC0415
    from .ops import load  # noqa: PLC0415

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in ALL_OPS]
    if unknown:
        print(f"--ops: unknown {unknown}; expected a subset of {ALL_OPS}", file=sys.stderr)
        return 2
    device = harness.resolve_device(args.device)
    preset = args.preset or ("quick" if args.quick else ("gpu" if device.type == "cuda" else "cpu"))
    quick = args.quick or preset == "quick"
    out = args.out or Path(__file__).resolve().parent / "out" / (
        f"{device.type}-{_dt.date.today().isoformat()}")
    out.mkdir(parents=True, exist_ok=True)

    env = harness.environment(device)
    print(f"device: {env.device_name} ({device.type}); torch {env.torch}, triton {env.triton}; "
          f"commit {env.git_commit[:12]}{' (dirty)' if env.git_dirty else ''}; preset {preset}")
    timed_ops = [o for o in ops if o not in ("model", "extension")]
    if timed_ops or "extension" in ops:
        env.copy_bw_gbps = harness.copy_bandwidth_gbps(
            device, (64 << 20) if quick and device.type == "cpu" else None)
        print(f"copy bandwidth (read + write): {env.copy_bw_gbps:.1f} GB/s"
              + (f"; L2 {env.l2_bytes / 2**20:.0f} MiB, inputs rotate past 2x L2"
                 if env.l2_bytes else ""))
    cfg = harness.RunConfig(quick=quick, compiled=not (quick or args.no_compiled),
                            cpu_budget_s=0.3 if quick else 1.0,
                            gpu_rep_ms=50.0 if preset == "gpu_check" else 100.0,
                            backends=set(args.backends.split(",")) if args.backends else None)
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    if device.type == "cpu" and load_avg:
        print(f"load average {load_avg[0]:.2f} on {os.cpu_count()} CPUs (other work skews CPU timings)")
    meta = {"preset": preset, "ops": ops, "argv": sys.argv[1:], **env.row_fields(),
            "load_average": load_avg, "cpu_count": os.cpu_count(),
            "l2_bytes": env.l2_bytes, "byte_formulas": {}, "not_run": []}

    work = []
    speedup_baselines: dict = {}
    for op in timed_ops:
        module = load(op)
        meta["byte_formulas"][op] = module.BYTES_FORMULA
        work += [(module, case) for case in module.cases(device, preset)]
        speedup_baselines[module.OP] = getattr(module, "SPEEDUP_BASELINE", "torch_unfused")

    rows: list[dict] = []
    start = time.perf_counter()
    try:
        from tqdm import tqdm  # noqa: PLC0415
        progress = tqdm(work, desc="bench", unit="case", disable=args.no_progress, file=sys.stderr)
    except ImportError:
        progress = work
    for module, case in progress:
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            meta["not_run"].append(case.label())
            continue
        if hasattr(progress, "set_postfix_str"):
            progress.set_postfix_str(case.label()[:60])
        rows += harness.run_case(case, module, env, cfg)
        harness.add_speedups(rows, speedup_baselines)
        harness.write_results(rows, out)
    if "extension" in ops:
        from .ops import extension  # noqa: PLC0415
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            meta["not_run"].append("extension")
        else:
            rows += extension.run(env, quick)
            speedup_baselines.update({op: "reference" for op in (
                "build_tree_attention", "compact_kv_cache", "compact_paged_kv_cache")})
            harness.add_speedups(rows, speedup_baselines)
            harness.write_results(rows, out)
    if meta["not_run"]:
        print(f"time budget reached: {len(meta['not_run'])} cases not run (listed in meta.json)")

    if rows:
        skipped = {(r["backend"], r["note"]) for r in rows if r["status"] == "skipped"}
        for backend, note in sorted(skipped):
            print(f"skipped {backend}: {note}")
        errors = [r for r in rows if r["status"] == "error"]
        for r in errors[:20]:
            print(f"error {r['op']}[{r['shape']},{r['dtype']},{r['mode']}] {r['backend']} "
                  f"{r['stage']} {r['variant']}: {r['note']}")
        table = summary_table(rows)
        (out / "summary.md").write_text(
            f"# Benchmark results\n\n{env.device_name} ({device.type}), torch {env.torch}, "
            f"triton {env.triton}, commit {env.git_commit}, {env.timestamp}; copy bandwidth "
            f"{env.copy_bw_gbps:.1f} GB/s.\n\n{table}\n")
        print(table)

    if "model" in ops:
        run_model(out, quick, args.model_batch, env)
    if not args.no_plots and rows:
        for path in plots.write_all(rows, out):
            print(f"plot: {path}")
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
