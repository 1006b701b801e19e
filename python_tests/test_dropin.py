"""Contract sections 8-10 through the public API: min_p, token_bitmask, return_logprobs and
verify_chain_packed. Definitions against an independent float64 implementation, laws by
chi-square (alpha and power stated at each test), equalities token for token on every backend,
and bad input."""
from __future__ import annotations

import math

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference import chain as ref_chain
from specdec_kernels.reference import sampling as ref_sampling

from conftest import CHAIN_BACKENDS
from test_chain_exactness import ALPHA, TV_MIN, _chi_square



# --- helpers -----------------------------------------------------------------------------

def bitmask_of(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(V/32)]`` with bit ``v % 32`` of word ``v // 32`` = ``allowed[..., v]``
    (written independently of the library: Python integers per word)."""
    vocab = allowed.shape[-1]
    words = -(-vocab // 32)
    flat = allowed.reshape(-1, vocab).tolist()
    out = []
    for row in flat:
        row_words = []
        for w in range(words):
            value = sum(1 << b for b in range(32) if w * 32 + b < vocab and row[w * 32 + b])
            row_words.append(value - (1 << 32) if value >= 1 << 31 else value)
        out.append(row_words)
    return torch.tensor(out, dtype=torch.int32).reshape(*allowed.shape[:-1], words)


def oracle_probs(x, temperature, top_k, top_p, min_p, allowed=None):
    """Contract sections 1 and 8 for one row, in float64 Python (sorted lists, no torch
    filters): bitmask, temperature, top-k, min-p, softmax, top-p, renormalise. The public API
    takes float parameters as float32, so they are rounded to it first."""
    as_f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))
    temperature, top_p, min_p = as_f32(temperature), as_f32(top_p), as_f32(min_p)
    vocab = len(x)
    x = [float(v) if math.isfinite(float(v)) and (allowed is None or allowed[i]) else -math.inf
         for i, v in enumerate(x)]
    if max(x) == -math.inf:
        return [0.0] * vocab
    if temperature == 0:
        best = max(x)
        first = x.index(best)
        return [1.0 if i == first else 0.0 for i in range(vocab)]
    z = [v / temperature for v in x]
    kept = [v > -math.inf for v in z]
    if 0 < top_k < vocab:
        kth = sorted(z, reverse=True)[top_k - 1]
        kept = [k and v >= kth for k, v in zip(kept, z)]
    if min_p > 0:
        z_max = max(z)
        kept = [k and v >= z_max + math.log(min_p) for k, v in zip(kept, z)]
    z_max = max(v for v, k in zip(z, kept) if k)
    e = [math.exp(v - z_max) if k else 0.0 for v, k in zip(z, kept)]
    total = sum(e)
    p = [v / total for v in e]
    if top_p < 1:
        ordered = sorted(p, reverse=True)
        mass, tau = 0.0, ordered[-1]
        for v in ordered:
            mass += v
            if mass >= top_p:
                tau = v
                break
        p = [v if v >= tau else 0.0 for v in p]
        total = sum(p)
        p = [v / total for v in p]
    return p


# --- definitions -------------------------------------------------------------------------

CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 1.0), (0.7, 0, 1.0, 0.2), (1.3, 5, 1.0, 0.05),
    (0.9, 0, 0.6, 0.1), (1.0, 4, 0.8, 0.3), (0.0, 0, 1.0, 0.5), (0.5, 3, 0.5, 0.9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-k{}-p{}-m{}".format(*c))
def test_processed_probs_matches_float64_oracle(case):
    temperature, top_k, top_p, min_p = case
    gen = torch.Generator().manual_seed(7)
    vocab = 45  # two bitmask words, the second partial
    rows = torch.randn(6, vocab, generator=gen, dtype=torch.float64) * 2
    rows[1, 3:9] = rows[1].max()  # ties at the maximum (min_p = 1 keeps all of them)
    rows[2, ::3] = 0.25           # ties inside the kept set
    rows[3, 10] = float("nan")
    allowed = torch.rand(6, vocab, generator=gen) < 0.6
    allowed[4] = False            # nothing allowed: all zero
    allowed[5] = True
    got = sk.processed_probs(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p, token_bitmask=bitmask_of(allowed))
    for b in range(6):
        want = torch.tensor(oracle_probs(rows[b].tolist(), temperature, top_k, top_p, min_p,
                                         allowed[b].tolist()), dtype=torch.float64)
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-15)
    assert (got[4] == 0).all()
    # Without a bitmask: every token allowed.
    plain = sk.processed_probs(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                               min_p=min_p)
    for b in range(6):
        want = oracle_probs(rows[b].tolist(), temperature, top_k, top_p, min_p)
        torch.testing.assert_close(plain[b], torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-15)


def test_processed_probs_bitmask_leading_dims_and_bits_past_vocab():
    logits = torch.randn(2, 3, 33, generator=torch.Generator().manual_seed(1))
    allowed = torch.rand(2, 3, 33, generator=torch.Generator().manual_seed(2)) < 0.5
    allowed[..., 0] = True
    mask = bitmask_of(allowed)
    mask[..., 1] |= -2  # bits 33..63: past V, ignored
    got = sk.processed_probs(logits, token_bitmask=mask, min_p=0.01)
    want = sk.processed_probs(logits.masked_fill(~allowed, float("-inf")), min_p=0.01)
    assert torch.equal(got, want)
    one = sk.processed_probs(logits[0, 0], token_bitmask=mask[0, 0])  # 1-D: [V] and [W]
    assert torch.equal(one, sk.processed_probs(logits[0, 0].masked_fill(~allowed[0, 0],
                                                                        float("-inf"))))


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_nothing_allowed_emits_minus_one_with_nan_logprob(backend):
    logits = torch.randn(3, 40)
    allowed = torch.ones(3, 40, dtype=torch.bool)
    allowed[1] = False
    for kind in ("processed", "raw"):
        out = sk.sample(logits, token_bitmask=bitmask_of(allowed), seed=3, backend=backend,
                        temperature=torch.tensor([1.0, 1.0, 0.0]), return_logprobs=kind)
        assert isinstance(out, sk.SampleOutput)
        assert out.token_ids[1] == -1 and math.isnan(out.logprobs[1])
        assert (out.token_ids[[0, 2]] >= 0).all() and not out.logprobs[[0, 2]].isnan().any()
        chain = sk.verify_chain(logits[:, None].expand(3, 2, 40).contiguous(),
                                torch.zeros(3, 1, dtype=torch.int64), seed=3, backend=backend,
                                token_bitmask=bitmask_of(allowed)[:, None].expand(3, 2, 2)
                                .contiguous(), return_logprobs=kind)
        assert chain.output_token_ids[1].tolist() == [-1, -1]
        assert chain.logprobs[1].isnan().all()


def _logprob_oracle(logits_row, probs_row, token, kind, greedy):
    if token < 0:
        return float("nan")
    if kind == "raw":
        return float(torch.log_softmax(logits_row.double(), -1)[token])
    return 0.0 if greedy else float(torch.log(probs_row[token].double()))


@pytest.mark.parametrize("kind", ["processed", "raw"])
def test_logprobs_are_those_of_the_emitting_row(kind):
    gen = torch.Generator().manual_seed(11)
    batch, num_drafts, vocab = 6, 3, 50
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=gen) < 0.7
    drafts = target[:, :num_drafts].argmax(-1)  # often accepted
    params = dict(temperature=torch.tensor([1.0, 0.0, 0.8, 1.2, 1.0, 0.0]),
                  top_k=torch.tensor([0, 0, 10, 0, 0, 5]), min_p=torch.tensor([0.0, 0.1, 0.0, 0.05, 0.2, 0.0]),
                  top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.7, 1.0]))
    mask = bitmask_of(allowed)
    out = sk.verify_chain(target, drafts, token_bitmask=mask, seed=torch.arange(batch),
                          num_draft_tokens=torch.tensor([3, 2, 0, 3, 1, 3]),
                          return_logprobs=kind, backend="reference", **params)
    probs = sk.processed_probs(target, token_bitmask=mask, **params)
    for b in range(batch):
        for j in range(num_drafts + 1):
            want = _logprob_oracle(target[b, j], probs[b, j], int(out.output_token_ids[b, j]),
                                   kind, params["temperature"][b] == 0)
            got = float(out.logprobs[b, j])
            assert (math.isnan(want) and math.isnan(got)) or abs(got - want) < 1e-5, (b, j)
    # sample: row 0 of each request
    s = sk.sample(target[:, 0], token_bitmask=mask[:, 0], seed=5, return_logprobs=kind,
                  backend="reference", **params)
    for b in range(batch):
        want = _logprob_oracle(target[b, 0], probs[b, 0], int(s.token_ids[b]), kind,
                               params["temperature"][b] == 0)
        assert abs(float(s.logprobs[b]) - want) < 1e-5


@pytest.mark.parametrize("kind", ["processed", "raw"])
def test_tree_logprobs_use_the_parent_row_and_the_last_node_row(kind):
    gen = torch.Generator().manual_seed(12)
    batch, nodes, vocab = 5, 6, 40
    target = torch.randn(batch, nodes, vocab, generator=gen) * 2
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * batch)
    tokens = target.argmax(-1).gather(1, parents.clamp(min=0))  # children = parent's argmax
    tokens[:, 2] = (tokens[:, 2] + 1) % vocab
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.5])
    out = sk.verify_tree(target, tokens, parents, temperature=temperature, min_p=0.05,
                         seed=torch.arange(batch), return_logprobs=kind, backend="reference")
    probs = sk.processed_probs(target, temperature=temperature, min_p=0.05)
    for b in range(batch):
        for m in range(nodes):
            token = int(out.output_token_ids[b, m])
            row = int(out.accepted_nodes[b, m]) if token >= 0 else 0
            want = _logprob_oracle(target[b, row], probs[b, row], token, kind,
                                   temperature[b] == 0)
            got = float(out.logprobs[b, m])
            assert (math.isnan(want) and math.isnan(got)) or abs(got - want) < 1e-5, (b, m)
    plain = sk.verify_tree(target, tokens, parents, temperature=temperature, min_p=0.05,
                           seed=torch.arange(batch), backend="reference")
    assert plain.logprobs is None and torch.equal(plain.output_token_ids, out.output_token_ids)


# --- laws (chi-square, alpha = ALPHA per test, power vs TV >= TV_MIN asserted >= 0.99) -------

LAW_VOCAB = 40  # two words: a bitmask read one word off changes the allowed set
LAW_LOGITS = torch.randn(4, LAW_VOCAB, generator=torch.Generator().manual_seed(21)) * 1.5
LAW_ALLOWED = torch.zeros(4, LAW_VOCAB, dtype=torch.bool)
LAW_ALLOWED[:, [1, 4, 6, 9, 33, 35, 38]] = True
LAW_ALLOWED[2, [0, 2, 34, 36]] = True
MIN_P_PARAMS = dict(temperature=1.0, top_p=0.5, min_p=0.3)  # min_p after top-p keeps more


def _law_logits():
    """Rows with a few dominant tokens (so min_p and top-p interact, see MIN_P_PARAMS)."""
    x = torch.full((4, LAW_VOCAB), -4.0)
    x[:, [1, 4, 6, 9, 33, 35, 38]] = torch.tensor([1.2, 0.9, 0.0, -0.3, 0.8, -0.5, 0.4])
    return x + 0.3 * LAW_LOGITS


def _oracle_row(x, allowed=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return torch.tensor(oracle_probs(x.tolist(), temperature, top_k, top_p, min_p,
                                     None if allowed is None else allowed.tolist()),
                        dtype=torch.float64)


def _min_p_after_top_p(logits, temperature, top_k, top_p, min_p=None, token_bitmask=None):
    """Planted bug: min_p applied after top-p (the contract puts it before the softmax)."""
    p = _CORRECT_PROBS(logits, temperature, top_k, top_p, None, token_bitmask)
    if min_p is None:
        return p
    keep = p >= p.amax(-1, keepdim=True) * min_p.reshape(-1, *[1] * (p.dim() - 1))
    p = torch.where(keep, p, 0.0)
    return p / p.sum(-1, keepdim=True).clamp(min=1e-30)


def _bitmask_one_word_off(logits, temperature, top_k, top_p, min_p=None, token_bitmask=None):
    """Planted bug: word w of each row read from word w + 1 (wrapping)."""
    if token_bitmask is not None:
        token_bitmask = token_bitmask.roll(-1, -1)
    return _CORRECT_PROBS(logits, temperature, top_k, top_p, min_p, token_bitmask)


_CORRECT_PROBS = ref_sampling.processed_probs
BUGS = {"min_p": _min_p_after_top_p, "bitmask": _bitmask_one_word_off}


def _sample_counts(feature: str, draws: int, backend: str = "auto"):
    x = _law_logits()[0]
    seeds = torch.arange(draws)
    if feature == "min_p":
        tokens = sk.sample(x.expand(draws, -1), seed=seeds, offset=9, backend=backend,
                           **MIN_P_PARAMS)
        want = _oracle_row(x, **MIN_P_PARAMS)
    else:
        mask = bitmask_of(LAW_ALLOWED[0]).expand(draws, -1)
        tokens = sk.sample(x.expand(draws, -1), seed=seeds, offset=9, token_bitmask=mask,
                           backend=backend)
        want = _oracle_row(x, LAW_ALLOWED[0])
    return torch.bincount(tokens.long(), minlength=LAW_VOCAB), want


def _chain_counts(feature: str, batch: int, position: int, backend: str = "auto"):
    """A verify round over context-free rows, drafts sampled from q = the draft's own
    processed distribution (draft logits: min_p applies to them too; never the bitmask)."""
    x = _law_logits()
    target = x.expand(batch, 4, LAW_VOCAB)
    draft = (x[:3] + 0.7 * LAW_LOGITS[:3].flip(-1))
    seeds = torch.arange(batch, dtype=torch.int64) + 77
    kw = dict(MIN_P_PARAMS) if feature == "min_p" else {}
    mask = None
    if feature == "bitmask":
        mask = bitmask_of(LAW_ALLOWED).expand(batch, 4, -1)
    drafts = torch.stack([sk.sample(draft[j].expand(batch, -1), seed=seeds, offset=3 + j,
                                    backend=backend, **kw) for j in range(3)], 1)
    out = sk.verify_chain(target, drafts, draft_logits=draft.expand(batch, 3, LAW_VOCAB),
                          seed=seeds, offset=3, token_bitmask=mask, backend="reference", **kw)
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    reached = accepted >= position
    counts = torch.bincount(tokens[reached, position], minlength=LAW_VOCAB)
    want = _oracle_row(x[position], LAW_ALLOWED[position] if feature == "bitmask" else None, **kw)
    return counts, want


@pytest.mark.parametrize("feature", ["min_p", "bitmask"])
def test_sample_law(feature):
    counts, want = _sample_counts(feature, 40_000)
    pvalue, power = _chi_square(counts, want)
    print(f"sample {feature}: p-value={pvalue:.3g} power(TV>={TV_MIN})={power:.4f}")
    assert power >= 0.99 and pvalue > ALPHA


@pytest.mark.parametrize("feature", ["min_p", "bitmask"])
def test_verify_chain_law(feature):
    for position in (0, 1):
        counts, want = _chain_counts(feature, 40_000, position)
        pvalue, power = _chi_square(counts, want)
        print(f"chain {feature} position {position}: N={int(counts.sum())} p-value={pvalue:.3g} "
              f"power(TV>={TV_MIN})={power:.4f}")
        assert pvalue > ALPHA
        if position == 0:
            assert power >= 0.99


@pytest.mark.parametrize("feature", ["min_p", "bitmask"])
def test_laws_catch_planted_bugs(monkeypatch, feature):
    monkeypatch.setattr(ref_sampling, "processed_probs", BUGS[feature])
    monkeypatch.setattr(ref_chain, "processed_probs", BUGS[feature])
    # The bug is planted in the reference, so every draw takes it (auto would run C++ on CPU).
    counts, want = _sample_counts(feature, 40_000, backend="reference")
    assert _chi_square_rejects(counts, want), f"sample: missed the planted {feature} bug"
    counts, want = _chain_counts(feature, 40_000, 0, backend="reference")
    assert _chi_square_rejects(counts, want), f"verify_chain: missed the planted {feature} bug"


def _chi_square_rejects(counts, want) -> bool:
    if bool((counts[want == 0] > 0).any()):  # a token the law forbids: rejected outright
        return True
    pvalue, power = _chi_square(counts, want)
    return power >= 0.99 and pvalue < ALPHA


# --- equalities ------------------------------------------------------------------------------

def _masked_problem(batch=5, num_drafts=3, vocab=77, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2
    draft_logits = target[:, :num_drafts] + torch.randn(batch, num_drafts, vocab, generator=gen)
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=gen) < 0.5
    drafts = torch.where(allowed[:, :num_drafts], target[:, :num_drafts], -99).argmax(-1)
    return target, draft_logits, allowed, drafts


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
@pytest.mark.parametrize("mode", ["one_hot", "draft_probs", "draft_logits"])
def test_bitmask_equals_masked_logits(backend, mode):
    target, draft_logits, allowed, drafts = _masked_problem()
    masked = target.masked_fill(~allowed, float("-inf"))
    draft_kw = {"one_hot": {}, "draft_probs": {"draft_probs": torch.softmax(draft_logits, -1)},
                "draft_logits": {"draft_logits": draft_logits}}[mode]
    kw = dict(seed=torch.arange(5) * 13, offset=2, temperature=torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3]),
              top_k=torch.tensor([0, 0, 9, 0, 4]), min_p=torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0]),
              num_draft_tokens=torch.tensor([3, 3, 2, 0, 1]), backend=backend, **draft_kw)
    if backend == "triton":
        pytest.importorskip("specdec_kernels.triton.chain")
    with_mask = sk.verify_chain(target, drafts, token_bitmask=bitmask_of(allowed),
                                return_logprobs="processed", **kw)
    with_inf = sk.verify_chain(masked, drafts, return_logprobs="processed", **kw)
    assert torch.equal(with_mask.output_token_ids, with_inf.output_token_ids)
    assert torch.equal(with_mask.num_accepted, with_inf.num_accepted)
    torch.testing.assert_close(with_mask.logprobs, with_inf.logprobs, equal_nan=True)
    emitted = with_mask.output_token_ids.long()
    assert bool(allowed.gather(-1, emitted.clamp(min=0)[..., None])[..., 0][emitted >= 0].all())
    s_mask = sk.sample(target[:, 0], token_bitmask=bitmask_of(allowed[:, 0]), seed=4,
                       min_p=0.02, backend=backend)
    assert torch.equal(s_mask, sk.sample(masked[:, 0], seed=4, min_p=0.02, backend=backend))


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_tree_bitmask_equals_masked_logits(backend):
    gen = torch.Generator().manual_seed(3)
    batch, nodes, vocab = 4, 5, 70
    target = torch.randn(batch, nodes, vocab, generator=gen) * 2
    allowed = torch.rand(batch, nodes, vocab, generator=gen) < 0.4
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * batch)
    tokens = torch.where(allowed, target, -99).argmax(-1).gather(1, parents.clamp(min=0))
    probs = torch.softmax(target, -1)
    kw = dict(seed=torch.arange(batch), temperature=torch.tensor([1.0, 0.0, 0.8, 1.0]),
              min_p=0.03, backend=backend, return_logprobs="processed")
    for draft in (None, probs):
        a = sk.verify_tree(target, tokens, parents, draft_probs=draft,
                           token_bitmask=bitmask_of(allowed), **kw)
        b = sk.verify_tree(target.masked_fill(~allowed, float("-inf")), tokens, parents,
                           draft_probs=draft, **kw)
        assert torch.equal(a.output_token_ids, b.output_token_ids)
        assert torch.equal(a.accepted_nodes, b.accepted_nodes)
        torch.testing.assert_close(a.logprobs, b.logprobs, equal_nan=True)


def packed_problem(lengths, num_drafts=3, vocab=37, seed=0, dtype=torch.float32):
    """A ragged batch in the packed layout and its padded equivalent (random values in the
    padding, which must not matter)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    target = (torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2).to(dtype)
    draft_logits = (target[:, :num_drafts].float()
                    + torch.randn(batch, num_drafts, vocab, generator=gen)).to(dtype)
    drafts = torch.where(torch.rand(batch, num_drafts, generator=gen) < 0.6,
                         target[:, :num_drafts].float().argmax(-1),
                         torch.randint(0, vocab, (batch, num_drafts), generator=gen))
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=gen) < 0.8
    allowed[..., 0] = True
    mask = bitmask_of(allowed)
    n = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    rows = [j for b in range(batch) for j in range(lengths[b] + 1)]
    req = [b for b in range(batch) for _ in range(lengths[b] + 1)]
    drows = [j for b in range(batch) for j in range(lengths[b])]
    dreq = [b for b in range(batch) for _ in range(lengths[b])]
    packed = dict(target_logits=target[req, rows], draft_token_ids=drafts[dreq, drows],
                  cu_num_draft_tokens=cu, draft_logits=draft_logits[dreq, drows],
                  token_bitmask=mask[req, rows])
    padded = dict(target_logits=target, draft_token_ids=drafts, num_draft_tokens=n,
                  draft_logits=draft_logits, token_bitmask=mask)
    return packed, padded


PACKED_LENGTHS = [3, 0, 1, 3, 2, 0, 3]


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
@pytest.mark.parametrize("mode", ["one_hot", "draft_probs", "draft_logits"])
def test_packed_equals_padded(backend, mode):
    packed, padded = packed_problem(PACKED_LENGTHS)
    batch = len(PACKED_LENGTHS)
    for d in (packed, padded):
        logits = d.pop("draft_logits")
        if mode == "draft_probs":
            d["draft_probs"] = torch.softmax(logits.float(), -1)
        elif mode == "draft_logits":
            d["draft_logits"] = logits
    kinds = [dict(temperature=0.0), dict(temperature=torch.tensor([1.0, 0.0, 0.7, 1.2, 1.0, 0.9, 0.0]),
                                         top_k=torch.tensor([0, 0, 5, 0, 0, 3, 0]),
                                         top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 1.0, 1.0]))]
    # (the bitmask and min_p with processed logprobs; raw logprobs without them; neither)
    extras = [(True, dict(min_p=0.05, return_logprobs="processed")),
              (False, dict(return_logprobs="raw")), (False, {})]
    combos = [(kind, extra) for kind in kinds for extra in extras]
    if backend == "triton":  # the interpreter: the greedy plain call and the sampled one with
        combos = [combos[2], combos[3]]  # every feature (test_triton_dropin.py has more)
    for kind, (use_mask, extra) in combos:
        kw = dict(seed=torch.arange(batch) * 7, offset=5, backend=backend, **kind, **extra)
        drop = () if use_mask else ("token_bitmask",)
        got = sk.verify_chain_packed(**{k: v for k, v in packed.items() if k not in drop},
                                     max_draft_tokens=3, **kw)
        want = sk.verify_chain(**{k: v for k, v in padded.items() if k not in drop}, **kw)
        assert torch.equal(got.output_token_ids, want.output_token_ids), (kind, extra)
        assert torch.equal(got.num_accepted, want.num_accepted)
        if want.logprobs is None:
            assert got.logprobs is None
        else:
            torch.testing.assert_close(got.logprobs, want.logprobs, equal_nan=True)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_packed_edge_shapes(backend):
    # No drafts at all (T = 0), and K = 0.
    logits = torch.randn(3, 20)
    empty = torch.zeros(0, dtype=torch.int64)
    out = sk.verify_chain_packed(logits, empty, torch.zeros(4, dtype=torch.int32),
                                 max_draft_tokens=2, temperature=0.0, backend=backend,
                                 draft_probs=torch.zeros(0, 20))
    assert out.output_token_ids.shape == (3, 3)
    assert out.output_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert (out.output_token_ids[:, 1:] == -1).all() and (out.num_accepted == 0).all()
    out0 = sk.verify_chain_packed(logits, empty, torch.zeros(4, dtype=torch.int64),
                                  max_draft_tokens=0, temperature=0.0, backend=backend)
    assert out0.output_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    # B = 0
    none = sk.verify_chain_packed(torch.zeros(0, 20), empty, torch.zeros(1, dtype=torch.int64),
                                  max_draft_tokens=2, backend=backend, seed=1)
    assert none.output_token_ids.shape == (0, 3)


# --- bad input ---------------------------------------------------------------------------

def _rng_state_unchanged(call):
    state = torch.get_rng_state()
    call()
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_bad_new_arguments_raise_naming_them(backend):
    target, _, allowed, drafts = _masked_problem(batch=2, vocab=40)
    mask = bitmask_of(allowed)
    chain = lambda **kw: sk.verify_chain(target, drafts, backend=backend, **kw)
    bad = [
        (dict(min_p=1.5), ValueError, "min_p"), (dict(min_p=-0.1), ValueError, "min_p"),
        (dict(min_p=float("nan")), ValueError, "min_p"),
        (dict(min_p=torch.tensor([0.1, 2.0])), ValueError, "min_p"),
        (dict(min_p=torch.tensor([0.1, 0.2, 0.3])), ValueError, "min_p"),
        (dict(min_p="0.1"), TypeError, "min_p"),
        (dict(token_bitmask=mask[..., :1]), ValueError, "token_bitmask"),
        (dict(token_bitmask=mask[:, :3]), ValueError, "token_bitmask"),
        (dict(token_bitmask=mask.long()), TypeError, "token_bitmask"),
        (dict(token_bitmask=allowed), TypeError, "token_bitmask"),
        (dict(token_bitmask=[1, 2]), TypeError, "token_bitmask"),
        (dict(return_logprobs="log"), ValueError, "return_logprobs"),
        (dict(return_logprobs=True), ValueError, "return_logprobs"),
    ]
    for kw, error, name in bad:
        with pytest.raises(error, match=name):
            _rng_state_unchanged(lambda: chain(**kw))
        # A wrong width is a shape: an error with validate=False too.
        if "token_bitmask" in kw and error is ValueError:
            with pytest.raises(ValueError, match="token_bitmask"):
                chain(validate=False, **kw)
    with pytest.raises(ValueError, match="token_bitmask"):
        sk.sample(target[:, 0], token_bitmask=mask[:, 0, :1], validate=False, backend=backend)
    with pytest.raises(ValueError, match="token_bitmask"):
        sk.processed_probs(target[:, 0], token_bitmask=mask[:1, 0])
    with pytest.raises(ValueError, match="return_logprobs"):
        sk.sample(target[:, 0], return_logprobs="x", backend=backend)
    with pytest.raises(ValueError, match="token_bitmask"):
        sk.verify_tree(target, drafts.new_zeros(2, 4), torch.tensor([[-1, 0, 1, 2]] * 2),
                       token_bitmask=mask[:, :, :1], backend=backend)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_bad_packed_offsets_raise_naming_cu_num_draft_tokens(backend):
    packed, _ = packed_problem([2, 0, 3])
    kw = dict(max_draft_tokens=3, backend=backend)
    target, ids, cu = packed["target_logits"], packed["draft_token_ids"], packed["cu_num_draft_tokens"]
    bad_offsets = [torch.tensor([1, 2, 2, 5]), torch.tensor([0, 3, 2, 5]),
                   torch.tensor([0, 2, 2, 4]), torch.tensor([0, 0, 0, 5])]  # cu[0], decreasing, cu[B], n_b > K
    for bad in bad_offsets:
        with pytest.raises(ValueError, match="cu_num_draft_tokens"):
            _rng_state_unchanged(lambda: sk.verify_chain_packed(target, ids, bad, **kw))
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):  # n_b > K
        sk.verify_chain_packed(target, ids, cu, max_draft_tokens=2, backend=backend)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):  # rows != T + B
        sk.verify_chain_packed(target[1:], ids, cu, validate=False, **kw)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        sk.verify_chain_packed(target, ids, cu[:, None], **kw)
    with pytest.raises(TypeError, match="cu_num_draft_tokens"):
        sk.verify_chain_packed(target, ids, cu.float(), **kw)
    with pytest.raises(TypeError, match="max_draft_tokens"):
        sk.verify_chain_packed(target, ids, cu, max_draft_tokens=3.0, backend=backend)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        sk.verify_chain_packed(target, ids, cu, max_draft_tokens=-1, backend=backend)
    with pytest.raises(ValueError, match="method"):
        sk.verify_chain_packed(target, ids, cu, method="tokens", **kw)
    with pytest.raises(ValueError, match="draft_token_ids"):
        sk.verify_chain_packed(target, torch.full_like(ids, 37), cu, **kw)
    with pytest.raises(ValueError, match="draft_logits"):
        sk.verify_chain_packed(target, ids, cu, draft_logits=packed["draft_logits"][1:], **kw)
    with pytest.raises(ValueError, match="token_bitmask"):
        sk.verify_chain_packed(target, ids, cu, token_bitmask=packed["token_bitmask"][1:], **kw)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_unvalidated_garbage_stays_in_range(backend):
    gen = torch.Generator().manual_seed(9)
    vocab = 45
    packed, _ = packed_problem([2, 0, 3], vocab=vocab)
    target, ids = packed["target_logits"], packed["draft_token_ids"]
    garbage_mask = torch.randint(-2**31, 2**31 - 1, packed["token_bitmask"].shape, generator=gen,
                                 dtype=torch.int64).to(torch.int32)
    min_ps = torch.tensor([float("nan"), 7.0, -3.0])
    for cu in (torch.tensor([5, -3, 99, 1]), torch.tensor([0, 4, 1, 5]), torch.tensor([0, 2, 2, 5])):
        for extra in ({}, dict(draft_logits=packed["draft_logits"])):
            out = sk.verify_chain_packed(
                target, torch.randint(-50, 50, ids.shape, generator=gen), cu,
                max_draft_tokens=3, min_p=min_ps, token_bitmask=garbage_mask, seed=1,
                return_logprobs="processed", validate=False, backend=backend, **extra)
            tokens = out.output_token_ids
            assert ((tokens >= -1) & (tokens < vocab)).all()
            assert out.logprobs[tokens == -1].isnan().all()
    logits = target[:3]
    s = sk.sample(logits, min_p=min_ps, token_bitmask=garbage_mask[:3], seed=2, validate=False,
                  backend=backend)
    assert ((s >= -1) & (s < vocab)).all()
