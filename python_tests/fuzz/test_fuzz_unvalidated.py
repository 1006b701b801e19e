"""Fuzz: ``validate=False`` with garbage (contract section 7). The verify ops never emit an id
outside ``[0, V)`` other than ``-1`` and write none of their inputs; tree attention stays
well-formed; compaction writes only its slots (positions ``kv_lens + 1 .. kv_lens +
num_accepted`` of each request, in blocks of the request's table), never a guard region."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from calls import KV_OPS, VERIFY_OPS, draw_call
from conftest import EXTENSION_BACKENDS
from strategies import bits, examples


def _in_range(ids: torch.Tensor, high: int) -> bool:
    return bool(((ids == -1) | ((ids >= 0) & (ids < high))).all())


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto on CPU: the C++ path
@pytest.mark.parametrize("op", [op for op in VERIFY_OPS if op != "processed_probs"])
@examples(50)
@given(data=st.data())
def test_garbage_never_emits_an_id_outside_the_vocabulary(op, backend, data):
    call = data.draw(draw_call(op, garbage=True), label="call")
    out = call.run(validate=False, backend=backend)
    d = call.dims
    assert call.nothing_written()
    if op == "sample":
        tokens = out.token_ids if isinstance(out, tuple) else out  # tuple: return_logprobs
        assert tokens.shape == (d.batch,) and _in_range(tokens, d.vocab)
        _logprobs_follow(out, tokens)
        return
    assert _in_range(out.output_token_ids, d.vocab)
    _logprobs_follow(out, out.output_token_ids)
    assert bool(((out.num_accepted >= 0) & (out.num_accepted < d.rows)).all())
    if op == "verify_tree":
        assert _in_range(out.accepted_nodes, d.rows)


def _logprobs_follow(out, tokens):
    """With return_logprobs: float32, shaped like the tokens, NaN where the token is -1."""
    logprobs = getattr(out, "logprobs", None)
    if logprobs is None:
        return
    assert logprobs.dtype == torch.float32 and logprobs.shape == tokens.shape
    assert bool(logprobs[tokens == -1].isnan().all())


@examples(40)
@given(data=st.data())
def test_garbage_processed_probs_writes_nothing(data):
    call = data.draw(draw_call("processed_probs", garbage=True), label="call")
    probs = call.run(validate=False)
    assert probs.shape == call.kwargs["logits"].shape and call.nothing_written()


@pytest.mark.parametrize("backend", EXTENSION_BACKENDS)
@examples(60)
@given(data=st.data())
def test_garbage_tree_attention_stays_well_formed(backend, data):
    call = data.draw(draw_call("build_tree_attention", garbage=True), label="call")
    before = call.kwargs["parents"].clone()
    out = call.run(validate=False, backend=backend)
    n = call.dims.rows
    assert torch.equal(call.kwargs["parents"], before)
    assert bool(out.mask.diagonal(dim1=1, dim2=2).all())
    assert bool(((out.depth >= 0) & (out.depth < n)).all())
    assert torch.equal(out.depth.long(), out.mask.sum(-1) - 1)


def allowed_slots(call) -> list[torch.Tensor]:
    """Per cache, a bool mask over its view: the elements compaction may write."""
    kw = call.kwargs
    view = kw["caches"][0]
    allowed = torch.zeros(view.shape, dtype=torch.bool)
    nodes = kw["accepted_nodes"].shape[1]
    paged = call.op == "compact_paged_kv_cache"
    for b in range(call.dims.batch):
        start = int(kw["kv_lens"][b])
        count = min(max(int(kw["num_accepted"][b]), 0), nodes - 1)
        if start < 0:
            continue
        for k in range(1, count + 1):
            position = start + k
            if not paged:
                seq_dim = 1 if kw.get("layout", "bshd") == "bshd" else 2
                if position < view.shape[seq_dim]:
                    allowed.select(0, b).select(seq_dim - 1, position).fill_(True)
                continue
            column, slot = divmod(position, view.shape[1])
            if column < kw["block_tables"].shape[1]:
                block = int(kw["block_tables"][b, column])
                if 0 <= block < view.shape[0]:
                    allowed[block, slot] = True
    return allowed


@pytest.mark.parametrize("op", KV_OPS)
@pytest.mark.parametrize("backend", EXTENSION_BACKENDS)
@examples(60)
@given(data=st.data())
def test_garbage_compaction_writes_only_its_slots(op, backend, data):
    call = data.draw(draw_call(op, garbage=True), label="call")
    index_before = {k: v.clone() for k, v in call.kwargs.items()
                    if isinstance(v, torch.Tensor)}
    views_before = [g.view.clone() for g in call.guards["caches"]]
    new = call.run(validate=False, backend=backend)
    allowed = allowed_slots(call)
    for guard, before in zip(call.guards["caches"], views_before):
        assert guard.outside_unchanged(), "a byte outside the cache view was written"
        changed = bits(guard.view) != bits(before)
        assert not bool((changed & ~allowed).any()), "a byte outside its slots was written"
    for name, value in index_before.items():
        assert torch.equal(call.kwargs[name], value), f"{name} was written"
    assert new.dtype == call.kwargs["kv_lens"].dtype and new.shape == (call.dims.batch,)
