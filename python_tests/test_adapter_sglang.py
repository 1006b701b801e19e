"""SGLang adapter (``specdec_kernels.adapters.sglang``, sglang 0.5.23 / sgl-kernel 0.3.21).

* sgl-kernel's documented test case (one-hot target rows force every decision) through
  ``tree_speculative_sampling_target_only`` (SGLang's call: its coins, its zero scratch;
  and raw logits with SGLang's ``[bs, 1]`` temperatures) and ``verify_tree_greedy``.
* ``verify_tree_greedy`` token for token against a transcription of SGLang's
  ``VerifyTreeGreedy`` kernel on random trees (lists in build_tree_kernel_efficient's order
  and shuffled), and greedy sampling (temperature 0) equal to it.
* Laws of the first emitted token (chi-square at ALPHA = 1e-4 per test, power >= 0.99 at
  TV 0.02, asserted; C++ CPU path) with a planted bug caught.
* SGLang's linked lists round-trip through ``parents``; a row with no mass writes V - 1
  (SGLang's kernel), never -1; seeds: the same seed and offset give the same tokens, None
  gives fresh ones, a permuted batch permutes the outputs; batch size 0; bad input raises
  naming the argument, writes nothing and advances no generator.
"""
from __future__ import annotations

import math

import pytest
import torch

import specdec_kernels as sk
from conftest import _triton_param
from specdec_kernels.adapters import sglang
from test_chain_exactness import ALPHA, _chi_square

TREE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.tree")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAW_BATCH = 40_000  # draws per law test: power >= 0.99 at TV 0.02 for V <= 8


def _random_probs(shape, gen, zeros=True):
    probs = torch.rand(shape, generator=gen) ** 2
    if zeros:  # a zero probability is -inf after the log: never emitted
        probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def _law_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=probs.shape[-1])
    if counts[probs == 0].sum() > 0:
        return 0.0
    pvalue, power = _chi_square(counts, probs)
    assert power >= 0.99
    return pvalue


# --- SGLang ----------------------------------------------------------------------------------

def _sglang_example():
    """sgl-kernel's tests/test_speculative_sampling.py case (one-hot target rows)."""
    tree = dict(candidates=torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
                retrive_index=torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
                retrive_next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
                retrive_next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1],
                                                   [-1, -1, -1, -1, 1, -1]]))
    target_logits = torch.zeros(2, 6, 20)
    for b, i, token in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        target_logits[b, i, token] = 10
    target_logits[target_logits.amax(-1) < 10, 18] = 10
    return tree, target_logits


def _sglang_outputs(batch, nodes, num_spec_step):
    return (torch.full((batch * nodes,), -1, dtype=torch.int32),
            torch.full((batch, num_spec_step), -1, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32))


def _sglang_emitted(parents, candidates, *coins, **kwargs) -> list:
    """Each request's emitted tokens (``predicts`` along its accepted path) from SGLang's call
    on this tree; ``coins`` are SGLang's positional uniforms, ``kwargs`` the rest."""
    batch, nodes = candidates.shape
    tree = sglang.tree_to_sglang(parents, candidates)
    predicts, accept_index, accept_token_num = outputs = _sglang_outputs(batch, nodes, 4)
    sglang.tree_speculative_sampling_target_only(*outputs, *tree[3:], *tree[:3], *coins, **kwargs)
    return [predicts[accept_index[b, :int(accept_token_num[b]) + 1].long()].tolist()
            for b in range(batch)]


@pytest.mark.parametrize("backend", TREE_BACKENDS)
@pytest.mark.parametrize("inputs", ["probs", "logits", "sampling_info"])
def test_documented_example(backend, inputs):
    if inputs == "sampling_info" and backend != "reference":
        pytest.skip("the [bs, 1] parameters are reshaped before any backend: reference only")
    tree, target_logits = _sglang_example()
    for seed in (0, torch.tensor([5, 6])):
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(2, 6, 4)
        if inputs == "probs":  # SGLang's call: its coins, its zero-filled draft_probs
            target_probs = torch.softmax(target_logits / 0.01, -1)
            kw = dict(uniform_samples=torch.rand(2, 6), uniform_samples_for_final_sampling=
                      torch.rand(2), target_probs=target_probs,
                      draft_probs=torch.zeros_like(target_probs), threshold_single=1.0,
                      threshold_acc=1.0, deterministic=True)
        elif inputs == "logits":
            kw = dict(target_logits=target_logits, temperature=torch.tensor([0.01, 0.0]),
                      seed=seed)
        else:  # SGLang's sampling_info.temperatures: [bs, 1]
            kw = dict(target_logits=target_logits, temperature=torch.tensor([[0.01], [0.0]]),
                      top_k=torch.tensor([1 << 30, 1 << 30], dtype=torch.int32),
                      top_p=torch.ones(2), min_p=torch.zeros(2), seed=seed)
        result = sglang.tree_speculative_sampling_target_only(*outputs, **tree, **kw,
                                                              backend=backend)
        assert result is None
        assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
        assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
        assert accept_token_num.tolist() == [3, 2]


def _eagle_lists(parents: torch.Tensor):
    """The lists as build_tree_kernel_efficient writes them: nodes from N-1 down to 1, each
    pushed at the head of its parent's list (a Python transcription of that loop)."""
    batch, nodes = parents.shape
    next_token = torch.full((batch, nodes), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b in range(batch):
        for i in range(nodes - 1, 0, -1):
            parent = int(parents[b, i])
            next_sibling[b, i] = next_token[b, parent]
            next_token[b, parent] = i
    return next_token, next_sibling


def test_tree_conversion_round_trips():
    gen = torch.Generator().manual_seed(2)
    for nodes in (1, 2, 7, 33):
        batch = 6
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen))
                                                    for i in range(1, nodes)])
                               for _ in range(batch)])
        tokens = torch.randint(0, 50, (batch, nodes), generator=gen)
        eagle = sglang.tree_to_sglang(parents, tokens)
        next_token, next_sibling = _eagle_lists(parents)
        assert torch.equal(eagle.retrive_next_token, next_token)
        assert torch.equal(eagle.retrive_next_sibling, next_sibling)
        assert eagle.retrive_index.tolist() == torch.arange(batch * nodes).view(batch, -1).tolist()
        assert torch.equal(eagle.candidates, tokens)
        back = sglang.tree_from_sglang(next_token.int(), next_sibling, tokens)
        assert torch.equal(back.parents, parents) and back.tree_token_ids is tokens
    # A list in another order (the example's request 1: children 4 then 1) gives the same tree.
    tree, _ = _sglang_example()
    parents = sglang.tree_from_sglang(tree["retrive_next_token"], tree["retrive_next_sibling"],
                                      tree["candidates"]).parents
    assert parents.tolist() == [[-1, 0, 1, 0, 3, 4], [-1, 0, 1, 2, 0, 4]]
    # Padding nodes (num_nodes) are in no list.
    eagle = sglang.tree_to_sglang(torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 0]]),
                                  torch.zeros(2, 4, dtype=torch.int64),
                                  num_nodes=torch.tensor([4, 2]))
    assert eagle.retrive_next_token.tolist() == [[1, 3, -1, -1], [1, -1, -1, -1]]
    assert eagle.retrive_next_sibling.tolist() == [[-1, 2, -1, -1], [-1, -1, -1, -1]]


def test_bad_lists_name_the_argument():
    good_next, good_sibling = torch.tensor([[1, 3, -1, -1]]), torch.tensor([[-1, 2, -1, -1]])
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    cases = [
        (torch.tensor([[1, 3, -1, 9]]), good_sibling, "retrive_next_token: expected node"),
        (good_next, torch.tensor([[-1, 2, -2, -1]]), "retrive_next_sibling: expected node"),
        (torch.tensor([[1, -1, -1, -1]]), good_sibling, "node 3 of request 0 is reached by 0"),
        (torch.tensor([[1, 3, -1, -1]]), torch.tensor([[-1, 2, 1, -1]]), "reached by 2"),
        (torch.tensor([[2, -1, 1, -1]]), torch.tensor([[-1, 3, -1, -1]]), "parents before"),
        (torch.tensor([[1, -1, -1, -1]]), torch.tensor([[-1, 2, 3, 2]]), "reached by 2"),
    ]
    for next_token, next_sibling, message in cases:
        with pytest.raises(ValueError, match=message):
            sglang.tree_from_sglang(next_token, next_sibling, tokens)
    with pytest.raises(TypeError, match="retrive_next_sibling"):
        sglang.tree_from_sglang(good_next, good_sibling.float(), tokens)
    with pytest.raises(ValueError, match="parents"):
        sglang.tree_to_sglang(torch.tensor([[-1, 0, 3, 1]]), tokens)


def test_bad_input_writes_nothing():
    tree, target_logits = _sglang_example()
    probs = torch.softmax(target_logits, -1)
    cases = [
        (dict(threshold_single=0.5), ValueError, "threshold_single"),
        (dict(threshold_acc=0), ValueError, "threshold_acc"),
        (dict(target_logits=target_logits), ValueError, "target_probs, target_logits"),
        (dict(temperature=0.5), ValueError, "temperature"),
        (dict(retrive_index=tree["retrive_index"] + 100), ValueError, "retrive_index"),
        (dict(candidates=tree["candidates"] + 20), ValueError, "tree_token_ids"),
        (dict(accept_index=torch.full((2, 3), -1, dtype=torch.int32)), ValueError,
         "accept_index"),  # depth 3 needs 4 columns
        (dict(predicts=torch.full((12,), -1, dtype=torch.int64)), TypeError, "predicts"),
        (dict(retrive_next_token=tree["retrive_next_token"].flip(1)), ValueError,
         "retrive_next_token"),
    ]
    for change, error, name in cases:
        predicts, accept_index, accept_token_num = _sglang_outputs(2, 6, 4)
        kwargs = dict(predicts=predicts, accept_index=accept_index,
                      accept_token_num=accept_token_num, **tree, target_probs=probs, seed=0)
        kwargs.update(change)
        with pytest.raises(error, match=name):
            sglang.tree_speculative_sampling_target_only(**kwargs)
        assert (predicts == -1).all() and (accept_index == -1).all()
        assert (accept_token_num == 0).all()


def test_zero_draft_rows_are_deterministic_candidates_and_coins_key_the_stream():
    """A request whose draft_probs are all zero (SGLang's scratch) is verified as
    deterministic candidates, the others with their q -- in a mixed batch too, with or
    without validation; SGLang's coins key each request's stream (row independent)."""
    gen = torch.Generator().manual_seed(10)
    batch, nodes, vocab = 12, 6, 9
    parents = torch.tensor([-1, 0, 0, 1, 1, 3]).expand(batch, nodes)
    candidates = torch.randint(0, vocab, (batch, nodes), generator=gen)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    draft = _random_probs((batch, nodes, vocab), gen, zeros=False)
    scratch = torch.arange(batch) % 3 == 0
    draft[scratch] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    eagle = sglang.tree_to_sglang(parents, candidates)
    want = [sk.verify_tree(logits, candidates, parents, seed=seeds),
            sk.verify_tree(logits, candidates, parents, draft_probs=draft, seed=seeds)]
    for validate in (True, False):
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(batch, nodes, 4)
        sglang.tree_speculative_sampling_target_only(
            *outputs, *eagle[3:], *eagle[:3], target_logits=logits, draft_probs=draft,
            seed=seeds, validate=validate)
        for b in range(batch):
            expected = want[0 if scratch[b] else 1]
            assert int(accept_token_num[b]) == int(expected.num_accepted[b])
            m = int(accept_token_num[b])
            assert predicts[accept_index[b, :m + 1].long()].tolist() == \
                expected.output_token_ids[b, :m + 1].tolist()

    coins, final_coins = torch.rand(batch, nodes, generator=gen), torch.rand(batch, generator=gen)

    def emitted(order, coins, final_coins):
        return _sglang_emitted(parents, candidates[order], coins[order], final_coins[order],
                               target_logits=logits[order], draft_probs=draft[order])

    perm = torch.randperm(batch, generator=gen)
    base = emitted(torch.arange(batch), coins, final_coins)
    assert emitted(perm, coins, final_coins) == [base[b] for b in perm.tolist()]
    assert emitted(torch.arange(batch), coins.flip(0), final_coins.flip(0)) != base


def test_unvalidated_garbage_stays_in_range():
    """validate=False with garbage lists, indices and tokens: no error, and every write is
    in range (tokens in [0, V) or -1, flat indices into predicts, counts below num_spec_step)."""
    gen = torch.Generator().manual_seed(9)
    batch, nodes, vocab, steps = 8, 7, 13, 3
    garbage = lambda low, high: torch.randint(low, high, (batch, nodes), generator=gen)
    for _ in range(5):
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(batch, nodes, steps)
        sglang.tree_speculative_sampling_target_only(
            *outputs, garbage(-3, vocab + 3), garbage(-5, batch * nodes + 5),
            garbage(-3, nodes + 3), garbage(-3, nodes + 3),
            target_logits=torch.randn(batch, nodes, vocab, generator=gen), seed=1,
            validate=False)
        assert bool(((predicts == -1) | ((predicts >= 0) & (predicts < vocab))).all())
        assert bool(((accept_index == -1) | ((accept_index >= 0)
                                             & (accept_index < batch * nodes))).all())
        assert bool(((accept_token_num >= 0) & (accept_token_num < steps)).all())


def _sglang_law_round(mode: str, batch: int, gen: torch.Generator):
    """Root with three children (tokens repeat: i.i.d. drafts or a repeated candidate), one
    grandchild; returns the first emitted token of each request and the root's law."""
    vocab, nodes = 6, 5
    root_p = _random_probs(vocab, gen)
    rows = torch.cat([root_p[None], _random_probs((nodes - 1, vocab), gen)])
    parents = torch.tensor([-1, 0, 0, 0, 1])
    kw = dict(seed=torch.arange(batch) * 7919, offset=2)
    if mode == "iid":  # children drawn i.i.d. from q: repeats happen
        q = _random_probs(vocab, gen, zeros=False)
        children = torch.multinomial(q, 3 * batch, replacement=True, generator=gen).view(batch, 3)
        draft_probs = torch.zeros(batch, nodes, vocab)
        draft_probs[:, 0] = q
        draft_probs[:, 1] = 1.0 / vocab
        kw.update(draft_probs=draft_probs)
    else:  # deterministic candidates, one repeated
        children = torch.tensor([2, 2, 5]).expand(batch, 3)
    if mode == "sglang_call":  # SGLang's own arguments: its coins and its zero scratch
        kw = dict(uniform_samples=torch.rand(batch, nodes, generator=gen),
                  uniform_samples_for_final_sampling=torch.rand(batch, generator=gen),
                  draft_probs=torch.zeros(batch, nodes, vocab))
    candidates = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), children,
                            torch.full((batch, 1), 3)], 1)
    eagle = sglang.tree_to_sglang(parents.expand(batch, nodes), candidates)
    predicts, accept_index, accept_token_num = outputs = _sglang_outputs(batch, nodes, 3)
    sglang.tree_speculative_sampling_target_only(
        *outputs, eagle.candidates, eagle.retrive_index, eagle.retrive_next_token,
        eagle.retrive_next_sibling, target_probs=rows.expand(batch, -1, -1), **kw)
    return predicts.view(batch, nodes)[:, 0], root_p


@pytest.mark.parametrize("mode", ["deterministic", "iid", "sglang_call"])
def test_first_token_law(mode):
    tokens, p = _sglang_law_round(mode, LAW_BATCH, torch.Generator().manual_seed(4))
    assert _law_pvalue(tokens, p) > ALPHA


def test_law_catches_probs_fed_as_logits(monkeypatch):
    monkeypatch.setattr(sglang, "logits_from_probs", lambda probs, name: probs.float())
    tokens, p = _sglang_law_round("deterministic", LAW_BATCH, torch.Generator().manual_seed(4))
    assert _law_pvalue(tokens, p) < ALPHA, "the chi-square test missed softmax(probs)"


def test_permuted_batch_permutes_emitted_tokens():
    gen = torch.Generator().manual_seed(6)
    batch, nodes, vocab = 16, 6, 9
    parents = torch.tensor([-1, 0, 0, 1, 1, 3]).expand(batch, nodes)
    candidates = torch.randint(0, vocab, (batch, nodes), generator=gen)
    probs = _random_probs((batch, nodes, vocab), gen)
    draft = _random_probs((batch, nodes, vocab), gen, zeros=False)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)

    def emitted(order):
        return _sglang_emitted(parents, candidates[order], target_probs=probs[order],
                               draft_probs=draft[order], seed=seeds[order])

    identity, perm = torch.arange(batch), torch.randperm(batch, generator=gen)
    base = emitted(identity)
    assert emitted(perm) == [base[b] for b in perm.tolist()]
    assert len({len(tokens) for tokens in base}) > 1  # some requests accepted more




# --- verify_tree_greedy ----------------------------------------------------------------------

def _sglang_greedy_kernel(candidates, retrive_index, next_token, next_sibling, target_predict,
                          predicts, accept_index, accept_token_num):
    """A transcription of SGLang 0.5.23's VerifyTreeGreedy kernel (one request per block)."""
    batch, nodes = candidates.shape
    steps = accept_index.shape[1]
    flat_predict = target_predict.reshape(-1)
    for b in range(batch):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, current = 0, 0
        for _ in range(1, steps):
            current = int(next_token[b, current])
            while current != -1:
                if int(candidates[b, current]) == int(flat_predict[last]):
                    predicts[last] = int(flat_predict[last])
                    accepted += 1
                    accept_index[b, accepted] = int(retrive_index[b, current])
                    last = int(retrive_index[b, current])
                    break
                current = int(next_sibling[b, current])
            if current == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = int(flat_predict[last])


def _shuffled_lists(parents, gen):
    """First-child / next-sibling lists with each node's children in a random order."""
    batch, nodes = parents.shape
    next_token = torch.full((batch, nodes), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b in range(batch):
        for u in range(nodes):
            children = [c for c in range(1, nodes) if int(parents[b, c]) == u]
            order = [children[i] for i in torch.randperm(len(children), generator=gen).tolist()]
            for c, nxt in zip(order, order[1:] + [-1]):
                next_sibling[b, c] = nxt
            if order:
                next_token[b, u] = order[0]
    return next_token, next_sibling


def _random_parents(batch, nodes, gen):
    return torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen))
                                             for i in range(1, nodes)]) for _ in range(batch)])


def test_verify_tree_greedy_documented_example():
    tree, target_logits = _sglang_example()
    target_predict = target_logits.argmax(-1)
    predicts, accept_index, accept_token_num = outputs = _sglang_outputs(2, 6, 4)
    assert sglang.verify_tree_greedy(*outputs, **tree, target_predict=target_predict) is None
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_token_num.tolist() == [3, 2]


@pytest.mark.parametrize("order", ["eagle", "shuffled"])
def test_verify_tree_greedy_equals_sglangs_kernel(order):
    """Random trees, candidates and arg-maxes (small vocabulary: many matches, repeated
    tokens among siblings), lists in build_tree_kernel_efficient's order or shuffled, and
    num_spec_step below the depth: every output equal to SGLang's kernel, untouched
    entries included."""
    gen = torch.Generator().manual_seed(31)
    batch, nodes, vocab = 24, 12, 3
    parents = _random_parents(batch, nodes, gen)
    if order == "eagle":
        next_token, next_sibling = _eagle_lists(parents)
    else:
        next_token, next_sibling = _shuffled_lists(parents, gen)
    candidates = torch.randint(0, vocab, (batch, nodes), generator=gen)
    target_predict = torch.randint(0, vocab, (batch, nodes), generator=gen)
    retrive_index = torch.arange(batch * nodes).view(batch, nodes)
    for steps in (1, 3, nodes):
        want = _sglang_outputs(batch, nodes, steps)
        _sglang_greedy_kernel(candidates, retrive_index, next_token, next_sibling,
                              target_predict, *want)
        for validate in (None, False):
            got = _sglang_outputs(batch, nodes, steps)
            sglang.verify_tree_greedy(*got, candidates, retrive_index, next_token, next_sibling,
                                      target_predict, validate=validate)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        assert steps == 1 or bool((want[2] > 0).any())


def test_greedy_sampling_equals_verify_tree_greedy():
    """temperature = 0 through tree_speculative_sampling_target_only gives SGLang's greedy
    kernel's answer on the arg-max of the same logits (distinct arg-maxes: no ties)."""
    gen = torch.Generator().manual_seed(32)
    batch, nodes, vocab = 16, 9, 4
    parents = _random_parents(batch, nodes, gen)
    eagle = sglang.tree_to_sglang(parents, torch.randint(0, vocab, (batch, nodes), generator=gen))
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    greedy = _sglang_outputs(batch, nodes, nodes)
    sglang.verify_tree_greedy(*greedy, eagle.candidates, eagle.retrive_index,
                              eagle.retrive_next_token, eagle.retrive_next_sibling,
                              logits.argmax(-1))
    sampled = _sglang_outputs(batch, nodes, nodes)
    sglang.tree_speculative_sampling_target_only(
        *sampled, eagle.candidates, eagle.retrive_index, eagle.retrive_next_token,
        eagle.retrive_next_sibling, target_logits=logits, temperature=torch.zeros(batch, 1),
        seed=0)
    for a, b in zip(sampled, greedy):
        assert torch.equal(a, b)


def test_verify_tree_greedy_unvalidated_garbage_stays_in_range():
    gen = torch.Generator().manual_seed(33)
    batch, nodes, steps = 8, 7, 3
    garbage = lambda low, high: torch.randint(low, high, (batch, nodes), generator=gen)
    for _ in range(5):
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(batch, nodes, steps)
        sglang.verify_tree_greedy(*outputs, garbage(0, 4), garbage(-5, batch * nodes + 5),
                                  garbage(-3, nodes + 3), garbage(-3, nodes + 3),
                                  garbage(-9, 9), validate=False)
        assert bool(((accept_index == -1) | ((accept_index >= 0)
                                             & (accept_index < batch * nodes))).all())
        assert bool(((accept_token_num >= 0) & (accept_token_num < steps)).all())


# --- SGLang's sentinels, edges, seeds --------------------------------------------------------

def test_row_with_no_mass_writes_the_last_token_id_never_minus_one():
    """A node whose target row has no mass: SGLang's kernel finds nothing to sample and
    writes V - 1; so do we (our kernels emit -1 there, never fed back as a token)."""
    tree, target_logits = _sglang_example()
    probs = torch.softmax(target_logits / 0.01, -1)
    probs[0, 5] = 0.0   # request 0's leaf 5 (reached: 0 -> 3 -> 4 -> 5): its bonus row
    probs[1, 0] = 0.0   # request 1's root: no child can be accepted, nothing to sample
    predicts, accept_index, accept_token_num = outputs = _sglang_outputs(2, 6, 4)
    sglang.tree_speculative_sampling_target_only(*outputs, **tree, target_probs=probs, seed=1)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 19, 19, -1, -1, -1, -1, -1]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, -1, -1, -1]]
    assert accept_token_num.tolist() == [3, 0]


@pytest.mark.parametrize("draft", ["none", "scratch", "probs"])
@pytest.mark.parametrize("validate", [None, False])
def test_batch_size_zero(draft, validate):
    empty = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype)
    draft_probs = {"none": None, "scratch": empty(0, 4, 5, dtype=torch.float32),
                   "probs": torch.full((0, 4, 5), 0.2)}[draft]
    outputs = _sglang_outputs(0, 4, 3)
    lists = dict(candidates=empty(0, 4), retrive_index=empty(0, 4),
                 retrive_next_token=empty(0, 4), retrive_next_sibling=empty(0, 4))
    sglang.tree_speculative_sampling_target_only(
        *outputs, **lists, uniform_samples=empty(0, 4, dtype=torch.float32),
        uniform_samples_for_final_sampling=empty(0, dtype=torch.float32),
        target_probs=empty(0, 4, 5, dtype=torch.float32), draft_probs=draft_probs,
        validate=validate)
    sglang.tree_speculative_sampling_target_only(
        *outputs, **lists, target_logits=empty(0, 4, 5, dtype=torch.float32),
        temperature=empty(0, 1, dtype=torch.float32), draft_probs=draft_probs, validate=validate)
    sglang.verify_tree_greedy(*outputs, **lists, target_predict=empty(0, 4), validate=validate)
    assert all(t.numel() == 0 for t in outputs)


BAD_AT_ANY_BATCH = [  # (keywords, error, argument named): issue 47 item 4
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(draft_sampling="bogus"), ValueError, "draft_sampling"),
    (dict(draft_sampling="bogus", draft_probs="probs"), ValueError, "draft_sampling"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(backend="bogus"), ValueError, "backend"),
    (dict(temperature="[bs + 1, 1]"), ValueError, "temperature"),
    (dict(draft_probs="int"), TypeError, "draft_probs"),
    # V = 0 through target_probs: named as given, not the op's target_logits (issue 47 item 6)
    (dict(target_probs="[bs, N, 0]", target_logits=None), ValueError, "target_probs"),
]


@pytest.mark.parametrize("batch", [0, 1])
@pytest.mark.parametrize("case", range(len(BAD_AT_ANY_BATCH)))
def test_bad_input_raises_at_every_batch_size(batch, case):
    """At batch size 0 the same checks run as at 1 (the core verify_tree's, and
    draft_sampling even without draft_probs); nothing is written, no generator advances."""
    keywords, error, name = BAD_AT_ANY_BATCH[case]
    nodes, vocab = 3, 5
    given = {"probs": torch.full((batch, nodes, vocab), 0.2),
             "int": torch.ones(batch, nodes, vocab, dtype=torch.int64),
             "[bs + 1, 1]": torch.ones(batch + 1, 1), "[bs, N, 0]": torch.zeros(batch, nodes, 0)}
    keywords = {k: given[v] if k in ("draft_probs", "temperature", "target_probs")
                and isinstance(v, str) else v for k, v in keywords.items()}
    next_token = torch.full((batch, nodes), -1)
    next_token[:, 0], next_token[:, 1] = 1, 2  # a chain 0 -> 1 -> 2
    outputs = _sglang_outputs(batch, nodes, 4)
    before = [t.clone() for t in outputs]
    state = torch.get_rng_state()
    with pytest.raises(error, match=f"^{name}"):
        sglang.tree_speculative_sampling_target_only(
            *outputs, candidates=torch.zeros(batch, nodes, dtype=torch.int64),
            retrive_index=torch.arange(batch * nodes).view(batch, nodes),
            retrive_next_token=next_token, retrive_next_sibling=torch.full((batch, nodes), -1),
            **{"target_logits": torch.zeros(batch, nodes, vocab), **keywords})
    assert all(torch.equal(a, b) for a, b in zip(outputs, before))
    assert torch.equal(torch.get_rng_state(), state)


def test_rejected_call_advances_no_generator():
    """seed=None and no coins: one seed per request from torch's generator -- never drawn
    by a call rejected for its arguments (fuzz finding: temperature=-1 advanced it)."""
    tree, target_logits = _sglang_example()
    state = torch.get_rng_state()
    bad = [dict(target_logits=target_logits, temperature=-1.0),
           dict(target_logits=target_logits, temperature=torch.tensor([[0.5], [-1.0]])),
           dict(target_logits=target_logits, top_p=0.0),
           dict(target_logits=target_logits, draft_probs=torch.full((2, 6, 20), 0.05),
                draft_sampling="sometimes"),
           dict(target_probs=torch.softmax(target_logits, -1), threshold_acc=1.5)]
    for kwargs in bad:
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(2, 6, 4)
        with pytest.raises((ValueError, TypeError)):
            sglang.tree_speculative_sampling_target_only(*outputs, **tree, **kwargs)
        assert (predicts == -1).all() and (accept_index == -1).all()
        assert (accept_token_num == 0).all()
    assert torch.equal(torch.get_rng_state(), state), "a rejected call advanced torch's generator"
    sglang.tree_speculative_sampling_target_only(*_sglang_outputs(2, 6, 4), **tree,
                                                 target_logits=target_logits)
    assert not torch.equal(torch.get_rng_state(), state)


def test_relaxed_thresholds_are_not_implemented_here():
    """threshold_single/threshold_acc below 1 (SGLang's lossy relaxed acceptance) delegate
    to SGLang's own kernel when importable; on CPU without it: NotImplementedError (also a
    ValueError) naming them, nothing written."""
    tree, target_logits = _sglang_example()
    probs = torch.softmax(target_logits / 0.01, -1)
    for thresholds in (dict(threshold_single=0.0, threshold_acc=0.0), dict(threshold_acc=0.5)):
        outputs = _sglang_outputs(2, 6, 4)
        with pytest.raises(NotImplementedError, match="threshold_single, threshold_acc"):
            sglang.tree_speculative_sampling_target_only(
                *outputs, **tree, uniform_samples=torch.rand(2, 6),
                uniform_samples_for_final_sampling=torch.rand(2), target_probs=probs,
                draft_probs=torch.zeros_like(probs), **thresholds)
        assert issubclass(sglang.UnsupportedModeError, ValueError)
        assert (outputs[0] == -1).all() and (outputs[2] == 0).all()


def test_seed_semantics_and_retrieve_spelling():
    """The same seed and offset give the same tokens, another offset other tokens; seed=None
    gives fresh ones each call; SGLang's coins are repeatable; ``retrieve_*`` keywords are
    the same lists."""
    gen = torch.Generator().manual_seed(34)
    batch, nodes, vocab = 32, 7, 30
    parents = _random_parents(batch, nodes, gen)
    eagle = sglang.tree_to_sglang(parents, torch.randint(0, vocab, (batch, nodes), generator=gen))
    logits = torch.randn(batch, nodes, vocab, generator=gen)

    def run(**kwargs):
        outputs = _sglang_outputs(batch, nodes, nodes)
        lists = kwargs.pop("lists", dict(retrive_index=eagle.retrive_index,
                                         retrive_next_token=eagle.retrive_next_token,
                                         retrive_next_sibling=eagle.retrive_next_sibling))
        sglang.tree_speculative_sampling_target_only(
            *outputs, candidates=eagle.candidates, **lists, target_logits=logits, **kwargs)
        return [t.tolist() for t in outputs]

    assert run(seed=5, offset=2) == run(seed=5, offset=2)
    assert run(seed=5, offset=2) != run(seed=5, offset=3)
    assert run() != run()
    coins = dict(uniform_samples=torch.rand(batch, nodes, generator=gen),
                 uniform_samples_for_final_sampling=torch.rand(batch, generator=gen))
    assert run(**coins) == run(**coins)
    spelled = dict(retrieve_index=eagle.retrive_index,
                   retrieve_next_token=eagle.retrive_next_token,
                   retrieve_next_sibling=eagle.retrive_next_sibling)
    assert run(seed=5, offset=2, lists=spelled) == run(seed=5, offset=2)
    with pytest.raises(TypeError, match="retrive_index"):
        run(lists=dict(spelled, retrive_index=eagle.retrive_index))


@needs_cuda
def test_on_cuda_tensors():
    tree, target_logits = _sglang_example()
    cuda = {k: v.cuda() for k, v in tree.items()}
    for call in ("sampling", "greedy"):
        outputs = [t.cuda() for t in _sglang_outputs(2, 6, 4)]
        if call == "sampling":
            sglang.tree_speculative_sampling_target_only(
                *outputs, **cuda, target_logits=target_logits.cuda(),
                temperature=torch.full((2, 1), 0.01, device="cuda"), seed=1)
        else:
            sglang.verify_tree_greedy(*outputs, **cuda,
                                      target_predict=target_logits.cuda().argmax(-1))
        predicts, accept_index, accept_token_num = outputs
        assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
        assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
        assert accept_token_num.tolist() == [3, 2]
