"""The Triton tree kernels equal the reference token for token (under TRITON_INTERPRET=1 on CPU
tensors, as CI runs them; on CUDA tensors when a GPU is present).

Decisions may differ only within floating-point rounding of their threshold (the kernels sum
in a different order, and exp/log may differ in the last ulp): the mismatch rate over
requests is printed and bounded by MAX_MISMATCH_RATE (conftest).
"""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import DEVICE, DTYPES, MAX_MISMATCH_RATE, needs_triton, spy_launches

pytestmark = needs_triton
MODES = ["deterministic", "iid", "without_replacement"]


def random_trees(batch: int, nodes: int, vocab: int, mode: str, seed: int):
    """Random trees whose drafts are often accepted: target and draft logits are close, and
    children are drawn from their parent's draft row (without replacement for that mode;
    top candidates for deterministic trees), with some duplicates in i.i.d. trees."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, nodes, vocab, generator=gen) * 2.0
    draft_logits = target + 0.7 * torch.randn(batch, nodes, vocab, generator=gen)
    q = torch.softmax(draft_logits, -1)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):  # shallow-biased random trees: parent among the last few nodes
        low = max(0, i - 4)
        parents[:, i] = torch.randint(low, i, (batch,), generator=gen)
    tokens = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b in range(batch):
        for u in range(nodes):
            kids = (parents[b] == u).nonzero()[:, 0]
            if len(kids) == 0:
                continue
            if mode == "deterministic":
                order = torch.argsort(q[b, u], descending=True, stable=True)
                tokens[b, kids] = order[:len(kids)] if len(kids) <= vocab else order[0]
            else:
                replace = mode == "iid" or len(kids) > vocab
                tokens[b, kids] = torch.multinomial(q[b, u], len(kids), replacement=replace,
                                                    generator=gen)
    num_nodes = torch.randint(1, nodes + 1, (batch,), generator=gen)
    num_nodes[: batch // 2] = nodes
    return target, tokens, parents, q, num_nodes


def _compare(batch, nodes, vocab, mode, dtype, seed, q_dtype=torch.float32, **params):
    target, tokens, parents, q, num_nodes = random_trees(batch, nodes, vocab, mode, seed)
    target = target.to(dtype).to(DEVICE)
    kw = dict(num_nodes=num_nodes.to(DEVICE), seed=torch.arange(batch, device=DEVICE) * 13 + seed,
              offset=torch.full((batch,), 3, device=DEVICE), **params)
    if mode != "deterministic":
        kw.update(draft_probs=q.to(q_dtype).to(DEVICE), draft_sampling=mode)
    args = (target, tokens.to(DEVICE), parents.to(DEVICE))
    ref = sk.verify_tree(*args, backend="reference", **kw)
    tri = sk.verify_tree(*args, backend="triton", **kw)
    assert tri.output_token_ids.dtype == torch.int32 and tri.accepted_nodes.dtype == torch.int32
    assert tri.num_accepted.dtype == torch.int32
    out = tri.output_token_ids.cpu()
    assert bool(((out >= -1) & (out < vocab)).all())
    same = ((tri.output_token_ids == ref.output_token_ids).all(1)
            & (tri.accepted_nodes == ref.accepted_nodes).all(1)
            & (tri.num_accepted == ref.num_accepted)).cpu()
    rate = 1.0 - float(same.double().mean())
    shown = {k: "per-request" if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    print(f"{mode} {dtype} V={vocab} N={nodes} {shown}: mismatch rate {rate:.4f} "
          f"({int((~same).sum())}/{batch}), mean accepted {float(ref.num_accepted.double().mean()):.2f}")
    assert rate <= MAX_MISMATCH_RATE
    return ref, tri


SAMPLING = {
    "plain": dict(temperature=1.0),
    "mixed": dict(temperature=torch.tensor([0.0, 0.8, 1.0, 1.3] * 3),
                  top_k=torch.tensor([0, 5, 0, 3] * 3), top_p=torch.tensor([1.0, 1.0, 0.8, 0.9] * 3)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("mode", MODES)
def test_triton_equals_reference(mode, dtype):
    params = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
              for k, v in SAMPLING["mixed"].items()}
    ref, _ = _compare(12, 10, 32, mode, dtype, seed=MODES.index(mode), **params)
    assert int(ref.num_accepted.max()) >= 2  # the trees are actually walked


@pytest.mark.parametrize("mode", MODES)
def test_triton_small_vocab_duplicates_and_padding(mode):
    # V = 5 with up to 4 children per node: duplicates (i.i.d.), exhausted candidates,
    # residuals that run out of mass; half the requests padded.
    _compare(16, 12, 5, mode, torch.float32, seed=7, temperature=1.0)


@pytest.mark.parametrize("mode", MODES)
def test_triton_multi_group_race(monkeypatch, mode):
    """Groups of 8 tokens over V = 61 (8 groups, the last partial): the walk's two-level race
    equals the reference, and a chain-shaped tree still equals the chain (below)."""
    from specdec_kernels import _rng
    monkeypatch.setattr(_rng, "RACE_GROUP", 8)
    _compare(12, 10, 61, mode, torch.float32, seed=3 + MODES.index(mode),
             **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                for k, v in SAMPLING["mixed"].items()})
    test_triton_chain_shaped_tree_equals_triton_chain()


@pytest.mark.parametrize("mode", MODES)
def test_triton_split_unfiltered_statistics(monkeypatch, mode):
    """Node rows split over programs with no filter on: the walk merges the partials as it
    reads each row (no finish kernel) and still equals the reference."""
    from specdec_kernels.triton import stats
    monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", 16)
    launched = spy_launches(monkeypatch, stats, "_row_stats_finish_kernel")
    _compare(12, 10, 61, mode, torch.float32, seed=5 + MODES.index(mode),
             temperature=torch.tensor([0.0, 0.8, 1.0, 1.3] * 3, device=DEVICE))
    assert not launched


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
@pytest.mark.parametrize("garbage", ["nan", "inf", "negative"])
def test_triton_garbage_draft_probs_like_reference(mode, garbage):
    """Draft probabilities are never read by validation: NaN, +inf or negative entries give
    the reference's tokens (a NaN residual emits -1 on both), never an id outside [0, V)."""
    gen = torch.Generator().manual_seed(21)
    batch, nodes, vocab = 10, 5, 40
    parents = torch.tensor([-1, 0, 0, 1, 2]).repeat(batch, 1)
    tokens = torch.randint(0, vocab, (batch, nodes), generator=gen)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    q[:, :, 7] = {"nan": float("nan"), "inf": float("inf"), "negative": -0.5}[garbage]
    kw = dict(draft_probs=q.to(DEVICE), draft_sampling=mode,
              seed=torch.arange(batch, device=DEVICE), offset=1)
    args = (logits.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE))
    ref = sk.verify_tree(*args, backend="reference", **kw)
    tri = sk.verify_tree(*args, backend="triton", **kw)
    assert torch.equal(tri.output_token_ids.cpu(), ref.output_token_ids.cpu())
    assert torch.equal(tri.accepted_nodes.cpu(), ref.accepted_nodes.cpu())
    out = tri.output_token_ids.cpu()
    assert bool(((out >= -1) & (out < vocab)).all())
    if garbage == "nan":  # the case is exercised: some request's final token is the NaN's -1
        assert bool((out.gather(1, tri.num_accepted.cpu().long()[:, None]) == -1).any())


def test_triton_greedy_and_draft_dtype():
    _compare(8, 9, 33, "iid", torch.bfloat16, seed=5, q_dtype=torch.bfloat16, temperature=0.0)
    _compare(8, 9, 33, "without_replacement", torch.float16, seed=6, q_dtype=torch.float16,
             temperature=0.9, top_p=0.7)


def test_triton_chain_shaped_tree_equals_triton_chain():
    batch, num_drafts, vocab = 8, 4, 40
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2).to(DEVICE)
    q = torch.softmax(logits[:, :num_drafts].cpu() + torch.randn(batch, num_drafts, vocab,
                                                                 generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    kw = dict(seed=torch.arange(batch, device=DEVICE), offset=2, backend="triton")
    chain = sk.verify_chain(logits, drafts.to(DEVICE), draft_probs=q.to(DEVICE), **kw)
    tree = sk.verify_tree(logits, torch.cat([torch.full((batch, 1), -1), drafts], 1).to(DEVICE),
                          torch.arange(-1, num_drafts).expand(batch, -1).to(DEVICE),
                          draft_probs=torch.cat([q, q[:, :1]], 1).to(DEVICE), **kw)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)


def test_triton_row_without_finite_logit():
    logits = torch.full((2, 3, 6), -torch.inf, device=DEVICE)
    logits[1, 0, 2] = 0.0
    out = sk.verify_tree(logits, torch.tensor([[-1, 1, 2]] * 2, device=DEVICE),
                         torch.tensor([[-1, 0, 0]] * 2, device=DEVICE), seed=0, backend="triton")
    # Request 1: node 2 (token 2, the only finite logit) is accepted, then its row has none.
    assert out.output_token_ids.tolist() == [[-1, -1, -1], [2, -1, -1]]
    assert out.accepted_nodes.tolist() == [[0, -1, -1], [0, 2, -1]]
    assert out.num_accepted.tolist() == [0, 1]


def test_triton_unvalidated_ids_past_int32_like_reference():
    """validate=False: ids and parents are checked in their own width before they are
    narrowed, so 2**32 + 3 is an invalid id (as in the reference), not id 3."""
    logits = torch.zeros(1, 3, 10)
    logits[0, 0, 3] = logits[0, 1, 0] = 9.0
    cases = [(torch.tensor([[-1, 2**32 + 3, 5]]), torch.tensor([[-1, 0, 0]])),
             (torch.tensor([[-1, 3, 0]]), torch.tensor([[-1, 0, 2**32 + 1]]))]
    for ids, parents in cases:
        outs = [sk.verify_tree(logits.to(DEVICE), ids.to(DEVICE), parents.to(DEVICE),
                               temperature=0.0, backend=backend, validate=False, seed=1)
                for backend in ("reference", "triton")]
        assert outs[0].num_accepted.tolist() == [0 if ids[0, 1] > 10 else 1]
        for got, want in zip(outs[1][:3], outs[0][:3]):  # (logprobs: None, not asked)
            assert torch.equal(got.cpu(), want.cpu())
        assert outs[0].logprobs is None and outs[1].logprobs is None
