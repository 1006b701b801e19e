"""Setup shared by the tests: where the Triton tests run, their dtypes and skip mark, the
backends the API tests cover, the mismatch bound, and small helpers."""
import functools
import importlib
import os

import pytest
import torch

from specdec_kernels import _extension

from interpreter_speedup import install as _install_interpreter_speedup

if os.environ.get("TRITON_INTERPRET") == "1":
    _install_interpreter_speedup()  # see interpreter_speedup.py: no repeated language patch

# Under pytest-xdist (`make test` runs `-n 2`) each worker gets one torch thread: two workers
# on two cores, each with two threads, would spin against each other at every parallel op.
# Tests that need more threads set them themselves and restore this.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The Triton tests run on CUDA tensors when a GPU is present (and TRITON_INTERPRET is not
# set), else on CPU tensors in Triton's interpreter, as CI runs them.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # the logits dtypes of the kernels
needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

# The compiled extension's tests (tree attention, the KV cache): its backend where
# specdec_kernels._C is built.
needs_extension = pytest.mark.skipif(
    not _extension.HAS_EXTENSION, reason=f"specdec_kernels._C not built: {_extension.IMPORT_ERROR}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EXTENSION_BACKENDS = ["reference", pytest.param("extension", marks=needs_extension)]

# Kernels and reference may differ only at decisions within float rounding of a threshold:
# the measured share of differing tokens (sample) or requests (chain, tree) stays at most this.
MAX_MISMATCH_RATE = 0.01


def _triton_param(module: str):
    """The Triton backend on the CPU tensors of the API tests: only under TRITON_INTERPRET=1
    (set by the Makefile). On a GPU, test_triton_*.py run the kernels on CUDA tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return pytest.param("triton", marks=pytest.mark.skip(
            reason="CPU tensors need TRITON_INTERPRET=1 for the Triton backend"))
    try:
        importlib.import_module(module)
        return pytest.param("triton")
    except ImportError as err:  # surfaced as a skip reason, never silently
        return pytest.param("triton", marks=pytest.mark.skip(reason=f"{module}: {err}"))


CHAIN_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.chain")]
SAMPLE_BACKENDS = ["reference", _triton_param("specdec_kernels.triton.sampling")]


def mixed_params(batch, vocab, gen, device="cpu"):
    """Per-request parameters mixing greedy, plain, top-k, top-p and both."""
    kind = torch.arange(batch) % 5
    temperature = torch.where(kind == 0, 0.0, 0.3 + 1.4 * torch.rand(batch, generator=gen))
    top_k = torch.where((kind == 2) | (kind == 4),
                        torch.randint(1, max(2, vocab), (batch,), generator=gen), 0)
    top_p = torch.where((kind == 3) | (kind == 4), 0.05 + 0.9 * torch.rand(batch, generator=gen), 1.0)
    return dict(temperature=temperature.to(device), top_k=top_k.to(device), top_p=top_p.to(device))


def spy_launches(monkeypatch, module, name: str) -> list:
    """Wraps the Triton kernel ``module.<name>`` so that each launch records its grid and then
    runs; returns the list of grids (tests that a launcher skips or makes a launch)."""
    launched = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]
    monkeypatch.setattr(module, name, Spy())
    return launched


SECTION_8_9_ARGS = ("min_p", "token_bitmask", "return_logprobs")


@functools.lru_cache(maxsize=None)
def triton_refuses(op: str, device: str = "cpu") -> frozenset:
    """The contract section 8-9 arguments that ``op``'s Triton backend refuses today
    (``NotImplementedError``), found by one tiny call each: tests that compare Triton with
    the reference draw only the others, and take the rest up once the kernels do."""
    import specdec_kernels as sk
    vocab, rows = 4, 2
    logits = torch.zeros(1, rows, vocab, device=device)
    calls = {"sample": lambda **kw: sk.sample(logits[:, 0], **kw),
             "verify_chain": lambda **kw: sk.verify_chain(
                 logits, torch.zeros(1, rows - 1, dtype=torch.int64, device=device), **kw),
             "verify_chain_packed": lambda **kw: sk.verify_chain_packed(
                 logits[0], torch.zeros(rows - 1, dtype=torch.int64, device=device),
                 torch.tensor([0, rows - 1], device=device), max_draft_tokens=rows - 1, **kw),
             "verify_tree": lambda **kw: sk.verify_tree(
                 logits, torch.zeros(1, rows, dtype=torch.int64, device=device),
                 torch.tensor([[-1, 0]], device=device), **kw)}
    lead = {"sample": (1,), "verify_chain": (1, rows), "verify_chain_packed": (rows,),
            "verify_tree": (1, rows)}[op]
    values = {"min_p": 0.5, "return_logprobs": "processed",
              "token_bitmask": torch.full(lead + (1,), -1, dtype=torch.int32, device=device)}
    refused = set()
    for name in SECTION_8_9_ARGS:
        try:
            calls[op](backend="triton", seed=0, **{name: values[name]})
        except NotImplementedError:
            refused.add(name)
        if op == "verify_tree":  # traversal may refuse what the token walk takes: "traversal:name"
            try:
                calls[op](backend="triton", seed=0, method="traversal",
                          draft_probs=torch.full((1, rows, vocab), 1.0 / vocab, device=device),
                          **{name: values[name]})
            except NotImplementedError:
                refused.add(f"traversal:{name}")
    return frozenset(refused)


# The costliest files first (CPU seconds of one run, largest first), so that under
# `pytest -n 2 --dist loadfile --no-loadscope-reorder` (make test) no long file starts last
# while the other worker idles. Files not listed follow in collection order. Only the order
# changes: every file still runs whole, on one worker.
COSTLIEST_FIRST = (
    "test_triton_compile.py",   # one subprocess compiling every kernel for sm_80 and sm_90
    "test_triton_chain.py", "test_triton_sampling.py", "test_triton_tree.py", "test_draft_slots.py",
    "test_e2e.py", "test_vocab_parallel.py", "test_serving.py", "test_triton_dropin.py", "test_dropin.py", "test_triton_methods.py",
    "test_rng_tails.py", "test_chain_api.py", "test_testing_toolkit.py", "test_graph_safety.py",
    "test_cpu_path.py", "test_fuzz_backends.py", "test_adapter_vllm.py",
    "test_peer_failure_classes.py", "test_one_law.py", "test_chain_exactness.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
