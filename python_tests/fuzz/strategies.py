"""Hypothesis strategies for every public op's arguments, and the fuzz suite's settings.

Each op's arguments are tables of one line per argument (``*_ARGS``: valid values;
``BAD_*``: values outside the contract with the exception they must raise), keyed by the
argument's name, so a new argument joins the fuzz suite with one line in each table. A
strategy is a function of the call's dimensions (:class:`Dims`) returning a Hypothesis
strategy; ``None`` in a drawn call means "argument not passed".

Budget: the ``ci`` profile (the default, used by ``make test``) is derandomized (the same
examples every run, no database, no deadline) with ``examples(n)`` per test;
``SPECDEC_FUZZ_EXAMPLES=N`` runs ``N * n / 100`` examples per test (at least ``n``), fresh
random ones: the nightly mode (``SPECDEC_FUZZ_SEED`` makes a failing night repeatable).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st

_LONG = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "0"))
_SEED = os.environ.get("SPECDEC_FUZZ_SEED")
settings.register_profile(  # make test: the same examples every run
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=list(HealthCheck))
settings.register_profile(  # nightly: fresh examples (or SPECDEC_FUZZ_SEED's)
    "nightly", derandomize=False, database=None, deadline=None, print_blob=True,
    suppress_health_check=list(HealthCheck))
settings.load_profile("nightly" if _LONG else "ci")


def examples(count: int):
    """A test's budget: ``count`` examples in ``make test``; with SPECDEC_FUZZ_EXAMPLES=N,
    ``N * count / 100`` (at least ``count``), seeded by SPECDEC_FUZZ_SEED when given."""
    if _LONG:
        count = max(count, _LONG * count // 100)

    def apply(test):
        test = settings(max_examples=count)(test)
        return seed(int(_SEED))(test) if _LONG and _SEED else test
    return apply


@dataclass(frozen=True)
class Dims:
    batch: int
    rows: int   # K + 1 (chain), N (tree, attention, KV), 1 (sample)
    vocab: int


def dims(batch=(0, 4), rows=(1, 5), vocab=(1, 40)):
    return st.builds(Dims, st.integers(*batch), st.integers(*rows), st.integers(*vocab))


# ---------------------------------------------------------------------------------------------
# Per-request values: None, a Python scalar, a 0-D tensor or a [B] tensor.
# ---------------------------------------------------------------------------------------------
FLOAT_PARAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@st.composite
def per_request(draw, d: Dims, values, *, floating: bool, allow_none: bool = True):
    form = draw(st.sampled_from(["none", "scalar", "0d", "tensor"] if allow_none
                                else ["scalar", "0d", "tensor"]))
    if form == "none":
        return None
    if form == "scalar":
        return draw(values)
    dtype = draw(st.sampled_from(FLOAT_PARAM_DTYPES if floating else INDEX_DTYPES))
    if form == "0d":
        return _tensor([draw(values)], dtype)[0]
    return _tensor(draw(st.lists(values, min_size=d.batch, max_size=d.batch)), dtype)


def _tensor(values, dtype):
    if dtype.is_floating_point:
        # float16/bfloat16 cannot hold every drawn value: float64 keeps it exact.
        return torch.tensor(values, dtype=torch.float64).to(dtype) if dtype in (
            torch.float16, torch.bfloat16) else torch.tensor(values, dtype=dtype)
    if any(not -2**31 <= v < 2**31 for v in values):
        dtype = torch.int64
    # Seeds past int63 are uint64 keys: a tensor holds their two's-complement int64 bits.
    return torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=dtype)


def floats(low, high):
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


# ---------------------------------------------------------------------------------------------
# Sampling parameters (processed_probs, sample, verify_chain, verify_tree): one line each.
# ---------------------------------------------------------------------------------------------
def _valid_temperature(d):
    return per_request(d, st.sampled_from([0.0, 1.0]) | floats(0.05, 4.0), floating=True)


SAMPLING_ARGS = {
    "temperature": _valid_temperature,
    "top_k": lambda d: per_request(d, st.integers(0, d.vocab + 2), floating=False),
    "top_p": lambda d: per_request(d, st.sampled_from([1.0]) | floats(0.05, 1.0), floating=True),
    "min_p": lambda d: per_request(d, st.sampled_from([0.0, 1.0]) | floats(0.0, 1.0),
                                   floating=True),
}
BAD_SAMPLING = {  # name -> (bad values, exception); any form (scalar or tensor)
    "temperature": (st.sampled_from([-1.0, -1e-50, math.inf, math.nan]), ValueError),
    "top_k": (st.sampled_from([-1, -2**40]), ValueError),
    "top_p": (st.sampled_from([0.0, -0.5, 1.5, 1 + 1e-12, math.nan]), ValueError),
    "min_p": (st.sampled_from([-0.5, -1e-12, 1 + 1e-12, 2.0, math.inf, math.nan]), ValueError),
}
# Garbage for validate=False (tensors only: Python numbers are checked whatever validate says).
GARBAGE_SAMPLING = {
    "temperature": lambda d: st.lists(st.sampled_from([-1.0, math.nan, math.inf, 1e39, 0.0, 1.0]),
                                      min_size=d.batch, max_size=d.batch).map(_float64),
    "top_k": lambda d: st.lists(st.integers(-2**40, 2**40), min_size=d.batch,
                                max_size=d.batch).map(lambda v: torch.tensor(v, dtype=torch.int64)),
    "top_p": lambda d: st.lists(st.sampled_from([-1.0, 0.0, math.nan, 2.0, 0.5]),
                                min_size=d.batch, max_size=d.batch).map(_float64),
    "min_p": lambda d: st.lists(st.sampled_from([-1.0, math.nan, math.inf, 2.0, 0.5, 0.0, 1.0]),
                                min_size=d.batch, max_size=d.batch).map(_float64),
}
# Per-op flags (sample and the verify ops): valid values, and bad ones with their exception.
FLAG_ARGS = {
    "return_logprobs": lambda d: st.sampled_from([None, "processed", "raw"]),
}
BAD_FLAGS = {
    "return_logprobs": (st.sampled_from(["logits", "Raw", True, 1]), ValueError),
}
# Verification methods per op (contract section 12); the builder passes "traversal" only with
# draft_probs, which it requires.
METHODS = {"verify_chain": ("token", "block"), "verify_chain_packed": ("token", "block"),
           "verify_tree": ("token", "traversal")}
BAD_METHOD = (st.sampled_from(["Token", "blocks", "", 0]), ValueError)


@st.composite
def token_bitmask(draw, lead_shape, vocab: int):
    """xgrammar's int32 bitmask ``[*lead_shape, ceil(V/32)]``: all allowed, random bits (rows
    with no allowed token included) or a single allowed token per row."""
    shape = tuple(lead_shape) + (-(-vocab // 32),)
    kind = draw(st.sampled_from(["all", "random", "one"]))
    if kind == "all":
        return torch.full(shape, -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "random":
        return torch.randint(-2**31, 2**31, shape, dtype=torch.int64, generator=gen).to(torch.int32)
    token = torch.randint(0, vocab, tuple(lead_shape), generator=gen)
    mask = torch.zeros(shape, dtype=torch.int64)
    mask.scatter_(-1, (token // 32)[..., None], (1 << (token % 32))[..., None])
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def _float64(values):
    return torch.tensor(values, dtype=torch.float64)

RNG_ARGS = {
    "seed": lambda d: per_request(d, st.integers(-2**63, 2**64 - 1), floating=False,
                                  allow_none=False).map(_int64_tensor),
    "offset": lambda d: per_request(d, st.integers(0, 2**40), floating=False),
}
BAD_RNG = {
    "seed": (st.sampled_from([2**64, -2**63 - 1, 0.5]), (ValueError, TypeError)),
    "offset": (st.sampled_from([2**64, 1.5]), (ValueError, TypeError)),
}


def _int64_tensor(value):
    """Seeds past int64 are Python ints only (tensors cannot hold them)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.int32:
        return value.to(torch.int64)
    return value


# ---------------------------------------------------------------------------------------------
# Tensors: logits with garbage, views with guard regions.
# ---------------------------------------------------------------------------------------------
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SPECIAL = (math.nan, math.inf, -math.inf)


@st.composite
def logits(draw, shape, *, garbage: bool = False, dtypes=LOGIT_DTYPES, seed=None):
    """Random logits; with ``garbage`` some NaN / +-inf entries and whole dead rows."""
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)) if seed is None else seed)
    scale = draw(st.sampled_from([1.0, 4.0, 30.0]))
    x = torch.randn(shape, generator=gen) * scale
    if garbage and x.numel():
        kind = torch.randint(0, 12, shape, generator=gen)
        for value, code in zip(SPECIAL, (0, 1, 2)):
            x[kind == code] = value
        if draw(st.booleans()) and x.dim() >= 2:
            x.view(-1, shape[-1])[0] = -math.inf  # a row with no finite logit
    return x.to(dtype)


@dataclass
class Guarded:
    """A view into a larger buffer; ``outside_unchanged()`` checks the guard region."""
    view: torch.Tensor
    buffer: torch.Tensor
    inside: torch.Tensor  # bool, the buffer's elements the view covers
    snapshot: torch.Tensor

    def outside_unchanged(self) -> bool:
        return torch.equal(bits(self.buffer)[~self.inside], bits(self.snapshot)[~self.inside])

    def unchanged(self) -> bool:
        return torch.equal(bits(self.buffer), bits(self.snapshot))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN == NaN), as integers of the same width."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def padding(ndim: int, pad_dims=None):
    """(before, after) padding per dimension, in ``pad_dims`` only (default: every one)."""
    pad_dims = range(ndim) if pad_dims is None else pad_dims
    pair = st.tuples(st.integers(0, 2), st.integers(0, 2))
    return st.tuples(*[pair if i in pad_dims else st.just((0, 0)) for i in range(ndim)])


@st.composite
def guarded(draw, value: torch.Tensor, *, pads=None, fill=1234.5):
    """``value`` copied into a view of a larger buffer whose other elements hold ``fill``: the
    view is padded by ``pads`` (default: drawn, in every dimension), so it is strided."""
    pads = draw(padding(value.dim())) if pads is None else pads
    shape = [s + a + b for s, (a, b) in zip(value.shape, pads)]
    if value.dtype.is_floating_point:
        buffer = torch.full(shape, fill, dtype=torch.float32).to(value.dtype)
    else:
        buffer = torch.full(shape, 7, dtype=value.dtype)
    index = tuple(slice(a, a + s) for s, (a, _) in zip(value.shape, pads))
    view = buffer[index]
    view.copy_(value)
    inside = torch.zeros(shape, dtype=torch.bool)
    inside[index] = True
    return Guarded(view, buffer, inside, buffer.clone())


# ---------------------------------------------------------------------------------------------
# Trees, paths and caches.
# ---------------------------------------------------------------------------------------------
@st.composite
def parents(draw, batch: int, nodes: int, *, garbage: bool = False):
    rows = []
    for _ in range(batch):
        if garbage:
            rows.append(draw(st.lists(st.integers(-3, nodes + 2) | st.sampled_from(
                [-2**31, 2**31 - 1]), min_size=nodes, max_size=nodes)))
        else:
            rows.append([-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)])
    dtype = draw(st.sampled_from(INDEX_DTYPES))
    return torch.tensor(rows, dtype=dtype).view(batch, nodes)


def num_nodes_values(d: Dims):
    return per_request(d, st.integers(1, d.rows), floating=False)


TREE_ATTENTION_ARGS = {
    "num_nodes": num_nodes_values,
    "prefix_lens": lambda d: per_request(d, st.integers(0, 2**40), floating=False),
}
BAD_TREE_ATTENTION = {
    "num_nodes": (st.sampled_from([0, -1, 10**6, 2**70]), ValueError),
    "prefix_lens": (st.sampled_from([-1, 2**63, -2**63 - 1]), ValueError),
}


@st.composite
def accepted_paths(draw, batch: int, nodes: int):
    """Root-first strictly increasing paths, ``-1`` padded, and their num_accepted."""
    path_rows, counts = [], []
    for _ in range(batch):
        rest = draw(st.lists(st.integers(1, nodes - 1), unique=True, max_size=nodes - 1)
                    ) if nodes > 1 else []
        path = [0] + sorted(rest)
        path_rows.append(path + [-1] * (nodes - len(path)))
        counts.append(len(path) - 1)
    dtype = draw(st.sampled_from(INDEX_DTYPES))
    return (torch.tensor(path_rows, dtype=dtype).view(batch, nodes),
            torch.tensor(counts, dtype=draw(st.sampled_from(INDEX_DTYPES))))


GARBAGE_INT = st.integers(-5, 12) | st.sampled_from([-2**63, 2**63 - 1, -2**31, 2**31 - 1,
                                                     2**62])


@st.composite
def garbage_index(draw, shape, *, dtype=None):
    values = draw(st.lists(GARBAGE_INT, min_size=math.prod(shape), max_size=math.prod(shape)))
    dtype = dtype or draw(st.sampled_from(INDEX_DTYPES))
    info = torch.iinfo(dtype)
    values = [min(max(v, info.min), info.max) for v in values]
    return torch.tensor(values, dtype=dtype).view(shape)


CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def random_cache(shape, dtype, seed: int) -> torch.Tensor:
    """Any bit pattern: compaction moves bytes, tests compare bytes."""
    gen = torch.Generator().manual_seed(seed)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)
