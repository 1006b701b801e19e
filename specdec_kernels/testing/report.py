"""The report a check returns: one row per test, and an overall verdict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ._stats import fmt


@dataclass
class TestResult:
    """One test. Statistical tests fill ``statistic``, ``pvalue`` and ``power``; exact
    (deterministic) checks leave ``pvalue`` None and pass only with ``statistic == 0``
    (the number of mismatching trials)."""
    __test__ = False  # not a pytest class

    name: str                 # e.g. "joint law", "position 1 | prefix", "acceptance law"
    config: str               # e.g. "token probs T=0.7,top_k=2"
    passed: bool
    statistic: Optional[float] = None
    dof: Optional[int] = None
    pvalue: Optional[float] = None
    alpha: Optional[float] = None
    samples: int = 0
    power: Optional[float] = None
    alternative: str = ""     # what the power is computed against
    detail: str = ""

    def row(self) -> list:
        return ["ok" if self.passed else "FAIL", self.config, self.name,
                fmt(self.statistic) + (f" ({self.dof})" if self.dof is not None else ""),
                fmt(self.pvalue), fmt(self.alpha), str(self.samples), fmt(self.power),
                self.alternative, self.detail]


@dataclass
class Report:
    """Every test of one check. ``passed`` is the verdict: all tests passed. The family-wise
    false-alarm rate of a correct verifier is at most ``alpha`` (Bonferroni over the
    statistical tests; the exact checks never fail a correct verifier)."""
    title: str
    alpha: float
    seed: int
    plan: str
    results: list = field(default_factory=list)
    runtime_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list:
        return [r for r in self.results if not r.passed]

    def table(self) -> str:
        header = ["", "config", "test", "statistic (dof)", "p-value", "alpha", "N", "power",
                  "against", "detail"]
        rows = [header] + [r.row() for r in self.results]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header) - 1)]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1]
                 for row in rows]
        verdict = "PASS" if self.passed else f"FAIL ({len(self.failures)} of {len(self.results)} tests)"
        return "\n".join([f"{self.title}", self.plan, *lines,
                          f"verdict: {verdict}; family-wise alpha {self.alpha:g}, seed {self.seed}, "
                          f"{self.runtime_s:.1f} s"])

    def __str__(self) -> str:
        return self.table()
