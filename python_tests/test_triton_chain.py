"""Triton chain verification against the reference, token for token, in every dtype and mode.

Runs under TRITON_INTERPRET=1 on CPU (CI) or on a GPU. Requests may differ only when a
decision sits within float rounding of its threshold: the measured rate is printed and bounded.
"""
from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference.sampling import processed_probs
from conftest import DEVICE, DTYPES, MAX_MISMATCH_RATE, mixed_params, needs_triton, spy_launches

pytestmark = needs_triton
MODES = ["one_hot", "draft_probs", "draft_logits"]


def _problem(batch, num_drafts, vocab, dtype, mode, gen, params):
    """Target logits, drafts drawn from the draft distribution (so some are accepted), and the
    draft argument of ``mode``; the draft is close to the target so acceptance is frequent."""
    target = torch.randn(batch, num_drafts + 1, vocab, generator=gen) * 2.5
    noise = torch.randn(batch, num_drafts, vocab, generator=gen)
    draft_logits = (target[:, :num_drafts] + noise).to(dtype)
    target = target.to(dtype)
    kwargs = {}
    if mode == "draft_probs":
        q = torch.softmax(draft_logits.float(), -1)
        kwargs["draft_probs"] = q
    elif mode == "draft_logits":
        q = processed_probs(draft_logits, params["temperature"], params["top_k"].clamp(max=2**31 - 1),
                            params["top_p"])
        q = torch.where(q.sum(-1, keepdim=True) > 0, q, 1.0)
        kwargs["draft_logits"] = draft_logits
    else:
        q = torch.softmax(target[:, :num_drafts].float(), -1)  # drafts near the target's mode
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_drafts) \
        if num_drafts else torch.zeros(batch, 0, dtype=torch.int64)
    return target, drafts, kwargs


def _run(target, drafts, kwargs, params, num_draft_tokens, seeds, offsets):
    to = lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
    got = sk.verify_chain(to(target), to(drafts), num_draft_tokens=to(num_draft_tokens),
                          seed=to(seeds), offset=to(offsets), backend="triton",
                          **{k: to(v) for k, v in kwargs.items()},
                          **{k: to(v) for k, v in params.items()})
    want = sk.verify_chain(target, drafts, num_draft_tokens=num_draft_tokens, seed=seeds,
                           offset=offsets, backend="reference", **kwargs, **params)
    tokens, accepted = got.output_token_ids.cpu(), got.num_accepted.cpu()
    assert tokens.dtype == torch.int32 and accepted.dtype == torch.int32
    assert tokens.shape == want.output_token_ids.shape
    same = (tokens == want.output_token_ids).all(1) & (accepted == want.num_accepted)
    return tokens, accepted, want, same


MISMATCHES = {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_verify_chain_matches_reference(dtype, mode):
    gen = torch.Generator().manual_seed(hash((str(dtype), mode)) % 2**31)
    total = differ = accepted_total = 0
    for batch, num_drafts, vocab in ((12, 3, 301), (6, 1, 2048), (6, 4, 7)):
        params = mixed_params(batch, vocab, gen)
        target, drafts, kwargs = _problem(batch, num_drafts, vocab, dtype, mode, gen, params)
        target[0, :, vocab // 2:] = -torch.inf   # a mask on every row of request 0
        target[1, 0, 0] = torch.nan
        num_draft_tokens = torch.randint(0, num_drafts + 1, (batch,), generator=gen)
        num_draft_tokens[:2] = num_drafts
        seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)
        offsets = torch.randint(0, 2**40, (batch,), generator=gen)
        tokens, accepted, want, same = _run(target, drafts, kwargs, params, num_draft_tokens,
                                            seeds, offsets)
        assert ((tokens >= -1) & (tokens < vocab)).all()
        total += batch
        differ += int((~same).sum())
        accepted_total += int(accepted.sum())
    rate = differ / total
    MISMATCHES[(dtype, mode)] = (differ, total)
    print(f"verify_chain {mode} {dtype}: {differ}/{total} requests differ ({rate:.2%}), "
          f"{accepted_total} drafts accepted")
    assert accepted_total > 0
    assert rate <= MAX_MISMATCH_RATE


def test_many_random_cases_mismatch_rate():
    """A larger sweep in bf16 with everything mixed; prints the rate over all requests."""
    gen = torch.Generator().manual_seed(2024)
    total = differ = 0
    for trial in range(3):
        mode = MODES[trial % 3]
        batch, num_drafts, vocab = 40, 3, 113 + 50 * trial
        params = mixed_params(batch, vocab, gen)
        target, drafts, kwargs = _problem(batch, num_drafts, vocab, torch.bfloat16, mode, gen, params)
        num_draft_tokens = torch.randint(0, num_drafts + 1, (batch,), generator=gen)
        seeds = torch.randint(-2**62, 2**62, (batch,), generator=gen)
        offsets = torch.randint(0, 2**40, (batch,), generator=gen)
        *_, same = _run(target, drafts, kwargs, params, num_draft_tokens, seeds, offsets)
        total += batch
        differ += int((~same).sum())
    print(f"verify_chain sweep: {differ}/{total} requests differ ({differ / total:.2%})")
    assert differ / total <= MAX_MISMATCH_RATE


@pytest.mark.parametrize("mode", MODES)
def test_edge_cases(mode):
    gen = torch.Generator().manual_seed(1)
    # K = 0: the bonus token only.
    for vocab in (1, 33):
        params = mixed_params(6, vocab, gen)
        target, drafts, kwargs = _problem(6, 0, vocab, torch.float32, mode, gen, params)
        *_, same = _run(target, drafts, kwargs, params, None, torch.arange(6), torch.zeros(6, dtype=torch.long))
        assert same.all()
    # V = 1: every draft is token 0 and is accepted unless the row is masked.
    params = mixed_params(5, 1, gen)
    target, drafts, kwargs = _problem(5, 2, 1, torch.float16, mode, gen, params)
    target[4, 1] = -torch.inf
    tokens, accepted, want, same = _run(target, drafts, kwargs, params, None, torch.arange(5),
                                        torch.zeros(5, dtype=torch.long))
    assert same.all()
    # A row with no finite logit, NaN rows, p == q and q(d) == 0.
    batch, num_drafts, vocab = 8, 2, 50
    params = dict(temperature=torch.tensor([1.0, 0.0, 0.8, 1.0, 1.0, 0.7, 1.2, 0.0]),
                  top_k=torch.tensor([0, 0, 5, 0, 0, 0, 3, 0]),
                  top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 1.0, 1.0, 0.9, 1.0]))
    target, drafts, kwargs = _problem(batch, num_drafts, vocab, torch.bfloat16, mode, gen, params)
    target[0, 0] = -torch.inf            # rejected (p = 0), then the correction row has no mass
    target[1, 1] = torch.nan             # greedy row of NaN: -1 if reached
    target[2, :, ::2] = -torch.inf
    if mode == "draft_logits":
        kwargs["draft_logits"][3:5] = target[3:5, :num_drafts]        # p == q
    if mode == "draft_probs":
        kwargs["draft_probs"][3:5] = processed_probs(target[3:5, :num_drafts], params["temperature"][3:5],
                                                     params["top_k"][3:5], params["top_p"][3:5])
        kwargs["draft_probs"][5, 0, drafts[5, 0]] = 0.0               # q(d) == 0
    tokens, accepted, want, same = _run(target, drafts, kwargs, params, None, torch.arange(batch) + 9,
                                        torch.full((batch,), 2))
    assert same.all(), (tokens, want)
    assert tokens[0, 0] == -1 or accepted[0] == 0


def test_split_vocabulary_race(monkeypatch):
    from specdec_kernels import _rng
    from specdec_kernels.triton import race, stats
    gen = torch.Generator().manual_seed(4)
    batch, num_drafts, vocab = 12, 3, 600
    results = []
    params = mixed_params(batch, vocab, gen)
    target, drafts, kwargs = _problem(batch, num_drafts, vocab, torch.bfloat16, "draft_logits", gen, params)
    monkeypatch.setattr(_rng, "RACE_GROUP", 32)  # 19 groups, 2 per chunk of 64
    for override in (None, 64):  # 64: the race and the row statistics split over programs
        monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", override)
        monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", override)
        tokens, accepted, want, same = _run(target, drafts, kwargs, params, None, torch.arange(batch),
                                            torch.ones(batch, dtype=torch.long))
        results.append(tokens)
        assert same.all()
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", [None, 96])
def test_multi_group_race(monkeypatch, mode, chunk):
    """Groups of 16 tokens over V = 203 (13 groups, the last one partial), in one program per
    request or split over chunks of 6 groups: both levels of the race equal the reference."""
    from specdec_kernels import _rng
    from specdec_kernels.triton import race
    monkeypatch.setattr(_rng, "RACE_GROUP", 16)
    monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", chunk)
    gen = torch.Generator().manual_seed(11)
    batch, num_drafts, vocab = 20, 3, 203
    params = mixed_params(batch, vocab, gen)
    target, drafts, kwargs = _problem(batch, num_drafts, vocab, torch.float32, mode, gen, params)
    *_, same = _run(target, drafts, kwargs, params, None, torch.arange(batch) + 3,
                    torch.full((batch,), 5))
    assert same.all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("race_chunk", [None, 64])
def test_split_unfiltered_statistics_merged_by_the_race(monkeypatch, mode, race_chunk):
    """Rows split over programs with no filter on: the race merges the partials itself (no
    finish kernel), the target's and the draft logits', in its acceptance replay and its
    row, in one program or in chunks, and the tokens equal the reference (greedy, sampled
    and no-finite-logit rows)."""
    from specdec_kernels import _rng
    from specdec_kernels.triton import race, stats
    monkeypatch.setattr(_rng, "RACE_GROUP", 32)
    monkeypatch.setattr(stats, "STATS_CHUNK_OVERRIDE", 100)
    monkeypatch.setattr(race, "RACE_CHUNK_OVERRIDE", race_chunk)
    launched = spy_launches(monkeypatch, stats, "_row_stats_finish_kernel")
    gen = torch.Generator().manual_seed(13)
    batch, num_drafts, vocab = 10, 3, 450
    params = dict(temperature=torch.tensor([0.0, 1.0, 0.6, 1.4, 0.0] * 2))
    target, drafts, kwargs = _problem(batch, num_drafts, vocab, torch.bfloat16, mode, gen,
                                      dict(params, top_k=torch.zeros(batch, dtype=torch.long),
                                           top_p=torch.ones(batch)))
    target[1, 1] = -torch.inf     # a row with no finite logit
    target[2, :, :300] = -torch.inf  # the leading chunks of every row masked
    *_, same = _run(target, drafts, kwargs, params, None, torch.arange(batch) + 21,
                    torch.full((batch,), 4))
    assert same.all()
    assert not launched  # neither the target rows nor the draft logits' rows


def test_large_vocabulary():
    gen = torch.Generator().manual_seed(8)
    vocab = 128256
    params = dict(temperature=torch.tensor([1.0, 0.7]), top_k=torch.tensor([0, 50]),
                  top_p=torch.tensor([1.0, 0.95]))
    target, drafts, kwargs = _problem(2, 1, vocab, torch.bfloat16, "draft_logits", gen, params)
    *_, same = _run(target, drafts, kwargs, params, None, torch.tensor([5, 6]), torch.tensor([0, 1]))
    assert same.all()


def test_garbage_with_validate_false_stays_in_range():
    gen = torch.Generator().manual_seed(9)
    batch, num_drafts, vocab = 16, 4, 40
    for mode in MODES:
        params = mixed_params(batch, vocab, gen)
        target, _, kwargs = _problem(batch, num_drafts, vocab, torch.float16, mode, gen, params)
        target[torch.rand(target.shape, generator=gen) < 0.2] = torch.nan
        target[torch.rand(target.shape, generator=gen) < 0.2] = torch.inf
        target[3] = -torch.inf
        if mode == "draft_probs":
            kwargs["draft_probs"][torch.rand(kwargs["draft_probs"].shape, generator=gen) < 0.1] = torch.nan
            kwargs["draft_probs"][0] = -1.0
        drafts = torch.randint(-2**40, 2**40, (batch, num_drafts), generator=gen)
        drafts[:, 0] = torch.randint(-3, vocab + 3, (batch,), generator=gen)
        num_draft_tokens = torch.randint(-5, num_drafts + 5, (batch,), generator=gen)
        out = sk.verify_chain(target.to(DEVICE), drafts.to(DEVICE), num_draft_tokens=num_draft_tokens.to(DEVICE),
                              seed=5, backend="triton", validate=False,
                              **{k: v.to(DEVICE) for k, v in kwargs.items()},
                              **{k: v.to(DEVICE) for k, v in params.items()})
        tokens, accepted = out.output_token_ids.cpu(), out.num_accepted.cpu()
        assert ((tokens >= -1) & (tokens < vocab)).all()
        assert ((accepted >= 0) & (accepted <= num_drafts)).all()
        assert (tokens[3] == -1).all() or accepted[3] == 0
        # The valid garbage (ids, lengths, NaN logits) is defined: same as the reference.
        want = sk.verify_chain(target, drafts, num_draft_tokens=num_draft_tokens, seed=5,
                               backend="reference", validate=False, **kwargs, **params)
        same = (tokens == want.output_token_ids).all(1)
        assert same.all(), (mode, tokens, want.output_token_ids)
    # Garbage parameters: negative / NaN temperature, huge top_k, never an id out of range.
    params = dict(temperature=torch.tensor([-1.0, float("nan"), 1e-42, 3e38] * 4),
                  top_k=torch.tensor([-4, 2**40, 1, 0] * 4), top_p=torch.tensor([0.0, -1.0, 2.0, float("nan")] * 4))
    out = sk.verify_chain(target.to(DEVICE), drafts.to(DEVICE), seed=1, backend="triton", validate=False,
                          **{k: v.to(DEVICE) for k, v in params.items()})
    assert ((out.output_token_ids >= -1) & (out.output_token_ids < vocab)).all()
