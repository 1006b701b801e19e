"""End to end on the real (embedded) model: the loop's mechanics, greedy identity for every
drafter and method, the committed KV cache against a recomputation, and the law of the first
two sampled tokens against the exact law (chi-square, with a planted bug that it catches)."""
from __future__ import annotations

import os

import pytest
import torch

from specdec_kernels.e2e import engine as E
from specdec_kernels.e2e.adaptive import AdaptiveLength
from specdec_kernels.e2e.drafters import NgramDrafter
from specdec_kernels.e2e.config import Sampling, Speculation, replace
from specdec_kernels.e2e.engine import generate
from specdec_kernels.e2e.verify import methods_for, verify_methods


@pytest.fixture(scope="module")
def models():
    """One load for the module. Two torch threads, one when the cores are busy (two
    contended threads wait on each other at every parallel op: ~4x slower here)."""
    from specdec_kernels.e2e.model import early_exit_draft, load_model
    saved = torch.get_num_threads()
    busy = os.getloadavg()[0] > (os.cpu_count() or 1) - 1
    torch.set_num_threads(1 if busy else min(2, os.cpu_count() or 1))
    model, tokenizer = load_model()
    yield model, early_exit_draft(model, 8), tokenizer
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def requests(models):
    from specdec_kernels.e2e.tasks import task_requests
    _, _, tokenizer = models
    copy = task_requests(tokenizer, "copy", 2, max_new_tokens=10)
    rare = task_requests(tokenizer, "rare_terms", 1, max_new_tokens=6)
    # Different prompt lengths and budgets in one batch; the last one stops first.
    return copy + rare


def test_ngram_proposes_the_latest_continuation():
    drafter = NgramDrafter(ngram_max=2)
    assert drafter.propose([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], 3) == [8, 2, 5]
    assert drafter.propose([1, 2, 3], 2) == []         # no earlier occurrence of 3
    assert drafter.propose([4, 9, 4], 5) == [9, 4]      # shorter than asked at the end


def _latest_continuation(history, length, ngram_max=3):
    """The definition: the continuation of the most recent earlier occurrence of the
    longest suffix n-gram (n = ngram_max .. 1), by brute force."""
    for n in range(min(ngram_max, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + length]
    return []


def test_ngram_lookup_equals_the_definition_on_random_histories():
    import random
    drafter, rng = NgramDrafter(ngram_max=3), random.Random(0)
    for _ in range(2000):
        alphabet = rng.choice([2, 3, 5, 20])
        history = [rng.randrange(alphabet) for _ in range(rng.randint(2, 40))]
        length = rng.randint(1, 6)
        assert drafter.propose(history, length) == _latest_continuation(history, length)


def _probe_steps(adaptive, steps, accept=lambda k: 0):
    chosen = []
    for _ in range(steps):
        k = adaptive.choose([8])[0]
        chosen.append(k)
        adaptive.observe(0, k, accept(k))
    return [i for i, k in enumerate(chosen) if k]


def test_adaptive_length_backs_off_and_probes():
    adaptive = AdaptiveLength(1, 8, row_exponent=0.5)  # as if 4 rows cost 2x one
    for _ in range(20):
        adaptive.observe(0, 4, 0)
    # Probes after 4 plain steps, then 8, then 16: each probe here accepts nothing.
    assert _probe_steps(adaptive, 4 + 8 + 16) == [3, 11, 27]
    assert adaptive.choose([3]) == [0]
    for _ in range(20):
        adaptive.observe(0, 8, 8)
    assert adaptive.choose([8]) == [8]
    assert adaptive.choose([3]) == [3]  # never more than the drafter has


def test_a_probe_drafts_several_and_an_accepted_one_resets_the_gap():
    adaptive = AdaptiveLength(1, 16, row_exponent=0.5)
    for _ in range(20):
        adaptive.observe(0, 4, 0)
    chosen = [adaptive.choose([16])[0] for _ in range(4)]
    assert chosen == [0, 0, 0, adaptive.probe_length]
    adaptive.observe(0, adaptive.probe_length, 0)
    assert _probe_steps(adaptive, 8 + 16) == [7, 23]     # gap 8, then 16
    assert adaptive.gap[0] == 32
    # The next probe (gap 32) accepts its drafts: the gap goes back to 4, and the next draft
    # comes within 4 steps (sooner if the raised rates make drafting worth it).
    drafted = _probe_steps(adaptive, 32 + 4, accept=lambda k: k)
    assert drafted[0] == 31 and adaptive.gap[0] == 4
    assert drafted[1] <= 35


def test_adaptive_lengths_are_per_request():
    """The packed verify forward costs its rows, so one request's long chain charges the
    others nothing: each request gets its own length, and none where drafts never land."""
    adaptive = AdaptiveLength(16, 8)
    adaptive.observe_cost(16, 1.0)             # a plain step of 16 rows
    adaptive.observe_cost(40, 1.5)             # 40 rows: 2% more per extra row
    for b in range(16):                        # nor does the batch's rate at position 1
        adaptive.observe(b, 4, 0)
    for _ in range(20):
        adaptive.observe(0, 8, 8)              # request 0 copies
        for b in range(1, 16):
            adaptive.observe(b, 4, 0)          # the others never agree
    lengths = adaptive.choose([8] * 16)
    assert lengths[0] == 8 and lengths[1:] == [0] * 15
    assert adaptive.choose([0] + [8] * 15) == [0] * 16  # no proposal, no draft


def test_adaptive_cost_fits_a_power_law_then_uses_measured_counts():
    adaptive = AdaptiveLength(1, 8)
    adaptive.observe_cost(1, 0.04)
    adaptive.observe_cost(4, 0.08)                # seconds = 0.04 * rows^0.5
    assert adaptive.verify_seconds(9) == pytest.approx(0.12)
    assert adaptive.verify_seconds(16) == pytest.approx(0.16)
    for _ in range(AdaptiveLength.MEASURED):  # two rows cost what one does
        adaptive.observe_cost(2, 0.04)
    assert adaptive.verify_seconds(2) == pytest.approx(0.04)


@pytest.mark.parametrize("lengths", [[5, 1, 3, 2], [1, 5, 1, 4]])
def test_packed_forward_equals_the_padded_one(models, lengths):
    """Requests with different numbers of new positions in one packed forward: the same
    logits and committed K/V as the padded forward. Attention runs the first rows batched
    and each longer request's rest alone: request 0's last 2 rows; requests 1 and 3 (not
    first in the packed sequence) past row 1."""
    from specdec_kernels.e2e.model import (SlotCache, _split_rows, chain_visibility,
                                           forward_block, prefill)
    from specdec_kernels.e2e.verify import pack_chain_rows
    model, _, _ = models
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist()
               for n in (30, 12, 45, 20)]
    caches = [SlotCache(4, 80) for _ in range(2)]
    kv_lens = [prefill(model, c, prompts, "cpu") for c in caches]
    tokens = torch.randint(0, 1000, (4, 5), generator=generator)
    assert _split_rows(lengths) == {5: 3, 1: 1}[lengths[0]]
    lengths = torch.tensor(lengths)
    visible, depth = chain_visibility(4, 5, "cpu")
    padded = forward_block(model, caches[0], tokens, kv_lens[0], visible, depth)
    packed = forward_block(model, caches[1], tokens, kv_lens[1], visible, depth,
                           lengths=lengths)
    assert packed.shape == (int(lengths.sum()), padded.shape[-1])
    assert (pack_chain_rows(padded, lengths) - packed).abs().max() < 1e-4
    for old, new in zip(*(c.tensors() for c in caches)):
        for b in range(4):
            end = int(kv_lens[0][b] + lengths[b])
            assert (old[b, :, :end] - new[b, :, :end]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="lengths"):
        forward_block(model, caches[1], tokens, kv_lens[1], visible, depth,
                      lengths=torch.tensor([0, 1, 1, 1]))


def test_adaptive_state_follows_its_request_when_others_leave():
    adaptive = AdaptiveLength(3, 8)
    for _ in range(10):
        adaptive.observe(0, 4, 0)
        adaptive.observe(2, 4, 4)
    adaptive.gap[2], adaptive.probing[2] = 16, True
    kept = [adaptive.rates(2), adaptive.trials[2]]
    adaptive.select([2])                       # requests 0 and 1 finished
    assert [adaptive.rates(0), adaptive.trials[0]] != kept  # the batch prior changed
    assert adaptive.trials[0] == kept[1] and adaptive.successes[0][3] > 0
    assert adaptive.gap == [16] and adaptive.probing == [True]


def test_a_request_without_proposals_still_comes_to_its_probe():
    """Steps where the n-gram has nothing to propose do not restart the wait for a probe."""
    adaptive = AdaptiveLength(1, 8, row_exponent=0.5)
    for _ in range(20):
        adaptive.observe(0, 4, 0)
    chosen = [adaptive.choose([8] if step % 2 else [0])[0] for step in range(8)]
    assert chosen == [0] * 7 + [adaptive.probe_length]


def test_no_request_drafts_more_than_it_may_still_emit():
    """Drafts past a request's remaining budget less one could never be emitted (the step
    adds a token of its own): a row each, for nothing."""
    adaptive = AdaptiveLength(3, 8, row_exponent=0.0)  # rows cost nothing: draft all you may
    for b in range(3):
        for _ in range(20):
            adaptive.observe(b, 8, 8)
    assert adaptive.choose([8, 8, 8]) == [8, 8, 8]
    assert adaptive.choose([8, 8, 8], remaining=[1, 3, 20]) == [0, 2, 8]


def test_adaptive_trees_are_rejected(models, requests):
    model, draft, _ = models
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate(model, requests, Sampling(), Speculation("model", "adaptive", tree=(2, 1)),
                 draft_model=draft)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate(model, requests, Sampling(), Speculation("ngram", "adaptive", trie_nodes=8))
    with pytest.raises(ValueError, match="trie_nodes"):
        generate(model, requests, Sampling(), Speculation("model", 2, trie_nodes=8),
                 draft_model=draft)


@pytest.mark.parametrize("change, error, name", [
    ({"requests": []}, ValueError, r"requests: expected at least one"),
    ({"prompt": []}, ValueError, r"requests\[1\]\.prompt: expected at least one token"),
    ({"prompt": [-1]}, ValueError, r"requests\[1\]\.prompt: token ids must be in"),
    ({"prompt": "vocab"}, ValueError, r"requests\[1\]\.prompt: token ids must be in"),
    ({"prompt": [1.5]}, TypeError, r"requests\[1\]\.prompt: expected a list of int"),
    ({"max_new_tokens": 0}, ValueError, r"requests\[1\]\.max_new_tokens: expected >= 1"),
    ({"max_new_tokens": -2}, ValueError, r"requests\[1\]\.max_new_tokens: expected >= 1"),
    ({"max_new_tokens": 2.0}, TypeError, r"requests\[1\]\.max_new_tokens: expected an int"),
    ({"sampling": Sampling(temperature=-1.0)}, ValueError, r"sampling\.temperature"),
    ({"sampling": Sampling(temperature=float("nan"))}, ValueError, r"sampling\.temperature"),
    ({"sampling": Sampling(top_k=-1)}, ValueError, r"sampling\.top_k"),
    ({"sampling": Sampling(top_p=0.0)}, ValueError, r"sampling\.top_p"),
    ({"spec": Speculation("ngram", -1)}, ValueError, r"speculation\.num_draft_tokens"),
    ({"spec": Speculation("ngram", 0)}, ValueError, r"speculation\.num_draft_tokens"),
    ({"spec": Speculation("ngram", 2, method="bogus")}, ValueError, r"speculation\.method"),
    ({"spec": Speculation("ngram", 2, children="bogus")}, ValueError, r"speculation\.children"),
    ({"spec": Speculation("bogus", 2)}, ValueError, r"drafter: expected"),
])
def test_bad_runs_raise_naming_the_field_before_any_forward(models, requests, monkeypatch,
                                                            change, error, name):
    """Each bad argument is an error naming it, raised before the prefill (a forward) runs."""
    import dataclasses
    model, _, _ = models
    vocab = model.get_input_embeddings().num_embeddings
    batch = list(requests)
    if "prompt" in change or "max_new_tokens" in change:
        fields = {k: v for k, v in change.items() if k in ("prompt", "max_new_tokens")}
        if fields.get("prompt") == "vocab":
            fields["prompt"] = [1, vocab]
        batch[1] = dataclasses.replace(batch[1], **fields)
    batch = change.get("requests", batch)

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the arguments were checked")
    monkeypatch.setattr(E, "prefill", no_forward)
    with pytest.raises(error, match=name):
        generate(model, batch, change.get("sampling", Sampling()),
                 change.get("spec", Speculation("ngram", 2)))


def test_verify_methods_include_token():
    assert "token" in verify_methods("chain")
    assert "token" in verify_methods("tree")


def test_greedy_speculation_equals_plain_decoding(models, requests):
    model, draft, tokenizer = models
    eos = tokenizer.eos_token_id
    plain = generate(model, requests, eos_token_id=eos)
    assert [len(t) for t in plain.tokens] == [r.max_new_tokens for r in requests] or any(
        t[-1] == eos for t in plain.tokens)
    specs = [Speculation("ngram", 3), Speculation("ngram", "adaptive", max_draft_tokens=4),
             Speculation("model", 2), Speculation("model", "adaptive", max_draft_tokens=3),
             Speculation("model", 0, tree=(2, 1)),
             Speculation("model", 0, tree=(2, 1), children="without_replacement"),
             Speculation("ngram", 4, trie_nodes=6)]
    for spec in specs:
        for method in methods_for(spec):
            result = generate(model, requests, Sampling(), replace(spec, method=method),
                              draft_model=draft, eos_token_id=eos)
            assert result.tokens == plain.tokens, (spec, method)
            if spec.adaptive:  # it drafted (an adaptive run may then back off)
                assert sum(result.stats.drafted_at) > 0, (spec, method)
            else:  # drafts landed
                assert result.stats.steps < plain.stats.steps, (spec, method)


def test_committed_cache_equals_recomputation(models, requests):
    model, draft, tokenizer = models
    for spec in (Speculation("model", 0, tree=(2, 2)), Speculation("ngram", 4),
                 Speculation("ngram", 4, trie_nodes=6),
                 Speculation("model", 0, tree=(2, 2), children="without_replacement",
                             method="traversal")):
        result = generate(model, requests, Sampling(1.0, top_k=20), spec, draft_model=draft,
                          eos_token_id=tokenizer.eos_token_id, keep_cache=True)
        for request, tokens, kept in zip(requests, result.tokens, result.caches):
            assert kept[0].shape[1] == len(request.prompt) + len(tokens) - 1
            assert E.cache_recompute_error(model, request, tokens, kept) < 1e-4


@pytest.mark.parametrize("drafter,method", [("ngram", "token"), ("model", "token"),
                                            ("model", "block"), ("ngram_trie", "token")])
def test_first_two_tokens_law(models, drafter, method):
    """20,000 speculative requests; alpha = 1e-3; the reported distance is what the test
    detects with power 0.99. Block verification with the draft model's real q (with an
    n-gram's one-hot q it is the token law); the n-gram trie as deterministic candidates
    (its root has several children on this prompt)."""
    from specdec_kernels.e2e.exactness import first_two_tokens_test
    from specdec_kernels.e2e.tasks import encode
    if method not in verify_methods("chain"):
        pytest.skip(f"the installed verify_chain has no method {method!r}")
    model, draft, tokenizer = models
    # Block differs from token verification from two drafts on (one draft: the same rule).
    result = first_two_tokens_test(model, draft, encode(tokenizer, EXACTNESS_PROMPT),
                                   drafter=drafter, samples=20000, method=method,
                                   num_draft=2 if method == "block" else None)
    assert result["passed"], result
    assert result["detectable_distance"] < 0.01
    if drafter == "ngram_trie":
        assert result["root_candidates"] >= 2, result


@pytest.mark.parametrize("drafter", ["ngram", "ngram_trie"])
def test_first_two_tokens_law_catches_a_planted_bug(models, drafter):
    from specdec_kernels.e2e.exactness import first_two_tokens_test
    from specdec_kernels.e2e.tasks import encode
    model, draft, tokenizer = models
    result = first_two_tokens_test(model, draft, encode(tokenizer, EXACTNESS_PROMPT),
                                   drafter=drafter, samples=20000, planted_bug="rows_one_late")
    assert not result["passed"], result


EXACTNESS_PROMPT = "Repeat after me: the cat sat on the mat. The cat sat on the"


def test_policy_replay_counts_what_the_record_accepts():
    """bench.e2e_policy replays draft lengths on a recorded greedy answer: a periodic answer
    is accepted in full by the n-gram drafter, a mismatching one never; the oracle bounds
    every policy."""
    from bench.e2e_policy import compare, replay
    period = [11, 12, 13, 14, 15, 16]
    copying = [{"prompt": period * 2, "answer": period * 4}]
    one_row = replay(copying, 1, 0, lambda rows: 1.0)
    assert one_row["steps"] == 24 and one_row["accepted"] == 0
    k4 = replay(copying, 1, 4, lambda rows: 1.0)
    assert k4["steps"] == 5 and k4["accepted"] == 20  # 4 drafts + 1 a step; 24 tokens
    ratios = compare(copying, 1, lambda rows: rows ** 0.5)
    assert max(v for k, v in ratios.items() if k != "plain_tokens_per_s") == ratios["oracle"]
    never = [{"prompt": [1, 2, 1, 2], "answer": [3, 4, 5, 6, 7, 8]}]
    assert replay(never, 1, 4, lambda rows: 1.0)["accepted"] == 0


@pytest.mark.parametrize("path", ["measured", "linear", "columns", "two_columns"])
def test_small_row_linear_equals_f_linear_and_is_undone(path):
    from specdec_kernels.e2e import small_rows as M
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False))
    inputs = [torch.randn(rows, 64) for rows in range(1, 9)] + [torch.randn(2, 3, 64),
                                                                 torch.randn(M.SMALL_ROWS + 1, 64)]
    with torch.no_grad():
        stock = [model(x) for x in inputs]
        paths = M.use_small_row_linear(
            model, paths=None if path == "measured" else dict.fromkeys(range(1, 9), path))
        assert set(paths) <= set(range(1, M.SMALL_ROWS + 1))
        assert set(paths.values()) <= {M.LINEAR, M.COLUMNS, M.TWO_COLUMNS}
        assert all("forward" in m.__dict__ for m in model)
        assert M.row_paths_in_use(model) == {
            r: p for r, p in sorted(paths.items()) if p != M.LINEAR}
        for x, expected in zip(inputs, stock):
            assert torch.allclose(model(x), expected, atol=1e-5), x.shape
        M.use_small_row_linear(model, enable=False)
        assert not any("forward" in m.__dict__ or "_row_paths" in m.__dict__ for m in model)
        assert M.row_paths_in_use(model) == {}
    # Measured once per process (dtype, threads, weight shapes): a second model reuses it.
    assert M.small_row_paths(model) is M.small_row_paths(model)


def _match_starts_by_definition(history, ngram_max):
    """The earlier occurrences of the last n tokens (n = ngram_max .. 1, most recent first,
    each position once): where their continuations start."""
    starts, seen = [], set()
    for n in range(min(ngram_max, len(history) - 1), 0, -1):
        for end in range(len(history) - 2, n - 2, -1):
            if history[end - n + 1:end + 1] == history[-n:] and end not in seen:
                seen.add(end)
                starts.append(end + 1)
    return starts


def _trie_by_definition(history, ngram_max, max_nodes, max_depth):
    """The n-gram trie by brute force: the first suffix match, then where a copy broken by
    the last token resumes (it was inserted before, or replaced, the token the history
    without it predicts), then the other matches, each position once, the first
    4 * max_nodes; their continuations of up to max_depth tokens inserted in that order as
    paths from the root, no node past the budget."""
    matches = _match_starts_by_definition(history, ngram_max)
    resync = []
    if len(history) >= 3:
        predicted = _match_starts_by_definition(history[:-1], ngram_max)
        if predicted and history[predicted[0]] != history[-1]:
            resync = [s for s in (predicted[0], predicted[0] + 1) if s < len(history) - 1]
    starts = []
    for start in matches[:1] + resync + matches[1:]:
        if start not in starts:
            starts.append(start)
    nodes, tokens, parents = {(): 0}, [history[-1]], [-1]
    for start in starts[:4 * max_nodes]:
        continuation = history[start:start + max_depth]
        for d in range(1, len(continuation) + 1):
            path = tuple(continuation[:d])
            if path not in nodes:
                if len(tokens) - 1 >= max_nodes:
                    return tokens, parents
                nodes[path] = len(tokens)
                tokens.append(continuation[d - 1])
                parents.append(nodes[path[:-1]])
    return tokens, parents


def test_ngram_trie_equals_the_definition_on_random_histories():
    import random
    from specdec_kernels.e2e.drafters import NgramTrieDrafter, match_starts
    rng, chain = random.Random(1), NgramDrafter(ngram_max=3)
    for _ in range(1500):
        alphabet = rng.choice([2, 3, 5, 20])
        history = [rng.randrange(alphabet) for _ in range(rng.randint(2, 40))]
        nodes, depth = rng.randint(1, 12), rng.randint(1, 6)
        trie = NgramTrieDrafter(3, nodes, depth)
        tokens, parents = trie.trie(history)
        assert (tokens, parents) == _trie_by_definition(history, 3, nodes, depth)
        assert len(tokens) - 1 <= nodes and all(0 <= p < i for i, p in
                                                enumerate(parents) if i)
        # siblings are distinct; the first path is the chain drafter's proposal
        assert len({(p, t) for p, t in zip(parents[1:], tokens[1:])}) == len(tokens) - 1
        starts = match_starts(history, 3, 4 * nodes)
        first = history[starts[0]:starts[0] + depth] if starts else []
        assert first == chain.propose(history, depth)
        assert tokens[1:1 + min(len(first), nodes)] == first[:nodes]


def test_trie_plan_and_row_packing():
    from specdec_kernels.e2e.plans import deterministic_tree_plan
    from specdec_kernels.e2e.verify import pack_chain_rows, unpack_rows
    trees = [([9, 5, 6, 7], [-1, 0, 1, 0]), ([3], [-1]), ([4, 8], [-1, 0])]
    plan = deterministic_tree_plan(trees, torch.tensor([10, 3, 7]))
    assert plan.is_tree and plan.num_nodes.tolist() == [4, 1, 2]
    assert plan.tree_tokens().tolist() == [[-1, 5, 6, 7], [-1, -1, -1, -1], [-1, 8, -1, -1]]
    assert plan.depths == [2, 0, 1] and plan.tree_depth == 2
    assert plan.depth[0].tolist() == [0, 1, 2, 1]
    assert plan.visible[0, 2].tolist() == [True, True, True, False]  # node 2's ancestors
    rows = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    packed = pack_chain_rows(rows, plan.num_nodes)
    assert packed.shape == (7, 2)
    unpacked = unpack_rows(packed, plan.num_nodes, 4)
    for b, n in enumerate(plan.num_nodes.tolist()):
        assert torch.equal(unpacked[b, :n], rows[b, :n]) and not unpacked[b, n:].any()


def test_e2e_modules_import_no_private_names_and_no_cycles():
    """The restructure (#27): what two modules share is a public name of the lower one, and
    the package's modules import each other without a cycle."""
    import ast
    from pathlib import Path
    import specdec_kernels.e2e as package
    folder = Path(package.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.add(node.module)
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, node.module, private)
        graph[path.stem] = deps
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active + [module])}"
        if module in done:
            return
        active.append(module)
        for dep in graph.get(module, ()):
            visit(dep)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)
    assert max(len(p.read_text().splitlines()) for p in folder.glob("*.py")) <= 450


def test_profile_accounts_for_the_wall_time(models, requests):
    from specdec_kernels.e2e.config import PHASES, Stats
    model, _, tokenizer = models
    eos = tokenizer.eos_token_id
    plain = generate(model, requests[:1], eos_token_id=eos).stats
    trie = generate(model, requests[:2], Sampling(),
                    Speculation("ngram", 4, trie_nodes=6), eos_token_id=eos).stats
    for stats in (plain, trie):
        assert set(stats.profile) == set(PHASES)
        assert min(stats.profile.values()) >= 0
        assert sum(stats.profile.values()) == pytest.approx(stats.wall_s, rel=0.02)
        assert stats.profile["forward"] > stats.profile["masks"]
        per_step = stats.profile_ms_per_step()
        assert sum(per_step.values()) == pytest.approx(1e3 * stats.wall_s / stats.steps,
                                                       rel=0.02)
    assert plain.profile["drafting"] < 0.01 * plain.wall_s
    assert trie.profile["verify_op"] > 0 and trie.profile["compaction"] > 0
    merged = Stats()
    merged.merge(plain)
    merged.merge(trie)
    assert merged.profile["forward"] == pytest.approx(plain.profile["forward"]
                                                      + trie.profile["forward"])
