"""The law of the first two generated tokens under speculation, against the exact law from
the model's own next-token distributions (top-k = 5, so 25 cells).

Running the whole loop 20,000 times is out of reach on a CPU, and unnecessary: with
``top_k = 5`` the first two tokens depend on few prefixes (the prompt, the prompt + each of
5 first tokens, and the draft paths below them). Their target and draft logit rows are
computed by the real model once, then many requests take the speculative steps together
through the loop's own pieces (:class:`NgramDrafter`, ``sk.sample`` for the draft model's
drafts, the n-gram trie as a tree of deterministic candidates, the loop's ``verify_step``)
until each has two tokens. Rows are restricted to the
union of every row's top 5 and the drafted ids: top-k = 5 over that sub-vocabulary is the
same distribution as over the full one, so the law is unchanged.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

import specdec_kernels as sk

from .config import Sampling, Speculation
from .drafters import DRAFT_SEED, NgramDrafter, NgramTrieDrafter
from .model import SlotCache, forward_block, prefill
from .plans import chain_plan, deterministic_tree_plan
from .verify import pack_chain_rows, verify_step

TOP_K = 5


def _rows(model, prompt: tuple[int, ...], prefixes) -> dict:
    """Next-token logits after each prefix (each extends ``prompt``), by the real model: the
    prompt once, then every extension as one token tree (tree attention) in one forward."""
    device = next(model.parameters()).device
    suffixes = sorted({tuple(p[len(prompt):]) for p in prefixes}, key=len)
    nodes = {(): 0}
    tokens, parents = [prompt[-1]], [-1]
    for suffix in suffixes:
        for end in range(1, len(suffix) + 1):
            if suffix[:end] not in nodes:
                nodes[suffix[:end]] = len(tokens)
                tokens.append(suffix[end - 1])
                parents.append(nodes[suffix[:end - 1]])
    cache = SlotCache(1, len(prompt) + len(tokens) + 1)
    prefill(model, cache, [list(prompt)], device)
    tree = sk.build_tree_attention(torch.tensor([parents], device=device))
    logits = forward_block(model, cache, torch.tensor([tokens], device=device),
                           torch.tensor([len(prompt) - 1], device=device), tree.mask,
                           tree.depth.to(torch.long))[0]
    return {prompt + suffix: logits[nodes[suffix]] for suffix in suffixes}


class RowTable:
    """Logit rows of the target (and draft) after every prefix the test can reach."""

    def __init__(self, target, draft, prompt: list[int], num_draft: int, drafter: str,
                 ngram: NgramDrafter, trie: Optional[NgramTrieDrafter] = None):
        prompt = tuple(prompt)
        self.prompt, self.num_draft, self.drafter, self.trie = prompt, num_draft, drafter, trie
        target_rows = _rows(target, prompt, [prompt])
        firsts = target_rows[prompt].topk(TOP_K).indices.tolist()
        draft_rows: dict = {}
        if drafter == "model":
            # Every path of up to num_draft drafts below the prompt and below prompt + x1.
            roots = [prompt] + [prompt + (x,) for x in firsts]
            draft_rows.update(_rows(draft, prompt, roots))
            frontier = list(roots)
            for _ in range(num_draft - 1):
                frontier = [p + (d,) for p in frontier
                            for d in draft_rows[p].topk(TOP_K).indices.tolist()]
                draft_rows.update(_rows(draft, prompt, frontier))
            needed = set()
            for p in draft_rows:
                for d in draft_rows[p].topk(TOP_K).indices.tolist():
                    needed.add(p + (d,))
            needed |= set(draft_rows)
        elif drafter == "ngram_trie":  # every node's path below the prompt and prompt + x1
            needed = set()
            for root in [prompt] + [prompt + (x,) for x in firsts]:
                tokens, parents = trie.trie(list(root))
                paths = [root]
                for i in range(1, len(tokens)):
                    paths.append(paths[parents[i]] + (tokens[i],))
                needed.update(paths)
        else:
            needed = {prompt}
            for root in [prompt] + [prompt + (x,) for x in firsts]:
                path = root
                drafts = ngram.propose(list(root), num_draft)
                for d in [None] + drafts:
                    path = path if d is None else path + (d,)
                    needed.add(path)
        target_rows.update(_rows(target, prompt, needed - set(target_rows)))
        ids = set()
        for rows in (target_rows, draft_rows):
            for p, row in rows.items():
                ids.update(row.topk(TOP_K).indices.tolist())
                ids.update(p[len(prompt):])
        self.vocab = sorted(ids)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        columns = torch.tensor(self.vocab)
        self.target = {p: r[columns] for p, r in target_rows.items()}
        self.draft = {p: r[columns] for p, r in draft_rows.items()}
        self.firsts = firsts


def exact_law(table: RowTable) -> np.ndarray:
    """P(x1, x2) over the 5 x 5 top-k cells, float64 from the model's rows."""
    p1 = sk.processed_probs(table.target[table.prompt].double()[None], 1.0, TOP_K)[0]
    law = np.zeros((TOP_K, TOP_K))
    for i, x1 in enumerate(table.firsts):
        row = table.target[table.prompt + (x1,)]
        p2 = sk.processed_probs(row.double()[None], 1.0, TOP_K)[0]
        seconds = table.target[table.prompt + (x1,)].topk(TOP_K).indices.tolist()
        for j, x2 in enumerate(seconds):
            law[i, j] = float(p1[table.index[x1]] * p2[x2])
    return law


def _step(table: RowTable, prefixes: list[tuple], seeds: torch.Tensor, offset: int,
          ngram: NgramDrafter, planted_bug: Optional[str], method: str = "token"):
    """One speculative step for a batch of requests at the given prefixes: (tokens emitted)."""
    k = table.num_draft
    batch = len(prefixes)
    sampling = Sampling(temperature=1.0, top_k=TOP_K)
    vocab = len(table.vocab)
    if table.drafter == "ngram_trie":
        return _trie_step(table, prefixes, seeds, offset, sampling, method, planted_bug)
    drafts = torch.full((batch, k), -1, dtype=torch.long)
    draft_logits = None
    paths = [list(p) for p in prefixes]
    if table.drafter == "model":
        draft_logits = torch.zeros(batch, k, vocab)
        for j in range(k):
            rows = torch.stack([table.draft[tuple(p)] for p in paths])
            local = sk.sample(rows, seed=seeds + DRAFT_SEED, offset=offset * 64 + j,
                              **sampling.kwargs())
            draft_logits[:, j] = rows
            drafts[:, j] = local
            for b, t in enumerate(local.tolist()):
                paths[b].append(table.vocab[t])
        num_draft = torch.full((batch,), k, dtype=torch.long)
    else:
        lengths = []
        for b, p in enumerate(prefixes):
            proposal = ngram.propose(list(p), k)
            lengths.append(len(proposal))
            for j, t in enumerate(proposal):
                drafts[b, j] = table.index[t]
                paths[b].append(t)
        num_draft = torch.tensor(lengths, dtype=torch.long)
    # Target rows after each path prefix: pending (the prefix) then each draft.
    logits = torch.zeros(batch, k + 1, vocab)
    for b in range(batch):
        base = len(prefixes[b])
        for j in range(int(num_draft[b]) + 1):
            logits[b, j] = table.target[tuple(paths[b][:base + j])]
    plan = chain_plan(drafts, num_draft, draft_logits)
    out, num_accepted, _ = verify_step(pack_chain_rows(logits, num_draft + 1), plan, None,
                                   torch.zeros(batch, dtype=torch.long), sampling,
                                   Speculation(method=method), seeds,
                                   torch.full((batch,), offset, dtype=torch.long), planted_bug)
    emitted = []
    for b in range(batch):
        emitted.append([table.vocab[t] for t in out[b, :int(num_accepted[b]) + 1].tolist()])
    return emitted


def _trie_step(table: RowTable, prefixes: list[tuple], seeds: torch.Tensor, offset: int,
               sampling: Sampling, method: str, planted_bug: Optional[str] = None):
    """One step with the n-gram trie: a tree of deterministic candidates per request
    (planted ``"rows_one_late"``: node ``i`` is checked against node ``i + 1``'s row)."""
    tries, paths = {}, {}
    for prefix in set(prefixes):
        tokens, parents = table.trie.trie(list(prefix))
        node_paths = [prefix]
        for i in range(1, len(tokens)):
            node_paths.append(node_paths[parents[i]] + (tokens[i],))
        local = [-1] + [table.index[t] for t in tokens[1:]]
        tries[prefix], paths[prefix] = (local, parents), node_paths
    batch = len(prefixes)
    zeros = torch.zeros(batch, dtype=torch.long)
    plan = deterministic_tree_plan([tries[p] for p in prefixes], zeros)
    width = plan.parents.shape[1]
    late = planted_bug == "rows_one_late"
    rows = {p: torch.stack([table.target[paths[p][min(i + late, len(paths[p]) - 1)]]
                            for i in range(len(paths[p]))]) for p in tries}
    logits = torch.zeros(batch, width, len(table.vocab))
    for b, p in enumerate(prefixes):
        logits[b, :rows[p].shape[0]] = rows[p]
    out, num_accepted, _ = verify_step(logits, plan, None, zeros, sampling,
                                       Speculation(method=method), seeds,
                                       torch.full((batch,), offset, dtype=torch.long))
    return [[table.vocab[t] for t in out[b, :int(num_accepted[b]) + 1].tolist()]
            for b in range(batch)]


def sampled_law(table: RowTable, samples: int, *, seed: int = 0,
                planted_bug: Optional[str] = None,
                method: str = "token") -> tuple[np.ndarray, int]:
    """(counts of (x1, x2) over ``samples`` speculative requests in the cells of exact_law,
    count of requests outside them: impossible under the exact law)."""
    ngram = NgramDrafter()
    seeds = torch.arange(samples, dtype=torch.long) + seed * samples
    prefixes = [table.prompt] * samples
    emitted = _step(table, prefixes, seeds, 0, ngram, planted_bug, method)
    short = [b for b, e in enumerate(emitted) if len(e) < 2 and e[0] in table.firsts]
    if short:
        more = _step(table, [table.prompt + (emitted[b][0],) for b in short], seeds[short], 1,
                     ngram, planted_bug, method)
        for b, e in zip(short, more):
            emitted[b] = emitted[b] + e
    counts = np.zeros((TOP_K, TOP_K))
    outside = 0
    for e in emitted:
        if len(e) < 2 or e[0] not in table.firsts:
            outside += 1
            continue
        i = table.firsts.index(e[0])
        seconds = table.target[table.prompt + (e[0],)].topk(TOP_K).indices.tolist()
        j = table.index.get(e[1])
        if j not in seconds:
            outside += 1
            continue
        counts[i, seconds.index(j)] += 1
    return counts, outside


def chi_square(counts: np.ndarray, law: np.ndarray, *, alpha: float = 1e-3,
               power: float = 0.99) -> dict:
    """Pearson's chi-square of counts against law (cells with expected < 5 merged), and the
    smallest chi-square distance sum((p' - p)^2 / p) detected with the given power."""
    from scipy import stats
    total = counts.sum()
    expected = law.flatten() * total
    observed = counts.flatten()
    order = np.argsort(expected)
    merged_e, merged_o, acc_e, acc_o = [], [], 0.0, 0.0
    for i in order:
        acc_e += expected[i]
        acc_o += observed[i]
        if acc_e >= 5:
            merged_e.append(acc_e)
            merged_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e and merged_e:
        merged_e[-1] += acc_e
        merged_o[-1] += acc_o
    e, o = np.array(merged_e), np.array(merged_o)
    statistic = float(((o - e) ** 2 / e).sum()) if len(e) else 0.0
    df = len(e) - 1
    p_value = float(stats.chi2.sf(statistic, df))
    critical = float(stats.chi2.isf(alpha, df))
    lo, hi = 0.0, 1e4  # noncentrality at which the test reaches `power`
    for _ in range(100):
        mid = (lo + hi) / 2
        if stats.ncx2.sf(critical, df, mid) < power:
            lo = mid
        else:
            hi = mid
    return {"statistic": statistic, "df": df, "p_value": p_value, "alpha": alpha,
            "power": power, "detectable_distance": hi / total if total else float("inf"),
            "samples": int(total)}


def first_two_tokens_test(target, draft, prompt: list[int], *, drafter: str,
                          num_draft: Optional[int] = None, samples: int = 20000,
                          planted_bug: Optional[str] = None, alpha: float = 1e-3,
                          method: str = "token", trie_nodes: int = 8) -> dict:
    """``drafter``: ``"ngram"``, ``"model"`` or ``"ngram_trie"`` (a trie of at most
    ``trie_nodes`` nodes, depth ``num_draft``)."""
    if num_draft is None:  # the draft model's paths multiply the rows needed: one draft
        num_draft = 1 if drafter == "model" else 2
    trie = NgramTrieDrafter(max_nodes=trie_nodes, max_depth=num_draft)
    table = RowTable(target, draft, prompt, num_draft, drafter, NgramDrafter(), trie)
    law = exact_law(table)
    counts, outside = sampled_law(table, samples, planted_bug=planted_bug, method=method)
    result = chi_square(counts, law, alpha=alpha)
    if outside:  # a pair the exact law gives probability 0
        result["p_value"] = 0.0
    if drafter == "ngram_trie":
        result["root_candidates"] = trie.trie(list(prompt))[1].count(0)
    result.update(drafter=drafter, method=method, num_draft=num_draft, planted_bug=planted_bug,
                  outside_support=outside, vocab_rows=len(table.vocab),
                  passed=result["p_value"] > alpha)
    return result
