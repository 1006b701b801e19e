"""The Triton kernels of block verification (``verify_chain(method="block")``) and traversal
verification (``verify_tree(method="traversal")``) equal the reference token for token
(TRITON_INTERPRET=1 on CPU tensors, as CI runs them; CUDA tensors on a GPU). Decisions may
differ only within float rounding of a threshold (sums in another order, exp2 for exp): the
mismatch rate over requests is printed and bounded by MAX_MISMATCH_RATE. Shapes are small:
the statistics are on the reference path (``test_block_traversal.py``).
"""
from __future__ import annotations

import os

import pytest
import torch

import specdec_kernels as sk
from conftest import mixed_params, spy_launches
from test_triton_chain import _problem
from test_triton_tree import random_trees

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
MAX_MISMATCH_RATE = 0.02


def _to(value):
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


def _chain_case(mode, dtype, batch, num_drafts, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    params = mixed_params(batch, vocab, gen)
    target, drafts, kwargs = _problem(batch, num_drafts, vocab, dtype, mode, gen, params)
    target[0, :, vocab // 2:] = -torch.inf  # a mask on every row of request 0
    num_draft_tokens = torch.randint(0, num_drafts + 1, (batch,), generator=gen)
    num_draft_tokens[: batch // 2] = num_drafts
    kwargs.update(params, num_draft_tokens=num_draft_tokens, offset=5, method="block",
                  seed=torch.randint(-2**62, 2**62, (batch,), generator=gen))
    return target, drafts, kwargs


def _chain_mismatches(target, drafts, kwargs):
    got = sk.verify_chain(_to(target), _to(drafts), backend="triton",
                          **{k: _to(v) for k, v in kwargs.items()})
    want = sk.verify_chain(target, drafts, backend="reference", **kwargs)
    same = (got.output_token_ids.cpu() == want.output_token_ids).all(1) & \
        (got.num_accepted.cpu() == want.num_accepted)
    return int((~same).sum()), want


@pytest.mark.parametrize("mode,dtype", [("draft_probs", torch.float32),
                                        ("draft_logits", torch.bfloat16),
                                        ("one_hot", torch.float16)])
def test_block_matches_reference(mode, dtype):
    target, drafts, kwargs = _chain_case(mode, dtype, 10, 4, 97, seed=11)
    differ, want = _chain_mismatches(target, drafts, kwargs)
    print(f"block {mode} {dtype}: {differ}/10 requests differ")
    assert differ / 10 <= MAX_MISMATCH_RATE
    assert 0 < int(want.num_accepted.sum())


def test_block_split_rows_and_race(monkeypatch):
    """Residual masses split over chunks, unmerged statistics partials and the two-stage race
    (whose second stage replays w_tau): the same tokens."""
    from specdec_kernels.triton import block, race, stats
    monkeypatch.setattr(block, "MASS_CHUNK_OVERRIDE", 64)
    monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", 64)
    monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", 64)
    monkeypatch.setattr(race._rng, "RACE_GROUP", 64)
    launched = spy_launches(monkeypatch, block, "_residual_mass_kernel")
    target, drafts, kwargs = _chain_case("draft_probs", torch.float32, 8, 3, 200, seed=12)
    kwargs.pop("top_k"), kwargs.pop("top_p")  # unfiltered rows keep their partials
    differ, _ = _chain_mismatches(target, drafts, kwargs)
    assert differ <= 1
    assert launched == [(8, 2, 4)]


def test_block_takes_the_token_path_when_it_gives_the_same_tokens(monkeypatch):
    """K <= 1, or every request greedy: no residual-mass launch, token's tokens."""
    from specdec_kernels.triton import block
    launched = spy_launches(monkeypatch, block, "_residual_mass_kernel")
    for num_drafts, temperature in ((1, 1.0), (3, 0.0)):
        target, drafts, kwargs = _chain_case("draft_probs", torch.float32, 6, num_drafts, 50, 13)
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        block_out = sk.verify_chain(_to(target), _to(drafts), backend="triton",
                                    **{k: _to(v) for k, v in kwargs.items()})
        token_out = sk.verify_chain(_to(target), _to(drafts), backend="triton",
                                    **{k: _to(v) for k, v in {**kwargs, "method": "token"}.items()})
        assert torch.equal(block_out.output_token_ids, token_out.output_token_ids)
    assert launched == []


@pytest.mark.parametrize("mode,dtype", [("iid", torch.float32), ("without_replacement", torch.bfloat16)])
def test_traversal_matches_reference(mode, dtype):
    batch, nodes, vocab = 8, 7, 40
    target, tokens, parents, q, num_nodes = random_trees(batch, nodes, vocab, mode, seed=21)
    gen = torch.Generator().manual_seed(22)
    kwargs = dict(draft_probs=q, draft_sampling=mode, num_nodes=num_nodes, method="traversal",
                  seed=torch.randint(0, 2**40, (batch,), generator=gen), offset=3,
                  **mixed_params(batch, vocab, gen))
    target = target.to(dtype)
    got = sk.verify_tree(_to(target), _to(tokens), _to(parents), backend="triton",
                         **{k: _to(v) for k, v in kwargs.items()})
    want = sk.verify_tree(target, tokens, parents, backend="reference", **kwargs)
    same = torch.ones(batch, dtype=torch.bool)
    for a, b in zip(got[:3], want[:3]):  # tokens, path, num_accepted (logprobs None)
        a = a.cpu()
        same &= (a == b).all(1) if a.dim() == 2 else (a == b)
    print(f"traversal {mode}: {int((~same).sum())}/{batch} requests differ")
    assert int((~same).sum()) / batch <= MAX_MISMATCH_RATE
    assert int(want.num_accepted.sum()) > 0


def test_chain_shaped_tree_traversal_equals_block_on_triton():
    batch, num_drafts, vocab = 8, 4, 30
    target, drafts, kwargs = _chain_case("draft_probs", torch.float32, batch, num_drafts, vocab, 14)
    q, n = kwargs.pop("draft_probs"), kwargs.pop("num_draft_tokens")
    kwargs.pop("method")
    chain = sk.verify_chain(_to(target), _to(drafts), draft_probs=_to(q), num_draft_tokens=_to(n),
                            method="block", backend="triton",
                            **{k: _to(v) for k, v in kwargs.items()})
    tree_tokens = torch.cat([torch.full((batch, 1), -1), drafts], 1)
    parents = torch.arange(-1, num_drafts).expand(batch, -1)
    tree_q = torch.cat([q, torch.full((batch, 1, vocab), 1.0 / vocab)], 1)
    tree = sk.verify_tree(_to(target), _to(tree_tokens), _to(parents), draft_probs=_to(tree_q),
                          num_nodes=_to(n + 1), method="traversal", backend="triton",
                          **{k: _to(v) for k, v in kwargs.items()})
    assert torch.equal(tree.output_token_ids.cpu(), chain.output_token_ids.cpu())
    assert torch.equal(tree.num_accepted.cpu(), chain.num_accepted.cpu())
