"""``verify_chain``, ``verify_chain_packed`` and ``sample`` on vocabulary shards (contract
section 17): the reference's definitions (``reference/chain.py``, ``reference/sampling.py``)
decided from per-shard summaries.

Rounds of a chain call (each one collective; the counts are asserted in the tests):
agreement; maxima; top-k search (4 all-reduces, only with top-k); normalisers with the
owners' ``p(d_j)``, ``q(d_j)`` (every rank then knows the accepted prefix); top-p search (4,
only with top-p) and the renormaliser (only with a filter); block's residual masses (only
``method="block"``); the group race (only when ``vocab_size > RACE_GROUP``); the token race.
"""
from __future__ import annotations


import torch

from .. import _params, _rng
from ..reference.chain import (last_success, rejection_weight, sequence_weight,
                               weighted_residual)
from ..reference.packed import packed_layout, padded_inputs
from ..reference.sampling import allowed_tokens
from . import _parse
from ._race import Layout, sharded_race
from ._rows import Block, process


def _filters(params, vocab: int):
    """The reference's batch-level flags of ``processed_probs`` (its renormalisation after a
    filter runs on every row of the call when any row filters)."""
    k, p = params.top_k, params.top_p
    filtered = bool(((k > 0) & (k < vocab)).any()) or bool((p < 1).any())
    use_min_p = params.min_p is not None and bool((params.min_p > 0).any())
    return filtered, use_min_p


def _rows(values: torch.Tensor, per_request: int) -> torch.Tensor:
    return values.repeat_interleave(per_request)


class _Chain:
    """Parsed arguments of one sharded chain call."""


def _parse_chain(shard, target_logits, draft_token_ids, draft_probs, draft_logits,
                 num_draft_tokens, temperature, top_k, top_p, seed, offset, method, backend,
                 validate, min_p, token_bitmask, return_logprobs, unsupported, op="verify_chain",
                 extra_names=(), extra_values=()):
    c = _Chain()
    _parse.check_logits(target_logits, "target_logits", 3)
    device = target_logits.device
    batch, rows, width = target_logits.shape
    if rows > _rng.MAX_POSITION:
        raise ValueError(f"target_logits: expected at most {_rng.MAX_POSITION} rows (K+1), "
                         f"got {rows}")
    num_drafts = rows - 1
    _params.check_tensor(draft_token_ids, "draft_token_ids", dtypes=_params.INDEX_DTYPES,
                         device=device)
    _params.check_shape(draft_token_ids, "draft_token_ids", [batch, num_drafts],
                        "[B, K] from target_logits [B, K+1, W]")
    if draft_probs is not None and draft_logits is not None:
        raise ValueError("draft_probs, draft_logits: give at most one of them")
    for name, draft in (("draft_probs", draft_probs), ("draft_logits", draft_logits)):
        if draft is not None:
            _params.check_tensor(draft, name, dtypes=_parse.DTYPES, device=device)
            _params.check_shape(draft, name, [batch, num_drafts, width],
                                "[B, K, W] like target_logits [B, K+1, W]")
    _parse.check_bitmask(token_bitmask, [batch, rows], width, device,
                         "[B, K+1, ceil(W/32)] like target_logits [B, K+1, W]")
    _parse.check_options(method, return_logprobs, backend, unsupported)
    common = _parse.common(shard, batch, device, temperature, top_k, top_p, min_p, seed,
                           offset, validate)
    ndt = _params.per_request(num_draft_tokens, "num_draft_tokens", batch, device,
                              torch.int32, num_drafts)
    if validate:
        vocab = shard.vocab_size
        bad = (ndt < 0) | (ndt > num_drafts)
        if bool(bad.any()):
            b = _params.first_true(bad)
            raise ValueError(f"num_draft_tokens: expected values in 0..{num_drafts} (K), "
                             f"got {int(ndt[b])} for request {b}")
        live = torch.arange(num_drafts, device=device) < ndt[:, None]
        out = live & ((draft_token_ids < 0) | (draft_token_ids >= vocab))
        if bool(out.any()):
            b = _params.first_true(out.any(1))
            j = _params.first_true(out[b])
            raise ValueError(f"draft_token_ids: expected ids in [0, {vocab}) (global ids) for "
                             f"the first num_draft_tokens[b] entries, got "
                             f"{int(draft_token_ids[b, j])} at [{b}, {j}]")
    c.target_logits, c.draft_probs, c.draft_logits = target_logits, draft_probs, draft_logits
    c.draft_token_ids, c.num_draft_tokens, c.token_bitmask = draft_token_ids, ndt, token_bitmask
    c.common, c.method, c.return_logprobs = common, method, return_logprobs
    mode = 0 if draft_probs is None and draft_logits is None else (1 if draft_logits is None
                                                                     else 2)
    c.names = common.names + ["operation", "K+1", "target_logits dtype", "draft kind",
                              "draft dtype", "token_bitmask given", "method",
                              "return_logprobs"] + list(extra_names)
    c.values = common.values + [
        _parse.OPS[op], rows, _parse.dtype_code(target_logits), mode,
        _parse.dtype_code(draft_probs if draft_logits is None else draft_logits),
        int(token_bitmask is not None), _parse.METHODS.index(method),
        _parse.LOGPROBS.index(return_logprobs)] + list(extra_values)
    if validate:
        c.names += ["num_draft_tokens (digest)", "draft_token_ids (digest)"]
        c.values += [_parse.digest(ndt), _parse.digest(draft_token_ids)]
    return c


def verify_chain(target_logits, draft_token_ids, *, vocab_shard, draft_probs=None,
                 draft_logits=None, num_draft_tokens=None, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, method="token", backend="auto",
                 validate=True, min_p=None, token_bitmask=None, return_logprobs=None,
                 draft_slots=None, draft_temperature=None):
    """:func:`specdec_kernels.verify_chain` on this rank's vocabulary shard: the same
    outputs on every rank, those of the unsharded op on the concatenated rows."""
    from .._types import ChainVerifyOutput
    comm = _parse.open_comm(vocab_shard, target_logits)
    c = _parse.agree(comm, lambda: _parse_chain(
        vocab_shard, target_logits, draft_token_ids, draft_probs, draft_logits,
        num_draft_tokens, temperature, top_k, top_p, seed, offset, method, backend, validate,
        min_p, token_bitmask, return_logprobs,
        {"draft_slots": draft_slots, "draft_temperature": draft_temperature}))
    return ChainVerifyOutput(*_run_chain(comm, vocab_shard, c))


def verify_chain_packed(target_logits, draft_token_ids, cu_num_draft_tokens, *,
                        max_draft_tokens, vocab_shard, draft_probs=None, draft_logits=None,
                        temperature=None, top_k=None, top_p=None, min_p=None,
                        token_bitmask=None, seed=None, offset=None, method="token",
                        return_logprobs=None, backend="auto", validate=True, draft_slots=None,
                        draft_temperature=None):
    """:func:`specdec_kernels.verify_chain_packed` on this rank's shard (vLLM's
    ``[T+B, V/P]`` rows, as its vocabulary-parallel head leaves them); the padded layout is
    built on the shard (a local copy of ``O(rows x W)``), then as :func:`verify_chain`."""
    from .._types import ChainVerifyOutput
    comm = _parse.open_comm(vocab_shard, target_logits)

    def parse():
        _parse.check_logits(target_logits, "target_logits", 2)
        device = target_logits.device
        _params.check_tensor(draft_token_ids, "draft_token_ids", ndim=1,
                             dtypes=_params.INDEX_DTYPES, device=device)
        _params.check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", ndim=1,
                             dtypes=_params.INDEX_DTYPES, device=device)
        if cu_num_draft_tokens.shape[0] < 1:
            raise ValueError("cu_num_draft_tokens: expected shape [B+1] with B >= 0, got [0]")
        if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or \
                not 0 <= max_draft_tokens < _rng.MAX_POSITION:
            raise ValueError(f"max_draft_tokens: expected a Python int 0 <= K < "
                             f"{_rng.MAX_POSITION}, got {max_draft_tokens!r}")
        batch, num_packed = cu_num_draft_tokens.shape[0] - 1, draft_token_ids.shape[0]
        if target_logits.shape[0] != num_packed + batch:
            raise ValueError(f"cu_num_draft_tokens, target_logits: expected T + B = "
                             f"{num_packed} + {batch} rows, got {list(target_logits.shape)}")
        width = target_logits.shape[1]
        for name, draft in (("draft_probs", draft_probs), ("draft_logits", draft_logits)):
            if draft is not None:
                _params.check_tensor(draft, name, dtypes=_parse.DTYPES, device=device)
                _params.check_shape(draft, name, [num_packed, width], "[T, W]")
        _parse.check_bitmask(token_bitmask, [num_packed + batch], width, device,
                             "[T+B, ceil(W/32)]")
        if validate:
            _check_offsets(cu_num_draft_tokens, max_draft_tokens, num_packed)
        layout = packed_layout(cu_num_draft_tokens, num_packed, max_draft_tokens)
        logits, ids, probs, dlogits, bitmask = padded_inputs(
            layout, target_logits, draft_token_ids, draft_probs, draft_logits, token_bitmask)
        return _parse_chain(
            vocab_shard, logits, ids, probs, dlogits, layout.num_draft_tokens, temperature,
            top_k, top_p, seed, offset, method, backend, validate, min_p, bitmask,
            return_logprobs, {"draft_slots": draft_slots,
                              "draft_temperature": draft_temperature},
            op="verify_chain_packed", extra_names=["cu_num_draft_tokens (digest)"],
            extra_values=[_parse.digest(cu_num_draft_tokens) if validate else 0])
    c = _parse.agree(comm, parse)
    return ChainVerifyOutput(*_run_chain(comm, vocab_shard, c))


def _check_offsets(cu: torch.Tensor, max_draft_tokens: int, num_packed: int) -> None:
    cu = cu.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((counts < 0).any()) or bool((counts > max_draft_tokens).any()) \
            or int(cu[-1]) != num_packed:
        raise ValueError(f"cu_num_draft_tokens: expected cu[0] = 0, non-decreasing offsets, "
                         f"at most max_draft_tokens = {max_draft_tokens} drafts per request "
                         f"and cu[B] = len(draft_token_ids) = {num_packed}, got "
                         f"{cu.tolist()[:16]}")


def _run_chain(comm, shard, c):
    logits = c.target_logits
    batch, rows, width = logits.shape
    num_drafts, vocab, start = rows - 1, shard.vocab_size, shard.start
    device = logits.device
    comm.layouts = [Layout(s, w, vocab) for s, w in comm.spans]
    params, seeds, offsets = c.common.params, c.common.seeds, c.common.offsets
    temperature = params.temperature
    greedy = temperature == 0
    filtered, use_min_p = _filters(params, vocab)
    raw = c.return_logprobs == "raw"

    position = torch.arange(num_drafts, device=device)
    ids = c.draft_token_ids.to(torch.int64)
    live_drafts = c.num_draft_tokens.to(torch.int64).clamp(0, num_drafts)
    valid = (position < live_drafts[:, None]) & (ids >= 0) & (ids < vocab)
    drafts = torch.where(valid, ids, 0)
    queries = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], 1)  # [B, K+1]
    allowed = None if c.token_bitmask is None else \
        allowed_tokens(c.token_bitmask, width).reshape(batch * rows, width)

    def per_row(x, n):
        return None if x is None else _rows(x, n)
    target = Block(logits.reshape(batch * rows, width), _rows(temperature, rows),
                   _rows(params.top_k, rows), _rows(params.top_p, rows),
                   per_row(params.min_p, rows), allowed, filtered, use_min_p,
                   queries.reshape(-1, 1), start, vocab, raw)
    blocks = [target]
    if c.draft_logits is not None:
        draft = Block(c.draft_logits.reshape(batch * num_drafts, width),
                      _rows(temperature, num_drafts), _rows(params.top_k, num_drafts),
                      _rows(params.top_p, num_drafts), per_row(params.min_p, num_drafts),
                      None, filtered, use_min_p, drafts.reshape(-1, 1), start, vocab, False)
        blocks.append(draft)
    elif c.draft_probs is not None:
        # q(d_j) from its owner: a query block of its own riding the normaliser round.
        owned = (drafts >= start) & (drafts < start + width)
        local = torch.where(owned, drafts - start, 0)
        compute = target.compute
        q_owned = c.draft_probs.to(compute).gather(-1, local[..., None])[..., 0]
        target.extra = torch.where(owned, q_owned.double(), 0.0)
    process(comm, blocks)

    p = target.probs().view(batch, rows, width)
    p_draft = target.query_probs().view(batch, rows)[:, :num_drafts]
    local_ids = start + torch.arange(width, device=device)
    in_vocab = local_ids < vocab
    if c.draft_logits is not None:
        q = blocks[1].probs().view(batch, num_drafts, width)
        q_draft = blocks[1].query_probs().view(batch, num_drafts)
    elif c.draft_probs is not None:
        q = torch.where(in_vocab, c.draft_probs.to(p.dtype), 0.0)
        q_draft = target.extra_sum.to(p.dtype)
    else:
        q = (local_ids == drafts[..., None]).to(p.dtype)  # one-hot on this shard
        q_draft = torch.ones_like(p_draft)

    u = _rng.uniform(seeds[:, None], offsets[:, None], position + 1, _rng.PURPOSE_ACCEPT)
    accept = torch.where(greedy[:, None], p_draft > 0, u * q_draft < p_draft) & valid
    token_accepted = accept.to(torch.int64).cumprod(-1).sum(-1)
    token_last = token_accepted.clamp(max=max(num_drafts - 1, 0))
    rejected = valid.gather(1, token_last[:, None])[:, 0] & (token_accepted <= token_last) \
        if num_drafts else torch.zeros_like(greedy)
    one = torch.ones(batch, dtype=p.dtype, device=device)
    if c.method == "block" and num_drafts:
        num_accepted, weight, prefer = _block(comm, p, q, p_draft, q_draft, valid, u, greedy,
                                              token_accepted, rejected)
    else:
        num_accepted, weight, prefer = token_accepted, one, rejected & ~greedy

    p_last = p.gather(1, num_accepted[:, None, None].expand(batch, 1, width))[:, 0]
    if num_drafts:
        last = num_accepted.clamp(max=num_drafts - 1)
        q_last = q.gather(1, last[:, None, None].expand(batch, 1, width))[:, 0]
        residual = weighted_residual(weight[:, None], p_last, q_last)
    else:
        residual = torch.zeros_like(p_last)
    carry = [p_last]
    if raw:
        x_raw = target.x_raw.view(batch, rows, width)
        carry.append(x_raw.gather(1, num_accepted[:, None, None].expand(batch, 1, width))[:, 0])
    final, carried = sharded_race(
        comm, comm.layouts[comm.order.index(comm.rank)], [residual, p_last],
        lambda any_positive: torch.where(prefer & any_positive[:, 0], 0, 1),
        seeds, offsets, num_accepted, _rng.PURPOSE_RESAMPLE, carry)
    has_finite = target.has_finite.view(batch, rows).gather(1, num_accepted[:, None])[:, 0]
    final = torch.where(has_finite, final, -1)

    out = torch.full((batch, rows), -1, dtype=torch.int32, device=device)
    out[:, :num_drafts] = torch.where(position < num_accepted[:, None], drafts, -1).to(
        torch.int32)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    logprobs = None
    if c.return_logprobs is not None:
        logprobs = _chain_logprobs(c.return_logprobs, target, out, num_accepted, p_draft,
                                   carried, greedy, batch, rows)
    return out, num_accepted.to(torch.int32), logprobs


def _block(comm, p, q, p_draft, q_draft, valid, u, greedy, token_accepted, token_rejected):
    """Block verification (``reference.chain.block_outcome``) from the owners' values and one
    round of residual masses ``R_j``. Returns ``(num_accepted, w_tau, prefer_residual)``."""
    batch, rows, width = p.shape
    num_drafts = rows - 1
    live = valid.to(torch.int64).cumprod(-1).bool()
    num_live = live.sum(-1)
    weights = [torch.ones(batch, dtype=p.dtype, device=p.device)]
    for j in range(num_drafts):
        weights.append(sequence_weight(weights[j], p_draft[:, j], q_draft[:, j]))
    w = torch.stack(weights, 1)
    if num_drafts > 1:
        partial = torch.stack([weighted_residual(w[:, j, None], p[:, j], q[:, j]).sum(-1)
                               for j in range(1, num_drafts)], 1)
        masses = comm.gather([partial])[0].sum(0).to(p.dtype)
        h = torch.stack([rejection_weight(masses[:, j - 1], w[:, j])
                         for j in range(1, num_drafts)] + [w[:, num_drafts]], 1)
    else:
        h = w[:, 1:]
    last = torch.arange(1, num_drafts + 1, device=p.device) == num_live[:, None]
    passed = torch.where(last, u * q_draft < w[:, :num_drafts] * p_draft, u < h) & live
    tau = last_success(passed)
    w_tau = w.gather(1, tau[:, None])[:, 0]
    num_accepted = torch.where(greedy, token_accepted, tau)
    weight = torch.where(greedy, 1.0, w_tau)
    prefer = torch.where(greedy, False, tau < num_live)
    return num_accepted, weight, prefer


def _chain_logprobs(kind, target, out, num_accepted, p_draft, carried, greedy, batch, rows):
    """``reference.sampling.token_logprobs`` for a chain: output position ``m`` at row ``m``."""
    num_drafts = rows - 1
    emitted = out >= 0
    final_row = torch.arange(rows, device=out.device) == num_accepted[:, None]
    if kind == "raw":
        raw_q = target.raw_q.view(batch, rows)
        x = torch.where(final_row, carried[1][:, None], raw_q)
        value = target.raw_logprob(x.reshape(-1, 1)).view(batch, rows)
    else:
        p_out = torch.cat([p_draft, torch.zeros_like(p_draft[:, :1])], 1) if num_drafts \
            else torch.zeros(batch, 1, dtype=p_draft.dtype, device=out.device)
        p_out = torch.where(final_row, carried[0][:, None].to(p_out.dtype), p_out)
        value = torch.where(greedy[:, None], 0.0, torch.log(p_out))
    return torch.where(emitted, value, torch.nan).to(torch.float32)


def sample(logits, *, vocab_shard, temperature=None, top_k=None, top_p=None, seed=None,
           offset=None, backend="auto", validate=True, min_p=None, token_bitmask=None,
           return_logprobs=None):
    """:func:`specdec_kernels.sample` on this rank's vocabulary shard ``[B, W]``."""
    from .._types import SampleOutput
    comm = _parse.open_comm(vocab_shard, logits)

    def parse():
        _parse.check_logits(logits, "logits", 2)
        batch, width = logits.shape
        _parse.check_bitmask(token_bitmask, [batch], width, logits.device,
                             "[B, ceil(W/32)] like logits [B, W]")
        _parse.check_options(None, return_logprobs, backend, {})
        common = _parse.common(vocab_shard, batch, logits.device, temperature, top_k, top_p,
                               min_p, seed, offset, validate)
        common.names += ["operation", "logits dtype", "token_bitmask given",
                         "return_logprobs"]
        common.values += [_parse.OPS["sample"], _parse.dtype_code(logits),
                          int(token_bitmask is not None),
                          _parse.LOGPROBS.index(return_logprobs)]
        return common
    common = _parse.agree(comm, parse)
    batch, width = logits.shape
    vocab = vocab_shard.vocab_size
    comm.layouts = [Layout(s, w, vocab) for s, w in comm.spans]
    params = common.params
    filtered, use_min_p = _filters(params, vocab)
    raw = return_logprobs == "raw"
    allowed = None if token_bitmask is None else allowed_tokens(token_bitmask, width)
    block = Block(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                  allowed, filtered, use_min_p,
                  torch.zeros(batch, 0, dtype=torch.int64, device=logits.device),
                  vocab_shard.start, vocab, raw)
    process(comm, [block])
    p = block.probs()
    carry = [p] + ([block.x_raw] if raw else [])
    tokens, carried = sharded_race(comm, comm.layouts[comm.order.index(comm.rank)], [p],
                                   lambda any_positive: torch.zeros_like(any_positive[:, 0],
                                                                         dtype=torch.int64),
                                   common.seeds, common.offsets, 0, _rng.PURPOSE_SAMPLE,
                                   carry)
    if return_logprobs is None:
        return tokens
    if raw:
        value = block.raw_logprob(carried[1][:, None])[:, 0]
    else:
        value = torch.where(params.temperature == 0, 0.0, torch.log(carried[0].to(p.dtype)))
    logprobs = torch.where(tokens >= 0, value, torch.nan).to(torch.float32)
    return SampleOutput(tokens, logprobs)

