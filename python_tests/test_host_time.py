"""Host time per call (issue 46, docs/performance.md): a call's structure is parsed once (its
plan), a validated call reads one combined flag, the Triton path's launches per mode are the
documented ones, and the bench runs."""
from __future__ import annotations

import collections
import copy
import dataclasses
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_kernels as sk
from specdec_kernels import chain, sampling, tree

B, K, V = 3, 4, 20


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(logits=torch.randn(B, K + 1, V, generator=g),
                ids=torch.randint(0, V, (B, K), generator=g),
                probs=torch.softmax(torch.randn(B, K, V, generator=g), -1),
                seed=torch.arange(B) + 5, offset=torch.zeros(B, dtype=torch.int64),
                parents=torch.tensor([[-1, 0, 0, 1, 2]] * B),
                tree_ids=torch.randint(0, V, (B, K + 1), generator=g))


class _Reads(TorchDispatchMode):
    """Counts the ops that hand a tensor's value to the host."""
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.counts["reads"] += 1
        return func(*args, **(kwargs or {}))


def test_a_repeated_call_reuses_its_plan(monkeypatch):
    x = _inputs()
    built = []
    plan = chain._chain_plan
    monkeypatch.setattr(chain, "_chain_plan", lambda *a: built.append(1) or plan(*a))
    monkeypatch.setattr(chain, "_CHAIN_PLANS", {})
    call = lambda t: sk.verify_chain(x["logits"], x["ids"], draft_probs=x["probs"],  # noqa: E731
                                     temperature=t, seed=x["seed"], offset=x["offset"])
    first, second = call(0.7), call(0.7)
    assert len(built) == 1 and torch.equal(first.output_token_ids, second.output_token_ids)
    other = call(1.3)  # another Python value: another plan, its own law
    assert len(built) == 2
    monkeypatch.setattr(chain, "_CHAIN_PLANS", {})
    assert torch.equal(other.output_token_ids, call(1.3).output_token_ids)  # = a fresh parse


def test_a_plan_still_checks_every_call_s_values():
    """The plan keeps host checks, never tensor values: a bad id on a repeated structure is
    still the contract's error, and a bad Python number still its own."""
    x = _inputs()
    for _ in range(2):
        sk.verify_chain(x["logits"], x["ids"], temperature=0.5, seed=x["seed"])
    bad = x["ids"].clone()
    bad[1, 2] = V
    with pytest.raises(ValueError, match=r"^draft_token_ids: expected ids in \[0, 20\).* at "
                                         r"\[1, 2\]"):
        sk.verify_chain(x["logits"], bad, temperature=0.5, seed=x["seed"])
    with pytest.raises(ValueError, match="^seed: expected a 64-bit integer"):
        sk.verify_chain(x["logits"], x["ids"], temperature=0.5, seed=2**64)
    sk.sample(x["logits"][:, 0], temperature=torch.ones(B), seed=x["seed"])
    with pytest.raises(ValueError, match="^temperature: expected finite values >= 0"):
        sk.sample(x["logits"][:, 0], temperature=-torch.ones(B), seed=x["seed"])


def _validated_calls(x):
    t, p = torch.full((B,), 0.8), torch.full((B,), 0.9)
    return {
        "verify_chain": lambda: sk.verify_chain(
            x["logits"], x["ids"], draft_probs=x["probs"], num_draft_tokens=torch.full((B,), 2),
            temperature=t, top_p=p, seed=x["seed"], offset=x["offset"]),
        "verify_chain_packed": lambda: sk.verify_chain_packed(
            x["logits"].reshape(-1, V)[:B * K], x["ids"].reshape(-1)[:B * (K - 1)],
            torch.arange(B + 1) * (K - 1), max_draft_tokens=K, temperature=t, top_p=p,
            seed=x["seed"], offset=x["offset"]),
        "verify_tree": lambda: sk.verify_tree(
            x["logits"], x["tree_ids"], x["parents"], num_nodes=torch.full((B,), 4),
            temperature=t, top_p=p, seed=x["seed"], offset=x["offset"]),
        "sample": lambda: sk.sample(x["logits"][:, 0], temperature=t, top_p=p, seed=x["seed"],
                                    offset=x["offset"]),
    }


@pytest.mark.parametrize("op", ["verify_chain", "verify_chain_packed", "verify_tree", "sample"])
def test_a_validated_call_reads_the_host_once(op):
    """Every value check of a validated call (the parameters' tensors, counts, ids, the tree)
    in one read of one combined flag: one synchronisation on a GPU, not one per check."""
    call = _validated_calls(_inputs())[op]
    call()
    with _Reads() as reads:
        call()
    assert reads.counts["reads"] == 1


def test_plans_are_bounded():
    x = _inputs()
    for t in range(100):
        sk.sample(x["logits"][:, 0], temperature=0.01 * (t + 1), seed=x["seed"])
    assert len(sampling._SAMPLE_PLANS) <= 64 and len(tree._TREE_PLANS) <= 64


# The Triton path's launches per call (docs/triton.md), counted in the interpreter: B = 1,
# K = 4, V = 16 (one chunk per row there).
LAUNCHES = {
    "verify_chain, one-hot greedy": {"_row_stats_kernel": 1, "_race_kernel": 1},
    "verify_chain, draft probs": {"_row_stats_kernel": 1, "_race_kernel": 1},
    "verify_chain, draft logits, top-p": {"_row_stats_kernel": 2, "_race_kernel": 1},
    "verify_chain, block, draft probs": {"_row_stats_kernel": 1, "_residual_mass_kernel": 1,
                                         "_race_kernel": 1},
    "verify_chain_packed, draft probs": {"_row_stats_kernel": 1, "_race_kernel": 1},
    "verify_tree, draft probs, chain-shaped": {"_row_stats_kernel": 1, "_tree_walk_kernel": 1},
    "sample, temperature 1": {"_row_stats_kernel": 1, "_race_kernel": 1},
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="counts launches in Triton's interpreter (TRITON_INTERPRET=1)")
def test_triton_launches_per_call_are_the_documented_ones():
    from bench.ops import host
    assert host.triton_launches() == LAUNCHES


def test_the_host_bench_runs(tmp_path):
    from bench.ops import host
    result = host.run(rounds=1, calls=1, profile_calls=2)
    rows = {(r["op"], r["mode"]) for r in result["rows"]}
    assert ("torch op", "softmax + argmax") in rows
    assert ("verify_chain", "draft logits, top-p, validate=True") in rows
    assert any(r["adapter"] for r in result["rows"]) and result["profiles"]


def test_a_call_under_fake_tensor_mode_leaves_no_fake_tensor_in_the_caches():
    """A traced call (FakeTensorMode, as torch.compile's fake kernels and make_fx run) parses
    afresh and caches nothing: the same Python numbers in a later eager call must not find
    a fake tensor in the parameter or broadcast caches (they did: every later eager call with
    those numbers failed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import specdec_kernels as sk
    with FakeTensorMode():
        sk.sample(torch.randn(3, 50), temperature=0.7, top_k=5,
                  seed=torch.zeros(3, dtype=torch.int64), validate=False)
        sk.verify_chain(torch.randn(3, 3, 50), torch.zeros(3, 2, dtype=torch.int64),
                        temperature=0.7, top_p=0.9, seed=torch.zeros(3, dtype=torch.int64),
                        validate=False)
    token = sk.sample(torch.randn(3, 50), temperature=0.7, top_k=5, seed=1)
    out = sk.verify_chain(torch.randn(3, 3, 50), torch.zeros(3, 2, dtype=torch.int64),
                          temperature=0.7, top_p=0.9, seed=1)
    assert token.shape == (3,) and out.output_token_ids.shape == (3, 3)


def test_the_caches_serve_real_tensors_under_modes_that_are_not_tracing():
    """Only tracing bypasses the caches: a profiler's or a test's dispatch mode and
    ``with torch.device(...)`` (a function mode) run real tensors, and the second of two
    identical calls there pays no parsing (test_host_path counts its ops under such a mode;
    a guard on every dispatch mode made it pay a fill per parameter)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from specdec_kernels import _params

    class _Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not _params._tracing()
    with _Passthrough():
        assert not _params._tracing()
    with torch.device("cpu"):
        assert not _params._tracing()
    with FakeTensorMode():
        assert _params._tracing()
    assert _params._tracing() is False


def _packed_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 2, 2, 5])  # request 1 has no drafts, request 2 three
    num_packed, batch = 5, 3
    return dict(logits=torch.randn(num_packed + batch, V, generator=g),
                ids=torch.randint(0, V, (num_packed,), generator=g), cu=cu,
                probs=torch.softmax(torch.randn(num_packed, V, generator=g), -1),
                seed=torch.arange(batch) + 5, offset=torch.zeros(batch, dtype=torch.int64))


def test_a_repeated_packed_call_reuses_its_plan_and_still_checks_its_offsets(monkeypatch):
    x = _packed_inputs()
    built = []
    plan = chain._packed_plan
    monkeypatch.setattr(chain, "_packed_plan", lambda *a: built.append(1) or plan(*a))
    monkeypatch.setattr(chain, "_PACKED_PLANS", {})
    call = lambda cu, **kw: sk.verify_chain_packed(  # noqa: E731
        x["logits"], x["ids"], cu, max_draft_tokens=K, draft_probs=x["probs"], temperature=0.7,
        seed=x["seed"], offset=x["offset"], **kw)
    first, second = call(x["cu"]), call(x["cu"])
    assert len(built) == 1 and torch.equal(first.output_token_ids, second.output_token_ids)
    reference = call(x["cu"], backend="reference")
    assert torch.equal(first.output_token_ids, reference.output_token_ids)
    with pytest.raises(ValueError, match="^cu_num_draft_tokens"):
        call(torch.tensor([0, 3, 2, 5]))  # the same structure, a bad value: still checked
    assert len(built) == 2  # (the reference call's backend is its own structure)


@pytest.mark.skipif(not sk._cpu.AVAILABLE, reason="needs the compiled C++ CPU path")
def test_the_cpp_packed_rows_equal_the_reference_layout_on_garbage_offsets():
    """The C++ op derives each request's rows from ``cu_num_draft_tokens`` itself: on garbage
    offsets (validate=False: decreasing, past T, negative, int64 extremes whose differences
    wrap) it reads the rows the reference's ``packed_layout`` gives, token for token."""
    x = _packed_inputs(1)
    big, small = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
    offsets = [[0, 2, 2, 5], [3, 1, 9, -4], [small, big, 0, 5], [big, small, small + 1, 2],
               [-1, 6, 2, 2], [0, 5, 5, 5], [5, 0, 0, 0]]
    for cu in offsets:
        for dtype in (torch.int64, torch.int32):
            cu_t = torch.tensor(cu, dtype=torch.int64)
            if dtype is torch.int32:
                cu_t = cu_t.clamp(-2**31, 2**31 - 1).to(torch.int32)
            outs = [sk.verify_chain_packed(
                x["logits"], x["ids"], cu_t, max_draft_tokens=K, draft_probs=x["probs"],
                temperature=0.7, seed=x["seed"], offset=x["offset"], backend=backend,
                validate=False) for backend in ("auto", "reference")]
            assert torch.equal(outs[0].output_token_ids, outs[1].output_token_ids), cu
            assert torch.equal(outs[0].num_accepted, outs[1].num_accepted), cu


def _tokens_or_error(call):
    """A verify call's tokens as lists, or its ValueError's message: what a check decides."""
    try:
        return call().output_token_ids.tolist()
    except ValueError as error:
        return str(error)


@pytest.mark.skipif(not sk._cpu.AVAILABLE, reason="needs the compiled C++ CPU path")
def test_the_cpp_packed_check_agrees_with_the_torch_checks(monkeypatch):
    """A validated CPU packed call checks its offsets and ids in one C++ pass
    (``cpu_packed_layout_ok``); where it finds a fault the torch checks name it. On valid
    layouts and on each of contract section 10's faults (int64 extremes included) a call gives
    the same tokens or the same error with the C++ pass and without it."""
    g = torch.Generator().manual_seed(3)
    big = torch.iinfo(torch.int64).max

    def outcome(cu, ids):
        logits = torch.randn(ids.shape[0] + cu.shape[0] - 1, V, generator=torch.Generator())
        return _tokens_or_error(lambda: sk.verify_chain_packed(
            logits, ids, cu, max_draft_tokens=K, temperature=0.0))

    for trial in range(300):
        batch = int(torch.randint(0, 5, (1,), generator=g))
        counts = torch.randint(0, K + 1, (batch,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        ids = torch.randint(0, V, (int(cu[-1]),), generator=g)
        fault = trial % 6
        if fault == 1:
            cu[int(torch.randint(0, batch + 1, (1,), generator=g))] += 1
        elif fault == 2 and batch:
            cu[1:] += K + 1  # a request with K + 1 drafts (and cu[B] != T)
        elif fault == 3 and batch > 1:
            cu[1], cu[2] = cu[2] + 1, cu[1]  # decreasing
        elif fault == 4 and ids.numel():
            ids[int(torch.randint(0, ids.numel(), (1,), generator=g))] = (-1, V)[trial % 2]
        elif fault == 5 and batch:
            cu[1] = (big, -big)[trial % 2]
        if trial % 3 == 0:
            cu = cu.clamp(-2**31, 2**31 - 1).to(torch.int32)
        fast = outcome(cu, ids)
        assert sk._cpu.packed_layout_ok(cu, ids, K, V) == (not isinstance(fast, str))
        with monkeypatch.context() as m:
            m.setattr(sk._cpu, "packed_layout_ok", lambda *a: False)
            assert outcome(cu, ids) == fast, (cu.tolist(), ids.tolist())


@pytest.mark.skipif(not sk._cpu.AVAILABLE, reason="needs the compiled C++ CPU path")
def test_the_cpp_tree_check_agrees_with_the_torch_checks(monkeypatch):
    """As for the packed layout: ``cpu_tree_ok`` (num_nodes, roots, edges, the real nodes' ids
    in one pass) and the torch checks give the same tokens or the same error on valid trees
    and on each fault (a bad count, root, forward edge, orphan, id; faults in padding nodes,
    which are not checked)."""
    g = torch.Generator().manual_seed(4)
    nodes = 5

    def outcome(parents, ids, num_nodes):
        logits = torch.randn(parents.shape[0], nodes, V, generator=torch.Generator())
        return _tokens_or_error(lambda: sk.verify_tree(
            logits, ids, parents, num_nodes=num_nodes, temperature=0.0))

    for trial in range(300):
        batch = int(torch.randint(1, 4, (1,), generator=g))
        parents = torch.stack([torch.cat([torch.tensor([-1]), torch.tensor(
            [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)])])
            for _ in range(batch)])
        ids = torch.randint(0, V, (batch, nodes), generator=g)
        num_nodes = torch.randint(1, nodes + 1, (batch,), generator=g) if trial % 2 else None
        b, i = int(torch.randint(0, batch, (1,), generator=g)), \
            int(torch.randint(1, nodes, (1,), generator=g))
        fault = trial % 7
        if fault == 1:
            parents[b, 0] = 0
        elif fault == 2:
            parents[b, i] = i  # a cycle or forward edge
        elif fault == 3:
            parents[b, i] = -1  # an orphan
        elif fault == 4:
            ids[b, i] = (-1, V)[trial % 2]
        elif fault == 5 and num_nodes is not None:
            num_nodes[b] = (0, nodes + 1)[trial % 4 // 2]
        if trial % 3 == 0:
            parents, ids = parents.to(torch.int32), ids.to(torch.int32)
        fast = outcome(parents, ids, num_nodes)
        assert sk._cpu.tree_ok(parents, num_nodes, ids, V) == (not isinstance(fast, str))
        with monkeypatch.context() as m:
            m.setattr(sk._cpu, "tree_ok", lambda *a: False)
            assert outcome(parents, ids, num_nodes) == fast, (parents.tolist(), ids.tolist())


@pytest.mark.skipif(not sk._cpu.AVAILABLE, reason="needs the compiled C++ CPU path")
def test_the_cpp_uniforms_are_the_torch_philox_bit_for_bit():
    """The FlashInfer adapter's acceptance uniforms come from one C++ op on CPU tensors
    (``_cpu.uniform``): bit for bit ``_rng.uniform`` over broadcast shapes, any 64-bit seed and
    offset, and every purpose; None under FakeTensorMode (the torch Philox runs there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from specdec_kernels import _rng
    g = torch.Generator().manual_seed(5)
    info = torch.iinfo(torch.int64)
    for purpose in (_rng.PURPOSE_ACCEPT, 0, 3):
        seed = torch.randint(info.min, info.max, (6, 1), generator=g)
        seed[0, 0], seed[1, 0] = info.min, info.max
        offset = torch.randint(info.min, info.max, (6, 1), generator=g)
        position = torch.arange(5) * 30011  # past 2**16 too (the stream keeps 16 bits)
        assert torch.equal(sk._cpu.uniform(seed, offset, position, purpose),
                           _rng.uniform(seed, offset, position, purpose))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(seed)
        assert sk._cpu.uniform(fake, fake, position, 0) is None


@pytest.mark.skipif(not sk._cpu.AVAILABLE, reason="needs the compiled C++ CPU path")
def test_cpp_packed_edges_equal_the_reference():
    """Batch 0 with packed rows left over (validate=False), K = 0, slots with S = 0 at batch
    0 (packed and padded), logprobs of every row: the C++ op gives the reference's outputs;
    a direct call with K past MAX_POSITION is an error, not a write past a buffer."""
    g = torch.Generator().manual_seed(6)

    def both(call):
        ours, reference = (call(backend) for backend in ("auto", "reference"))
        assert torch.equal(ours.output_token_ids, reference.output_token_ids)
        assert torch.equal(ours.num_accepted, reference.num_accepted)
        if reference.logprobs is not None:  # (float32 sums in another order: within 1e-5)
            torch.testing.assert_close(ours.logprobs, reference.logprobs, rtol=0, atol=1e-5,
                                       equal_nan=True)

    for cu, k, rows in (([0], 2, 3), ([5], 2, 3), ([0, 0, 0], 0, 2), ([0, 1, 3], 0, 5),
                        ([0, 2, 3], 2, 5)):
        num_packed = rows - (len(cu) - 1)
        logits = torch.randn(rows, V, generator=g)
        ids = torch.randint(0, V, (num_packed,), generator=g)
        probs = torch.softmax(torch.randn(num_packed, V, generator=g), -1)
        both(lambda backend: sk.verify_chain_packed(
            logits, ids, torch.tensor(cu), max_draft_tokens=k, draft_probs=probs,
            temperature=0.9, seed=3, offset=1, backend=backend, validate=False,
            return_logprobs="raw"))
    empty = torch.zeros(0, dtype=torch.int64)
    both(lambda backend: sk.verify_chain_packed(
        torch.randn(0, V), empty, torch.tensor([0]), max_draft_tokens=2,
        draft_probs=torch.rand(0, 2, V), draft_slots=empty, temperature=1.0, backend=backend))
    both(lambda backend: sk.verify_chain(
        torch.randn(0, 3, V), torch.zeros(0, 2, dtype=torch.int64),
        draft_probs=torch.rand(0, 4, V + 2), draft_slots=empty, temperature=1.0,
        backend=backend))
    b = 4
    with pytest.raises(RuntimeError, match="max_draft_tokens must be in"):
        torch.ops.specdec.cpu_verify_chain_packed(
            torch.randn(b, V), empty, None, None, torch.zeros(b + 1, dtype=torch.int64), 2**62,
            torch.ones(b), torch.zeros(b, dtype=torch.int32), torch.ones(b), None, None,
            torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), 0, 0)


def test_every_tracing_mode_counts_as_tracing():
    """make_fx (real and fake tracing, and pre-dispatch), functionalization and vmap bypass
    the caches and the C++ helpers; plain eager and an op counter do not."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from specdec_kernels import _types
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = _types.tracing()
            return x + 1
        return f
    make_fx(probe("real"), tracing_mode="real")(torch.ones(2))
    make_fx(probe("fake"), tracing_mode="fake")(torch.ones(2))
    make_fx(probe("pre_dispatch"), tracing_mode="real", pre_dispatch=True)(torch.ones(2))
    torch.func.functionalize(probe("functionalize"))(torch.ones(2))
    torch.vmap(probe("vmap"))(torch.ones(2, 2))
    assert seen == dict.fromkeys(("real", "fake", "pre_dispatch", "functionalize", "vmap"),
                                 True), seen
    assert not _types.tracing()


@pytest.mark.parametrize("op", ["chain", "packed", "tree", "sample"])
def test_a_plan_of_tensor_parameters_takes_each_call_s_values(op, monkeypatch):
    """A plan keeps a template of tensor parameters, never their values: a repeated structure
    with other temperatures, top-k, top-p and min-p gives what a fresh parse of them gives (and
    is served by the template: ``_params.filled``), a non-contiguous tensor of the kept
    structure is parsed afresh, and a bad value is still the error."""
    from specdec_kernels import _params
    x, p = _inputs(), _packed_inputs()

    def call(t, top_k, top_p, min_p):
        s = dict(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, seed=x["seed"],
                 offset=x["offset"])
        if op == "chain":
            return sk.verify_chain(x["logits"], x["ids"], draft_probs=x["probs"], **s)[0]
        if op == "packed":
            return sk.verify_chain_packed(p["logits"], p["ids"], p["cu"], max_draft_tokens=K,
                                          draft_probs=p["probs"], **s)[0]
        if op == "tree":
            return sk.verify_tree(x["logits"], x["tree_ids"], x["parents"], **s)[0]
        return sk.sample(x["logits"][:, 0], **s)

    served = []
    real_filled = _params.filled
    monkeypatch.setattr(_params, "filled",
                        lambda *a: served.append(real_filled(*a)) or served[-1])
    plans = (chain._CHAIN_PLANS, chain._PACKED_PLANS, tree._TREE_PLANS, sampling._SAMPLE_PLANS)
    for temperature, top_k, min_p in (([0.5, 1.0, 2.0], [0, 3, 1], [0.0, 0.1, 0.5]),
                                      ([0.0, 3.0, 0.2], [2, 0, V], [0.3, 0.0, 0.0]),
                                      ([4.0, 0.0, 1.0], [1, 1, 5], [0.9, 0.2, 0.05])):
        # (top_k as int32, the parse's own dtype: an int64 one is narrowed, so parsed afresh)
        t, m = torch.tensor(temperature), torch.tensor(min_p)
        k = torch.tensor(top_k, dtype=torch.int32)
        top_p = torch.tensor([0.9, 0.5, 1.0])
        for cache in plans:
            cache.clear()
        _params_cache().clear()
        fresh = call(t, k, top_p, m)  # parsed: the plan keeps a template
        served.clear()
        kept = call(t.clone(), k.clone(), top_p.clone(), m.clone())  # from the template
        assert torch.equal(kept, fresh)
        assert served and all(params is not None for params in served)
        strided = torch.stack([t, t], 1)[:, 0]  # the kept structure, not contiguous
        assert not strided.is_contiguous() and torch.equal(kept, call(strided, k, top_p, m))
        assert torch.equal(kept, call(t, k.long(), top_p, m))  # int64 top-k: the same tokens
    with pytest.raises(ValueError, match="^top_p: expected values in \\(0, 1\\]"):
        call(t, k, torch.tensor([0.9, 0.0, 1.0]), m)
    with pytest.raises(ValueError, match="^min_p: expected"):
        call(t, k, top_p, torch.tensor([0.9, 1.5, 1.0]))


def _params_cache():
    from specdec_kernels import _params
    return _params._PARAMS_CACHE


def _vllm_step(num_draft_tokens, seed=0, **sampling):
    from specdec_kernels.adapters import vllm
    g = torch.Generator().manual_seed(seed)
    metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(
        [torch.randint(0, V, (n,), generator=g).tolist() for n in num_draft_tokens])
    rows = sum(num_draft_tokens) + len(num_draft_tokens)
    logits = torch.randn(rows, V, generator=g)
    sm = vllm.SamplingMetadata(**{"temperature": torch.full((len(num_draft_tokens),), 0.8),
                                  "all_greedy": False, "all_random": True, **sampling})
    return metadata, logits, sm


def test_the_vllm_step_layout_is_kept_by_structure_and_every_call_is_still_checked():
    """``parse_step`` keeps a step's layout by its structure: a repeated structure gives what a
    fresh parse gives, another draft count its own layout, and what a call's Python values
    can change (the counts' types, ``max_spec_len``, generators, ``spec_token_ids``) is still
    checked on every call, with the error a fresh parse gives."""
    from specdec_kernels.adapters import vllm
    from specdec_kernels.adapters.vllm import _layout
    sampler = vllm.RejectionSampler(None, None, fused_bonus=True)
    seed, offset = torch.tensor([3, 4]), torch.zeros(2, dtype=torch.int64)
    metadata, logits, sm = _vllm_step([2, 3])
    first = sampler(metadata, None, logits, sm, seed=seed, offset=offset).sampled_token_ids
    other_metadata, other_logits, _ = _vllm_step([3, 2], seed=1)  # same shapes, other counts
    other = sampler(other_metadata, None, other_logits, sm, seed=seed, offset=offset)
    _layout._STEPS.clear()
    assert torch.equal(first, sampler(metadata, None, logits, sm, seed=seed,
                                      offset=offset).sampled_token_ids)
    _layout._STEPS.clear()
    assert torch.equal(other.sampled_token_ids, sampler(
        other_metadata, None, other_logits, sm, seed=seed, offset=offset).sampled_token_ids)

    def error(**changes):
        bad = copy.copy(metadata)
        for name, value in changes.pop("metadata", {}).items():
            object.__setattr__(bad, name, value)
        try:
            sampler(bad, changes.pop("draft_probs", None), logits,
                    dataclasses.replace(sm, **changes), seed=seed, offset=offset)
        except (TypeError, ValueError) as e:
            return type(e), str(e)
        return None

    cases = [dict(metadata=dict(num_draft_tokens=[True, 3])),
             dict(metadata=dict(max_spec_len=2)),
             dict(generators={5: torch.Generator()}),
             dict(draft_probs=torch.full((5, V), 1.0 / V), spec_token_ids=[[1, 2]])]
    for case in cases:
        for _ in range(2):  # the step's structure (the case's draft_probs too) is kept by then
            sampler(metadata, case.get("draft_probs"), logits, sm, seed=seed, offset=offset)
        assert _layout._STEPS
        kept = error(**dict(case))
        _layout._STEPS.clear()
        assert kept is not None and kept == error(**dict(case)), case


def test_a_validated_vllm_step_reads_the_host_once():
    """vLLM's validated step checks the ids, its layout, the parameters and the prompt in
    one read (on a GPU each read is a synchronisation), with each check's own error."""
    from specdec_kernels.adapters import vllm
    sampler = vllm.RejectionSampler(None, None, fused_bonus=True, validate=True)
    seed, offset = torch.tensor([3, 4]), torch.zeros(2, dtype=torch.int64)
    metadata, logits, sm = _vllm_step([2, 3])
    sampler(metadata, None, logits, sm, seed=seed, offset=offset)
    with _Reads() as reads:
        sampler(metadata, None, logits, sm, seed=seed, offset=offset)
    assert reads.counts["reads"] == 1
    bad = copy.copy(metadata)
    object.__setattr__(bad, "draft_token_ids", metadata.draft_token_ids.clone())
    bad.draft_token_ids[3] = V
    with pytest.raises(ValueError, match=r"^draft_token_ids: expected ids in \[0, 20\) or -1 "
                                         r".* got 20 at \[3\]"):
        sampler(bad, None, logits, sm, seed=seed, offset=offset)
    bad = copy.copy(metadata)
    object.__setattr__(bad, "bonus_logits_indices", metadata.bonus_logits_indices.flip(0))
    with pytest.raises(ValueError, match=r"^bonus_logits_indices: expected vLLM's layout .*"
                                         r"\[2, 6\], got \[6, 2\]"):
        sampler(bad, None, logits, sm, seed=seed, offset=offset)
    with pytest.raises(ValueError, match="^temperature: expected finite values >= 0"):
        sampler(metadata, None, logits, dataclasses.replace(sm, temperature=torch.tensor(
            [0.8, float("nan")])), seed=seed, offset=offset)
