"""vLLM 0.33.0's V1 rejection sampler through ``specdec_kernels.adapters.vllm`` (no vLLM needed:
its types are mirrored by attribute name, as the adapter reads them).

* vLLM's constructor, ``forward`` and ``parse_output`` call shapes and types; the bonus token
  from the given ``Sampler`` (default) or fused; ``-1`` drafts; malformed metadata (a
  ValueError/TypeError naming the field, nothing written, no generator advanced).
* Greedy token-for-token equality with vLLM's rule (accept while the draft is the arg-max of
  its processed row) with penalties, bad words, ``allowed_token_ids``, ``logit_bias`` and
  ``min_tokens`` on the draft rows with vLLM's draft-aware history, against an independent
  float64 definition of those features.
* Laws: chi-square (false-alarm rate ALPHA = 1e-4 per test, power >= 0.99 at total-variation
  distance 0.02, asserted) of the token emitted at draft row 2, whose history includes draft 1,
  for a penalised / logit-biased / allowed-ids / bad-words request, on the C++ CPU path; a
  planted bug (the history without the drafts, vLLM's sampler's rule for a bonus row) caught.
* ``LogprobsTensors`` against ``log_softmax`` of the row each token was emitted at (raw and
  processed modes); the adapter's own code makes no host synchronisation.
"""
from __future__ import annotations

import math
import types

import pytest
import torch

import specdec_kernels as sk
from conftest import CHAIN_BACKENDS
from specdec_kernels.adapters import vllm
from test_chain_exactness import ALPHA, _chi_square
from test_dropin import bitmask_of, oracle_probs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAW_BATCH = 40_000  # draws per law test: power >= 0.998 at TV 0.02 for V <= 8


def _random_probs(shape, gen, zeros=True):
    probs = torch.rand(shape, generator=gen) ** 2
    if zeros:
        probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def _law_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=probs.shape[-1])
    if counts[probs == 0].sum() > 0:
        return 0.0
    pvalue, power = _chi_square(counts, probs)
    assert power >= 0.99
    return pvalue


# vLLM's own example (the comment of gpu_model_runner._calc_spec_decode_metadata).
VLLM_NUM_DRAFTS = [3, 0, 2, 0, 1]


def _vllm_problem(num_drafts, vocab=11, seed=0, with_probs=True):
    gen = torch.Generator().manual_seed(seed)
    drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in num_drafts]
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(drafts)
    total = sum(num_drafts)
    logits = torch.randn(total + len(num_drafts), vocab, generator=gen) * 2
    draft_probs = _random_probs((total, vocab), gen, zeros=False) if with_probs else None
    return metadata, logits, draft_probs


def _padded(metadata, logits, draft_probs):
    """The padded [B, K+1, V] equivalent, built row by row from vLLM's own indices."""
    batch, num_drafts = len(metadata.num_draft_tokens), metadata.max_spec_len
    vocab = logits.shape[-1]
    target = torch.zeros(batch, num_drafts + 1, vocab)
    ids = torch.full((batch, num_drafts), -1, dtype=torch.int64)
    probs = torch.full((batch, num_drafts, vocab), 1.0 / vocab)
    start = 0
    for b, n in enumerate(metadata.num_draft_tokens):
        rows = metadata.target_logits_indices[start:start + n].long()
        target[b, :n] = logits[rows]
        target[b, n] = logits[int(metadata.bonus_logits_indices[b])]
        ids[b, :n] = metadata.draft_token_ids[start:start + n]
        if draft_probs is not None:
            probs[b, :n] = draft_probs[start:start + n]
        start += n
    return target, ids, (probs if draft_probs is not None else None)


def test_vllm_metadata_is_vllms_layout():
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(
        [[5] * n for n in VLLM_NUM_DRAFTS])
    assert metadata.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert metadata.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert metadata.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert metadata.cu_num_sampled_tokens.tolist() == [4, 5, 8, 9, 11]
    assert metadata.max_spec_len == 3 and metadata.draft_token_ids.dtype == torch.int32


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_vllm_equals_verify_chain_on_the_padded_equivalent(backend):
    """Shapes, dtype and placeholders as vLLM's sampler has them; per-request temperature
    (0 = greedy), top-k (V disables, vLLM's convention) and top-p; with and without draft
    probabilities: token for token verify_chain on the padded copy."""
    _check_vllm_against_padded(backend, min_p=None)


@pytest.mark.parametrize("backend", CHAIN_BACKENDS)
def test_vllm_min_p_equals_verify_chain_on_the_padded_equivalent(backend):
    try:
        _check_vllm_against_padded(backend, min_p=torch.tensor([0.0, 0.1, 0.0, 0.3, 0.05]))
    except NotImplementedError as err:  # runs as soon as the kernels take min_p
        pytest.skip(str(err))


def _check_vllm_against_padded(backend, min_p):
    batch = len(VLLM_NUM_DRAFTS)
    for with_probs in (True, False):
        metadata, logits, draft_probs = _vllm_problem(VLLM_NUM_DRAFTS, with_probs=with_probs)
        vocab = logits.shape[-1]
        params = dict(temperature=torch.tensor([0.0, 0.8, 1.0, 0.0, 1.3]),
                      top_k=torch.tensor([vocab, 4, vocab, 2, 3], dtype=torch.int32),
                      top_p=torch.tensor([1.0, 0.9, 0.7, 1.0, 1.0]), min_p=min_p)
        sampling = vllm.SamplingMetadata(all_greedy=False, all_random=False, **params)
        seeds = torch.arange(batch) * 1_000_003
        out = vllm.rejection_sample(metadata, draft_probs, logits, sampling, seed=seeds,
                                    offset=9, backend=backend)
        assert out.dtype == torch.int32 and out.shape == (batch, metadata.max_spec_len + 1)
        target, ids, probs = _padded(metadata, logits, draft_probs)
        want = sk.verify_chain(target, ids, draft_probs=probs,
                               num_draft_tokens=torch.tensor(VLLM_NUM_DRAFTS), seed=seeds,
                               offset=9, backend=backend, **params)
        assert torch.equal(out, want.output_token_ids)
        emitted = (out != vllm.PLACEHOLDER_TOKEN_ID).sum(1)
        assert torch.equal(emitted, want.num_accepted + 1)
        assert bool((out[:, 1:][emitted[:, None] <= torch.arange(3)] == -1).all())


def test_vllm_sampling_fields_as_vllm_keeps_them():
    """all_greedy with temperature None; min_p from vLLM's MinPLogitsProcessor ([B, 1], only
    while min_p_count > 0); a grammar bitmask; RejectionSampler.forward and parse_output."""
    metadata, logits, draft_probs = _vllm_problem(VLLM_NUM_DRAFTS, seed=1)
    batch, vocab = len(VLLM_NUM_DRAFTS), logits.shape[-1]
    greedy = vllm.rejection_sample(metadata, draft_probs, logits, vllm.SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False))
    by_zero = vllm.rejection_sample(metadata, draft_probs, logits, vllm.SamplingMetadata(
        temperature=torch.zeros(batch), all_greedy=False, all_random=False))
    assert torch.equal(greedy, by_zero)

    min_p = torch.tensor([0.2, 0.0, 0.5, 0.1, 0.3])

    class MinPLogitsProcessor:  # the two attributes vLLM's processor keeps
        def __init__(self, count):
            self.min_p, self.min_p_count = min_p[:, None].clone(), count

    class LogitsProcessors:
        def __init__(self, count):
            self.argmax_invariant = [object(), MinPLogitsProcessor(count)]

    class VllmSamplingMetadata:
        def __init__(self, count):
            self.temperature, self.all_greedy, self.all_random = torch.ones(batch), False, True
            self.top_k = self.top_p = None
            self.generators, self.logitsprocs = {}, LogitsProcessors(count)

    seeds = torch.arange(batch) + 5
    run = lambda sampling, **kw: vllm.rejection_sample(metadata, draft_probs, logits, sampling,
                                                       seed=seeds, **kw)
    ours = lambda m: run(vllm.SamplingMetadata(temperature=torch.ones(batch), all_greedy=False,
                                               all_random=True, min_p=m))
    assert torch.equal(run(VllmSamplingMetadata(4)), ours(min_p))
    assert torch.equal(run(VllmSamplingMetadata(0)), ours(None))
    assert not torch.equal(ours(min_p), ours(None))

    allowed = torch.rand(logits.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    allowed[:, 0] = True
    masked = run(VllmSamplingMetadata(0), token_bitmask=bitmask_of(allowed))
    rows = torch.where(allowed, logits, float("-inf"))
    assert torch.equal(masked, vllm.rejection_sample(metadata, draft_probs, rows,
                                                     VllmSamplingMetadata(0), seed=seeds))

    output = vllm.RejectionSampler(None, fused_bonus=True).forward(
        metadata, draft_probs, logits, VllmSamplingMetadata(0), seed=seeds)
    assert torch.equal(output.sampled_token_ids, run(VllmSamplingMetadata(0)))
    assert output.logprobs_tensors is None
    parsed, no_logprobs = vllm.RejectionSampler.parse_output(output.sampled_token_ids, vocab)
    assert no_logprobs is None
    assert [len(tokens) for tokens in parsed] == (output.sampled_token_ids >= 0).sum(1).tolist()


def test_vllm_generators_seed_each_request_by_its_own():
    """A seeded request's tokens depend on its generator only (not on its row nor the other
    requests), drawing one seed per step from it; unseeded requests follow torch's seed."""
    metadata, logits, draft_probs = _vllm_problem([2, 2, 2, 2], seed=3)
    sampling = lambda generators: vllm.SamplingMetadata(
        temperature=torch.ones(4), all_greedy=False, all_random=True, generators=generators)
    gen = lambda: torch.Generator().manual_seed(1234)
    torch.manual_seed(0)
    first = vllm.rejection_sample(metadata, draft_probs, logits, sampling({1: gen()}))
    torch.manual_seed(99)
    other = vllm.rejection_sample(metadata, draft_probs, logits, sampling({1: gen()}))
    assert torch.equal(first[1], other[1])   # the seeded request
    assert not torch.equal(first, other)      # the others follow torch's seed
    # Request 1 moved to row 3 (its rows swapped with request 3's): the same tokens.
    swapped = torch.cat([logits[:3], logits[9:12], logits[6:9], logits[3:6]])
    drafts = metadata.draft_token_ids.view(4, 2)[[0, 3, 2, 1]].flatten()
    moved = vllm.SpecDecodeMetadata(drafts, [2] * 4, metadata.cu_num_draft_tokens,
                                    metadata.target_logits_indices, metadata.bonus_logits_indices)
    probs = draft_probs.view(4, 2, -1)[[0, 3, 2, 1]].reshape(8, -1)
    again = vllm.rejection_sample(moved, probs, swapped, sampling({3: gen()}))
    assert torch.equal(again[3], first[1])
    generator = gen()
    state = generator.get_state()
    vllm.rejection_sample(metadata, draft_probs, logits, sampling({0: generator}))
    assert not torch.equal(generator.get_state(), state), "the generator did not advance"


def test_vllm_rejected_call_advances_no_generator():
    """The requests' seeds are drawn (from their generators and torch's) only once the op has
    checked the call: one rejected with ValueError leaves every generator as it was."""
    metadata, logits, draft_probs = _vllm_problem([2, 1, 2], seed=7)  # V = 11
    bad_ids = metadata.draft_token_ids.clone()
    bad_ids[1] = 11
    bad = vllm.SpecDecodeMetadata(bad_ids, metadata.num_draft_tokens,
                                  metadata.cu_num_draft_tokens, metadata.target_logits_indices,
                                  metadata.bonus_logits_indices)
    generator = torch.Generator().manual_seed(5)
    state, default = generator.get_state(), torch.get_rng_state()
    sampling = lambda **kw: vllm.SamplingMetadata(
        temperature=torch.ones(3), all_greedy=False, all_random=True, generators={1: generator},
        **kw)
    with pytest.raises(ValueError, match="draft_token_ids"):
        vllm.rejection_sample(bad, draft_probs, logits, sampling())
    with pytest.raises(ValueError, match="min_p"):
        vllm.rejection_sample(metadata, draft_probs, logits, sampling(min_p=torch.full((3,), 2.0)))
    with pytest.raises(ValueError, match="offset"):
        vllm.rejection_sample(metadata, draft_probs, logits, sampling(), offset=2**64)
    with pytest.raises(TypeError, match="generators"):
        vllm.rejection_sample(metadata, draft_probs, logits, vllm.SamplingMetadata(
            temperature=torch.ones(3), all_greedy=False, all_random=True,
            generators={0: generator, 2: "not a generator"}))
    assert torch.equal(generator.get_state(), state), "a rejected call advanced the generator"
    assert torch.equal(torch.get_rng_state(), default), "a rejected call advanced torch's"
    vllm.rejection_sample(metadata, draft_probs, logits, sampling())
    assert not torch.equal(generator.get_state(), state)


def test_vllm_permuted_batch_permutes_the_outputs():
    lengths = [3, 0, 2, 1, 3, 0, 1, 2]
    metadata, logits, draft_probs = _vllm_problem(lengths, seed=4)
    batch = len(lengths)
    seeds = torch.randint(0, 2**62, (batch,), generator=torch.Generator().manual_seed(5))
    sampling = lambda t: vllm.SamplingMetadata(temperature=t, all_greedy=False, all_random=False)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.2, 1.0, 0.9, 0.0, 1.1])
    base = vllm.rejection_sample(metadata, draft_probs, logits, sampling(temperature),
                                 seed=seeds, offset=seeds // 7)
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(6)).tolist()
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    rows = [list(range(starts[b] + b, starts[b + 1] + b + 1)) for b in range(batch)]
    drafts = [list(range(starts[b], starts[b + 1])) for b in range(batch)]
    new_rows = [r for b in perm for r in rows[b]]
    new_drafts = [d for b in perm for d in drafts[b]]
    permuted_meta = vllm.SpecDecodeMetadata.from_draft_token_ids(
        [metadata.draft_token_ids[drafts[b]].tolist() for b in perm])
    permuted = vllm.rejection_sample(permuted_meta, draft_probs[new_drafts], logits[new_rows],
                                     sampling(temperature[perm]), seed=seeds[perm],
                                     offset=seeds[perm] // 7)
    assert torch.equal(permuted, base[perm])


def _vllm_law_round(batch: int, min_p: float, gen: torch.Generator):
    """Ragged requests (0 to 3 drafts) whose every target row is the same row x, drafts drawn
    from q: the first emitted token of each request follows P(x)."""
    vocab, temperature = 7, 0.8
    x = torch.randn(vocab, generator=gen) * 1.5
    q = _random_probs(vocab, gen, zeros=False)
    lengths = (torch.arange(batch) % 4).tolist()
    total = sum(lengths)
    flat = torch.multinomial(q, total, replacement=True, generator=gen)
    counts = torch.tensor(lengths)
    cu = counts.cumsum(0)
    metadata = vllm.SpecDecodeMetadata(
        flat.to(torch.int32), lengths, cu.to(torch.int32),
        (torch.arange(total) + torch.repeat_interleave(torch.arange(batch), counts)).int(),
        (cu + torch.arange(batch)).int())
    sampling = vllm.SamplingMetadata(temperature=torch.full((batch,), temperature),
                                     all_greedy=False, all_random=True,
                                     min_p=torch.full((batch,), min_p))
    out = vllm.rejection_sample(metadata, q.expand(total, vocab), x.expand(total + batch, vocab),
                                sampling, seed=torch.arange(batch) * 31, offset=1,
                                backend="reference")
    law = torch.tensor(oracle_probs(x.tolist(), temperature, 0, 1.0, min_p), dtype=torch.float64)
    return out[:, 0], law


def test_vllm_first_token_law():
    tokens, law = _vllm_law_round(LAW_BATCH, 0.15, torch.Generator().manual_seed(7))
    assert int((law > 0).sum()) < law.numel(), "min_p should remove a token here"
    assert _law_pvalue(tokens, law) > ALPHA


def test_vllm_law_catches_min_p_ignored_on_draft_rows(monkeypatch):
    """vLLM's own rule (min_p on the bonus row only) as a planted bug: every request with a
    draft emits its first token from a draft row, which then ignores min_p."""
    real = sk.chain.verify_chain_packed

    def min_p_on_bonus_rows_only(*args, min_p=None, **kwargs):
        with_drafts = (args[2][1:] - args[2][:-1]) > 0
        return real(*args, min_p=torch.where(with_drafts, 0.0, min_p), **kwargs)
    monkeypatch.setattr(vllm, "verify_chain_packed", min_p_on_bonus_rows_only)
    tokens, law = _vllm_law_round(LAW_BATCH, 0.15, torch.Generator().manual_seed(7))
    assert _law_pvalue(tokens, law) < ALPHA, "the chi-square test missed min_p being ignored"


def test_vllm_bad_input_names_the_argument():
    metadata, logits, draft_probs = _vllm_problem(VLLM_NUM_DRAFTS, seed=8)
    sampling = vllm.SamplingMetadata(temperature=torch.ones(5), all_greedy=False, all_random=True)
    shifted = vllm.SpecDecodeMetadata(metadata.draft_token_ids, metadata.num_draft_tokens,
                                      metadata.cu_num_draft_tokens,
                                      metadata.target_logits_indices + 1,
                                      metadata.bonus_logits_indices)
    with pytest.raises(ValueError, match="target_logits_indices: expected vLLM's layout"):
        vllm.rejection_sample(shifted, draft_probs, logits, sampling)
    bonus_first = vllm.SpecDecodeMetadata(metadata.draft_token_ids, metadata.num_draft_tokens,
                                          metadata.cu_num_draft_tokens,
                                          metadata.target_logits_indices,
                                          metadata.bonus_logits_indices - 1)
    with pytest.raises(ValueError, match="bonus_logits_indices"):
        vllm.rejection_sample(bonus_first, draft_probs, logits, sampling)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        vllm.rejection_sample(metadata, draft_probs, logits[:-1], sampling)
    with pytest.raises(ValueError, match="generators"):
        vllm.rejection_sample(metadata, draft_probs, logits, vllm.SamplingMetadata(
            temperature=torch.ones(5), all_greedy=False, all_random=True,
            generators={5: torch.Generator()}))
    with pytest.raises(ValueError, match="min_p"):
        vllm.rejection_sample(metadata, draft_probs, logits, vllm.SamplingMetadata(
            temperature=torch.ones(5), all_greedy=False, all_random=True,
            min_p=torch.full((5,), 1.5)))
    with pytest.raises(TypeError, match="logits"):
        vllm.rejection_sample(metadata, draft_probs, logits.long(), sampling)


