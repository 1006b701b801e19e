"""Speculation model: when does drafting pay?

One verification step with draft length ``K`` costs ``K`` draft forwards and one target forward:
``K*c + 1`` in units of a target forward, where ``c`` is the draft/target cost ratio. It emits
``E_K`` tokens in expectation, with per-position acceptance rates ``alpha_j`` (the probability
that draft ``j`` is accepted given drafts ``1..j-1`` were):

    E_K = 1 + sum_{k=1..K} prod_{j<=k} alpha_j          (expected tokens per step)
    speedup_K = E_K / (K*c + 1)                           (against plain decoding)

With a constant ``alpha`` this is Leviathan et al.'s (ICML 2023) ``(1 - alpha^(K+1)) /
((1 - alpha) (K c + 1))``. Verification time itself is left out (it is the kernels' job to
make it negligible; the chain benchmark says how small it is).

The rates come from our own ``verify_chain`` (reference backend, CPU) on synthetic
target/draft pairs of controlled agreement: target logits ``3 * N(0, 1)`` over ``V`` tokens and
draft logits ``target + sigma_j * N(0, 1)`` with ``sigma_j = sigma * (1 + 0.1 (j - 1))``, so a
draft drifts further from the target the further it looks ahead. Drafts are sampled from the
draft's distribution and verified with ``draft_logits``, so ``q`` is exact and the measured
rate estimates ``sum(min(p, q))``, which the table reports alongside as a check. The full
K-draft chain's mean accepted length is compared with ``E_K - 1`` as a check of the model.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

AGREEMENT = {"high": 0.5, "medium": 1.5, "low": 4.0}  # draft noise scale sigma
COST_RATIOS = (0.02, 0.1, 0.25, 0.5)                   # draft forward / target forward
LOGIT_SCALE = 3.0
POSITION_GROWTH = 0.1


def expected_tokens(alphas: Sequence[float], num_drafts: int) -> float:
    """``E_K = 1 + sum_{k=1..K} prod_{j<=k} alpha_j`` for ``K = num_drafts``."""
    total, run = 1.0, 1.0
    for alpha in list(alphas)[:num_drafts]:
        run *= alpha
        total += run
    return total


def speedup(alphas: Sequence[float], num_drafts: int, cost_ratio: float) -> float:
    """``E_K / (K*c + 1)``."""
    return expected_tokens(alphas, num_drafts) / (num_drafts * cost_ratio + 1)


def leviathan_speedup(alpha: float, num_drafts: int, cost_ratio: float) -> float:
    """The constant-rate closed form, for checking."""
    if alpha == 1:
        return (num_drafts + 1) / (num_drafts * cost_ratio + 1)
    return (1 - alpha ** (num_drafts + 1)) / ((1 - alpha) * (num_drafts * cost_ratio + 1))


def measure_acceptance(sigma: float, *, num_drafts: int = 8, batch: int = 4096, vocab: int = 256,
                       seed: int = 0) -> dict:
    """Per-position acceptance measured with ``verify_chain`` (reference backend, CPU).

    Every position is verified twice from the same drafts: once as a one-draft chain per
    (request, position) -- ``alphas[j-1]``, the rate at position ``j`` from ``batch`` trials
    however deep ``j`` is -- and once as the full ``K``-draft chain, whose mean accepted length
    checks the model: it should equal ``E_K - 1`` computed from the rates (positions are
    independent here, so the conditional rate equals the one-draft rate).

    Returns ``alphas``, ``alphas_expected`` (mean ``sum(min(p_j, q_j))``, what the rate should
    be), ``chain_mean_accepted`` and ``model_mean_accepted`` (``E_K - 1``) and ``trials``.
    """
    import specdec_kernels as sk  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    target = LOGIT_SCALE * torch.randn(batch, num_drafts + 1, vocab, generator=gen)
    growth = 1 + POSITION_GROWTH * torch.arange(num_drafts, dtype=torch.float32)
    draft_logits = target[:, :num_drafts] + sigma * growth[None, :, None] * torch.randn(
        batch, num_drafts, vocab, generator=gen)
    q = torch.softmax(draft_logits, -1)  # temperature 1, no top-k/top-p: processed_probs
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, num_drafts)

    chain = sk.verify_chain(target, drafts, draft_logits=draft_logits,
                            seed=torch.arange(batch, dtype=torch.int64) + 7 * (seed + 1),
                            offset=1, backend="reference")
    # One-draft chains: request (b, j) verifies draft j against target row j (bonus row K).
    single_target = torch.stack([target[:, :num_drafts],
                                 target[:, num_drafts:].expand(-1, num_drafts, -1)], dim=2)
    single = sk.verify_chain(single_target.reshape(batch * num_drafts, 2, vocab),
                             drafts.reshape(-1, 1),
                             draft_logits=draft_logits.reshape(batch * num_drafts, 1, vocab),
                             seed=torch.arange(batch * num_drafts, dtype=torch.int64) + 99991,
                             offset=2, backend="reference")
    alphas = single.num_accepted.view(batch, num_drafts).float().mean(0).tolist()
    p = torch.softmax(target[:, :num_drafts], -1)
    expected = torch.minimum(p, q).sum(-1).mean(0).tolist()
    return {"alphas": alphas, "alphas_expected": expected, "trials": batch,
            "chain_mean_accepted": float(chain.num_accepted.float().mean()),
            "model_mean_accepted": expected_tokens(alphas, num_drafts) - 1}


def build_table(measured: dict, cost_ratios: Sequence[float] = COST_RATIOS,
                max_drafts: int = 8) -> list[dict]:
    """One row per (agreement, c, K) with ``E_K`` and the speedup."""
    rows = []
    for level, m in measured.items():
        for c in cost_ratios:
            for k in range(1, max_drafts + 1):
                rows.append({"agreement": level, "sigma": m["sigma"], "cost_ratio": c,
                             "K": k, "alpha_k": round(m["alphas"][k - 1], 4),
                             "alpha_k_expected": round(m["alphas_expected"][k - 1], 4),
                             "expected_tokens": round(expected_tokens(m["alphas"], k), 4),
                             "speedup": round(speedup(m["alphas"], k, c), 4)})
    return rows


def run(agreement: dict = AGREEMENT, *, num_drafts: int = 8, batch: int = 4096,
        vocab: int = 256) -> tuple[dict, list[dict]]:
    measured = {}
    for i, (level, sigma) in enumerate(agreement.items()):
        m = measure_acceptance(sigma, num_drafts=num_drafts, batch=batch, vocab=vocab, seed=i)
        m["sigma"] = sigma
        measured[level] = m
    return measured, build_table(measured, max_drafts=num_drafts)


def summary(measured: dict, rows: list[dict]) -> str:
    """Markdown: per-position rates, then the best K and its speedup for each (agreement, c)."""
    lines = ["| agreement | sigma | alpha_1..alpha_K (measured) | sum min(p,q) (expected) |",
             "|---|---|---|---|"]
    for level, m in measured.items():
        lines.append(f"| {level} | {m['sigma']} | {', '.join(f'{a:.3f}' for a in m['alphas'])} "
                     f"| {', '.join(f'{a:.3f}' for a in m['alphas_expected'])} |")
    lines += ["", "| agreement | c | best K | E at best K | speedup at best K | speedup at largest K |",
              "|---|---|---|---|---|---|"]
    for level in measured:
        for c in sorted({r["cost_ratio"] for r in rows}):
            sel = [r for r in rows if r["agreement"] == level and r["cost_ratio"] == c]
            best = max(sel, key=lambda r: r["speedup"])
            last = max(sel, key=lambda r: r["K"])
            verdict = "" if best["speedup"] > 1 else " (drafting loses)"
            lines.append(f"| {level} | {c} | {best['K']} | {best['expected_tokens']:.2f} | "
                         f"{best['speedup']:.2f}{verdict} | {last['speedup']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    levels = list(dict.fromkeys(r["agreement"] for r in rows))
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.6), sharey=True,
                             squeeze=False)
    for ax, level in zip(axes[0], levels):
        for c in sorted({r["cost_ratio"] for r in rows}):
            sel = sorted((r for r in rows if r["agreement"] == level and r["cost_ratio"] == c),
                         key=lambda r: r["K"])
            ax.plot([r["K"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"c={c}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        alpha1 = next(r["alpha_k"] for r in rows if r["agreement"] == level)
        ax.set_title(f"{level} agreement (alpha_1={alpha1:.2f})")
        ax.set_xlabel("draft length K")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup E_K / (K c + 1)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Speculation model: below the dashed line drafting loses", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- Verification methods: block vs token (chains), traversal vs token (trees) ------------

def _synthetic_rows(sigma: float, batch: int, rows: int, vocab: int, gen: torch.Generator):
    """Target logits ``[B, rows + 1, V]`` and draft logits ``[B, rows, V]`` as above: row ``j``
    of a request is the same whatever was drafted before it (context-free per request)."""
    target = LOGIT_SCALE * torch.randn(batch, rows + 1, vocab, generator=gen)
    growth = 1 + POSITION_GROWTH * torch.arange(rows, dtype=torch.float32)
    draft = target[:, :rows] + sigma * growth[None, :, None] * torch.randn(
        batch, rows, vocab, generator=gen)
    return target, draft


def chain_method_gain(sigma: float, *, num_drafts: int = 8, batch: int = 4096,
                      vocab: int = 256, seed: int = 0) -> dict:
    """Expected accepted drafts per step, token vs block verification, for chains of
    ``num_drafts`` on the synthetic pairs above (temperature 1). Per request, with
    ``alpha_j = sum(min(p_j, q_j))`` and ``r_j = p_j(x_j) / q_j(x_j)`` (rows context-free, so
    the ratios are independent):

    * token, exact: ``sum_i prod_{j<=i} alpha_j``;
    * block: ``sum_i E[w_i]``, ``w_i = min(1, w_{i-1} r_i)`` (``w_i = P(tau >= i | x^i)``
      exactly, so only the drafts are sampled: one chain per request), as token + gain, where
      the gain ``sum_i (w_i - prod_{j<=i} min(1, r_j))`` (the second term's mean is token's
      exact value) is >= 0 pointwise; its standard error is given;
    * as a check, the mean ``num_accepted`` of ``verify_chain`` with each method.
    """
    import specdec_kernels as sk  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    target, draft = _synthetic_rows(sigma, batch, num_drafts, vocab, gen)
    p, q = torch.softmax(target.double(), -1), torch.softmax(draft.double(), -1)
    token_exact = torch.minimum(p[:, :num_drafts], q).sum(-1).cumprod(-1).sum(-1)
    drafts = torch.multinomial(q.reshape(-1, vocab).float(), 1, generator=gen).view(batch, -1)
    ratio = (p[:, :num_drafts].gather(-1, drafts[..., None])
             / q.gather(-1, drafts[..., None]))[..., 0]
    w, weights = torch.ones(batch, dtype=torch.float64), []
    for j in range(num_drafts):
        w = (w * ratio[:, j]).clamp(max=1)
        weights.append(w)
    gain = torch.stack(weights, 1).sum(-1) - ratio.clamp(max=1).cumprod(-1).sum(-1)
    kw = dict(draft_logits=draft, seed=torch.arange(batch) + 1000 * seed, offset=3,
              backend="reference")
    measured = {m: float(sk.verify_chain(target, drafts, method=m, **kw).num_accepted
                         .double().mean()) for m in ("token", "block")}
    return {"sigma": sigma, "num_drafts": num_drafts, "batch": batch, "vocab": vocab,
            "token_exact": float(token_exact.mean()),
            "block": float(token_exact.mean() + gain.mean()),
            "block_gain": float(gain.mean()), "block_gain_se": float(gain.std() / batch ** 0.5),
            "token_measured": measured["token"], "block_measured": measured["block"]}


def binary_tree(depth: int) -> list[int]:
    """Parents of a full binary tree of ``depth`` levels below the root, in pre-order (a
    node's subtree right after it): ``2**(depth+1) - 1`` nodes."""
    parents = [-1]

    def grow(node: int, level: int) -> None:
        for _ in range(2):
            if level < depth:
                parents.append(node)
                grow(len(parents) - 1, level + 1)
    grow(0, 0)
    return parents


def tree_method_gain(sigma: float, *, depth: int = 3, batch: int = 8192, vocab: int = 256,
                     seed: int = 0) -> dict:
    """Mean accepted drafts per step, token vs traversal verification, on full binary trees of
    ``depth`` levels with children drawn i.i.d. from the draft (rows context-free per depth:
    a node's rows are those of its depth). Monte Carlo: both methods verify the same trees
    with the same seeds and offsets; the gain's standard error is the paired one."""
    import specdec_kernels as sk  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    parents = binary_tree(depth)
    nodes = len(parents)
    level = [0] * nodes
    for i in range(1, nodes):
        level[i] = level[parents[i]] + 1
    target, draft = _synthetic_rows(sigma, batch, depth + 1, vocab, gen)
    node_target = target[:, level]
    node_q = torch.softmax(draft[:, level], -1)
    tokens = torch.zeros(batch, nodes, dtype=torch.int64)
    for i in range(1, nodes):  # node i drawn from its parent's draft row
        tokens[:, i] = torch.multinomial(node_q[:, parents[i]], 1, generator=gen)[:, 0]
    kw = dict(draft_probs=node_q, seed=torch.arange(batch) + 7000 * (seed + 1), offset=5,
              backend="reference")
    tree_parents = torch.tensor(parents).expand(batch, nodes)
    accepted = {m: sk.verify_tree(node_target, tokens, tree_parents, method=m, **kw)
                .num_accepted.double() for m in ("token", "traversal")}
    gain = accepted["traversal"] - accepted["token"]
    return {"sigma": sigma, "depth": depth, "nodes": nodes, "batch": batch, "vocab": vocab,
            "token": float(accepted["token"].mean()),
            "traversal": float(accepted["traversal"].mean()),
            "traversal_gain": float(gain.mean()), "traversal_gain_se": float(gain.std() / batch ** 0.5)}


def method_gain_table(agreement: dict = AGREEMENT, draft_lengths: Sequence[int] = (2, 4, 8), *,
                      chain_batch: int = 4096, tree_batch: int = 8192, vocab: int = 256,
                      tree_depth: int = 3) -> dict:
    """``{"chain": rows per (agreement, K), "tree": rows per agreement}``."""
    chain, tree = [], []
    for i, (level, sigma) in enumerate(agreement.items()):
        for k in draft_lengths:
            chain.append({"agreement": level, **chain_method_gain(
                sigma, num_drafts=k, batch=chain_batch, vocab=vocab, seed=i)})
        tree.append({"agreement": level, **tree_method_gain(
            sigma, depth=tree_depth, batch=tree_batch, vocab=vocab, seed=i)})
    return {"chain": chain, "tree": tree}


def method_gain_summary(table: dict) -> str:
    """Markdown: accepted drafts per step (a step emits accepted + 1 tokens)."""
    lines = ["| agreement | K | token (exact) | block | gain (emitted tokens) | verify_chain token → block |",
             "|---|---|---|---|---|---|"]
    for r in table["chain"]:
        lines.append(
            f"| {r['agreement']} | {r['num_drafts']} | {r['token_exact']:.3f} | {r['block']:.3f} "
            f"| +{r['block_gain']:.3f} ± {r['block_gain_se']:.3f} "
            f"(+{100 * r['block_gain'] / (1 + r['token_exact']):.1f}%) "
            f"| {r['token_measured']:.3f} → {r['block_measured']:.3f} |")
    lines += ["", "| agreement | tree | token | traversal | gain (emitted tokens) |",
              "|---|---|---|---|---|"]
    for r in table["tree"]:
        lines.append(
            f"| {r['agreement']} | binary, depth {r['depth']} ({r['nodes'] - 1} drafts) "
            f"| {r['token']:.3f} | {r['traversal']:.3f} "
            f"| {r['traversal_gain']:+.3f} ± {r['traversal_gain_se']:.3f} "
            f"({100 * r['traversal_gain'] / (1 + r['token']):+.1f}%) |")
    return "\n".join(lines)


__all__ = ["expected_tokens", "speedup", "leviathan_speedup", "measure_acceptance",
           "build_table", "run", "summary", "plot", "chain_method_gain", "tree_method_gain",
           "binary_tree", "method_gain_table", "method_gain_summary"]


if __name__ == "__main__":  # python -m bench.spec_model [OUT_DIR]: the methods' gain table
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    table = method_gain_table()
    (out / "method_gain.json").write_text(json.dumps(table, indent=1))
    text = method_gain_summary(table)
    (out / "method_gain.md").write_text(text + "\n")
    print(text)

