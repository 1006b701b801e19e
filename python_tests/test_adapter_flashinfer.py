"""FlashInfer adapter (``specdec_kernels.adapters.flashinfer``, flashinfer-python 0.7.4).

* FlashInfer's documented example, and token-for-token equality with a transcription of
  FlashInfer's ``ChainSpeculativeSampling`` kernel where its decisions are forced (one-hot
  targets, FlashInfer's own ``onehot_target`` test case): tokens and both counters.
* Counters as FlashInfer's kernel counts them, added in place.
* The law of the first emitted token: chi-square at false-alarm rate ALPHA = 1e-4 per test,
  power >= 0.99 at total-variation distance 0.02 (asserted); a planted bug (probabilities
  fed as logits without the log) caught. Statistics on the C++ CPU path (backend="auto").
* Seeds and offsets as FlashInfer takes them: None (either) draws both from the generator,
  fresh each call and repeatable from its seed; ints or [1]/[B] tensors; the same seed and
  offset give the same tokens; streams of (s+1, b) and (s, b+1) differ (the old ``seed + b``
  made them equal), with the stride's gap checked by exhaustion.
* Batch size 0; malformed input raises naming the argument, writes nothing, advances no
  generator.
"""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import CHAIN_BACKENDS
from specdec_kernels.adapters import _common, flashinfer
from test_chain_exactness import ALPHA, _chi_square

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAW_BATCH = 40_000  # draws per law test: power >= 0.99 at TV 0.02 for V <= 8

FLASHINFER_EXAMPLE = dict(
    draft_probs=torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]]),
    draft_token_ids=torch.tensor([[2, 1]], dtype=torch.int32),
    target_probs=torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0],
                                [0.7, 0.1, 0.1, 0.1]]]))


def _random_probs(shape, gen, zeros=True):
    probs = torch.rand(shape, generator=gen) ** 2
    if zeros:  # a zero probability is -inf after the log: never emitted
        probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def _random_chain(gen, batch=64, num_drafts=3, vocab=7):
    target = _random_probs((batch, num_drafts + 1, vocab), gen)
    draft = _random_probs((batch, num_drafts, vocab), gen, zeros=False)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts)
    return draft, ids, target


def _law_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=probs.shape[-1])
    if counts[probs == 0].sum() > 0:
        return 0.0
    pvalue, power = _chi_square(counts, probs)
    assert power >= 0.99
    return pvalue


def _flashinfer_kernel_onehot(draft_probs, draft_token_ids, target_probs):
    """A transcription of FlashInfer 0.7.4's ChainSpeculativeSampling for targets whose
    every decision is forced (one-hot rows: ``u * q < p`` holds iff ``p = 1``; the residual
    ``max(target - draft, 0)`` is one-hot at the target's token). Returns the tokens and
    the two counts the kernel adds."""
    batch, num_drafts, _ = draft_probs.shape
    out = torch.full((batch, num_drafts + 1), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        pos = num_drafts
        for i in range(num_drafts):
            token = int(draft_token_ids[b, i])
            if target_probs[b, i, token] == 1:  # u * q < 1 for every u in (0, 1], q < 1
                out[b, i] = token
            else:
                pos = i
                break
        later = sum(1 for i in range(pos + 1, num_drafts)
                    if target_probs[b, i, int(draft_token_ids[b, i])] == 1)
        emitted[b], accepted[b] = pos, pos + later
        residual = (target_probs[b, pos] - (draft_probs[b, pos] if pos < num_drafts else 0)
                    ).clamp(min=0)
        positive = (residual > 0).nonzero()
        out[b, pos] = int(positive[0]) if len(positive) else -1  # last_valid_id: -1
    return out, accepted, emitted


# --- FlashInfer's examples and rule -----------------------------------------------------------

@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_documented_example(backend):
    """FlashInfer's docstring example: draft 1 always accepted (p/q = 2), draft 2 always
    rejected (p = 0), the correction one-hot at token 0 -- with seeds drawn from the
    generator (FlashInfer's call) or given."""
    torch.manual_seed(42)
    for kwargs in ({}, dict(seed=0, offset=0), dict(seed=torch.tensor([7]),
                                                     offset=torch.tensor([3]))):
        tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
            *FLASHINFER_EXAMPLE.values(), backend=backend, **kwargs)
        assert tokens.dtype == accepted.dtype == emitted.dtype == torch.int32
        assert tokens.tolist() == [[2, 0, -1]]
        assert accepted.tolist() == [1] and emitted.tolist() == [1]


def test_onehot_targets_equal_flashinfers_kernel_token_for_token():
    """FlashInfer's test_chain_speculative_sampling(onehot_target=True) setting, and one-hot
    targets that disagree with the drafts: tokens, accepted and emitted counts equal the
    kernel's (every decision is forced), whatever the seed."""
    gen = torch.Generator().manual_seed(21)
    batch, num_drafts, vocab = 48, 5, 11
    draft = _random_probs((batch, num_drafts, vocab), gen, zeros=False)
    ids = torch.randint(vocab, (batch, num_drafts), generator=gen)
    target_ids = torch.randint(vocab, (batch, num_drafts + 1), generator=gen)
    agree = torch.rand(batch, num_drafts, generator=gen) < 0.7
    target_ids[:, :num_drafts] = torch.where(agree, ids, target_ids[:, :num_drafts])
    target = torch.zeros(batch, num_drafts + 1, vocab).scatter_(2, target_ids[..., None], 1.0)
    want = _flashinfer_kernel_onehot(draft, ids, target)
    for kwargs in ({}, dict(seed=5, offset=9), dict(seed=torch.arange(batch), offset=1)):
        got = flashinfer.chain_speculative_sampling(draft, ids, target, **kwargs)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    # FlashInfer's own case: every draft agrees, so the output is the target's tokens.
    target = torch.zeros(batch, num_drafts + 1, vocab)
    target_ids[:, :num_drafts] = ids
    target.scatter_(2, target_ids[..., None], 1.0)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target)
    assert torch.equal(tokens, target_ids.int())
    assert (emitted + 1 == (tokens != -1).sum(1)).all()


def test_row_with_no_mass_emits_minus_one_as_flashinfer():
    """A target row of zeros: its draft is rejected (p = 0) and the token there is -1
    (FlashInfer's sampler finds no positive entry); a bonus row of zeros likewise."""
    draft = torch.full((2, 2, 4), 0.25)
    ids = torch.tensor([[1, 2], [1, 2]])
    target = torch.full((2, 3, 4), 0.25)
    target[0, 1] = 0.0   # request 0: draft 2's row has no mass
    target[1, 2] = 0.0   # request 1: the bonus row has no mass
    target[1, :2] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    target[1, 1] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
        draft, ids, target, seed=3, offset=0)
    # request 0's first draft has p = q: accepted whatever the uniform in [0, 1)
    assert tokens.tolist() == [[1, -1, -1], [1, 2, -1]]
    assert emitted.tolist() == [1, 2] and accepted.tolist() == [1, 2]


def test_counters_add_in_place():
    """Counters are added to in place (int32 or int64) and returned as the same tensors;
    the accepted count goes on past the first rejection (FlashInfer's alignment metric),
    the rejected position itself not counted."""
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
                draft, ids, target, accepted, emitted, seed=torch.tensor([step]),
                offset=torch.tensor([0]))
            assert got_accepted is accepted and got_emitted is emitted
            assert tokens.tolist() == [[1, -1, -1, -1]]
        assert accepted.tolist() == [14] and emitted.tolist() == [5]


def test_counts_match_the_definition():
    """Random rows: emitted == verify_chain's num_accepted on log(target_probs); accepted ==
    emitted + the drafts after the first rejected one whose own uniform passes u * q < p."""
    gen = torch.Generator().manual_seed(3)
    draft, ids, target = _random_chain(gen, batch=400, num_drafts=3, vocab=6)
    seeds = torch.randint(0, 2**62, (400,), generator=gen)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target,
                                                                       seed=seeds, offset=3)
    ours = sk.verify_chain(torch.log(target), ids, draft_probs=draft, seed=seeds, offset=3)
    assert torch.equal(tokens, ours.output_token_ids) and torch.equal(emitted, ours.num_accepted)
    u = torch.stack([sk._rng.uniform(seeds, torch.full_like(seeds, 3), j + 1,
                                     sk._rng.PURPOSE_ACCEPT) for j in range(3)], 1)
    p = target[:, :3].gather(-1, ids[..., None])[..., 0]
    q = draft.gather(-1, ids[..., None])[..., 0]
    later = torch.arange(3) > emitted[:, None]
    assert torch.equal(accepted, emitted + (later & (u * q < p)).sum(1).int())
    assert bool((accepted > emitted).any()) and bool((accepted == emitted).any())


# --- laws ------------------------------------------------------------------------------------

def _law_round(batch: int, gen: torch.Generator):
    vocab, num_drafts = 6, 2
    target = _random_probs((num_drafts + 1, vocab), gen)
    draft = _random_probs((num_drafts, vocab), gen, zeros=False)
    ids = torch.multinomial(draft, batch, replacement=True, generator=gen).T
    tokens, _, _ = flashinfer.chain_speculative_sampling(
        draft.expand(batch, -1, -1), ids, target.expand(batch, -1, -1), seed=17, offset=11)
    return tokens[:, 0], target[0]


def test_first_token_law():
    tokens, p = _law_round(LAW_BATCH, torch.Generator().manual_seed(5))
    assert _law_pvalue(tokens, p) > ALPHA


def test_law_catches_probs_fed_as_logits(monkeypatch):
    monkeypatch.setattr(flashinfer, "logits_from_probs", lambda probs, name: probs.float())
    tokens, p = _law_round(LAW_BATCH, torch.Generator().manual_seed(5))
    assert _law_pvalue(tokens, p) < ALPHA, "the chi-square test missed softmax(probs)"


# --- seeds and offsets -----------------------------------------------------------------------

def test_same_seed_and_offset_same_tokens_and_conventions():
    gen = torch.Generator().manual_seed(8)
    draft, ids, target = args = _random_chain(gen)
    batch = ids.shape[0]
    run = lambda **kw: flashinfer.chain_speculative_sampling(*args, **kw)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    assert same(run(seed=3, offset=4), run(seed=3, offset=4))
    assert not same(run(seed=3, offset=4), run(seed=3, offset=5))
    # A [1] tensor is the batch's seed, like the int; uint64 tensors are the same bits.
    assert same(run(seed=3, offset=4), run(seed=torch.tensor([3]), offset=torch.tensor([4])))
    assert same(run(seed=2**64 - 5, offset=4),
                run(seed=torch.tensor([-5]).view(torch.uint64), offset=torch.tensor([4])))
    assert same(run(seed=3, offset=4), run(seed=3, offset=torch.full((batch,), 4)))
    # A [B] tensor is each request's own seed: a permuted batch permutes the outputs.
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen)
    base = run(seed=seeds, offset=seeds // 3)
    perm = torch.randperm(batch, generator=gen)
    permuted = flashinfer.chain_speculative_sampling(*(a[perm] for a in args), seed=seeds[perm],
                                                     offset=seeds[perm] // 3)
    for got, want in zip(permuted, base):
        assert torch.equal(got, want[perm])


def test_rows_and_steps_never_share_a_stream():
    """Identical rows: with the old ``seed + b``, row b+1 of seed s equalled row b of seed
    s+1. Now the rows' seeds are s + b * stride, and no two rows within 2**20 of each other
    have seeds closer than 2**43 (by exhaustion), so step-counter seeds never collide."""
    gen = torch.Generator().manual_seed(12)
    batch, num_drafts, vocab = 64, 4, 50
    target = _random_probs((num_drafts + 1, vocab), gen, zeros=False).expand(batch, -1, -1)
    draft = _random_probs((num_drafts, vocab), gen, zeros=False).expand(batch, -1, -1)
    ids = torch.multinomial(draft[0], 1, generator=gen).T.expand(batch, -1)
    one = flashinfer.chain_speculative_sampling(draft, ids, target, seed=100, offset=0)[0]
    two = flashinfer.chain_speculative_sampling(draft, ids, target, seed=101, offset=0)[0]
    assert not torch.equal(one[1:], two[:-1])
    assert len({tuple(row) for row in one.tolist()}) > 8  # rows are distinct streams
    seeds = _common.row_seeds(100, batch, torch.device("cpu"))
    assert not set(seeds[1:].tolist()) & set(_common.row_seeds(101, batch,
                                                                torch.device("cpu")).tolist())
    rows = torch.arange(1, 2 ** _common.ROW_SEED_MAX_ROWS_LOG2, dtype=torch.int64)
    gaps = rows * _common.ROW_SEED_STRIDE  # wraps like the int64 seeds
    gaps = torch.minimum(gaps.abs(), (gaps + 1).neg().abs() + 1)  # |x| without -2**63 overflow
    assert int(gaps.min()) >= 2 ** _common.ROW_SEED_MIN_GAP_LOG2


def test_none_draws_both_from_the_generator_fresh_each_call():
    """seed or offset None: both drawn from the generator (FlashInfer's rule), so a seed
    without an offset is not used; each call draws fresh streams, repeatable from the
    generator's seed, and advances it."""
    gen = torch.Generator().manual_seed(9)
    args = _random_chain(gen, batch=32, num_drafts=3, vocab=40)
    run = lambda **kw: flashinfer.chain_speculative_sampling(*args, **kw)[0]
    g = torch.Generator().manual_seed(1)
    first, second = run(generator=g), run(generator=g)
    assert not torch.equal(first, second)
    assert torch.equal(first, run(generator=torch.Generator().manual_seed(1)))
    assert torch.equal(first, run(generator=torch.Generator().manual_seed(1), seed=5))
    assert torch.equal(first, run(generator=torch.Generator().manual_seed(1), offset=5))
    torch.manual_seed(4)
    default = run()
    torch.manual_seed(4)
    assert torch.equal(default, run(seed=123)) and not torch.equal(default, run())


def test_philox_generator_is_read_as_flashinfers_get_seed_and_offset():
    """On a Philox (CUDA) generator, FlashInfer's ``get_seed_and_offset``: the state's seed
    and offset, the offset advanced by B * (K + 2) rounded up to 4."""
    class PhiloxState:  # a CUDA generator's 16-byte state, without a GPU
        def __init__(self):
            self.state = torch.tensor([1234, 40], dtype=torch.int64).view(torch.uint8)

        def get_state(self):
            return self.state.clone()

        def set_state(self, state):
            self.state = state.clone()

    generator = PhiloxState()
    assert flashinfer._seed_and_offset_from_generator(generator, 3, 2) == (1234, 40)
    assert generator.state.view(torch.int64).tolist() == [1234, 40 + 12]
    assert flashinfer._seed_and_offset_from_generator(generator, 5, 1) == (1234, 52)
    assert generator.state.view(torch.int64).tolist() == [1234, 52 + 16]


# --- edges and bad input ---------------------------------------------------------------------

def test_batch_size_zero():
    for kwargs in ({}, dict(seed=1, offset=2), dict(seed=torch.zeros(0, dtype=torch.int64),
                                                     offset=torch.zeros(0, dtype=torch.int64))):
        tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
            torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 4, 5),
            **kwargs)
        assert tokens.shape == (0, 4) and accepted.shape == emitted.shape == (0,)


def test_bad_input_names_the_argument_and_writes_nothing():
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
        (dict(seed=torch.tensor([1.5])), ValueError, "seed"),
        (dict(seed=torch.tensor([1, 2])), ValueError, "seed"),
        (dict(offset=torch.tensor([[1]])), ValueError, "offset"),
        (dict(seed="7"), TypeError, "seed"),
        (dict(offset=2**64), ValueError, "offset"),
        (dict(validate="no"), TypeError, "validate"),
        # V = 0: named by the arguments given, not the op's target_logits (issue 47 item 6)
        (dict(draft_probs=draft[..., :0], target_probs=target[..., :0]), ValueError,
         "^target_probs, draft_probs: expected V >= 1"),
    ]
    for change, error, name in cases:
        kwargs = dict(draft_probs=draft, draft_token_ids=ids, target_probs=target,
                      maybe_output_accepted_token_num=accepted,
                      maybe_output_emitted_draft_token_num=emitted, seed=0, offset=0)
        kwargs.update(change)
        with pytest.raises(error, match=name):
            flashinfer.chain_speculative_sampling(**kwargs)
        assert accepted.tolist() == [3] and emitted.tolist() == [4], "a rejected call wrote"


def test_rejected_call_advances_no_generator():
    """Seeds drawn from ``generator`` (or torch's) by a call that is then rejected are put
    back: both generators as they were; a valid call then draws what it would have."""
    draft, ids, target = FLASHINFER_EXAMPLE.values()
    bad_ids = torch.tensor([[2, 9]], dtype=torch.int32)  # 9 is outside V = 4
    generator = torch.Generator().manual_seed(1)
    state, default = generator.get_state(), torch.get_rng_state()
    for kwargs in (dict(generator=generator), {}):
        with pytest.raises(ValueError, match="draft_token_ids"):
            flashinfer.chain_speculative_sampling(draft, bad_ids, target, **kwargs)
        with pytest.raises(ValueError, match="draft_token_ids"):
            flashinfer.chain_speculative_sampling(draft, bad_ids, target, seed=3, **kwargs)
    assert torch.equal(generator.get_state(), state), "a rejected call advanced the generator"
    assert torch.equal(torch.get_rng_state(), default), "a rejected call advanced torch's"
    words = torch.randint(-2**63, 2**63 - 1, (2,), generator=torch.Generator().manual_seed(1))
    got = flashinfer.chain_speculative_sampling(draft, ids, target, generator=generator)
    want = flashinfer.chain_speculative_sampling(draft, ids, target, seed=int(words[0]),
                                                 offset=int(words[1]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(generator.get_state(), state)


def test_default_path_reads_no_values_off_cpu(monkeypatch):
    """validate=None runs the value checks on CPU tensors only: on another device (here
    faked by the helper's answer) verify_chain gets validate=False."""
    seen = {}
    real = flashinfer.verify_chain

    def spy(*args, **kwargs):
        seen["validate"] = kwargs["validate"]
        return real(*args, **kwargs)

    monkeypatch.setattr(flashinfer, "verify_chain", spy)
    flashinfer.chain_speculative_sampling(*FLASHINFER_EXAMPLE.values(), seed=1, offset=1)
    assert seen["validate"] is True
    monkeypatch.setattr(flashinfer, "value_checks_wanted", lambda validate, device: False)
    flashinfer.chain_speculative_sampling(*FLASHINFER_EXAMPLE.values(), seed=1, offset=1)
    assert seen["validate"] is False


@needs_cuda
def test_on_cuda_tensors():
    cuda = {k: v.cuda() for k, v in FLASHINFER_EXAMPLE.items()}
    for kwargs in ({}, dict(seed=torch.tensor([3], device="cuda"),
                            offset=torch.tensor([0], device="cuda"))):
        tokens, accepted, emitted = flashinfer.chain_speculative_sampling(**cuda, **kwargs)
        assert tokens.is_cuda and tokens.tolist() == [[2, 0, -1]]
        assert accepted.tolist() == emitted.tolist() == [1]
    generator = torch.Generator("cuda").manual_seed(5)
    offset = generator.get_offset()
    flashinfer.chain_speculative_sampling(**cuda, generator=generator)
    assert generator.get_offset() == offset + 4  # B * (K + 2) = 4, rounded up to 4
