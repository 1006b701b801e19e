"""Engine adapters (contract section 13): FlashInfer and SGLang call shapes.

* Shapes, dtypes, placeholders and in-place outputs as each engine's kernel has them, and each
  engine's own documented example reproduced (their target rows force every decision).
* Laws of the first emitted token through each adapter: chi-square on the reference backend at
  false-alarm rate ALPHA = 1e-4 per test, power >= 0.99 against any law at total-variation
  distance >= 0.02 (non-central chi-square, noncentrality 4 N TV^2; asserted). Each law test
  has a planted bug it catches: FlashInfer/SGLang probabilities fed as logits without the log
  (vLLM's tests are in test_adapter_vllm.py).
* A permuted batch permutes the outputs (per-request seeds honoured), SGLang's linked lists
  round-trip through ``parents``, bad input raises naming the argument and writes nothing.
* One small Triton-interpreter case per adapter: the same tokens as the reference.
"""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import CHAIN_BACKENDS, _triton_param
from specdec_kernels.adapters import _common, flashinfer, sglang
from test_chain_exactness import ALPHA, _chi_square

TREE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.tree")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAW_BATCH = 40_000  # draws per law test: power >= 0.998 at TV 0.02 for V <= 8


def _random_probs(shape, gen, zeros=True):
    probs = torch.rand(shape, generator=gen) ** 2
    if zeros:  # a zero probability is -inf after the log: never emitted
        probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def _law_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of the tokens against ``probs`` (0 if a zero-probability token was
    emitted), with the power asserted."""
    counts = torch.bincount(tokens.long(), minlength=probs.shape[-1])
    if counts[probs == 0].sum() > 0:
        return 0.0
    pvalue, power = _chi_square(counts, probs)
    assert power >= 0.99
    return pvalue


# --- FlashInfer ------------------------------------------------------------------------------

FLASHINFER_EXAMPLE = dict(
    draft_probs=torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]]),
    draft_token_ids=torch.tensor([[2, 1]], dtype=torch.int32),
    target_probs=torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0],
                                [0.7, 0.1, 0.1, 0.1]]]))


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_flashinfer_documented_example(backend):
    """FlashInfer's docstring example: draft 1 always accepted (p/q = 2), draft 2 always
    rejected (p = 0), the correction one-hot at token 0 -- whatever the seed."""
    for seed in (0, 42, torch.tensor([7])):
        tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
            *FLASHINFER_EXAMPLE.values(), seed=seed, backend=backend)
        assert tokens.dtype == accepted.dtype == emitted.dtype == torch.int32
        assert tokens.tolist() == [[2, 0, -1]]
        assert accepted.tolist() == [1] and emitted.tolist() == [1]


def test_flashinfer_counters_add_in_place():
    """Counters are added to in place (int32 or int64) and returned as the same tensors;
    the accepted count goes on past the first rejection (FlashInfer's alignment metric)."""
    vocab = 5
    target = torch.zeros(1, 4, vocab)
    target[0, 0, 1] = 1.0                       # draft 1 (token 3) has p = 0: rejected
    target[0, 1, 3] = target[0, 2, 4] = 1.0     # drafts 2 and 3 have p = 1: pass on their own
    target[0, 3] = 0.2
    draft = torch.full((1, 3, vocab), 0.2)
    ids = torch.tensor([[3, 3, 4]])
    for dtype in (torch.int32, torch.int64):
        accepted = torch.tensor([10], dtype=dtype)
        emitted = torch.tensor([5], dtype=dtype)
        for step in range(2):
            tokens, got_accepted, got_emitted = flashinfer.chain_speculative_sampling(
                draft, ids, target, accepted, emitted, seed=torch.tensor([step]))
            assert got_accepted is accepted and got_emitted is emitted
            assert tokens.tolist() == [[1, -1, -1, -1]]
        assert accepted.tolist() == [14] and emitted.tolist() == [5]


def test_flashinfer_counts_match_the_definition():
    """Random rows: emitted == verify_chain's num_accepted on log(target_probs); accepted ==
    emitted + the later drafts whose own uniform passes u * q < p."""
    gen = torch.Generator().manual_seed(3)
    batch, num_drafts, vocab = 400, 3, 6
    target = _random_probs((batch, num_drafts + 1, vocab), gen)
    draft = _random_probs((batch, num_drafts, vocab), gen, zeros=False)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target,
                                                                       seed=seeds, offset=3)
    ours = sk.verify_chain(torch.log(target), ids, draft_probs=draft, seed=seeds, offset=3)
    assert torch.equal(tokens, ours.output_token_ids) and torch.equal(emitted, ours.num_accepted)
    u = torch.stack([sk._rng.uniform(seeds, torch.full_like(seeds, 3), j + 1,
                                     sk._rng.PURPOSE_ACCEPT) for j in range(num_drafts)], 1)
    p = target[:, :num_drafts].gather(-1, ids[..., None])[..., 0]
    q = draft.gather(-1, ids[..., None])[..., 0]
    later = torch.arange(num_drafts) > emitted[:, None]
    assert torch.equal(accepted, emitted + (later & (u * q < p)).sum(1).int())
    assert bool((accepted > emitted).any()) and bool((accepted == emitted).any())


def _flashinfer_round(batch: int, gen: torch.Generator):
    vocab, num_drafts = 6, 2
    target = _random_probs((num_drafts + 1, vocab), gen)
    draft = _random_probs((num_drafts, vocab), gen, zeros=False)
    ids = torch.multinomial(draft, batch, replacement=True, generator=gen).T
    tokens, _, _ = flashinfer.chain_speculative_sampling(
        draft.expand(batch, -1, -1), ids, target.expand(batch, -1, -1),
        seed=torch.arange(batch), offset=11, backend="reference")
    return tokens[:, 0], target[0]


def test_flashinfer_first_token_law():
    tokens, p = _flashinfer_round(LAW_BATCH, torch.Generator().manual_seed(5))
    assert _law_pvalue(tokens, p) > ALPHA


def test_flashinfer_law_catches_probs_fed_as_logits(monkeypatch):
    monkeypatch.setattr(flashinfer, "logits_from_probs", lambda probs, name: probs.float())
    tokens, p = _flashinfer_round(LAW_BATCH, torch.Generator().manual_seed(5))
    assert _law_pvalue(tokens, p) < ALPHA, "the chi-square test missed softmax(probs)"


def test_flashinfer_permuted_batch_and_seed_conventions():
    gen = torch.Generator().manual_seed(8)
    batch, num_drafts, vocab = 64, 3, 7
    target = _random_probs((batch, num_drafts + 1, vocab), gen)
    draft = _random_probs((batch, num_drafts, vocab), gen, zeros=False)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen)
    args = (draft, ids, target)
    base = flashinfer.chain_speculative_sampling(*args, seed=seeds, offset=seeds // 3)
    perm = torch.randperm(batch, generator=gen)
    permuted = flashinfer.chain_speculative_sampling(*(a[perm] for a in args), seed=seeds[perm],
                                                     offset=seeds[perm] // 3)
    for got, want in zip(permuted, base):
        assert torch.equal(got, want[perm])
    # An int seed is the batch's seed, FlashInfer's way: request b keyed by seed + b.
    by_int = flashinfer.chain_speculative_sampling(*args, seed=2**63 - 2, offset=4)
    by_tensor = flashinfer.chain_speculative_sampling(
        *args, seed=torch.arange(batch) + (2**63 - 2), offset=4)  # wraps like int64
    assert all(torch.equal(a, b) for a, b in zip(by_int, by_tensor))
    # A generator: one fresh seed per request, repeatable from its seed, advancing it.
    runs = [flashinfer.chain_speculative_sampling(*args, generator=g)[0]
            for g in (torch.Generator().manual_seed(1), torch.Generator().manual_seed(1))]
    assert torch.equal(runs[0], runs[1])
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    flashinfer.chain_speculative_sampling(*args, generator=generator)
    assert not torch.equal(generator.get_state(), state)


def test_flashinfer_bad_input_names_the_argument():
    draft, ids, target = FLASHINFER_EXAMPLE.values()
    accepted = torch.tensor([3], dtype=torch.int32)
    emitted = torch.tensor([4], dtype=torch.int32)
    cases = [
        (dict(target_probs=target[:, :2]), ValueError, "target_probs"),
        (dict(draft_probs=draft[0]), ValueError, "draft_probs"),
        (dict(draft_token_ids=torch.tensor([[2, 9]])), ValueError, "draft_token_ids"),
        (dict(target_probs=target.to(torch.int64)), TypeError, "target_probs"),
        (dict(maybe_output_accepted_token_num=torch.zeros(1)), TypeError,
         "maybe_output_accepted_token_num"),
        (dict(maybe_output_emitted_draft_token_num=torch.zeros(2, dtype=torch.int32)),
         ValueError, "maybe_output_emitted_draft_token_num"),
        (dict(generator=3), TypeError, "generator"),
        (dict(deterministic="yes"), TypeError, "deterministic"),
    ]
    for change, error, name in cases:
        kwargs = dict(draft_probs=draft, draft_token_ids=ids, target_probs=target,
                      maybe_output_accepted_token_num=accepted,
                      maybe_output_emitted_draft_token_num=emitted, seed=0)
        kwargs.update(change)
        with pytest.raises(error, match=name):
            flashinfer.chain_speculative_sampling(**kwargs)
        assert accepted.tolist() == [3] and emitted.tolist() == [4], "a rejected call wrote"


def test_flashinfer_rejected_call_advances_no_generator():
    """Seeds are drawn (from ``generator`` or torch's) only once the op has checked the call:
    one rejected with ValueError leaves both generators as they were; a valid call then
    draws the seeds it drew before."""
    draft, ids, target = FLASHINFER_EXAMPLE.values()
    bad_ids = torch.tensor([[2, 9]], dtype=torch.int32)  # 9 is outside V = 4
    generator = torch.Generator().manual_seed(1)
    state, default = generator.get_state(), torch.get_rng_state()
    for kwargs in (dict(generator=generator), {}):
        with pytest.raises(ValueError, match="draft_token_ids"):
            flashinfer.chain_speculative_sampling(draft, bad_ids, target, **kwargs)
        with pytest.raises(ValueError, match="offset"):
            flashinfer.chain_speculative_sampling(draft, ids, target, offset=2**64, **kwargs)
    assert torch.equal(generator.get_state(), state), "a rejected call advanced the generator"
    assert torch.equal(torch.get_rng_state(), default), "a rejected call advanced torch's"
    drawn = torch.randint(-2**63, 2**63 - 1, (1,), generator=torch.Generator().manual_seed(1))
    got = flashinfer.chain_speculative_sampling(draft, ids, target, generator=generator)
    want = flashinfer.chain_speculative_sampling(draft, ids, target, seed=drawn)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(generator.get_state(), state)


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
@pytest.mark.parametrize("inputs", ["probs", "logits"])
def test_sglang_documented_example(backend, inputs):
    tree, target_logits = _sglang_example()
    for seed in (0, torch.tensor([5, 6])):
        predicts, accept_index, accept_token_num = outputs = _sglang_outputs(2, 6, 4)
        if inputs == "probs":  # SGLang's call: its coins, its zero-filled draft_probs
            target_probs = torch.softmax(target_logits / 0.01, -1)
            kw = dict(uniform_samples=torch.rand(2, 6), uniform_samples_for_final_sampling=
                      torch.rand(2), target_probs=target_probs,
                      draft_probs=torch.zeros_like(target_probs), threshold_single=1.0,
                      threshold_acc=1.0, deterministic=True)
        else:
            kw = dict(target_logits=target_logits, temperature=torch.tensor([0.01, 0.0]),
                      seed=seed)
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


def test_sglang_tree_conversion_round_trips():
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


def test_sglang_bad_lists_name_the_argument():
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


def test_sglang_bad_input_writes_nothing():
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


def test_sglang_zero_draft_rows_are_deterministic_candidates_and_coins_key_the_stream():
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


def test_sglang_unvalidated_garbage_stays_in_range():
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
        eagle.retrive_next_sibling, target_probs=rows.expand(batch, -1, -1), **kw,
        backend="reference")
    return predicts.view(batch, nodes)[:, 0], root_p


@pytest.mark.parametrize("mode", ["deterministic", "iid", "sglang_call"])
def test_sglang_first_token_law(mode):
    tokens, p = _sglang_law_round(mode, LAW_BATCH, torch.Generator().manual_seed(4))
    assert _law_pvalue(tokens, p) > ALPHA


def test_sglang_law_catches_probs_fed_as_logits(monkeypatch):
    monkeypatch.setattr(sglang, "logits_from_probs", lambda probs, name: probs.float())
    tokens, p = _sglang_law_round("deterministic", LAW_BATCH, torch.Generator().manual_seed(4))
    assert _law_pvalue(tokens, p) < ALPHA, "the chi-square test missed softmax(probs)"


def test_sglang_permuted_batch_permutes_emitted_tokens():
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


# --- vLLM ------------------------------------------------------------------------------------

# --- shared --------------------------------------------------------------------------------

def test_logits_from_probs_cost_and_zeros():
    probs = torch.tensor([[0.5, 0.0, 0.5]], dtype=torch.bfloat16)
    logits = _common.logits_from_probs(probs, "target_probs")
    assert logits.dtype == torch.float32 and logits[0, 1] == float("-inf")
    assert torch.allclose(torch.softmax(logits, -1), probs.float())


@needs_cuda
def test_adapters_on_cuda_tensors():
    """Each adapter on CUDA tensors (the kernels under backend="auto"): the engines' forced
    examples (vLLM's: test_adapter_vllm.py)."""
    cuda = lambda tensors: {k: v.cuda() for k, v in tensors.items()}
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
        **cuda(FLASHINFER_EXAMPLE), seed=torch.tensor([3], device="cuda"))
    assert tokens.is_cuda and tokens.tolist() == [[2, 0, -1]]
    assert accepted.tolist() == emitted.tolist() == [1]

    tree, target_logits = _sglang_example()
    outputs = [t.cuda() for t in _sglang_outputs(2, 6, 4)]
    predicts, accept_index, accept_token_num = outputs
    sglang.tree_speculative_sampling_target_only(
        *outputs, **cuda(tree), target_logits=target_logits.cuda(), temperature=0.01, seed=1)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_token_num.tolist() == [3, 2]
