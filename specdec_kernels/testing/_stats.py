"""Goodness-of-fit tests with their power, and sample sizes chosen from the power asked for.

Power against "total-variation distance >= tv": for any law ``p'`` with ``TV(p', p) >= tv``,
``sum (p' - p)**2 / p >= 4 tv**2`` (Cauchy-Schwarz), so Pearson's statistic on ``N`` draws
has non-centrality at least ``4 N tv**2``; the power is the non-central chi-square's tail
beyond the critical value. For a stratified test (a conditional law per prefix), Jensen's
inequality gives the same bound with ``tv`` the average of the strata's distances weighted
by how often each prefix occurs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from scipy import stats

MIN_EXPECTED = 5.0  # cells expected below this are pooled (the chi-square approximation)


def _pool(counts: torch.Tensor, expected: torch.Tensor):
    """Pool the smallest cells until every cell expects >= MIN_EXPECTED (one pool per call)."""
    order = expected.argsort()
    counts, expected = counts[order], expected[order]
    cum = expected.cumsum(0)
    cut = int((cum < MIN_EXPECTED).sum())
    if cut == 0:
        return counts, expected
    cut = min(cut + 1, len(expected))  # the pool includes the first cell that makes it big enough
    pooled_c = torch.cat([counts[:cut].sum().reshape(1), counts[cut:]])
    pooled_e = torch.cat([expected[:cut].sum().reshape(1), expected[cut:]])
    return pooled_c, pooled_e


def chi_square_parts(counts: torch.Tensor, probs: torch.Tensor):
    """(statistic, dof, impossible) for one stratum: ``counts`` of draws against ``probs``.

    ``impossible`` counts draws of a token with probability 0 (a failure whatever the
    p-value)."""
    counts, probs = counts.double(), probs.double()
    total = float(counts.sum())
    support = probs > 0
    impossible = int(counts[~support].sum())
    if total == 0 or int(support.sum()) < 2:
        return 0.0, 0, impossible
    c, e = _pool(counts[support], probs[support] / probs[support].sum() * total)
    if len(e) < 2:
        return 0.0, 0, impossible
    return float(((c - e) ** 2 / e).sum()), len(e) - 1, impossible


def stratified_chi_square(strata: torch.Tensor, tokens: torch.Tensor, law: torch.Tensor):
    """Sum of the strata's Pearson statistics: ``tokens`` drawn given ``strata`` (row index
    into ``law [S, V]``). Returns (statistic, dof, impossible, draws)."""
    vocab = law.shape[-1]
    counts = torch.bincount(strata * vocab + tokens, minlength=law.shape[0] * vocab)
    counts = counts.reshape(law.shape[0], vocab)
    statistic, dof, impossible = 0.0, 0, 0
    for s in torch.nonzero(counts.sum(-1)).flatten().tolist():
        part = chi_square_parts(counts[s], law[s])
        statistic, dof, impossible = statistic + part[0], dof + part[1], impossible + part[2]
    return statistic, dof, impossible, int(tokens.numel())


def chi_square_pvalue(statistic: float, dof: int) -> float:
    return 1.0 if dof == 0 else float(stats.chi2.sf(statistic, dof))


def chi_square_power(dof: int, draws: int, alpha: float, tv: float) -> float:
    if dof == 0:
        return 0.0
    critical = stats.chi2.isf(alpha, dof)
    return float(stats.ncx2.sf(critical, dof, 4.0 * draws * tv * tv))


def draws_for_power(dof: int, alpha: float, tv: float, power: float) -> int:
    """The fewest draws whose chi-square test (``dof``, level ``alpha``) has ``power`` against
    every law at total-variation distance >= ``tv``."""
    low, high = 1, 1
    while chi_square_power(dof, high, alpha, tv) < power:
        high *= 2
    while low < high:
        mid = (low + high) // 2
        if chi_square_power(dof, mid, alpha, tv) >= power:
            high = mid
        else:
            low = mid + 1
    return high


def binomial_pvalue(successes: int, trials: int, prob: float) -> float:
    """Two-sided exact binomial p-value (twice the smaller tail, at most 1)."""
    if prob <= 0:
        return 1.0 if successes == 0 else 0.0
    lower = stats.binom.cdf(successes, trials, prob)
    upper = stats.binom.sf(successes - 1, trials, prob)
    return float(min(1.0, 2 * min(lower, upper)))


def binomial_power(trials: int, prob: float, alpha: float, factor: float) -> float:
    """Power of the two-sided binomial test at level ``alpha`` against a success probability
    ``factor`` times too large or too small (the smaller of the two)."""
    if prob <= 0:
        return 0.0
    # Rejection region: counts whose two-sided p-value is <= alpha.
    low = int(stats.binom.ppf(alpha / 2, trials, prob)) - 1
    high = int(stats.binom.isf(alpha / 2, trials, prob)) + 1
    powers = []
    for alt in (min(1.0, prob * factor), prob / factor):
        powers.append(float(stats.binom.cdf(low, trials, alt) + stats.binom.sf(high - 1, trials, alt)))
    return min(powers)


def tail_alpha(alpha: float, tests: int) -> float:
    """Bonferroni: each of ``tests`` tests at ``alpha / tests`` keeps the family at ``alpha``."""
    return alpha / max(tests, 1)


def fmt(value: Optional[float], digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0 or (1e-3 <= abs(value) < 1e5):
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits + 1}g}"
    return f"{value:.{digits - 1}e}" if not math.isinf(value) else str(value)
