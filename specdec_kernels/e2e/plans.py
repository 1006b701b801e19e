"""A step's drafts as the loop and the verify ops see them (:class:`DraftPlan`), and the
shapes they come in: chains (:func:`chain_plan`), fixed-branching trees
(:class:`TreeShape`) and trees of any shape with deterministic candidates
(:func:`deterministic_tree_plan`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import specdec_kernels as sk

from .model import chain_visibility


@dataclass
class DraftPlan:
    """One step's drafts for the live batch. Node 0 is the pending token (the root);
    ``tokens[:, i - 1]`` is node ``i``'s (``-1``: padding)."""
    tokens: torch.Tensor                     # [B, N-1]
    visible: torch.Tensor                    # [B, N, N] node j visible to node i
    depth: torch.Tensor                      # [B, N]
    num_draft: Optional[torch.Tensor] = None  # chain: [B] drafts per request
    draft_logits: Optional[torch.Tensor] = None  # chain: [B, K, V] (None: one-hot q)
    parents: Optional[torch.Tensor] = None   # tree: [B, N]
    num_nodes: Optional[torch.Tensor] = None  # tree: [B]
    draft_probs: Optional[torch.Tensor] = None  # tree: [B, N, V] (None: deterministic)
    draft_sampling: str = "iid"
    tree_depth: int = 0
    depths: Optional[list] = None  # tree: per request, its deepest node (default tree_depth)
    accepted_nodes: Optional[torch.Tensor] = None  # filled by verification (trees)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def tree_tokens(self) -> torch.Tensor:
        root = self.tokens.new_full((self.tokens.shape[0], 1), -1)
        return torch.cat([root, self.tokens], 1)

    def num_drafted(self, row: int) -> int:
        """Most draft tokens the request can accept this step."""
        if self.is_tree:
            return self.tree_depth if self.depths is None else self.depths[row]
        return int(self.num_draft[row])

    def drafted_by_depth(self, row: int) -> list[int]:
        return [1] * self.num_drafted(row)


def chain_plan(tokens: torch.Tensor, num_draft: torch.Tensor,
                draft_logits: Optional[torch.Tensor] = None) -> DraftPlan:
    batch, k = tokens.shape
    visible, depth = chain_visibility(batch, k + 1, tokens.device)
    return DraftPlan(tokens=tokens, visible=visible, depth=depth, num_draft=num_draft,
                     draft_logits=draft_logits)


class TreeShape:
    """A tree with ``branching[d]`` children per node at depth ``d``, nodes in level order."""

    def __init__(self, branching: Sequence[int]):
        self.branching = tuple(int(w) for w in branching)
        if not self.branching or min(self.branching) < 1:
            raise ValueError(f"tree: expected children per depth >= 1, got {branching}")
        parents, levels, level = [-1], [(0, 1)], [0]
        for width in self.branching:
            nxt = []
            for parent in level:
                for _ in range(width):
                    nxt.append(len(parents))
                    parents.append(parent)
            levels.append((nxt[0], nxt[-1] + 1))
            level = nxt
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.levels = levels  # (first node, end) per depth
        self.num_nodes = len(parents)


def deterministic_tree_plan(trees: Sequence[tuple[Sequence[int], Sequence[int]]],
                            kv_lens: torch.Tensor) -> DraftPlan:
    """The plan of one tree per request, ``(tokens, parents)`` with the root first (its
    token ignored, parent ``-1``; ``parents[i] < i``), padded to the largest; no
    ``draft_probs``: ``sk.verify_tree`` treats the children as deterministic candidates
    (an n-gram's one-hot ``q``)."""
    width = max(len(t) for t, _ in trees)
    batch = len(trees)
    tokens = torch.full((batch, width), -1, dtype=torch.long)
    parents = torch.zeros((batch, width), dtype=torch.long)  # padding: ignored
    depths = []
    for b, (node_tokens, node_parents) in enumerate(trees):
        n = len(node_tokens)
        tokens[b, 1:n] = torch.tensor(list(node_tokens[1:]), dtype=torch.long)
        parents[b, :n] = torch.tensor(list(node_parents), dtype=torch.long)
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[node_parents[i]] + 1
        depths.append(max(depth))
    device = kv_lens.device
    parents = parents.to(device)
    num_nodes = torch.tensor([len(t) for t, _ in trees], dtype=torch.long, device=device)
    attention = sk.build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=kv_lens)
    return DraftPlan(tokens=tokens[:, 1:].to(device), visible=attention.mask,
                     depth=attention.depth.to(torch.long), parents=parents,
                     num_nodes=num_nodes, tree_depth=max(depths), depths=depths)
