"""Exactness and edge cases of tree verification on the reference path.

1. Exact float64 enumeration (tiny trees: V <= 5, up to 3 children, depth 2). Every draft of
   the tree (children drawn from q per mode: i.i.d., without replacement, or the top-c
   candidates), and every acceptance region of the uniforms, is run through
   ``reference.tree.walk_tree`` (the code the sampler runs), which reports the measure of the
   uniforms that accept each tested node; the final token's law is its final weights. The
   emitted tokens, completed to depth + 1 tokens by sampling the target, must have exactly the
   target's autoregressive law. (The uniforms are treated as continuous; the implementation's
   are float32 roundings of multiples of 2**-32, a bias of at most the float32 rounding of the
   ratio plus 2**-32 per decision.) Planted bugs -- no residual
   update in each mode, raw q for without-replacement drafts -- break the law by > 1e-3.
2. Chi-square tests of sampled outputs through the public API, per mode: the first token, and
   the token after an accepted node (the second token given the first node was accepted).
   False-alarm rate: alpha = 1e-3 for the family of FAMILY_SIZE sampled tests (Bonferroni:
   ALPHA_TEST per test). Power against the planted bugs is computed exactly from the
   enumerated law of the bug (non-central chi-square) and asserted >= 0.99; the bugged
   sampler is run and must be rejected.
3. Chain-shaped trees equal ``verify_chain`` token for token in every mode; duplicate
   siblings; a node whose every child has p = 0; padding nodes; invalid trees.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from scipy import stats

import specdec_kernels as sk
from specdec_kernels.reference import sampling as ref_sampling
from specdec_kernels.reference import tree as ref_tree

U_REJECT = 1.0 - 2.0 ** -24  # the largest uniform: rejects whenever rejection has mass

# Depth 2, interleaved indices: root children 1, 3, 5; node 1 has children 2, 4; node 3 has 6.
PARENTS = (-1, 0, 1, 0, 1, 0, 3)
DEPTH = 2
MODES = ["deterministic", "iid", "without_replacement"]
PARAMS = [(1.0, 0, 1.0), (0.8, 2, 1.0), (1.2, 0, 0.8), (0.0, 0, 1.0)]  # (T, top_k, top_p)


def _probs(logits: torch.Tensor, params) -> torch.Tensor:
    t, k, p = params
    rows = logits.reshape(-1, logits.shape[-1])
    b = rows.shape[0]
    out = ref_sampling.processed_probs(rows, torch.full((b,), float(t), dtype=torch.float64),
                                       torch.full((b,), k), torch.full((b,), float(p),
                                                                       dtype=torch.float64))
    return out.reshape(logits.shape)


def _tree_paths(parents):
    """For each node, the list of non-root nodes from the root's child down to it."""
    paths = [[]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [i])
    return paths


class ToyTree:
    """Target and draft distributions for every prefix of length 0..DEPTH over V tokens."""

    def __init__(self, vocab: int, seed: int, params, mode: str, parents=PARENTS):
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.params, self.mode, self.parents = vocab, params, mode, parents
        self.paths = _tree_paths(parents)
        self.children = [[c for c in range(1, len(parents)) if parents[c] == u]
                         for u in range(len(parents))]
        rows = sum(vocab ** n for n in range(DEPTH + 1))
        target = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 1.5
        draft = target + torch.randn(target.shape, generator=gen, dtype=torch.float64)
        self.p = _probs(target, params)  # [prefix, V]
        # The drafter's own distribution (some prefixes with zeros: top-3 of its softmax).
        self.q = _probs(draft, (1.0, 3 if seed % 2 else 0, 1.0))

    def prefix_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row of the prefix ``tokens`` ``[..., L]`` in the tables (shorter prefixes first)."""
        length = tokens.shape[-1]
        index = torch.zeros(tokens.shape[:-1], dtype=torch.int64)
        for j in range(length):
            index = index * self.vocab + tokens[..., j]
        return index + sum(self.vocab ** n for n in range(length))

    def tables(self):
        """T[d]: ``[V] * (d + 1)`` conditional target probabilities after d tokens."""
        out, start = [], 0
        for n in range(DEPTH + 1):
            count = self.vocab ** n
            out.append(self.p[start:start + count].reshape((self.vocab,) * (n + 1)))
            start += count
        return out

    def drafts(self):
        """All draft trees with their probability: (tokens [T, N] int64, prob [T] float64)."""
        nodes, vocab = len(self.parents), self.vocab
        if self.mode == "deterministic":  # top-c candidates of the drafter, in order
            tokens = torch.zeros(1, nodes, dtype=torch.int64)
            for u in range(nodes):
                kids = self.children[u]
                if kids:
                    q = self.q[self.prefix_index(tokens[:, self.paths[u]])][0]
                    order = sorted(range(vocab), key=lambda t: (-float(q[t]), t))
                    tokens[0, kids] = torch.tensor(order[:len(kids)])
            return tokens, torch.ones(1, dtype=torch.float64)
        tokens = torch.tensor(list(itertools.product(range(vocab), repeat=nodes - 1)))
        tokens = torch.cat([torch.zeros(len(tokens), 1, dtype=torch.int64), tokens], 1)
        prob = torch.ones(len(tokens), dtype=torch.float64)
        for u in range(nodes):
            kids = self.children[u]
            if not kids:
                continue
            q = self.q[self.prefix_index(tokens[:, self.paths[u]])]  # [T, V]
            left = torch.ones(len(tokens), dtype=torch.float64)
            for c in kids:
                qx = q.gather(1, tokens[:, c:c + 1])[:, 0]
                if self.mode == "iid":
                    prob = prob * qx
                else:  # without replacement: the remaining mass renormalises
                    prob = prob * torch.where(left > 0, qx / left, 0.0)
                    left = left - qx
                    q = q.scatter(1, tokens[:, c:c + 1], 0.0)
        keep = prob > 0
        return tokens[keep], prob[keep]

    def node_rows(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``[T, N, V]``: row i is ``table`` at node i's path prefix."""
        return torch.stack([table[self.prefix_index(tokens[:, self.paths[i]])]
                            for i in range(len(self.parents))], 1)


def _decision_vectors(parents):
    """Accept (1) / reject (0) decisions for nodes 1..N-1, one vector per walk outcome: the
    nodes a walk does not test are fixed to 1, so each outcome appears once."""
    vectors = []
    for bits in itertools.product([1, 0], repeat=len(parents) - 1):
        current, canonical = 0, True
        for i, bit in enumerate(bits, start=1):
            if parents[i] == current:
                current = i if bit else current
            elif not bit:
                canonical = False
        if canonical:
            vectors.append(bits)
    return vectors


class TreeLaw(NamedTuple):
    extended: torch.Tensor  # [V]*3: emitted tokens completed by the target to DEPTH + 1
    first: torch.Tensor     # [V]: the first emitted token
    second: torch.Tensor    # [V, V]: P(first node accepted, first token x, second token y)
    mean_accepted: float    # E[num_accepted]


def enumerate_law(toy: ToyTree, draft_sampling=None, walk_tree=ref_tree.walk_tree,
                  decision_vectors=_decision_vectors) -> TreeLaw:
    """Exact laws of one verify round through ``walk_tree`` (the token walk, or the traversal
    walk with its own ``decision_vectors``: one accept/reject vector per walk outcome)."""
    vocab, nodes = toy.vocab, len(toy.parents)
    tokens, draft_prob = toy.drafts()
    bits = torch.tensor(decision_vectors(toy.parents), dtype=torch.bool)
    trees, decisions = len(tokens), len(bits)
    tokens = tokens.repeat_interleave(decisions, 0)
    draft_prob = draft_prob.repeat_interleave(decisions, 0)
    bits = torch.cat([torch.ones(len(bits), 1, dtype=torch.bool), bits], 1).repeat(trees, 1)
    batch = len(tokens)
    p = toy.node_rows(tokens, toy.p)
    q = None if toy.mode == "deterministic" else toy.node_rows(tokens, toy.q)
    greedy = torch.full((batch,), toy.params[0] == 0)
    u = torch.where(bits, 0.0, U_REJECT).to(torch.float64)
    parents = torch.tensor(toy.parents).expand(batch, nodes)
    walk = walk_tree(p, q, tokens, parents, torch.full((batch,), nodes),
                     draft_sampling or toy.mode, greedy, u)

    accepted = torch.zeros(batch, nodes, dtype=torch.bool)
    path = walk.accepted_nodes
    accepted.scatter_(1, path.clamp(min=0), path >= 0)
    a = walk.accept_probability
    # Each tested node contributes its decision's measure; untested nodes count once (bit 1).
    factor = torch.where(walk.tested, torch.where(bits, a, 1.0 - a), bits.to(torch.float64))
    weight = draft_prob * factor.prod(1)
    mismatch = walk.tested & (accepted != bits)
    off_region = mismatch.any(1)
    assert float(weight[off_region].sum()) < 1e-6, "decisions disagree with their uniforms"
    weight = torch.where(off_region, 0.0, weight)

    final = walk.final_weights / walk.final_weights.sum(1, keepdim=True)
    length = walk.num_accepted
    path_tokens = tokens.gather(1, path[:, 1:].clamp(min=0))
    T0, T1, T2 = toy.tables()
    extended = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, vocab, dtype=torch.float64)
    for n in range(DEPTH + 1):
        sel = (length == n) & (weight > 0)
        if not bool(sel.any()):
            continue
        w, f, toks = weight[sel], final[sel], path_tokens[sel]
        if n == 0:
            first_law = (w[:, None] * f).sum(0)
            extended += first_law[:, None, None] * T1[:, :, None] * T2
            first += first_law
        elif n == 1:
            contrib = w[:, None, None] * f[:, :, None] * T2[toks[:, 0]]
            extended.view(vocab, -1).index_add_(0, toks[:, 0], contrib.reshape(len(w), -1))
            first.index_add_(0, toks[:, 0], w)
            second.index_add_(0, toks[:, 0], w[:, None] * f)
        else:
            idx = toks[:, 0] * vocab + toks[:, 1]
            extended.view(vocab * vocab, vocab).index_add_(0, idx, w[:, None] * f)
            first.index_add_(0, toks[:, 0], w)
            second.view(-1).index_add_(0, idx, w)
    return TreeLaw(extended, first, second, float((weight * length).sum()))


def target_law(toy: ToyTree) -> torch.Tensor:
    T0, T1, T2 = toy.tables()
    return T0[:, None, None] * T1[:, :, None] * T2


def _case(mode: str, params, seed: int = 1) -> ToyTree:
    vocab = 5 if mode == "deterministic" else 4
    return ToyTree(vocab, seed, params, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
@pytest.mark.parametrize("seed", [1, 2])
def test_enumerated_law_equals_target(mode, params, seed):
    toy = _case(mode, params, seed)
    extended, first, _, _ = enumerate_law(toy)
    assert abs(float(extended.sum()) - 1.0) < 1e-12
    gap = float((extended - target_law(toy)).abs().max())
    assert gap < 1e-12, f"law differs from the target by {gap}"
    assert float((first - toy.tables()[0]).abs().max()) < 1e-12


def _no_residual_update(p_raw, p_mass, q_raw, q_mass, r, wor):
    return p_raw, p_mass


def _no_removal(p_raw, p_mass, last_removed, r, token, p_token):
    return None


PLANTED_BUGS = {  # name: (mode, monkeypatched attribute or None, draft_sampling passed)
    "deterministic-no-removal": ("deterministic", ("_remove_token", _no_removal), None),
    "iid-no-residual": ("iid", ("_residual_update", _no_residual_update), None),
    "wor-no-residual": ("without_replacement", ("_residual_update", _no_residual_update), None),
    "wor-raw-q": ("without_replacement", None, "iid"),
}


def _plant(monkeypatch, bug: str):
    mode, patch, sampling = PLANTED_BUGS[bug]
    if patch is not None:
        monkeypatch.setattr(ref_tree, *patch)
    return mode, sampling


@pytest.mark.parametrize("bug", list(PLANTED_BUGS))
def test_enumeration_catches_planted_bug(monkeypatch, bug):
    mode, sampling = _plant(monkeypatch, bug)
    toy = _case(mode, (1.0, 0, 1.0), seed=2)
    extended = enumerate_law(toy, sampling).extended
    gap = float((extended - target_law(toy)).abs().max())
    assert gap > 1e-3, f"the planted bug changed the law by only {gap}"


# --- Sampled outputs through the public API: chi-square -----------------------------------

FAMILY_ALPHA = 1e-3
FAMILY_SIZE = 2 * len(MODES)  # first and second token per sampled mode
ALPHA_TEST = FAMILY_ALPHA / FAMILY_SIZE
SAMPLED_BATCH = 60_000
SAMPLED_PARAMS = (1.0, 0, 1.0)


def sample_round(toy: ToyTree, batch: int, seed: int, draft_sampling=None, method="token",
                 backend="reference"):
    """Draw ``batch`` trees from the drafter (torch's sampler) and verify them through the
    public API with float32 logits ``log p`` on ``backend``. Returns the TreeVerifyOutput."""
    gen = torch.Generator().manual_seed(seed)
    nodes, vocab = len(toy.parents), toy.vocab
    tokens = torch.zeros(batch, nodes, dtype=torch.int64)
    for u in range(nodes):
        kids = toy.children[u]
        if not kids:
            continue
        q = toy.q[toy.prefix_index(tokens[:, toy.paths[u]])]
        if toy.mode == "deterministic":
            order = torch.sort(q, dim=1, descending=True, stable=True).indices
            tokens[:, kids] = order[:, :len(kids)]
        else:
            tokens[:, kids] = torch.multinomial(q, len(kids),
                                                replacement=toy.mode == "iid", generator=gen)
    logits = toy.node_rows(tokens, toy.p).log().float()
    draft_probs = None if toy.mode == "deterministic" else toy.node_rows(tokens, toy.q).float()
    t, k, p = SAMPLED_PARAMS
    return sk.verify_tree(logits, tokens, torch.tensor(toy.parents).expand(batch, nodes),
                          draft_probs=draft_probs,
                          draft_sampling=draft_sampling or
                          ("iid" if toy.mode == "deterministic" else toy.mode),
                          temperature=t, top_k=k, top_p=p, seed=torch.arange(batch) + seed,
                          offset=11, method=method, backend=backend)


def _chi_square(counts: torch.Tensor, expected_law: torch.Tensor, bug_law: torch.Tensor):
    """(p-value, power against ``bug_law``) of ``counts`` ``[G, V]`` (G groups of V cells)
    against ``expected_law`` ``[G, V]`` (each group's conditional law). The power is that of
    the level-ALPHA_TEST test at the observed group sizes when the data follow ``bug_law``."""
    counts, law, bug = counts.double(), expected_law.double(), bug_law.double()
    group = counts.sum(1, keepdim=True)
    support = (law > 0) & (group > 0)
    assert float(counts[~(law > 0)].sum()) == 0, "a token with zero target probability was emitted"
    expected = law * group
    statistic = float(((counts - expected) ** 2 / expected)[support].sum())
    dof = int(support.sum()) - int((group[:, 0] > 0).sum())
    critical = stats.chi2.isf(ALPHA_TEST, dof)
    noncentral = float((group * (bug - law) ** 2 / law)[support].sum())
    return float(stats.chi2.sf(statistic, dof)), float(stats.ncx2.sf(critical, dof, noncentral))


def _sampled_counts(out, vocab):
    tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
    first = torch.bincount(tokens[:, 0], minlength=vocab)[None]
    reached = accepted >= 1
    pairs = tokens[reached, 0] * vocab + tokens[reached, 1]
    second = torch.bincount(pairs, minlength=vocab * vocab).reshape(vocab, vocab)
    return first, second


def _conditional(second: torch.Tensor) -> torch.Tensor:
    mass = second.sum(1, keepdim=True)
    return torch.where(mass > 0, second / mass.clamp(min=1e-300), 0.0)


BUG_OF_MODE = {"deterministic": "deterministic-no-removal", "iid": "iid-no-residual",
               "without_replacement": "wor-raw-q"}


@pytest.mark.parametrize("mode", MODES)
def test_sampled_tokens_follow_target(monkeypatch, mode):
    toy = _case(mode, SAMPLED_PARAMS, seed=2)
    T0, T1, _ = toy.tables()
    # The bug's exact law, for the power of each test.
    with monkeypatch.context() as patched:
        _, sampling = _plant(patched, BUG_OF_MODE[mode])
        _, bug_first, bug_second, _ = enumerate_law(toy, sampling)
    first, second = _sampled_counts(sample_round(toy, SAMPLED_BATCH, seed=0), toy.vocab)
    p_first, power_first = _chi_square(first, T0[None], bug_first[None])
    p_second, power_second = _chi_square(second, T1, _conditional(bug_second))
    print(f"{mode}: first token p={p_first:.3g} power={power_first:.4f}; after an accepted "
          f"node ({int(second.sum())} samples) p={p_second:.3g} power={power_second:.4f} "
          f"against {BUG_OF_MODE[mode]} at alpha={ALPHA_TEST:.2g}")
    assert p_first > ALPHA_TEST and p_second > ALPHA_TEST
    assert max(power_first, power_second) >= 0.99


@pytest.mark.parametrize("mode", MODES)
def test_chi_square_catches_planted_bug(monkeypatch, mode):
    toy = _case(mode, SAMPLED_PARAMS, seed=2)
    T0, T1, _ = toy.tables()
    _, sampling = _plant(monkeypatch, BUG_OF_MODE[mode])
    first, second = _sampled_counts(sample_round(toy, SAMPLED_BATCH, seed=1, draft_sampling=sampling),
                                    toy.vocab)
    p_first, _ = _chi_square(first, T0[None], T0[None])
    p_second, _ = _chi_square(second, T1, T1)
    print(f"{BUG_OF_MODE[mode]}: first token p={p_first:.3g}, second p={p_second:.3g}")
    assert min(p_first, p_second) < ALPHA_TEST, "the chi-square tests missed the planted bug"


# --- Chain-shaped trees equal verify_chain ------------------------------------------------

def _random_chain(batch, num_drafts, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2
    draft_logits = logits[:, :num_drafts] + torch.randn(batch, num_drafts, vocab, generator=gen)
    q = torch.softmax(draft_logits, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    # Some drafts copy the target's arg-max so greedy requests accept a few.
    copy = torch.rand(batch, num_drafts, generator=gen) < 0.5
    drafts = torch.where(copy, logits[:, :num_drafts].argmax(-1), drafts)
    n = torch.randint(0, num_drafts + 1, (batch,), generator=gen)
    return logits, drafts, q, n


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without_replacement"])
def test_chain_shaped_tree_equals_verify_chain(mode):
    batch, num_drafts, vocab = 256, 5, 12
    logits, drafts, q, n = _random_chain(batch, num_drafts, vocab, seed=3)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3]).repeat(batch // 4)
    top_k = torch.tensor([0, 0, 5, 3, 0, 8, 0, 0]).repeat(batch // 8)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.6, 0.8]).repeat(batch // 5 + 1)[:batch]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=torch.arange(batch) * 7,
              offset=torch.arange(batch) % 3, backend="reference")
    chain_kw = {} if mode == "deterministic" else {"draft_probs": q}
    chain = sk.verify_chain(logits, drafts, num_draft_tokens=n, **chain_kw, **kw)
    tree_tokens = torch.cat([torch.full((batch, 1), -1), drafts], 1)
    parents = torch.arange(-1, num_drafts).expand(batch, -1)
    tree_kw = {} if mode == "deterministic" else {
        "draft_probs": torch.cat([q, torch.full((batch, 1, vocab), 1.0 / vocab)], 1),
        "draft_sampling": mode}
    tree = sk.verify_tree(logits, tree_tokens, parents, num_nodes=n + 1, **tree_kw, **kw)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    expected_path = torch.where(torch.arange(num_drafts + 1) <= chain.num_accepted[:, None],
                                torch.arange(num_drafts + 1), -1).to(torch.int32)
    assert torch.equal(tree.accepted_nodes, expected_path)
    assert 0 < int(chain.num_accepted.sum()) < int(n.sum())  # both outcomes occur


# --- Edge cases ---------------------------------------------------------------------------

def _star(tokens, vocab, probs_row, batch=4000):
    """A root whose children carry ``tokens``; the root's target row is ``probs_row``."""
    nodes = len(tokens) + 1
    logits = torch.full((batch, nodes, vocab), 0.0)
    logits[:, 0] = probs_row.log()
    tree_tokens = torch.tensor([-1] + list(tokens)).expand(batch, nodes)
    parents = torch.tensor([-1] + [0] * len(tokens)).expand(batch, nodes)
    return logits, tree_tokens, parents


def test_duplicate_sibling_tokens():
    vocab, batch = 5, 40_000
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    logits, tokens, parents = _star([1, 1, 1], vocab, p, batch)
    seeds = torch.arange(batch)
    # Deterministic: a token already removed is never accepted again.
    out = sk.verify_tree(logits, tokens, parents, seed=seeds, backend="reference")
    assert set(out.accepted_nodes[:, 1].tolist()) <= {-1, 1}
    assert float((out.num_accepted == 1).double().mean()) == pytest.approx(0.3, abs=0.01)
    first = out.output_token_ids[:, 0]
    rejected = out.num_accepted == 0
    assert not bool((first[rejected] == 1).any())  # the correction excludes the removed token
    # i.i.d. drafts from q: duplicates are legitimate. A copy of a rejected token is never
    # accepted (rejection means p(x) < q(x), so the residual is 0 at x) but still updates the
    # residual; over the drafts the first token follows p (exact law: the enumeration above).
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    drafted = torch.multinomial(q.expand(batch, vocab), 3, replacement=True,
                                generator=torch.Generator().manual_seed(0))
    tokens = torch.cat([torch.full((batch, 1), -1), drafted], 1)
    out = sk.verify_tree(logits, tokens, parents, draft_probs=q.expand(batch, 4, vocab),
                         seed=seeds, backend="reference")
    node = out.accepted_nodes[:, 1].long()
    repeat = (node >= 2) & (tokens.gather(1, node.clamp(min=1)[:, None])[:, 0] == tokens[:, 1])
    assert not bool(repeat.any()), "a copy of a rejected token was accepted"
    assert float((drafted[:, 0] == drafted[:, 1]).double().mean()) > 0.3
    counts = torch.bincount(out.output_token_ids[:, 0].long(), minlength=vocab)[None]
    pvalue, _ = _chi_square(counts, p[None].double(), p[None].double())
    assert pvalue > ALPHA_TEST


def test_every_child_has_zero_target_probability():
    vocab, batch = 6, 2000
    p = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    logits, tokens, parents = _star([0, 2, 4], vocab, p, batch)
    q = torch.full((batch, 4, vocab), 1.0 / vocab)
    for kw in ({}, {"draft_probs": q}, {"draft_probs": q, "draft_sampling": "without_replacement"},
               {"temperature": 0.0}):
        out = sk.verify_tree(logits, tokens, parents, seed=torch.arange(batch),
                             backend="reference", **kw)
        assert int(out.num_accepted.max()) == 0
        first = out.output_token_ids[:, 0]
        assert set(first.tolist()) <= {1, 3}
        assert bool((out.output_token_ids[:, 1:] == -1).all())
        if "temperature" not in kw:
            assert 0.4 < float((first == 1).double().mean()) < 0.6


def test_padding_nodes_are_ignored():
    batch, nodes, vocab = 64, 9, 10
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6]).expand(batch, nodes).clone()
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, nodes)
    tokens[:, 1:3] = logits[:, 0].argmax(-1, keepdim=True)  # accept often
    num_nodes = torch.randint(1, nodes + 1, (batch,), generator=gen)
    padding = torch.arange(nodes) >= num_nodes[:, None]
    garbage_parents = torch.where(padding, 77, parents)
    garbage_tokens = torch.where(padding, -5, tokens)
    kw = dict(draft_probs=q, temperature=torch.tensor([0.0, 1.0]).repeat(batch // 2),
              seed=torch.arange(batch), offset=5, backend="reference")
    padded = sk.verify_tree(logits, garbage_tokens, garbage_parents, num_nodes=num_nodes, **kw)
    # The same trees with the padding nodes detached (parents pointing nowhere valid is the
    # same as absent): compare with a tree whose padding nodes are real but unreachable.
    for b in range(batch):
        m = int(num_nodes[b])
        single = sk.verify_tree(logits[b:b + 1, :m], tokens[b:b + 1, :m], parents[b:b + 1, :m],
                                draft_probs=q[b:b + 1, :m], temperature=kw["temperature"][b:b + 1],
                                seed=b, offset=5, backend="reference")
        assert torch.equal(padded.output_token_ids[b, :m], single.output_token_ids[0])
        assert bool((padded.output_token_ids[b, m:] == -1).all())
        assert torch.equal(padded.accepted_nodes[b, :m], single.accepted_nodes[0])
        assert int(padded.num_accepted[b]) == int(single.num_accepted[0])
    assert int(padded.num_accepted.max()) >= 2


@pytest.mark.parametrize("parents,num_nodes,needle", [
    ([0, 0, 1, 2], 4, "parents[b, 0]"),          # root must be -1
    ([-1, 0, 2, 1], 4, "parents[0, 2] = 2"),     # a node cannot be its own parent
    ([-1, 0, 3, 1], 4, "parents[0, 2] = 3"),     # parent after the child
    ([-1, -1, 0, 1], 4, "parents[0, 1] = -1"),   # a second root
])
def test_bad_parents_raise(parents, num_nodes, needle):
    logits = torch.zeros(1, 4, 5)
    with pytest.raises(ValueError, match="parents") as info:
        sk.verify_tree(logits, torch.tensor([[-1, 1, 2, 3]]), torch.tensor([parents]),
                       num_nodes=num_nodes, backend="reference")
    assert needle in str(info.value)


def test_bad_arguments_raise():
    logits = torch.zeros(2, 3, 5)
    tokens = torch.tensor([[-1, 1, 2]] * 2)
    parents = torch.tensor([[-1, 0, 0]] * 2)
    # Padding parents are not checked.
    sk.verify_tree(logits, tokens, torch.tensor([[-1, 0, 9]] * 2), num_nodes=2)
    with pytest.raises(ValueError, match="tree_token_ids"):
        sk.verify_tree(logits, torch.tensor([[-1, 1, 5]] * 2), parents)
    with pytest.raises(ValueError, match="draft_sampling"):
        sk.verify_tree(logits, tokens, parents, draft_sampling="greedy")
    with pytest.raises(ValueError, match="draft_probs"):
        sk.verify_tree(logits, tokens, parents, draft_probs=torch.zeros(2, 2, 5))
    with pytest.raises(ValueError, match="num_nodes"):
        sk.verify_tree(logits, tokens, parents, num_nodes=0)
    with pytest.raises(ValueError, match="parents"):
        sk.verify_tree(logits, tokens, parents[:, :2])
    with pytest.raises(TypeError, match="parents"):
        sk.verify_tree(logits, tokens, parents.float())
    with pytest.raises(ValueError, match="temperature"):
        sk.verify_tree(logits, tokens, parents, temperature=-1.0)
    # validate=False: an invalid tree is treated as padding, never read out of bounds.
    out = sk.verify_tree(logits, torch.tensor([[-1, 9, 2]] * 2), torch.tensor([[-1, 5, 0]] * 2),
                         validate=False, temperature=0.0)
    assert bool((out.accepted_nodes[:, 1] != 1).all())


def test_row_without_finite_logit_emits_minus_one():
    logits = torch.full((1, 2, 4), -torch.inf)
    out = sk.verify_tree(logits, torch.tensor([[-1, 1]]), torch.tensor([[-1, 0]]), seed=0)
    assert out.output_token_ids.tolist() == [[-1, -1]]
    assert out.num_accepted.tolist() == [0]
