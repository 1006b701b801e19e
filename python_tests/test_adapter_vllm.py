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
from specdec_kernels.adapters.vllm import _history as vllm_history
from specdec_kernels.adapters.vllm import v1_0_33 as vllm_v1
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
    monkeypatch.setattr(vllm_v1, "verify_chain_packed", min_p_on_bonus_rows_only)
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
    with pytest.raises(ValueError, match=r"^logits: expected shape \[T\+B, V\] with V >= 1"):
        vllm.rejection_sample(metadata, None, logits[:, :0], sampling)




# --- vLLM 0.33.0's class: constructor, Sampler, features, logprobs --------------------------

class FakeSampler:
    """vLLM's ``Sampler`` as the rejection sampler calls it: ``(logits, sampling_metadata,
    predict_bonus_token, logprobs_mode_override)``; greedy arg-max of the bonus rows it gets,
    logits back as its ``logprobs_tensors.logprobs`` when asked (``max_num_logprobs=-1``)."""

    def __init__(self, logprobs_mode="raw_logprobs"):
        self.logprobs_mode, self.calls = logprobs_mode, []

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False,
                 logprobs_mode_override=None):
        self.calls.append((logits.clone(), predict_bonus_token, logprobs_mode_override))
        lp = None
        if sampling_metadata.max_num_logprobs == -1:
            lp = vllm.LogprobsTensors(torch.empty(0), logits.float().clone(), torch.empty(0))
        return vllm.SamplerOutput(logits.argmax(-1).int()[:, None], lp)


def _features_problem(num_drafts, vocab=12, seed=0):
    """A batch using every draft-row feature: penalties, bad words, allowed ids, logit bias
    and min_tokens (vLLM's builtin processors mirrored by attribute name)."""
    gen = torch.Generator().manual_seed(seed)
    metadata, logits, _ = _vllm_problem(num_drafts, vocab=vocab, seed=seed, with_probs=False)
    batch = len(num_drafts)
    spec = []
    start = 0
    for n in num_drafts:
        spec.append(metadata.draft_token_ids[start:start + n].tolist())
        start += n
    output = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in range(batch)]
    allowed_mask = torch.rand(batch, vocab, generator=gen) < 0.2  # True = disallowed
    bad_words = {0: [[spec[0][0], 7], [3]], 2: [[5]]} if num_drafts[0] else {2: [[5]]}
    biases = {1: {2: 3.0, 4: -2.0}, 2: {0: 1.5}}
    min_toks = {0: (5, output[0], {1, 6}, False)}
    logitsprocs = types.SimpleNamespace(
        argmax_invariant=[],
        non_argmax_invariant=[types.SimpleNamespace(min_toks=min_toks,
                                                    apply_with_spec_decode=None),
                              types.SimpleNamespace(biases=biases)])
    sampling = vllm.SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, no_penalties=False,
        prompt_token_ids=torch.randint(0, vocab + 1, (batch, 4), generator=gen),
        frequency_penalties=torch.rand(batch, generator=gen),
        presence_penalties=torch.rand(batch, generator=gen),
        repetition_penalties=1 + torch.rand(batch, generator=gen),
        output_token_ids=output, spec_token_ids=spec, allowed_token_ids_mask=allowed_mask,
        bad_words_token_ids=bad_words, logitsprocs=logitsprocs)
    features = dict(output=output, spec=spec, allowed_mask=allowed_mask, bad_words=bad_words,
                    biases=biases, min_toks=min_toks)
    return metadata, logits, sampling, features


def _processed_row(row, sampling, features, b, j):
    """Independent float64 definition of vLLM's Sampler features for the token at position j
    of request b (history: output + drafts 1..j), in its order: allowed ids, bad words,
    min_tokens, logit_bias, then repetition/frequency/presence penalties."""
    x = row.double().tolist()
    vocab = len(x)
    past = features["output"][b] + features["spec"][b][:j]
    for v in range(vocab):
        if features["allowed_mask"][b, v]:
            x[v] = -math.inf
    for word in features["bad_words"].get(b, []):
        if len(word) - 1 <= len(past) and (len(word) == 1 or past[-(len(word) - 1):] == word[:-1]):
            x[word[-1]] = -math.inf
    entry = features["min_toks"].get(b)
    if entry is not None and len(entry[1]) + j < entry[0]:
        for v in entry[2]:
            x[v] = -math.inf
    for v, bias in features["biases"].get(b, {}).items():
        x[v] += bias
    prompt = set(sampling.prompt_token_ids[b].tolist())
    rep = float(sampling.repetition_penalties[b])
    freq, pres = float(sampling.frequency_penalties[b]), float(sampling.presence_penalties[b])
    for v in range(vocab):
        count = past.count(v)
        if v in prompt or count:
            x[v] = x[v] / rep if x[v] > 0 else x[v] * rep
        x[v] -= freq * count + pres * (count > 0)
    return torch.tensor(x, dtype=torch.float64)


def _vllm_greedy_rule(metadata, logits, sampling, features, bonus_tokens):
    """vLLM's greedy rule on the processed rows: accept while the draft is the arg-max."""
    out = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1), -1,
                     dtype=torch.int32)
    start = 0
    for b, n in enumerate(metadata.num_draft_tokens):
        drafts = metadata.draft_token_ids[start:start + n].tolist()
        rows = metadata.target_logits_indices[start:start + n].tolist()
        start += n
        for j in range(n):
            best = int(_processed_row(logits[rows[j]], sampling, features, b, j).argmax())
            out[b, j] = best
            if best != drafts[j]:
                break
        else:
            out[b, n] = bonus_tokens[b]
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_vllm_class_greedy_equals_vllms_rule_with_every_feature(fused):
    """RejectionSampler(sampler, spec_config, device) as vLLM's runner builds it; the bonus
    token from the Sampler (given the bonus rows, predict_bonus_token=True) or fused; draft
    rows processed in place with the draft-aware history: vLLM's greedy tokens exactly."""
    for seed in range(4):
        num_drafts = [3, 0, 2, 1]
        metadata, logits, sampling, features = _features_problem(num_drafts, seed=seed)
        # Make drafts often right: each draft the arg-max of its processed row, some flipped.
        start = 0
        for b, n in enumerate(num_drafts):
            for j in range(n):
                row = metadata.target_logits_indices[start + j]
                best = int(_processed_row(logits[row], sampling, features, b, j).argmax())
                token = best if (seed + b + j) % 3 else (best + 1) % logits.shape[1]
                metadata.draft_token_ids[start + j] = token
                features["spec"][b][j] = token
            start += n
        sampler = FakeSampler()
        spec_config = types.SimpleNamespace(rejection_sample_method="standard")
        rejection_sampler = vllm.RejectionSampler(sampler, spec_config, torch.device("cpu"),
                                                  fused_bonus=fused)
        bonus_rows = logits[metadata.bonus_logits_indices.long()]
        if fused:
            bonus = [int(_processed_row(bonus_rows[b], sampling, features, b, n).argmax())
                     for b, n in enumerate(num_drafts)]
        else:
            bonus = bonus_rows.argmax(-1).tolist()
        want = _vllm_greedy_rule(metadata, logits.clone(), sampling, features, bonus)
        output = rejection_sampler(metadata, None, logits, sampling)
        assert output.sampled_token_ids.dtype == torch.int32
        assert torch.equal(output.sampled_token_ids, want), seed
        assert len(sampler.calls) == (0 if fused else 1)
        if not fused:
            given, predict_bonus, _ = sampler.calls[0]
            assert predict_bonus and torch.equal(given, bonus_rows)


def test_vllm_minus_one_drafts_are_rejected_drafts():
    """vLLM's scheduler pads grammar-invalid drafts with -1: the request stops there with a
    correction token, greedy or sampled, with or without draft probabilities; never an error."""
    metadata, logits, draft_probs = _vllm_problem([3, 2, 1], seed=11)
    metadata.draft_token_ids[1] = -1   # request 0: draft 2 invalid (and what follows)
    metadata.draft_token_ids[2] = -1
    metadata.draft_token_ids[5] = -1   # request 2's only draft
    sampler = vllm.RejectionSampler(FakeSampler())
    for temperature in (None, torch.ones(3)):
        sampling = vllm.SamplingMetadata(temperature=temperature, all_greedy=temperature is None,
                                         all_random=temperature is not None)
        for probs in (None, draft_probs):
            out = sampler(metadata, probs, logits.clone(), sampling).sampled_token_ids
            assert out[0, 2:].tolist() == [-1, -1] and out[2, 1:].tolist() == [-1] * 3
            assert bool((out[:, 0] >= 0).all()) and bool((out < logits.shape[1]).all())
            if temperature is None:
                assert out[2, 0] == logits[7].argmax()


def test_vllm_malformed_metadata_names_the_field_writes_nothing_draws_nothing():
    metadata, logits, draft_probs = _vllm_problem([2, 1, 2], seed=12)
    generator = torch.Generator().manual_seed(3)
    sampling = vllm.SamplingMetadata(temperature=torch.ones(3), all_greedy=False,
                                     all_random=True, generators={1: generator})
    fake = FakeSampler()
    sampler = vllm.RejectionSampler(fake)
    before, state, default = logits.clone(), generator.get_state(), torch.get_rng_state()

    def meta(**changes):
        fields = dict(draft_token_ids=metadata.draft_token_ids,
                      num_draft_tokens=metadata.num_draft_tokens,
                      cu_num_draft_tokens=metadata.cu_num_draft_tokens,
                      target_logits_indices=metadata.target_logits_indices,
                      bonus_logits_indices=metadata.bonus_logits_indices)
        fields.update(changes)
        return types.SimpleNamespace(**fields)
    cases = [(meta(num_draft_tokens=[-1, 4, 2]), ValueError, "num_draft_tokens"),
             (meta(num_draft_tokens=[2.9, 1.0, 2]), TypeError, "num_draft_tokens"),
             (meta(num_draft_tokens=torch.tensor([2, 1, 2])), TypeError, "num_draft_tokens"),
             (None, TypeError, "metadata"),
             (meta(num_draft_tokens=[2, 2, 2]), ValueError, "draft_token_ids"),
             (meta(num_draft_tokens=[2, 1, 2, 0]), ValueError, "cu_num_draft_tokens"),
             (meta(target_logits_indices=metadata.target_logits_indices[:-1]), ValueError,
              "target_logits_indices"),
             (meta(bonus_logits_indices=metadata.bonus_logits_indices[:2]), ValueError,
              "bonus_logits_indices"),
             (meta(draft_token_ids=metadata.draft_token_ids.float()), TypeError,
              "draft_token_ids"),
             (meta(max_spec_len=7), ValueError, "max_spec_len")]
    for bad, error, name in cases:
        with pytest.raises(error, match=name):
            sampler(bad, draft_probs, logits, sampling)
    with pytest.raises(ValueError, match="draft_probs"):
        sampler(metadata, draft_probs[:-1], logits, sampling)
    with pytest.raises(TypeError, match="sampling_metadata"):
        sampler(metadata, draft_probs, logits, None)
    with pytest.raises(ValueError, match="temperature"):
        sampler(metadata, draft_probs, logits, vllm.SamplingMetadata(
            temperature=None, all_greedy=False, all_random=True))
    with pytest.raises(ValueError, match="spec_token_ids"):
        sampler(metadata, draft_probs, logits, vllm.SamplingMetadata(
            temperature=torch.ones(3), all_greedy=False, all_random=True,
            bad_words_token_ids={0: [[1]]}, output_token_ids=[[], [], []]))
    assert torch.equal(logits, before), "a rejected call wrote to logits"
    assert torch.equal(generator.get_state(), state) and not fake.calls
    assert torch.equal(torch.get_rng_state(), default)


class DrawingSampler(FakeSampler):
    """A Sampler that, as vLLM's does, advances torch's generator and each request's own."""

    def __call__(self, logits, sampling_metadata, **kwargs):
        torch.rand(1)
        for generator in sampling_metadata.generators.values():
            torch.rand(1, generator=generator)
        return super().__call__(logits, sampling_metadata, **kwargs)


def _bad_sampling_cases(vocab: int, batch: int):
    """(sampling changes, forward keywords, error, field) of issue 47's item 2: each raised
    by the op, or as an IndexError, only after the features were written."""
    def min_tokens(stop):
        return types.SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[
            types.SimpleNamespace(min_toks={0: (9, [], stop)}, apply_with_spec_decode=None)])
    def bias(biases):
        return types.SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[
            types.SimpleNamespace(biases=biases)])
    return [
        (dict(top_k=torch.ones(batch)), {}, TypeError, "top_k"),
        (dict(temperature=torch.ones(batch, dtype=torch.bool)), {}, TypeError, "temperature"),
        (dict(top_p=torch.ones(batch, dtype=torch.bool)), {}, TypeError, "top_p"),
        ({}, dict(seed=1.5), TypeError, "seed"),
        ({}, dict(seed=torch.zeros(batch + 1, dtype=torch.int64)), ValueError, "seed"),
        ({}, dict(offset=torch.zeros(batch, 2, dtype=torch.int64)), ValueError, "offset"),
        (dict(bad_words_token_ids={1: [[2, vocab]]}), {}, ValueError, "bad_words_token_ids"),
        (dict(bad_words_token_ids={0: [[-2]]}), {}, ValueError, "bad_words_token_ids"),
        (dict(bad_words_token_ids={0: [[]]}), {}, ValueError, "bad_words_token_ids"),
        (dict(bad_words_token_ids={0: [[1.5]]}), {}, TypeError, "bad_words_token_ids"),
        (dict(logitsprocs=bias({0: {1: 2.0}, 1: {vocab: 1.0}})), {}, ValueError, "logit_bias"),
        (dict(logitsprocs=bias({0: {-1: 2.0}})), {}, ValueError, "logit_bias"),
        (dict(logitsprocs=bias({0: {1: "big"}})), {}, TypeError, "logit_bias"),
        (dict(logitsprocs=min_tokens({1, vocab + 3})), {}, ValueError, "min_tokens"),
        (dict(logitsprocs=min_tokens({-1})), {}, ValueError, "min_tokens"),
        (dict(prompt_token_ids=torch.zeros(4, dtype=torch.int64)), {}, ValueError,
         "prompt_token_ids"),
        (dict(prompt_token_ids=torch.zeros(batch, 4)), {}, TypeError, "prompt_token_ids"),
        (dict(prompt_token_ids=torch.zeros(batch - 1, 4, dtype=torch.int64)), {}, ValueError,
         "prompt_token_ids"),
        (dict(repetition_penalties=torch.ones(batch, dtype=torch.bool)), {}, TypeError,
         "repetition_penalties"),
        (dict(output_token_ids=[[1, vocab], [], []]), {}, ValueError, "output_token_ids"),
        (dict(spec_token_ids=[[1, -3], [0], [2, 2]]), {}, ValueError, "spec_token_ids"),
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_vllm_bad_sampling_inputs_raise_before_anything_is_written(fused):
    """Issue 47 item 2: every check runs before the features are written into logits, before
    the bonus Sampler runs and before any generator advances: logits byte-identical, torch's
    and the request's generator unchanged, the Sampler not called, the field named."""
    metadata, logits, draft_probs = _vllm_problem([2, 1, 2], seed=16)
    batch, vocab = 3, logits.shape[1]
    spec = [metadata.draft_token_ids[:2].tolist(), metadata.draft_token_ids[2:3].tolist(),
            metadata.draft_token_ids[3:].tolist()]
    mask = torch.zeros(batch, vocab, dtype=torch.bool)
    mask[:, 0] = True  # written first by the features: a late check would leave it in logits
    base = dict(temperature=torch.ones(batch), all_greedy=False, all_random=True,
                allowed_token_ids_mask=mask, no_penalties=False,
                prompt_token_ids=torch.full((batch, 2), vocab),
                frequency_penalties=torch.full((batch,), 0.5),
                presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
                output_token_ids=[[1], [], [2]], spec_token_ids=spec,
                bad_words_token_ids={0: [[3]]})
    generator = torch.Generator().manual_seed(4)
    for changes, keywords, error, name in _bad_sampling_cases(vocab, batch):
        sampler = DrawingSampler()
        sampling = vllm.SamplingMetadata(**{**base, "generators": {1: generator}, **changes})
        before, state, default = logits.clone(), generator.get_state(), torch.get_rng_state()
        with pytest.raises(error, match=f"^{name}"):
            vllm.RejectionSampler(sampler, fused_bonus=fused)(metadata, draft_probs, logits,
                                                              sampling, **keywords)
        assert torch.equal(logits.view(torch.int32), before.view(torch.int32)), name
        assert not sampler.calls, f"{name}: the Sampler ran for a rejected call"
        assert torch.equal(generator.get_state(), state), name
        assert torch.equal(torch.get_rng_state(), default), name
    with pytest.raises(ValueError, match="^backend"):
        vllm.RejectionSampler(DrawingSampler(), backend="bogus")
    # The base call is valid, and writes: the checks above are what kept logits intact.
    vllm.RejectionSampler(DrawingSampler(), fused_bonus=fused)(
        metadata, draft_probs, logits, vllm.SamplingMetadata(**base))
    assert bool(torch.isneginf(logits[0, 0]))


def test_vllm_validated_call_checks_the_prompt_ids():
    metadata, logits, _ = _vllm_problem([1, 1], seed=17)
    sampling = vllm.SamplingMetadata(
        temperature=torch.ones(2), all_greedy=False, all_random=True, no_penalties=False,
        prompt_token_ids=torch.tensor([[0, 11], [-1, 11]]), frequency_penalties=torch.ones(2),
        presence_penalties=torch.ones(2), repetition_penalties=torch.ones(2),
        output_token_ids=[[], []], spec_token_ids=[[0], [1]])
    before = logits.clone()
    with pytest.raises(ValueError, match=r"^prompt_token_ids: expected ids in \[0, 11\]"):
        vllm.rejection_sample(metadata, None, logits, sampling)
    assert torch.equal(logits, before)


def test_vllm_modes_block_and_delegation():
    """"block" is our block verification; FLy and synthetic are vLLM's own class (without
    vLLM: NotImplementedError at construction naming rejection_sample_method)."""
    metadata, logits, draft_probs = _vllm_problem(VLLM_NUM_DRAFTS, seed=13)
    sampling = vllm.SamplingMetadata(temperature=torch.ones(5), all_greedy=False,
                                     all_random=True)
    seeds = torch.arange(5) + 100
    block = vllm.RejectionSampler(None, types.SimpleNamespace(rejection_sample_method="block"),
                                  fused_bonus=True)
    out = block(metadata, draft_probs, logits, sampling, seed=seeds).sampled_token_ids
    cu = torch.nn.functional.pad(metadata.cu_num_draft_tokens.long(), (1, 0))
    want = sk.verify_chain_packed(logits, metadata.draft_token_ids, cu, max_draft_tokens=3,
                                  draft_probs=draft_probs, temperature=1.0, seed=seeds,
                                  method="block")
    assert torch.equal(out, want.output_token_ids)
    try:
        import vllm as _vllm_installed  # noqa: F401
    except ImportError:
        for method in ("fly", "synthetic"):
            with pytest.raises(NotImplementedError, match="rejection_sample_method"):
                vllm.RejectionSampler(FakeSampler(),
                                      types.SimpleNamespace(rejection_sample_method=method))
    with pytest.raises(NotImplementedError, match="rejection_sample_method"):
        vllm.RejectionSampler(FakeSampler(), types.SimpleNamespace(rejection_sample_method="x"))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits",
                                  "processed_logits"])
def test_vllm_logprobs_tensors_are_log_softmax_of_the_emitting_row(mode):
    """vLLM's LogprobsTensors: per slot the emitted token then the top n, their logprobs and
    the token's rank, from the row the token was emitted at; parse_output filters them."""
    num_drafts = [3, 0, 2]
    metadata, logits, draft_probs = _vllm_problem(num_drafts, seed=14)
    temperature = torch.tensor([0.7, 1.0, 0.0])
    sampling = vllm.SamplingMetadata(temperature=temperature, all_greedy=False,
                                     all_random=False, max_num_logprobs=3,
                                     top_k=torch.tensor([5, 11, 11]))
    for fused in (False, True):
        sampler = vllm.RejectionSampler(FakeSampler(mode), fused_bonus=fused)
        output = sampler(metadata, draft_probs, logits.clone(), sampling,
                         seed=torch.tensor([1, 2, 3]))
        tokens, lp = output.sampled_token_ids, output.logprobs_tensors
        assert lp.logprob_token_ids.shape == (3 * 4, 4) and lp.logprobs.shape == (3 * 4, 4)
        starts = [0, 4, 5]
        for b, n in enumerate(num_drafts):
            for j in range(n + 1):
                token = int(tokens[b, j])
                if token < 0:
                    break
                row = logits[starts[b] + j].double()
                if mode.startswith("processed"):
                    t = float(temperature[b]) or 1.0
                    probs = sk.processed_probs(row[None].float(), t, int(sampling.top_k[b]))[0]
                    is_bonus_from_sampler = j == n and not fused
                    scores = row if is_bonus_from_sampler else torch.where(
                        probs > 0, row / t, -math.inf)
                else:
                    scores = row
                want = scores if mode.endswith("logits") else scores.log_softmax(-1)
                slot = b * 4 + j
                assert int(lp.logprob_token_ids[slot, 0]) == token
                assert abs(float(lp.logprobs[slot, 0]) - float(want[token])) < 1e-4
                top = want.topk(3)
                assert torch.allclose(lp.logprobs[slot, 1:].double(), top.values, atol=1e-4)
                assert int(lp.selected_token_ranks[slot]) == int((want >= want[token]).sum())
        lists, logprobs_lists = vllm.RejectionSampler.parse_output(tokens, 11, (),
                                                                   lp)
        assert sum(map(len, lists)) == len(logprobs_lists.logprob_token_ids)
        assert logprobs_lists.cu_num_generated_tokens[-1] == sum(map(len, lists))


def test_vllm_parse_output_signature_and_discard():
    tokens = torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, 6]], dtype=torch.int32)
    lists, logprobs = vllm.RejectionSampler.parse_output(tokens, 6, discard_req_indices=[1])
    assert lists == [[1, 2], [], [4, 5]] and logprobs is None


def test_vllm_default_path_makes_no_host_synchronisation(monkeypatch):
    """The adapter's own code (checks, features, seeds, the bonus merge) reads no tensor value
    on the host: every device-to-host read raises while it runs (the op is stubbed: its own
    graph safety is test_graph_safety's)."""
    metadata, logits, draft_probs = _vllm_problem(VLLM_NUM_DRAFTS, seed=15)
    metadata2, _, sampling, _ = _features_problem(VLLM_NUM_DRAFTS, vocab=11, seed=15)
    sampling.temperature, sampling.all_greedy = torch.ones(5), False
    sampling.generators = {1: torch.Generator().manual_seed(1)}
    sampling.max_num_logprobs = 2

    def stub(rows, ids, cu, *, max_draft_tokens, seed, **kwargs):
        seed()  # the deferred draw
        zeros = torch.zeros(cu.shape[0] - 1, max_draft_tokens + 1, dtype=torch.int32)
        return sk.chain.ChainVerifyOutput(zeros, zeros[:, 0].clone())
    monkeypatch.setattr(vllm_v1, "verify_chain_packed", stub)
    sampler = vllm.RejectionSampler(FakeSampler(), fused_bonus=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation")
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero", "__int__",
                 "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    sampler(metadata2, draft_probs, logits, sampling)


def _history_law_round(batch: int, gen: torch.Generator):
    """Requests with 2 drafts whose first draft is accepted (row 0 all but one-hot on it):
    the second emitted token comes from row 1, whose history includes draft 1. Every request
    is penalised, logit-biased, allowed-ids-masked and has a bad word starting with draft 1."""
    vocab, temperature, first = 8, 0.9, 3
    row0 = torch.full((vocab,), -40.0)
    row0[first] = 40.0
    row1 = torch.randn(vocab, generator=gen)
    row1[first] = 1.5  # the penalties on draft 1 matter
    q = _random_probs(vocab, gen, zeros=False)
    second = torch.multinomial(q, batch, replacement=True, generator=gen)
    drafts = torch.stack([torch.full((batch,), first), second], 1)
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(drafts.tolist())
    logits = torch.stack([row0, row1, torch.zeros(vocab)]).repeat(batch, 1)
    draft_probs = torch.stack([torch.nn.functional.one_hot(torch.tensor(first), vocab).float(),
                               q]).repeat(batch, 1)
    mask = torch.zeros(batch, vocab, dtype=torch.bool)
    mask[:, 6] = True
    output = [[1, 2]] * batch
    features = dict(output=output, spec=drafts.tolist(), allowed_mask=mask,
                    bad_words={b: [[first, 5]] for b in range(batch)},
                    biases={b: {0: 0.7} for b in range(batch)}, min_toks={})
    sampling = vllm.SamplingMetadata(
        temperature=torch.full((batch,), temperature), all_greedy=False, all_random=True,
        no_penalties=False, prompt_token_ids=torch.tensor([[4, vocab]] * batch),
        frequency_penalties=torch.full((batch,), 0.8),
        presence_penalties=torch.full((batch,), 0.3),
        repetition_penalties=torch.full((batch,), 1.7), output_token_ids=output,
        spec_token_ids=features["spec"], allowed_token_ids_mask=mask,
        bad_words_token_ids=features["bad_words"],
        logitsprocs=types.SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[
            types.SimpleNamespace(biases=features["biases"])]))
    out = vllm.rejection_sample(metadata, draft_probs, logits, sampling,
                                seed=torch.arange(batch) * 7 + 1, offset=3, validate=False)
    processed = _processed_row(row1, sampling, features, 0, 1)
    law = torch.tensor(oracle_probs(processed.tolist(), temperature, 0, 1.0, 0.0),
                       dtype=torch.float64)
    assert bool((out[:, 0] == first).all())
    return out[:, 1], law


def test_vllm_law_with_draft_aware_history():
    tokens, law = _history_law_round(LAW_BATCH, torch.Generator().manual_seed(21))
    assert _law_pvalue(tokens, law) > ALPHA


def test_vllm_law_catches_history_without_drafts(monkeypatch):
    """Planted bug: the penalties and bad words of draft row 2 ignore draft 1 (the history
    vLLM's sampler gives its bonus row without spec tokens)."""
    monkeypatch.setattr(vllm_history, "row_history",
                        lambda output, spec, b, j: list(output[b]) if b < len(output) else [])
    tokens, law = _history_law_round(LAW_BATCH, torch.Generator().manual_seed(21))
    assert _law_pvalue(tokens, law) < ALPHA, "the chi-square test missed the history bug"


# --- MRV2 ----------------------------------------------------------------------------------

def _mrv2_problem(num_drafts, vocab=9, max_num_reqs=6, seed=0):
    """MRV2's inputs: logits rows per request (drafts then bonus), the input ids at each row
    (row r's draft is at r + 1), request slots through idx_mapping."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, steps = len(num_drafts), max(num_drafts)
    counts = torch.tensor(num_drafts) + 1
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
    num_logits = int(cu[-1])
    target = torch.randn(num_logits, vocab, generator=gen) * 1.5
    draft_sampled = torch.randint(0, vocab, (num_logits,), generator=gen)
    idx_mapping = torch.randperm(max_num_reqs, generator=gen)[:num_reqs].int()
    draft_logits = torch.randn(max_num_reqs, steps, vocab, generator=gen)
    expanded_idx = torch.repeat_interleave(idx_mapping, counts)
    local = torch.cat([torch.arange(int(c)) for c in counts]).int()
    pos = (torch.arange(num_logits) + 100).long()
    temperature = torch.rand(max_num_reqs, generator=gen) + 0.5
    seeds = torch.randint(0, 2**40, (max_num_reqs,), generator=gen)
    return dict(target_logits=target, draft_logits=draft_logits, draft_sampled=draft_sampled,
                cu_num_logits=cu, pos=pos, idx_mapping=idx_mapping,
                expanded_idx_mapping=expanded_idx, expanded_local_pos=local,
                temperature=temperature, seed=seeds, num_speculative_steps=steps)


def test_mrv2_rejection_sample_is_verify_chain_on_mrv2_layout():
    """MRV2's signature and outputs; greedy: vLLM's rule (accept while the draft is the
    arg-max); sampled: verify_chain on the padded equivalent with q = softmax(draft / T)."""
    from specdec_kernels.adapters import vllm_mrv2
    num_drafts = [2, 0, 3, 1]
    problem = _mrv2_problem(num_drafts)
    problem["temperature"][problem["idx_mapping"][0]] = 0.0
    problem["draft_sampled"][2] = -1  # request 0's second draft: rejected
    sampled, num_sampled = vllm_mrv2.rejection_sample(**problem)
    assert sampled.dtype == torch.int64 and sampled.shape == (4, 4)
    assert num_sampled.dtype == torch.int32
    cu = problem["cu_num_logits"].tolist()
    target, ids = problem["target_logits"], problem["draft_sampled"]
    # Request 0 is greedy: draft 1 vs arg-max of row 0, then draft 2 = -1 is rejected.
    first = int(target[0].argmax())
    if int(ids[1]) == first:
        assert sampled[0, :2].tolist() == [first, int(target[1].argmax())]
    else:
        assert sampled[0, 0] == first and int(num_sampled[0]) == 1
    for i in range(1, 4):
        n, slot = num_drafts[i], int(problem["idx_mapping"][i])
        t = float(problem["temperature"][slot])
        rows = target[cu[i]:cu[i + 1]]
        drafts = ids[cu[i] + 1:cu[i + 1]]
        q = problem["draft_logits"][slot, :n] / t
        K = 3
        pad = lambda x, width, fill: torch.cat([x, x.new_full((width - x.shape[0],) +
                                                              tuple(x.shape[1:]), fill)])
        want = sk.verify_chain(pad(rows, K + 1, 0.0)[None], pad(drafts, K, 0)[None],
                               draft_logits=pad(q, K, 0.0)[None], num_draft_tokens=n,
                               temperature=1.0, seed=int(problem["seed"][slot]),
                               offset=int(problem["pos"][cu[i]]))
        assert torch.equal(sampled[i], want.output_token_ids[0].long()), i
        assert int(num_sampled[i]) == int(want.num_accepted[0]) + 1


def test_mrv2_bad_indices_name_the_argument():
    """Issue 47 item 3: idx_mapping past the end of temperature / seed / draft_logits and a
    cu_num_logits that does not match the rows are ValueErrors naming the argument (value
    checks: validate=None on CPU, or True); fewer logits rows than requests is a shape, checked
    always. validate=False clamps a slot past the end (no read out of bounds, no error)."""
    from specdec_kernels.adapters import vllm_mrv2
    problem = _mrv2_problem([2, 0, 3, 1], max_num_reqs=6)

    def call(validate=None, **changes):
        return vllm_mrv2.rejection_sample(**{**problem, **changes}, validate=validate)
    past_end = problem["idx_mapping"].clone()
    past_end[1] = 6
    for changes in (dict(idx_mapping=past_end), dict(temperature=problem["temperature"][:3]),
                    dict(seed=problem["seed"][:2]),
                    dict(draft_logits=problem["draft_logits"][:4])):
        with pytest.raises(ValueError, match=r"^idx_mapping: expected request slots in \[0, "):
            call(**changes)
        with pytest.raises(ValueError, match="^idx_mapping"):
            call(validate=True, **changes)
    few = problem["cu_num_logits"].clone()
    few[1:] = torch.tensor([1, 2, 3, 3], dtype=few.dtype)  # the last request has no row
    with pytest.raises(ValueError, match="^cu_num_logits"):
        call(cu_num_logits=few)
    too_many = torch.tensor([0, 5, 6, 10, 12], dtype=few.dtype)  # 5 rows: 4 drafts > K = 3
    with pytest.raises(ValueError, match="^cu_num_logits"):
        call(cu_num_logits=too_many)
    rows = 3  # fewer logits rows than the 4 requests
    with pytest.raises(ValueError, match="^target_logits, cu_num_logits"):
        call(validate=False, target_logits=problem["target_logits"][:rows],
             draft_sampled=problem["draft_sampled"][:rows], pos=problem["pos"][:rows])
    sampled, num_sampled = call(validate=False, idx_mapping=past_end)
    assert sampled.shape == (4, 4) and bool((num_sampled >= 1).all())


def _invalid_draft_law_round(batch: int, gen: torch.Generator, grammar: str = "logits"):
    """Every request's only draft is -1 (a grammar-invalid token x, p(x) = 0, drawn from q):
    the emitted token follows the residual norm(max(p - q, 0)), as rejecting x gives. The
    grammar forbids token 0 by a -inf logit (``grammar="logits"``) or by a 0 bit of
    ``token_bitmask`` on finite logits (``"bitmask"``, issue 47's law bug)."""
    vocab = 7
    row = torch.randn(vocab, generator=gen)
    forbidden = row.clone()
    forbidden[0] = -math.inf  # the grammar's invalid token
    q = _random_probs(vocab, gen, zeros=False)
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids([[-1]] * batch)
    given = forbidden if grammar == "logits" else row
    logits = torch.stack([given, torch.zeros(vocab)]).repeat(batch, 1)
    bitmask = None
    if grammar == "bitmask":
        allowed = torch.ones(2, vocab, dtype=torch.bool)
        allowed[0, 0] = False  # the draft rows forbid token 0, the bonus rows nothing
        bitmask = bitmask_of(allowed).repeat(batch, 1)
    sampling = vllm.SamplingMetadata(temperature=torch.ones(batch), all_greedy=False,
                                     all_random=True, spec_token_ids=[[-1]] * batch)
    out = vllm.rejection_sample(metadata, q.expand(batch, vocab), logits, sampling,
                                seed=torch.arange(batch) + 5, token_bitmask=bitmask,
                                validate=False)
    p = torch.softmax(forbidden.double(), -1)
    residual = (p - q.double()).clamp(min=0)
    return out[:, 0], residual / residual.sum()


@pytest.mark.parametrize("grammar", ["logits", "bitmask"])
def test_vllm_minus_one_draft_with_probs_follows_the_residual(grammar):
    """Chi-square, false-alarm rate ALPHA = 1e-4, power >= 0.99 at TV 0.02 (asserted)."""
    tokens, law = _invalid_draft_law_round(LAW_BATCH, torch.Generator().manual_seed(31), grammar)
    assert _law_pvalue(tokens, law) > ALPHA


def test_vllm_law_catches_minus_one_sampled_from_p(monkeypatch):
    monkeypatch.setattr(vllm_v1, "stand_ins_for_invalid_drafts",
                        lambda step, rows, draft_probs, sm, bitmask: step.draft_token_ids)
    tokens, law = _invalid_draft_law_round(LAW_BATCH, torch.Generator().manual_seed(31))
    assert _law_pvalue(tokens, law) < ALPHA, "the chi-square test missed -1 sampled from p"


def test_vllm_law_catches_the_stand_in_ignoring_the_bitmask(monkeypatch):
    """Planted bug (issue 47, the code before its fix): the stand-in for a -1 draft looks for a
    -inf logit only, so under a grammar given as token_bitmask the correction is a sample of
    the masked p instead of the residual."""
    real = vllm_v1.stand_ins_for_invalid_drafts
    monkeypatch.setattr(vllm_v1, "stand_ins_for_invalid_drafts",
                        lambda step, rows, draft_probs, sm, bitmask: real(step, rows,
                                                                          draft_probs, sm))
    tokens, law = _invalid_draft_law_round(LAW_BATCH, torch.Generator().manual_seed(31),
                                           "bitmask")
    assert _law_pvalue(tokens, law) < ALPHA, "the chi-square test missed the bitmask ignored"


def test_vllm_async_placeholders_in_the_host_lists_keep_the_real_drafts():
    """vLLM's async scheduler leaves -1 placeholders in ``spec_token_ids`` while
    ``draft_token_ids`` holds the real drafts (it refreshes the host lists only for structured
    output, penalties and bad words): with draft probabilities and a masked vocabulary, the
    call gives the tokens of the same call with the real host lists, not a forbidden stand-in
    in place of draft 1."""
    metadata, logits, draft_probs = _vllm_problem([3, 2, 1], seed=12)
    logits[:, 0] = -math.inf  # a masked token in every row: the stand-ins' candidates
    real = [metadata.draft_token_ids[s:e].tolist() for s, e in ((0, 3), (3, 5), (5, 6))]
    outs = []
    for spec in (real, [[-1] * len(d) for d in real]):
        sampling = vllm.SamplingMetadata(temperature=torch.ones(3), all_greedy=False,
                                         all_random=True, spec_token_ids=spec)
        outs.append(vllm.rejection_sample(metadata, draft_probs, logits.clone(), sampling,
                                          seed=torch.tensor([3, 4, 5]), validate=False))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("spec", [[7, 8, 9], [[1, 2, 3]], torch.zeros(3, 3)])
def test_vllm_malformed_spec_token_ids_with_probs_raise_before_any_write(spec):
    metadata, logits, draft_probs = _vllm_problem([3, 2, 1], seed=13)
    mask = torch.zeros(3, logits.shape[1], dtype=torch.bool)
    mask[:, :2] = True
    sampling = vllm.SamplingMetadata(temperature=torch.ones(3), all_greedy=False,
                                     all_random=True, allowed_token_ids_mask=mask,
                                     spec_token_ids=spec)
    before = logits.clone()
    with pytest.raises(ValueError, match="^spec_token_ids"):
        vllm.rejection_sample(metadata, draft_probs, logits, sampling, seed=0, validate=False)
    assert torch.equal(logits, before)
    sampling.spec_token_ids = []  # no host lists (vLLM's own tests): accepted
    vllm.rejection_sample(metadata, draft_probs, logits, sampling, seed=0, validate=False)
