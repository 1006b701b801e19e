"""Plots of ``bench.e2e`` rows: speedup against K per task, acceptance by position."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def speedup_vs_k(rows: list[dict], path: Path) -> None:
    """Tokens/s over plain decoding against K (chains with a fixed K; adaptive drawn as a
    dashed level), one panel per (task, batch, temperature) that has a plain baseline."""
    panels = sorted({(r["task"], r["batch"], r["temperature"]) for r in rows
                     if r["speedup_vs_plain"] is not None})  # a group without plain: none
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (task, batch, temperature) in zip(axes[0], panels):
        mine = [r for r in rows if (r["task"], r["batch"], r["temperature"])
                == (task, batch, temperature) and r["speedup_vs_plain"] is not None]
        for drafter, colour in (("ngram", "tab:blue"), ("model", "tab:orange")):
            fixed = sorted((r["K"], r["speedup_vs_plain"]) for r in mine
                           if r["drafter"] == drafter and isinstance(r["K"], int))
            if fixed:
                ax.plot(*zip(*fixed), "o-", color=colour, label=f"{drafter}, fixed K")
            for r in mine:
                if r["drafter"] == drafter and r["K"] == "adaptive":
                    ax.axhline(r["speedup_vs_plain"], color=colour, ls="--",
                               label=f"{drafter}, adaptive")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{task}, batch {batch}, T={temperature:g}", fontsize=9)
        ax.set_xlabel("draft tokens K")
        ax.set_ylabel("x plain decoding")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_by_position(rows: list[dict], path: Path) -> None:
    """Share of drafted tokens accepted at each draft position (batch-1 greedy rows)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        acc = r["acceptance_by_position"]
        if not acc or r["batch"] != 1 or r["temperature"] != 0:
            continue
        ax.plot(range(1, len(acc) + 1), acc, "o-", ms=3,
                label=f"{r['task']} {r['drafter']} K={r['K']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
