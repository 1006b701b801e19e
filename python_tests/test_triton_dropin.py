"""Triton == reference for the arguments of contract sections 8-10 (min_p, token_bitmask,
return_logprobs, verify_chain_packed read in place), token for token, in the interpreter (small shapes) or on a GPU. Logprobs
agree within float32 rounding (the kernels take log p from the row statistics, the
reference from the materialised probabilities)."""
from __future__ import annotations

import os

import pytest
import torch

import specdec_kernels as sk
from conftest import mixed_params, spy_launches
from test_dropin import bitmask_of, packed_problem
from test_triton_tree import random_trees

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
LOGPROB_TOL = dict(rtol=1e-4, atol=1e-4, equal_nan=True)


def _to(value):
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


def _both(op, **kwargs):
    got = op(**{k: _to(v) for k, v in kwargs.items()}, backend="triton")
    want = op(**kwargs, backend="reference")
    return got, want


def _assert_same(got, want):
    for name, g, w in zip(want._fields, got, want):
        if w is None:
            assert g is None, name
        elif name == "logprobs":
            torch.testing.assert_close(g.cpu(), w, **LOGPROB_TOL)
        else:
            assert torch.equal(g.cpu(), w), name


def _spy_calls(monkeypatch, record) -> list:
    """Wraps the statistics and race kernels so that each launch appends
    ``record(args, kwargs)`` and then runs; returns the list."""
    from specdec_kernels.triton import race, stats
    seen = []
    for module, name in ((stats, "_row_stats_kernel"), (race, "_race_kernel")):
        kernel = getattr(module, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel):
                def launch(*args, **kwargs):
                    seen.append(record(args, kwargs))
                    return kernel[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(module, name, Spy())
    return seen


def _feature_params(batch, vocab, gen):
    params = mixed_params(batch, vocab, gen)
    params["min_p"] = torch.where(torch.arange(batch) % 3 == 1,
                                  0.02 + 0.3 * torch.rand(batch, generator=gen), 0.0)
    return params


@pytest.mark.parametrize("dtype,kind", [(torch.float32, None), (torch.bfloat16, "processed"),
                                        (torch.float16, "raw")])
def test_sample_features_match_reference(dtype, kind):
    gen = torch.Generator().manual_seed(31)
    batch, vocab = 10, 301  # not a multiple of 32
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
    allowed = torch.rand(batch, vocab, generator=gen) < 0.5
    allowed[3] = False  # nothing allowed
    params = _feature_params(batch, vocab, gen)
    seeds = torch.arange(batch) * 17
    for mask in (None, bitmask_of(allowed)):
        got, want = _both(sk.sample, logits=logits, token_bitmask=mask, seed=seeds, offset=3,
                          return_logprobs=kind, **params)
        if kind is None:
            assert torch.equal(got.cpu(), want)
        else:
            _assert_same(got, want)


# Each draft mode with one combination of the features (all combinations cost the
# interpreter minutes; the kernels' feature branches are independent constexprs).
CHAIN_CASES = [("one_hot", True, "processed"), ("draft_probs", False, "raw"),
               ("draft_logits", True, "raw")]


@pytest.mark.parametrize("mode,use_mask,kind", CHAIN_CASES)
def test_chain_features_match_reference(mode, use_mask, kind):
    gen = torch.Generator().manual_seed(32)
    batch, num_drafts, vocab = 9, 3, 77
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2.5
    draft_logits = target[:, :num_drafts] + torch.randn(batch, num_drafts, vocab, generator=gen)
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=gen) < 0.6
    allowed[2, 1] = False
    drafts = torch.where(allowed[:, :num_drafts], target[:, :num_drafts], -99).argmax(-1)
    draft_kw = {"one_hot": {}, "draft_probs": {"draft_probs": torch.softmax(draft_logits, -1)},
                "draft_logits": {"draft_logits": draft_logits}}[mode]
    params = _feature_params(batch, vocab, gen)
    got, want = _both(sk.verify_chain, target_logits=target, draft_token_ids=drafts,
                      token_bitmask=bitmask_of(allowed) if use_mask else None,
                      return_logprobs=kind, seed=torch.arange(batch), offset=5,
                      num_draft_tokens=torch.tensor([3, 3, 2, 0, 1, 3, 2, 3, 1]),
                      **draft_kw, **params)
    _assert_same(got, want)


@pytest.mark.parametrize("mode,use_mask,kind", [("deterministic", True, "processed"),
                                                 ("iid", True, "raw")])
def test_tree_features_match_reference(mode, use_mask, kind):
    gen = torch.Generator().manual_seed(33)
    batch, nodes, vocab = 5, 6, 70
    target = torch.randn(batch, nodes, vocab, generator=gen) * 2
    allowed = torch.rand(batch, nodes, vocab, generator=gen) < 0.5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * batch)
    tokens = torch.where(allowed, target, -99).argmax(-1).gather(1, parents.clamp(min=0))
    tokens[:, 2] = torch.randint(0, vocab, (batch,), generator=gen)
    draft = {} if mode == "deterministic" else dict(
        draft_probs=torch.softmax(target + torch.randn(target.shape, generator=gen), -1),
        draft_sampling=mode)
    params = _feature_params(batch, vocab, gen)
    got, want = _both(sk.verify_tree, target_logits=target, tree_token_ids=tokens,
                      parents=parents, token_bitmask=bitmask_of(allowed) if use_mask else None,
                      return_logprobs=kind, seed=torch.arange(batch) + 4, **draft, **params)
    _assert_same(got, want)


def _packed_problem_of(mode, lengths, **kwargs):
    """``packed_problem`` with draft logits (``mode="draft_logits"``) or one-hot drafts."""
    packed, padded = packed_problem(lengths, **kwargs)
    for d in (packed, padded):
        logits = d.pop("draft_logits")
        if mode == "draft_logits":
            d["draft_logits"] = logits
    return packed, padded


@pytest.mark.parametrize("mode", ["one_hot", "draft_logits"])
def test_packed_matches_padded_and_reference(mode):
    lengths = [3, 0, 2, 3, 1, 0]
    packed, padded = _packed_problem_of(mode, lengths, dtype=torch.bfloat16, seed=4)
    gen = torch.Generator().manual_seed(5)
    params = _feature_params(len(lengths), 37, gen)
    kw = dict(seed=torch.arange(len(lengths)) * 3, offset=1, return_logprobs="processed",
              **params)
    got, want = _both(sk.verify_chain_packed, max_draft_tokens=3, **packed, **kw)
    _assert_same(got, want)
    padded_triton = sk.verify_chain(**{k: _to(v) for k, v in {**padded, **kw}.items()},
                                    backend="triton")
    _assert_same(got, type(padded_triton)(*(None if t is None else t.cpu()
                                            for t in padded_triton)))


def test_packed_reads_rows_in_place(monkeypatch):
    """No padded copy: the statistics and the race get the packed tensors themselves."""
    packed, _ = packed_problem([2, 0, 3], vocab=37)
    target = _to(packed["target_logits"])
    draft_logits = _to(packed["draft_logits"])
    seen = _spy_calls(monkeypatch, lambda args, kwargs: args[0].data_ptr())
    sk.verify_chain_packed(target, _to(packed["draft_token_ids"]),
                           _to(packed["cu_num_draft_tokens"]), max_draft_tokens=3, seed=1,
                           draft_logits=draft_logits, backend="triton")
    assert seen == [target.data_ptr(), draft_logits.data_ptr(), target.data_ptr()]


def test_split_rows_and_split_race_with_features(monkeypatch):
    """min_p (a finished row), raw logprobs (the T = 1 partials merged by the finish kernel)
    and the bitmask on rows split over programs and a race split over chunks."""
    from specdec_kernels import _rng
    from specdec_kernels.triton import race, stats
    monkeypatch.setattr(_rng, "RACE_GROUP", 64)
    monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", 128)
    monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", 128)
    gen = torch.Generator().manual_seed(34)
    batch, num_drafts, vocab = 4, 1, 300
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 3
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=gen) < 0.3
    drafts = torch.where(allowed[:, :num_drafts], target[:, :num_drafts], -99).argmax(-1)
    params = _feature_params(batch, vocab, gen)
    assert stats.stats_chunks(batch * 2, vocab, torch.device(DEVICE))[1] > 1
    got, want = _both(sk.verify_chain, target_logits=target, draft_token_ids=drafts,
                      token_bitmask=bitmask_of(allowed), return_logprobs="raw",
                      seed=torch.arange(batch), offset=2,
                      draft_probs=torch.softmax(target[:, :num_drafts], -1), **params)
    _assert_same(got, want)


def test_disabled_features_launch_the_plain_kernels(monkeypatch):
    """A call with min_p=0, no bitmask and no logprobs launches exactly what the plain call
    does, with the features' constexprs at their defaults (compiled out)."""
    gen = torch.Generator().manual_seed(35)
    target = _to(torch.randn(3, 3, 50, generator=gen))
    drafts = _to(torch.randint(0, 50, (3, 2), generator=gen))
    seen = _spy_calls(monkeypatch, lambda args, kwargs: sorted(
        k for k in kwargs if k in ("USE_MIN_P", "HAS_BITMASK", "RAW", "LOGPROBS", "PACKED")))
    plain = sk.verify_chain(target, drafts, seed=1, backend="triton")
    off = sk.verify_chain(target, drafts, seed=1, backend="triton", min_p=0.0,
                          token_bitmask=None, return_logprobs=None)
    assert torch.equal(plain.output_token_ids, off.output_token_ids)
    assert seen == [[], [], [], []]
    sk.verify_chain(target, drafts, seed=1, backend="triton", min_p=0.1, return_logprobs="raw")
    assert seen[-2:] == [["RAW", "USE_MIN_P"], ["LOGPROBS"]]


@pytest.mark.parametrize("mode", ["one_hot", "draft_logits"])
def test_block_with_bitmask_and_logprobs_matches_reference(mode):
    """Block verification with the section 8-10 features: the acceptance and the residual
    masses honour the bitmask (p of a masked draft is 0), logprobs are written, and the
    packed rows are read in place; Triton == reference, padded and packed."""
    lengths = [3, 3, 2, 3, 1, 0, 3, 2]
    packed, padded = _packed_problem_of(mode, lengths, seed=6)
    gen = torch.Generator().manual_seed(7)
    params = _feature_params(len(lengths), 37, gen)
    for kind in ("processed", "raw"):
        kw = dict(seed=torch.arange(len(lengths)) * 5 + 1, offset=2, method="block",
                  return_logprobs=kind, **params)
        got, want = _both(sk.verify_chain, **padded, **kw)
        _assert_same(got, want)
        assert int(want.num_accepted.sum()) > 0
        got, want = _both(sk.verify_chain_packed, max_draft_tokens=3, **packed, **kw)
        _assert_same(got, want)
    # Some live draft is masked out on its row: the bitmask decides there.
    ids, mask = padded["draft_token_ids"], padded["token_bitmask"][:, :3]
    bits = (mask.gather(2, (ids // 32)[..., None])[..., 0] >> (ids % 32)) & 1
    live = torch.arange(3)[None] < torch.tensor(lengths)[:, None]
    assert bool(((bits == 0) & live).any())


@pytest.mark.parametrize("mode,use_mask,kind", [("iid", True, "processed"),
                                                 ("without_replacement", True, "raw"),
                                                 ("without_replacement", False, "processed")])
def test_traversal_features_match_reference(mode, use_mask, kind):
    """``method="traversal"`` on Triton takes ``token_bitmask`` and ``return_logprobs``: the
    reference's tokens, paths and counts, logprobs within float32 rounding, with drafts masked
    out on their parent's row, rejections (row passes under the mask) and accepted paths."""
    gen = torch.Generator().manual_seed(34)
    batch, nodes, vocab = 6, 7, 45
    target, tokens, parents, q, num_nodes = random_trees(batch, nodes, vocab, mode, seed=35)
    allowed = torch.rand(batch, nodes, vocab, generator=gen) < 0.7
    params = _feature_params(batch, vocab, gen)
    got, want = _both(sk.verify_tree, target_logits=target, tree_token_ids=tokens,
                      parents=parents, draft_probs=q, draft_sampling=mode, num_nodes=num_nodes,
                      method="traversal", token_bitmask=bitmask_of(allowed) if use_mask else None,
                      return_logprobs=kind, seed=torch.arange(batch) + 9, offset=2, **params)
    _assert_same(got, want)
    assert int(want.num_accepted.sum()) > 0
    assert bool(want.logprobs[want.output_token_ids >= 0].isfinite().all())
    if use_mask:  # some real node's token is masked out on its parent's row
        live = (torch.arange(nodes) > 0) & (torch.arange(nodes) < num_nodes[:, None])
        bit = allowed.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab)).gather(
            2, tokens.clamp(min=0)[..., None])[..., 0]
        assert bool((live & ~bit).any())
