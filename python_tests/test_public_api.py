"""What every public op shares: arguments by keyword, a rejected call leaves torch's
generator untouched, and the device policy (a tensor on another device is a ValueError
naming it; nothing is copied)."""
from __future__ import annotations

import inspect

import pytest
import torch

import specdec_kernels as sk


def _problem(batch=2, num_drafts=2, vocab=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=gen)
    return target, drafts


@pytest.mark.parametrize("op", ["verify_chain", "sample", "verify_tree"])
def test_rejected_call_leaves_the_generator_untouched(op):
    """seed=None draws from torch's generator only once every argument has passed."""
    target, drafts = _problem()
    calls = {
        "verify_chain": lambda: sk.verify_chain(target, drafts, num_draft_tokens=5),
        "sample": lambda: sk.sample(target[:, 0], top_p=torch.tensor([0.5, 2.0])),
        "verify_tree": lambda: sk.verify_tree(target, drafts.new_zeros(2, 3),
                                              torch.tensor([[-1, 0, 0], [-1, 0, 2]])),
    }
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with pytest.raises(ValueError):
        calls[op]()
    with pytest.raises(ValueError, match="backend"):
        sk.sample(target[:, 0], backend="nowhere")
    for bad_offset in (2**64, "x", torch.tensor([1, 2, 3]), 1.5):
        with pytest.raises((ValueError, TypeError), match="offset"):
            sk.sample(target[:, 0], offset=bad_offset)
    assert torch.equal(torch.rand(3), expected)


def test_public_ops_take_every_argument_by_keyword():
    """The public ops keep their signatures (the device guard wraps them): every argument,
    the first included, may be passed by keyword."""
    target, drafts = _problem()
    out = sk.verify_chain(target_logits=target, draft_token_ids=drafts, seed=1)
    assert torch.equal(out.output_token_ids, sk.verify_chain(target, drafts, seed=1).output_token_ids)
    assert sk.sample(logits=target[:, 0], seed=1).shape == (2,)
    parents = torch.tensor([[-1, 0, 1]] * 2)
    tree = sk.verify_tree(target_logits=target, tree_token_ids=drafts.new_zeros(2, 3),
                          parents=parents, seed=1)
    assert tree.num_accepted.shape == (2,)
    for op in (sk.verify_chain, sk.sample, sk.verify_tree):
        assert "validate" in inspect.signature(op).parameters


def test_a_tensor_on_another_device_is_an_error_naming_it():
    """One device policy for every op: each tensor argument lives on the device of the op's
    main tensor; one elsewhere ("meta" stands in for another device here) is a ValueError
    naming it, never a silent copy."""
    target, drafts = _problem()
    elsewhere = torch.device("meta")
    parents = torch.tensor([[-1, 0, 1]] * 2)
    cache = torch.zeros(2, 8, 1, 1)
    calls = {
        "temperature": lambda: sk.sample(target[:, 0], temperature=torch.ones(2, device=elsewhere)),
        "draft_token_ids": lambda: sk.verify_chain(target, drafts.to(elsewhere)),
        "num_draft_tokens": lambda: sk.verify_chain(
            target, drafts, num_draft_tokens=torch.ones(2, dtype=torch.int64, device=elsewhere)),
        "num_nodes": lambda: sk.build_tree_attention(
            parents, num_nodes=torch.full((2,), 3, device=elsewhere)),
        "prefix_lens": lambda: sk.build_tree_attention(
            parents, prefix_lens=torch.zeros(2, dtype=torch.int64, device=elsewhere)),
        "kv_lens": lambda: sk.compact_kv_cache(
            cache, torch.zeros(2, dtype=torch.int64, device=elsewhere), parents.clamp(min=0),
            torch.ones(2, dtype=torch.int64)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{name}: expected a .*on cpu"):
            call()
