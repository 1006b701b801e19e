"""The host side of a verify call: what it costs on the device besides the kernels, and the
parameter parsing that keeps it cheap (cached broadcast scalars, no fill kernels)."""
from __future__ import annotations

import collections
import importlib
import os
import pkgutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_kernels as sk
from specdec_kernels import _ops, _params


class _CountOps(TorchDispatchMode):
    """Counts the ops dispatched, also inside the package's Python-implemented ops (a
    ``specdec::`` custom op runs its implementation under the count, so what it dispatches
    is counted too)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        implementation = _ops.IMPLEMENTATIONS.get(func.name().split("::")[-1]) \
            if func.namespace == "specdec" else None
        self.ops[str(func)] += 1
        if implementation is not None:
            with self:
                return implementation(*args, **(kwargs or {}))
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.to and result is args[0]:
            self.ops[str(func)] -= 1  # a cast to the tensor's own dtype: no kernel
            self.ops += collections.Counter()  # (drops zero counts)
        return result


class _NoLaunch:
    """Stands in for a Triton kernel: records the launch, runs nothing."""

    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
        return launch


def _triton_modules() -> list:
    """Every module of the kernel layer: each kernel is patched where it is defined (a launcher
    reads it from its own module's globals)."""
    import specdec_kernels.triton as package
    return [importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)]


def _no_launches(monkeypatch) -> collections.Counter:
    """Every @triton.jit kernel of the kernel layer replaced by a ``_NoLaunch``; returns the
    launch counts."""
    launches = collections.Counter()
    for module in _triton_modules():
        for name, value in vars(module).items():
            defined_here = getattr(getattr(value, "fn", None), "__module__", None) == module.__name__
            if name.endswith("_kernel") and defined_here:  # a @triton.jit kernel of this module
                monkeypatch.setattr(module, name, _NoLaunch(launches, name))
    return launches


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
def test_scalar_parameters_cost_only_the_output_allocations(monkeypatch):
    """With scalar temperature/top-k/top-p and tensor seeds (an engine's steady state), a
    Triton verify call dispatches no torch kernel at all: only allocations of its outputs and
    small workspaces. A fill or cast here would be one more launch per decode step."""
    launches = _no_launches(monkeypatch)
    batch, num_drafts, vocab = 8, 3, 50
    logits = torch.randn(batch, num_drafts + 1, vocab).bfloat16()
    draft_ids = torch.randint(0, vocab, (batch, num_drafts), dtype=torch.int32)
    probs = torch.softmax(torch.randn(batch, num_drafts, vocab), -1)
    kwargs = dict(draft_probs=probs, temperature=0.8, top_k=20, top_p=0.9,
                  seed=torch.arange(batch), offset=torch.zeros(batch, dtype=torch.int64),
                  backend="triton", validate=False)
    sk.verify_chain(logits, draft_ids, **kwargs)  # fills the broadcast cache
    launches.clear()
    with _CountOps() as counted:
        sk.verify_chain(logits, draft_ids, **kwargs)
    # One registered op (contract section 15), and inside it only allocations.
    assert counted.ops.pop("specdec.triton_verify_chain.default") == 1
    assert set(counted.ops) <= {"aten.empty.memory_format"}, dict(counted.ops)
    assert counted.ops["aten.empty.memory_format"] <= 6
    assert launches == {"_row_stats_kernel": 1, "_race_kernel": 1}  # the race accepts too


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("method,walk", [("token", "_tree_walk_kernel"),
                                         ("traversal", "_traversal_kernel")])
def test_tree_walks_cost_only_the_output_allocations(monkeypatch, method, walk):
    """Both tree walks (``triton/tree.py``, ``triton/traversal.py``): the statistics and the
    walk, one launch each, and no torch kernel besides allocations."""
    launches = _no_launches(monkeypatch)
    batch, nodes, vocab = 4, 5, 40
    logits = torch.randn(batch, nodes, vocab)
    ids = torch.randint(0, vocab, (batch, nodes))
    parents = torch.tensor([-1, 0, 0, 1, 1]).expand(batch, -1).contiguous()
    probs = torch.softmax(torch.randn(batch, nodes, vocab), -1)
    kwargs = dict(draft_probs=probs, temperature=0.8, seed=torch.arange(batch),
                  offset=torch.zeros(batch, dtype=torch.int64), method=method,
                  backend="triton", validate=False)
    sk.verify_tree(logits, ids, parents, **kwargs)  # fills the broadcast cache
    launches.clear()
    with _CountOps() as counted:
        sk.verify_tree(logits, ids, parents, **kwargs)
    assert counted.ops.pop("specdec.triton_verify_tree.default") == 1
    assert set(counted.ops) <= {"aten.empty.memory_format"}, dict(counted.ops)
    assert launches == {"_row_stats_kernel": 1, walk: 1}


def test_broadcast_scalars_are_cached_and_bounded():
    a = _params.per_request(0.7, "temperature", 4, torch.device("cpu"), torch.float32, 1.0)
    b = _params.per_request(0.7, "temperature", 4, torch.device("cpu"), torch.float32, 1.0)
    assert a is b and a.tolist() == pytest.approx([0.7] * 4)
    # 1 and 1.0 and True are different keys (dtype and validation differ).
    c = _params.per_request(1, "top_k", 4, torch.device("cpu"), torch.int32, 0)
    assert c.dtype == torch.int32 and c.tolist() == [1] * 4
    for value in range(2 * _params._BROADCAST_CACHE_SIZE):
        _params.broadcast(value, 3, torch.int64, torch.device("cpu"))
    assert len(_params._BROADCAST_CACHE) <= _params._BROADCAST_CACHE_SIZE


def test_a_hit_broadcast_survives_the_next_misses(monkeypatch):
    """Least recently used out first: a full cache whose oldest entry a call has just hit
    evicts another on that call's next miss. (First in, first out evicted it: the second of two
    identical verify calls then paid a fill, when earlier tests had filled the cache.)"""
    monkeypatch.setattr(_params, "_BROADCAST_CACHE", type(_params._BROADCAST_CACHE)())
    cpu = torch.device("cpu")
    for value in range(_params._BROADCAST_CACHE_SIZE):
        _params.broadcast(value, 3, torch.int64, cpu)
    used = _params.broadcast(0, 3, torch.int64, cpu)  # a hit on the oldest entry
    _params.broadcast(-1, 3, torch.int64, cpu)  # a miss: one entry out
    assert _params.broadcast(0, 3, torch.int64, cpu) is used
    assert (1, 3) not in {(key[1], key[2]) for key in _params._BROADCAST_CACHE}
    assert len(_params._BROADCAST_CACHE) == _params._BROADCAST_CACHE_SIZE


def test_unsigned_64_bit_seed_is_its_twos_complement():
    logits = torch.randn(3, 100)
    unsigned = sk.sample(logits, seed=2**64 - 5, offset=2**63 + 1)
    signed = sk.sample(logits, seed=-5, offset=-(2**63) + 1)
    assert torch.equal(unsigned, signed)
    with pytest.raises(ValueError, match="seed: expected a 64-bit integer"):
        sk.sample(logits, seed=2**64)


def test_int64_lengths_are_checked_before_narrowing():
    logits = torch.randn(2, 3, 10)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_draft_tokens"):  # 2**32 + 1 would wrap to 1
        sk.verify_chain(logits, ids, num_draft_tokens=torch.tensor([2**32 + 1, 0]))
    with pytest.raises(ValueError, match="num_draft_tokens: expected a value that fits int32"):
        sk.verify_chain(logits, ids, num_draft_tokens=2**40)
    out = sk.verify_chain(logits, ids, num_draft_tokens=torch.tensor([2, 1]), temperature=0.0)
    assert out.num_accepted.dtype == torch.int32


def test_scalar_parameters_are_checked_on_the_host():
    logits = torch.randn(2, 10)
    for kwargs, message in ((dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
                            (dict(top_p=0.0), "top_p"), (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(ValueError, match=message):
            sk.sample(logits, seed=0, **kwargs)
    with pytest.raises(TypeError, match="top_k: expected an integer"):
        sk.sample(logits, seed=0, top_k=2.5)
