"""What the chain, tree and sampler checks share: the budget, calling the callable, the
tests on completed windows, and the seed / batch checks."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import _laws, _stats
from ._laws import SamplingSetting
from .report import TestResult

PARAMS = ("temperature", "top_k", "top_p", "min_p")


@dataclass
class Budget:
    """How a check sizes itself. ``samples`` (trials per configuration) overrides the size
    chosen from ``power`` against ``TV >= tv``; ``max_samples`` caps it (the power reported
    is then what the capped size has). ``batch_size`` caps the rows of one call."""
    alpha: float = 1e-3
    tv: float = 0.05
    power: float = 0.95
    samples: Optional[int] = None
    max_samples: int = 400_000
    batch_size: int = 1 << 16
    seed: int = 0

    def trials(self, dof: int, tests: int) -> int:
        if self.samples is not None:
            return int(self.samples)
        needed = _stats.draws_for_power(dof, _stats.tail_alpha(self.alpha, tests), self.tv,
                                        self.power)
        return min(needed, self.max_samples)


def describe(fn) -> str:
    """A callable's name for a report title (``functools.partial`` shows its bound keywords)."""
    if isinstance(fn, functools.partial):
        bound = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        return f"{describe(fn.func)}({bound})" if bound else describe(fn.func)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclass
class Plan:
    """What a window check (chain or tree) runs: its configurations, their size and level."""
    settings: list
    greedy: list
    configs: list      # (method, draft mode, setting)
    tests: int         # statistical tests, for Bonferroni
    alpha_test: float
    trials: int        # per configuration
    pass_method: bool  # pass method= (more than "token" declared)
    caller: "Caller"
    gen: torch.Generator


def plan_windows(fn, *, outputs: int, params, draft_modes, methods, depth: int, vocab: int,
                 exact_acceptance, extra_tests: int, budget: "Budget", seeded: bool,
                 per_request: bool, device) -> Plan:
    """``exact_acceptance(method)``: whether that method has an exact acceptance law."""
    settings = sampled_settings(params)
    greedy = [SamplingSetting(temperature=0.0)] if "temperature" in params else []
    configs = [(m, d, s) for m in methods for d in draft_modes for s in settings]
    tests = sum(window_test_count(depth, exact_acceptance(m)) for m, _, _ in configs) + extra_tests
    trials = budget.trials(vocab ** (depth + 1) - 1, tests)
    caller = Caller(fn, outputs=outputs, device=device, seeded=seeded,
                    batch_size=budget.batch_size, seed=budget.seed, per_request=per_request)
    return Plan(settings, greedy, configs, tests, budget.alpha / tests, trials,
                tuple(methods) != ("token",), caller,
                torch.Generator().manual_seed(budget.seed + 1))


def check_declared(params: Sequence[str], allowed: Sequence[str], what: str) -> None:
    unknown = [p for p in params if p not in allowed]
    if unknown:
        raise ValueError(f"{what}: expected a subset of {tuple(allowed)}, got {tuple(params)}")


def sampled_settings(params: Sequence[str]) -> list:
    """The sampled (non-greedy) settings tried for the declared parameters: plain, each
    parameter alone, and all of them together."""
    check_declared(params, PARAMS, "params")
    alone = {"temperature": SamplingSetting(temperature=0.7),
             "top_k": SamplingSetting(top_k=2),
             "top_p": SamplingSetting(top_p=0.8),
             "min_p": SamplingSetting(min_p=0.2)}
    together = SamplingSetting(temperature=1.3 if "temperature" in params else None,
                               top_k=3 if "top_k" in params else None,
                               top_p=0.9 if "top_p" in params else None,
                               min_p=0.05 if "min_p" in params else None)
    settings = [SamplingSetting()] + [alone[p] for p in PARAMS if p in params]
    if len(params) > 1:
        settings.append(together)
    return settings


def per_request_kwargs(setting: SamplingSetting, batch: int, device, per_request: bool) -> dict:
    out = {}
    for name, value in setting.kwargs().items():
        if not per_request:
            out[name] = value
        elif name == "top_k":
            out[name] = torch.full((batch,), int(value), dtype=torch.int64, device=device)
        else:
            out[name] = torch.full((batch,), float(value), dtype=torch.float32, device=device)
    return out


def request_seeds(base: int, batch: int) -> tuple:
    """Distinct per-request seeds and one offset: a pure function of ``base``."""
    seeds = base * 1_000_003 + torch.arange(batch, dtype=torch.int64)
    return seeds, torch.full((batch,), 11, dtype=torch.int64)


class Caller:
    """Calls the user's callable in chunks of ``batch_size`` rows. Per-request tensors are
    split with the rows; an unseeded callable runs under ``torch.manual_seed`` of a counter,
    so a run is reproducible without disturbing the caller's generator."""

    def __init__(self, fn: Callable, *, outputs: int, device, seeded: bool, batch_size: int,
                 seed: int, per_request: bool = True):
        self.fn, self.outputs, self.device, self.seeded = fn, outputs, torch.device(device), seeded
        self.batch_size, self.seed, self.per_request, self.calls = batch_size, seed, per_request, 0

    def __call__(self, args: Sequence, kwargs: dict, batch: int) -> list:
        results = []
        for start in range(0, batch, self.batch_size):
            stop = min(batch, start + self.batch_size)

            def piece(x):
                if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
                    return x[start:stop].to(self.device)
                return x.to(self.device) if isinstance(x, torch.Tensor) else x

            call_args = [piece(a) for a in args]
            call_kwargs = {k: piece(v) for k, v in kwargs.items()}
            with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                torch.manual_seed(self.seed * 7919 + self.calls)
                self.calls += 1
                out = self.fn(*call_args, **call_kwargs)
            if isinstance(out, torch.Tensor):
                out = (out,)
            results.append([torch.as_tensor(o).detach().to("cpu", torch.int64)
                            for o in list(out)[:self.outputs]])
        return [torch.cat([r[i] for r in results]) for i in range(self.outputs)]


def emitted_length(ids: torch.Tensor) -> torch.Tensor:
    """Tokens before the first ``-1`` per row."""
    padding = ids < 0
    return torch.where(padding.any(-1), padding.to(torch.int64).argmax(-1), ids.shape[-1])


def window_format(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows that are well formed as ``tokens..., -1...`` with at least one token in range."""
    length = emitted_length(ids)
    position = torch.arange(ids.shape[-1])
    tokens_ok = torch.where(position < length[:, None], (ids >= 0) & (ids < vocab), ids == -1)
    return tokens_ok.all(-1) & (length >= 1)


def format_result(config: str, good: torch.Tensor, what: str) -> TestResult:
    bad = int((~good).sum())
    return TestResult("output format", config, bad == 0, statistic=bad, samples=good.numel(),
                      detail=f"{bad} malformed rows ({what})" if bad else what)


def complete_windows(ids: torch.Tensor, p_table: torch.Tensor, vocab: int, length: int,
                     gen: torch.Generator) -> torch.Tensor:
    """Each row's emitted tokens continued by the target to ``length`` tokens."""
    emitted = emitted_length(ids)
    window = ids[:, :length].clamp(min=0).clone()
    for j in range(length):
        todo = emitted <= j
        if bool(todo.any()):
            rows = p_table[_laws.prefix_index(window[todo, :j], vocab)]
            window[todo, j] = torch.multinomial(rows, 1, generator=gen)[:, 0]
    return window


def chi_result(name: str, config: str, statistic: float, dof: int, impossible: int, draws: int,
               alpha: float, tv: float, alternative: str, detail: str = "") -> TestResult:
    pvalue = _stats.chi_square_pvalue(statistic, dof)
    passed = impossible == 0 and pvalue > alpha
    if impossible:
        detail = (detail + "; " if detail else "") + f"{impossible} draws of a probability-0 token"
    return TestResult(name, config, passed, statistic=statistic, dof=dof, pvalue=pvalue,
                      alpha=alpha, samples=draws,
                      power=_stats.chi_square_power(dof, draws, alpha, tv),
                      alternative=alternative.format(tv=tv), detail=detail)


def window_tests(ids: torch.Tensor, p_table: torch.Tensor, vocab: int, depth: int, config: str,
                 alpha_test: float, tv: float, gen: torch.Generator, *, conditional: str,
                 acceptance_law: Optional[torch.Tensor]) -> list:
    """The law tests of one configuration, on well-formed rows ``ids [B, >= depth+1]``.

    * joint law: the emitted tokens completed by the target to ``depth + 1`` tokens must have
      the target's autoregressive law;
    * position j | prefix: the token at position ``j`` given the tokens before it, against
      the target row of that prefix. ``conditional="emitted"`` uses the rows that emitted it
      (valid for token-level verification: once j drafts are accepted the next step is a
      fresh round); ``"completed"`` uses every completed window (block / traversal, whose
      stopping point depends on later drafts);
    * acceptance law: ``num_accepted`` against its exact law, where one is given.
    """
    length = depth + 1
    window = complete_windows(ids, p_table, vocab, length, gen)
    results = []
    cells = torch.zeros(window.shape[0], dtype=torch.int64)
    for j in range(length):
        cells = cells * vocab + window[:, j]
    law = _laws.window_law(p_table, vocab, length)
    counts = torch.bincount(cells, minlength=vocab ** length)
    stat, dof, impossible = _stats.chi_square_parts(counts, law)
    results.append(chi_result("joint law", config, stat, dof, impossible, int(cells.numel()),
                              alpha_test, tv, "TV>={tv} (window)",
                              f"{vocab}^{length} windows"))
    emitted = emitted_length(ids)
    for j in range(length):
        rows = emitted > j if conditional == "emitted" else torch.ones_like(emitted, dtype=torch.bool)
        strata = _laws.prefix_index(window[rows, :j], vocab)
        stat, dof, impossible, draws = _stats.stratified_chi_square(strata, window[rows, j],
                                                                    p_table)
        results.append(chi_result(f"position {j} | prefix", config, stat, dof, impossible, draws,
                                  alpha_test, tv, "mean TV>={tv}", conditional))
    if acceptance_law is not None:
        accepted = emitted - 1
        counts = torch.bincount(accepted, minlength=len(acceptance_law))[:len(acceptance_law)]
        stat, dof, impossible = _stats.chi_square_parts(counts, acceptance_law)
        mean = float(accepted.double().mean())
        exact = float((torch.arange(len(acceptance_law)) * acceptance_law).sum())
        results.append(chi_result("acceptance law", config, stat, dof, impossible,
                                  int(accepted.numel()), alpha_test, tv, "TV>={tv}",
                                  f"mean {mean:.4f} vs exact {exact:.4f}"))
    return results


def window_test_count(depth: int, acceptance: bool) -> int:
    return 1 + (depth + 1) + int(acceptance)


def exact_result(name: str, config: str, mismatches: int, trials: int, what: str) -> TestResult:
    return TestResult(name, config, mismatches == 0, statistic=mismatches, samples=trials,
                      detail=f"{mismatches} of {trials} trials differ ({what})" if mismatches
                      else what)


def take(args: Sequence, kwargs: dict, order: torch.Tensor, batch: int) -> tuple:
    """The trials ``order`` of a call's inputs: every tensor with ``batch`` rows is indexed."""
    def pick(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x[order]
        return x
    return [pick(a) for a in args], {k: pick(v) for k, v in kwargs.items()}


SEED_TRIALS = 2048


def seed_tests(caller: Callable, trials: int, args: Sequence, kwargs: dict, first: list,
               config: str) -> list:
    """``args``/``kwargs``: an earlier call's inputs (``trials`` rows), ``first`` its outputs.
    One more call holds its first trials again, reversed, and their first half: the same
    seeds must give the same tokens in another call, and a request's tokens must not depend
    on its row or on the other requests of the batch."""
    batch = min(trials, SEED_TRIALS)
    everyone = torch.arange(batch)
    half = everyone[: max(1, batch // 2)]
    order = torch.cat([everyone, torch.flip(everyone, [0]), half])
    second = caller(*take(args, kwargs, order, trials), len(order))

    def differ(rows, start) -> int:
        bad = torch.zeros(len(rows), dtype=torch.bool)
        for x, y in zip(first, second):
            bad |= (x[rows] != y[start:start + len(rows)]).reshape(len(rows), -1).any(-1)
        return int(bad.sum())

    repeat = differ(everyone, 0)
    moved = differ(torch.flip(everyone, [0]), batch) + differ(half, 2 * batch)
    return [exact_result("seed determinism", config, repeat, batch, "same seeds, another call"),
            exact_result("batch invariance", config, moved, batch + len(half),
                         "the batch reversed and its first half, in one call")]


def binomial_result(name: str, config: str, successes: int, trials: int, prob: float,
                    alpha: float) -> TestResult:
    pvalue = _stats.binomial_pvalue(successes, trials, prob)
    return TestResult(name, config, pvalue > alpha, statistic=successes, pvalue=pvalue,
                      alpha=alpha, samples=trials,
                      power=_stats.binomial_power(trials, prob, alpha, 2.0),
                      alternative="rate x2 or /2",
                      detail=f"expected {trials * prob:.3g} (p={prob:.3g})")


def plan_line(configs: int, trials: int, total: int, row_bytes: int, batch_size: int,
              extra: str = "") -> str:
    peak = min(trials, batch_size) * row_bytes
    return (f"plan: {configs} configurations x {trials} trials ({total} rows in all{extra}); "
            f"largest call {min(trials, batch_size)} rows, ~{math.ceil(peak / 2 ** 20)} MiB of inputs")
