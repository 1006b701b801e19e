"""Graph safety (contract section 15): every public op reaches its kernel through one
registered ``torch.library`` op with a fake, so ``torch.compile(fullgraph=True)`` of a step
that calls it gives the eager tokens and ``torch.library.opcheck`` passes; ``validate=False``
reads nothing on the host (``specdec_kernels.testing.forbid_host_sync``); ``seed=None`` under
CUDA-graph capture is a ValueError naming ``seed``. The CUDA tests (capture and replay, sync
debug mode) run where a GPU is present (bench/gpu_check.sh runs this file)."""
from __future__ import annotations

import doctest
import os
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_kernels as sk
from specdec_kernels import _cpu, _extension, _ops, _params, _types
from specdec_kernels.testing import HostSyncError, forbid_host_sync
from specdec_kernels.testing import sync as sync_module

from conftest import needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED

# Backends of the Triton-family ops on CPU tensors: "auto" is the C++ CPU path.
CPU_BACKENDS = ["auto", "reference"] + (["triton"] if INTERPRETED else [])
CPU_EXTENSION_BACKENDS = ["auto", "reference"]

B, K, V, N = 2, 3, 40, 5
PARENTS = [-1, 0, 0, 1, 2]


class Inputs(NamedTuple):
    logits2: torch.Tensor       # [B, V]
    chain_logits: torch.Tensor  # [B, K+1, V]
    draft_ids: torch.Tensor     # [B, K]
    draft_probs: torch.Tensor   # [B, K, V]
    draft_logits: torch.Tensor  # [B, K, V]
    num_drafts: torch.Tensor    # [B]
    packed_logits: torch.Tensor  # [T+B, V]
    packed_ids: torch.Tensor    # [T]
    cu: torch.Tensor            # [B+1]
    tree_logits: torch.Tensor   # [B, N, V]
    tree_ids: torch.Tensor      # [B, N]
    parents: torch.Tensor       # [B, N]
    tree_probs: torch.Tensor    # [B, N, V]
    num_nodes: torch.Tensor     # [B]
    bitmask: torch.Tensor       # [B, K+1, W]
    temperature: torch.Tensor   # [B]
    seeds: torch.Tensor         # [B]
    offsets: torch.Tensor       # [B]
    caches: list                # 2 x [B, S, H, D]
    paged: list                 # 2 x [blocks, block, H, D]
    block_tables: torch.Tensor  # [B, blocks per request]
    kv_lens: torch.Tensor       # [B]
    accepted_nodes: torch.Tensor  # [B, N]
    num_accepted: torch.Tensor  # [B]


def make_inputs(device="cpu", seed=0) -> Inputs:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (2 * torch.randn(*shape, generator=g)).to(device)

    counts = torch.tensor([2, 3])
    total = int(counts.sum())
    draft_probs = torch.softmax(randn(B, K, V), -1)
    tree_probs = torch.softmax(randn(B, N, V), -1)
    bitmask = torch.full((B, K + 1, (V + 31) // 32), -1, dtype=torch.int32)
    bitmask[:, 1, 0] = 0x0FFF0FFF  # a grammar's mask on one row
    caches = [randn(B, 12, 2, 4) for _ in range(2)]
    paged = [randn(8, 4, 2, 4) for _ in range(2)]
    return Inputs(
        logits2=randn(B, V), chain_logits=randn(B, K + 1, V),
        draft_ids=torch.randint(0, V, (B, K), generator=g).to(device),
        draft_probs=draft_probs, draft_logits=randn(B, K, V),
        num_drafts=torch.tensor([3, 1], device=device),
        packed_logits=randn(total + B, V),
        packed_ids=torch.randint(0, V, (total,), generator=g).to(device),
        cu=torch.tensor([0, 2, 5], device=device),
        tree_logits=randn(B, N, V),
        tree_ids=torch.randint(0, V, (B, N), generator=g).to(device),
        parents=torch.tensor([PARENTS] * B, device=device), tree_probs=tree_probs,
        num_nodes=torch.tensor([5, 4], device=device), bitmask=bitmask.to(device),
        temperature=torch.tensor([0.8, 0.0], device=device),
        seeds=torch.tensor([11, -3], device=device), offsets=torch.tensor([4, 9], device=device),
        caches=caches, paged=paged,
        block_tables=torch.tensor([[3, 1, 6], [0, 5, 2]], device=device),
        kv_lens=torch.tensor([3, 5], device=device),
        accepted_nodes=torch.tensor([[0, 2, 4, -1, -1], [0, 1, -1, -1, -1]], device=device),
        num_accepted=torch.tensor([2, 1], device=device))


# One step per public op (and per method): (name, step(x, backend) -> tuple of tensors).
# Each passes validate=False and tensor seeds and offsets, as an engine's decode step does.

def _processed_probs(x, backend):
    return (sk.processed_probs(x.logits2, x.temperature, 5, 0.9, validate=False, min_p=0.01),)


def _sample(x, backend):
    out = sk.sample(x.logits2, temperature=x.temperature, top_k=7, seed=x.seeds,
                    offset=x.offsets, backend=backend, validate=False, return_logprobs="raw")
    return tuple(out)


def _chain(x, backend):
    out = sk.verify_chain(x.chain_logits, x.draft_ids, draft_probs=x.draft_probs,
                          num_draft_tokens=x.num_drafts, temperature=x.temperature, top_p=0.9,
                          seed=x.seeds, offset=x.offsets, backend=backend, validate=False,
                          token_bitmask=x.bitmask, return_logprobs="processed")
    return tuple(out)


def _chain_block(x, backend):
    out = sk.verify_chain(x.chain_logits, x.draft_ids, draft_logits=x.draft_logits,
                          temperature=0.9, seed=x.seeds, offset=x.offsets, method="block",
                          backend=backend, validate=False)
    return out.output_token_ids, out.num_accepted


def _chain_packed(x, backend):
    out = sk.verify_chain_packed(x.packed_logits, x.packed_ids, x.cu, max_draft_tokens=K,
                                 temperature=x.temperature, top_k=9, seed=x.seeds,
                                 offset=x.offsets, backend=backend, validate=False)
    return out.output_token_ids, out.num_accepted


def _tree(x, backend):
    out = sk.verify_tree(x.tree_logits, x.tree_ids, x.parents, num_nodes=x.num_nodes,
                         temperature=x.temperature, seed=x.seeds, offset=x.offsets,
                         backend=backend, validate=False, return_logprobs="raw")
    return tuple(out)


def _tree_traversal(x, backend):
    out = sk.verify_tree(x.tree_logits, x.tree_ids, x.parents, draft_probs=x.tree_probs,
                         draft_sampling="without_replacement", temperature=1.0, seed=x.seeds,
                         offset=x.offsets, method="traversal", backend=backend, validate=False)
    return out.output_token_ids, out.accepted_nodes, out.num_accepted


def _mask(x, backend):
    backend = "extension" if backend == "auto" else backend
    return tuple(sk.build_tree_attention(x.parents, num_nodes=x.num_nodes, prefix_lens=x.kv_lens,
                                         backend=backend, validate=False))


def _compact(x, backend):
    backend = "extension" if backend == "auto" else backend
    new = sk.compact_kv_cache(x.caches, x.kv_lens, x.accepted_nodes, x.num_accepted,
                              backend=backend, validate=False)
    return (new, *x.caches)


def _compact_paged(x, backend):
    backend = "extension" if backend == "auto" else backend
    new = sk.compact_paged_kv_cache(x.paged, x.block_tables, x.kv_lens, x.accepted_nodes,
                                    x.num_accepted, backend=backend, validate=False)
    return (new, *x.paged)


SAMPLING_STEPS = {"sample": _sample, "verify_chain": _chain, "verify_chain_block": _chain_block,
                  "verify_chain_packed": _chain_packed, "verify_tree": _tree,
                  "verify_tree_traversal": _tree_traversal}
EXTENSION_STEPS = {"build_tree_attention": _mask, "compact_kv_cache": _compact,
                   "compact_paged_kv_cache": _compact_paged}
# The Triton ops run in the interpreter on CPU (seconds a call): one step per Triton op.
TRITON_STEPS = ("sample", "verify_chain", "verify_chain_packed", "verify_tree")
# (name, backend) of every step: the reference and C++ paths for all, Triton for one step
# per op where TRITON_INTERPRET=1.
CASES = ([("processed_probs", "reference")]
         + [(name, backend) for name in SAMPLING_STEPS for backend in CPU_BACKENDS
            if backend != "triton" or name in TRITON_STEPS]
         + [pytest.param(name, backend, marks=pytest.mark.skipif(
             backend == "auto" and not _extension.HAS_EXTENSION, reason="_C not built"))
            for name in EXTENSION_STEPS for backend in CPU_EXTENSION_BACKENDS])
# The guard checks the public layer up to the op, which is the same Python for the Triton
# and the reference backends: no Triton cases.
GUARD_CASES = [case for case in CASES if not (isinstance(case, tuple) and case[1] == "triton")]
STEPS = {"processed_probs": _processed_probs, **SAMPLING_STEPS, **EXTENSION_STEPS}


def assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) if not a.is_floating_point() else \
            torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph break, the eager result
# ---------------------------------------------------------------------------------------------

# aot_eager traces what matters for the ops (Dynamo, fake tensors, functionalisation, the
# mutation of the caches); Inductor, the default, compiles the surrounding parsing code too:
# its C++ compilation costs seconds per step, so it runs for a decode step of every kind below.
@pytest.mark.parametrize("name,backend", CASES)
def test_fullgraph_compile_gives_the_eager_result(name, backend):
    torch._dynamo.reset()
    step = STEPS[name]
    eager_inputs, compiled_inputs = make_inputs(), make_inputs()
    expected = step(eager_inputs, backend)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_inputs, backend)
    assert_same(got, expected)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_inductor_decode_step_gives_the_eager_tokens(backend):
    """A whole tree step, Inductor-compiled: verify, attention metadata for the next step,
    KV compaction of the accepted path, then a sample from a chain's bonus row."""
    if backend == "auto" and not _extension.HAS_EXTENSION:
        pytest.skip("_C not built")
    torch._dynamo.reset()

    def decode_step(x):
        tree = _tree(x, backend)
        mask = _mask(x, backend)
        new_lens = sk.compact_kv_cache(x.caches, x.kv_lens, tree[1], tree[2],
                                       backend="extension" if backend == "auto" else backend,
                                       validate=False)
        chain = _chain(x, backend)
        return (*tree, *mask, new_lens, *x.caches, *chain, *_sample(x, backend))

    expected = decode_step(make_inputs(seed=1))
    compiled = torch.compile(decode_step, fullgraph=True)
    assert_same(compiled(make_inputs(seed=1)), expected)
    assert_same(compiled(make_inputs(seed=1)), expected)  # the compiled graph, run again


# Validated calls (the default validate=True) under fullgraph: the value checks are the op
# specdec::check_values, run when the compiled step runs; a bad value raises the eager error.
def _validated_steps(x):
    return {
        "verify_chain": lambda: sk.verify_chain(
            x.chain_logits, x.draft_ids, draft_probs=x.draft_probs,
            num_draft_tokens=x.num_drafts, temperature=x.temperature, top_p=0.9, seed=x.seeds,
            offset=x.offsets).output_token_ids,
        "verify_chain_packed": lambda: sk.verify_chain_packed(
            x.packed_logits, x.packed_ids, x.cu, max_draft_tokens=K, temperature=x.temperature,
            seed=x.seeds, offset=x.offsets).output_token_ids,
        "verify_tree": lambda: sk.verify_tree(
            x.tree_logits, x.tree_ids, x.parents, num_nodes=x.num_nodes,
            temperature=x.temperature, seed=x.seeds, offset=x.offsets).output_token_ids,
        "sample": lambda: sk.sample(x.logits2, temperature=x.temperature, seed=x.seeds,
                                    offset=x.offsets),
    }


# (op, the input made bad in place, its bad value, the eager error's start)
BAD_VALUES = [
    ("verify_chain", "draft_ids", (0, 0, V), "draft_token_ids: expected ids in"),
    ("verify_chain", "num_drafts", (1, 7), "num_draft_tokens: expected values in 0..3"),
    ("verify_chain", "temperature", (0, -1.0), "temperature: expected finite values >= 0"),
    ("verify_chain_packed", "cu", (1, 4), "cu_num_draft_tokens: expected at most"),
    ("verify_tree", "parents", (1, 3, 4), "parents: not a tree"),
    ("sample", "temperature", (1, float("nan")), "temperature: expected finite values >= 0"),
]


@pytest.mark.parametrize("op,field,bad,message", BAD_VALUES)
def test_fullgraph_validated_call_compiles_and_raises_the_eager_error(op, field, bad, message):
    torch._dynamo.reset()
    x = make_inputs()
    expected = _validated_steps(x)[op]()
    compiled = torch.compile(lambda: _validated_steps(x)[op](), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(), expected)  # compiles (no graph break), the eager tokens
    tensor, *index, value = getattr(x, field), *bad[:-1], bad[-1]
    tensor[tuple(index)] = value
    with pytest.raises(ValueError, match="^" + message) as eager:
        _validated_steps(x)[op]()
    with pytest.raises(ValueError, match="^" + message) as in_graph:
        compiled()  # the same graph: the check runs when it runs
    assert str(in_graph.value) == str(eager.value)


def test_fullgraph_bad_shape_is_dynamos_unsupported_naming_the_eager_error():
    """Host checks (shapes, dtypes, Python numbers) run while Dynamo traces: under
    fullgraph=True their error becomes torch._dynamo.exc.Unsupported ("Observed exception"),
    whose cause names the eager error (docs/graphs.md); without fullgraph, the eager error."""
    torch._dynamo.reset()
    x = make_inputs()

    def step(ids):
        return sk.verify_chain(x.chain_logits, ids, seed=x.seeds, offset=x.offsets)

    with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
        torch.compile(step, fullgraph=True, backend="aot_eager")(x.draft_ids[:, :2])
    assert "draft_token_ids: expected shape [2, 3]" in repr(caught.value.__cause__)
    with pytest.raises(ValueError, match="^draft_token_ids: expected shape"):
        torch.compile(step, backend="aot_eager")(x.draft_ids[:, :2])


def test_seed_none_under_compile_draws_afresh_like_eager():
    """``seed=None`` under torch.compile: a fresh draw from torch's default generator on
    every call of the compiled step, the same draws as eager mode (``specdec::draw_seeds``
    runs when the step runs, not when it is traced)."""
    torch._dynamo.reset()
    logits = torch.zeros(8, 1000)  # uniform: two draws agree with probability ~1e-24

    def step(logits):
        return sk.sample(logits, validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    eager = [step(logits) for _ in range(3)]
    torch.manual_seed(5)
    got = [compiled(logits) for _ in range(3)]
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], got[1])


# ---------------------------------------------------------------------------------------------
# opcheck on every registered op
# ---------------------------------------------------------------------------------------------


class _FirstOp(TorchDispatchMode):
    """Records every ``specdec::`` op a call dispatches, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "specdec":
            clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls.append((func, tuple(
                [clone(a) for a in arg] if isinstance(arg, list) else clone(arg)
                for arg in args), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _op_calls():
    """(op name, OpOverload, args, kwargs) of every specdec op the public layer reaches on CPU
    (seed=None for ``draw_seeds``), plus ``cpu_processed_probs`` (the C++ path's
    ``processed_probs``, which the public function leaves to the reference)."""
    calls = {}
    for name, backend in [(c.values[0], c.values[1]) if hasattr(c, "values") else c
                          for c in CASES]:
        if backend == "auto" and name in EXTENSION_STEPS and not _extension.HAS_EXTENSION:
            continue
        with _FirstOp() as recorder:
            STEPS[name](make_inputs(), backend)
        for func, args, kwargs in recorder.calls:
            calls.setdefault(func.name().split("::")[1], (func, args, kwargs))
    with _FirstOp() as recorder:
        sk.sample(make_inputs().logits2, validate=False)
        if _cpu.AVAILABLE:
            params = _params.sampling_params(0.7, 3, 0.9, batch=B, vocab_size=V,
                                             device=torch.device("cpu"), validate=False)
            _cpu.processed_probs(make_inputs().logits2, params)
    for func, args, kwargs in recorder.calls:
        calls.setdefault(func.name().split("::")[1], (func, args, kwargs))
    # A validated call's value checks: the op under torch.compile only (eagerly a plain call,
    # so that forbid_host_sync sees its reads); these are sample's (a temperature tensor).
    x = make_inputs()
    calls["check_values"] = (torch.ops.specdec.check_values.default,
                             ("sampling", [x.temperature, None, None, None], []), {})
    return calls


_CALLS = None


def _calls():
    global _CALLS
    if _CALLS is None:
        _CALLS = _op_calls()
    return _CALLS


def test_every_registered_op_is_reached():
    reachable = set(_ops.registered_ops())
    if not INTERPRETED:
        reachable -= {"triton_sample", "triton_verify_chain", "triton_verify_chain_packed",
                      "triton_verify_tree"}
    assert reachable <= set(_calls()), reachable - set(_calls())


@pytest.mark.parametrize("name", sorted(_ops.registered_ops()))
def test_opcheck(name, monkeypatch):
    if name.startswith("triton_") and not INTERPRETED:
        pytest.skip("the Triton ops run on CPU tensors under TRITON_INTERPRET=1")
    func, args, kwargs = _calls()[name]
    # draw_seeds is random by design: its outputs differ between runs, so opcheck's checks
    # that compare two runs are left out (its fake and schema are still checked).
    tests = ("test_schema", "test_faketensor") if name == "draw_seeds" else \
        ("test_schema", "test_autograd_registration", "test_faketensor",
         "test_aot_dispatch_dynamic")
    # logprobs are NaN where the token is -1 (the contract): compare NaN as equal.
    assert_close = torch.testing.assert_close
    monkeypatch.setattr(torch.testing, "assert_close",
                        lambda *a, **k: assert_close(*a, **{"equal_nan": True, **k}))
    torch.library.opcheck(func, args, kwargs, test_utils=tests)


# ---------------------------------------------------------------------------------------------
# No host synchronisation with validate=False
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,backend", GUARD_CASES)
def test_validate_false_reads_nothing_on_the_host(name, backend):
    x = make_inputs()
    STEPS[name](x, backend)  # first call: broadcast caches filled, kernels loaded
    with forbid_host_sync():
        STEPS[name](x, backend)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_scalar_parameters_and_defaults_read_nothing_on_the_host(backend):
    x = make_inputs()
    with forbid_host_sync():
        sk.verify_chain(x.chain_logits, x.draft_ids, temperature=0.7, top_k=5, top_p=0.8,
                        min_p=0.05, seed=3, offset=1, backend=backend, validate=False)
        sk.verify_tree(x.tree_logits, x.tree_ids, x.parents, seed=7, backend=backend,
                       validate=False)
        sk.sample(x.logits2, seed=None, backend=backend, validate=False)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: int(t[0]), lambda t: bool(t.any()), lambda t: t.tolist(),
    lambda t: t.numpy(), lambda t: t.nonzero(), lambda t: t[t > 0],
    lambda t: torch.masked_select(t, t > 0), lambda t: torch.unique(t),
    lambda t: torch.repeat_interleave(t.clamp(0, 2)), lambda t: t.equal(t)],
    ids=["item", "int", "bool", "tolist", "numpy", "nonzero", "bool_index", "masked_select",
         "unique", "repeat_interleave", "equal"])
def test_the_guard_catches_host_reads(read):
    t = torch.tensor([1, 0, 2])
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            read(t)
    read(t)  # and leaves everything as it was
    assert torch.Tensor.tolist(t) == [1, 0, 2]


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_the_guard_catches_validation(backend):
    """validate=True reads the small tensors: the guard sees it (a planted host read)."""
    x = make_inputs()
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            sk.verify_chain(x.chain_logits, x.draft_ids, seed=x.seeds, offset=x.offsets,
                            backend=backend)


def test_the_guard_docstring_example():
    result = doctest.testmod(sync_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------
# seed=None under CUDA-graph capture
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sample", "verify_chain", "verify_chain_packed", "verify_tree"])
def test_seed_none_while_capturing_is_a_value_error(monkeypatch, op):
    """Simulated on CPU: the capture query answers True. Nothing is drawn."""
    monkeypatch.setattr(_types, "capturing", lambda device: True)
    x = make_inputs()
    calls = {
        "sample": lambda: sk.sample(x.logits2),
        "verify_chain": lambda: sk.verify_chain(x.chain_logits, x.draft_ids, offset=x.offsets),
        "verify_chain_packed": lambda: sk.verify_chain_packed(
            x.packed_logits, x.packed_ids, x.cu, max_draft_tokens=K),
        "verify_tree": lambda: sk.verify_tree(x.tree_logits, x.tree_ids, x.parents),
    }
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="^seed: "):
        calls[op]()
    assert torch.equal(torch.get_rng_state(), state)
    calls_with_seeds = sk.sample(x.logits2, seed=x.seeds)  # tensor seeds: fine
    assert calls_with_seeds.shape == (B,)


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU; bench/gpu_check.sh runs them on a lent one)
# ---------------------------------------------------------------------------------------------

CUDA_STEPS = ["sample", "verify_chain", "verify_chain_block", "verify_chain_packed",
              "verify_tree", "verify_tree_traversal", "build_tree_attention",
              "compact_kv_cache", "compact_paged_kv_cache"]


def _copy_into(static: Inputs, fresh: Inputs) -> None:
    for a, b in zip(static, fresh):
        for s, f in (zip(a, b) if isinstance(a, list) else [(a, b)]):
            s.copy_(f)


@needs_cuda
@pytest.mark.skipif(not ON_GPU, reason="CUDA tensors (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", CUDA_STEPS)
def test_cuda_graph_capture_and_replay_equal_eager(name):
    """Capture the op with tensor seeds and offsets, replay it on new inputs copied into the
    captured buffers: the eager result on those inputs."""
    if name in EXTENSION_STEPS and not _extension.KERNELS.get((name, "cuda")):
        pytest.skip("the CUDA extension is not built")
    step = STEPS[name]
    static = make_inputs("cuda", seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (kernel compilation) outside the capture
        step(make_inputs("cuda", seed=1), "auto")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(static, "auto")
    for seed in (2, 3):
        fresh = make_inputs("cuda", seed=seed)
        _copy_into(static, fresh)
        graph.replay()
        expected = step(make_inputs("cuda", seed=seed), "auto")
        assert_same(outputs, expected)


@needs_cuda
@pytest.mark.skipif(not ON_GPU, reason="CUDA tensors (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", CUDA_STEPS)
def test_cuda_sync_debug_mode_error_around_the_ops(name):
    if name in EXTENSION_STEPS and not _extension.KERNELS.get((name, "cuda")):
        pytest.skip("the CUDA extension is not built")
    x = make_inputs("cuda")
    STEPS[name](x, "auto")  # compiles the kernels, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with forbid_host_sync():
            STEPS[name](x, "auto")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@needs_cuda
@pytest.mark.skipif(not ON_GPU, reason="CUDA tensors (TRITON_INTERPRET unset)")
def test_cuda_seed_none_while_capturing_is_a_value_error():
    x = make_inputs("cuda")
    sk.sample(x.logits2, seed=x.seeds, offset=x.offsets)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(ValueError, match="^seed: "):
            sk.sample(x.logits2, offset=x.offsets)


@needs_cuda
@pytest.mark.skipif(not ON_GPU, reason="CUDA tensors (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", ["verify_chain", "verify_chain_packed", "verify_tree"])
def test_cuda_fullgraph_compile_gives_the_eager_tokens(name):
    torch._dynamo.reset()
    step = STEPS[name]
    expected = step(make_inputs("cuda"), "auto")
    got = torch.compile(step, fullgraph=True)(make_inputs("cuda"), "auto")
    assert_same(got, expected)


# ---------------------------------------------------------------------------------------------
# The bench's compiled variant
# ---------------------------------------------------------------------------------------------


def test_bench_times_a_compiled_variant_beside_eager():
    from bench import harness
    from bench.ops import chain as chain_bench
    env = harness.Environment(torch.device("cpu"), "cpu", "t", "t", "c", False, "h", "now",
                              copy_bw_gbps=10.0)
    case = chain_bench._case(1, 1, 64, "fp32", "draft_probs")
    cfg = harness.RunConfig(quick=True, cpu_budget_s=0.05, backends={"reference"})
    rows = harness.run_case(case, chain_bench, env, cfg)
    variants = {row["variant"]: row["status"] for row in rows}
    assert variants == {"eager": "ok", "compiled": "ok"}, rows
