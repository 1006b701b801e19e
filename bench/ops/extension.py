"""The C++ extension's own benchmark (``bench/bench_extension.py``, issue 3) folded into the
harness: its ``bench_tree_attention`` and ``bench_compaction`` run as they are (their random
trees, their timer: ``perf_counter`` medians, synchronised on CUDA) and their rows become
harness rows, so one run writes everything into the same JSON/CSV.

The rows keep the extension's op names (``build_tree_attention``, ``compact_kv_cache``,
``compact_paged_kv_cache``), distinct from ``mask`` and ``compact``, which time the same ops
with the harness's timer on EAGLE-like trees (and rotate inputs and replay CUDA graphs on GPU).
"""
from __future__ import annotations

import importlib

from ..harness import Case, Timing, make_row

OP = "extension"
SPEEDUP_BASELINE = "reference"
BYTES_FORMULA = "as bench/bench_extension.py counts them (_tree_bytes, _compaction_bytes)"


def available() -> tuple[bool, str]:
    try:
        module = importlib.import_module("bench.bench_extension")
    except Exception as exc:  # noqa: BLE001 -- not written yet, or broken: say which
        return False, f"bench.bench_extension not importable ({type(exc).__name__}: {str(exc)[:100]})"
    missing = [f for f in ("bench_tree_attention", "bench_compaction") if not hasattr(module, f)]
    return (False, f"bench.bench_extension lacks {missing}") if missing else (True, "")


def run(env, quick: bool) -> list[dict]:
    """Rows for every measurement of the extension's benchmark (one skipped row if absent)."""
    ok, why = available()
    if not ok:
        return [make_row(Case("build_tree_attention", {"B": 0}, "int32"), "extension", "ours",
                         env, status="skipped", note=why, min_bytes=1)]
    module = importlib.import_module("bench.bench_extension")
    device = str(env.device)
    if quick:
        raw = module.bench_tree_attention(batch_sizes=(2,), node_counts=(16,), device=device,
                                          warmup=1, repeats=3)
        raw += module.bench_compaction(batch_sizes=(2,), layouts=("bshd", "paged"), layers=2,
                                       device=device, warmup=1, repeats=3)
    else:
        raw = module.bench_tree_attention(device=device)
        raw += module.bench_compaction(device=device)
    label = "cuda_ext" if env.device.type == "cuda" else "cpp"
    rows = []
    for r in raw:
        params = {k: r[k] for k in ("B", "N", "L", "S") if k in r}
        dtype = r.get("dtype", "int32").replace("bfloat16", "bf16").replace("float32", "fp32")
        case = Case(r["op"], params, dtype, r.get("layout", ""))
        backend = label if r["backend"] == "extension" else r["backend"]
        t = float(r["time_us"])
        rows.append(make_row(case, backend, "ours" if backend == label else "baseline", env,
                             timing=Timing(t, t, t, 0, 1), min_bytes=int(r["bytes"]),
                             note="bench/bench_extension.py (its timer: median of perf_counter calls)"))
    return rows


__all__ = ["available", "run"]
