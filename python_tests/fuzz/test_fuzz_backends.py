"""Fuzz: the backends agree. Triton == reference token for token on valid input (under
TRITON_INTERPRET=1 on CPU: tiny shapes, few examples); the C++ extension == reference bit
for bit, on valid input and on the garbage both skip alike (unvalidated lengths, counts,
nodes and block ids past the cache)."""
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from calls import KV_OPS, draw_call
from conftest import EXTENSION_BACKENDS, triton_refuses
from strategies import GARBAGE_INT, bits, examples

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU tensors need TRITON_INTERPRET=1 for Triton")
needs_extension = EXTENSION_BACKENDS[1].marks[0]  # skipif the extension is not built


LOGPROB_TOLERANCE = 1e-4  # absolute, on float32 log-probabilities of the same tokens


def _same(a, b):
    """Tokens (and counts, paths) equal; ``logprobs`` within LOGPROB_TOLERANCE, NaN where
    the other's is (the -1 slots), None on both sides unless asked."""
    if not isinstance(a, tuple):
        return torch.equal(a, b)
    for name, x, y in zip(a._fields, a, b):
        if x is None or y is None:
            if not x is y is None:
                return False
        elif name == "logprobs":
            if not torch.allclose(x, y, rtol=0, atol=LOGPROB_TOLERANCE, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


@needs_interpreter
@pytest.mark.parametrize("op", ["sample", "verify_chain", "verify_chain_packed", "verify_tree"])
@examples(8)
@given(data=st.data())
def test_triton_equals_reference(op, data):
    """Only the arguments the Triton backend takes today are drawn (found at run time)."""
    call = data.draw(draw_call(op, max_batch=2, max_rows=3, max_vocab=24,
                               exclude=triton_refuses(op)), label="call")
    assert _same(call.run(backend="triton"), call.run(backend="reference"))


@needs_extension
@examples(80)
@given(data=st.data(), garbage=st.booleans())
def test_extension_tree_attention_equals_reference(data, garbage):
    call = data.draw(draw_call("build_tree_attention", garbage=garbage, max_rows=70),
                     label="call")
    got = call.run(backend="extension", validate=not garbage)
    want = call.run(backend="reference", validate=not garbage)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@st.composite
def skipped_garbage(draw, call):
    """A valid compaction call with some entries that both backends skip: negative or huge
    kv_lens, num_accepted past N - 1 (clamped), a path tail of nodes >= N (still increasing),
    block ids outside the pool (never two columns on one block)."""
    kw = call.kwargs
    batch, nodes = kw["accepted_nodes"].shape
    for b in range(batch):
        kind = draw(st.sampled_from(["none", "kv_lens", "num_accepted", "tail", "block"]))
        if kind == "kv_lens":
            info = torch.iinfo(kw["kv_lens"].dtype)
            kw["kv_lens"][b] = max(min(draw(GARBAGE_INT), info.max), info.min)
        elif kind == "num_accepted":
            kw["num_accepted"][b] = draw(st.sampled_from([nodes, nodes + 5, 2**31 - 1]))
        elif kind == "tail" and int(kw["num_accepted"][b]) >= 1:
            k = draw(st.integers(1, int(kw["num_accepted"][b])))
            kw["accepted_nodes"][b, k:] = torch.arange(nodes - k) + nodes + draw(
                st.integers(0, 3))
        elif kind == "block" and "block_tables" in kw:
            column = draw(st.integers(0, kw["block_tables"].shape[1] - 1))
            kw["block_tables"][b, column] = draw(st.sampled_from(
                [-1, kw["caches"][0].shape[0], 2**31 - 1]))
    return call


@needs_extension
@pytest.mark.parametrize("op", KV_OPS)
@examples(80)
@given(data=st.data(), garbage=st.booleans())
def test_extension_compaction_equals_reference(op, data, garbage):
    call = data.draw(draw_call(op), label="call")
    if garbage:
        call = data.draw(skipped_garbage(call), label="garbage")
    originals = [g.buffer.clone() for g in call.guards["caches"]]
    want = call.run(backend="reference", validate=not garbage)
    want_bytes = [bits(g.buffer).clone() for g in call.guards["caches"]]
    for guard, original in zip(call.guards["caches"], originals):
        guard.buffer.copy_(original)
    got = call.run(backend="extension", validate=not garbage)
    assert torch.equal(got, want)
    for guard, expected in zip(call.guards["caches"], want_bytes):
        assert torch.equal(bits(guard.buffer), expected)
        assert guard.outside_unchanged()
