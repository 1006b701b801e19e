"""Measure the toolkit's false-alarm rate and its power against the planted bugs.

``python -m specdec_kernels.testing.calibrate [--repeats R] [--samples N]`` runs every
entry below over ``R`` seeds and prints a markdown table: how many runs each verdict
rejected, and, for the correct verifiers, the share of individual p-values below 0.05 and
0.01 (each test's own calibration: about 5% and 1% if the tests hold their level).
docs/testing.md records one run.
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

import specdec_kernels as sk
from . import check_chain_verifier, check_sampler, check_tree_verifier, from_sglang, planted

_CHAIN_REF = functools.partial(sk.verify_chain, backend="reference")
_SAMPLE_REF = functools.partial(sk.sample, backend="reference")


def _chain(fn, **kw):
    base = dict(draft_modes=("one_hot", "probs", "logits"), params=("temperature", "top_p"))
    base.update(kw)
    return lambda seed, samples: check_chain_verifier(fn, seed=seed, samples=samples, **base)


def _tree(fn, **kw):
    base = dict(params=("temperature",))
    base.update(kw)
    return lambda seed, samples: check_tree_verifier(fn, seed=seed, samples=samples, **base)


# name -> (correct?, what it is, run(seed, samples) -> Report)
ENTRIES = {
    "reference verify_chain": (True, "ours, token, 3 draft modes", _chain(_CHAIN_REF)),
    "token_chain": (True, "textbook token rule", _chain(planted.token_chain, seeded=False)),
    "block_chain": (True, "textbook block rule", _chain(planted.block_chain, seeded=False,
                                                         methods=("block",))),
    "reference verify_tree": (True, "ours, 3 draft modes",
                              _tree(functools.partial(sk.verify_tree, backend="reference"))),
    "reference sample": (True, "ours", lambda seed, samples: check_sampler(
        _SAMPLE_REF, seed=seed, samples=samples)),
    "resample_from_p": (False, "correction from p, not the residual",
                        _chain(planted.resample_from_p, seeded=False)),
    "always_reject": (False, "every draft rejected, a sample of p emitted",
                      _chain(planted.always_reject, seeded=False)),
    "reused_uniform": (False, "acceptance uniform reused for the correction",
                       _chain(planted.reused_uniform, seeded=False)),
    "shared_noise": (False, "correction drawn with the drafter's noise",
                     _chain(planted.shared_noise, draft_sampler=_SAMPLE_REF,
                            draft_modes=("probs", "logits"))),
    "block_first_failure": (False, "block rule stopping at the first failure",
                            _chain(planted.block_first_failure, seeded=False, methods=("block",))),
    "sglang_target_only (iid)": (False, "SGLang's rule, q ignored, i.i.d. drafts",
                                 _tree(from_sglang(planted.sglang_target_only), seeded=False,
                                       draft_modes=("iid",))),
    "sglang_target_only (candidates)": (True, "the same rule on distinct candidates (exact)",
                                        _tree(from_sglang(planted.sglang_target_only),
                                              seeded=False, draft_modes=("candidates",))),
}


def measure(names, repeats: int, samples: int) -> dict:
    """``{name: {"runs", "rejected", "pvalues", "below_05", "below_01", "seconds", ...}}``."""
    rows = {}
    for name in names:
        correct, what, run = ENTRIES[name]
        started = time.perf_counter()
        rejected, pvalues, caught_by = 0, [], {}
        for seed in range(repeats):
            report = run(1000 + seed, samples)
            rejected += not report.passed
            pvalues += [r.pvalue for r in report.results if r.pvalue is not None]
            for failure in report.failures:
                caught_by[failure.name] = caught_by.get(failure.name, 0) + 1
        count = max(len(pvalues), 1)
        rows[name] = dict(correct=correct, what=what, runs=repeats, rejected=rejected,
                          tests=len(pvalues) // max(repeats, 1),
                          below_05=sum(p < 0.05 for p in pvalues) / count,
                          below_01=sum(p < 0.01 for p in pvalues) / count,
                          caught_by=caught_by, seconds=time.perf_counter() - started)
    return rows


def markdown(rows: dict, samples: int) -> str:
    lines = [f"| verifier | what | correct | runs rejected | tests per run | p < 0.05 | p < 0.01 | failing tests (runs) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        top = ", ".join(f"{k} ({v})" for k, v in sorted(r["caught_by"].items(),
                                                         key=lambda kv: -kv[1])[:3]) or "-"
        lines.append(f"| `{name}` | {r['what']} | {'yes' if r['correct'] else 'no'} | "
                     f"{r['rejected']}/{r['runs']} | {r['tests']} | {r['below_05']:.3f} | "
                     f"{r['below_01']:.3f} | {top} |")
    lines.append(f"\n{samples} trials per configuration, family-wise alpha 1e-3, seeds 1000..")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels.testing.calibrate")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--only", nargs="*", default=list(ENTRIES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the tensors are tiny: one thread is fastest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(markdown(measure(args.only, args.repeats, args.samples), args.samples))


if __name__ == "__main__":
    main()
