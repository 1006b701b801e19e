"""Reference tree verification (contract section 4), vectorised over the batch.

One pass over the node indices ``i = 1..N-1`` visits every node in an order compatible with the
walk: a node's children all have larger indices than the node, and siblings are tested in
increasing index. Each request keeps its current node and the current (residual) target
distribution of that node; node ``i`` is tested when its parent is the request's current node.
An accepted child becomes the current node, so the children of the rest of the old current
node's children are never tested. The work is ``O(N * B * V)`` in the worst case, and only the
rows of requests that rejected a child under i.i.d. / without-replacement drafts are touched.

State per request (unnormalised row and its mass, so a chain-shaped tree does the same float
operations as ``verify_chain``: the first test at a node divides by a mass of exactly 1):
  * ``p_raw``, ``p_mass``: the current target distribution is ``p_raw / p_mass``.
  * ``q_raw``, ``q_mass``: the current draft distribution (i.i.d. and without replacement).

Choices where the contract is silent (see docs/tree.md):
  * i.i.d. / without replacement: a rejection whose residual ``max(p - q, 0)`` has no mass left
    (only through rounding: the exact algorithm would have accepted with probability 1) leaves
    ``p`` unchanged -- for a chain this is the contract's fallback to ``p_j``. The draft update
    of without-replacement sampling (``x`` removed from ``q``) always applies.
  * Deterministic candidates: a rejected token is removed and its probability subtracted from
    the mass (``1 - sum`` of the removed probabilities, a running float subtraction that the
    kernels reproduce from gathered values). A token already removed (a duplicate sibling) is
    never accepted. If the removals leave no mass, the correction is the last removed token with
    positive probability -- the only token the distribution before that removal had, so this is
    again "fall back to the distribution before the rejection that emptied it".
  * A draft distribution exhausted by without-replacement removals counts as ``q = 0``.
  * Nodes that are not part of a tree (``parents`` out of range, token ids outside ``[0, V)``,
    index ``>= num_nodes``; only reachable with ``validate=False``) are ignored like padding.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _rng
from .chain import rejection_weight, sequence_weight, weighted_residual, without_distribution
from .sampling import processed_probs, race, token_logprobs

DRAFT_SAMPLING = ("iid", "without_replacement")
METHODS = ("token", "traversal")


class TreeWalk(NamedTuple):
    """The walk's result before the final sample (what the exactness tests inspect)."""
    accepted_nodes: torch.Tensor  # [B, N] int64: root 0, then accepted nodes, then -1
    num_accepted: torch.Tensor    # [B] int64
    final_weights: torch.Tensor   # [B, V]: unnormalised distribution of the final token
    tested: torch.Tensor          # [B, N] bool: the nodes whose acceptance was tested
    accept_probability: torch.Tensor  # [B, N]: P(u_i accepts node i) for the tested nodes, else 0


def real_nodes(tree_token_ids: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
               vocab: int) -> torch.Tensor:
    """bool ``[B, N]``: non-root nodes that take part in the walk (not padding, valid parent and
    token id)."""
    nodes = parents.shape[1]
    index = torch.arange(nodes, device=parents.device)
    live_nodes = num_nodes.to(torch.int64).clamp(1, nodes)
    par = parents.to(torch.int64)
    ids = tree_token_ids.to(torch.int64)
    real = (index < live_nodes[:, None]) & (par >= 0) & (par < index) & (ids >= 0) & (ids < vocab)
    real[:, 0] = False
    return real


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return rows.gather(-1, index[:, None])[:, 0]


def walk_tree(p: torch.Tensor, q: Optional[torch.Tensor], tree_token_ids: torch.Tensor,
              parents: torch.Tensor, num_nodes: torch.Tensor, draft_sampling: str,
              greedy: torch.Tensor, accept_uniforms: torch.Tensor) -> TreeWalk:
    """The tree walk for processed target probabilities ``p`` ``[B, N, V]``, draft
    distributions ``q`` ``[B, N, V]`` (None: deterministic candidates), greedy flags ``[B]`` and
    the acceptance uniforms ``[B, N]`` (column ``i`` tests node ``i``)."""
    batch, nodes, vocab = p.shape
    device = p.device
    real = real_nodes(tree_token_ids, parents, num_nodes, vocab)
    par = parents.to(torch.int64)
    ids = torch.where(real, tree_token_ids.to(torch.int64), 0)
    wor = q is not None and draft_sampling == "without_replacement"

    current = torch.zeros(batch, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    p_raw = p[:, 0].clone()
    p_mass = torch.ones(batch, dtype=p.dtype, device=device)
    q_raw = None if q is None else q[:, 0].clone()
    q_mass = torch.ones(batch, dtype=p.dtype, device=device)
    last_removed = torch.full((batch,), -1, dtype=torch.int64, device=device)
    was_tested = torch.zeros(batch, nodes, dtype=torch.bool, device=device)
    accept_probability = torch.zeros(batch, nodes, dtype=p.dtype, device=device)

    for i in range(1, nodes):
        tested = real[:, i] & (par[:, i] == current)
        if not bool(tested.any()):
            continue
        token = ids[:, i]
        p_token = _gather(p_raw, token)
        target = torch.where(p_mass > 0, p_token / p_mass,
                             torch.where(p_token > 0, torch.inf, 0.0))
        if q is None:
            draft = torch.ones_like(target)
        else:
            draft = _gather(q_raw, token)
            if wor:
                draft = torch.where(q_mass > 0, draft / q_mass, 0.0)
        u = accept_uniforms[:, i]
        # Greedy p is one-hot at the arg-max, so p(x) > 0 means x is the arg-max.
        accept = tested & torch.where(greedy, p_token > 0, u * draft < target)
        rejected = tested & ~accept & ~greedy
        was_tested[:, i] = tested
        # The measure of the uniforms in [0, 1) that accept: what the exactness tests integrate.
        ratio = torch.where(draft > 0, (target / draft).clamp(max=1.0), (target > 0).to(p.dtype))
        accept_probability[:, i] = torch.where(
            tested, torch.where(greedy, (p_token > 0).to(p.dtype), ratio), 0.0)

        if bool(rejected.any()):
            r = rejected.nonzero()[:, 0]
            if q is None:
                _remove_token(p_raw, p_mass, last_removed, r, token[r], p_token[r])
            else:
                p_raw, p_mass = _residual_update(p_raw, p_mass, q_raw, q_mass, r, wor)
                if wor:
                    q_removed = _gather(q_raw[r], token[r])
                    q_mass[r] = q_mass[r] - q_removed
                    q_raw[r, token[r]] = 0.0

        if bool(accept.any()):
            a = accept.nonzero()[:, 0]
            current[a] = i
            num_accepted[a] += 1
            accepted_nodes[a, num_accepted[a]] = i
            p_raw[a] = p[a, i]
            p_mass[a] = 1.0
            if q is not None:
                q_raw[a] = q[a, i]
                q_mass[a] = 1.0
            last_removed[a] = -1

    if q is None:
        # Removals left no mass (rounding only): the last removed token was all that remained.
        emptied = ~(p_raw > 0).any(-1) & (last_removed >= 0) & ~greedy
        if bool(emptied.any()):
            e = emptied.nonzero()[:, 0]
            p_raw[e] = 0.0
            p_raw[e, last_removed[e]] = 1.0
    return TreeWalk(accepted_nodes, num_accepted, p_raw, was_tested, accept_probability)


def _remove_token(p_raw, p_mass, last_removed, r, token, p_token) -> None:
    """Deterministic candidates: remove the rejected ``token`` from ``p`` for the requests ``r``
    (in place); its probability leaves the mass."""
    p_mass[r] = p_mass[r] - p_token
    p_raw[r, token] = 0.0
    last_removed[r] = torch.where(p_token > 0, token, last_removed[r])


def _residual_update(p_raw, p_mass, q_raw, q_mass, r, wor: bool):
    """``p <- norm(max(p - q, 0))`` for the requests ``r`` that rejected a child under i.i.d. or
    without-replacement drafts; a residual with no mass left keeps ``p`` (see module doc)."""
    draft = q_raw[r]
    if wor:
        draft = torch.where(q_mass[r, None] > 0, draft / q_mass[r, None], 0.0)
    residual = (p_raw[r] / p_mass[r, None] - draft).clamp(min=0)
    has_mass = (residual > 0).any(-1)
    p_raw[r] = torch.where(has_mass[:, None], residual, p_raw[r])
    p_mass[r] = torch.where(has_mass, residual.sum(-1), p_mass[r])
    return p_raw, p_mass


def assemble(tree_token_ids: torch.Tensor, accepted_nodes: torch.Tensor,
             num_accepted: torch.Tensor, final_token: torch.Tensor):
    """``(output_token_ids [B, N] int32, accepted_nodes [B, N] int32, num_accepted [B] int32)``."""
    batch, nodes = tree_token_ids.shape
    path = accepted_nodes[:, 1:].to(torch.int64)
    tokens = tree_token_ids.to(torch.int64).gather(1, path.clamp(min=0))
    out = torch.full((batch, nodes), -1, dtype=torch.int64, device=tree_token_ids.device)
    out[:, :nodes - 1] = torch.where(path >= 0, tokens, -1)
    out.scatter_(1, num_accepted.to(torch.int64)[:, None], final_token.to(torch.int64)[:, None])
    return out.to(torch.int32), accepted_nodes.to(torch.int32), num_accepted.to(torch.int32)


# --- Traversal verification (contract section 12) ------------------------------------------

def euler_tour(parents: torch.Tensor, reachable: torch.Tensor) -> torch.Tensor:
    """``[B, 2(N-1)]`` int64: the depth-first tour of each request's tree (children in
    increasing node index), ``v`` when the walk enters node ``v`` and ``v + N`` when it leaves
    it (all of ``v``'s subtree done), ``-1`` past the end. Only ``reachable`` nodes take part.

    From subtree sizes and pre-order ranks: node ``v`` is entered at step
    ``2 pre(v) - depth(v) - 1`` (``pre(v) - 1`` entries and ``pre(v) - depth(v)`` exits before
    it) and left ``2 size(v) - 1`` steps later.
    """
    batch, nodes = parents.shape
    device = parents.device
    par = parents.to(torch.int64).clamp(0, nodes - 1)
    size = reachable.to(torch.int64)
    size[:, 0] = 1
    for i in range(nodes - 1, 0, -1):
        size.scatter_add_(1, par[:, i:i + 1], torch.where(reachable[:, i:i + 1], size[:, i:i + 1], 0))
    pre = torch.zeros(batch, nodes, dtype=torch.int64, device=device)
    depth = torch.zeros_like(pre)
    next_slot = torch.ones_like(pre)  # pre-order rank of the next child, relative to its parent
    for i in range(1, nodes):
        parent = par[:, i:i + 1]
        pre[:, i:i + 1] = pre.gather(1, parent) + next_slot.gather(1, parent)
        depth[:, i:i + 1] = depth.gather(1, parent) + 1
        next_slot.scatter_add_(1, parent, torch.where(reachable[:, i:i + 1], size[:, i:i + 1], 0))
    steps = 2 * (nodes - 1)
    enter = torch.where(reachable, 2 * pre - depth - 1, steps)
    leave = torch.where(reachable, enter + 2 * size - 1, steps)
    node = torch.arange(nodes, device=device).expand(batch, nodes)
    tour = torch.full((batch, steps + 1), -1, dtype=torch.int64, device=device)
    tour.scatter_(1, enter, node)
    tour.scatter_(1, leave, node + nodes)
    return tour[:, :steps]


def reachable_nodes(real: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Real nodes whose every ancestor is real (a subtree under a node that is not part of the
    tree -- bad id or parent, with ``validate=False`` -- is cut off with it)."""
    reach = real.clone()
    par = parents.to(torch.int64)
    for i in range(1, real.shape[1]):
        parent = par[:, i].clamp(0, real.shape[1] - 1)
        reach[:, i] &= (parent == 0) | reach.gather(1, parent[:, None])[:, 0]
    return reach


def _current_draft(q_raw, q_mass, wor: bool):
    """The law of a node's next child: ``q`` (i.i.d.) or ``q`` with the drafted-and-rejected
    tokens removed, renormalised (without replacement; 0 once exhausted)."""
    if not wor:
        return q_raw
    return torch.where(q_mass[..., None] > 0, q_raw / q_mass[..., None], 0.0)


def traversal_final_weights(p_raw: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The final token's unnormalised law at the accepted node: its current distribution
    ``p_raw`` (a residual after a child's rejection; ``p``, its original row, is unused)."""
    return p_raw


def traverse_tree(p: torch.Tensor, q: torch.Tensor, tree_token_ids: torch.Tensor,
                  parents: torch.Tensor, num_nodes: torch.Tensor, draft_sampling: str,
                  greedy: torch.Tensor, accept_uniforms: torch.Tensor) -> TreeWalk:
    """Traversal verification (Weng et al., NeurIPS 2025), arguments as :func:`walk_tree`
    (``q`` required). Greedy requests take :func:`walk_tree`'s answer.

    The walk follows the depth-first tour: entering node ``v`` sets
    ``w_v = min(1, w_u P_u(x_v) / Q_u(x_v))`` from its parent ``u``'s current state (the lazy
    form of "recompute w below u's remaining children": a subtree's w is needed only once the
    walk enters it). Leaving ``v`` (every child rejected, or none) tests it with ``u_v``:
    ``u_v < w_v`` after a child's rejection, ``u_v Q_u(x_v) < w_u P_u(x_v)`` otherwise (the
    same measure, in the token rule's float form). Accepted: emit its path and a sample of
    ``P_v``. Rejected: ``S = sum(max(w_u P_u - Q_u, 0))``, ``P_u <- norm(max(w_u P_u - Q_u,
    0))`` (kept when ``S = 0``: then ``w_u`` becomes 0, or the rejection had probability 0),
    ``w_u <- S / (S + 1 - w_u)``, and without replacement ``x_v`` leaves ``Q_u``. No node
    accepted: a sample of the root's ``P`` (``w_root`` stays 1: the root is never rejected).
    ``P`` is kept unnormalised with its mass, as in :func:`walk_tree`, so a chain-shaped tree
    does block verification's float operations.
    """
    batch, nodes, vocab = p.shape
    device = p.device
    wor = draft_sampling == "without_replacement"
    reach = reachable_nodes(real_nodes(tree_token_ids, parents, num_nodes, vocab), parents)
    par = parents.to(torch.int64).clamp(0, nodes - 1)
    ids = torch.where(reach, tree_token_ids.to(torch.int64), 0)
    tour = euler_tour(parents, reach)
    has_children = torch.zeros(batch, nodes, dtype=torch.int64, device=device).scatter_add_(
        1, par, reach.to(torch.int64)) > 0

    p_raw = p.clone()
    p_mass = torch.ones(batch, nodes, dtype=p.dtype, device=device)
    q_raw = q.to(p.dtype).clone() if wor else q.to(p.dtype)
    q_mass = torch.ones(batch, nodes, dtype=p.dtype, device=device)
    w = torch.ones(batch, nodes, dtype=p.dtype, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    tested = torch.zeros(batch, nodes, dtype=torch.bool, device=device)
    accept_probability = torch.zeros(batch, nodes, dtype=p.dtype, device=device)

    def parent_state(r, v):
        u = par[r, v]
        token = ids[r, v]
        target = p_raw[r, u, token] / p_mass[r, u]
        draft = _current_draft(q_raw[r, u], q_mass[r, u], wor).gather(-1, token[:, None])[:, 0]
        return u, token, target, draft

    for step in range(tour.shape[1]):
        event = tour[:, step]
        active = (event >= 0) & ~done
        if not bool(active.any()):
            continue
        entering = active & (event < nodes)
        if bool(entering.any()):
            r = entering.nonzero()[:, 0]
            v = event[r]
            u, _, target, draft = parent_state(r, v)
            w[r, v] = sequence_weight(w[r, u], target, draft)
        leaving = active & (event >= nodes)
        if not bool(leaving.any()):
            continue
        r = leaving.nonzero()[:, 0]
        v = event[r] - nodes
        u, token, target, draft = parent_state(r, v)
        uniform = accept_uniforms[r, v]
        passed = torch.where(has_children[r, v], uniform < w[r, v],
                             uniform * draft < w[r, u] * target)
        tested[r, v] = True
        accept_probability[r, v] = w[r, v]
        a, rej = r[passed], r[~passed]
        done[a] = True
        accepted[a] = v[passed]
        if len(rej):
            v_rej, u_rej, token_rej = v[~passed], u[~passed], token[~passed]
            p_row = p_raw[rej, u_rej] / p_mass[rej, u_rej][:, None]
            q_row = _current_draft(q_raw[rej, u_rej], q_mass[rej, u_rej], wor)
            residual = weighted_residual(w[rej, u_rej][:, None], p_row, q_row)
            mass = residual.sum(-1)
            has_mass = (residual > 0).any(-1)
            w[rej, u_rej] = rejection_weight(mass, w[rej, u_rej])
            p_raw[rej, u_rej] = torch.where(has_mass[:, None], residual, p_raw[rej, u_rej])
            p_mass[rej, u_rej] = torch.where(has_mass, mass, p_mass[rej, u_rej])
            if wor:
                q_mass[rej, u_rej] = q_mass[rej, u_rej] - q_raw[rej, u_rej, token_rej]
                q_raw[rej, u_rej, token_rej] = 0.0

    # The accepted node's path, root first: its ancestors by parent chasing.
    up = [accepted]
    while bool((up[-1] > 0).any()):
        up.append(torch.where(up[-1] > 0, par.gather(1, up[-1][:, None])[:, 0], 0))
    up = torch.stack(up, 1)  # [B, L]: the accepted node, its parent, ..., the root, then 0s
    num_accepted = (up > 0).sum(-1)
    level = torch.arange(nodes, device=device)
    source = (num_accepted[:, None] - level).clamp(0, up.shape[1] - 1)
    path = torch.where(level <= num_accepted[:, None], up.gather(1, source), -1)
    final = traversal_final_weights(
        p_raw.gather(1, accepted[:, None, None].expand(batch, 1, vocab))[:, 0],
        p.gather(1, accepted[:, None, None].expand(batch, 1, vocab))[:, 0])
    walk = TreeWalk(path, num_accepted, final, tested, accept_probability)
    if bool(greedy.any()):
        token_walk = walk_tree(p, q, tree_token_ids, parents, num_nodes, draft_sampling, greedy,
                               accept_uniforms)
        walk = TreeWalk(*(torch.where(greedy.view((batch,) + (1,) * (mine.dim() - 1)), theirs, mine)
                          for mine, theirs in zip(walk, token_walk)))
    return walk


def verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor, parents: torch.Tensor,
                draft_probs: Optional[torch.Tensor], draft_sampling: str, num_nodes: torch.Tensor,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seed: torch.Tensor, offset: torch.Tensor, min_p: Optional[torch.Tensor] = None,
                token_bitmask: Optional[torch.Tensor] = None,
                return_logprobs: Optional[str] = None, method: str = "token"):
    """Returns ``(output_token_ids [B, N] int32, accepted_nodes [B, N] int32,
    num_accepted [B] int32, logprobs)``, ``logprobs`` float32 ``[B, N]`` when
    ``return_logprobs`` is set, else None. Per-request arguments are ``[B]`` tensors (parsed
    by the public layer); ``token_bitmask`` ``[B, N, W]``; ``method`` ``"token"`` or
    ``"traversal"`` (which needs ``draft_probs``). Computation is in float32 (float64
    for float64 logits, which the exactness tests use)."""
    batch, nodes, vocab = target_logits.shape
    device = target_logits.device
    p = processed_probs(target_logits, temperature, top_k, top_p, min_p,
                        token_bitmask)  # [B, N, V]
    q = None if draft_probs is None else draft_probs.to(p.dtype)
    node = torch.arange(nodes, device=device)
    # ACCEPT position = the node tested; a chain's draft j is node j.
    u = _rng.uniform(seed[:, None], offset[:, None], node, _rng.PURPOSE_ACCEPT)
    walk = (traverse_tree if method == "traversal" else walk_tree)(
        p, q, tree_token_ids, parents, num_nodes, draft_sampling, temperature == 0, u)
    # RESAMPLE position = the node whose row the final token is drawn from.
    current = walk.accepted_nodes.gather(1, walk.num_accepted[:, None])[:, 0]
    final_token = race(walk.final_weights, seed, offset, current, _rng.PURPOSE_RESAMPLE)
    final_token = without_distribution(final_token, p, current)
    out, path, accepted = assemble(tree_token_ids, walk.accepted_nodes, walk.num_accepted,
                                   final_token)
    logprobs = None
    if return_logprobs is not None:
        # Output position m was emitted at accepted_nodes[m]: the parent row of the m-th
        # accepted node, or the last accepted node's row for the final token.
        logprobs = token_logprobs(target_logits, p, path.clamp(min=0), out, temperature == 0,
                                  return_logprobs)
    return out, path, accepted, logprobs
