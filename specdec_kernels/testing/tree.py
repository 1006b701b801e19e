"""``check_tree_verifier``: certify a tree verifier in the toolkit's padded layout."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from . import _core, _laws
from ._laws import SamplingSetting
from .chain import ChainInstance
from .report import Report

DRAFT_MODES = ("candidates", "iid", "without_replacement")
METHODS = ("token", "traversal")
# Depth 2: the root's children 1 and 2; node 1's children 3 and 4; node 2's child 5.
PARENTS = (-1, 0, 0, 1, 1, 2)


class TreeShape:
    def __init__(self, parents: Sequence[int]):
        self.parents = list(parents)
        if self.parents[0] != -1 or any(not 0 <= u < i for i, u in enumerate(self.parents) if i):
            raise ValueError(f"parents: expected parents[0] == -1 and 0 <= parents[i] < i, "
                             f"got {tuple(parents)}")
        self.nodes = len(self.parents)
        self.children = [[c for c in range(1, self.nodes) if self.parents[c] == u]
                         for u in range(self.nodes)]
        self.depth = [0] * self.nodes
        for i in range(1, self.nodes):
            self.depth[i] = self.depth[self.parents[i]] + 1
        self.max_depth = max(self.depth)


def _draw_tree(shape: TreeShape, q_table: torch.Tensor, mode: str, vocab: int, batch: int,
               gen: torch.Generator):
    """Node tokens ``[B, N]`` (root 0) and each node's table row ``[B, N]``: the children of
    a node drawn from ``q`` of its path (i.i.d., without replacement, or its top
    candidates in decreasing ``q``, lowest id among ties)."""
    tokens = torch.zeros(batch, shape.nodes, dtype=torch.int64)
    paths = [torch.zeros(batch, 0, dtype=torch.int64)] + [None] * (shape.nodes - 1)
    rows = torch.zeros(batch, shape.nodes, dtype=torch.int64)
    for u in range(shape.nodes):
        rows[:, u] = _laws.prefix_index(paths[u], vocab)
        kids = shape.children[u]
        if not kids:
            continue
        q = q_table[rows[:, u]]
        if mode == "candidates":
            drawn = q.sort(dim=-1, descending=True, stable=True).indices[:, :len(kids)]
        else:
            drawn = torch.multinomial(q, len(kids), replacement=mode == "iid", generator=gen)
        for r, child in enumerate(kids):
            tokens[:, child] = drawn[:, r]
            paths[child] = torch.cat([paths[u], drawn[:, r:r + 1]], 1)
    return tokens, rows


def _greedy_expected(shape: TreeShape, target_logits: torch.Tensor, tokens: torch.Tensor):
    best = _laws.one_hot_rows(target_logits).argmax(-1)  # [B, N]
    batch = tokens.shape[0]
    out = torch.full((batch, shape.nodes), -1, dtype=torch.int64)
    node = torch.zeros(batch, dtype=torch.int64)
    done = torch.zeros(batch, dtype=torch.bool)
    for step in range(shape.max_depth + 1):
        want = best.gather(1, node[:, None])[:, 0]
        moved = torch.zeros(batch, dtype=torch.bool)
        nxt = node.clone()
        for u in range(shape.nodes):
            for child in shape.children[u]:
                hit = (node == u) & ~moved & (tokens[:, child] == want) & ~done
                nxt = torch.where(hit, child, nxt)
                moved |= hit
        out[:, step] = torch.where(done, out[:, step], want)
        done |= ~moved
        node = nxt
    return out


def _check_format(ids, path, tokens, parents, vocab):
    """Rows whose path starts at the root, follows parent links, carries the nodes' tokens
    and ends in one in-range token, all padded with ``-1``."""
    nodes = tokens.shape[1]
    if ids.dim() != 2 or path.shape != ids.shape or ids.shape[1] < nodes:
        return torch.zeros(ids.shape[0], dtype=torch.bool)
    good = _core.window_format(ids, vocab)
    length = _core.emitted_length(ids)
    position = torch.arange(nodes)
    on_path = position < length[:, None]
    good &= (path[:, 0] == 0) & torch.where(on_path, path >= 0, path == -1).all(-1)
    node = path.clamp(0, nodes - 1)
    parent_ok = parents.gather(1, node[:, 1:]) == node[:, :-1]
    token_ok = ids[:, :-1] == tokens.gather(1, node[:, 1:])
    drafted = (position[1:] < length[:, None])
    good &= torch.where(drafted, parent_ok & token_ok, True).all(-1)
    return good


def check_tree_verifier(verify: Callable, *, draft_modes: Sequence[str] = DRAFT_MODES,
                        params: Sequence[str] = ("temperature", "top_k", "top_p"),
                        methods: Sequence[str] = ("token",), seeded: bool = True,
                        per_request: bool = True, parents: Sequence[int] = PARENTS,
                        vocab_size: int = 4, alpha: float = 1e-3, tv: float = 0.05,
                        power: float = 0.95, samples: Optional[int] = None,
                        max_samples: int = 400_000, batch_size: int = 1 << 16, seed: int = 0,
                        device="cpu") -> Report:
    r"""Certify a tree verifier: does it preserve the target distribution, exactly?

    ``verify(target_logits, tree_token_ids, parents, *, draft_probs=None,
    [draft_sampling=...], [temperature=..., top_k=..., top_p=..., min_p=...],
    [seed=..., offset=...], [method=...])`` -- the layout of
    :func:`specdec_kernels.verify_tree`:

    * ``target_logits`` float32 ``[B, N, V]`` (row ``i``: after the path root..i);
      ``tree_token_ids`` int64 ``[B, N]`` (node 0's is 0); ``parents`` int64 ``[B, N]``
      (the same tree for every request, ``parents[:, 0] == -1``);
    * mode ``"candidates"``: ``draft_probs=None`` and each node's children are its draft
      row's top tokens; ``"iid"`` / ``"without_replacement"``: ``draft_probs`` float32
      ``[B, N, V]`` (row ``i``: what node i's children were drawn from) and
      ``draft_sampling=<mode>``;
    * the declared ``params``, ``seed``/``offset``, ``method`` as for
      :func:`check_chain_verifier`;
    * returns ``(output_token_ids [B, N], accepted_nodes [B, N], ...)``: the accepted path's
      tokens then one correction or bonus token, and the path's nodes root first, both
      ``-1`` padded.

    Tests per configuration: output format (a root path carrying its nodes' tokens); the
    joint law of the emitted tokens completed by the target to depth + 1; each position's law
    given its prefix; ``num_accepted`` against its exact law (token-level rule; none is
    computed for traversal). Greedy, seed determinism and batch invariance as for chains.
    """
    started = time.perf_counter()
    _core.check_declared(draft_modes, DRAFT_MODES, "draft_modes")
    _core.check_declared(methods, METHODS, "methods")
    shape = TreeShape(parents)
    depth = shape.max_depth
    budget = _core.Budget(alpha, tv, power, samples, max_samples, batch_size, seed)
    plan = _core.plan_windows(verify, outputs=2, params=params, draft_modes=draft_modes,
                              methods=methods, depth=depth, vocab=vocab_size,
                              exact_acceptance=lambda m: m == "token", extra_tests=0,
                              budget=budget, seeded=seeded, per_request=per_request,
                              device=device)
    greedy, configs, tests = plan.greedy, plan.configs, plan.tests
    alpha_test, trials, pass_method = plan.alpha_test, plan.trials, plan.pass_method
    caller, gen = plan.caller, plan.gen
    instance = ChainInstance(vocab_size, depth, seed, plan.settings)
    plan_text = _core.plan_line(len(configs), trials, trials * len(configs),
                                2 * shape.nodes * vocab_size * 4, batch_size,
                                f"; {len(greedy) * len(draft_modes) * len(methods)} greedy "
                                f"configurations")
    report = Report(f"check_tree_verifier({_core.describe(verify)}): "
                    f"V={vocab_size}, parents={tuple(parents)}, {tests} statistical tests",
                    alpha, seed, plan_text)
    parents_t = torch.tensor(shape.parents, dtype=torch.int64)

    def q_table(mode):
        if mode == "candidates":
            return instance.draft_probs.double()
        return instance.q_table("probs", SamplingSetting())

    def make(method, mode, setting, batch, base):
        tokens, rows = _draw_tree(shape, q_table(mode), mode, vocab_size, batch, gen)
        kwargs = _core.per_request_kwargs(setting, batch, device, per_request)
        if mode == "candidates":
            kwargs["draft_probs"] = None
        else:
            kwargs.update(draft_probs=instance.draft_probs[rows], draft_sampling=mode)
        if seeded:
            seeds, offsets = _core.request_seeds(base, batch)
            kwargs.update(seed=seeds, offset=offsets)
        if pass_method:
            kwargs["method"] = method
        return [instance.target_logits[rows], tokens, parents_t.expand(batch, -1).contiguous()], kwargs

    for index, (method, mode, setting) in enumerate(configs):
        config = f"{method} {mode} {setting.label()}"
        args, kwargs = make(method, mode, setting, trials, seed * 1000 + index)
        ids, path = caller(args, kwargs, trials)
        if index == 0:
            first_call = (args, kwargs, [ids, path], config)
        good = _check_format(ids, path, args[1], args[2], vocab_size)
        report.results.append(_core.format_result(config, good, "root path, one token, -1"))
        p_table = _laws.processed_probs(instance.target_logits, setting)
        law = None
        if method == "token":
            law = _laws.tree_acceptance_law(p_table, q_table(mode), vocab_size, shape.parents,
                                            mode)
        report.results += _core.window_tests(
            ids[good][:, :depth + 1], p_table, vocab_size, depth, config, alpha_test, tv, gen,
            conditional="emitted" if method == "token" else "completed", acceptance_law=law)

    for method in methods:
        for mode in draft_modes:
            for setting in greedy:
                batch = min(trials, 4096)
                args, kwargs = make(method, mode, setting, batch, seed * 1000 + 777)
                ids, _ = caller(args, kwargs, batch)
                expected = _greedy_expected(shape, args[0], args[1])
                mismatches = int((ids[:, :shape.nodes] != expected).any(-1).sum())
                report.results.append(_core.exact_result("greedy arg-max", f"{method} {mode} greedy",
                                                         mismatches, batch, "the arg-max answer"))
    if seeded:
        report.results += _core.seed_tests(caller, trials, *first_call)
    report.runtime_s = time.perf_counter() - started
    return report
