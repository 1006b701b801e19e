"""Tail exactness of the random numbers (contract section 11), on every backend.

Regression tests at the two streams where the old 24-bit uniforms failed (the Philox words are
unchanged, only their conversion to numbers changed), and a statistical test over 2**26
(seed, offset) pairs of the reference's acceptance predicate and race on the streams' words,
with the old conversion as the planted bug.
"""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _rng
from specdec_kernels.reference import sampling as ref_sampling
from specdec_kernels.reference.chain import chain_outcome

from conftest import CHAIN_BACKENDS, SAMPLE_BACKENDS, _triton_param

TREE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.tree")]

# Seed 0: the acceptance word of draft 1 at this offset is 202, the old u = (202 >> 8) * 2**-24
# = 0; the sample() noise word of token 2 at the other offset is 5, the old noise -log(1 - 0)
# = -0.0 (found by searching the streams for words below 256).
ACCEPT_ZERO_OFFSET = 36667345
SAMPLE_ZERO_OFFSET = 442010
ZERO_TOKEN = 2


def _old_uniform(word: torch.Tensor) -> torch.Tensor:
    """The old conversion (the planted bug): 24 bits, u == 0 for the 256 words below 2**8."""
    return (word >> 8).to(torch.float32) * 2.0 ** -24


def _old_noise(word: torch.Tensor) -> torch.Tensor:
    return -torch.log(1.0 - _old_uniform(word))  # -0.0 for u == 0: w / -0.0 = -inf


@pytest.fixture
def old_conversion(monkeypatch):
    monkeypatch.setattr(_rng, "word_uniform", _old_uniform)
    monkeypatch.setattr(_rng, "word_noise", _old_noise)


def _forbidden_draft():
    """One-hot draft of token 3, whose target logit is -69 (p = 1.5e-31 / 7) at the offset
    where the old acceptance uniform was 0."""
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 3] = -69.0
    return logits, torch.tensor([[3]])


def test_counterexample_words_are_where_the_old_conversion_failed():
    word = _rng.random_words(torch.tensor(0), torch.tensor(ACCEPT_ZERO_OFFSET), 1,
                             _rng.PURPOSE_ACCEPT)
    assert int(word) >> 8 == 0 and int(word) != 0
    assert float(_rng.word_uniform(word)) == int(word) * 2.0 ** -32
    words = _rng.token_words(torch.tensor(0), torch.tensor(SAMPLE_ZERO_OFFSET), 0,
                             _rng.PURPOSE_SAMPLE, 8)
    assert int(words[ZERO_TOKEN]) >> 8 == 0 and torch.signbit(_old_noise(words[ZERO_TOKEN]))
    assert float(_rng.word_noise(words[ZERO_TOKEN])) > 0


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_forbidden_draft_is_rejected_where_the_old_uniform_was_zero(backend):
    logits, drafts = _forbidden_draft()
    out = sk.verify_chain(logits, drafts, seed=0, offset=ACCEPT_ZERO_OFFSET, backend=backend)
    assert int(out.num_accepted[0]) == 0 and int(out.output_token_ids[0, 0]) != 3


@pytest.mark.parametrize("backend", TREE_BACKENDS)
def test_forbidden_tree_draft_is_rejected_where_the_old_uniform_was_zero(backend):
    """The chain-shaped tree of the same draft (node 1) uses the same acceptance uniform."""
    logits, drafts = _forbidden_draft()
    out = sk.verify_tree(logits, torch.tensor([[-1, 3]]), torch.tensor([[-1, 0]]), seed=0,
                         offset=ACCEPT_ZERO_OFFSET, backend=backend)
    assert int(out.num_accepted[0]) == 0 and int(out.output_token_ids[0, 0]) != 3


def test_planted_old_uniform_accepts_the_forbidden_draft(old_conversion):
    logits, drafts = _forbidden_draft()
    out = sk.verify_chain(logits, drafts, seed=0, offset=ACCEPT_ZERO_OFFSET, backend="reference")
    assert int(out.num_accepted[0]) == 1
    tree = sk.verify_tree(logits, torch.tensor([[-1, 3]]), torch.tensor([[-1, 0]]), seed=0,
                          offset=ACCEPT_ZERO_OFFSET, backend="reference")
    assert int(tree.num_accepted[0]) == 1


def _race_rows():
    """Token 2 (the one with the old -0.0 noise) of probability 1 - 7e-12 among 1e-12's, and
    a uniform row, where its noise word 5 (E = 1.2e-9) makes it the winner too."""
    dominant = torch.full((8,), -27.6)
    dominant[ZERO_TOKEN] = 0.0
    return torch.stack([dominant, torch.zeros(8)])


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_token_with_the_old_minus_zero_noise_still_wins(backend):
    tokens = sk.sample(_race_rows(), seed=0, offset=SAMPLE_ZERO_OFFSET, backend=backend)
    assert tokens.tolist() == [ZERO_TOKEN, ZERO_TOKEN]


def test_planted_old_noise_drops_the_token(old_conversion):
    tokens = sk.sample(_race_rows(), seed=0, offset=SAMPLE_ZERO_OFFSET, backend="reference")
    assert (tokens != ZERO_TOKEN).all()


CHUNK = 1 << 18  # 2 MB per int64 tensor: cache-friendly, no page faults per chunk
TRIALS = 1 << 26
CONVERSIONS = {"new": (_rng.word_uniform, _rng.word_noise),
               "old 24-bit (planted bug)": (_old_uniform, _old_noise)}


def _streams():
    """2**26 (seed, offset) pairs: seeds 0..255, offsets 0..2**18 - 1 (one key per chunk, so
    the vectorised Philox adds no per-element key)."""
    offsets = torch.arange(CHUNK)
    for seed in range(TRIALS // CHUNK):
        yield torch.tensor(seed), offsets


def test_tail_events_are_at_most_2_to_the_minus_32_per_trial():
    """Over 2**26 streams: (a) a one-hot draft with p/q = 2**-40 is accepted at most once, by
    the reference's acceptance predicate (``chain_outcome``) on the stream's acceptance uniform
    of draft 1; (b) a token of probability 1e-12 beats one of 1 - 1e-12 (float32: 1.0) at most
    once, by the reference's race score on the stream's ``sample()`` noise of tokens 0 and 1.

    The contract allows each event with probability at most 2**-32 per trial: the count is then
    at most Binomial(2**26, 2**-32), about Poisson(2**-6), so "at most once" fails with
    probability alpha <= 2**-13 (1.2e-4) over the choice of seeds. (Ours make both events
    impossible: u >= 2**-33 and E in [2**-33, 24 ln 2].) The 24-bit uniforms make each event
    probability 2**-24 (u == 0 for 256 words: the draft accepted; the 1 - 1e-12 token's noise
    -0.0, score -inf): Poisson(4), caught with power 1 - 5 e**-4 = 0.91 -- the planted bug, the
    old conversion run on the same words, is caught here. Evaluated on the words in chunks of
    2**18 on one thread (a second thread mostly waits on a shared machine): 2 * 2**26 Philox
    evaluations, about 20 s of CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accepted, emitted = _count_tail_events()
    finally:
        torch.set_num_threads(threads)
    print(f"over {TRIALS} streams: p/q = 2**-40 accepted {accepted}, "
          f"1e-12 beating 1 - 1e-12 {emitted}")
    assert accepted["new"] <= 1 and emitted["new"] <= 1
    assert accepted["old 24-bit (planted bug)"] >= 2 and emitted["old 24-bit (planted bug)"] >= 2


def _count_tail_events():
    """Per conversion: how many of the streams accept the p/q = 2**-40 draft, and how many
    emit the 1e-12 token."""
    p = torch.tensor([[1 - 2.0 ** -40, 2.0 ** -40], [0.5, 0.5]]).expand(CHUNK, 2, 2)
    drafts = torch.ones(CHUNK, 1, dtype=torch.int64)  # p(1) / q(1) = 2**-40 / 1
    valid = torch.ones(CHUNK, 1, dtype=torch.bool)
    greedy = torch.zeros(CHUNK, dtype=torch.bool)
    weights = torch.tensor([1e-12, 1 - 1e-12]).expand(CHUNK, 2)
    accepted = dict.fromkeys(CONVERSIONS, 0)
    emitted = dict.fromkeys(CONVERSIONS, 0)
    for seed, offsets in _streams():
        accept_words = _rng.random_words(seed, offsets, 1, _rng.PURPOSE_ACCEPT)
        noise_words = _rng.token_words(seed, offsets[:, None], 0, _rng.PURPOSE_SAMPLE, 2)
        for name, (to_uniform, to_noise) in CONVERSIONS.items():
            num_accepted, _ = chain_outcome(p, None, drafts, valid, greedy,
                                            to_uniform(accept_words)[:, None])
            accepted[name] += int(num_accepted.sum())
            winner = ref_sampling._race_scores(weights, to_noise(noise_words))
            emitted[name] += int((winner == 0).sum())
    return accepted, emitted
