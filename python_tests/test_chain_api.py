"""verify_chain through the public API, on every backend: determinism, batch independence,
edge cases, and bad input (``sample``/``processed_probs``: test_sampling_api.py; what every
public op shares: test_public_api.py)."""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _rng

from conftest import CHAIN_BACKENDS


def _problem(batch=5, num_drafts=3, vocab=37, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2).to(dtype)
    draft_logits = (target[:, :num_drafts].float()
                    + torch.randn(batch, num_drafts, vocab, generator=gen)).to(dtype)
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=gen)
    return target, draft_logits, drafts


def _check_well_formed(out, num_drafts, vocab, num_draft_tokens=None):
    tokens, accepted = out.output_token_ids, out.num_accepted
    assert tokens.dtype == torch.int32 and accepted.dtype == torch.int32
    assert tokens.shape[1] == num_drafts + 1
    assert ((tokens >= -1) & (tokens < vocab)).all()
    if num_draft_tokens is not None:
        assert (accepted <= num_draft_tokens).all()
    position = torch.arange(num_drafts + 1)
    assert (tokens[position > accepted[:, None].long()] == -1).all()


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_same_seed_same_tokens_and_offsets_matter(backend):
    # The claim does not depend on the batch; Triton's interpreter pays ~0.4 s per request
    # and call here, so it runs 6 requests where the reference runs 16.
    batch = 16 if backend == "reference" else 6
    target, draft_logits, _ = _problem(batch=batch)
    drafts = torch.stack([sk.sample(draft_logits[:, j], seed=11, offset=j) for j in range(3)], 1)
    kw = dict(draft_logits=draft_logits, seed=torch.arange(batch), backend=backend)
    a = sk.verify_chain(target, drafts, offset=4, **kw)
    b = sk.verify_chain(target, drafts, offset=4, **kw)
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    others = [sk.verify_chain(target, drafts, offset=o, **kw).output_token_ids for o in (5, 6, 7)]
    assert any(not torch.equal(a.output_token_ids, o) for o in others)
    _check_well_formed(a, 3, 37)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_tokens_do_not_depend_on_batch_row(backend):
    batch = 7
    target, draft_logits, drafts = _problem(batch=batch, seed=1)
    params = dict(temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.5, 2.0]),
                  top_k=torch.tensor([0, 0, 5, 0, 3, 0, 10]),
                  top_p=torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 1.0, 0.8]),
                  seed=torch.arange(batch) * 7919, offset=torch.arange(batch) + 3,
                  num_draft_tokens=torch.tensor([3, 2, 0, 1, 3, 3, 2]))
    full = sk.verify_chain(target, drafts, draft_logits=draft_logits, backend=backend, **params)
    for rows in (torch.randperm(batch, generator=torch.Generator().manual_seed(2)),
                 torch.tensor([4, 1]), torch.tensor([6])):
        part = sk.verify_chain(target[rows], drafts[rows], draft_logits=draft_logits[rows],
                               backend=backend, **{k: v[rows] for k, v in params.items()})
        assert torch.equal(part.output_token_ids, full.output_token_ids[rows])
        assert torch.equal(part.num_accepted, full.num_accepted[rows])


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_greedy_accepts_argmax_prefix(backend):
    target, _, _ = _problem(batch=6, num_drafts=4, vocab=11, seed=3)
    argmax = target.argmax(-1)
    drafts = argmax[:, :4].clone()
    mismatch_at = torch.tensor([0, 1, 2, 3, 4, 4])
    for b, j in enumerate(mismatch_at.tolist()):
        if j < 4:
            drafts[b, j] = (drafts[b, j] + 1) % 11
    out = sk.verify_chain(target, drafts, temperature=0.0, seed=0, backend=backend)
    assert torch.equal(out.num_accepted, mismatch_at.int())
    for b, j in enumerate(mismatch_at.tolist()):
        assert out.output_token_ids[b, :j].tolist() == drafts[b, :j].tolist()
        assert int(out.output_token_ids[b, j]) == int(argmax[b, j])


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_greedy_ties_pick_lowest_id(backend):
    target = torch.zeros(1, 2, 5)
    target[0, :, 2] = target[0, :, 4] = 3.0
    out = sk.verify_chain(target, torch.tensor([[4]]), temperature=0.0, backend=backend)
    assert out.output_token_ids.tolist() == [[2, -1]]


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_no_drafts(backend):
    target, _, _ = _problem(batch=4, num_drafts=0, vocab=9)
    out = sk.verify_chain(target, torch.zeros(4, 0, dtype=torch.int64), seed=5, backend=backend)
    assert out.output_token_ids.shape == (4, 1) and (out.num_accepted == 0).all()
    assert (out.output_token_ids[:, 0] >= 0).all()
    target3, _, drafts3 = _problem(batch=4, num_drafts=3, vocab=9)
    out3 = sk.verify_chain(target3, drafts3, num_draft_tokens=0, temperature=0.0,
                           backend=backend)
    assert out3.output_token_ids[:, 0].tolist() == target3[:, 0].argmax(-1).tolist()
    assert (out3.output_token_ids[:, 1:] == -1).all() and (out3.num_accepted == 0).all()


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_vocab_of_one(backend):
    out = sk.verify_chain(torch.randn(3, 3, 1), torch.zeros(3, 2, dtype=torch.int32),
                          seed=1, backend=backend)
    assert out.output_token_ids.tolist() == [[0, 0, 0]] * 3
    assert out.num_accepted.tolist() == [2] * 3


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_large_vocab(backend):
    vocab = 128256
    target = torch.randn(1, 2, vocab, dtype=torch.bfloat16)
    drafts = target[:, :1].float().argmax(-1)
    out = sk.verify_chain(target, drafts, temperature=0.0, backend=backend)
    assert out.output_token_ids.tolist() == [[int(drafts), int(target[0, 1].float().argmax())]]
    ref = sk.verify_chain(target, drafts, seed=9, backend="reference")
    got = sk.verify_chain(target, drafts, seed=9, backend=backend)
    assert torch.equal(ref.output_token_ids, got.output_token_ids)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_masked_and_nan_logits_never_emitted(backend):
    target, draft_logits, _ = _problem(batch=12, vocab=16, seed=4)
    gen = torch.Generator().manual_seed(4)
    banned = torch.rand(target.shape, generator=gen) < 0.5
    banned[..., 0] = False  # keep one finite logit per row
    target = target.masked_fill(banned, float("-inf"))
    target[banned & (torch.rand(target.shape, generator=gen) < 0.3)] = float("nan")
    drafts = torch.randint(0, 16, (12, 3), generator=gen)
    out = sk.verify_chain(target, drafts, draft_logits=draft_logits, seed=torch.arange(12),
                          backend=backend)
    _check_well_formed(out, 3, 16)
    tokens = out.output_token_ids.long()
    emitted = tokens >= 0
    rows = torch.arange(4).expand(12, 4)
    assert not banned[torch.arange(12)[:, None].expand(12, 4)[emitted], rows[emitted],
                      tokens[emitted]].any()


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_row_without_finite_logit_emits_minus_one(backend):
    target = torch.randn(3, 3, 8)
    target[0, 0] = float("-inf")                      # first row dead: nothing accepted, -1
    target[1, 2] = float("nan")                       # bonus row dead
    drafts = target[:, :2].argmax(-1)
    out = sk.verify_chain(target, drafts, temperature=0.0, backend=backend)
    assert out.output_token_ids[0].tolist() == [-1, -1, -1] and int(out.num_accepted[0]) == 0
    assert int(out.num_accepted[1]) == 2 and int(out.output_token_ids[1, 2]) == -1
    sampled = sk.verify_chain(target, drafts, seed=3, backend=backend)
    assert sampled.output_token_ids[0].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_p_equals_q_accepts_everything(backend):
    target, _, _ = _problem(batch=8, num_drafts=3, vocab=10, seed=6)
    q = sk.processed_probs(target[:, :3], top_k=4)
    drafts = torch.stack([sk.sample(target[:, j], top_k=4, seed=2, offset=j) for j in range(3)], 1)
    for kw in (dict(draft_probs=q), dict(draft_logits=target[:, :3])):
        out = sk.verify_chain(target, drafts, top_k=4, seed=torch.arange(8), backend=backend, **kw)
        assert (out.num_accepted == 3).all()


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_zero_draft_probability_is_accepted_when_target_allows(backend):
    target = torch.zeros(4, 2, 3)
    q = torch.tensor([0.0, 0.5, 0.5]).expand(4, 1, 3).contiguous()
    out = sk.verify_chain(target, torch.zeros(4, 1, dtype=torch.int64), draft_probs=q,
                          seed=torch.arange(4), backend=backend)
    assert (out.num_accepted == 1).all()
    # ... and a token the target forbids is never accepted, whatever q says.
    target[:, 0, 0] = float("-inf")
    out = sk.verify_chain(target, torch.zeros(4, 1, dtype=torch.int64), draft_probs=q,
                          seed=torch.arange(4), backend=backend)
    assert (out.num_accepted == 0).all() and (out.output_token_ids[:, 0] != 0).all()


def _seed_on_threshold():
    """A seed whose first acceptance uniform u has q = 0.5 / u with u * q == 0.5 in float32."""
    for seed in range(1000):
        u = _rng.uniform(torch.tensor(seed), torch.tensor(0), 1, _rng.PURPOSE_ACCEPT)
        q = torch.tensor(0.5, dtype=torch.float32) / u
        if u > 0 and (u * q) == 0.5:
            return seed, q
    raise AssertionError("no seed found")


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_uniform_exactly_on_threshold_rejects(backend):
    seed, q_on = _seed_on_threshold()
    target = torch.zeros(1, 2, 2)  # p = [0.5, 0.5] exactly
    for q_value, accepted in ((q_on, 0), (torch.nextafter(q_on, torch.tensor(0.0)), 1)):
        q = torch.stack([q_value, torch.tensor(0.0)]).reshape(1, 1, 2)
        out = sk.verify_chain(target, torch.zeros(1, 1, dtype=torch.int64), draft_probs=q,
                              seed=seed, offset=0, backend=backend)
        assert int(out.num_accepted[0]) == accepted


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_garbage_without_validation_stays_in_range(backend):
    gen = torch.Generator().manual_seed(8)
    batch, num_drafts, vocab = 9, 3, 13
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 50
    target[torch.rand(target.shape, generator=gen) < 0.2] = float("nan")
    target[torch.rand(target.shape, generator=gen) < 0.2] = float("inf")
    target[torch.rand(target.shape, generator=gen) < 0.2] = float("-inf")
    drafts = torch.randint(-20, vocab + 20, (batch, num_drafts), generator=gen)
    q = torch.randn(batch, num_drafts, vocab, generator=gen)  # not a distribution at all
    out = sk.verify_chain(target, drafts, draft_probs=q, validate=False, backend=backend,
                          num_draft_tokens=torch.randint(-3, 7, (batch,), generator=gen),
                          temperature=torch.randn(batch, generator=gen),
                          top_k=torch.randint(-3, 20, (batch,), generator=gen),
                          top_p=torch.randn(batch, generator=gen), seed=1)
    _check_well_formed(out, num_drafts, vocab)


# --- Bad input: ValueError/TypeError naming the argument; inputs untouched --------------------

def _bad_cases():
    target, draft_logits, drafts = _problem(batch=2, num_drafts=2, vocab=6)
    q = sk.processed_probs(draft_logits)
    yield "target_logits", (target[0], drafts), {}
    yield "target_logits", (target.to(torch.int64), drafts), {}
    yield "draft_token_ids", (target, drafts[:, :1]), {}
    yield "draft_token_ids", (target, drafts.float()), {}
    yield "draft_token_ids", (target, torch.tensor([[0, 6], [1, 1]])), {}
    yield "draft_token_ids", (target, torch.tensor([[-1, 0], [1, 1]])), {}
    yield "draft_probs", (target, drafts), dict(draft_probs=q, draft_logits=draft_logits)
    yield "draft_probs", (target, drafts), dict(draft_probs=q[:, :1])
    yield "draft_logits", (target, drafts), dict(draft_logits=draft_logits[..., :5])
    yield "num_draft_tokens", (target, drafts), dict(num_draft_tokens=3)
    yield "num_draft_tokens", (target, drafts), dict(num_draft_tokens=torch.tensor([1, -1]))
    yield "num_draft_tokens", (target, drafts), dict(num_draft_tokens=torch.tensor([1, 1, 1]))
    yield "temperature", (target, drafts), dict(temperature=-0.5)
    yield "temperature", (target, drafts), dict(temperature=torch.tensor([1.0, float("nan")]))
    yield "top_k", (target, drafts), dict(top_k=-1)
    yield "top_k", (target, drafts), dict(top_k=torch.tensor([1.5, 2.0]))
    yield "top_p", (target, drafts), dict(top_p=0.0)
    yield "top_p", (target, drafts), dict(top_p=torch.tensor([0.5, 1.5]))
    yield "seed", (target, drafts), dict(seed=torch.tensor([1, 2, 3]))
    yield "seed", (target, drafts), dict(seed=1e30)      # an integral float past 64 bits
    yield "offset", (target, drafts), dict(offset="zero")
    yield "offset", (target, drafts), dict(offset=-1e30)
    # Python numbers are checked without a synchronisation, so even with validate=False.
    yield "temperature", (target, drafts), dict(temperature=-1.0, validate=False)
    yield "top_p", (target, drafts), dict(top_p=1.5, validate=False)
    yield "backend", (target, drafts), dict(backend="cuda-magic")


@pytest.mark.parametrize("name,args,kwargs", list(_bad_cases()),
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(_bad_cases())])
def test_bad_input_names_the_argument(name, args, kwargs):
    before = [a.clone() for a in args] + [v.clone() for v in kwargs.values()
                                          if isinstance(v, torch.Tensor)]
    with pytest.raises((ValueError, TypeError), match=name):
        sk.verify_chain(*args, **kwargs)
    after = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_unvalidated_int64_lengths_clamp_instead_of_wrapping(backend):
    """validate=False: num_draft_tokens past int32 clamps to K, as any value past K does
    (narrowed to int32 naively, 2**32 + 1 would wrap to 1)."""
    target, _, _ = _problem(batch=2, num_drafts=3, vocab=11, seed=3)
    greedy_drafts = target.argmax(-1)[:, :3]  # every draft accepted
    out = sk.verify_chain(target, greedy_drafts, temperature=0.0, validate=False,
                          num_draft_tokens=torch.tensor([2**32 + 1, -2**40]), backend=backend)
    assert out.num_accepted.tolist() == [3, 0]
