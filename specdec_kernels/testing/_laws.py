"""The exact laws the toolkit tests against, in float64, independent of the code under test.

A *table* is a tiny language model: one row of logits for every prefix of length
``0..depth`` over a vocabulary of ``V`` tokens (shorter prefixes first, each length in
base-``V`` order), so a row depends on the drafted prefix and conditioning is tested.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingSetting:
    """One setting of the sampling parameters; ``None`` means not passed to the callable."""
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def kwargs(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if value is not None}

    def label(self) -> str:
        short = {"temperature": "T", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}
        return ",".join(f"{short[k]}={v}" for k, v in self.kwargs().items()) or "defaults"


def processed_probs(logits: torch.Tensor, setting: SamplingSetting) -> torch.Tensor:
    """The processed target distribution (temperature, top-k, min-p, softmax, top-p) in float64.

    Written from the contract's definition (sections 1 and 8) without the package's code, so
    the toolkit checks the package rather than itself."""
    z = logits.double().nan_to_num(nan=-math.inf, posinf=math.inf)
    vocab = z.shape[-1]
    if setting.greedy:
        best = z.max(-1, keepdim=True).values
        first = torch.where(z == best, torch.arange(vocab), vocab).min(-1, keepdim=True).values
        return torch.zeros_like(z).scatter_(-1, first, 1.0)
    z = z / (1.0 if setting.temperature is None else setting.temperature)
    k = setting.top_k or 0
    if 0 < k < vocab:
        kth = z.sort(-1, descending=True).values[..., k - 1:k]
        z = torch.where(z >= kth, z, -math.inf)
    if setting.min_p:
        z = torch.where(z >= z.max(-1, keepdim=True).values + math.log(setting.min_p), z,
                        -math.inf)
    probs = torch.softmax(z, -1)
    top_p = 1.0 if setting.top_p is None else setting.top_p
    if top_p < 1.0:
        ordered = probs.sort(-1, descending=True).values
        reached = ordered.cumsum(-1) >= top_p
        first = reached.to(torch.int64).argmax(-1, keepdim=True)  # smallest set reaching top_p
        tau = ordered.gather(-1, first)
        probs = torch.where(probs >= tau, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def near_threshold(logits: torch.Tensor, setting: SamplingSetting, margin: float = 1e-4) -> bool:
    """True when a row's kept set changes under a relative nudge of top-p / min-p: float32
    kernels may then decide differently from float64, so the toolkit redraws its tables."""
    base = processed_probs(logits, setting) > 0
    for factor in (1 - margin, 1 + margin):
        nudged = SamplingSetting(setting.temperature, setting.top_k,
                                 None if setting.top_p is None else min(1.0, setting.top_p * factor),
                                 None if not setting.min_p else setting.min_p * factor)
        if not torch.equal(processed_probs(logits, nudged) > 0, base):
            return True
    return False


def num_prefixes(vocab: int, depth: int) -> int:
    return sum(vocab ** length for length in range(depth + 1))


def prefix_index(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Table row of each prefix ``tokens [..., L]`` (int64)."""
    length = tokens.shape[-1]
    index = torch.zeros(tokens.shape[:-1], dtype=torch.int64)
    for j in range(length):
        index = index * vocab + tokens[..., j].long()
    return index + num_prefixes(vocab, length - 1) if length else index


def all_prefixes(vocab: int, length: int) -> torch.Tensor:
    """Every sequence of ``length`` tokens in base-``vocab`` order, ``[V**length, length]``."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=length)),
                        dtype=torch.int64).reshape(vocab ** length, length)


def window_law(p_table: torch.Tensor, vocab: int, length: int) -> torch.Tensor:
    """The target's autoregressive law of ``length`` tokens, flattened in base-``vocab`` order."""
    law = torch.ones(1, dtype=torch.float64)
    for j in range(length):
        rows = p_table[num_prefixes(vocab, j - 1) if j else 0:num_prefixes(vocab, j)]
        law = (law[:, None] * rows).reshape(-1)
    return law


def one_hot_rows(logits: torch.Tensor) -> torch.Tensor:
    """A deterministic drafter's q: one-hot at the arg-max (lowest id among ties)."""
    return processed_probs(logits, SamplingSetting(temperature=0.0))


def chain_acceptance_law(p_table: torch.Tensor, q_table: torch.Tensor, vocab: int,
                         num_drafts: int, method: str) -> torch.Tensor:
    """Exact law of ``num_accepted`` (``[K+1]``) for one chain round, every request drafting K.

    ``"token"``: ``P(A >= j) = sum over x_1..x_j of prod_i min(p_i(x_i), q_i(x_i))``.
    ``"block"``: per draft sequence, ``P(tau = a) = h_a prod_{j > a} (1 - h_j)`` with the
    weights ``w_j`` and ``h_j`` of block verification (Sun et al.; ``h_0 = 1``)."""
    drafts = all_prefixes(vocab, num_drafts)
    law = torch.zeros(num_drafts + 1, dtype=torch.float64)
    rows = [p_table[prefix_index(drafts[:, :j], vocab)] for j in range(num_drafts + 1)]
    q_rows = [q_table[prefix_index(drafts[:, :j], vocab)] for j in range(num_drafts + 1)]
    q_seq = torch.ones(len(drafts), dtype=torch.float64)
    for j in range(num_drafts):
        q_seq = q_seq * q_rows[j].gather(1, drafts[:, j:j + 1])[:, 0]
    if method == "token":
        survive = [torch.ones_like(q_seq)]
        for j in range(num_drafts):
            pj = rows[j].gather(1, drafts[:, j:j + 1])[:, 0]
            qj = q_rows[j].gather(1, drafts[:, j:j + 1])[:, 0]
            survive.append(survive[-1] * torch.where(qj > 0, torch.clamp(pj / qj, max=1.0), 0.0))
        for a in range(num_drafts + 1):
            stop = survive[a] - survive[a + 1] if a < num_drafts else survive[a]
            law[a] = (q_seq * stop).sum()
        return law
    if method != "block":
        raise ValueError(f"method: expected 'token' or 'block', got {method!r}")
    weight = torch.ones_like(q_seq)
    h = [torch.ones_like(q_seq)]
    for j in range(1, num_drafts + 1):
        pj = rows[j - 1].gather(1, drafts[:, j - 1:j])[:, 0]
        qj = q_rows[j - 1].gather(1, drafts[:, j - 1:j])[:, 0]
        weight = torch.where(qj > 0, torch.clamp(weight * pj / qj, max=1.0), 0.0)
        if j == num_drafts:
            h.append(weight)
            break
        residual = (weight[:, None] * rows[j] - q_rows[j]).clamp(min=0).sum(-1)
        denominator = residual + (1 - weight)
        h.append(torch.where(denominator > 0, residual / denominator.clamp(min=1e-300), 1.0))
    for a in range(num_drafts + 1):
        prob = h[a].clone()
        for j in range(a + 1, num_drafts + 1):
            prob = prob * (1 - h[j])
        law[a] = (q_seq * prob).sum()
    return law


def children_draws(q_row: torch.Tensor, count: int, mode: str):
    """Every way a node's ``count`` children are drawn from ``q_row``: ``[(tokens, prob)]``."""
    vocab = q_row.shape[0]
    if mode == "candidates":
        order = sorted(range(vocab), key=lambda t: (-float(q_row[t]), t))
        return [(tuple(order[:count]), 1.0)]
    draws = []
    for tokens in itertools.product(range(vocab), repeat=count):
        prob, remaining = 1.0, q_row.clone()
        for token in tokens:
            mass = float(remaining.sum())
            prob *= float(remaining[token]) / mass if mass > 0 else 0.0
            if mode == "without_replacement":
                remaining[token] = 0.0
        if prob > 0:
            draws.append((tokens, prob))
    return draws


def tree_acceptance_law(p_table: torch.Tensor, q_table: torch.Tensor, vocab: int,
                        parents: list, mode: str) -> torch.Tensor:
    """Exact law of ``num_accepted`` for token-level (multi-draft) tree verification, by
    recursion over nodes: the children of a node are drawn independently of everything the
    verifier decided above it, so each accepted child starts a fresh round."""
    children = [[c for c in range(1, len(parents)) if parents[c] == u] for u in range(len(parents))]
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    max_depth = max(depth)

    def law_at(node: int, path: tuple) -> torch.Tensor:
        law = torch.zeros(max_depth + 1, dtype=torch.float64)
        kids = children[node]
        if not kids:
            law[0] = 1.0
            return law
        row = int(prefix_index(torch.tensor([path], dtype=torch.int64), vocab)[0])
        p_row, q_row = p_table[row], q_table[row]
        for tokens, draw_prob in children_draws(q_row, len(kids), mode):
            p_cur, q_cur, reach = p_row.clone(), q_row.clone(), draw_prob
            if mode == "candidates":
                q_cur = torch.zeros_like(q_row)
            for child, token in zip(kids, tokens):
                if mode == "candidates":
                    q_cur = torch.zeros_like(q_row)
                    q_cur[token] = 1.0
                ratio = min(1.0, float(p_cur[token]) / float(q_cur[token])) if q_cur[token] > 0 else 0.0
                law[1:] += reach * ratio * law_at(child, path + (token,))[:-1]
                reach *= 1 - ratio
                residual = (p_cur - q_cur).clamp(min=0)
                if residual.sum() > 0:
                    p_cur = residual / residual.sum()
                if mode == "without_replacement":
                    q_cur = q_cur.clone()
                    q_cur[token] = 0.0
                    if q_cur.sum() > 0:
                        q_cur = q_cur / q_cur.sum()
            law[0] += reach
        return law

    return law_at(0, ())
