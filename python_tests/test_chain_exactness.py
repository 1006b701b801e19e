"""Exactness of chain verification on the reference path.

1. Exact float64 enumeration: for tiny V and K, every draft sequence and every acceptance
   region of the uniforms is enumerated through ``reference.chain.chain_outcome`` (the code the
   sampler runs); the emitted tokens, completed to K+1 tokens by sampling the target, have
   exactly the target's autoregressive law. (The enumeration treats the uniforms as
   continuous; the implementation's are float32 roundings of multiples of 2**-32, a bias of at
   most the float32 rounding of p/q plus 2**-32 per decision, far below anything the tests
   below can see.)
2. Chi-square tests of sampled outputs (first token, and each token given the earlier drafts
   were accepted), plus acceptance counts against sum(min(p, q)).
   False-alarm rate: alpha = 1e-4 per test (about 40 tests here, so at most ~0.4% for the file
   over the choice of seeds). Power against any law at total-variation distance >= 0.02 is
   computed from the non-central chi-square (noncentrality >= 4 N TV^2) and asserted >= 0.99
   for the first-token tests; printed for the others.
3. Planted bug: resampling from p instead of the residual after a rejection. Both the
   enumeration and the chi-square test catch it.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

import specdec_kernels as sk
from specdec_kernels import _rng
from specdec_kernels.reference import chain as ref_chain
from specdec_kernels.reference import sampling as ref_sampling

ALPHA = 1e-4
TV_MIN = 0.02
U_REJECT = 1.0 - 2.0 ** -24  # largest uniform: lies in the rejection region whenever it has mass

PARAMS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 2, 1.0),
    (1.3, 0, 0.8),
    (0.9, 3, 0.75),
    (0.0, 0, 1.0),
]
MODES = ["draft_probs", "draft_logits", "one_hot"]


def _probs(logits: torch.Tensor, params) -> torch.Tensor:
    t, k, p = params
    rows = logits.reshape(-1, logits.shape[-1])
    b = rows.shape[0]
    out = ref_sampling.processed_probs(rows, torch.full((b,), t, dtype=torch.float64),
                                       torch.full((b,), k), torch.full((b,), p, dtype=torch.float64))
    return out.reshape(logits.shape)


class ToyModels:
    """Target and draft logits for every prefix of length 0..K over a vocabulary of V."""

    def __init__(self, vocab: int, num_drafts: int, seed: int, params, mode: str):
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.num_drafts, self.params, self.mode = vocab, num_drafts, params, mode
        self.prefixes = [pre for n in range(num_drafts + 1)
                         for pre in itertools.product(range(vocab), repeat=n)]
        self.index = {pre: i for i, pre in enumerate(self.prefixes)}
        target = torch.randn(len(self.prefixes), vocab, generator=gen, dtype=torch.float64) * 1.5
        draft = target + torch.randn(target.shape, generator=gen, dtype=torch.float64)
        self.p = _probs(target, params)
        if mode == "draft_probs":  # the drafter's own distribution, not the target's filters
            self.q = torch.softmax(draft, -1)
        elif mode == "draft_logits":
            self.q = _probs(draft, params)
        else:  # deterministic drafter: arg-max of its logits
            self.q = torch.zeros_like(draft).scatter_(-1, draft.argmax(-1, keepdim=True), 1.0)

    def target(self, prefix) -> torch.Tensor:
        return self.p[self.index[tuple(prefix)]]

    def draft(self, prefix) -> torch.Tensor:
        return self.q[self.index[tuple(prefix)]]

    def target_law(self, length: int) -> dict:
        law = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            prob = 1.0
            for j in range(length):
                prob *= float(self.target(seq[:j])[seq[j]])
            law[seq] = prob
        return law

    def completed(self, prefix, length: int, complete: bool = True) -> dict:
        """``complete(prefix, length)``, or ``{prefix: 1}`` when ``complete`` is False."""
        return self.complete(prefix, length) if complete else {tuple(prefix): 1.0}

    def complete(self, prefix, length: int) -> dict:
        """Law of ``prefix`` continued by the target to ``length`` tokens."""
        law = {tuple(prefix): 1.0}
        for _ in range(length - len(prefix)):
            nxt = {}
            for seq, prob in law.items():
                row = self.target(seq)
                for tok in range(self.vocab):
                    if row[tok] > 0:
                        nxt[seq + (tok,)] = nxt.get(seq + (tok,), 0.0) + prob * float(row[tok])
            law = nxt
        return law


def enumerate_round(models: ToyModels, num_draft_tokens: int, outcome=ref_chain.chain_outcome,
                    complete: bool = True):
    """Exact law of one verify round's tokens, completed by the target to K+1 tokens
    (``complete=False``: the law of the emitted tokens themselves)."""
    vocab, K, n = models.vocab, models.num_drafts, num_draft_tokens
    greedy = models.params[0] == 0
    branches = []  # (drafts, intended accepted count, probability)
    for drafts in itertools.product(range(vocab), repeat=n):
        q_prob = 1.0
        for j in range(n):
            q_prob *= float(models.draft(drafts[:j])[drafts[j]])
        if q_prob == 0:
            continue
        ratios = [min(1.0, float(models.target(drafts[:j])[drafts[j]])
                      / float(models.draft(drafts[:j])[drafts[j]])) for j in range(n)]
        for accepted in range(n + 1):
            prob = q_prob
            for j in range(accepted):
                prob *= ratios[j]
            if accepted < n:
                prob *= 1.0 - ratios[accepted]
            if prob > 0:
                branches.append((drafts, accepted, prob))

    batch = len(branches)
    drafts_t = torch.zeros(batch, K, dtype=torch.int64)
    u = torch.zeros(batch, K, dtype=torch.float64)
    p = torch.zeros(batch, K + 1, vocab, dtype=torch.float64)
    q = torch.zeros(batch, K, vocab, dtype=torch.float64)
    for b, (drafts, accepted, _) in enumerate(branches):
        drafts_t[b, :n] = torch.tensor(drafts, dtype=torch.int64)
        if accepted < n:
            u[b, accepted] = U_REJECT
        full = list(drafts) + [0] * (K - n)
        for j in range(K + 1):
            p[b, j] = models.target(full[:j])
        for j in range(K):
            q[b, j] = models.draft(full[:j])
    valid = torch.arange(K)[None, :] < n
    valid = valid.expand(batch, K)
    q_arg = None if models.mode == "one_hot" else q
    num_accepted, weights = outcome(p, q_arg, drafts_t, valid,
                                    torch.full((batch,), greedy), u)
    law = {}
    for b, (drafts, accepted, prob) in enumerate(branches):
        assert int(num_accepted[b]) == accepted, "acceptance disagrees with its uniform's region"
        final = weights[b] / weights[b].sum()
        for tok in range(vocab):
            if final[tok] > 0:
                emitted = tuple(drafts[:accepted]) + (tok,)
                for seq, cont in models.completed(emitted, K + 1, complete).items():
                    law[seq] = law.get(seq, 0.0) + prob * float(final[tok]) * cont
    return law


def _max_law_gap(law_a: dict, law_b: dict) -> float:
    keys = set(law_a) | set(law_b)
    return max(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
@pytest.mark.parametrize("vocab,num_drafts", [(3, 2), (4, 3)])
def test_enumerated_law_equals_target(vocab, num_drafts, params, mode):
    models = ToyModels(vocab, num_drafts, seed=vocab * 10 + num_drafts, params=params, mode=mode)
    target = models.target_law(num_drafts + 1)
    for n in range(num_drafts + 1):
        law = enumerate_round(models, n)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        assert _max_law_gap(law, target) < 1e-12, f"num_draft_tokens={n}"


_CORRECT_OUTCOME = ref_chain.chain_outcome


def _resample_from_p(p, q, drafts, valid, greedy, u):
    """Planted bug: after a rejection, sample p instead of the residual max(p - q, 0)."""
    num_accepted, _ = _CORRECT_OUTCOME(p, q, drafts, valid, greedy, u)
    batch, _, vocab = p.shape
    return num_accepted, p.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab))[:, 0]


@pytest.mark.parametrize("mode", MODES)
def test_enumeration_catches_planted_bug(mode):
    models = ToyModels(4, 3, seed=43, params=(1.0, 0, 1.0), mode=mode)
    gap = _max_law_gap(enumerate_round(models, 3, outcome=_resample_from_p),
                       models.target_law(4))
    assert gap > 1e-3, f"the planted bug changed the law by only {gap}"


# --- Sampled outputs: chi-square ---------------------------------------------------------

def _chi_square(counts: torch.Tensor, probs: torch.Tensor):
    """(p-value, power vs TV >= TV_MIN) of counts against probs; cells with p == 0 must be 0."""
    counts, probs = counts.double(), probs.double()
    total = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    expected = probs[support] * total
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0, 1.0
    critical = stats.chi2.isf(ALPHA, dof)
    power = float(stats.ncx2.sf(critical, dof, 4 * float(total) * TV_MIN ** 2))
    return float(stats.chi2.sf(statistic, dof)), power


def _context_free_round(mode: str, params, batch: int, vocab: int = 6, num_drafts: int = 3,
                        seed: int = 0, method: str = "token", backend: str = "reference"):
    """Sample one verify round for ``batch`` requests sharing context-free rows: target row j
    is fixed, drafts are drawn with ``sk.sample`` from their q with the verifier's seed (the
    streams are disjoint) and one offset per draft position, as a drafter's steps would.
    Returns ``(ChainVerifyOutput, p [K+1, V], q [K, V])``."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5
    draft = target[:num_drafts] + 0.6 * torch.randn(num_drafts, vocab, generator=gen)
    temperature, top_k, top_p = params
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    seeds = torch.arange(batch, dtype=torch.int64) + seed * 1_000_003
    offsets = torch.full((batch,), 7, dtype=torch.int64)
    draft_kw = {}
    if mode == "draft_probs":  # drafter samples its own softmax, whatever the target's filters
        q = torch.softmax(draft, -1)
        drafts = torch.stack([sk.sample(draft[j].expand(batch, vocab), seed=seeds, offset=offsets + j)
                              for j in range(num_drafts)], 1)
        draft_kw["draft_probs"] = q.expand(batch, num_drafts, vocab)
    elif mode == "draft_logits":
        q = sk.processed_probs(draft, **kw)
        drafts = torch.stack([sk.sample(draft[j].expand(batch, vocab), seed=seeds,
                                        offset=offsets + j, **kw) for j in range(num_drafts)], 1)
        draft_kw["draft_logits"] = draft.expand(batch, num_drafts, vocab)
    else:
        q = torch.zeros(num_drafts, vocab).scatter_(-1, draft.argmax(-1, keepdim=True), 1.0)
        drafts = draft.argmax(-1).expand(batch, num_drafts)
    out = sk.verify_chain(target.expand(batch, num_drafts + 1, vocab), drafts, seed=seeds,
                          offset=offsets, method=method, backend=backend, **draft_kw, **kw)
    p = sk.processed_probs(target, **kw)
    return out, p, q


SAMPLED_PARAMS = [(1.0, 0, 1.0), (0.8, 4, 0.9)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", SAMPLED_PARAMS, ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
def test_sampled_tokens_follow_target(mode, params):
    batch, vocab, num_drafts = 120_000, 6, 3
    out, p, q = _context_free_round(mode, params, batch, vocab, num_drafts)
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    for j in range(num_drafts + 1):
        reached = accepted >= j  # the first j drafts were accepted, so token j was emitted
        counts = torch.bincount(tokens[reached, j], minlength=vocab)
        pvalue, power = _chi_square(counts, p[j])
        print(f"{mode} {params} position {j}: N={int(reached.sum())} p-value={pvalue:.3g} "
              f"power(TV>={TV_MIN})={power:.4f}")
        assert pvalue > ALPHA, f"position {j}: emitted tokens do not follow the target"
        if j == 0:
            assert power >= 0.99
    # Acceptance of the first draft: P = sum(min(p, q)).
    rate = float((accepted >= 1).double().mean())
    expected = float(torch.minimum(p[0], q[0]).sum())
    sd = (expected * (1 - expected) / batch) ** 0.5
    assert abs(rate - expected) <= stats.norm.isf(ALPHA / 2) * sd + 1e-12, (rate, expected)


def test_chi_square_catches_planted_bug(monkeypatch):
    monkeypatch.setattr(ref_chain, "chain_outcome", _resample_from_p)
    out, p, _ = _context_free_round("draft_probs", (1.0, 0, 1.0), 120_000)
    counts = torch.bincount(out.output_token_ids[:, 0].long(), minlength=p.shape[-1])
    pvalue, power = _chi_square(counts, p[0])
    assert power >= 0.99
    assert pvalue < ALPHA, "the chi-square test missed resampling from p"


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.2, 0, 0.7), (1.0, 2, 0.5)],
                         ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
def test_sample_follows_processed_probs(params):
    batch, vocab = 60_000, 7
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 2
    temperature, top_k, top_p = params
    tokens = sk.sample(logits.expand(batch, vocab), temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=torch.arange(batch), offset=3)
    p = sk.processed_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    pvalue, power = _chi_square(torch.bincount(tokens.long(), minlength=vocab), p)
    assert power >= 0.99 and pvalue > ALPHA


def _two_level_draws(monkeypatch, weights: torch.Tensor, draws: int) -> torch.Tensor:
    """``draws`` samples of ``weights`` by the reference race with groups of 4 tokens, one seed
    per draw."""
    monkeypatch.setattr(_rng, "RACE_GROUP", 4)
    seeds = torch.arange(draws, dtype=torch.int64)
    tokens = ref_sampling.race(weights.expand(draws, -1), seeds, torch.full_like(seeds, 11), 2,
                               _rng.PURPOSE_RESAMPLE)
    return torch.bincount(tokens.long(), minlength=weights.shape[-1])


# Groups of 4 over V = 10: {0..3} (one zero weight), {4..7} (all zero), {8, 9} (partial).
TWO_LEVEL_WEIGHTS = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.25])


def test_two_level_race_is_exact(monkeypatch):
    """The race draws a group by its mass, then a token of it by its weight: the token law is
    ``weights / sum(weights)`` (chi-square at false-alarm rate ALPHA; power printed and
    required against TV >= TV_MIN), zero weights and empty groups are never drawn."""
    counts = _two_level_draws(monkeypatch, TWO_LEVEL_WEIGHTS, 60_000)
    pvalue, power = _chi_square(counts, TWO_LEVEL_WEIGHTS / TWO_LEVEL_WEIGHTS.sum())
    print(f"two-level race: p-value={pvalue:.3g} power(TV>={TV_MIN})={power:.4f}")
    assert power >= 0.99 and pvalue > ALPHA
    assert int(counts[TWO_LEVEL_WEIGHTS == 0].sum()) == 0


def test_two_level_race_catches_planted_bug(monkeypatch):
    """The same test fails when the first level ignores the groups' masses (a group drawn
    uniformly among those with any weight)."""
    monkeypatch.setattr(ref_sampling, "_group_masses", lambda groups: (groups > 0).any(-1).double())
    counts = _two_level_draws(monkeypatch, TWO_LEVEL_WEIGHTS, 60_000)
    pvalue, power = _chi_square(counts, TWO_LEVEL_WEIGHTS / TWO_LEVEL_WEIGHTS.sum())
    assert power >= 0.99
    assert pvalue < ALPHA, "the chi-square test missed a group race that ignores the masses"
