"""Failure classes found in other speculative-decoding implementations, one test each, named
after what it guards against (the peer's report in the comment)."""
import math
import os
import tempfile

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _rng
from specdec_kernels.reference import chain as reference_chain

from conftest import CHAIN_BACKENDS, EXTENSION_BACKENDS, SAMPLE_BACKENDS


# FlashInfer #879: -1 draft ids (padding) were read as token ids.
@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
@pytest.mark.parametrize("validate", [True, False])
def test_minus_one_draft_id_is_never_read(backend, validate):
    gen = torch.Generator().manual_seed(879)
    batch, k, vocab = 4, 3, 11
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    n = torch.tensor([0, 1, 2, 3])
    live = torch.arange(k) < n[:, None]
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    args = dict(num_draft_tokens=n, seed=torch.arange(batch), backend=backend, validate=validate)
    padded = sk.verify_chain(logits, torch.where(live, drafts, -1),
                             draft_probs=torch.where(live[..., None], q, math.nan), **args)
    other = sk.verify_chain(logits, torch.where(live, drafts, 0), draft_probs=q, **args)
    assert torch.equal(padded.output_token_ids, other.output_token_ids)
    assert torch.equal(padded.num_accepted, other.num_accepted)
    assert bool((padded.num_accepted <= n).all())


# FlashInfer read seed[0] for every request: per-request seeds are honoured, and a request's
# tokens do not depend on its batch neighbours (batch invariance).
@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_per_request_seeds_honoured_and_batch_invariant(backend):
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 6, 2, 16
    logits = torch.randn(1, k + 1, vocab, generator=gen).expand(batch, k + 1, vocab)
    drafts = torch.randint(0, vocab, (1, k), generator=gen).expand(batch, k)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])
    together = sk.verify_chain(logits, drafts, seed=seeds, backend=backend).output_token_ids
    for b in range(batch):
        alone = sk.verify_chain(logits[b:b + 1], drafts[b:b + 1], seed=seeds[b:b + 1],
                                backend=backend).output_token_ids
        assert torch.equal(together[b:b + 1], alone)
    # Identical requests with distinct seeds: not all the same tokens (seed[0] for all would).
    assert len({tuple(row) for row in together.tolist()}) > 1
    neighbours = seeds.clone()
    neighbours[1:] += 100
    assert torch.equal(sk.verify_chain(logits, drafts, seed=neighbours,
                                       backend=backend).output_token_ids[0], together[0])


# vLLM #45060, #53029: an all-NaN row of logits produced a token.
@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_all_nan_row_never_becomes_a_token(backend):
    vocab = 9
    logits = torch.randn(4, vocab)
    logits[1] = math.nan
    logits[3, ::2] = math.nan
    logits[3, 1::2] = -math.inf
    for temperature in (0.0, 1.0):
        tokens = sk.sample(logits, temperature=temperature, seed=3, backend=backend)
        assert tokens[1] == -1 and tokens[3] == -1 and bool((tokens[[0, 2]] >= 0).all())
    target = torch.randn(3, 3, vocab)
    target[0, 0] = math.nan      # the first draft's row: nothing accepted, no token
    target[1, 2] = math.nan      # the bonus row
    target[2] = math.nan
    drafts = torch.tensor([[1, 2]] * 3)
    backend = "triton" if backend == "triton" else "reference"
    for temperature in (0.0, 1.0):
        out = sk.verify_chain(target, drafts, draft_probs=torch.full((3, 2, vocab), 1 / vocab),
                              temperature=temperature, seed=5, backend=backend)
        ids, accepted = out.output_token_ids, out.num_accepted
        for b in range(3):
            row = int(accepted[b])
            if bool(target[b, row].isnan().all()):
                assert ids[b, row] == -1, (temperature, b, ids)
        assert accepted[0] == 0 and accepted[2] == 0


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# chi2 with 3 degrees of freedom: P(chi2 > 21.11) = 1e-4, the false-alarm rate (alpha).
CHI2_CRITICAL_3DOF = 21.11
P_TARGET = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q_DRAFT = torch.tensor([0.4, 0.3, 0.2, 0.1])
TRIALS = 20000  # planted reuse of the draft noise: chi2 ~ 120 here (power ~ 1)


def _one_draft_round(monkeypatch=None):
    """TRIALS independent rounds of drafter + verifier with one draft and the same (seed,
    offset): the drafter samples with sk.sample (the sample stream), the verifier keys its
    acceptance uniform and its recovery noise on the same seed and offset."""
    seeds = torch.arange(TRIALS)
    draft_logits = Q_DRAFT.log().expand(TRIALS, 4)
    drafts = sk.sample(draft_logits, seed=seeds, offset=7, backend="reference")
    target = P_TARGET.log().expand(TRIALS, 2, 4)
    out = sk.verify_chain(target, drafts[:, None], draft_logits=draft_logits[:, None],
                          seed=seeds, offset=7, backend="reference")
    return drafts, out


# vLLM #54282 and vllm-ascend #16370: the draft's noise reused for the recovery sample, the
# acceptance uniform reused for resampling. Each draws from its own Philox purpose, and the
# first emitted token has the target law (alpha 1e-4); both planted reuses fail that test.
def test_draft_noise_never_reused_for_recovery_and_acceptance_uniform_never_for_resampling(
        monkeypatch):
    seeds = torch.arange(10000)
    words = {purpose: _rng.random_words(seeds, torch.tensor(7), 0, purpose)
             for purpose in (_rng.PURPOSE_ACCEPT, _rng.PURPOSE_RESAMPLE, _rng.PURPOSE_SAMPLE)}
    for a in words:
        for b in words:
            if a < b:  # distinct streams: equal words at most by 2**-32 chance per seed
                assert int((words[a] == words[b]).sum()) <= 1

    drafts, out = _one_draft_round()
    assert _chi_square(out.output_token_ids[:, 0], P_TARGET) < CHI2_CRITICAL_3DOF

    # Planted bug 1: the recovery sample drawn with the drafter's noise (its purpose).
    monkeypatch.setattr(_rng, "PURPOSE_RESAMPLE", _rng.PURPOSE_SAMPLE)
    _, reused = _one_draft_round()
    assert _chi_square(reused.output_token_ids[:, 0], P_TARGET) > CHI2_CRITICAL_3DOF
    monkeypatch.undo()

    # Planted bug 2: the residual sampled by inverse CDF with the acceptance uniform itself
    # (the uniform is conditioned on the rejection, so the residual is sampled wrong).
    u = _rng.uniform(torch.arange(TRIALS), torch.tensor(7), 1, _rng.PURPOSE_ACCEPT)
    p_d, q_d = P_TARGET[drafts.long()], Q_DRAFT[drafts.long()]
    accepted = u * q_d < p_d
    residual = (P_TARGET - Q_DRAFT).clamp(min=0)
    cdf = (residual / residual.sum()).cumsum(0)
    recovery = torch.searchsorted(cdf, u.double().clamp(max=1 - 1e-9).float())
    first = torch.where(accepted, drafts.long(), recovery)
    planted = _chi_square(first, P_TARGET)
    assert planted > CHI2_CRITICAL_3DOF, planted


# vllm-ascend #13730: with u = 0 every draft was accepted (u * q <= p). Our uniforms are never
# 0 (u >= 2**-33, test_rng_tails.py), and the rule is strict anyway: a draft the target gives
# probability 0 is rejected even with u forced to 0.
@pytest.mark.parametrize("greedy", [False, True])
def test_zero_uniform_never_accepts_everything(monkeypatch, greedy):
    vocab = 5
    logits = torch.zeros(2, 3, vocab)
    logits[:, 1, 3] = -math.inf          # the second draft (token 3) has p = 0
    drafts = torch.tensor([[2, 3], [2, 3]])
    monkeypatch.setattr(_rng, "uniform", lambda *args, **kwargs: torch.zeros(2, 2))
    out = sk.verify_chain(logits, drafts, temperature=0.0 if greedy else 1.0, seed=0,
                          backend="reference")
    assert out.num_accepted.tolist() == ([0, 0] if greedy else [1, 1])
    assert bool((out.output_token_ids[:, 1] != 3).all())
    p = sk.processed_probs(logits.view(-1, vocab)).view(2, 3, vocab)
    accepted, _ = reference_chain.chain_outcome(
        p, None, drafts, torch.ones(2, 2, dtype=torch.bool), torch.tensor([False, False]),
        torch.zeros(2, 2))
    assert accepted.tolist() == [1, 1]  # u = 0 accepts draft 1 (p > 0), never draft 2


def _past_int32_logits(rows_total: int, vocab: int, keep: list[int], rows_per_request: int):
    """A [len(keep) // rows_per_request, rows_per_request, V] fp16 view whose rows sit at row
    ``keep[i]`` of a [rows_total, V] buffer: a sparse file mapped privately, so only the kept
    rows take memory (the rest reads as zeros, never touched)."""
    handle = tempfile.NamedTemporaryFile(prefix="specdec-int64-", delete=False)
    handle.truncate(rows_total * vocab * 2)
    handle.close()
    try:
        storage = torch.from_file(handle.name, shared=False, size=rows_total * vocab,
                                  dtype=torch.float16)
    finally:
        os.unlink(handle.name)  # the mapping stays valid
    gen = torch.Generator().manual_seed(31)
    for row in keep:
        storage[row * vocab:(row + 1) * vocab] = (torch.randn(vocab, generator=gen) * 3).half()
    first = keep[0]
    stride_request = (keep[rows_per_request] - first) * vocab
    return storage.as_strided((len(keep) // rows_per_request, rows_per_request, vocab),
                              (stride_request, vocab, 1), storage_offset=first * vocab)


# vLLM's block-verification kernels computed row offsets in int32: rows x V past 2**31
# elements (V = 155,000, 14,000 rows) read the wrong row. Two requests, the second past 2**31
# elements from the first (a view over a sparse mapping: no 4 GB allocation).
@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_row_offsets_in_int64_past_2_31_elements(backend):
    vocab, rows_total = 155_000, 14_000
    assert rows_total * vocab > 2**31
    logits = _past_int32_logits(rows_total, vocab, [0, 1, 13_998, 13_999], rows_per_request=2)
    assert logits.stride(0) * logits.shape[0] > 2**31
    drafts = logits[:, 0].float().argmax(-1, keepdim=True)  # greedy accepts it
    out = sk.verify_chain(logits, drafts, temperature=0.0, backend=backend)
    dense = sk.verify_chain(logits.contiguous(), drafts, temperature=0.0, backend="reference")
    assert torch.equal(out.output_token_ids, dense.output_token_ids)
    assert out.num_accepted.tolist() == [1, 1]
    sampled = sk.verify_chain(logits, drafts, seed=torch.tensor([1, 2]), backend=backend)
    assert torch.equal(sampled.output_token_ids,
                       sk.verify_chain(logits.contiguous(), drafts, seed=torch.tensor([1, 2]),
                                       backend="reference").output_token_ids)


# A tree builder that reads past its request (the next request's parents, or its own padding)
# builds a different tree: request b's outputs depend only on its real nodes.
@pytest.mark.parametrize("backend", EXTENSION_BACKENDS)
def test_tree_builder_never_reads_past_its_request(backend):
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 2, 3, 4], [-1, 0, 1, 1, 0, 2]])
    num_nodes = torch.tensor([4, 6, 3])
    out = sk.build_tree_attention(parents, num_nodes=num_nodes, prefix_lens=5, backend=backend)
    garbage = parents.clone()
    garbage[0, 4:] = torch.tensor([2**31 - 1, -7])  # request 0's padding
    garbage[2, 3:] = torch.tensor([5, 4, 100])
    noisy = sk.build_tree_attention(garbage, num_nodes=num_nodes, prefix_lens=5,
                                    backend=backend)
    for b in range(3):
        alone = sk.build_tree_attention(parents[b:b + 1, :int(num_nodes[b])], prefix_lens=5,
                                        backend=backend)
        real = int(num_nodes[b])
        for got, one, want in zip(out, noisy, alone):
            assert torch.equal(got[b], one[b])
        assert torch.equal(out.mask[b, :real, :real], alone.mask[0])
        assert torch.equal(out.depth[b, :real], alone.depth[0])
        assert torch.equal(out.position_ids[b, :real], alone.position_ids[0])


# KV rollback must never shrink a request below its committed history: positions below
# kv_lens (and the root at kv_lens) are never written, and new lengths are >= kv_lens + 1,
# also for unvalidated garbage counts.
@pytest.mark.parametrize("backend", EXTENSION_BACKENDS)
def test_kv_rollback_never_shrinks_below_committed_history(backend):
    gen = torch.Generator().manual_seed(13730)
    batch, seq_len, nodes = 4, 16, 5
    cache = torch.randn(batch, seq_len, 2, 3, generator=gen)
    before = cache.clone()
    kv_lens = torch.tensor([0, 3, 7, 10])
    paths = torch.tensor([[0, 2, 3, 4, -1], [0, 1, 4, -1, -1], [0, 3, -1, -1, -1],
                          [0, -1, -1, -1, -1]])
    counts = torch.tensor([3, 2, 1, 0])
    new = sk.compact_kv_cache([cache], kv_lens, paths, counts, backend=backend)
    assert new.tolist() == (kv_lens + counts + 1).tolist()
    for b in range(batch):
        assert torch.equal(cache[b, :kv_lens[b] + 1], before[b, :kv_lens[b] + 1])
    garbage_counts = torch.tensor([-5, -2**31, 2**40, -1])
    cache.copy_(before)
    new = sk.compact_kv_cache([cache], kv_lens, paths, garbage_counts, backend=backend,
                              validate=False)
    assert bool((new >= kv_lens + 1).all())
    for b in range(batch):
        assert torch.equal(cache[b, :kv_lens[b] + 1], before[b, :kv_lens[b] + 1])
