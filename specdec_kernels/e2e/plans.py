"""A step's drafts as the loop and the verify ops see them (:class:`DraftPlan`), and the
shapes they come in: chains (:func:`chain_plan`) and fixed-branching trees
(:class:`TreeShape`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

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
    accepted_nodes: Optional[torch.Tensor] = None  # filled by verification (trees)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def tree_tokens(self) -> torch.Tensor:
        root = torch.full_like(self.tokens[:, :1], -1)
        return torch.cat([root, self.tokens], 1)

    def num_drafted(self, row: int) -> int:
        """Most draft tokens the request can accept this step."""
        return self.tree_depth if self.is_tree else int(self.num_draft[row])

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
