"""The exactness toolkit (``specdec_kernels.testing``) on verifiers whose answer is known.

1. Its exact laws against an independent float64 enumeration written here: the processed
   distribution against the package's reference (and min-p by its definition), the window
   law by brute force, the chain acceptance laws (token and block) and the block rule's
   exactness by enumerating every draft sequence and every success pattern of the uniforms,
   the tree acceptance law by enumerating every outcome of a small tree.
2. It certifies correct verifiers: our reference chain / tree / sampler in every draft mode
   and parameter (block too once ``verify_chain`` takes ``method``), the textbook token and
   block verifiers, our Triton kernels under the interpreter (tiny samples: the interpreter
   runs ~0.2 s per request here), and our engine adapters through the toolkit's
   engine-layout wrappers (vLLM's: ``verify_chain_packed``, min_p included).
3. It fails each planted bug, at the test that should see it.
4. A cheap calibration: a correct verifier passes over several seeds, a planted bug fails
   over several seeds (the full measurement is ``python -m specdec_kernels.testing.calibrate``,
   recorded in docs/testing.md).
Every check runs at the toolkit's family-wise alpha = 1e-3, so this file's false-alarm rate
is at most ~1.5% over the choice of seeds; the seeds are fixed, so a run is reproducible.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import os

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import adapters, testing
from specdec_kernels.reference import sampling as ref_sampling
from specdec_kernels.testing import _laws, planted
from specdec_kernels.testing.__main__ import main as cli
from specdec_kernels.testing._laws import SamplingSetting
from specdec_kernels.testing.chain import ChainInstance
from conftest import DEVICE, triton_refuses

CHAIN_REF = functools.partial(sk.verify_chain, backend="reference")
TREE_REF = functools.partial(sk.verify_tree, backend="reference")
SAMPLE_REF = functools.partial(sk.sample, backend="reference")
CHAIN_METHODS = ("token", "block") if "method" in inspect.signature(sk.verify_chain).parameters \
    else ("token",)
CHEAP = dict(tv=0.1, power=0.9)  # trials sized for TV >= 0.1: a few thousand per configuration
TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _one_thread():
    """The checks' tensors are tiny: torch's thread pool costs more than it saves (15 ms per
    op with two threads on a loaded 2-core machine, 0.5 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _failed(report) -> set:
    return {r.name for r in report.failures}


# --- 1. The toolkit's exact laws against independent enumeration ---------------------------

@pytest.mark.parametrize("setting", [SamplingSetting(), SamplingSetting(temperature=0.6, top_k=3),
                                     SamplingSetting(temperature=1.3, top_p=0.7),
                                     SamplingSetting(temperature=0.0)], ids=str)
def test_processed_probs_matches_package_reference(setting):
    logits = torch.randn(50, 7, generator=torch.Generator().manual_seed(3)) * 2
    logits[0, 2] = -float("inf")
    expected = ref_sampling.processed_probs(
        logits.double(), torch.full((50,), setting.temperature if setting.temperature is not None else 1.0,
                                    dtype=torch.float64),
        torch.full((50,), setting.top_k or 0), torch.full((50,), setting.top_p or 1.0, dtype=torch.float64))
    assert torch.allclose(_laws.processed_probs(logits, setting), expected, atol=1e-12)


def test_min_p_by_its_definition():
    logits = torch.randn(30, 6, generator=torch.Generator().manual_seed(4))
    probs = _laws.processed_probs(logits, SamplingSetting(min_p=0.3))
    full = torch.softmax(logits.double(), -1)
    kept = full >= 0.3 * full.max(-1, keepdim=True).values
    assert torch.allclose(probs, torch.where(kept, full, 0.0) / torch.where(kept, full, 0.0).sum(-1, keepdim=True))


def _brute_window_law(p_table, vocab, length):
    law = []
    for seq in itertools.product(range(vocab), repeat=length):
        prob = 1.0
        for j in range(length):
            prob *= float(p_table[int(_laws.prefix_index(torch.tensor([seq[:j]]), vocab))][seq[j]])
        law.append(prob)
    return torch.tensor(law, dtype=torch.float64)


def _enumerate_chain(p_table, q_table, vocab, num_drafts, method):
    """(acceptance law, completed window law) by enumerating every draft sequence and every
    pattern of acceptance events (token: the first failure; block: which h_j succeed)."""
    def row(table, prefix):
        return table[int(_laws.prefix_index(torch.tensor([list(prefix)], dtype=torch.int64), vocab))]

    accept = torch.zeros(num_drafts + 1, dtype=torch.float64)
    window = torch.zeros(vocab ** (num_drafts + 1), dtype=torch.float64)
    target = _brute_window_law(p_table, vocab, num_drafts + 1)
    for drafts in itertools.product(range(vocab), repeat=num_drafts):
        q_prob = 1.0
        for j in range(num_drafts):
            q_prob *= float(row(q_table, drafts[:j])[drafts[j]])
        if q_prob == 0:
            continue
        weights, h = [1.0], []
        for j in range(num_drafts):
            p_j, q_j = row(p_table, drafts[:j]), row(q_table, drafts[:j])
            weights.append(min(1.0, weights[-1] * float(p_j[drafts[j]]) / float(q_j[drafts[j]])))
        for j in range(1, num_drafts + 1):
            if method == "token":
                p_j, q_j = row(p_table, drafts[:j - 1]), row(q_table, drafts[:j - 1])
                h.append(min(1.0, float(p_j[drafts[j - 1]]) / float(q_j[drafts[j - 1]])))
            elif j == num_drafts:
                h.append(weights[j])
            else:
                res = float((weights[j] * row(p_table, drafts[:j]) - row(q_table, drafts[:j])).clamp(min=0).sum())
                h.append(res / (res + 1 - weights[j]) if res + 1 - weights[j] > 0 else 1.0)
        for pattern in itertools.product((True, False), repeat=num_drafts):
            prob = q_prob
            for j, ok in enumerate(pattern):
                prob *= h[j] if ok else 1 - h[j]
            if prob == 0:
                continue
            if method == "token":
                tau = next((j for j, ok in enumerate(pattern) if not ok), num_drafts)
            else:
                tau = max([0] + [j + 1 for j, ok in enumerate(pattern) if ok])
            accept[tau] += prob
            p_next = row(p_table, drafts[:tau])
            if tau == num_drafts:
                final = p_next
            else:
                scale = 1.0 if method == "token" else weights[tau]
                final = (scale * p_next - row(q_table, drafts[:tau])).clamp(min=0)
                final = final / final.sum() if final.sum() > 0 else p_next
            emitted = list(drafts[:tau])
            for token in range(vocab):
                if final[token] == 0:
                    continue
                prefix = emitted + [token]
                rest = num_drafts + 1 - len(prefix)
                for tail in itertools.product(range(vocab), repeat=rest):
                    seq, cont = prefix + list(tail), 1.0
                    for j in range(len(prefix), num_drafts + 1):
                        cont *= float(row(p_table, seq[:j])[seq[j]])
                    cell = 0
                    for t in seq:
                        cell = cell * vocab + t
                    window[cell] += prob * float(final[token]) * cont
    return accept, window, target


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("mode", ["one_hot", "probs", "logits"])
def test_chain_laws_match_enumeration(method, mode):
    setting = SamplingSetting(temperature=0.8, top_k=3)
    instance = ChainInstance(3, 2, seed=5, settings=[setting])
    p_table = _laws.processed_probs(instance.target_logits, setting)
    q_table = instance.q_table(mode, setting)
    accept, window, target = _enumerate_chain(p_table, q_table, 3, 2, method)
    assert torch.allclose(_laws.window_law(p_table, 3, 3), target, atol=1e-13)
    assert torch.allclose(window, target, atol=1e-12), "the rule the toolkit expects is not exact"
    assert torch.allclose(_laws.chain_acceptance_law(p_table, q_table, 3, 2, method), accept,
                          atol=1e-12)


def _enumerate_tree(p_table, q_table, vocab, parents, mode):
    """Law of num_accepted by walking every draw of the whole tree and every accept/reject
    outcome (depth-first, children in index order), without the toolkit's recursion."""
    children = [[c for c in range(1, len(parents)) if parents[c] == u] for u in range(len(parents))]
    order = [u for u in range(len(parents)) if children[u]]
    law = torch.zeros(len(parents), dtype=torch.float64)

    def row(table, path):
        return table[int(_laws.prefix_index(torch.tensor([list(path)], dtype=torch.int64), vocab))]

    def draws(u, path):
        return _laws.children_draws(row(q_table, path), len(children[u]), mode)

    def walk(node, path, tokens, prob, depth):
        kids = children[node]
        if not kids:
            law[depth] += prob
            return
        p_cur, q_cur = row(p_table, path).clone(), row(q_table, path).clone()
        reach = prob
        for child in kids:
            x = tokens[child]
            if mode == "candidates":
                q_cur = torch.zeros(vocab, dtype=torch.float64)
                q_cur[x] = 1.0
            a = min(1.0, float(p_cur[x] / q_cur[x])) if q_cur[x] > 0 else 0.0
            if a > 0:
                walk(child, path + (x,), tokens, reach * a, depth + 1)
            reach *= 1 - a
            res = (p_cur - q_cur).clamp(min=0)
            p_cur = res / res.sum() if res.sum() > 0 else p_cur
            if mode == "without_replacement":
                q_cur = q_cur.clone()
                q_cur[x] = 0
                q_cur = q_cur / q_cur.sum() if q_cur.sum() > 0 else q_cur
        law[depth] += reach

    def assign(index, path_of, tokens, prob):
        if index == len(order):
            walk(0, (), tokens, prob, 0)
            return
        u = order[index]
        for drawn, p_draw in draws(u, path_of[u]):
            new_tokens, new_paths = dict(tokens), dict(path_of)
            for child, x in zip(children[u], drawn):
                new_tokens[child] = x
                new_paths[child] = path_of[u] + (x,)
            assign(index + 1, new_paths, new_tokens, prob * p_draw)

    assign(0, {0: ()}, {}, 1.0)
    return law


@pytest.mark.parametrize("mode", ["candidates", "iid", "without_replacement"])
def test_tree_acceptance_law_matches_enumeration(mode):
    parents = [-1, 0, 0, 1]
    setting = SamplingSetting(temperature=0.9)
    instance = ChainInstance(3, 2, seed=6, settings=[setting])
    p_table = _laws.processed_probs(instance.target_logits, setting)
    q_table = instance.q_table("probs", setting)
    exact = _enumerate_tree(p_table, q_table, 3, parents, mode)
    law = _laws.tree_acceptance_law(p_table, q_table, 3, parents, mode)
    assert torch.allclose(law, exact[:len(law)], atol=1e-12) and abs(float(law.sum()) - 1) < 1e-12


# --- 2. Correct verifiers are certified ------------------------------------------------------

def test_certifies_reference_chain_every_mode():
    report = testing.check_chain_verifier(CHAIN_REF, methods=CHAIN_METHODS, tail=True,
                                          tail_samples=1 << 18, **CHEAP)
    print(report)
    assert report.passed, report.table()
    names = {r.name for r in report.results}
    assert {"joint law", "acceptance law", "greedy arg-max", "seed determinism",
            "batch invariance", "position 2 | prefix"} <= names


def test_certifies_textbook_token_and_block():
    for fn, method in ((planted.token_chain, "token"), (planted.block_chain, "block")):
        report = testing.check_chain_verifier(fn, methods=(method,), seeded=False,
                                              params=("temperature", "top_p", "min_p"), **CHEAP)
        assert report.passed, report.table()


def test_certifies_reference_tree_every_mode():
    report = testing.check_tree_verifier(TREE_REF, params=("temperature", "top_p"), **CHEAP)
    print(report)
    assert report.passed, report.table()


def test_certifies_reference_sampler():
    report = testing.check_sampler(SAMPLE_REF, **CHEAP)
    assert report.passed, report.table()


@pytest.mark.skipif(not TRITON, reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
def test_certifies_triton_kernels():
    """Tiny samples under the interpreter: format, seed determinism, batch invariance and the
    arg-max exactly; the statistical tests run with the power these sizes have (printed).
    The interpreter's cost grows with the rows of a call (~0.3 s per request and call), and
    none of those checks needs more than a few requests: 8 trials there."""
    small = dict(samples=8 if DEVICE == "cpu" else 20_000, device=DEVICE)
    chain = testing.check_chain_verifier(functools.partial(sk.verify_chain, backend="triton"),
                                         draft_modes=("probs",), params=(), **small)
    tree = testing.check_tree_verifier(functools.partial(sk.verify_tree, backend="triton"),
                                       draft_modes=("iid",), params=(), **small)
    sampler = testing.check_sampler(functools.partial(sk.sample, backend="triton"),
                                    params=("temperature",), **small)
    # verify_chain_packed through vLLM's layout; min_p once the kernels take it.
    packed = testing.check_chain_verifier(
        testing.from_vllm(functools.partial(adapters.vllm.rejection_sample, backend="triton")),
        draft_modes=("probs",), params=tuple(
            p for p in ("min_p",) if p not in triton_refuses("verify_chain_packed", DEVICE)),
        **small)
    for report in (chain, tree, sampler, packed):
        print(report)
        assert report.passed, report.table()


def test_adapters_certify_engine_layouts():
    """Our engine adapters through the toolkit's engine-layout wrappers: vLLM's step (our
    verify_chain_packed on the flattened rows, min_p included), FlashInfer's and SGLang's
    probabilities-in calls (SGLang's coins key our streams: unseeded)."""
    vllm = testing.check_chain_verifier(
        testing.from_vllm(functools.partial(adapters.vllm.rejection_sample, backend="reference")),
        draft_modes=("probs", "one_hot"), params=("temperature", "top_k", "min_p"), **CHEAP)
    flashinfer = testing.check_chain_verifier(
        testing.from_flashinfer(functools.partial(adapters.flashinfer.chain_speculative_sampling,
                                                  backend="reference")),
        params=("top_p",), draft_modes=("probs", "logits"), **CHEAP)
    sglang = testing.check_tree_verifier(
        testing.from_sglang(functools.partial(
            adapters.sglang.tree_speculative_sampling_target_only, backend="reference")),
        seeded=False, draft_modes=("iid", "candidates"), params=("temperature",), **CHEAP)
    for report in (vllm, flashinfer, sglang):
        print(report)
        assert report.passed, report.table()


def test_catches_vllm_layout_dropping_min_p():
    """A vLLM step that loses min_p on the way to the kernels fails where min_p is set."""
    def min_p_dropped(metadata, draft_probs, logits, sampling_metadata, **kw):
        sampling_metadata.min_p = None
        return adapters.vllm.rejection_sample(metadata, draft_probs, logits, sampling_metadata,
                                              backend="reference", **kw)
    bug = testing.check_chain_verifier(testing.from_vllm(min_p_dropped), draft_modes=("probs",),
                                       params=("min_p",), **CHEAP)
    assert not bug.passed and {r.config for r in bug.failures} == {"token probs min_p=0.2"}, \
        bug.table()


# --- 3. Planted bugs are caught ----------------------------------------------------------------

PLANTED_CHAIN = [  # (verifier, declared methods, the tests that must fail)
    (planted.resample_from_p, ("token",), {"joint law", "position 0 | prefix"}),
    (planted.always_reject, ("token",), {"acceptance law"}),
    (planted.reused_uniform, ("token",), {"joint law"}),
    (planted.block_first_failure, ("block",), {"acceptance law"}),
]


@pytest.mark.parametrize("fn,methods,expected", PLANTED_CHAIN, ids=lambda x: getattr(x, "__name__", ""))
def test_catches_planted_chain_bug(fn, methods, expected):
    report = testing.check_chain_verifier(fn, methods=methods, seeded=False, draft_modes=("probs",),
                                          params=("temperature",), **CHEAP)
    assert not report.passed and expected <= _failed(report), report.table()


def test_catches_noise_shared_with_the_drafter():
    report = testing.check_chain_verifier(planted.shared_noise, draft_sampler=SAMPLE_REF,
                                          draft_modes=("probs",), params=("temperature",),
                                          samples=8000)
    assert not report.passed and "position 0 | prefix" in _failed(report), report.table()
    # The same check passes our verifier drawing its drafts with the same sampler and seeds.
    assert testing.check_chain_verifier(CHAIN_REF, draft_sampler=SAMPLE_REF, draft_modes=("probs",),
                                        params=("temperature",), **CHEAP).passed


def test_catches_sglang_ignoring_q_under_iid_drafts():
    verify = testing.from_sglang(planted.sglang_target_only)
    bug = testing.check_tree_verifier(verify, seeded=False, draft_modes=("iid",), params=(), **CHEAP)
    assert not bug.passed and "joint law" in _failed(bug), bug.table()
    # Distinct deterministic candidates: the same rule is exact, and certified.
    assert testing.check_tree_verifier(verify, seeded=False, draft_modes=("candidates",),
                                       params=(), **CHEAP).passed


# --- 4. Reports, reproducibility, calibration, CLI ---------------------------------------------

def test_report_is_reproducible_and_states_its_guarantees():
    kw = dict(draft_modes=("probs",), params=(), samples=2000)
    first = testing.check_chain_verifier(CHAIN_REF, **kw)
    again = testing.check_chain_verifier(CHAIN_REF, **kw)
    assert [r.statistic for r in first.results] == [r.statistic for r in again.results]
    table = first.table()
    for word in ("p-value", "alpha", "power", "TV>=0.05", "verdict: PASS", "plan:"):
        assert word in table
    statistical = [r for r in first.results if r.pvalue is not None]
    assert abs(sum(r.alpha for r in statistical) - first.alpha) < 1e-12  # Bonferroni


def test_cheap_calibration():
    """False alarms and power over a few seeds (the full table: calibrate.py, docs/testing.md)."""
    from specdec_kernels.testing import calibrate
    rows = calibrate.measure(["token_chain", "resample_from_p"], repeats=3, samples=1500)
    assert rows["token_chain"]["rejected"] == 0
    assert rows["resample_from_p"]["rejected"] == 3


def test_cli_exit_codes(capsys):
    base = ["chain", "--modes", "probs", "--params", "", "--samples", "1500"]
    assert cli(base + ["--verifier", "specdec_kernels:verify_chain,backend=reference"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert cli(base + ["--verifier", "specdec_kernels.testing.planted:resample_from_p",
                       "--unseeded"]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli(["chain", "--verifier", "no_colon"])


def test_bad_declarations_are_value_errors():
    with pytest.raises(ValueError, match="draft_modes"):
        testing.check_chain_verifier(CHAIN_REF, draft_modes=("bogus",))
    with pytest.raises(ValueError, match="params"):
        testing.check_sampler(SAMPLE_REF, params=("temprature",))
    with pytest.raises(ValueError, match="parents"):
        testing.check_tree_verifier(TREE_REF, parents=(-1, 0, 3))
