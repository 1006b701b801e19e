"""Valid and garbage calls of every public op, drawn by Hypothesis (see strategies.py).

``draw_call(draw, op, garbage=...)`` returns a :class:`Call`: the op, its keyword arguments
(an argument left out is not passed) and the guarded buffers its tensors are views of. The
valid calls satisfy the contract; the garbage ones only what ``validate=False`` needs (the
shapes and dtypes right, anything in the values).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

import specdec_kernels as sk
from strategies import (CACHE_DTYPES, FLAG_ARGS, GARBAGE_SAMPLING, METHODS, RNG_ARGS,
                        SAMPLING_ARGS, TREE_ATTENTION_ARGS, Dims, accepted_paths, dims,
                        garbage_index, guarded, logits, num_nodes_values, padding, parents,
                        per_request, random_cache, token_bitmask)

VERIFY_OPS = ("processed_probs", "sample", "verify_chain", "verify_chain_packed", "verify_tree")
KV_OPS = ("compact_kv_cache", "compact_paged_kv_cache")
OPS = VERIFY_OPS + ("build_tree_attention",) + KV_OPS


@dataclass
class Call:
    op: str
    dims: Dims
    kwargs: dict
    guards: dict = field(default_factory=dict)  # argument name -> Guarded (or list of)

    def run(self, **extra):
        kwargs = dict(self.kwargs, **extra)
        if self.op == "processed_probs":
            kwargs.pop("backend", None)
        return getattr(sk, self.op)(**kwargs)

    def all_guards(self):
        for value in self.guards.values():
            yield from (value if isinstance(value, list) else [value])

    def nothing_written(self) -> bool:
        return all(g.unchanged() for g in self.all_guards())


def _draw_args(draw, table, d: Dims, kwargs: dict, exclude=()):
    for name, strategy in table.items():
        if name in exclude:
            continue
        value = draw(strategy(d))
        if value is not None:
            kwargs[name] = value


def _draw_garbage_sampling(draw, d: Dims, kwargs: dict, exclude=()):
    for name, strategy in GARBAGE_SAMPLING.items():
        if name not in exclude and draw(st.booleans()):
            kwargs[name] = draw(strategy(d))


def _guard(draw, call: Call, name: str, value: torch.Tensor, **how):
    g = draw(guarded(value, **how))
    call.guards[name] = g
    call.kwargs[name] = g.view


def _probs(draw, shape, garbage: bool):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if garbage:
        return torch.randn(shape, generator=gen)  # not a distribution at all
    q = torch.rand(shape, generator=gen) ** 3
    q[..., 0] += 1e-3  # no all-zero row
    return (q / q.sum(-1, keepdim=True)).to(draw(st.sampled_from([torch.float32, torch.float64])))


@st.composite
def draw_call(draw, op: str, *, garbage: bool = False, max_batch: int = 3, max_rows: int = 5,
              max_vocab: int = 40, exclude=frozenset()) -> Call:
    """``exclude``: argument names never drawn (e.g. those a backend does not take yet)."""
    rows_low = 2 if op in KV_OPS else 1
    d = draw(dims(batch=(0, max_batch), rows=(rows_low, max_rows), vocab=(1, max_vocab)))
    call = Call(op, d, {})
    if op in VERIFY_OPS:
        _verify_call(draw, call, garbage, exclude)
    elif op == "build_tree_attention":
        call.kwargs["parents"] = draw(parents(d.batch, d.rows, garbage=garbage))
        if garbage:
            for name in TREE_ATTENTION_ARGS:
                if draw(st.booleans()):
                    call.kwargs[name] = draw(garbage_index((d.batch,)))
        else:
            _draw_args(draw, TREE_ATTENTION_ARGS, d, call.kwargs)
    else:
        _kv_call(draw, call, garbage)
    return call


def _verify_call(draw, call: Call, garbage: bool, exclude=()):
    d, kw, op = call.dims, call.kwargs, call.op
    if garbage:
        _draw_garbage_sampling(draw, d, kw, exclude)
    else:
        _draw_args(draw, SAMPLING_ARGS, d, kw, exclude)
    if op == "processed_probs":
        _guard(draw, call, "logits", draw(logits((d.batch, d.vocab), garbage=garbage)))
        _draw_bitmask(draw, call, (d.batch,), exclude)
        return
    _draw_args(draw, RNG_ARGS, d, kw)
    _draw_args(draw, FLAG_ARGS, d, kw, exclude)
    if op == "sample":
        _guard(draw, call, "logits", draw(logits((d.batch, d.vocab), garbage=garbage)))
        _draw_bitmask(draw, call, (d.batch,), exclude)
        return
    method = draw(st.sampled_from(METHODS[op]))
    if op == "verify_chain_packed":
        _packed_chain_call(draw, call, garbage, exclude)
    elif op == "verify_chain":
        _guard(draw, call, "target_logits", draw(logits((d.batch, d.rows, d.vocab),
                                                        garbage=garbage)))
        _draw_bitmask(draw, call, (d.batch, d.rows), exclude)
        num_drafts = d.rows - 1
        kw["draft_token_ids"] = _draft_ids(draw, (d.batch, num_drafts), d.vocab, garbage)
        _draw_drafts(draw, call, (d.batch, num_drafts, d.vocab), garbage)
        if garbage:
            if draw(st.booleans()):
                kw["num_draft_tokens"] = draw(garbage_index((d.batch,)))
        else:
            value = draw(per_request(d, st.integers(0, num_drafts), floating=False))
            if value is not None:
                kw["num_draft_tokens"] = value
    else:
        _tree_call(draw, call, garbage, exclude)
        if method == "traversal" and "draft_probs" not in kw:
            method = "token"  # traversal needs the drafter's probabilities
        if method == "traversal" and any(f"traversal:{name}" in exclude for name in kw):
            method = "token"  # an argument the backend's traversal does not take yet
    if method != "token":
        kw["method"] = method


def _draw_bitmask(draw, call: Call, lead_shape, exclude):
    if "token_bitmask" not in exclude and draw(st.booleans()):
        _guard(draw, call, "token_bitmask", draw(token_bitmask(lead_shape, call.dims.vocab)))


def _draft_ids(draw, shape, vocab: int, garbage: bool) -> torch.Tensor:
    if garbage:
        return draw(garbage_index(shape))
    count = math.prod(shape)
    return torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=count,
                                      max_size=count)), dtype=torch.int64).view(shape)


def _draw_drafts(draw, call: Call, shape, garbage: bool):
    """None, draft_probs or draft_logits of ``shape``."""
    draft = draw(st.sampled_from(["none", "draft_probs", "draft_logits"]))
    if draft == "draft_probs":
        _guard(draw, call, "draft_probs", _probs(draw, shape, garbage))
    elif draft == "draft_logits":
        call.kwargs["draft_logits"] = draw(logits(shape, garbage=garbage))


def _packed_chain_call(draw, call: Call, garbage: bool, exclude):
    """Contract section 10: request b's n_b draft rows then its bonus row; exclusive offsets
    ``[B+1]``; ``max_draft_tokens`` K = rows - 1 (or more). Garbage offsets: anything."""
    d, kw = call.dims, call.kwargs
    max_drafts = d.rows - 1
    counts = draw(st.lists(st.integers(0, max_drafts), min_size=d.batch, max_size=d.batch))
    num_packed = sum(counts)
    offsets = [0] + list(itertools.accumulate(counts))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    kw["cu_num_draft_tokens"] = (draw(garbage_index((d.batch + 1,))) if garbage and
                                 draw(st.booleans()) else torch.tensor(offsets, dtype=index_dtype))
    kw["max_draft_tokens"] = max_drafts + draw(st.sampled_from([0, 0, 1]))
    rows = num_packed + d.batch
    _guard(draw, call, "target_logits", draw(logits((rows, d.vocab), garbage=garbage)))
    _draw_bitmask(draw, call, (rows,), exclude)
    kw["draft_token_ids"] = _draft_ids(draw, (num_packed,), d.vocab, garbage)
    _draw_drafts(draw, call, (num_packed, d.vocab), garbage)


def _tree_call(draw, call: Call, garbage: bool, exclude):
    d, kw = call.dims, call.kwargs
    _guard(draw, call, "target_logits", draw(logits((d.batch, d.rows, d.vocab),
                                                    garbage=garbage)))
    _draw_bitmask(draw, call, (d.batch, d.rows), exclude)
    kw["parents"] = draw(parents(d.batch, d.rows, garbage=garbage))
    kw["tree_token_ids"] = (draw(garbage_index((d.batch, d.rows))) if garbage else torch.tensor(
        draw(st.lists(st.integers(0, d.vocab - 1), min_size=d.batch * d.rows,
                      max_size=d.batch * d.rows)), dtype=torch.int32).view(d.batch, d.rows))
    if draw(st.booleans()):
        _guard(draw, call, "draft_probs", _probs(draw, (d.batch, d.rows, d.vocab), garbage))
        kw["draft_sampling"] = draw(st.sampled_from(["iid", "without_replacement"]))
    value = (draw(garbage_index((d.batch,))) if garbage and draw(st.booleans()) else
             None if garbage else draw(num_nodes_values(d)))
    if value is not None:
        kw["num_nodes"] = value


def _kv_call(draw, call: Call, garbage: bool):
    d, kw = call.dims, call.kwargs
    nodes = d.rows
    paged = call.op == "compact_paged_kv_cache"
    dtype = draw(st.sampled_from(CACHE_DTYPES))
    heads, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    if garbage:
        kw["accepted_nodes"] = draw(garbage_index((d.batch, nodes)))
        kw["num_accepted"] = draw(garbage_index((d.batch,)))
        kw["kv_lens"] = draw(garbage_index((d.batch,)))
    else:
        kw["accepted_nodes"], kw["num_accepted"] = draw(accepted_paths(d.batch, nodes))
    # The path's last node sizes a valid call's cache; garbage gets caches of any small size.
    last = [0 if garbage else int(kw["accepted_nodes"][b, int(kw["num_accepted"][b])])
            for b in range(d.batch)]
    if paged:
        block_size = draw(st.integers(1, 4))
        columns = draw(st.integers(1, 4)) + max(last, default=0) // block_size
        num_blocks = d.batch * columns + draw(st.integers(0, 2))
        shape = (num_blocks, block_size, heads, head_dim)
        if draw(st.booleans()):  # a 3-D or 5-D pool
            shape = (num_blocks, block_size, heads * head_dim) if draw(st.booleans()) else \
                (num_blocks, block_size, heads, 1, head_dim)
        if garbage:  # duplicate blocks and ids outside the pool too
            kw["block_tables"] = draw(garbage_index((d.batch, columns)))
        else:
            perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(
                draw(st.integers(0, 2**31))))[:d.batch * columns]
            kw["block_tables"] = perm.view(d.batch, columns).to(
                draw(st.sampled_from([torch.int32, torch.int64])))
        capacity = columns * block_size
        pad_dims = (0, 1)
    else:
        layout = draw(st.sampled_from(["bshd", "bhsd"]))
        kw["layout"] = layout
        seq_len = max(last, default=0) + 1 + draw(st.integers(0, 4))
        shape = ((d.batch, seq_len, heads, head_dim) if layout == "bshd"
                 else (d.batch, heads, seq_len, head_dim))
        capacity = seq_len
        pad_dims = None  # every dimension: strided views
    if not garbage:
        room = [capacity - 1 - v for v in last]
        kw["kv_lens"] = torch.tensor([draw(st.integers(0, r)) for r in room],
                                     dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    layers = draw(st.integers(1, 3))
    pads = draw(padding(len(shape), pad_dims))  # one layout for every layer
    caches = [draw(guarded(random_cache(shape, dtype, draw(st.integers(0, 2**31))), pads=pads))
              for _ in range(layers)]
    call.guards["caches"] = caches
    kw["caches"] = [g.view for g in caches]
