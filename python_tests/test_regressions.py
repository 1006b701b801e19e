"""Regression tests for the input-handling defects found by fuzzing (issue 17), one per
reproducer: the error is a ValueError/TypeError naming the argument, nothing is written, and
the backends agree on what they skip."""
import pytest
import torch

import specdec_kernels as sk

from conftest import CHAIN_BACKENDS, EXTENSION_BACKENDS as KV_BACKENDS, SAMPLE_BACKENDS


# 1. Python ints outside int64 name the argument.
@pytest.mark.parametrize("name, value", [("prefix_lens", 2**63), ("num_nodes", 2**70),
                                         ("prefix_lens", -2**63 - 1)])
@pytest.mark.parametrize("validate", [True, False])
def test_tree_attention_int_past_int64_names_the_argument(name, value, validate):
    with pytest.raises(ValueError, match=name):
        sk.build_tree_attention(torch.tensor([[-1, 0, 1]]), **{name: value}, validate=validate)


@pytest.mark.parametrize("backend", KV_BACKENDS)
def test_tree_attention_prefix_whose_position_ids_pass_int64(backend):
    parents = torch.tensor([[-1, 0, 1]])
    with pytest.raises(ValueError, match="prefix_lens"):
        sk.build_tree_attention(parents, prefix_lens=torch.tensor([2**63 - 2]), backend=backend)
    top = sk.build_tree_attention(parents, prefix_lens=torch.tensor([2**63 - 3]), backend=backend)
    assert top.position_ids.tolist() == [[2**63 - 3, 2**63 - 2, 2**63 - 1]]
    # Unvalidated, both backends wrap as torch's int64 addition does.
    wrapped = sk.build_tree_attention(parents, prefix_lens=torch.tensor([2**63 - 1]),
                                      backend=backend, validate=False)
    assert wrapped.position_ids.tolist() == [[2**63 - 1, -2**63, -2**63 + 1]]
    small = sk.build_tree_attention(parents, prefix_lens=torch.tensor([5], dtype=torch.int32),
                                    backend=backend)
    assert small.position_ids.tolist() == [[5, 6, 7]]


# 2. Compaction validation does not overflow int64; unvalidated, the backends skip alike.
@pytest.mark.parametrize("backend", KV_BACKENDS)
def test_compaction_lengths_near_int64_max(backend):
    cache = torch.arange(8.).view(1, 8, 1, 1)
    before = cache.clone()
    with pytest.raises(ValueError, match="accepted_nodes.*past the cache"):
        sk.compact_kv_cache([cache], torch.tensor([2**63 - 1]), torch.tensor([[0, 1]]),
                            torch.tensor([1]), backend=backend)
    with pytest.raises(ValueError, match="accepted_nodes.*past the cache"):
        sk.compact_kv_cache([cache], torch.tensor([2**63 - 2]), torch.tensor([[0, 2, 3, -1]]),
                            torch.tensor([2]), backend=backend)
    paged = torch.zeros(4, 2, 1, 1)
    with pytest.raises(ValueError, match="accepted_nodes.*block table"):
        sk.compact_paged_kv_cache([paged], torch.tensor([[0, 1]]), torch.tensor([2**63 - 1]),
                                  torch.tensor([[0, 1]]), torch.tensor([1]), backend=backend)
    # int32 lengths: a new length past int32 is rejected too (it could not be returned).
    big = torch.zeros(1, 1, 1, 1).expand(1, 2**31 + 4, 1, 1)  # no storage of that size
    with pytest.raises(ValueError, match="accepted_nodes"):
        sk.compact_kv_cache([big], torch.tensor([2**31 - 2], dtype=torch.int32),
                            torch.tensor([[0, 1]]), torch.tensor([1]), backend=backend)
    new = sk.compact_kv_cache([cache], torch.tensor([2**63 - 2]), torch.tensor([[0, 2, 3, -1]]),
                              torch.tensor([2]), backend=backend, validate=False)
    assert new.tolist() == [-2**63 + 1]  # wrapped as torch's int64 addition wraps
    assert torch.equal(cache, before)


# 3. Index tensors on a device that holds no data name the argument.
@pytest.mark.parametrize("name", ["kv_lens", "accepted_nodes", "num_accepted", "block_tables"])
def test_compaction_index_on_meta_names_the_argument(name):
    args = dict(kv_lens=torch.tensor([0]), accepted_nodes=torch.tensor([[0, 1]]),
                num_accepted=torch.tensor([1]), block_tables=torch.tensor([[0, 1]]))
    args[name] = args[name].to("meta")
    cache = torch.arange(8.).view(4, 2, 1, 1)
    with pytest.raises(ValueError, match=f"{name}: expected a tensor on cpu"):
        sk.compact_paged_kv_cache([cache], args["block_tables"], args["kv_lens"],
                                  args["accepted_nodes"], args["num_accepted"])
    if name != "block_tables":
        del args["block_tables"]
        with pytest.raises(ValueError, match=f"{name}: expected a tensor on cpu"):
            sk.compact_kv_cache([cache.view(1, 8, 1, 1)], **args)
    assert torch.equal(cache.flatten(), torch.arange(8.))


@pytest.mark.parametrize("name", ["num_nodes", "prefix_lens"])
def test_tree_attention_index_on_meta_names_the_argument(name):
    with pytest.raises(ValueError, match=f"{name}: expected a tensor on cpu"):
        sk.build_tree_attention(torch.tensor([[-1, 0]]),
                                **{name: torch.tensor([1], device="meta")})


# 4. An empty contiguous paged cache of any rank is accepted.
@pytest.mark.parametrize("backend", KV_BACKENDS)
@pytest.mark.parametrize("shape", [(4, 2, 0), (4, 2, 3, 0), (4, 2, 3, 0, 2), (4, 2, 0, 3, 2)])
def test_empty_paged_cache_of_any_rank(backend, shape):
    new = sk.compact_paged_kv_cache([torch.zeros(shape)], torch.tensor([[0, 1]]),
                                    torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([1]),
                                    backend=backend)
    assert new.tolist() == [2]


# 5. float64 parameter tensors are checked in float64, as the same Python numbers are.
@pytest.mark.parametrize("name, value, ok", [
    ("temperature", -1e-50, False), ("temperature", 1e-50, True),
    ("top_p", 1 + 1e-12, False), ("top_p", 1e-50, True), ("top_p", -1e-300, False)])
def test_float64_parameters_checked_before_rounding(name, value, ok):
    logits, drafts = torch.randn(1, 2, 4), torch.tensor([[1]])
    for given in (value, torch.tensor([value], dtype=torch.float64)):
        if ok:
            sk.verify_chain(logits, drafts, **{name: given}, seed=0)
            sk.sample(logits[:, 0], **{name: given}, seed=0)
        else:
            with pytest.raises(ValueError, match=name):
                sk.verify_chain(logits, drafts, **{name: given}, seed=0)
            with pytest.raises(ValueError, match=name):
                sk.processed_probs(logits[:, 0], **{name: given})


# 6. A finite temperature past float32's range is float32's largest: near-uniform over the
# kept tokens, the same tokens on every backend and for every way of passing it.
HUGE_TEMPERATURES = [1e39, 10**40, 3.5e38, torch.tensor([1e39, 1e300], dtype=torch.float64)]


@pytest.mark.parametrize("temperature", HUGE_TEMPERATURES, ids=["1e39", "int", "3.5e38", "f64"])
def test_temperature_past_float32_is_float32_max(temperature):
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5]] * 2)
    probs = sk.processed_probs(logits, temperature=temperature)
    torch.testing.assert_close(probs, torch.full((2, 4), 0.25))
    same = sk.processed_probs(logits, temperature=torch.finfo(torch.float32).max)
    assert torch.equal(probs, same)
    kept = sk.processed_probs(logits, temperature=temperature, top_k=2)
    torch.testing.assert_close(kept, torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 2))
    with pytest.raises(ValueError, match="temperature"):
        sk.processed_probs(logits, temperature=float("inf"))


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_temperature_past_float32_same_tokens_on_every_backend(backend):
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 6, 3, 13
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 4
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    # top_p stays off here: at such temperatures p ties where x does not (tested below).
    args = dict(top_k=torch.tensor([0, 3, 0, 5, 1, 0]), seed=torch.arange(batch), offset=3)
    got = sk.verify_chain(logits, drafts, temperature=1e39, backend=backend, **args)
    want = sk.verify_chain(logits, drafts, temperature=torch.finfo(torch.float32).max,
                           backend="reference", **args)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    parents = torch.tensor([[-1, 0, 0, 1]] * batch)
    tokens = torch.cat([drafts.new_full((batch, 1), -1), drafts], 1)
    tree = sk.verify_tree(logits, tokens, parents, temperature=1e39, backend=backend, **args)
    tree_want = sk.verify_tree(logits, tokens, parents,
                               temperature=torch.finfo(torch.float32).max, backend="reference",
                               **args)
    assert torch.equal(tree.output_token_ids, tree_want.output_token_ids)


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_temperature_past_float32_sample_same_tokens(backend):
    logits = torch.randn(8, 11, generator=torch.Generator().manual_seed(3)) * 5
    got = sk.sample(logits, temperature=1e39, top_k=4, seed=torch.arange(8), backend=backend)
    want = sk.sample(logits, temperature=torch.finfo(torch.float32).max, top_k=4,
                     seed=torch.arange(8), backend="reference")
    assert torch.equal(got, want)


# Where exp collapses distinct logits to one probability (T >= ~1e8 in float32), top-p keeps
# the boundary ties of p below the threshold logit (contract 16; triton/filters.py and the
# C++ path's e-threshold).
@pytest.mark.parametrize("backend", [p for p in SAMPLE_BACKENDS if p != "reference"])
def test_top_p_keeps_ties_of_collapsed_probabilities(backend):
    logits = torch.randn(4, 13, generator=torch.Generator().manual_seed(6)) * 4
    args = dict(temperature=1e8, top_p=0.3, seed=torch.arange(4))
    assert torch.equal(sk.sample(logits, backend=backend, **args),
                       sk.sample(logits, backend="reference", **args))


# 7. Caches that partly overlap are rejected; interleaved views that share no element are not.
@pytest.mark.parametrize("backend", KV_BACKENDS)
def test_partly_overlapping_caches_rejected(backend):
    buffer = torch.arange(20.)
    before = buffer.clone()
    args = (torch.tensor([0]), torch.tensor([[0, 2, 3]]), torch.tensor([1]))
    for second in (buffer[2:18], buffer[0:16], buffer[1:17]):
        with pytest.raises(ValueError, match=r"caches\[1\].*overlaps caches\[0\]"):
            sk.compact_kv_cache([buffer[0:16].view(1, 8, 1, 2), second.view(1, 8, 1, 2)], *args,
                                backend=backend)
    # Views of one buffer one element apart, in a wider row: they share elements.
    halves = torch.zeros(1, 8, 1, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="overlaps"):
        sk.compact_kv_cache([halves[..., 0:2], halves[..., 1:3]], *args, backend=backend)
    # A byte-shifted view shares bytes of elements without sharing any whole element.
    raw = torch.zeros(80, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        sk.compact_kv_cache([raw[0:64].view(torch.float32).view(1, 8, 1, 2),
                             raw[4:68].view(torch.float32).view(1, 8, 1, 2)], *args,
                            backend=backend)
    assert torch.equal(buffer, before) and halves.abs().sum() == 0 and raw.sum() == 0
    # K and V interleaved in one [blocks, 2, block_size, H, D] buffer share no element.
    kv = torch.arange(3 * 2 * 4 * 2, dtype=torch.float32).view(3, 2, 4, 1, 2)
    new = sk.compact_paged_kv_cache([kv[:, 0], kv[:, 1]], torch.tensor([[0, 1]]),
                                    torch.tensor([0]), torch.tensor([[0, 2, 3]]),
                                    torch.tensor([1]), backend=backend)
    assert new.tolist() == [2]
    assert torch.equal(kv[0, 0, 1], torch.tensor([[4.0, 5.0]]))
    assert torch.equal(kv[0, 1, 1], torch.tensor([[12.0, 13.0]]))
    with pytest.raises(ValueError, match="overlaps"):
        sk.compact_paged_kv_cache([kv[:, 0], kv[:, 1], kv[:, 0]], torch.tensor([[0, 1]]),
                                  torch.tensor([0]), torch.tensor([[0, 2, 3]]),
                                  torch.tensor([1]), backend=backend)
