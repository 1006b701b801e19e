"""SGLang's EAGLE trees (``retrive_*`` first-child / next-sibling lists, sglang 0.5.23) to and
from our ``parents``; each node's rank among its siblings. The layout is described in
:mod:`specdec_kernels.adapters.sglang`, which exports these names."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _cpu, _params
from ..tree_attention import _validate as _validate_parents

__all__ = ["EagleTree", "ParentTree", "tree_from_sglang", "tree_to_sglang", "sibling_rank"]


class EagleTree(NamedTuple):
    """SGLang's tree layout, each ``[bs, N]`` int64."""
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    candidates: torch.Tensor


class ParentTree(NamedTuple):
    """Our tree layout (contract section 4)."""
    parents: torch.Tensor         # [bs, N] int64, -1 for the root
    tree_token_ids: torch.Tensor  # [bs, N], the candidates as given


def tree_from_sglang(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                     candidates: torch.Tensor, *, validate: bool = True) -> ParentTree:
    r"""SGLang's first-child / next-sibling lists as ``parents`` and ``tree_token_ids``.

    Args:
        retrive_next_token: each node's first child, ``-1`` for a leaf.
            Shape ``(bs, N)``; int32 or int64.
        retrive_next_sibling: the next child of the same parent, ``-1`` at the end.
            Shape ``(bs, N)``; int32 or int64.
        candidates: each node's token (node 0's is ignored by verification).
            Shape ``(bs, N)``; int32 or int64.
        validate: check that every non-root node is reached by exactly one link, the root
            by none, and that parents come before children (one synchronisation).

    Returns:
        ParentTree(parents ``(bs, N)`` int64, tree_token_ids = ``candidates``). No host
        synchronisation without ``validate``: ``log2(N)`` pointer-jumping steps.

    >>> import torch
    >>> from specdec_kernels.adapters.sglang import tree_from_sglang
    >>> tree_from_sglang(torch.tensor([[1, 2, -1, 4, 5, -1]]),   # 0 -> {1, 3}, 1 -> 2, 3 -> 4 -> 5
    ...                  torch.tensor([[-1, 3, -1, -1, -1, -1]]),
    ...                  torch.tensor([[0, 1, 2, 3, 4, 5]])).parents
    tensor([[-1,  0,  1,  0,  3,  4]])
    """
    links = {"retrive_next_token": retrive_next_token,
             "retrive_next_sibling": retrive_next_sibling, "candidates": candidates}
    for name, index in links.items():
        _params.check_tensor(index, name, ndim=2, dtypes=_params.INDEX_DTYPES,
                             device=retrive_next_token.device)
        _params.check_shape(index, name, list(retrive_next_token.shape),
                            "[bs, N] like retrive_next_token")
    batch, nodes = retrive_next_token.shape
    if nodes < 1:
        raise ValueError(f"retrive_next_token: expected at least one node (the root), got "
                         f"shape {list(retrive_next_token.shape)}")
    fast = _cpu.sglang_parents(retrive_next_token, retrive_next_sibling)  # (CPU: one op)
    if fast is not None and (fast[1] or not validate):
        return ParentTree(fast[0], candidates)
    device = retrive_next_token.device
    node = torch.arange(nodes, device=device).expand(batch, nodes)
    sink = nodes  # one extra column takes the writes of "-1" (and of bad values)

    def targets(links: torch.Tensor) -> torch.Tensor:
        links = links.to(torch.int64)
        return torch.where((links >= 0) & (links < nodes), links, sink)

    first_child, next_sibling = targets(retrive_next_token), targets(retrive_next_sibling)
    parent_of_head = torch.full((batch, nodes + 1), -1, dtype=torch.int64, device=device)
    parent_of_head.scatter_(1, first_child, node)
    previous = torch.full((batch, nodes + 1), -1, dtype=torch.int64, device=device)
    previous.scatter_(1, next_sibling, node)
    # The head of each sibling list by pointer jumping: 2**steps >= N - 1 links.
    head = torch.where(previous[:, :nodes] >= 0, previous[:, :nodes], node)
    for _ in range(max(1, (nodes - 1).bit_length())):
        head = head.gather(1, head)
    parents = parent_of_head.gather(1, head)
    parents[:, 0] = -1
    if validate:
        _check_links(retrive_next_token, retrive_next_sibling, first_child, next_sibling,
                     parents)
    return ParentTree(parents, candidates)


def _check_links(retrive_next_token, retrive_next_sibling, first_child, next_sibling,
                 parents) -> None:
    batch, nodes = parents.shape
    node = torch.arange(nodes, device=parents.device)
    incoming = torch.zeros((batch, nodes + 1), dtype=torch.int64, device=parents.device)
    ones = torch.ones_like(first_child)
    incoming.scatter_add_(1, first_child, ones).scatter_add_(1, next_sibling, ones)
    incoming = incoming[:, :nodes]
    bad_range = [((x < -1) | (x >= nodes)) for x in (retrive_next_token, retrive_next_sibling)]
    bad_incoming = incoming != (node > 0).to(torch.int64)
    bad_order = (node > 0) & ((parents < 0) | (parents >= node))
    failed = torch.stack([bad_range[0].any(), bad_range[1].any(), bad_incoming.any(),
                          bad_order.any()]).tolist()
    for name, bad, links, flag in (("retrive_next_token", bad_range[0], retrive_next_token,
                                    failed[0]),
                                   ("retrive_next_sibling", bad_range[1], retrive_next_sibling,
                                    failed[1])):
        if flag:
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}: expected node indices in [-1, {nodes}) (-1: none), "
                             f"got {int(links[b, i])} at [{b}, {i}]")
    if failed[2]:
        b, i = (int(x) for x in bad_incoming.nonzero()[0])
        raise ValueError(f"retrive_next_token, retrive_next_sibling: expected one tree, every "
                         f"node but the root reached by exactly one link and the root by none; "
                         f"node {i} of request {b} is reached by {int(incoming[b, i])}")
    if failed[3]:
        b, i = (int(x) for x in bad_order.nonzero()[0])
        raise ValueError(f"retrive_next_token, retrive_next_sibling: expected parents before "
                         f"children (build_tree_kernel_efficient's order), got node {i} of "
                         f"request {b} under node {int(parents[b, i])}")


def tree_to_sglang(parents: torch.Tensor, tree_token_ids: torch.Tensor, *,
                   num_nodes=None, validate: bool = True) -> EagleTree:
    r"""``parents`` and ``tree_token_ids`` as SGLang's lists, children in increasing index.

    Args:
        parents: ``parents[b, 0] == -1``, ``0 <= parents[b, i] < i``. Shape ``(bs, N)``;
            int32 or int64.
        tree_token_ids: each node's token. Shape ``(bs, N)``; int32 or int64.
        num_nodes: int or ``(bs,)``: nodes ``>= num_nodes[b]`` are padding, left out of every
            list (their own lists are ``-1``). Default N.
        validate: check that ``parents`` is a tree (one synchronisation).

    Returns:
        EagleTree(retrive_index ``b * N + i``, retrive_next_token, retrive_next_sibling,
        candidates), each ``(bs, N)`` int64. Builds ``[bs, N, N]`` comparisons: for trees of
        up to a few hundred nodes.

    >>> import torch
    >>> from specdec_kernels.adapters.sglang import tree_to_sglang
    >>> tree = tree_to_sglang(torch.tensor([[-1, 0, 1, 0, 3, 4]]), torch.arange(6)[None])
    >>> tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist()
    ([[1, 2, -1, 4, 5, -1]], [[-1, 3, -1, -1, -1, -1]])
    """
    _params.check_tensor(parents, "parents", ndim=2, dtypes=_params.INDEX_DTYPES)
    _params.check_tensor(tree_token_ids, "tree_token_ids", dtypes=_params.INDEX_DTYPES,
                         device=parents.device)
    _params.check_shape(tree_token_ids, "tree_token_ids", list(parents.shape), "like parents")
    batch, nodes = parents.shape
    device = parents.device
    count = _params.per_request(num_nodes, "num_nodes", batch, device, torch.int64, nodes)
    if validate:
        _validate_parents(parents, count, None)
    node = torch.arange(nodes, device=device)
    parent = parents.to(torch.int64)
    real = (node > 0) & (node < count[:, None])                                    # [bs, N]
    # children[b, u, c]: c is a real child of u; siblings[b, c, s]: s is a later sibling of c.
    children = real[:, None, :] & (parent[:, None, :] == node[None, :, None])
    siblings = (real[:, None, :] & real[:, :, None] & (node[None, None, :] > node[None, :, None])
                & (parent[:, None, :] == parent[:, :, None]))
    none = torch.tensor(nodes, device=device)

    def first(mask: torch.Tensor) -> torch.Tensor:
        index = torch.where(mask, node, none).amin(-1)
        return torch.where(index == nodes, -1, index)

    retrive_index = torch.arange(batch, device=device)[:, None] * nodes + node
    return EagleTree(retrive_index, first(children), first(siblings),
                     tree_token_ids.to(torch.int64))


def sibling_rank(retrive_next_sibling: torch.Tensor) -> torch.Tensor:
    """Each node's position in its parent's child list (0 for the first child), by pointer
    jumping along the reversed ``retrive_next_sibling`` links (``log2 N`` steps)."""
    batch, nodes = retrive_next_sibling.shape
    device = retrive_next_sibling.device
    node = torch.arange(nodes, device=device).expand(batch, nodes)
    links = retrive_next_sibling.to(torch.int64)
    links = torch.where((links >= 0) & (links < nodes), links, nodes)
    previous = torch.full((batch, nodes + 1), -1, dtype=torch.int64, device=device)
    previous.scatter_(1, links, node)
    previous = previous[:, :nodes]
    rank = (previous >= 0).to(torch.int64)
    for _ in range(max(1, (nodes - 1).bit_length())):
        valid = previous >= 0
        safe = previous.clamp(min=0)
        rank = rank + torch.where(valid, rank.gather(1, safe), 0)
        previous = torch.where(valid, previous.gather(1, safe), -1)
    return rank
