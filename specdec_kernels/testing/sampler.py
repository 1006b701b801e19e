"""``check_sampler``: certify a sampler ``logits [B, V] -> token ids [B]``."""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import torch

from . import _core, _laws, _stats
from ._laws import SamplingSetting
from .report import Report


def sampler_rows(vocab: int, seed: int, settings) -> torch.Tensor:
    """Four rows of logits: random, random with two ``-inf`` (masked tokens), a tie at the
    maximum (greedy picks the lowest id), and a peaked row."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(100):
        rows = torch.randn(4, vocab, generator=gen) * 1.5
        rows[1, [1, vocab - 2]] = -math.inf
        rows[2, 3] = rows[2, 5] = rows[2].max() + 0.5
        rows[3] *= 3.0
        if not any(_laws.near_threshold(rows, s) for s in settings):
            return rows.float()
    return rows.float()


def check_sampler(sample: Callable, *, params: Sequence[str] = ("temperature", "top_k", "top_p"),
                  seeded: bool = True, per_request: bool = True, vocab_size: int = 8,
                  alpha: float = 1e-3, tv: float = 0.05, power: float = 0.95,
                  samples: Optional[int] = None, max_samples: int = 400_000,
                  batch_size: int = 1 << 16, tail: bool = False, tail_samples: int = 1 << 20,
                  seed: int = 0, device="cpu") -> Report:
    r"""Certify a sampler: is each token drawn from the processed target distribution?

    ``sample(logits, *, [temperature=..., top_k=..., top_p=..., min_p=...],
    [seed=..., offset=...])``: ``logits`` float32 ``[B, V]``; the declared ``params`` as
    ``[B]`` tensors (or scalars, ``per_request=False``); returns int ``[B]`` token ids (or a
    tuple starting with them). The layout of :func:`specdec_kernels.sample`.

    Tests per parameter setting: format (ids in ``[0, V)``); the law of the token given its
    row (four rows, one with masked ``-inf`` tokens), against the float64 processed
    distribution (contract order: temperature, top-k, min-p, softmax, top-p). Greedy: the
    arg-max, lowest id among ties. Seeded: seed determinism and batch invariance. ``tail``:
    the count of a token of probability ~1e-5 over ``tail_samples`` draws.
    """
    started = time.perf_counter()
    settings = _core.sampled_settings(params)
    rows = sampler_rows(vocab_size, seed, settings)
    budget = _core.Budget(alpha, tv, power, samples, max_samples, batch_size, seed)
    tests = len(settings) + int(tail)
    alpha_test = alpha / tests
    trials = budget.trials(rows.shape[0] * (vocab_size - 1), tests)
    caller = _core.Caller(sample, outputs=1, device=device, seeded=seeded,
                          batch_size=batch_size, seed=seed, per_request=per_request)
    plan = _core.plan_line(len(settings), trials, trials * len(settings), vocab_size * 4,
                           batch_size)
    report = Report(f"check_sampler({_core.describe(sample)}): V={vocab_size}, "
                    f"{tests} statistical tests", alpha, seed, plan)

    def make(setting, batch, base, logits=None):
        which = torch.arange(batch) % rows.shape[0]
        kwargs = _core.per_request_kwargs(setting, batch, device, per_request)
        if seeded:
            seeds, offsets = _core.request_seeds(base, batch)
            kwargs.update(seed=seeds, offset=offsets)
        return [rows[which] if logits is None else logits], kwargs, which

    for index, setting in enumerate(settings):
        config = setting.label()
        args, kwargs, which = make(setting, trials, seed * 1000 + index)
        (ids,) = caller(args, kwargs, trials)
        ids = ids.reshape(-1)
        if index == 0:
            first_call = (args, kwargs, [ids], config)
        good = (ids >= 0) & (ids < vocab_size)
        report.results.append(_core.format_result(config, good, "ids in [0, V)"))
        law = _laws.processed_probs(rows, setting)
        stat, dof, impossible, draws = _stats.stratified_chi_square(which[good], ids[good], law)
        report.results.append(_core.chi_result("law | row", config, stat, dof, impossible, draws,
                                               alpha_test, tv, "mean TV>={tv}",
                                               f"{rows.shape[0]} rows"))
    if "temperature" in params:
        setting = SamplingSetting(temperature=0.0)
        batch = min(trials, 4096)
        args, kwargs, which = make(setting, batch, seed * 1000 + 777)
        (ids,) = caller(args, kwargs, batch)
        expected = _laws.one_hot_rows(rows).argmax(-1)[which]
        report.results.append(_core.exact_result("greedy arg-max", "greedy",
                                                 int((ids.reshape(-1) != expected).sum()), batch,
                                                 "lowest id among ties"))
    if seeded:
        report.results += _core.seed_tests(caller, trials, *first_call)
    if tail:
        logits = torch.zeros(1, vocab_size)
        logits[0, 0] = math.log(1e-5 * (vocab_size - 1) / (1 - 1e-5))
        args, kwargs, _ = make(SamplingSetting(), tail_samples, seed * 1000 + 555,
                               logits.expand(tail_samples, -1).contiguous())
        (ids,) = caller(args, kwargs, tail_samples)
        prob = float(torch.softmax(logits[0].double(), -1)[0])
        report.results.append(_core.binomial_result("tail: token of p~1e-5", "defaults",
                                                    int((ids == 0).sum()), tail_samples, prob,
                                                    alpha_test))
    report.runtime_s = time.perf_counter() - started
    return report
