"""``check_chain_verifier``: certify a chain verifier in the toolkit's padded layout."""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import torch

from . import _core, _laws
from ._laws import SamplingSetting
from .report import Report

DRAFT_MODES = ("one_hot", "probs", "logits")
METHODS = ("token", "block")


class ChainInstance:
    """A tiny context-dependent target and draft: one row of logits per prefix of length
    ``0..K``; the draft's rows are the target's plus noise, so drafts are often rejected."""

    def __init__(self, vocab: int, num_drafts: int, seed: int, settings: Sequence[SamplingSetting]):
        gen = torch.Generator().manual_seed(seed)
        rows = _laws.num_prefixes(vocab, num_drafts)
        for _ in range(100):  # redraw until no row sits on a top-p / min-p threshold
            self.target_logits = (torch.randn(rows, vocab, generator=gen) * 1.5).float()
            self.draft_logits = (self.target_logits + torch.randn(rows, vocab, generator=gen)).float()
            if not any(_laws.near_threshold(t, s) for s in settings
                       for t in (self.target_logits, self.draft_logits)):
                break
        self.vocab, self.num_drafts = vocab, num_drafts
        self.draft_probs = torch.softmax(self.draft_logits.double(), -1).float()

    def q_table(self, mode: str, setting: SamplingSetting) -> torch.Tensor:
        if mode == "one_hot":
            return _laws.one_hot_rows(self.draft_logits)
        if mode == "probs":  # the drafter's own distribution, whatever the target's filters
            q = self.draft_probs.double()
            return q / q.sum(-1, keepdim=True)
        return _laws.processed_probs(self.draft_logits, setting)


def _draft(instance: ChainInstance, mode: str, setting: SamplingSetting, q_table, batch: int,
           gen: torch.Generator, draft_sampler: Optional[Callable], seeds, offsets, device):
    """Drafts ``[B, K]`` drawn autoregressively from ``q`` (by the toolkit's generator, or by
    ``draft_sampler`` with the verifier's seeds and offset + j for draft j, as an engine's
    drafter would), and the rows the verifier sees."""
    vocab, num_drafts = instance.vocab, instance.num_drafts
    drafts = torch.zeros(batch, num_drafts, dtype=torch.int64)
    for j in range(num_drafts):
        index = _laws.prefix_index(drafts[:, :j], vocab)
        if mode == "one_hot":
            drafts[:, j] = q_table[index].argmax(-1)
        elif draft_sampler is None:
            drafts[:, j] = torch.multinomial(q_table[index], 1, generator=gen)[:, 0]
        else:
            if mode == "probs":
                rows, kwargs = instance.draft_probs[index].log(), {}
            else:
                rows, kwargs = instance.draft_logits[index], setting.kwargs()
            out = draft_sampler(rows.to(device), seed=seeds.to(device),
                                offset=(offsets + j).to(device), **kwargs)
            drafts[:, j] = torch.as_tensor(out[0] if isinstance(out, tuple) else out).long().cpu()
    rows = torch.stack([_laws.prefix_index(drafts[:, :j], vocab) for j in range(num_drafts + 1)], 1)
    return drafts, rows


def _greedy_expected(target_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    best = _laws.one_hot_rows(target_logits).argmax(-1)  # [B, K+1], lowest id among ties
    num_drafts = drafts.shape[1]
    accepted = (drafts == best[:, :num_drafts]).to(torch.int64).cumprod(-1).sum(-1)
    out = torch.full_like(best, -1)
    out[:, :num_drafts] = torch.where(torch.arange(num_drafts) < accepted[:, None], drafts, -1)
    out.scatter_(1, accepted[:, None], best.gather(1, accepted[:, None]))
    return out


def check_chain_verifier(verify: Callable, *, draft_modes: Sequence[str] = DRAFT_MODES,
                         params: Sequence[str] = ("temperature", "top_k", "top_p"),
                         methods: Sequence[str] = ("token",), seeded: bool = True,
                         per_request: bool = True, draft_sampler: Optional[Callable] = None,
                         vocab_size: int = 4, num_drafts: int = 2, alpha: float = 1e-3,
                         tv: float = 0.05, power: float = 0.95, samples: Optional[int] = None,
                         max_samples: int = 400_000, batch_size: int = 1 << 16,
                         tail: bool = False, tail_samples: int = 1 << 20, seed: int = 0,
                         device="cpu") -> Report:
    r"""Certify a chain verifier: does it preserve the target distribution, exactly?

    ``verify(target_logits, draft_token_ids, *, draft_probs=None, [draft_logits=...],
    [temperature=..., top_k=..., top_p=..., min_p=...], [seed=..., offset=...],
    [method=...])`` -- the layout of :func:`specdec_kernels.verify_chain`:

    * ``target_logits``: float32 ``[B, K+1, V]``, raw target logits at the K draft positions
      and the bonus position;
    * ``draft_token_ids``: int64 ``[B, K]``; every request drafts K tokens;
    * ``draft_probs``: float32 ``[B, K, V]`` (mode ``"probs"``), or ``None`` (mode
      ``"one_hot"``: a deterministic drafter); mode ``"logits"`` passes ``draft_logits``
      ``[B, K, V]`` instead (``q = processed(draft_logits)`` with the same parameters);
    * the declared ``params`` only, as ``[B]`` tensors (float32; int64 for ``top_k``) or, with
      ``per_request=False``, Python scalars; ``seed`` / ``offset`` int64 ``[B]`` when
      ``seeded``; ``method`` only when ``methods`` holds more than ``"token"``;
    * returns ``output_token_ids`` ``[B, >= K+1]`` (accepted drafts, one correction or bonus
      token, then ``-1``), or a tuple whose first element it is.

    Tests per configuration (draft mode x parameter setting x method): output format; the
    joint law of the window completed by the target; each position's law given its prefix;
    the law of ``num_accepted`` against its exact value (token and block rules). Greedy
    (``temperature=0``): the exact arg-max answer. Seeded: seed determinism and batch
    invariance. ``tail``: acceptance at ``p/q`` of 1e-4 and 1e-6 over ``tail_samples`` trials.

    Sizes: each configuration runs the fewest trials whose joint-law test has ``power``
    against every law at total variation ``>= tv`` at its Bonferroni share of ``alpha``
    (capped by ``max_samples``; ``samples`` overrides). The same ``seed`` reproduces the run.

    Returns a :class:`Report`; ``report.passed`` is the verdict, ``print(report)`` the table.
    """
    started = time.perf_counter()
    _core.check_declared(draft_modes, DRAFT_MODES, "draft_modes")
    _core.check_declared(methods, METHODS, "methods")
    budget = _core.Budget(alpha, tv, power, samples, max_samples, batch_size, seed)
    plan = _core.plan_windows(verify, outputs=1, params=params, draft_modes=draft_modes,
                              methods=methods, depth=num_drafts, vocab=vocab_size,
                              exact_acceptance=lambda m: True, extra_tests=2 if tail else 0,
                              budget=budget, seeded=seeded, per_request=per_request,
                              device=device)
    settings, greedy, configs, tests = plan.settings, plan.greedy, plan.configs, plan.tests
    alpha_test, trials, pass_method = plan.alpha_test, plan.trials, plan.pass_method
    caller, gen = plan.caller, plan.gen
    instance = ChainInstance(vocab_size, num_drafts, seed, settings)
    total = trials * len(configs) + (2 * tail_samples if tail else 0)
    plan_text = _core.plan_line(len(configs), trials, total,
                                (2 * num_drafts + 1) * vocab_size * 4, batch_size,
                                f"; {len(greedy) * len(draft_modes) * len(methods)} "
                                f"greedy configurations")
    report = Report(f"check_chain_verifier({_core.describe(verify)}): "
                    f"V={vocab_size}, K={num_drafts}, {tests} statistical tests",
                    alpha, seed, plan_text)

    def make(method, mode, setting, batch, base):
        """The inputs of one call: (args, kwargs) with every per-request tensor ``[B, ...]``."""
        seeds, offsets = _core.request_seeds(base, batch)
        q = instance.q_table(mode, setting)
        drafts, rows = _draft(instance, mode, setting, q, batch, gen, draft_sampler, seeds,
                              offsets, device)
        kwargs = _core.per_request_kwargs(setting, batch, device, per_request)
        if mode == "probs":
            kwargs["draft_probs"] = instance.draft_probs[rows[:, :-1]]
        elif mode == "logits":
            kwargs["draft_logits"] = instance.draft_logits[rows[:, :-1]]
        else:
            kwargs["draft_probs"] = None
        if seeded:
            kwargs.update(seed=seeds, offset=offsets)
        if pass_method:
            kwargs["method"] = method
        return [instance.target_logits[rows], drafts], kwargs

    def run(method, mode, setting, batch, base):
        args, kwargs = make(method, mode, setting, batch, base)
        return caller(args, kwargs, batch)[0], args[1], args[0]

    for index, (method, mode, setting) in enumerate(configs):
        config = f"{method} {mode} {setting.label()}"
        args, kwargs = make(method, mode, setting, trials, seed * 1000 + index)
        (ids,) = caller(args, kwargs, trials)
        drafts = args[1]
        if index == 0:
            first_call = (args, kwargs, [ids], config)
        good = _check_format(ids, drafts, vocab_size, num_drafts)
        report.results.append(_core.format_result(config, good, "drafts, then one token, then -1"))
        p_table = _laws.processed_probs(instance.target_logits, setting)
        law = _laws.chain_acceptance_law(p_table, instance.q_table(mode, setting), vocab_size,
                                         num_drafts, method)
        report.results += _core.window_tests(
            ids[good], p_table, vocab_size, num_drafts, config, alpha_test, tv, gen,
            conditional="emitted" if method == "token" else "completed", acceptance_law=law)

    for method in methods:
        for mode in draft_modes:
            for setting in greedy:
                config = f"{method} {mode} greedy"
                batch = min(trials, 4096)
                ids, drafts, target = run(method, mode, setting, batch, seed * 1000 + 777)
                expected = _greedy_expected(target, drafts)
                mismatches = int((ids[:, :num_drafts + 1] != expected).any(-1).sum())
                report.results.append(_core.exact_result("greedy arg-max", config, mismatches,
                                                         batch, "the arg-max answer"))

    if seeded:
        report.results += _core.seed_tests(caller, trials, *first_call)

    if tail:
        report.results += _tail_probes(caller, draft_modes, seeded, pass_method, tail_samples,
                                       alpha_test, seed, device)
    report.runtime_s = time.perf_counter() - started
    return report


def _check_format(ids: torch.Tensor, drafts: torch.Tensor, vocab: int, num_drafts: int):
    if ids.dim() != 2 or ids.shape[1] < num_drafts + 1:
        return torch.zeros(ids.shape[0], dtype=torch.bool)
    ids = ids[:, :num_drafts + 1]
    good = _core.window_format(ids, vocab)
    length = _core.emitted_length(ids)
    accepted_ok = (ids[:, :num_drafts] == drafts) | (torch.arange(num_drafts) >= length[:, None] - 1)
    return good & accepted_ok.all(-1)


def _tail_probes(caller, draft_modes, seeded, pass_method, trials, alpha_test, seed, device):
    """Acceptance of a draft at tiny ``p/q``: V = 2, K = 1, the draft is token 0."""
    mode = "probs" if "probs" in draft_modes else "one_hot"
    results = []
    for ratio in (1e-4, 1e-6):
        q0 = 0.5 if mode == "probs" else 1.0
        p0 = ratio * q0
        target = torch.tensor([[math.log(p0 / (1 - p0)), 0.0], [0.0, 0.0]]).expand(trials, 2, 2)
        drafts = torch.zeros(trials, 1, dtype=torch.int64)
        kwargs = {"draft_probs": torch.tensor([[q0, 1 - q0]]).expand(trials, 1, 2)
                  if mode == "probs" else None}
        if seeded:
            seeds, offsets = _core.request_seeds(seed * 1000 + 555, trials)
            kwargs.update(seed=seeds, offset=offsets)
        if pass_method:
            kwargs["method"] = "token"
        (ids,) = caller([target.contiguous(), drafts], kwargs, trials)
        exact = float(torch.softmax(target[0, 0].double(), -1)[0]) / q0
        accepted = int((_core.emitted_length(ids) >= 2).sum())
        results.append(_core.binomial_result(f"tail: accept at p/q={ratio:g}", f"token {mode}",
                                             accepted, trials, exact, alpha_test))
    return results
