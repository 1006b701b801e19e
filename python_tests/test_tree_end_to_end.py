"""End to end: speculative generation with draft trees on a toy target "model" (no weights).

The target is a fixed random first-order Markov chain over V tokens (the logits depend on the
previous token only); the drafter is a perturbed copy of it. Each step, per request, a draft
tree of a fixed regular shape (3 children at the root, 2 under each of them, 1 under each of
those: N = 16 nodes, depth 3) is drawn from the drafter (i.i.d., without replacement, or the
top candidates), the "forward" writes every node's K/V (its token and its position id from
``build_tree_attention``) at ``kv_lens + i`` of a toy cache, ``verify_tree`` picks the tokens,
and ``compact_kv_cache`` moves the accepted path into place.

Checks, per mode, on >= 4,000 generated tokens:
* the cache holds exactly the committed sequence with consecutive position ids (the tree
  attention positions and the compaction agree with ``accepted_nodes``), and the mask row of
  the last accepted node selects exactly the accepted path;
* bigram statistics match the target chain (chi-square on transition counts, Anderson-Goodman);
* the mean accepted length matches its exact expectation given each step's root token
  (computed in float64 by a recursion over the tree levels; z-test on the per-step differences).
False-alarm rate: alpha = 1e-3 for the family of 2 * len(MODES) tests (Bonferroni). The power of
the bigram test against a chain whose every row is at total-variation distance 0.1 from the
target's is computed (non-central chi-square) and asserted >= 0.99.
"""
from __future__ import annotations

import pytest
import torch
from scipy import stats

import specdec_kernels as sk

VOCAB = 12
BATCH = 32
MIN_TOKENS = 4_000
CHILDREN = (3, 2, 1)  # children per node at depth 0, 1, 2
MODES = ["deterministic", "iid", "without_replacement"]
ALPHA_TEST = 1e-3 / (2 * len(MODES))
TV_ALT = 0.1


def _regular_tree(children):
    """parents of the regular tree, in breadth-first order, and each node's depth."""
    parents, depth, level = [-1], [0], [0]
    for d, count in enumerate(children):
        nxt = []
        for u in level:
            for _ in range(count):
                parents.append(u)
                depth.append(d + 1)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents, depth


PARENTS, DEPTHS = _regular_tree(CHILDREN)
NODES = len(PARENTS)


class ToyChain:
    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.target_logits = torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64) * 1.6
        self.draft_logits = self.target_logits + 0.8 * torch.randn(VOCAB, VOCAB, generator=gen,
                                                                   dtype=torch.float64)
        self.p = torch.softmax(self.target_logits, -1)  # [prev, next]
        self.q = torch.softmax(self.draft_logits, -1)


def draft_tree(chain: ToyChain, roots: torch.Tensor, mode: str, gen: torch.Generator):
    """Tokens ``[B, N]`` of a draft tree per request, drawn from the drafter."""
    tokens = torch.zeros(len(roots), NODES, dtype=torch.int64)
    tokens[:, 0] = roots
    for u in range(NODES):
        kids = [c for c in range(1, NODES) if PARENTS[c] == u]
        if not kids:
            continue
        q = chain.q[tokens[:, u]].float()
        if mode == "deterministic":
            tokens[:, kids] = torch.sort(q, dim=-1, descending=True, stable=True).indices[:, :len(kids)]
        else:
            tokens[:, kids] = torch.multinomial(q, len(kids), replacement=mode == "iid",
                                                generator=gen)
    return tokens


def expected_accepted(chain: ToyChain, mode: str) -> torch.Tensor:
    """E[num_accepted | root token r] ``[V]`` for the regular tree, exactly (float64).

    A(r, x) = P(the walk at a node with token r accepts a child with token x), by the mode's
    rule in closed form; E_l(r) = sum_x A_l(r, x) (1 + E_{l+1}(x)), E = 0 below the leaves.
    """
    def norm(v):
        s = v.sum()
        return v / s if s > 0 else v

    def accept_law(r: int, count: int) -> torch.Tensor:
        p, q = chain.p[r], chain.q[r]
        law = torch.zeros(VOCAB, dtype=torch.float64)
        if mode == "deterministic":
            candidates = torch.sort(q.float(), descending=True, stable=True).indices[:count]
            survive = 1.0
            for x in candidates.tolist():
                law[x] += survive * p[x]
                survive *= 1.0 - float(p[x])
                p = norm(torch.where(torch.arange(VOCAB) == x, 0.0, p))
            return law
        states = [(p, q, 1.0)]  # (current residual, current draft, probability of reaching it)
        for _ in range(count):
            nxt = []
            for p_k, q_k, prob in states:
                law += prob * torch.minimum(p_k, q_k)
                residual = norm((p_k - q_k).clamp(min=0))
                if mode == "iid":
                    reject = float((q_k - p_k).clamp(min=0).sum())
                    nxt.append((residual, q_k, prob * reject))
                else:  # the rejected token x1 leaves the draft
                    for x in range(VOCAB):
                        w = float((q_k[x] - p_k[x]).clamp(min=0))
                        if w > 0:
                            nxt.append((residual, norm(torch.where(torch.arange(VOCAB) == x, 0.0, q_k)),
                                        prob * w))
            states = nxt
        return law

    expected = torch.zeros(VOCAB, dtype=torch.float64)
    for count in reversed(CHILDREN):
        laws = torch.stack([accept_law(r, count) for r in range(VOCAB)])
        expected = laws @ (1.0 + expected)
    return expected


def generate(chain: ToyChain, mode: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    capacity = 512
    cache = torch.full((BATCH, capacity, 1, 2), -7.0)  # [B, S, H, D]: (token, position id)
    kv_lens = torch.zeros(BATCH, dtype=torch.int64)
    roots = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    sequences = [[int(r)] for r in roots]
    parents = torch.tensor(PARENTS).expand(BATCH, NODES)
    step_roots, step_accepted, generated, step = [], [], 0, 0
    while generated < MIN_TOKENS:
        tokens = draft_tree(chain, roots, mode, gen)
        attention = sk.build_tree_attention(parents, prefix_lens=kv_lens)
        assert torch.equal(attention.depth[0], torch.tensor(DEPTHS, dtype=torch.int32))
        # The "forward": K/V of node i at kv_lens + i; logits from the node's own token.
        slots = kv_lens[:, None] + torch.arange(NODES)
        rows = torch.arange(BATCH)[:, None].expand(BATCH, NODES)
        cache[rows, slots, 0, 0] = tokens.float()
        cache[rows, slots, 0, 1] = attention.position_ids.float()
        target_logits = chain.target_logits[tokens].float()  # [B, N, V]
        kw = {} if mode == "deterministic" else {
            "draft_probs": chain.q[tokens].float(), "draft_sampling": mode}
        out = sk.verify_tree(target_logits, tokens, parents, seed=torch.arange(BATCH) + 1000 * seed,
                             offset=step, **kw)
        # The mask row of the last accepted node is exactly the accepted path.
        last = out.accepted_nodes.long().gather(1, out.num_accepted.long()[:, None])[:, 0]
        visible = attention.mask[torch.arange(BATCH), last]
        on_path = (out.accepted_nodes.long()[:, :, None] == torch.arange(NODES)).any(1)
        assert torch.equal(visible, on_path)

        new_lens = sk.compact_kv_cache([cache], kv_lens, out.accepted_nodes, out.num_accepted)
        assert torch.equal(new_lens, kv_lens + out.num_accepted.long() + 1)
        for b in range(BATCH):
            emitted = out.output_token_ids[b, :int(out.num_accepted[b]) + 1].tolist()
            assert min(emitted) >= 0
            sequences[b].extend(emitted)
            generated += len(emitted)
        step_roots.append(roots.clone())
        step_accepted.append(out.num_accepted.long())
        kv_lens = new_lens
        roots = out.output_token_ids.long().gather(1, out.num_accepted.long()[:, None])[:, 0]
        step += 1

    # The cache holds the committed sequence (all but the last, uncommitted, root) in order,
    # each at its own position.
    for b in range(BATCH):
        length = int(kv_lens[b])
        assert cache[b, :length, 0, 0].long().tolist() == sequences[b][:length]
        assert cache[b, :length, 0, 1].long().tolist() == list(range(length))
    return sequences, torch.cat(step_roots), torch.cat(step_accepted), generated


@pytest.mark.parametrize("mode", MODES)
def test_speculative_generation_matches_target_chain(mode):
    chain = ToyChain(seed=1)
    sequences, roots, accepted, generated = generate(chain, mode, seed=MODES.index(mode))
    assert generated >= MIN_TOKENS

    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seq in sequences:
        s = torch.tensor(seq)
        counts.index_put_((s[:-1], s[1:]), torch.ones(len(s) - 1, dtype=torch.float64),
                          accumulate=True)
    row_totals = counts.sum(1, keepdim=True)
    live = row_totals[:, 0] > 0
    expected = row_totals * chain.p
    statistic = float(((counts - expected) ** 2 / expected)[live].sum())
    dof = int(live.sum()) * (VOCAB - 1)
    pvalue = float(stats.chi2.sf(statistic, dof))
    critical = stats.chi2.isf(ALPHA_TEST, dof)
    power = float(stats.ncx2.sf(critical, dof, 4 * float(row_totals.sum()) * TV_ALT ** 2))

    mean_expected = expected_accepted(chain, mode)[roots]
    diff = accepted.double() - mean_expected
    z = float(diff.sum() / (diff.var() * len(diff)) ** 0.5)
    z_critical = float(stats.norm.isf(ALPHA_TEST / 2))
    print(f"{mode}: {generated} tokens in {len(accepted) // BATCH} steps; bigram chi2 p={pvalue:.3g} "
          f"(power vs TV {TV_ALT} per row: {power:.4f}); mean accepted "
          f"{float(accepted.double().mean()):.3f} vs expected {float(mean_expected.mean()):.3f} "
          f"(z={z:.2f}, |z| limit {z_critical:.2f})")
    assert pvalue > ALPHA_TEST, "generated bigrams do not follow the target chain"
    assert power >= 0.99
    assert abs(z) < z_critical, "mean accepted length differs from its expectation"
