"""The C++ CPU path (``specdec_kernels._cpu``, csrc/core/sampling_cpu.*) behind
``backend="auto"`` on CPU tensors: its random numbers bit for bit against ``_rng``, and its
tokens (chains, trees, samples) and log-probabilities against the reference's across modes,
dtypes, odd vocabularies and garbage inputs.
Tokens may differ only at decisions within float rounding of a threshold (its exp, its sums
and Sleef's log differ from torch's by ulps); the tests count differing requests and bound
them at 1%."""
from __future__ import annotations

import pytest
import torch
from scipy import stats

import specdec_kernels as sk
from specdec_kernels import _cpu, _params, _rng
from specdec_kernels.reference import sampling as ref_sampling

from conftest import mixed_params
from test_chain_exactness import ALPHA, MODES, _chi_square, _context_free_round

pytestmark = pytest.mark.skipif(not _cpu.AVAILABLE, reason="the extension is not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIFFERING = 0.01  # of requests (the Triton tests' bound)


def test_words_and_uniforms_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    count = 20000
    seed = torch.randint(-2**63, 2**63 - 1, (count,), generator=gen)
    offset = torch.randint(-2**63, 2**63 - 1, (count,), generator=gen)
    position = torch.randint(0, 2**17, (count,), generator=gen)  # & 0xFFFF on both sides
    index = torch.randint(0, 2**32, (count,), generator=gen)
    edges = torch.tensor([0, 1, 2**24 - 1, 2**24 + 1, 2**25 + 3, 2**31, 2**32 - 1])
    for purpose in (_rng.PURPOSE_ACCEPT, _rng.PURPOSE_RESAMPLE, _rng.PURPOSE_SAMPLE):
        words, uniform, noise = torch.ops.specdec.cpu_random_words(seed, offset, position,
                                                                   purpose, index)
        expected = _rng.random_words(seed, offset, position, purpose, index)
        assert torch.equal(words, expected)
        assert torch.equal(uniform, _rng.word_uniform(expected))
        # The noise: glibc's logf vs torch's (Sleef) log, within 1 ulp, mostly equal.
        reference_noise = _rng.word_noise(expected)
        ulps = (noise.view(torch.int32) - reference_noise.view(torch.int32)).abs()
        assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.8
        assert bool((noise > 0).all())
    # Edge words through the uniform and noise (the words themselves as index-free inputs).
    w, u, e = torch.ops.specdec.cpu_random_words(torch.zeros(1, dtype=torch.int64),
                                                 torch.zeros(1, dtype=torch.int64),
                                                 torch.zeros(1, dtype=torch.int64), 0,
                                                 torch.zeros(1, dtype=torch.int64))
    assert int(w[0]) == 0x6627E8D5  # Random123: counter 0, key 0
    assert torch.equal(_rng.word_uniform(edges), _rng.word_uniform(edges))  # (reference only)


def _inputs(batch, drafts, vocab, dtype, gen, scale=3.0):
    target = (torch.randn(batch, drafts + 1, vocab, generator=gen) * scale).to(dtype)
    draft_logits = (torch.randn(batch, drafts, vocab, generator=gen) * scale).to(dtype)
    # Drafts drawn near the target's arg-max so that both acceptances and rejections happen.
    ids = torch.where(torch.rand(batch, drafts, generator=gen) < 0.5,
                      target[:, :drafts].float().argmax(-1),
                      torch.randint(0, vocab, (batch, drafts), generator=gen))
    return target, draft_logits, ids


def _differing(a, b) -> int:
    return int((a.output_token_ids != b.output_token_ids).any(-1).sum()
               + (a.num_accepted != b.num_accepted).sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 3001, 4099])
def test_verify_chain_equals_reference(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    batch, drafts = 12, 3
    target, draft_logits, ids = _inputs(batch, drafts, vocab, dtype, gen)
    params = mixed_params(batch, vocab, gen)
    params["min_p"] = torch.where(torch.arange(batch) % 7 == 6, 0.05, 0.0)
    num = torch.randint(0, drafts + 1, (batch,), generator=gen)
    seed = torch.randint(0, 2**62, (batch,), generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, drafts + 1, (vocab + 31) // 32),
                            generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[::2] = -1  # half the requests unmasked
    probs = ref_sampling.processed_probs(draft_logits, params["temperature"],
                                         params["top_k"], params["top_p"])
    compared = differing = 0
    for mode in ("one_hot", "draft_probs", "draft_logits", "bitmask"):
        extra = {"draft_probs": dict(draft_probs=probs.to(dtype)),
                 "draft_logits": dict(draft_logits=draft_logits),
                 "bitmask": dict(token_bitmask=bitmask)}.get(mode, {})
        common = dict(num_draft_tokens=num, seed=seed, offset=3, **params, **extra)
        got = sk.verify_chain(target, ids, **common)
        want = sk.verify_chain(target, ids, backend="reference", **common)
        compared += batch
        differing += _differing(got, want)
        assert bool(((got.output_token_ids >= -1) & (got.output_token_ids < vocab)).all())
    assert differing <= MAX_DIFFERING * compared + 1, (differing, compared)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_equals_reference(dtype):
    compared = differing = 0
    for vocab in (1, 7, 1023, 3001, 2048 * 3 + 5):
        gen = torch.Generator().manual_seed(vocab)
        batch = 20
        logits = (torch.randn(batch, vocab, generator=gen) * 2).to(dtype)
        logits[3] = float("nan")
        logits[4, : vocab // 2] = float("-inf")
        params = mixed_params(batch, vocab, gen)
        params["min_p"] = torch.where(torch.arange(batch) % 6 == 5, 0.1, 0.0)
        seed = torch.randint(0, 2**62, (batch,), generator=gen)
        got = sk.sample(logits, seed=seed, offset=11, **params)
        want = sk.sample(logits, seed=seed, offset=11, backend="reference", **params)
        compared += batch
        differing += int((got != want).sum())
        assert int(got[3]) == -1
    assert differing <= MAX_DIFFERING * compared, (differing, compared)


def test_many_seeds_bf16_large_vocab():
    """V = 32000 bf16 over many seeds: the rate of rounding-level differences stays bounded."""
    gen = torch.Generator().manual_seed(5)
    batch, drafts, vocab = 24, 4, 32000
    target, draft_logits, ids = _inputs(batch, drafts, vocab, torch.bfloat16, gen, scale=2.0)
    params = dict(temperature=0.8, top_p=0.9)
    seed = torch.arange(batch)
    got = sk.verify_chain(target, ids, draft_logits=draft_logits, seed=seed, **params)
    want = sk.verify_chain(target, ids, draft_logits=draft_logits, seed=seed,
                           backend="reference", **params)
    assert _differing(got, want) <= MAX_DIFFERING * batch + 1


def test_packed_equals_reference():
    gen = torch.Generator().manual_seed(2)
    vocab, counts = 3001, [0, 3, 1, 4, 2]
    batch, total = len(counts), sum(counts)
    cu = torch.tensor([0] + counts).cumsum(0)
    target = torch.randn(total + batch, vocab, generator=gen) * 3
    ids = torch.randint(0, vocab, (total,), generator=gen)
    draft_logits = torch.randn(total, vocab, generator=gen) * 3
    for extra in ({}, dict(draft_logits=draft_logits), dict(temperature=0.0)):
        kwargs = dict(max_draft_tokens=4, seed=9, top_k=40, **extra)
        got = sk.verify_chain_packed(target, ids, cu, **kwargs)
        want = sk.verify_chain_packed(target, ids, cu, backend="reference", **kwargs)
        assert _differing(got, want) == 0


def test_garbage_inputs_unvalidated():
    """validate=False: out-of-range ids and lengths, NaN/+inf/negative draft_probs give the
    reference's tokens and never an id outside [0, V) other than -1."""
    gen = torch.Generator().manual_seed(3)
    batch, drafts, vocab = 16, 3, 300
    target, _, ids = _inputs(batch, drafts, vocab, torch.float32, gen)
    ids[0, 0], ids[1, 1], ids[2, 0] = -5, vocab, 2**40
    num = torch.tensor([5, -2] + [drafts] * (batch - 2))
    probs = torch.rand(batch, drafts, vocab, generator=gen)
    probs[3, 0, :5] = float("nan")
    probs[4, :, 7] = float("inf")
    probs[5] = -probs[5]
    kwargs = dict(draft_probs=probs, num_draft_tokens=num, seed=1, validate=False)
    got = sk.verify_chain(target, ids, **kwargs)
    want = sk.verify_chain(target, ids, backend="reference", **kwargs)
    assert _differing(got, want) == 0
    assert bool(((got.output_token_ids >= -1) & (got.output_token_ids < vocab)).all())


def test_dispatch_and_fallbacks(monkeypatch):
    """auto on CPU runs the C++ path where it covers the call (logprobs included); float64
    draft probs, the methods it lacks and backend="reference" take the reference; bad input
    raises as before."""
    calls = []
    for name in ("verify_chain", "verify_tree", "sample"):
        real = getattr(_cpu, name)
        monkeypatch.setattr(_cpu, name, lambda *a, _real=real, _name=name, **k:
                            calls.append(_name) or _real(*a, **k))
    target = torch.randn(2, 3, 50)
    ids = torch.randint(0, 50, (2, 2))
    sk.verify_chain(target, ids, seed=1)
    sk.verify_chain(target, ids, seed=1, return_logprobs="raw")
    assert calls == ["verify_chain"] * 2
    sk.verify_chain(target, ids, seed=1, backend="reference")
    sk.verify_chain(target, ids, seed=1, draft_probs=torch.rand(2, 2, 50, dtype=torch.float64))
    assert calls == ["verify_chain"] * 2
    tree_ids, parents = torch.tensor([[-1, 3, 4]] * 2), torch.tensor([[-1, 0, 0]] * 2)
    q = torch.softmax(torch.randn(2, 3, 50), -1)
    sk.verify_tree(target, tree_ids, parents, seed=1, return_logprobs="processed")
    sk.verify_tree(target, tree_ids, parents, seed=1, draft_probs=q, method="traversal")
    assert calls[-2:] == ["verify_tree"] * 2
    del calls[:]
    sk.verify_tree(target, tree_ids, parents, seed=1, draft_probs=q.double())
    sk.verify_tree(target, tree_ids, parents, seed=1, backend="reference")
    assert calls == []
    with pytest.raises(ValueError, match="num_draft_tokens"):
        sk.verify_chain(target, ids, num_draft_tokens=3)
    with pytest.raises(ValueError, match="draft_token_ids"):
        sk.verify_chain(target, torch.tensor([[0, 50], [1, 1]]))
    with pytest.raises(ValueError, match="top_p"):
        sk.sample(target[:, 0], top_p=torch.tensor([0.5, 1.5]))
    out = sk.sample(target[:, 0], seed=1, return_logprobs="processed")
    assert isinstance(out, sk.SampleOutput) and calls == ["sample"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_processed_probs_close_to_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    batch, vocab = 25, 3001
    logits = (torch.randn(batch, 2, vocab, generator=gen) * 3).to(dtype)
    params = _params.sampling_params(**mixed_params(batch, vocab, gen), batch=batch,
                                     vocab_size=vocab, device=torch.device("cpu"),
                                     validate=True, min_p=0.01)
    got = _cpu.processed_probs(logits, params)
    want = ref_sampling.processed_probs(logits, params.temperature, params.top_k, params.top_p,
                                        params.min_p)
    support_differs = ((got > 0) != (want > 0)).any(-1).sum()
    assert int(support_differs) <= MAX_DIFFERING * batch * 2
    assert float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_cpp_chain_tokens_follow_target(mode):
    """The C++ chain's law: chi-square of the first emitted token and of the token after one
    accepted draft, 60k requests, alpha = 1e-4 per test, power >= 0.99 against any law at
    TV >= 0.02 for the first token (test_chain_exactness's statistic; its planted bug shows the
    statistic fails on a wrong residual)."""
    batch = 60_000
    out, p, _ = _context_free_round(mode, (0.8, 4, 0.9), batch, backend="auto")
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    for j in (0, 1):
        reached = accepted >= j
        pvalue, power = _chi_square(torch.bincount(tokens[reached, j], minlength=p.shape[-1]),
                                    p[j])
        assert pvalue > ALPHA, (j, pvalue)
        if j == 0:
            assert power >= 0.99


# ---- verify_tree (method "token") and return_logprobs in C++ ----
TREE_MODES = ("deterministic", "iid", "without_replacement")


def _tree_differing(a, b) -> int:
    return int(((a.output_token_ids != b.output_token_ids).any(-1)
                | (a.accepted_nodes != b.accepted_nodes).any(-1)
                | (a.num_accepted != b.num_accepted)).sum())


def _assert_logprobs_close(got, want, same_tokens):
    """Log-probabilities agree where the tokens agree: NaN at the same places, else within
    float rounding (exp, sums and log differ from torch's by ulps)."""
    got, want = got[same_tokens], want[same_tokens]
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ("token", "traversal"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("vocab", [1, 7, 3001])
def test_verify_tree_equals_reference(dtype, vocab, method):
    """Deterministic (token walk only), i.i.d. and without-replacement trees with padding
    (num_nodes), mixed greedy/T/top-k/top-p/min-p, a bitmask, both log-probability kinds."""
    from test_triton_tree import random_trees
    batch, nodes = 20, 9
    compared = differing = 0
    for mode in TREE_MODES[method == "traversal":]:
        target, tokens, parents, q, num_nodes = random_trees(batch, nodes, vocab, mode,
                                                             seed=vocab + len(mode))
        gen = torch.Generator().manual_seed(vocab)
        params = mixed_params(batch, vocab, gen)
        params["min_p"] = torch.where(torch.arange(batch) % 7 == 6, 0.05, 0.0)
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, nodes, (vocab + 31) // 32),
                                generator=gen, dtype=torch.int64).to(torch.int32)
        bitmask[::2] = -1
        extra = {} if mode == "deterministic" else dict(draft_probs=q.to(dtype),
                                                        draft_sampling=mode)
        for more, kind in (({}, "processed"), (dict(token_bitmask=bitmask), "raw")):
            common = dict(num_nodes=num_nodes, seed=torch.arange(batch) * 7 + vocab, offset=5,
                          method=method, return_logprobs=kind, **params, **extra, **more)
            args = (target.to(dtype), tokens, parents)
            got = sk.verify_tree(*args, **common)
            want = sk.verify_tree(*args, backend="reference", **common)
            compared += batch
            differing += _tree_differing(got, want)
            assert bool(((got.output_token_ids >= -1) & (got.output_token_ids < vocab)).all())
            same = (got.output_token_ids == want.output_token_ids).all(-1)
            _assert_logprobs_close(got.logprobs, want.logprobs, same)
    assert differing <= MAX_DIFFERING * compared + 1, (differing, compared)


def test_chain_shaped_tree_equals_verify_chain():
    """A chain-shaped tree gives verify_chain's tokens on the C++ path (one-hot drafts as
    deterministic candidates, draft_probs as i.i.d. / without-replacement trees), N = 1 too."""
    gen = torch.Generator().manual_seed(8)
    batch, vocab = 30, 517
    for drafts in (0, 4):
        target, draft_logits, ids = _inputs(batch, drafts, vocab, torch.float32, gen)
        params = mixed_params(batch, vocab, gen)
        q = torch.softmax(draft_logits, -1)
        parents = torch.arange(-1, drafts)[None].expand(batch, -1)
        tree_ids = torch.cat([torch.full((batch, 1), -1), ids], 1)
        num = torch.randint(0, drafts + 1, (batch,), generator=gen)
        for probs, sampling in ((None, "iid"), (q, "iid"), (q, "without_replacement")):
            common = dict(seed=torch.arange(batch), offset=2, **params)
            chain = sk.verify_chain(target, ids, num_draft_tokens=num, draft_probs=probs,
                                    return_logprobs="processed", **common)
            padded = None if probs is None else torch.cat([q, torch.zeros(batch, 1, vocab)], 1)
            tree = sk.verify_tree(target, tree_ids, parents, num_nodes=num + 1,
                                  draft_probs=padded, draft_sampling=sampling,
                                  return_logprobs="processed", **common)
            assert torch.equal(tree.output_token_ids, chain.output_token_ids)
            assert torch.equal(tree.num_accepted, chain.num_accepted)
            assert torch.allclose(tree.logprobs, chain.logprobs, equal_nan=True)


def test_tree_garbage_unvalidated():
    """validate=False: garbage parents (>= i, negative, huge), ids outside [0, V), num_nodes
    outside 1..N and NaN/negative draft probs give the reference's answer, in bounds (token
    walk and traversal)."""
    from test_triton_tree import random_trees
    batch, nodes, vocab = 24, 7, 301
    gen = torch.Generator().manual_seed(6)
    for mode, method in [(mode, "token") for mode in TREE_MODES] + [
            ("iid", "traversal"), ("without_replacement", "traversal")]:
        target, tokens, parents, q, num_nodes = random_trees(batch, nodes, vocab, mode, seed=6)
        parents[0, 3], parents[1, 2], parents[2, 4] = 5, -7, 2**40
        tokens[3, 1], tokens[4, 2], tokens[5, 5] = -3, vocab, 2**35
        parents[6, 0], tokens[7, 0] = 3, vocab + 9  # the root's entries are ignored
        num_nodes = num_nodes.clone()
        num_nodes[8], num_nodes[9] = -4, 99
        q = q.clone()
        q[10, 0, :20] = float("nan")
        q[11] = -q[11]
        extra = {} if mode == "deterministic" else dict(draft_probs=q, draft_sampling=mode)
        common = dict(num_nodes=num_nodes, seed=torch.randint(0, 2**60, (batch,), generator=gen),
                      validate=False, temperature=torch.rand(batch, generator=gen) + 0.2,
                      method=method, **extra)
        got = sk.verify_tree(target, tokens, parents, **common)
        want = sk.verify_tree(target, tokens, parents, backend="reference", **common)
        assert _tree_differing(got, want) == 0
        assert bool(((got.output_token_ids >= -1) & (got.output_token_ids < vocab)).all())
        assert bool(((got.accepted_nodes >= -1) & (got.accepted_nodes < nodes)).all())


@pytest.mark.parametrize("kind", ("processed", "raw"))
def test_chain_and_sample_logprobs_equal_reference(kind):
    """return_logprobs in C++: verify_chain (modes, bitmask), verify_chain_packed and sample,
    bf16 and fp32, NaN rows and NaN at -1."""
    gen = torch.Generator().manual_seed(10)
    batch, drafts, vocab = 20, 3, 1029
    for dtype in (torch.float32, torch.bfloat16):
        target, draft_logits, ids = _inputs(batch, drafts, vocab, dtype, gen)
        params = mixed_params(batch, vocab, gen)
        params["min_p"] = torch.where(torch.arange(batch) % 6 == 5, 0.1, 0.0)
        num = torch.randint(0, drafts + 1, (batch,), generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, drafts + 1, (vocab + 31) // 32),
                                generator=gen, dtype=torch.int64).to(torch.int32)
        for extra in ({}, dict(draft_logits=draft_logits), dict(token_bitmask=bitmask)):
            common = dict(num_draft_tokens=num, seed=torch.arange(batch), return_logprobs=kind,
                          **params, **extra)
            got = sk.verify_chain(target, ids, **common)
            want = sk.verify_chain(target, ids, backend="reference", **common)
            assert _differing(got, want) <= MAX_DIFFERING * batch + 1
            _assert_logprobs_close(got.logprobs, want.logprobs,
                                   (got.output_token_ids == want.output_token_ids).all(-1))
        logits = target[:, 0].clone()
        logits[2] = float("nan")
        common = dict(seed=torch.arange(batch), return_logprobs=kind, **params)
        got = sk.sample(logits, **common)
        want = sk.sample(logits, backend="reference", **common)
        assert bool(got.logprobs[2].isnan())
        _assert_logprobs_close(got.logprobs, want.logprobs, got.token_ids == want.token_ids)
    counts = [0, 3, 1, 2]
    cu = torch.tensor([0] + counts).cumsum(0)
    packed = torch.randn(sum(counts) + len(counts), vocab, generator=gen) * 3
    packed_ids = torch.randint(0, vocab, (sum(counts),), generator=gen)
    common = dict(max_draft_tokens=3, seed=4, top_k=30, return_logprobs=kind)
    got = sk.verify_chain_packed(packed, packed_ids, cu, **common)
    want = sk.verify_chain_packed(packed, packed_ids, cu, backend="reference", **common)
    assert _differing(got, want) == 0
    _assert_logprobs_close(got.logprobs, want.logprobs, torch.ones(len(counts), dtype=torch.bool))


@pytest.mark.parametrize("mode", TREE_MODES)
def test_cpp_tree_tokens_follow_target(monkeypatch, mode):
    """The C++ tree walk's law: test_tree_reference's chi-square of the first token and of the
    token after an accepted node (60k trees, alpha 1e-3 / 6 per test, power >= 0.99 against
    the mode's planted bug, whose law is enumerated exactly), through backend="auto"."""
    import test_tree_reference as tree_tests
    toy = tree_tests._case(mode, tree_tests.SAMPLED_PARAMS, seed=2)
    T0, T1, _ = toy.tables()
    with monkeypatch.context() as patched:
        _, sampling = tree_tests._plant(patched, tree_tests.BUG_OF_MODE[mode])
        _, bug_first, bug_second, _ = tree_tests.enumerate_law(toy, sampling)
    out = tree_tests.sample_round(toy, tree_tests.SAMPLED_BATCH, seed=3, backend="auto")
    first, second = tree_tests._sampled_counts(out, toy.vocab)
    p_first, power_first = tree_tests._chi_square(first, T0[None], bug_first[None])
    p_second, power_second = tree_tests._chi_square(second, T1,
                                                    tree_tests._conditional(bug_second))
    assert p_first > tree_tests.ALPHA_TEST and p_second > tree_tests.ALPHA_TEST
    assert max(power_first, power_second) >= 0.99


# ---- method="block" in C++ ----
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("vocab", [1, 7, 3001])
def test_block_chain_equals_reference(dtype, vocab):
    """Block verification in C++ == the reference: one-hot, draft_probs, draft_logits and
    bitmask modes, mixed greedy/T/top-k/top-p/min-p, ragged num_draft_tokens with invalid
    drafts (garbage ids, validate=False), log-probabilities."""
    gen = torch.Generator().manual_seed(vocab + 1)
    batch, drafts = 20, 4
    target, draft_logits, ids = _inputs(batch, drafts, vocab, dtype, gen)
    # Drafts close to the target make later tests pass after an early failure.
    draft_logits = (target[:, :drafts].float() + 0.5 * draft_logits.float()).to(dtype)
    ids[3, 2], ids[5, 0] = -1, vocab + 3
    params = mixed_params(batch, vocab, gen)
    params["min_p"] = torch.where(torch.arange(batch) % 7 == 6, 0.05, 0.0)
    num = torch.randint(0, drafts + 1, (batch,), generator=gen)
    num[: batch // 2] = drafts
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, drafts + 1, (vocab + 31) // 32),
                            generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[::2] = -1
    probs = ref_sampling.processed_probs(draft_logits, params["temperature"], params["top_k"],
                                         params["top_p"])
    compared = differing = 0
    for mode, kind in (("one_hot", None), ("draft_probs", "processed"),
                       ("draft_logits", "raw"), ("bitmask", "processed")):
        extra = {"draft_probs": dict(draft_probs=probs.to(dtype)),
                 "draft_logits": dict(draft_logits=draft_logits),
                 "bitmask": dict(token_bitmask=bitmask, draft_probs=probs)}.get(mode, {})
        common = dict(num_draft_tokens=num, seed=torch.arange(batch) * 3, offset=1,
                      method="block", validate=False, return_logprobs=kind, **params, **extra)
        got = sk.verify_chain(target, ids, **common)
        want = sk.verify_chain(target, ids, backend="reference", **common)
        compared += batch
        differing += _differing(got, want)
        assert bool(((got.output_token_ids >= -1) & (got.output_token_ids < vocab)).all())
        if kind is not None:
            _assert_logprobs_close(got.logprobs, want.logprobs,
                                   (got.output_token_ids == want.output_token_ids).all(-1))
    assert differing <= MAX_DIFFERING * compared + 1, (differing, compared)


def test_block_packed_equals_reference():
    gen = torch.Generator().manual_seed(12)
    vocab, counts = 1001, [0, 4, 1, 3, 2, 4]
    batch, total = len(counts), sum(counts)
    cu = torch.tensor([0] + counts).cumsum(0)
    target = torch.randn(total + batch, vocab, generator=gen) * 2
    draft_logits = torch.randn(total, vocab, generator=gen) * 2
    ids = torch.randint(0, vocab, (total,), generator=gen)
    for extra in ({}, dict(draft_logits=draft_logits)):
        kwargs = dict(max_draft_tokens=4, seed=torch.arange(batch), method="block",
                      return_logprobs="processed", **extra)
        got = sk.verify_chain_packed(target, ids, cu, **kwargs)
        want = sk.verify_chain_packed(target, ids, cu, backend="reference", **kwargs)
        assert _differing(got, want) == 0
        _assert_logprobs_close(got.logprobs, want.logprobs, torch.ones(batch, dtype=torch.bool))


@pytest.mark.parametrize("mode", ("draft_probs", "draft_logits"))
def test_cpp_block_tokens_follow_target(mode):
    """The C++ block law: test_block_traversal's statistic through backend="auto" (40k
    requests, chi-square per position at alpha = 1e-4, power >= 0.99 at TV >= 0.02 for the
    first token; its planted bug h = w fails it), and the mean accepted length above the token
    rule's exact expectation (normal test at alpha = 1e-4)."""
    from test_block_traversal import _context_free_expectation
    batch, vocab, num_drafts = 40_000, 6, 3
    params = (1.0, 0, 1.0) if mode == "draft_probs" else (0.8, 4, 0.9)
    out, p, q = _context_free_round(mode, params, batch, vocab, num_drafts, method="block",
                                    backend="auto")
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    for j in range(num_drafts + 1):
        reached = accepted >= j
        pvalue, power = _chi_square(torch.bincount(tokens[reached, j], minlength=vocab), p[j])
        assert pvalue > ALPHA, (j, pvalue)
        if j == 0:
            assert power >= 0.99
    closed = _context_free_expectation(p, q)
    sd = float(accepted.double().std()) / batch ** 0.5
    assert abs(float(accepted.double().mean()) - closed["block"]) <= stats.norm.isf(ALPHA / 2) * sd
    assert closed["block"] > closed["token"] + 10 * sd


# ---- method="traversal" in C++ (its == reference test: test_verify_tree_equals_reference) ----
def test_chain_shaped_traversal_equals_block():
    """A chain-shaped tree under traversal gives verify_chain(method="block")'s tokens on the
    C++ path (i.i.d. and without replacement: one child per node, the same law)."""
    gen = torch.Generator().manual_seed(9)
    batch, vocab, drafts = 40, 301, 4
    target, draft_logits, ids = _inputs(batch, drafts, vocab, torch.float32, gen)
    draft_logits = target[:, :drafts] + 0.5 * draft_logits
    q = torch.softmax(draft_logits, -1)
    params = mixed_params(batch, vocab, gen)
    parents = torch.arange(-1, drafts)[None].expand(batch, -1)
    tree_ids = torch.cat([torch.full((batch, 1), -1), ids], 1)
    num = torch.randint(0, drafts + 1, (batch,), generator=gen)
    num[: batch // 2] = drafts
    common = dict(seed=torch.arange(batch), offset=4, return_logprobs="processed", **params)
    chain = sk.verify_chain(target, ids, num_draft_tokens=num, draft_probs=q, method="block",
                            **common)
    for sampling in ("iid", "without_replacement"):
        tree = sk.verify_tree(target, tree_ids, parents, num_nodes=num + 1,
                              draft_probs=torch.cat([q, torch.zeros(batch, 1, vocab)], 1),
                              draft_sampling=sampling, method="traversal", **common)
        assert torch.equal(tree.output_token_ids, chain.output_token_ids)
        assert torch.equal(tree.num_accepted, chain.num_accepted)
        assert torch.allclose(tree.logprobs, chain.logprobs, equal_nan=True)


@pytest.mark.parametrize("mode", ("iid", "without_replacement"))
def test_cpp_traversal_tokens_follow_target(monkeypatch, mode):
    """The C++ traversal law: test_block_traversal's statistic through backend="auto" (20k
    trees, chi-square of the first token and of the token after an accepted first node at
    alpha = 1e-3/4 each, power >= 0.99 against the 'final-from-original-row' bug whose law is
    enumerated) and the mean accepted length against its exact expectation."""
    import test_block_traversal as bt
    import test_tree_reference as tree_tests
    from specdec_kernels.reference import tree as ref_tree
    toy = bt.ToyTree(4, 2, (1.0, 0, 1.0), mode)
    T0, T1, _ = toy.tables()
    exact = bt.enumerate_traversal(toy)
    with monkeypatch.context() as patched:
        patched.setattr(ref_tree, *bt.TRAVERSAL_BUGS["final-from-original-row"][1])
        bug = bt.enumerate_traversal(toy)
    batch = 20_000
    out = tree_tests.sample_round(toy, batch, seed=5, method="traversal", backend="auto")
    first, second = tree_tests._sampled_counts(out, toy.vocab)
    with monkeypatch.context() as patched:
        patched.setattr(tree_tests, "ALPHA_TEST", bt.TRAVERSAL_ALPHA)
        p_first, power_first = tree_tests._chi_square(first, T0[None], bug.first[None])
        p_second, power_second = tree_tests._chi_square(second, T1,
                                                        tree_tests._conditional(bug.second))
    assert p_first > bt.TRAVERSAL_ALPHA and p_second > bt.TRAVERSAL_ALPHA
    assert max(power_first, power_second) >= 0.99
    accepted = out.num_accepted.double()
    sd = float(accepted.std()) / batch ** 0.5
    assert abs(float(accepted.mean()) - exact.mean_accepted) <= \
        stats.norm.isf(bt.TRAVERSAL_ALPHA / 2) * sd


# ---- instruction-set builds (issue 28): the same answers, bit for bit ----
def _every_build(call):
    """``call()``'s result under each build this processor runs (the build chosen before is
    restored)."""
    before = _cpu.isa()
    try:
        return {isa: (_cpu.set_isa(isa), call())[1] for isa in _cpu.ISAS
                if _cpu.isa_supported(isa)}
    finally:
        _cpu.set_isa(before)


def _same(results):
    first = next(iter(results.values()))
    for isa, result in results.items():
        for a, b in zip(first, result):
            if a is None:
                assert b is None
            else:  # bit for bit, NaN included
                assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                                   b.view(torch.int32) if b.is_floating_point() else b), isa


def test_instruction_set_builds_agree_bit_for_bit():
    """Every build (baseline, AVX2 + FMA, AVX-512: those this machine runs; the dispatcher
    picks the best) gives identical tokens, counts, log-probabilities and probabilities:
    the same float operations, no FMA contraction. Mixed filters, a bitmask, subnormal
    probabilities, ragged vocabularies (tails shorter than a vector)."""
    gen = torch.Generator().manual_seed(28)
    assert _cpu.isa() in _cpu.ISAS and _cpu.isa_supported("baseline")
    for vocab, dtype in ((7, torch.float32), (3001, torch.bfloat16), (4099, torch.float32),
                         (2053, torch.float16)):
        batch, drafts = 10, 3
        target, draft_logits, ids = _inputs(batch, drafts, vocab, dtype, gen, scale=12.0)
        params = dict(mixed_params(batch, vocab, gen),
                      min_p=torch.where(torch.arange(batch) % 3 == 0, 0.05, 0.0),
                      seed=torch.arange(batch), offset=3)
        mask = torch.randint(-2**31, 2**31 - 1, (batch, drafts + 1, (vocab + 31) // 32),
                             generator=gen, dtype=torch.int32)
        probs = torch.softmax(torch.randn(batch, drafts, vocab, generator=gen), -1)
        _same(_every_build(lambda: tuple(sk.verify_chain(
            target, ids, draft_logits=draft_logits, token_bitmask=mask, return_logprobs="raw",
            **params))))
        _same(_every_build(lambda: tuple(sk.verify_chain(
            target, ids, draft_probs=probs.to(dtype), method="block",
            return_logprobs="processed", **params))))
        tree_ids = torch.cat([torch.full((batch, 1), -1), ids], 1)
        parents = torch.tensor([[-1, 0, 0, 1]] * batch)
        _same(_every_build(lambda: tuple(sk.verify_tree(
            target, tree_ids, parents, draft_probs=torch.softmax(target.float(), -1),
            draft_sampling="without_replacement", method="traversal",
            return_logprobs="processed", **params))))
        rows = target[:, 0].contiguous()
        _same(_every_build(lambda: tuple(sk.sample(rows, token_bitmask=mask[:, 0],
                                                   return_logprobs="processed", **params))))
        parsed = _params.sampling_params(params["temperature"], params["top_k"],
                                         params["top_p"], min_p=params["min_p"], batch=batch,
                                         vocab_size=vocab, device=torch.device("cpu"),
                                         validate=True)
        _same(_every_build(lambda: (_cpu.processed_probs(rows, parsed, mask[:, 0]),)))


def test_forcing_a_build_by_environment():
    """SPECDEC_CPU_ISA picks the build at import; a build the processor cannot run, or an
    unknown name, is a ValueError naming the variable's value."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    code = "from specdec_kernels import _cpu; print(_cpu.isa())"
    env = dict(os.environ, SPECDEC_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "baseline", out.stderr[-2000:]
    env["SPECDEC_CPU_ISA"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ValueError" in out.stderr and "sse9" in out.stderr


# ---- threads: at::parallel_for splits the batch (the extension is built with OpenMP) ----
def test_extension_parallelises_with_openmp():
    """at::parallel_for is a header template: compiled without OpenMP it runs every op on one
    thread, silently. The extension must call OpenMP's runtime (torch's libgomp)."""
    import specdec_kernels._C as ext  # noqa: PLC0415
    with open(ext.__file__, "rb") as handle:
        assert b"GOMP_parallel" in handle.read(), "the extension was built without -fopenmp"


def test_two_threads_agree_bit_for_bit_with_one():
    """The same answers on 2 threads as on 1 (requests split across tasks, one scratch per
    task, the expanded bitmask per thread): chains (token, block, packed), trees, samples,
    tree masks and KV compaction, each large enough that its grain (csrc/torch) splits it.
    And a bitmask changed in place between calls is read anew (no stale expanded mask)."""
    gen = torch.Generator().manual_seed(2)
    batch, drafts, vocab = 24, 3, 3001
    target, draft_logits, ids = _inputs(batch, drafts, vocab, torch.float32, gen)
    params = dict(mixed_params(batch, vocab, gen), seed=torch.arange(batch), offset=5)
    mask = torch.randint(-2**31, 2**31 - 1, (batch, drafts + 1, (vocab + 31) // 32),
                         generator=gen, dtype=torch.int32)
    probs = torch.softmax(torch.randn(batch, drafts, vocab, generator=gen), -1)
    parents = torch.tensor([[-1, 0, 0, 1]] * batch)
    tree_ids = torch.cat([torch.full((batch, 1), -1), ids], 1)
    packed_ids = ids.reshape(-1)
    cu = torch.arange(0, batch * drafts + 1, drafts, dtype=torch.int32)
    # Splitting needs >= 2 tasks: tree masks at 64 nodes (grain 65536 / (N * (N + 16)) = 12
    # requests), compaction at 16 KiB per position (grain 32768 / 16384 = 2 requests x layers).
    nodes = 64
    big_parents = torch.cat([torch.full((batch, 1), -1),
                             (torch.rand(batch, nodes - 1, generator=gen)
                              * torch.arange(1, nodes)).long()], 1)
    cache = torch.randn(batch, 12, 8, 512, generator=gen)
    paths = torch.tensor([[0, 2, 3, -1]] * batch)

    def calls():
        compacted = cache.clone()
        lens = sk.compact_kv_cache([compacted], torch.arange(batch) % 5, paths,
                                   torch.arange(batch) % 3)
        return (tuple(sk.verify_chain(target, ids, draft_logits=draft_logits,
                                      token_bitmask=mask, return_logprobs="raw", **params))
                + tuple(sk.verify_chain(target, ids, draft_probs=probs, method="block",
                                        **params))
                + tuple(sk.verify_chain_packed(target.reshape(-1, vocab), packed_ids, cu,
                                               draft_probs=probs.reshape(-1, vocab),
                                               max_draft_tokens=drafts, **params))
                + tuple(sk.verify_tree(target, tree_ids, parents,
                                       draft_probs=torch.softmax(target.float(), -1),
                                       method="traversal", **params))
                + tuple(sk.sample(target[:, 0].contiguous(), token_bitmask=mask[:, 0],
                                  **params))
                + tuple(sk.build_tree_attention(big_parents, prefix_lens=torch.arange(batch)))
                + (lens, compacted))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = calls()
        torch.set_num_threads(2)
        two = calls()
        rows, words = target[:, 0].contiguous(), mask[:, 0].contiguous()
        first = sk.sample(rows, token_bitmask=words, **params)
        words.bitwise_not_()  # the same storage, other words
        again = sk.sample(rows, token_bitmask=words, **params)
        fresh = sk.sample(rows, token_bitmask=words.clone(), **params)
    finally:
        torch.set_num_threads(before)
    _same({"1 thread": one, "2 threads": two})
    _same({"in place": tuple(again), "fresh": tuple(fresh)})
    assert not torch.equal(first[0], again[0])
