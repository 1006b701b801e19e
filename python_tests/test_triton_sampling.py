"""Triton row statistics and ``sample`` against the reference, token for token.

Runs under TRITON_INTERPRET=1 on CPU (CI) or on a GPU. Token mismatches are allowed only
when a decision sits within float rounding of its threshold; the measured rate is printed
and bounded.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import specdec_kernels as sk
from specdec_kernels import _params
from specdec_kernels.reference import sampling as ref
from specdec_kernels.triton import _tiles, filters, race, stats
from conftest import DEVICE, DTYPES, MAX_MISMATCH_RATE, mixed_params, needs_triton, spy_launches

pytestmark = needs_triton


def _logits(shape, dtype, gen, scale=3.0):
    x = torch.randn(shape, generator=gen) * scale
    return x.to(dtype).to(DEVICE)


def _row_stats(logits, params, **kwargs):
    """``row_stats`` of ``[B, V]`` logits (one row per request)."""
    return stats.row_stats(logits[:, None], params, **kwargs)


def _stats_probs(logits, params):
    """Probabilities rebuilt from the kernel's row statistics (x_max, x_thr, norm, argmax)."""
    result = _row_stats(logits, params)
    stats, argmax = result.stats.cpu(), result.argmax.cpu()
    x = logits.float().cpu()
    x = torch.where(torch.isfinite(x), x, -torch.inf)
    t = params.temperature.cpu()[:, None]
    inv_t = torch.where(t == 0, 1.0, 1.0 / torch.where(t == 0, 1.0, t))
    x_max, x_thr, norm = stats[:, 0:1], stats[:, 1:2], stats[:, 2:3]
    kept = (x > -torch.inf) & (x >= x_thr)
    probs = torch.where(kept, torch.exp((x - x_max) * inv_t) / norm, 0.0)
    one_hot = torch.zeros_like(probs).scatter_(1, argmax.long()[:, None], 1.0)
    probs = torch.where(t == 0, one_hot, probs)
    return torch.where(x_max > -torch.inf, probs, 0.0), argmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 5, 257, 1000])
def test_row_stats_give_the_reference_distribution(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    batch = 20
    logits = _logits((batch, vocab), dtype, gen)
    if vocab > 4:
        logits[1, ::3] = -torch.inf            # a grammar mask
        logits[2] = -torch.inf                 # no finite logit
        logits[3, 1] = torch.nan               # NaN counts as -inf
        logits[4, :vocab // 2] = logits[4, 0]  # a block of exact ties (kth boundary ties kept)
    params = _params.sampling_params(**mixed_params(batch, vocab, gen, DEVICE), batch=batch,
                                     vocab_size=vocab, device=logits.device, validate=True)
    probs, argmax = _stats_probs(logits, params)
    expected = ref.processed_probs(logits.cpu(), params.temperature.cpu(), params.top_k.cpu(),
                                   params.top_p.cpu())
    # The kept set (top-k/top-p thresholds, masks) is exact; the values within rounding.
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=2e-5, atol=1e-7)
    x = torch.where(torch.isfinite(logits.float().cpu()), logits.float().cpu(), -torch.inf)
    assert torch.equal(argmax.long(), x.argmax(-1))


@pytest.mark.parametrize("search", [None, "gpu"])
def test_top_k_ties_and_top_p_boundaries_are_exact(monkeypatch, search):
    """Integer logits: many exact ties, so off-by-one thresholds would show. ``gpu`` runs the
    GPU's search shape (8 pivots a pass, blocks of 16 logits streamed 4 per iteration) where the
    interpreter otherwise uses one block and 256 pivots: more passes, the same thresholds."""
    if search == "gpu":
        monkeypatch.setattr(filters, "SEARCH_CONFIG_OVERRIDE", (16, 4, filters.NUM_PIVOTS))
    gen = torch.Generator().manual_seed(3)
    batch, vocab = 24, 300
    logits = torch.randint(-6, 6, (batch, vocab), generator=gen).float().to(DEVICE)
    top_k = torch.randint(1, 40, (batch,), generator=gen).to(DEVICE)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.99, 1.0, 0.3] * 4).to(DEVICE)
    for kw in (dict(top_k=top_k), dict(top_p=top_p), dict(top_k=top_k, top_p=top_p)):
        params = _params.sampling_params(0.8, kw.get("top_k"), kw.get("top_p"), batch=batch,
                                         vocab_size=vocab, device=logits.device, validate=True)
        probs, _ = _stats_probs(logits, params)
        expected = ref.processed_probs(logits.cpu(), params.temperature.cpu(), params.top_k.cpu(),
                                       params.top_p.cpu())
        assert torch.equal(probs > 0, expected > 0), kw


def _compare_sample(logits, params, seeds, offsets):
    tokens = sk.sample(logits, seed=seeds, offset=offsets, backend="triton", **params)
    expected = sk.sample(logits.cpu(), seed=seeds.cpu(), offset=offsets.cpu(), backend="reference",
                         **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in params.items()})
    assert tokens.dtype == torch.int32 and tokens.shape == expected.shape
    return tokens.cpu(), expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_matches_reference_token_for_token(dtype):
    gen = torch.Generator().manual_seed(11)
    total = mismatched = 0
    for vocab in (1, 7, 1023, 3001):
        batch = 20
        logits = _logits((batch, vocab), dtype, gen)
        if vocab > 2:
            logits[0, vocab // 2:] = -torch.inf
            logits[1] = -torch.inf
            logits[2, 0] = torch.nan
        seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen).to(DEVICE)
        offsets = torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE)
        for params in (mixed_params(batch, vocab, gen, DEVICE), dict(temperature=1.0),
                       dict(temperature=0.0)):
            tokens, expected = _compare_sample(logits, params, seeds, offsets)
            assert ((tokens >= -1) & (tokens < vocab)).all()
            if vocab > 2:
                assert tokens[1] == -1
            total += batch
            mismatched += int((tokens != expected).sum())
    rate = mismatched / total
    print(f"sample {dtype}: {mismatched}/{total} tokens differ ({rate:.3%})")
    assert rate <= MAX_MISMATCH_RATE


def test_sample_split_vocabulary_race(monkeypatch):
    """The split-V race (several programs per request + deterministic reduction) gives the
    same tokens as one program per request, and as the reference."""
    from specdec_kernels import _rng
    monkeypatch.setattr(_rng, "RACE_GROUP", 64)  # 16 groups, 2 per chunk of 128
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 12, 1000
    logits = _logits((batch, vocab), torch.bfloat16, gen)
    logits[3] = -torch.inf
    params = mixed_params(batch, vocab, gen, DEVICE)
    seeds = torch.arange(batch, device=DEVICE)
    offsets = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    whole = sk.sample(logits, seed=seeds, offset=offsets, backend="triton", **params)
    monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", 128)
    assert race.race_chunks(batch, vocab, logits.device)[1] > 1
    split = sk.sample(logits, seed=seeds, offset=offsets, backend="triton", **params)
    assert torch.equal(whole, split)
    assert torch.equal(split.cpu(), sk.sample(logits.cpu(), seed=seeds.cpu(), offset=offsets.cpu(),
                                              backend="reference",
                                              **{k: v.cpu() for k, v in params.items()}))
    assert split[3] == -1


def test_sample_large_vocabulary():
    gen = torch.Generator().manual_seed(7)
    vocab = 128256
    logits = _logits((2, vocab), torch.bfloat16, gen)
    params = dict(temperature=torch.tensor([1.0, 0.6], device=DEVICE),
                  top_p=torch.tensor([1.0, 0.9], device=DEVICE))
    seeds = torch.tensor([1, 2], device=DEVICE)
    offsets = torch.tensor([3, 4], device=DEVICE)
    tokens, expected = _compare_sample(logits, params, seeds, offsets)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_statistics_equal_one_program_per_row(monkeypatch, dtype):
    """Rows split over programs (partials merged by ``_row_stats_finish_kernel``) give the
    same thresholds and arg-max as one program per row, and a norm within float rounding.
    Covers chunks without a finite logit, the row maximum in two chunks (the lower id wins)
    and a vocabulary that is not a multiple of the chunk."""
    gen = torch.Generator().manual_seed(11)
    batch, vocab = 15, 1000
    logits = _logits((batch, vocab), dtype, gen)
    logits[1, :700] = -torch.inf             # leading chunks with no finite logit
    logits[2] = -torch.inf                   # no finite logit at all
    logits[3, 10] = logits[3, 900] = 50.0    # the maximum in the first and the last chunk
    logits[4, 5] = torch.nan
    params = _params.sampling_params(**mixed_params(batch, vocab, gen, DEVICE), batch=batch,
                                     vocab_size=vocab, device=logits.device, validate=True)
    whole = _row_stats(logits, params)
    for override in (64, 100, 256):
        monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", override)
        assert stats.stats_chunks(batch, vocab, logits.device)[1] > 1
        split = _row_stats(logits, params)
        assert torch.equal(split[1], whole[1]), "arg-max"
        assert int(split[1][3]) == 10
        assert torch.equal(split[0][:, :2], whole[0][:, :2]), "x_max and the top-k/top-p cut"
        torch.testing.assert_close(split[0][:, 2], whole[0][:, 2], rtol=2e-6, atol=0)


@triton.jit
def _read_row_stats(stats_ptr, argmax_ptr, temperature_ptr, out_f_ptr, out_i_ptr,
                    STATS_CHUNKS: tl.constexpr, STATS_CHUNKS_P2: tl.constexpr):
    """Row r's statistics as a consuming kernel sees them (``load_row_stats``)."""
    r = tl.program_id(0)
    scale = _tiles.exp2_scale(tl.load(temperature_ptr + r))
    x_max, x_thr, norm, argmax = stats.load_row_stats(
        stats_ptr, argmax_ptr, r, tl.full([], 1, tl.int1), scale, STATS_CHUNKS, STATS_CHUNKS_P2)
    tl.store(out_f_ptr + r * 3 + 0, x_max)
    tl.store(out_f_ptr + r * 3 + 1, x_thr)
    tl.store(out_f_ptr + r * 3 + 2, norm)
    tl.store(out_i_ptr + r, argmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumers_merge_unfiltered_partials_as_the_finish_kernel(monkeypatch, dtype):
    """Split rows with no filter on: ``row_stats(merge_in_consumer=True)`` skips the finish
    kernel and returns the partials, and a consuming kernel's ``load_row_stats`` reads from
    them exactly the finish kernel's statistics (every bit, greedy and sampled rows, rows
    with no finite logit or a NaN). Filtered rows are still finished (their search)."""
    gen = torch.Generator().manual_seed(12)
    batch, vocab = 9, 1000
    logits = _logits((batch, vocab), dtype, gen)
    logits[1, :700] = -torch.inf
    logits[2] = -torch.inf
    logits[3, 10] = logits[3, 900] = 50.0
    logits[4, 5] = torch.nan
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 2.0, 0.0, 0.5, 1.0], device=DEVICE)
    params = _params.sampling_params(temperature, None, None, batch=batch, vocab_size=vocab,
                                     device=logits.device, validate=True)
    monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", 100)
    finished = _row_stats(logits, params)
    launched = spy_launches(monkeypatch, stats, "_row_stats_finish_kernel")
    partials = _row_stats(logits, params, merge_in_consumer=True)
    assert partials.chunks == stats.stats_chunks(batch, vocab, logits.device)[1] > 1
    assert not launched
    out_f = torch.empty((batch, 3), dtype=torch.float32, device=DEVICE)
    out_i = torch.empty(batch, dtype=torch.int32, device=DEVICE)
    _read_row_stats[(batch,)](partials.stats, partials.argmax, params.temperature, out_f, out_i,
                              **partials.constexprs())
    assert finished.chunks == 1
    assert torch.equal(out_f.view(torch.int32), finished.stats.view(torch.int32))
    assert torch.equal(out_i, finished.argmax)
    # Filters on: the finish kernel runs (it searches the thresholds), whatever the caller asks.
    filtered = _params.sampling_params(temperature, 5, None, batch=batch, vocab_size=vocab,
                                       device=logits.device, validate=True)
    assert _row_stats(logits, filtered, merge_in_consumer=True).chunks == 1
    assert len(launched) == 1


@pytest.mark.parametrize("candidates", [0, 12, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_search_shape_gives_the_same_thresholds(monkeypatch, dtype, candidates):
    """The top-k/top-p search in the GPU's shape (8 pivots a pass, 4 unrolled blocks of 16
    logits) finds exactly the thresholds of the interpreter's shape (256 pivots, one block):
    the search is exact whatever the number of passes, on random logits (fp32: many distinct
    keys, so the most passes). ``candidates``: the candidate list's size, 0 (every pass reads
    the row), 12 (passes over the row until the kept set is small, then over the list) or
    2048 (the list from the start: it holds every row here)."""
    monkeypatch.setattr(filters, "SEARCH_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(21)
    batch, vocab = 20, 1000
    logits = _logits((batch, vocab), dtype, gen)
    logits[1, ::3] = -torch.inf
    params = _params.sampling_params(**mixed_params(batch, vocab, gen, DEVICE), batch=batch,
                                     vocab_size=vocab, device=logits.device, validate=True)
    wide = _row_stats(logits, params)
    monkeypatch.setattr(filters, "SEARCH_CONFIG_OVERRIDE", (16, 4, filters.NUM_PIVOTS))
    narrow = _row_stats(logits, params)
    assert torch.equal(narrow[0][:, :2], wide[0][:, :2]) and torch.equal(narrow[1], wide[1])
    torch.testing.assert_close(narrow[0][:, 2], wide[0][:, 2], rtol=2e-6, atol=0)
