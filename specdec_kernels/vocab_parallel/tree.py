"""``verify_tree`` on vocabulary shards (contract sections 4, 12 and 17): the walks of
``reference/tree.py`` with each rank holding its columns of every row.

The walk is sequential over the nodes (a rejection changes the current row), so its rounds
grow with ``N``, never with ``V``: per tested node one all-gather of the owners' ``p(x)``,
``q(x)`` (``[B, 2]``), and after an i.i.d. / without-replacement rejection one of the
residual's partial mass and any-positive flag (``[B, 2]``). Then the race, and one round of
the emitted tokens' values for the log-probabilities. Deterministic candidates: a removed
token's probability comes from its owner; the emptied-row fallback rides the race's flags.
"""
from __future__ import annotations

import torch

from .. import _params, _rng
from ..reference.chain import rejection_weight, sequence_weight, weighted_residual
from ..reference.sampling import allowed_tokens
from ..reference.tree import (DRAFT_SAMPLING, METHODS, assemble, euler_tour, real_nodes,
                              reachable_nodes)
from . import _parse
from ._race import Layout, sharded_race
from ._rows import Block, process
from .chain import _filters, _rows


class _Owner:
    """Reads of single entries of shard rows by global id: the owner's value, zero elsewhere,
    summed over the ranks in one all-gather."""

    def __init__(self, comm, start: int, width: int):
        self.comm, self.start, self.width = comm, start, width

    def local(self, ids: torch.Tensor):
        owned = (ids >= self.start) & (ids < self.start + self.width)
        return owned, torch.where(owned, ids - self.start, 0)

    def values(self, rows: list, ids: torch.Tensor) -> list:
        """``rows``: ``[B, W]`` tensors; the entry at global ``ids`` ``[B]`` of each."""
        owned, local = self.local(ids)
        parts = [torch.where(owned, r.gather(-1, local[:, None])[:, 0].double(), 0.0)
                 for r in rows]
        return [g.sum(0) for g in self.comm.gather(parts)]


def verify_tree(target_logits, tree_token_ids, parents, *, vocab_shard, draft_probs=None,
                draft_sampling="iid", num_nodes=None, temperature=None, top_k=None,
                top_p=None, seed=None, offset=None, method="token", backend="auto",
                validate=True, min_p=None, token_bitmask=None, return_logprobs=None):
    """:func:`specdec_kernels.verify_tree` on this rank's vocabulary shard."""
    from .._types import TreeVerifyOutput
    comm = _parse.open_comm(vocab_shard, target_logits)

    def parse():
        _parse.check_logits(target_logits, "target_logits", 3)
        device = target_logits.device
        batch, nodes, width = target_logits.shape
        if nodes > _rng.MAX_POSITION:
            raise ValueError(f"target_logits: expected at most {_rng.MAX_POSITION} nodes")
        for name, index in (("tree_token_ids", tree_token_ids), ("parents", parents)):
            _params.check_tensor(index, name, dtypes=_params.INDEX_DTYPES, device=device)
            _params.check_shape(index, name, [batch, nodes], "[B, N] like target_logits")
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling: expected one of {DRAFT_SAMPLING}, "
                             f"got {draft_sampling!r}")
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        if method == "traversal" and draft_probs is None:
            raise ValueError("method: 'traversal' needs draft_probs")
        if draft_probs is not None:
            _params.check_tensor(draft_probs, "draft_probs", dtypes=_parse.DTYPES, device=device)
            _params.check_shape(draft_probs, "draft_probs", [batch, nodes, width],
                                "[B, N, W] like target_logits")
        _parse.check_bitmask(token_bitmask, [batch, nodes], width, device,
                             "[B, N, ceil(W/32)] like target_logits")
        _parse.check_options(None, return_logprobs, backend, {})
        common = _parse.common(vocab_shard, batch, device, temperature, top_k, top_p, min_p,
                               seed, offset, validate)
        n = _params.per_request(num_nodes, "num_nodes", batch, device, torch.int32, nodes)
        if validate:
            _params.raise_first_failure(_params.tree_checks(parents, n))
            index = torch.arange(nodes, device=device)
            live = (index < n[:, None]) & (index > 0)
            ids = tree_token_ids.to(torch.int64)
            bad = live & ((ids < 0) | (ids >= vocab_shard.vocab_size))
            if bool(bad.any()):
                b = _params.first_true(bad.any(1))
                i = _params.first_true(bad[b])
                raise ValueError(f"tree_token_ids: expected ids in [0, "
                                 f"{vocab_shard.vocab_size}) (global ids) for the real "
                                 f"non-root nodes, got {int(ids[b, i])} at [{b}, {i}]")
        common.num_nodes = n.to(torch.int64).clamp(1, nodes)
        common.names += ["operation", "N", "target_logits dtype", "draft_probs dtype",
                         "draft_sampling", "method", "token_bitmask given", "return_logprobs"]
        common.values += [_parse.OPS["verify_tree"], nodes, _parse.dtype_code(target_logits),
                          _parse.dtype_code(draft_probs), DRAFT_SAMPLING.index(draft_sampling),
                          METHODS.index(method), int(token_bitmask is not None),
                          _parse.LOGPROBS.index(return_logprobs)]
        if validate:
            common.names += ["parents (digest)", "tree_token_ids (digest)",
                             "num_nodes (digest)"]
            common.values += [_parse.digest(parents), _parse.digest(tree_token_ids),
                              _parse.digest(n)]
        return common
    c = _parse.agree(comm, parse)
    return TreeVerifyOutput(*_run_tree(comm, vocab_shard, c, target_logits, tree_token_ids,
                                       parents, draft_probs, draft_sampling, method,
                                       token_bitmask, return_logprobs))


def _run_tree(comm, shard, c, logits, tree_token_ids, parents, draft_probs, draft_sampling,
              method, token_bitmask, return_logprobs):
    batch, nodes, width = logits.shape
    vocab, start, device = shard.vocab_size, shard.start, logits.device
    comm.layouts = [Layout(s, w, vocab) for s, w in comm.spans]
    params = c.params
    filtered, use_min_p = _filters(params, vocab)
    allowed = None if token_bitmask is None else \
        allowed_tokens(token_bitmask, width).reshape(batch * nodes, width)
    min_p = None if params.min_p is None else _rows(params.min_p, nodes)
    block = Block(logits.reshape(batch * nodes, width), _rows(params.temperature, nodes),
                  _rows(params.top_k, nodes), _rows(params.top_p, nodes), min_p, allowed,
                  filtered, use_min_p, torch.zeros(batch * nodes, 0, dtype=torch.int64,
                                                   device=device),
                  start, vocab, return_logprobs == "raw")
    process(comm, [block])
    p = block.probs().view(batch, nodes, width)
    in_vocab = (start + torch.arange(width, device=device)) < vocab
    q = None if draft_probs is None else torch.where(in_vocab, draft_probs.to(p.dtype), 0.0)
    greedy = params.temperature == 0
    node = torch.arange(nodes, device=device)
    u = _rng.uniform(c.seeds[:, None], c.offsets[:, None], node, _rng.PURPOSE_ACCEPT)
    owner = _Owner(comm, start, width)
    walk = _traverse if method == "traversal" else _walk
    accepted_nodes, num_accepted, variants, choose = walk(
        owner, p, q, tree_token_ids, parents, c.num_nodes, draft_sampling, greedy, u, vocab)
    current = accepted_nodes.gather(1, num_accepted[:, None])[:, 0]
    final, _ = sharded_race(comm, comm.layouts[comm.order.index(comm.rank)], variants, choose,
                            c.seeds, c.offsets, current, _rng.PURPOSE_RESAMPLE)
    has_finite = block.has_finite.view(batch, nodes).gather(1, current[:, None])[:, 0]
    final = torch.where(has_finite, final, -1)
    out, path, accepted = assemble(tree_token_ids, accepted_nodes, num_accepted, final)
    logprobs = None
    if return_logprobs is not None:
        logprobs = _tree_logprobs(owner, block, p, out, path, greedy, return_logprobs)
    return out, path, accepted, logprobs


def _tree_logprobs(owner, block, p, out, path, greedy, kind):
    """Output position ``m`` was emitted at row ``path[m]``: one round of owners' values."""
    batch, nodes, width = p.shape
    row = path.to(torch.int64).clamp(min=0)
    token = out.to(torch.int64).clamp(min=0)
    rows = p.gather(1, row[..., None].expand(batch, nodes, width))  # [B, N, W] local
    source = block.x_raw.view(batch, nodes, width).gather(
        1, row[..., None].expand(batch, nodes, width)) if kind == "raw" else rows
    flat = source.reshape(batch * nodes, width)
    value, = owner.values([flat], token.reshape(-1))
    value = value.view(batch, nodes)
    if kind == "raw":
        norm = block.raw_log_norm.view(batch, nodes).gather(1, row)
        top = block.raw_max.view(batch, nodes).gather(1, row).double()
        logp = value - top - norm
    else:
        logp = torch.where(greedy[:, None], 0.0, torch.log(value.to(p.dtype)))
    return torch.where(out >= 0, logp, torch.nan).to(torch.float32)


def _walk(owner, p, q, tree_token_ids, parents, num_nodes, draft_sampling, greedy, u, vocab):
    """``reference.tree.walk_tree`` (same float operations) on this shard."""
    batch, nodes, width = p.shape
    device = p.device
    real = real_nodes(tree_token_ids, parents, num_nodes, vocab)
    par = parents.to(torch.int64)
    ids = torch.where(real, tree_token_ids.to(torch.int64), 0)
    wor = q is not None and draft_sampling == "without_replacement"
    current = torch.zeros(batch, dtype=torch.int64, device=device)
    num_accepted = torch.zeros_like(current)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    p_raw = p[:, 0].clone()
    p_mass = torch.ones(batch, dtype=p.dtype, device=device)
    q_raw = None if q is None else q[:, 0].clone()
    q_mass = torch.ones(batch, dtype=p.dtype, device=device)
    last_removed = torch.full((batch,), -1, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)
    for i in range(1, nodes):
        tested = real[:, i] & (par[:, i] == current)
        if not bool(tested.any()):
            continue
        token = ids[:, i]
        got = owner.values([p_raw] + ([] if q is None else [q_raw]), token)
        p_token = got[0].to(p.dtype)
        target = torch.where(p_mass > 0, p_token / p_mass,
                             torch.where(p_token > 0, torch.inf, 0.0))
        if q is None:
            draft = torch.ones_like(target)
        else:
            q_token = got[1].to(p.dtype)
            draft = torch.where(q_mass > 0, q_token / q_mass, 0.0) if wor else q_token
        accept = tested & torch.where(greedy, p_token > 0, u[:, i] * draft < target)
        rejected = tested & ~accept & ~greedy
        if bool(rejected.any()):
            owned, local = owner.local(token)
            hit = rejected & owned
            if q is None:
                p_mass = torch.where(rejected, p_mass - p_token, p_mass)
                p_raw[rows[hit], local[hit]] = 0.0
                last_removed = torch.where(rejected & (p_token > 0), token, last_removed)
            else:
                d = torch.where(q_mass[:, None] > 0, q_raw / q_mass[:, None], 0.0) if wor \
                    else q_raw
                residual = (p_raw / p_mass[:, None] - d).clamp(min=0)
                mass, anyp = [g.sum(0) for g in owner.comm.gather(
                    [residual.sum(-1).double(), (residual > 0).any(-1).double()])]
                has_mass = rejected & (anyp > 0)
                p_raw = torch.where(has_mass[:, None], residual, p_raw)
                p_mass = torch.where(has_mass, mass.to(p.dtype), p_mass)
                if wor:
                    q_mass = torch.where(rejected, q_mass - q_token, q_mass)
                    q_raw[rows[hit], local[hit]] = 0.0
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
    if q is not None:
        return accepted_nodes, num_accepted, [p_raw], lambda any_positive: torch.zeros_like(
            any_positive[:, 0], dtype=torch.int64)
    # Removals left no mass: the last removed token was all that remained (reference).
    ids_local = owner.start + torch.arange(width, device=device)
    fallback = (ids_local == last_removed[:, None]).to(p.dtype)
    may_empty = (last_removed >= 0) & ~greedy
    return accepted_nodes, num_accepted, [p_raw, fallback], \
        lambda any_positive: torch.where(any_positive[:, 0] | ~may_empty, 0, 1)


def _traverse(owner, p, q, tree_token_ids, parents, num_nodes, draft_sampling, greedy, u,
              vocab):
    """``reference.tree.traverse_tree`` on this shard (greedy requests: the token walk)."""
    batch, nodes, width = p.shape
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
    q_raw = q.clone()
    q_mass = torch.ones(batch, nodes, dtype=p.dtype, device=device)
    w = torch.ones(batch, nodes, dtype=p.dtype, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)

    def parent_state(v):
        """Every request's parent ``u`` of ``v``, token, target and draft (one round)."""
        u_ = par.gather(1, v[:, None])[:, 0]
        token = ids.gather(1, v[:, None])[:, 0]
        p_row, q_row = p_raw[rows, u_], q_raw[rows, u_]
        got_p, got_q = owner.values([p_row, q_row], token)
        target = got_p.to(p.dtype) / p_mass[rows, u_]
        q_token = got_q.to(p.dtype)
        draft = torch.where(q_mass[rows, u_] > 0, q_token / q_mass[rows, u_], 0.0) if wor \
            else q_token
        return u_, token, target, draft, q_token

    for step in range(tour.shape[1]):
        event = tour[:, step]
        active = (event >= 0) & ~done
        if not bool(active.any()):
            continue
        entering = active & (event < nodes)
        v = torch.where(entering, event, 0)
        if bool(entering.any()):
            u_, _, target, draft, _ = parent_state(v)
            new = sequence_weight(w[rows, u_], target, draft)
            w[rows[entering], v[entering]] = new[entering]
        leaving = active & (event >= nodes)
        if not bool(leaving.any()):
            continue
        v = torch.where(leaving, event - nodes, 0)
        u_, token, target, draft, q_token = parent_state(v)
        w_u = w[rows, u_]
        passed = torch.where(has_children[rows, v], u[rows, v] < w[rows, v],
                             u[rows, v] * draft < w_u * target) & leaving
        done |= passed
        accepted = torch.where(passed, v, accepted)
        rej = leaving & ~passed
        if bool(rej.any()):
            p_row = p_raw[rows, u_] / p_mass[rows, u_][:, None]
            q_row = q_raw[rows, u_]
            if wor:
                q_row = torch.where(q_mass[rows, u_][:, None] > 0,
                                    q_row / q_mass[rows, u_][:, None], 0.0)
            residual = weighted_residual(w_u[:, None], p_row, q_row)
            mass, anyp = [g.sum(0) for g in owner.comm.gather(
                [residual.sum(-1).double(), (residual > 0).any(-1).double()])]
            mass = mass.to(p.dtype)
            has_mass = rej & (anyp > 0)
            r, ur = rows[rej], u_[rej]
            w[r, ur] = rejection_weight(mass, w_u)[rej]
            keep = has_mass[rej]
            p_raw[r[keep], ur[keep]] = residual[rej][keep]
            p_mass[r[keep], ur[keep]] = mass[rej][keep]
            if wor:
                q_mass[r, ur] = q_mass[r, ur] - q_token[rej]
                owned, local = owner.local(token)
                hit = rej & owned
                q_raw[rows[hit], u_[hit], local[hit]] = 0.0
    up = [accepted]
    while bool((up[-1] > 0).any()):
        up.append(torch.where(up[-1] > 0, par.gather(1, up[-1][:, None])[:, 0], 0))
    up = torch.stack(up, 1)
    num_accepted = (up > 0).sum(-1)
    level = torch.arange(nodes, device=device)
    source = (num_accepted[:, None] - level).clamp(0, up.shape[1] - 1)
    path = torch.where(level <= num_accepted[:, None], up.gather(1, source), -1)
    final = p_raw.gather(1, accepted[:, None, None].expand(batch, 1, width))[:, 0]
    if bool(greedy.any()):
        token_path, token_accepted, token_variants, _ = _walk(
            owner, p, q, tree_token_ids, parents, num_nodes, draft_sampling, greedy, u, vocab)
        path = torch.where(greedy[:, None], token_path, path)
        num_accepted = torch.where(greedy, token_accepted, num_accepted)
        final = torch.where(greedy[:, None], token_variants[0], final)
    return path, num_accepted, [final], lambda any_positive: torch.zeros_like(
        any_positive[:, 0], dtype=torch.int64)
