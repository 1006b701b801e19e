"""Exactness of block verification (chains) and traversal verification (trees), contract 12,
on the reference path.

1. Exact float64 enumeration. Block: for tiny V and K (context-dependent rows of
   ``test_chain_exactness.ToyModels``), every draft sequence and every pass/fail pattern of
   the K acceptance tests is run through ``reference.chain.block_outcome`` (the code the
   sampler runs), which reports the measure of the uniforms passing each test; a probe at
   either side of each reported threshold checks that the decision switches exactly there.
   Traversal: the trees of ``test_tree_reference`` through ``reference.tree.traverse_tree``,
   one decision vector per post-order outcome. The emitted tokens, completed by the target to
   the window, equal the autoregressive law to 1e-12. The expected accepted length equals its
   closed form (block: ``sum_i E[w_i]``) and is at least the token rule's.
2. Planted bugs (the pitfalls seen in public implementations) break the enumerated law by
   > 1e-3: a token-level residual, ``h_j = w_j``, stopping at the first failed test, the
   correction drawn from the original row; for traversal the analogues (no ``w`` in the
   residual, ``w`` not updated after a rejection, the final token from the node's original
   row) and a draft update that does not match the drafting (wor drafts verified as iid,
   iid drafts as wor).
3. Chi-square of sampled outputs through the public API (alpha and power stated where the
   test is), and the sample mean of ``num_accepted`` against its exact expectation.
4. Equalities: ``n <= 1`` and greedy requests give the token rule's tokens; one-hot drafts
   have the token rule's law (enumerated); a chain-shaped tree under ``"traversal"`` gives
   ``verify_chain(method="block")``'s tokens; bad ``method`` arguments raise.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

import specdec_kernels as sk
from specdec_kernels.reference import chain as ref_chain
from specdec_kernels.reference import tree as ref_tree
from test_chain_exactness import (ALPHA, MODES, U_REJECT, ToyModels, _chi_square,
                                  _context_free_round, _max_law_gap, enumerate_round)
from test_tree_reference import (PARENTS, ToyTree, _random_chain, enumerate_law, sample_round,
                                 target_law)

SAMPLED_PARAMS = [(1.0, 0, 1.0), (0.7, 2, 1.0), (1.3, 0, 0.8), (0.9, 3, 0.75)]  # no greedy
PROBE = 1e-9  # relative step of the threshold probes


# --- Block: exact enumeration ---------------------------------------------------------------

def enumerate_block(models: ToyModels, num_draft_tokens: int, outcome=None,
                    complete: bool = True) -> tuple[dict, float]:
    """Exact law of one block-verification round (completed by the target to K+1 tokens, or
    the emitted tokens themselves) and its expected ``num_accepted``."""
    outcome = outcome or ref_chain.block_outcome
    vocab, K, n = models.vocab, models.num_drafts, num_draft_tokens
    sequences = []
    for drafts in itertools.product(range(vocab), repeat=n):
        prob = 1.0
        for j in range(n):
            prob *= float(models.draft(drafts[:j])[drafts[j]])
        if prob > 0:
            sequences.append((drafts, prob))
    patterns = torch.tensor(list(itertools.product([True, False], repeat=n)),
                            dtype=torch.bool).reshape(2 ** n, n)
    batch = len(sequences) * len(patterns)
    drafts_t = torch.zeros(batch, K, dtype=torch.int64)
    p = torch.zeros(batch, K + 1, vocab, dtype=torch.float64)
    q = torch.zeros(batch, K, vocab, dtype=torch.float64)
    draft_prob = torch.zeros(batch, dtype=torch.float64)
    for s, (drafts, prob) in enumerate(sequences):
        rows = slice(s * len(patterns), (s + 1) * len(patterns))
        full = list(drafts) + [0] * (K - n)
        drafts_t[rows] = torch.tensor(full, dtype=torch.int64)
        p[rows] = torch.stack([models.target(full[:j]) for j in range(K + 1)])
        q[rows] = torch.stack([models.draft(full[:j]) for j in range(K)])
        draft_prob[rows] = prob
    bits = patterns.repeat(len(sequences), 1)
    bits = torch.cat([bits, torch.ones(batch, K - n, dtype=torch.bool)], 1)
    valid = (torch.arange(K) < n).expand(batch, K)
    q_arg = None if models.mode == "one_hot" else q
    greedy = torch.zeros(batch, dtype=torch.bool)

    def run(u):
        return outcome(p, q_arg, drafts_t, valid, greedy, u)

    out = run(torch.where(bits, 0.0, U_REJECT).to(torch.float64))
    a = out.accept_probability[:, :n]
    # The reported measures are the decisions' thresholds: just below passes, just above fails.
    inner = (a > 1e-6) & (a < 1 - 1e-6)
    below = run(torch.cat([a * (1 - PROBE), torch.zeros(batch, K - n, dtype=torch.float64)], 1))
    above = run(torch.cat([a * (1 + PROBE), torch.zeros(batch, K - n, dtype=torch.float64)], 1))
    assert bool(below.passed[:, :n][inner].all()) and not bool(above.passed[:, :n][inner].any())
    factor = torch.where(bits[:, :n], a, 1.0 - a).prod(1)
    weight = draft_prob * factor
    assert float(weight[(out.passed[:, :n] != bits[:, :n]).any(1)].sum()) < 1e-12, \
        "decisions disagree with their uniforms' regions"
    law, mean = {}, 0.0
    for b in range(batch):
        if weight[b] <= 0:
            continue
        accepted = int(out.num_accepted[b])
        mean += float(weight[b]) * accepted
        final = out.final_weights[b] / out.final_weights[b].sum()
        prefix = tuple(int(t) for t in drafts_t[b, :accepted])
        for tok in range(vocab):
            if final[tok] > 0:
                for seq, cont in models.completed(prefix + (tok,), K + 1, complete).items():
                    law[seq] = law.get(seq, 0.0) + float(weight[b] * final[tok]) * cont
    return law, mean


def expected_accepted(target, draft, vocab: int, num_drafts: int) -> dict:
    """Closed forms of E[num_accepted] for conditional laws ``target(prefix)``,
    ``draft(prefix)`` (rows over ``vocab``): block ``sum_i sum_{x^i} min_{0<=j<=i}
    Q(x^j) P(x_{j+1..i} | x^j)`` (= ``sum_i E[w_i]``), token ``sum_i sum_{x^i} prod_t
    min(p, q)``, and the full-information bound ``sum_i sum_{x^i} min(Q(x^i), P(x^i))``."""
    block = token = bound = 0.0
    for i in range(1, num_drafts + 1):
        for seq in itertools.product(range(vocab), repeat=i):
            p = [float(target(seq[:t])[seq[t]]) for t in range(i)]
            q = [float(draft(seq[:t])[seq[t]]) for t in range(i)]
            splits = []
            for j in range(i + 1):
                value = 1.0
                for t in range(j):
                    value *= q[t]
                for t in range(j, i):
                    value *= p[t]
                splits.append(value)
            block += min(splits)
            run = 1.0
            for t in range(i):
                run *= min(p[t], q[t])
            token += run
            bound += min(splits[0], splits[-1])
    return {"block": block, "token": token, "bound": bound}


BLOCK_PARAMS = [(1.0, 0, 1.0), (0.7, 2, 1.0), (1.3, 0, 0.8), (0.9, 3, 0.75)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", BLOCK_PARAMS, ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
@pytest.mark.parametrize("vocab,num_drafts", [(3, 2), (4, 3)])
def test_block_enumerated_law_equals_target(vocab, num_drafts, params, mode):
    models = ToyModels(vocab, num_drafts, seed=vocab * 10 + num_drafts, params=params, mode=mode)
    target = models.target_law(num_drafts + 1)
    for n in range(num_drafts + 1):
        law, mean = enumerate_block(models, n)
        assert abs(sum(law.values()) - 1.0) < 1e-12
        assert _max_law_gap(law, target) < 1e-12, f"num_draft_tokens={n}"
        closed = expected_accepted(models.target, models.draft, vocab, n)
        assert abs(mean - closed["block"]) < 1e-12, (n, mean, closed)
        assert closed["token"] - 1e-12 <= closed["block"] <= closed["bound"] + 1e-12, closed


def test_block_gain_on_the_papers_example():
    """Sun et al.'s example: context-free target (1/3, 2/3), draft (2/3, 1/3), K = 2:
    E[num_accepted] is 10/9 (token), 11/9 (block), 12/9 (the full-information bound)."""
    p, q = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3],
                                                                           dtype=torch.float64)
    closed = expected_accepted(lambda _: p, lambda _: q, 2, 2)
    assert closed == pytest.approx({"token": 10 / 9, "block": 11 / 9, "bound": 12 / 9}, abs=1e-12)


@pytest.mark.parametrize("vocab,num_drafts", [(3, 2), (4, 3)])
def test_block_one_hot_drafts_have_the_token_law(vocab, num_drafts):
    """One-hot drafts: block's emitted tokens (not completed) have the token rule's law."""
    for params in BLOCK_PARAMS[:2]:
        models = ToyModels(vocab, num_drafts, seed=7, params=params, mode="one_hot")
        for n in range(num_drafts + 1):
            block, _ = enumerate_block(models, n, complete=False)
            token = enumerate_round(models, n, complete=False)
            assert _max_law_gap(block, token) < 1e-12


_BLOCK_OUTCOME = ref_chain.block_outcome


def _token_level_correction(weight, p, q):
    """Planted bug: the correction from max(p - q, 0) (w_tau ignored)."""
    return _CORRECTION(torch.ones_like(weight), p, q)


def _original_row_correction(weight, p, q):
    """Planted bug: the correction from the target row itself, not the residual."""
    return p


def _first_failure(passed):
    """Planted bug: tau = the tests passed before the first failure."""
    return passed.to(torch.int64).cumprod(-1).sum(-1)


_CORRECTION = ref_chain.correction_weights
BLOCK_BUGS = {
    "token-level-residual": ("correction_weights", _token_level_correction),
    "h-equals-w": ("rejection_weight", lambda mass, weight: weight),
    "stop-at-first-failure": ("last_success", _first_failure),
    "correction-from-original-row": ("correction_weights", _original_row_correction),
}


@pytest.mark.parametrize("bug", list(BLOCK_BUGS))
def test_block_enumeration_catches_planted_bug(monkeypatch, bug):
    monkeypatch.setattr(ref_chain, *BLOCK_BUGS[bug])
    models = ToyModels(4, 3, seed=43, params=(1.0, 0, 1.0), mode="draft_probs")
    law, _ = enumerate_block(models, 3)
    gap = _max_law_gap(law, models.target_law(4))
    assert gap > 1e-3, f"the planted bug changed the law by only {gap}"


# --- Block: sampled outputs ---------------------------------------------------------------

def _context_free_expectation(p: torch.Tensor, q: torch.Tensor) -> dict:
    num_drafts, vocab = q.shape
    return expected_accepted(lambda prefix: p[len(prefix)].double(),
                             lambda prefix: q[len(prefix)].double(), vocab, num_drafts)


@pytest.mark.parametrize("mode,params", [("draft_probs", (1.0, 0, 1.0)),
                                         ("draft_logits", (0.8, 4, 0.9))])
def test_block_sampled_tokens_follow_target(mode, params):
    """Token j given drafts 1..j accepted follows target row j (context-free rows; the
    invariant P(tau >= j, next token y | X^j) = w_j p_{j+1}(y) makes this exact for block too):
    chi-square at alpha = ALPHA per test, power >= 0.99 against any law at TV >= 0.02 asserted
    for the first token. The mean accepted length matches sum_i E[w_i] (normal test at ALPHA)
    and exceeds the token rule's exact expectation."""
    batch, vocab, num_drafts = 40_000, 6, 3
    out, p, q = _context_free_round(mode, params, batch, vocab, num_drafts, method="block")
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    for j in range(num_drafts + 1):
        reached = accepted >= j
        pvalue, power = _chi_square(torch.bincount(tokens[reached, j], minlength=vocab), p[j])
        print(f"block {mode} position {j}: N={int(reached.sum())} p-value={pvalue:.3g} "
              f"power(TV>=0.02)={power:.4f}")
        assert pvalue > ALPHA, f"position {j}: emitted tokens do not follow the target"
        if j == 0:
            assert power >= 0.99
    closed = _context_free_expectation(p, q)
    mean = float(accepted.double().mean())
    sd = float(accepted.double().std()) / batch ** 0.5
    print(f"block {mode}: mean accepted {mean:.4f} (sd {sd:.4f}), exact {closed['block']:.4f}, "
          f"token {closed['token']:.4f}")
    assert abs(mean - closed["block"]) <= stats.norm.isf(ALPHA / 2) * sd
    assert closed["block"] > closed["token"] + 10 * sd  # the gain is visible at this size


def test_block_chi_square_catches_planted_bug(monkeypatch):
    """h_j = w_j (the "cumulative ratio" shortcut): the token after one accepted draft no
    longer follows the target (chi-square p-value < ALPHA; power printed)."""
    monkeypatch.setattr(ref_chain, *BLOCK_BUGS["h-equals-w"])
    batch, vocab, num_drafts = 40_000, 6, 3
    out, p, _ = _context_free_round("draft_probs", (1.0, 0, 1.0), batch, vocab, num_drafts,
                                    method="block")
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    pvalues = []
    for j in range(1, num_drafts + 1):
        reached = accepted >= j
        pvalues.append(_chi_square(torch.bincount(tokens[reached, j], minlength=vocab), p[j])[0])
    print(f"h = w: p-values {pvalues}")
    assert min(pvalues) < ALPHA, "the chi-square tests missed h_j = w_j"


def _mixed_chain(batch, num_drafts, vocab, seed):
    logits, drafts, q, n = _random_chain(batch, num_drafts, vocab, seed)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3]).repeat(batch // 4)
    top_k = torch.tensor([0, 0, 5, 3, 0, 8, 0, 0]).repeat(batch // 8)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.6, 0.8]).repeat(batch // 5 + 1)[:batch]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=torch.arange(batch) * 7,
              offset=torch.arange(batch) % 3)
    return logits, drafts, q, n, kw


@pytest.mark.parametrize("draft", ["draft_probs", "draft_logits", "one_hot"])
def test_block_equals_token_for_greedy_and_short_chains(draft):
    batch, num_drafts, vocab = 256, 5, 12
    logits, drafts, q, n, kw = _mixed_chain(batch, num_drafts, vocab, seed=5)
    n = torch.where(torch.arange(batch) % 3 == 0, n, n.clamp(max=1))
    draft_kw = {"draft_probs": {"draft_probs": q}, "one_hot": {},
                "draft_logits": {"draft_logits": q.log() + 0.3}}[draft]
    token = sk.verify_chain(logits, drafts, num_draft_tokens=n, backend="reference", **draft_kw,
                            **kw)
    block = sk.verify_chain(logits, drafts, num_draft_tokens=n, method="block",
                            backend="reference", **draft_kw, **kw)
    same = (n <= 1) | (kw["temperature"] == 0)
    assert torch.equal(token.output_token_ids[same], block.output_token_ids[same])
    assert torch.equal(token.num_accepted[same], block.num_accepted[same])
    assert int(token.num_accepted[same].sum()) > 0 and bool((~same).any())


# --- Traversal: exact enumeration ---------------------------------------------------------

def _post_order(parents) -> list:
    children = [[c for c in range(1, len(parents)) if parents[c] == u] for u in range(len(parents))]
    order = []

    def visit(u):
        for c in children[u]:
            visit(c)
        order.append(u)
    visit(0)
    return order[:-1]  # the root is never tested


def traversal_decision_vectors(parents) -> list:
    """One decision vector per traversal outcome: the nodes before the accepted one in
    post-order rejected, the rest (untested) fixed to 1; and every node rejected."""
    order = _post_order(parents)
    vectors = []
    for k in range(len(order) + 1):
        bits = [1] * (len(parents) - 1)
        for v in order[:k]:
            bits[v - 1] = 0
        vectors.append(tuple(bits))
    return vectors


def enumerate_traversal(toy: ToyTree, draft_sampling=None):
    return enumerate_law(toy, draft_sampling, walk_tree=ref_tree.traverse_tree,
                         decision_vectors=traversal_decision_vectors)


TREE_MODES = ["iid", "without_replacement"]
TREE_PARAMS = [(1.0, 0, 1.0), (0.8, 2, 1.0), (1.2, 0, 0.8)]


@pytest.mark.parametrize("mode", TREE_MODES)
@pytest.mark.parametrize("params,seed", [(TREE_PARAMS[0], 1), (TREE_PARAMS[0], 2),
                                         (TREE_PARAMS[1], 2), (TREE_PARAMS[2], 2)],
                         ids=lambda x: f"T{x[0]}-k{x[1]}-p{x[2]}" if isinstance(x, tuple) else
                         f"seed{x}")
def test_traversal_enumerated_law_equals_target(mode, params, seed):
    toy = ToyTree(4, seed, params, mode)
    law = enumerate_traversal(toy)
    assert abs(float(law.extended.sum()) - 1.0) < 1e-12
    gap = float((law.extended - target_law(toy)).abs().max())
    assert gap < 1e-12, f"law differs from the target by {gap}"
    token = enumerate_law(toy)
    print(f"{mode} {params} seed {seed}: E[accepted] traversal {law.mean_accepted:.5f}, "
          f"token {token.mean_accepted:.5f}")
    assert law.mean_accepted >= token.mean_accepted - 1e-12


def test_traversal_on_a_chain_has_the_block_law():
    """A chain-shaped tree (depth 2) under traversal: E[accepted] is block's closed form."""
    toy = ToyTree(4, 3, (1.0, 0, 1.0), "iid", parents=(-1, 0, 1))
    law = enumerate_traversal(toy)
    assert float((law.extended - target_law(toy)).abs().max()) < 1e-12

    def row(table, prefix):
        index = toy.prefix_index(torch.tensor(prefix, dtype=torch.int64)[None])[0]
        return table[index]
    closed = expected_accepted(lambda pre: row(toy.p, pre), lambda pre: row(toy.q, pre), 4, 2)
    assert abs(law.mean_accepted - closed["block"]) < 1e-12


_TRAVERSAL_FINAL = ref_tree.traversal_final_weights
_WEIGHTED_RESIDUAL = ref_chain.weighted_residual
TRAVERSAL_BUGS = {  # name: (mode, patched attribute of reference.tree or None, draft_sampling)
    "token-level-residual": ("iid", ("weighted_residual",
                                     lambda w, p, q: _WEIGHTED_RESIDUAL(torch.ones_like(w), p, q)),
                             None),
    "w-not-updated": ("iid", ("rejection_weight", lambda mass, weight: weight), None),
    "final-from-original-row": ("iid", ("traversal_final_weights", lambda p_raw, p: p), None),
    "wor-verified-as-iid": ("without_replacement", None, "iid"),
    "iid-verified-as-wor": ("iid", None, "without_replacement"),
}


@pytest.mark.parametrize("bug", list(TRAVERSAL_BUGS))
def test_traversal_enumeration_catches_planted_bug(monkeypatch, bug):
    mode, patch, sampling = TRAVERSAL_BUGS[bug]
    if patch is not None:
        monkeypatch.setattr(ref_tree, *patch)
    toy = ToyTree(4, 2, (1.0, 0, 1.0), mode)
    gap = float((enumerate_traversal(toy, sampling).extended - target_law(toy)).abs().max())
    assert gap > 1e-3, f"the planted bug changed the law by only {gap}"


# --- Traversal: sampled outputs and equalities --------------------------------------------

TRAVERSAL_ALPHA = 1e-3 / 4  # family-wise 1e-3 over the 4 sampled tests below


@pytest.mark.parametrize("mode", TREE_MODES)
def test_traversal_sampled_tokens_follow_target(monkeypatch, mode):
    """First token and the token after an accepted first node: chi-square at TRAVERSAL_ALPHA
    each, power against the 'final-from-original-row' bug computed from its enumerated law
    (>= 0.99 asserted for one of the two); the mean accepted length matches the enumerated
    expectation (normal test at TRAVERSAL_ALPHA)."""
    from test_tree_reference import _chi_square as tree_chi_square, _conditional, _sampled_counts
    toy = ToyTree(4, 2, (1.0, 0, 1.0), mode)
    T0, T1, _ = toy.tables()
    exact = enumerate_traversal(toy)
    with monkeypatch.context() as patched:
        patched.setattr(ref_tree, *TRAVERSAL_BUGS["final-from-original-row"][1])
        bug = enumerate_traversal(toy)
    batch = 20_000
    out = sample_round(toy, batch, seed=0, method="traversal")
    first, second = _sampled_counts(out, toy.vocab)
    import test_tree_reference
    monkeypatch.setattr(test_tree_reference, "ALPHA_TEST", TRAVERSAL_ALPHA)
    p_first, power_first = tree_chi_square(first, T0[None], bug.first[None])
    p_second, power_second = tree_chi_square(second, T1, _conditional(bug.second))
    accepted = out.num_accepted.double()
    sd = float(accepted.std()) / batch ** 0.5
    print(f"traversal {mode}: p={p_first:.3g}/{p_second:.3g}, power {power_first:.4f}/"
          f"{power_second:.4f}; mean accepted {float(accepted.mean()):.4f} exact "
          f"{exact.mean_accepted:.4f} (sd {sd:.4f})")
    assert p_first > TRAVERSAL_ALPHA and p_second > TRAVERSAL_ALPHA
    assert max(power_first, power_second) >= 0.99
    assert abs(float(accepted.mean()) - exact.mean_accepted) <= \
        stats.norm.isf(TRAVERSAL_ALPHA / 2) * sd


@pytest.mark.parametrize("mode", TREE_MODES)
def test_chain_shaped_tree_under_traversal_equals_block(mode):
    batch, num_drafts, vocab = 256, 5, 12
    logits, drafts, q, n, kw = _mixed_chain(batch, num_drafts, vocab, seed=3)
    chain = sk.verify_chain(logits, drafts, num_draft_tokens=n, draft_probs=q, method="block",
                            backend="reference", **kw)
    tree_tokens = torch.cat([torch.full((batch, 1), -1), drafts], 1)
    parents = torch.arange(-1, num_drafts).expand(batch, -1)
    tree_q = torch.cat([q, torch.full((batch, 1, vocab), 1.0 / vocab)], 1)
    tree = sk.verify_tree(logits, tree_tokens, parents, num_nodes=n + 1, draft_probs=tree_q,
                          draft_sampling=mode, method="traversal", backend="reference", **kw)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    expected_path = torch.where(torch.arange(num_drafts + 1) <= chain.num_accepted[:, None],
                                torch.arange(num_drafts + 1), -1).to(torch.int32)
    assert torch.equal(tree.accepted_nodes, expected_path)
    token = sk.verify_chain(logits, drafts, num_draft_tokens=n, draft_probs=q,
                            backend="reference", **kw)
    assert not torch.equal(token.output_token_ids, chain.output_token_ids)  # block differs


def test_traversal_greedy_equals_token():
    batch, nodes, vocab = 64, 9, 10
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6]).expand(batch, nodes)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, nodes)
    tokens[:, 1:3] = logits[:, 0].argmax(-1, keepdim=True)
    kw = dict(draft_probs=q, temperature=0.0, seed=torch.arange(batch), backend="reference")
    token = sk.verify_tree(logits, tokens, parents, **kw)
    traversal = sk.verify_tree(logits, tokens, parents, method="traversal", **kw)
    for a, b in zip(token[:3], traversal[:3]):  # tokens, path, num_accepted (logprobs None)
        assert torch.equal(a, b)
    assert int(token.num_accepted.sum()) > 0


def test_method_errors():
    logits = torch.zeros(2, 3, 5)
    tokens, parents = torch.tensor([[-1, 1, 2]] * 2), torch.tensor([[-1, 0, 0]] * 2)
    with pytest.raises(ValueError, match="method"):
        sk.verify_tree(logits, tokens, parents, method="traversal")  # no draft_probs
    with pytest.raises(ValueError, match="method"):
        sk.verify_tree(logits, tokens, parents, method="block")
    with pytest.raises(ValueError, match="method"):
        sk.verify_chain(logits, tokens[:, :2], method="traversal")
    with pytest.raises(ValueError, match="method"):
        sk.verify_chain(logits, tokens[:, :2], method=None)


def test_traversal_padding_and_invalid_nodes_are_ignored():
    """Padding and (validate=False) invalid nodes cut off their subtrees; the answer equals the
    same tree without them."""
    batch, nodes, vocab = 32, 7, 8
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    parents = torch.tensor([-1, 0, 1, 0, 3, 3, 0]).expand(batch, nodes)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, nodes)
    bad = tokens.clone()
    bad[:, 3] = vocab + 4  # node 3 invalid: its children 4 and 5 are cut off with it
    kw = dict(draft_probs=q, seed=torch.arange(batch), offset=2, method="traversal",
              backend="reference")
    cut = sk.verify_tree(logits, bad, parents, validate=False, **kw)
    keep = torch.tensor([0, 1, 2, 6])
    pruned = sk.verify_tree(logits[:, keep], tokens[:, keep],
                            torch.tensor([-1, 0, 1, 0]).expand(batch, 4),
                            draft_probs=q[:, keep], seed=torch.arange(batch), offset=2,
                            method="traversal", backend="reference")
    # Node indices differ (6 -> 3), and so do the Philox positions of node 6: compare the
    # requests whose walk never reached node 6's test, i.e. accepted inside 1..2.
    inside = (pruned.accepted_nodes[:, 1] == 1)
    assert bool(inside.any())
    assert torch.equal(cut.output_token_ids[inside, :3], pruned.output_token_ids[inside, :3])
    assert not bool((cut.accepted_nodes >= 3).logical_and(cut.accepted_nodes <= 5).any())


def test_packed_layout_gets_block_verification():
    """verify_chain_packed(method="block") forwards to the chain's internal entry point: the
    padded call's tokens."""
    gen = torch.Generator().manual_seed(0)
    batch, num_drafts, vocab = 6, 4, 11
    n = torch.tensor([4, 0, 2, 3, 1, 4])
    logits = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2
    q = torch.softmax(logits[:, :num_drafts] + torch.randn(batch, num_drafts, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    rows = torch.cat([torch.arange(int(n[b]) + 1) + b * (num_drafts + 1) for b in range(batch)])
    draft_rows = torch.cat([torch.arange(int(n[b])) + b * num_drafts for b in range(batch)])
    kw = dict(seed=torch.arange(batch) + 3, offset=2, method="block", backend="reference")
    padded = sk.verify_chain(logits, drafts, draft_probs=q, num_draft_tokens=n, **kw)
    packed = sk.verify_chain_packed(logits.reshape(-1, vocab)[rows], drafts.reshape(-1)[draft_rows],
                                    cu, max_draft_tokens=num_drafts,
                                    draft_probs=q.reshape(-1, vocab)[draft_rows], **kw)
    assert torch.equal(padded.output_token_ids, packed.output_token_ids)
    assert torch.equal(padded.num_accepted, packed.num_accepted)
