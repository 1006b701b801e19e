"""The serving loop (continuous batching, e2e/serving.py) and its load generator (e2e/load.py):
greedy tokens of every request equal to its own plain decoding however the batch around it
changes, the first-two-tokens law with requests joining mid-flight, bad requests rejected at
submission while the others go on, the pool's rows reused, and the load-aware policy.

Most checks run on a tiny random Llama (2 layers, vocabulary 64: milliseconds a step); the
greedy identity also on the embedded SmolLM2-135M with tiny budgets (one load)."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from specdec_kernels.e2e.adaptive import AdaptiveLength
from specdec_kernels.e2e.config import Request, Sampling, Speculation
from specdec_kernels.e2e.engine import generate
from specdec_kernels.e2e.load import Arrival, ArrivalList, ClosedLoop, poisson_arrivals
from specdec_kernels.e2e import serving as S
from specdec_kernels.e2e.serving import Server, SlotPool, serve

SPECS = [Speculation(), Speculation("ngram", 3),
         Speculation("ngram", "adaptive", max_draft_tokens=4),
         Speculation("ngram", 4, trie_nodes=6), Speculation("model", 2),
         Speculation("model", "adaptive", max_draft_tokens=3)]


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    from specdec_kernels.e2e.model import early_exit_draft
    model.draft = early_exit_draft(model, 1)  # its first layer: the draft model's tests
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits on a busy machine
    yield model
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def real():
    """The embedded model, one load for the module (one thread when the cores are busy)."""
    from specdec_kernels.e2e.model import load_model
    saved = torch.get_num_threads()
    busy = os.getloadavg()[0] > (os.cpu_count() or 1) - 1
    torch.set_num_threads(1 if busy else min(2, os.cpu_count() or 1))
    model, tokenizer = load_model()
    yield model, tokenizer
    torch.set_num_threads(saved)


TINY_REQUESTS = [Request([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], 12, seed=1),
                 Request([1, 2, 3, 1, 2, 3, 1, 2], 7, seed=2),
                 Request([9, 10, 11, 12], 10, seed=3, stop_at_eos=False),
                 Request([4], 5, seed=4),
                 Request([3, 3, 3, 3, 3, 3], 9, seed=5)]


def _staggered(model, spec, requests, samplings=None, eos=None, **kwargs):
    """Request i joins after i steps of the others (a request may finish, freeing its row,
    before the next joins); then the loop drains."""
    server = Server(model, spec, eos_token_id=eos, draft_model=getattr(model, "draft", None),
                    **kwargs)
    samplings = samplings or [Sampling()] * len(requests)
    for request, sampling in zip(requests, samplings):
        server.submit(request, sampling)
        server.step()
    while server.busy:
        server.step()
    return server


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.drafter}-{s.num_draft_tokens}-"
                                                      f"{s.trie_nodes}")
def test_greedy_tokens_equal_each_requests_own_plain_decoding(tiny, spec):
    alone = [generate(tiny, [r]).tokens[0] for r in TINY_REQUESTS]
    # Joining one by one, all at once, and in the reverse order.
    for order in (range(5), [4, 3, 2, 1, 0]):
        requests = [TINY_REQUESTS[i] for i in order]
        server = _staggered(tiny, spec, requests)
        assert [c.tokens for c in server.completions] == [alone[i] for i in order], order
        assert all(c.finished and c.error is None for c in server.completions)
    server = Server(tiny, spec, draft_model=tiny.draft)
    for r in TINY_REQUESTS:
        server.submit(r)
    while server.busy:
        server.step()
    assert [c.tokens for c in server.completions] == alone
    # Greedy rows among sampled ones keep their tokens (per-row parameters).
    samplings = [Sampling(1.0, top_k=5), Sampling(), Sampling(0.7, top_p=0.9), Sampling(),
                 Sampling(1.0)]
    server = _staggered(tiny, spec, TINY_REQUESTS, samplings)
    for c, a, s in zip(server.completions, alone, samplings):
        if s.greedy:
            assert c.tokens == a


def test_drafts_land_and_the_pool_reuses_freed_rows(tiny):
    server = _staggered(tiny, Speculation("ngram", 3), TINY_REQUESTS[:2])
    assert server.stats.accepted > 0 and server.stats.speculative_steps > 0
    # Two live at most: the third request joins after the first two finished, in a freed row.
    server = Server(tiny, Speculation("ngram", 3), max_batch=2)
    for r in TINY_REQUESTS:
        server.submit(r)
    while server.busy:
        server.step()
    assert server.pool.rows == 2 and server.stats.max_rows == 2
    assert [c.tokens for c in server.completions] == [generate(tiny, [r]).tokens[0]
                                                      for r in TINY_REQUESTS]


def test_slot_pool_moves_the_last_rows_into_freed_ones():
    from specdec_kernels.e2e.model import SlotCache
    pool = SlotPool()
    fresh = SlotCache(4, 3)
    fresh.keys = [torch.arange(4.0)[:, None, None, None].expand(4, 1, 3, 2).clone()]
    fresh.values = [fresh.keys[0] + 10]
    pool.add(fresh, 5)
    assert (pool.rows, pool.capacity, pool.live) == (4, 5, 4)
    order = pool.remove([1, 2], [3, 3, 3, 3])
    assert order == [0, 3]
    assert pool.view().keys[0][:, 0, 0, 0].tolist() == [0.0, 3.0]
    assert pool.view().values[0][:, 0, 0, 0].tolist() == [10.0, 13.0]
    one = SlotCache(3, 2)  # three more: the pool doubles its rows, keeps its capacity
    one.keys = [torch.full((3, 1, 2, 2), 7.0)]
    one.values = [torch.full((3, 1, 2, 2), 8.0)]
    pool.add(one, 4)
    assert (pool.rows, pool.capacity, pool.live) == (8, 5, 5)
    assert pool.view().keys[0][:, 0, 0, 0].tolist() == [0.0, 3.0, 7.0, 7.0, 7.0]


@pytest.mark.parametrize("change, error, name", [
    ({"prompt": []}, ValueError, r"requests\[1\]\.prompt: expected at least one token"),
    ({"prompt": [64]}, ValueError, r"requests\[1\]\.prompt: token ids must be in"),
    ({"prompt": [-3, 2]}, ValueError, r"requests\[1\]\.prompt: token ids must be in"),
    ({"max_new_tokens": 0}, ValueError, r"requests\[1\]\.max_new_tokens: expected >= 1"),
    ({"max_new_tokens": -4}, ValueError, r"requests\[1\]\.max_new_tokens: expected >= 1"),
    ({"sampling": Sampling(temperature=-1.0)}, ValueError, r"sampling\.temperature"),
    ({"sampling": Sampling(temperature=float("nan"))}, ValueError, r"sampling\.temperature"),
    ({"sampling": Sampling(top_k=-2)}, ValueError, r"sampling\.top_k"),
    ({"sampling": Sampling(top_p=1.5)}, ValueError, r"sampling\.top_p"),
    ({"sampling": {"temperature": 1.0}}, TypeError, r"sampling: expected a Sampling"),
])
def test_a_bad_request_is_rejected_and_the_others_go_on(tiny, change, error, name):
    import dataclasses
    alone = [generate(tiny, [r]).tokens[0] for r in TINY_REQUESTS[:2]]
    server = Server(tiny, Speculation("ngram", 3))
    server.submit(TINY_REQUESTS[0])
    server.step()
    bad = dataclasses.replace(TINY_REQUESTS[1], **{k: v for k, v in change.items()
                                                  if k != "sampling"})
    with pytest.raises(error, match=name):
        server.submit(bad, change.get("sampling", Sampling()))
    assert len(server.queue) == 0 and len(server.rows) == 1
    server.submit(TINY_REQUESTS[1])
    while server.busy:
        server.step()
    tokens = [c.tokens for c in server.completions]
    assert tokens == [alone[0], [], alone[1]]
    assert server.completions[1].error and server.stats.rejected == 1
    # serve() records the rejection and serves the rest.
    result = serve(tiny, [Arrival(TINY_REQUESTS[0]), Arrival(bad, change.get(
        "sampling", Sampling()), at=0.0), Arrival(TINY_REQUESTS[1], at=0.01)],
        Speculation("ngram", 3))
    assert [c.tokens for c in result.completions] == [alone[0], [], alone[1]]
    assert re.search(name, result.completions[1].error)


def test_a_server_rejects_what_it_does_not_serve(tiny):
    with pytest.raises(ValueError, match="draft_model"):
        Server(tiny, Speculation("model", 2))
    with pytest.raises(ValueError, match="speculation.tree"):
        Server(tiny, Speculation("model", 0, tree=(2, 1)), draft_model=tiny.draft)
    with pytest.raises(ValueError, match="drafter: expected"):
        Server(tiny, Speculation("bogus", 2))
    with pytest.raises(ValueError, match="speculation.num_draft_tokens"):
        Server(tiny, Speculation("ngram", 0))
    with pytest.raises(ValueError, match="max_batch"):
        Server(tiny, Speculation(), max_batch=0)
    with pytest.raises(ValueError, match="time_limit"):
        serve(tiny, [], time_limit=-1)


def test_serve_admits_arrivals_as_the_clock_passes_them(tiny):
    times = [0.0, 0.05, 0.3]
    arrivals = [Arrival(r, at=t, tag=f"r{i}") for i, (r, t) in
                enumerate(zip(TINY_REQUESTS, times))]
    result = serve(tiny, arrivals, Speculation("ngram", "adaptive", max_draft_tokens=4))
    alone = [generate(tiny, [r]).tokens[0] for r in TINY_REQUESTS[:3]]
    assert [c.tokens for c in result.completions] == alone
    for c, t in zip(result.completions, times):
        assert c.arrival_s == t and c.admitted_s >= t and c.first_token_s > c.admitted_s
        assert c.finish_s >= c.first_token_s and c.ttft_s > 0
    assert result.stats.wall_s >= 0.3 and result.policy is not None
    # A time limit leaves the requests in flight unfinished.
    cut = serve(tiny, [Arrival(Request([1, 2], 400, stop_at_eos=False))], time_limit=0.2)
    assert not cut.completions[0].finished and 0 < len(cut.completions[0].tokens) < 400


def test_load_generators_are_seeded_and_bounded():
    pool = [Arrival(r, tag=str(i)) for i, r in enumerate(TINY_REQUESTS)]
    a = poisson_arrivals(pool, 20.0, 10.0, seed=3)
    assert a == poisson_arrivals(pool, 20.0, 10.0, seed=3) != poisson_arrivals(pool, 20.0, 10.0)
    assert all(0 <= x.at < 10.0 for x in a) and 150 < len(a) < 250  # 200 expected (sd 14)
    assert len({x.request.seed for x in a}) == len(a)
    gaps = np.diff([0.0] + [x.at for x in a])
    assert abs(gaps.mean() - 0.05) < 0.01
    loop = ClosedLoop(pool, 3, 1.0, think=0.1)
    assert len(loop.due(0.0)) == 3 and loop.next_at() is None
    loop.finished(None, 0.5)
    assert loop.due(0.55) == [] and loop.next_at() == pytest.approx(0.6)
    assert len(loop.due(0.6)) == 1
    loop.finished(None, 0.95)  # past the duration: no next request
    assert loop.next_at() is None
    listed = ArrivalList([Arrival(TINY_REQUESTS[0], at=0.2), Arrival(TINY_REQUESTS[1], at=0.1)])
    assert [x.at for x in listed.due(1.0)] == [0.1, 0.2]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(pool, 0.0, 1.0)
    with pytest.raises(ValueError, match="clients"):
        ClosedLoop(pool, 0, 1.0)


def test_a_closed_loop_keeps_its_clients_busy(tiny):
    pool = [Arrival(r) for r in TINY_REQUESTS[:3]]
    result = serve(tiny, ClosedLoop(pool, 2, 600.0, seed=1, limit=5), Speculation("ngram", 3))
    done = result.completions
    assert len(done) == 5 and all(c.finished for c in done)
    assert result.stats.mean_batch <= 2 and result.stats.max_rows == 2
    # Each next request arrives when one of the two before it finished.
    finishes = sorted(c.finish_s for c in done)
    assert all(c.arrival_s == 0.0 for c in done[:2])
    assert [c.arrival_s for c in done[2:]] == pytest.approx(finishes[:3])


def test_load_aware_policy_adds_rows_and_fades_with_the_batch():
    policy = AdaptiveLength(0, 8, load_aware=True)
    policy.add(1)
    for rows, seconds in ((1, 1.0), (5, 1.1), (16, 3.0), (32, 6.0)) * 4:
        policy.observe_cost(rows, seconds)
    for i in range(8):
        policy.observe(0, 4, i % 2)           # half of the first drafts land
    assert sum(policy.choose([8])) > 0        # one request: 2 rows cost 2.5% more
    policy.add(15)                             # 16: a row costs its share
    assert len(policy.successes) == 16 and policy.batch == 16
    for b in range(16):
        for i in range(8):
            policy.observe(b, 4, i % 2)
    assert sum(policy.choose([8] * 16)) == 0
    assert policy.prior == pytest.approx(policy.batch_prior(16))
    policy.select([3, 5])                      # 14 leave: back to drafting
    assert policy.batch == 2 and sum(policy.choose([8, 8])) > 0
    assert policy.verify_seconds(64) == pytest.approx(12.0)  # past 32: in proportion
    with pytest.raises(ValueError, match="count"):
        policy.add(-1)


def test_static_policy_is_unchanged_by_the_new_options():
    """generate's policy (not load-aware) still resets its costs on a new batch size."""
    policy = AdaptiveLength(2, 8)
    policy.observe_cost(2, 1.0)
    policy.start(3)
    assert policy.samples == [] and policy.step_seconds == {}


def _law_run(model, prompt, samples, spec, background, bug=None):
    """``samples`` law requests (T = 1, top-k = 5, two tokens) arriving among background
    requests (greedy or T = 0.7 / top-p 0.9, budgets 5-9) while those decode; rows join as
    others leave (at most 256 live)."""
    server = Server(model, spec, max_batch=256, draft_model=model.draft)
    law_ids = []
    for i in range(samples):
        if i % background == 0:
            server.submit(Request(prompt[:3 + i % 5], 5 + i % 5, seed=10**6 + i),
                          Sampling(0.7, top_p=0.9) if i % 2 else Sampling())
        law_ids.append(server.submit(Request(list(prompt), 2, seed=i), Sampling(1.0, top_k=5)))
        if i % 97 == 0:  # some join mid-flight, one step at a time
            server.step()
    while server.busy:
        server.step()
    return [server.completions[i].tokens for i in law_ids], server


def _law_prompt(model):
    """``[a, a+1, a+2, a+3] * 2 + [a, a+1]`` (the n-gram proposal ``a+2, a+3``) for the ``a``
    whose proposal the model's top 5 gives the most probability, so that drafts are accepted
    whatever the random weights (another torch may draw others)."""
    def score(a):
        prompt = [a, a + 1, a + 2, a + 3] * 2 + [a, a + 1]
        top = model(torch.tensor([prompt])).logits[0, -1].topk(5)
        hit = top.indices == a + 2
        return float(torch.softmax(top.values, -1)[hit].sum()), prompt
    return max(score(a) for a in range(5, 60, 6))[1]


@pytest.mark.parametrize("spec", [Speculation("ngram", 2), Speculation("ngram", 2, trie_nodes=4),
                                  Speculation("model", 2)], ids=["chain", "trie", "model"])
def test_first_two_tokens_law_with_requests_joining(tiny, spec, monkeypatch):
    """8,000 law requests; alpha = 1e-3 (the false-alarm rate), and the chi-square distance
    detected with power 0.99 is below 0.01 (about 0.005). The planted bug (each row verified
    with the previous row's sampling parameters: what a row order lost as rows join and
    leave would do) is caught with 4,000 (chain only: the same loop code)."""
    from specdec_kernels.e2e.drafters import NgramDrafter
    from specdec_kernels.e2e.exactness import TOP_K, RowTable, chi_square, exact_law
    prompt = _law_prompt(tiny)
    table = RowTable(tiny, None, prompt, 2, "ngram", NgramDrafter())
    law = exact_law(table)

    def counts_of(outputs):
        counts, outside = np.zeros((TOP_K, TOP_K)), 0
        for tokens in outputs:
            if len(tokens) < 2 or tokens[0] not in table.firsts:
                outside += 1
                continue
            seconds = table.target[table.prompt + (tokens[0],)].topk(TOP_K).indices.tolist()
            j = table.index.get(tokens[1])
            if j not in seconds:
                outside += 1
                continue
            counts[table.firsts.index(tokens[0]), seconds.index(j)] += 1
        return counts, outside

    outputs, server = _law_run(tiny, prompt, 8000, spec, background=4)
    assert server.stats.accepted > 100 and server.stats.max_rows <= 512
    counts, outside = counts_of(outputs)
    result = chi_square(counts, law)
    assert outside == 0 and result["p_value"] > 1e-3, result
    assert result["detectable_distance"] < 0.01, result
    if spec.drafter != "ngram" or spec.trie:
        return

    class Shifted(S.RowSampling):  # planted: row b gets row b - 1's parameters
        def __init__(self, samplings, device):
            super().__init__(list(samplings[-1:]) + list(samplings[:-1]), device)
    monkeypatch.setattr(S, "RowSampling", Shifted)
    outputs, _ = _law_run(tiny, prompt, 4000, spec, background=4)
    counts, outside = counts_of(outputs)
    assert outside > 0 or chi_square(counts, law)["p_value"] < 1e-3


def test_real_model_greedy_identity_with_requests_joining(real):
    """SmolLM2-135M, tiny budgets: every request's greedy tokens equal its own plain decoding
    while requests join mid-flight and leave (n-gram chain, adaptive, trie)."""
    from specdec_kernels.e2e.tasks import task_requests
    model, tokenizer = real
    eos = tokenizer.eos_token_id
    requests = (task_requests(tokenizer, "copy", 2, max_new_tokens=8)
                + task_requests(tokenizer, "rare_terms", 1, max_new_tokens=4))
    alone = [generate(model, [r], eos_token_id=eos).tokens[0] for r in requests]
    for spec in SPECS[1:4]:
        server = _staggered(model, spec, requests, eos=eos)
        assert [c.tokens for c in server.completions] == alone, spec
    bad = Request([], 4)
    server = Server(model, Speculation("ngram", 3), eos_token_id=eos)
    server.submit(requests[0])
    server.step()
    with pytest.raises(ValueError, match=r"requests\[1\]\.prompt"):
        server.submit(bad)
    while server.busy:
        server.step()
    assert server.completions[0].tokens == alone[0]


def test_serving_bench_tables_ratios_and_plot(tmp_path):
    """bench.serving's reductions on made-up rows: ratios to plain under the same load, the
    rate where speculation stops paying, and the files it writes."""
    from bench import serving as B
    rows = []
    for rate, plain, spec in ((0.5, 10.0, 15.0), (1.0, 18.0, 20.0), (2.0, 30.0, 29.4),
                              (4.0, 40.0, 38.0)):
        for config, tps in (("plain", plain), ("adaptive", spec)):
            rows.append({"load": f"poisson {rate:g}", "rate": rate, "clients": None,
                         "config": config, "tokens_per_s": tps, "tpot_p50_ms": 1e3 / tps,
                         "tpot_p99_ms": 2e3 / tps, "ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0,
                         "mean_batch": rate * 4, "accepted_per_step": 1.0,
                         "speculative_share": 0.5, "completed": 3, "requests": 3,
                         "profile_s": {}})
    B.ratios(rows)
    assert [r["throughput_vs_plain"] for r in rows[1::2]] == [1.5, 1.111, 0.98, 0.95]
    assert B.stops_paying(rows) == {"adaptive": 2.0}  # 0.98x: above the floor, TPOT behind
    for r in rows[5::2]:
        r["tpot_p50_vs_plain"] = 0.9               # ahead on TPOT: the floor decides
    assert B.stops_paying(rows) == {"adaptive": 4.0}
    assert B.percentile([3.0, 1.0, float("nan"), 2.0], 50) == 2.0
    assert B.percentile([], 99) is None
    meta = {"device_name": "cpu", "cpu": {"model": "x"}, "git_commit": "abc", "timestamp": "t",
            "threads": 1, "loadavg_start": [0.0], "loadavg_end": [0.0], "note": ""}
    B.write(tmp_path, {"meta": meta, "rows": rows, "stops_paying_at": B.stops_paying(rows)})
    for name in ("serving.json", "serving.csv", "serving_summary.md", "serving.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "stops paying" in (tmp_path / "serving_summary.md").read_text()


@pytest.mark.parametrize("loop", ["generate", "serve"])
def test_adaptive_draft_cost_is_charged_per_step(tiny, loop, monkeypatch):
    """The policy's draft cost per level comes from each step's own drafting time: the
    seconds it is told add up to at most the run's drafting (generate passed the run's
    running total, so a long run charged drafts ever more)."""
    told = []
    original = AdaptiveLength.observe_cost

    def spy(self, rows, seconds, draft_seconds=0.0, widest=0):
        told.append(draft_seconds)
        return original(self, rows, seconds, draft_seconds, widest)
    monkeypatch.setattr(AdaptiveLength, "observe_cost", spy)
    spec = Speculation("model", "adaptive", max_draft_tokens=3)
    requests = [Request([5, 6, 7, 8, 5, 6, 7], 24, stop_at_eos=False)]
    if loop == "generate":
        drafting = generate(tiny, requests, Sampling(), spec,
                            draft_model=tiny.draft).stats.profile["drafting"]
    else:
        drafting = _staggered(tiny, spec, requests).stats.profile["drafting"]
    assert len(told) > 10 and sum(told) <= drafting + 1e-6


@pytest.mark.parametrize("load_aware", [False, True])
def test_probes_fade_with_the_load(load_aware):
    """At batch 16 with rows costing in proportion, the load-aware policy's probes of a step
    cost at most one request's share (one probe of 4 rows here, the longest idle first; the
    others wait for the next probe step); generate's policy probes every due request."""
    policy = AdaptiveLength(16, 8, load_aware=load_aware)
    for rows, seconds in ((16, 1.0), (32, 2.0), (80, 5.0)) * 4:
        policy.observe_cost(rows, seconds)
    for b in range(16):
        for _ in range(4):
            policy.observe(b, 4, 0)              # nothing lands: every choice is plain
    probed = []
    for _ in range(8):
        lengths = policy.choose([8] * 16)
        probed.append([b for b, k in enumerate(lengths) if k])
        for b in probed[-1]:
            policy.observe(b, lengths[b], 0)
    assert probed[:3] == [[], [], []] and probed[4:7] == [[], [], []]
    if load_aware:
        assert len(probed[3]) == 1 and len(probed[7]) == 1 and probed[3] != probed[7]
    else:
        assert len(probed[3]) == 16
