"""PNG plots of benchmark rows: latency against batch per op and backend, and % of the measured
copy bandwidth against vocabulary. (The speculation-model plot lives in ``spec_model.py``.)

Each panel fixes every axis but the one plotted, choosing the slice of the sweep that has the
most points along that axis (ties: the larger V, then bf16, then mode ``draft_probs``); the
fixed values are in the panel title.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

AXES = ("B", "K", "V", "N", "L", "S")


def _ok(row) -> bool:
    m = row.get("median_us")
    return row.get("status") == "ok" and row.get("kind") != "stage" and isinstance(m, (int, float)) \
        and m == m and m > 0


def _slice(rows: list[dict], axis: str):
    """The rows of the slice (all axes but ``axis`` fixed) with the most distinct ``axis``
    values, and a title for it."""
    groups = defaultdict(list)
    for r in rows:
        if axis not in r:
            continue
        key = tuple((a, r[a]) for a in AXES if a != axis and a in r) + (("dtype", r["dtype"]),
                                                                        ("mode", r["mode"]))
        groups[key].append(r)
    if not groups:
        return [], ""

    def rank(item):
        key, members = item
        d = dict(key)
        return (len({m[axis] for m in members}), d.get("V", 0), d.get("dtype") == "bf16",
                d.get("mode") == "draft_probs", len(members))
    key, members = max(groups.items(), key=rank)
    title = ", ".join(f"{k}={v}" for k, v in key if v != "")
    return members, title


def _series(members: list[dict], axis: str, value: str):
    series = defaultdict(list)
    for r in members:
        label = r["backend"] + ("" if r["variant"] == "eager" else f" ({r['variant']})")
        y = r.get(value)
        if isinstance(y, (int, float)) and y == y:
            series[label].append((r[axis], y))
    return {k: sorted(v) for k, v in series.items()}


def _figure(n_panels: int):
    import matplotlib  # noqa: PLC0415 -- plots are optional; import only when drawing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.8 * rows), squeeze=False)
    return plt, fig, [ax for line in axes for ax in line]


def _device_title(rows: list[dict]) -> str:
    r = rows[0]
    return f"{r.get('device_name', '?')}, torch {r.get('torch', '?')}, commit {str(r.get('git_commit', '?'))[:10]}"


def _panels(ok: list[dict], ops: list[str], axis: str, metric: str, xlabel: str, ylabel: str,
            xbase: float, suptitle: str, path: Path) -> bool:
    """One log-log panel per op: ``metric`` against ``axis``, a line per series."""
    if not ops:
        return False
    plt, fig, axes = _figure(len(ops))
    for ax, op in zip(axes, ops):
        members, title = _slice([r for r in ok if r["op"] == op], axis)
        for label, pts in _series(members, axis, metric).items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=xbase)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{op}: {title}", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in axes[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"{suptitle} -- {_device_title(ok)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_vs_batch(rows: list[dict], path: Path) -> bool:
    ok = [r for r in rows if _ok(r)]
    ops = [op for op in dict.fromkeys(r["op"] for r in ok) if any("B" in r for r in ok if r["op"] == op)]
    return _panels(ok, ops, "B", "median_us", "batch B", "median latency (us)", 2,
                   "Latency against batch", path)


def roofline_vs_vocab(rows: list[dict], path: Path) -> bool:
    ok = [r for r in rows if _ok(r) and "V" in r]
    ops = list(dict.fromkeys(r["op"] for r in ok))
    copy_bw = ok[0].get("copy_bw_gbps") if ok else None
    return _panels(ok, ops, "V", "pct_copy_bw", "vocabulary V", "% of measured copy bandwidth", 10,
                   f"Minimal bytes / time as % of copy bandwidth ({copy_bw} GB/s)", path)


def write_all(rows: list[dict], out_dir: Path) -> list[Path]:
    written = []
    for name, fn in (("latency_vs_batch.png", latency_vs_batch),
                     ("roofline_vs_vocab.png", roofline_vs_vocab)):
        if fn(rows, out_dir / name):
            written.append(out_dir / name)
    return written
