"""Argument parsing and validation shared by every public op and backend.

Errors name the argument, what was expected and what was given. Checks of shapes, dtypes,
devices and Python-number values never synchronise and always run; checks of tensor values
(ids, ranges) read only small tensors and run only when ``validate=True`` (``validate=False``
skips the checks that need a device synchronisation).

Device policy (every op): each tensor argument must be on the device of the op's main
tensor (the logits, ``parents`` or the caches). One on another device is a ``ValueError``
naming it; nothing is copied across devices behind the caller's back (a copy would
synchronise, and fail under CUDA-graph capture).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Callable, Optional, Sequence, Union

import torch

from . import _ops, _types  # _ops: the draw_seeds op (this module sits above it, docs/layers.md)
from ._rng import MAX_POSITION
from ._types import SamplingParams

Scalar = Union[int, float, bool]
PerRequest = Union[Scalar, torch.Tensor, None]

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(x, name: str, *, ndim: Optional[int] = None,
                 dtypes: Optional[Sequence[torch.dtype]] = None,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    return x


def check_verify_logits(logits, name: str, rows: str) -> tuple[int, int, int]:
    """``[B, R, V]`` logits of a verify call (``rows`` names R: ``"K+1"`` or ``"N"``) with
    ``1 <= R <= 2**16`` (rows and drafts are Philox positions) and ``V >= 1``."""
    check_tensor(logits, name, ndim=3, dtypes=LOGIT_DTYPES)
    batch, num_rows, vocab = logits.shape
    if num_rows < 1 or vocab < 1:
        raise ValueError(f"{name}: expected shape [B, {rows}, V] with {rows} >= 1 and V >= 1, "
                         f"got {list(logits.shape)}")
    if num_rows > MAX_POSITION:
        raise ValueError(f"{name}: expected at most {MAX_POSITION} rows ({rows}), got {num_rows}")
    return batch, num_rows, vocab


def check_shape(x: torch.Tensor, name: str, expected: Sequence[Optional[int]], what: str = "") -> None:
    shape = x.shape
    if len(shape) == len(expected):
        for e, s in zip(expected, shape):
            if e is not None and e != s:
                break
        else:
            return  # (a loop, not all(<generator>): every call of every op runs this)
    shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
    hint = f" ({what})" if what else ""
    raise ValueError(f"{name}: expected shape {shown}{hint}, got {list(x.shape)}")


def per_request(value: PerRequest, name: str, batch: int, device: torch.device,
                dtype: torch.dtype, default: Scalar) -> torch.Tensor:
    """A per-request argument as a ``[batch]`` tensor on ``device``.

    Accepts None (the default), a Python scalar (broadcast, as ``dtype``), or a 0-D /
    ``[batch]`` tensor on ``device`` (converted to ``dtype``, except that an int64 tensor asked
    for as int32 stays int64: the caller checks its values, then narrows it). A tensor on
    another device is a ``ValueError`` (the module's device policy). No synchronisation.
    """
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        check_tensor(value, name, device=device)
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name}: expected a real-valued tensor, got dtype {value.dtype}")
        if dtype.is_floating_point is False and value.is_floating_point():
            raise TypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        elif value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name}: expected a scalar or a [{batch}] tensor (one per request), "
                             f"got shape {list(value.shape)}")
        if value.dtype != dtype and not (dtype == torch.int32 and value.dtype == torch.int64):
            value = value.to(dtype)
        return value if value.is_contiguous() else value.contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a Python number or a tensor, got {type(value).__name__}")
    if not dtype.is_floating_point and isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise TypeError(f"{name}: expected an integer, got {value!r}")
        value = int(value)
    if dtype == torch.int32 and not -2**31 <= value < 2**31:
        raise ValueError(f"{name}: expected a value that fits int32, got {value}")
    return broadcast(value, batch, dtype, device)


# Broadcast scalars, kept per (value, batch, dtype, device, stream): an engine that passes the
# same temperature every step pays neither an allocation nor a fill kernel. The tensors are
# internal (never returned to the caller, never written). Bounded, least recently used out
# first: a value a call hits must survive the misses of that same call (first in, first out
# evicted an engine's steady temperature while it was in use).
_BROADCAST_CACHE: collections.OrderedDict = collections.OrderedDict()
_BROADCAST_CACHE_SIZE = 256
_BROADCAST_LOCK = threading.Lock()  # misses only: a hit is a lookup and a move to the end


def _stream_key(device: torch.device) -> int:
    """The device's current stream (0 on CPU): a cached tensor is filled on the stream of the
    call that made it and used only by later calls on that stream, so no call reads it before
    its fill has run, and its memory goes back to the pool of the stream that used it."""
    if _types.device_type(device) != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def broadcast(value: Scalar, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full((batch,), value)``, cached outside CUDA-graph capture.

    Under capture the cache is bypassed both ways: a graph keeps raw pointers, so it must not
    use a cached tensor that a later eviction could free (an engine capturing one graph per
    batch size can outgrow the cache), and a tensor filled under capture holds its value only
    when the graph replays. The graph then carries its own small fill kernels.
    """
    # Under torch.compile the fill is part of the traced graph (a cached tensor would be a
    # graph constant, and a fake tensor must never enter the cache).
    if _tracing() or _types.capturing(device):
        return torch.full((batch,), value, dtype=dtype, device=device)
    return _kept((type(value), value, batch, dtype, device, _stream_key(device)),
                 lambda: torch.full((batch,), value, dtype=dtype, device=device))


def _kept(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The internal tensor kept under ``key`` in the bounded cache, else ``make()``, kept."""
    cached = _BROADCAST_CACHE.get(key)
    if cached is not None:
        try:
            _BROADCAST_CACHE.move_to_end(key)
        except KeyError:  # evicted by another thread since the lookup: the tensor stays valid
            pass
        return cached
    tensor = make()
    with _BROADCAST_LOCK:
        if len(_BROADCAST_CACHE) >= _BROADCAST_CACHE_SIZE:
            _BROADCAST_CACHE.popitem(last=False)
        _BROADCAST_CACHE[key] = tensor
    return tensor


def arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64), cached as ``broadcast`` caches its fills (internal, never
    written, bypassed while tracing and under capture)."""
    if _tracing() or _types.capturing(device):
        return torch.arange(n, device=device)
    return _kept(("arange", n, device, _stream_key(device)),
                 lambda: torch.arange(n, device=device))


def as_int64(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.int64)``, without a dispatch where it is int64 already."""
    return x if x.dtype == torch.int64 else x.to(torch.int64)


def _any(mask: torch.Tensor) -> bool:
    return bool(mask.any().item())


def first_true(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D bool tensor (a synchronisation: error paths only)."""
    return int(mask.nonzero()[0, 0].item())


# A value check: (bad, raise_error): a bool tensor, True where a request fails, and what
# raises its error (naming the first failing request).
Check = tuple[torch.Tensor, Callable[[], None]]


def raise_first_failure(checks: Sequence[Check]) -> None:
    """Value checks in one synchronisation: calls the ``raise_error`` of the first check whose
    ``bad`` tensor holds a True (each builds its message, naming the first bad request). One
    read of one combined flag; only on a failure is each check read again, in order."""
    if not checks:
        return
    flags = checks[0][0] if len(checks) == 1 else \
        torch.cat([bad.reshape(-1) for bad, _ in checks])
    if flags.any().item():
        for bad, raise_error in checks:
            if bad.any().item():
                raise_error()


def check_values(family: str, tensors: list, ints: list) -> None:
    """Runs the value checks ``CHECKS[family](tensors, ints)`` (``raise_first_failure``):
    eagerly, a plain call; under ``torch.compile`` the op ``specdec::check_values``, which
    runs them when the compiled step runs, so a validated call compiles with
    ``fullgraph=True`` and a bad value raises the eager error (docs/graphs.md). Outside
    Dynamo it is a plain call even under a dispatch mode, so ``forbid_host_sync`` sees its
    reads (validation reads by design)."""
    if torch.compiler.is_compiling():
        torch.ops.specdec.check_values.default(family, tensors, ints)
    else:
        _ops.CHECKS[family](tensors, ints)


def check_family(name: str):
    """Registers ``builder(tensors, ints) -> list[Check]`` as the value checks ``name``."""
    def register(builder):
        _ops.CHECKS[name] = lambda tensors, ints: raise_first_failure(builder(tensors, ints))
        return builder
    return register


def tree_checks(parents: torch.Tensor, num_nodes: Optional[torch.Tensor]) -> list[Check]:
    """The checks of a batch of trees ``parents`` ``[B, N]`` with ``num_nodes`` (None: N),
    for ``raise_first_failure``: ``num_nodes`` in ``[1, N]``, ``parents[b, 0] == -1`` and
    ``0 <= parents[b, i] < i`` for every real node ``i >= 1`` (padding parents are not read).
    No synchronisation."""
    batch, nodes = parents.shape
    index = torch.arange(1, nodes, device=parents.device)  # the non-root nodes
    parent = parents if parents.dtype == torch.int64 else parents.to(torch.int64)
    children = parent[:, 1:]
    bad_root = parent[:, 0] != -1
    bad_edge = (children < 0) | (children >= index)
    checks = []
    if num_nodes is not None:  # (None: every node is real, N is in range)
        count = num_nodes if num_nodes.dtype == torch.int64 else num_nodes.to(torch.int64)
        bad_count = (count < 1) | (count > nodes)
        bad_edge &= index < count[:, None]

        def count_error():
            b = first_true(bad_count)
            raise ValueError(f"num_nodes: expected values in [1, {nodes}] (N, the root counts), "
                             f"got {count[b].item()} for request {b}")
        checks.append((bad_count, count_error))

    def root_error():
        b = first_true(bad_root)
        raise ValueError(f"parents: expected parents[b, 0] == -1 (node 0 is the root), got "
                         f"{parent[b, 0].item()} for request {b}")

    def edge_error():
        b = first_true(bad_edge.any(1))
        i = first_true(bad_edge[b]) + 1
        value = parent[b, i].item()
        kind = "a cycle or forward edge" if value >= i else "a node without a parent"
        raise ValueError(f"parents: not a tree: expected 0 <= parents[b, i] < i for every real "
                         f"node i >= 1 (i < num_nodes[b]; parents before children), got "
                         f"parents[{b}, {i}] = {value} ({kind})")
    return checks + [(bad_root, root_error), (bad_edge, edge_error)]


# Parsed parameters of Python numbers, kept per (values, batch, V, device, stream) like the
# broadcast scalars: an engine passing the same temperature every step parses it once.
_PARAMS_CACHE: collections.OrderedDict = collections.OrderedDict()
_PARAMS_CACHE_SIZE = 128
_SCALAR_TYPES = (int, float, bool, type(None))


def sampling_params(temperature: PerRequest, top_k: PerRequest, top_p: PerRequest, *,
                    batch: int, vocab_size: int, device: torch.device,
                    validate: bool, min_p: PerRequest = None,
                    checks: Optional[list] = None) -> SamplingParams:
    """The parsed parameters. Python numbers are checked on the host whatever ``validate``
    says (no synchronisation); tensors' values only when validating: here (the family
    ``"sampling"``), or, given ``checks`` (a list), by the caller, whose family takes the four
    tensors this appends (temperature, top-k, top-p, min-p as parsed, before rounding; None
    for a Python number) with its own in one read."""
    given = (temperature, top_k, top_p, min_p)
    key = _params_key(given, batch, vocab_size, device)
    cached = _PARAMS_CACHE.get(key) if key is not None else None
    values: list = []
    params = filled(cached, given, values) if cached is not None else None
    if params is None:
        params, values = _parse_sampling(temperature, top_k, top_p, min_p, batch, vocab_size,
                                         device)
        template = params_template(params, given) if key is not None else None
        if template is not None:
            with _BROADCAST_LOCK:
                if len(_PARAMS_CACHE) >= _PARAMS_CACHE_SIZE:
                    _PARAMS_CACHE.popitem(last=False)
                _PARAMS_CACHE[key] = template
    return _checked(params, values, checks, validate)


def planned_params(template: Optional[SamplingParams], temperature, top_k, top_p, min_p, *,
                   batch: int, vocab_size: int, device: torch.device, validate: bool,
                   checks: Optional[list] = None) -> SamplingParams:
    """A planned call's parameters: its plan's ``params_template`` with the call's tensors put
    in, else (no template, or a tensor to copy) parsed now (``sampling_params``)."""
    given = (temperature, top_k, top_p, min_p)
    values: list = []
    params = filled(template, given, values) if template is not None else None
    if params is None:
        return sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab_size,
                               device=device, validate=validate, min_p=min_p, checks=checks)
    return _checked(params, values, checks, validate)


def _checked(params: SamplingParams, values: list, checks: Optional[list],
             validate: bool) -> SamplingParams:
    """``params``, with its tensors' values handed to the caller's ``checks`` or, validating,
    checked now."""
    if checks is not None:
        checks += values
    elif validate and any(v is not None for v in values):
        check_values("sampling", values, [])
    return params


def params_template(params: SamplingParams, given: tuple) -> Optional[SamplingParams]:
    """``params`` (parsed from ``given``: temperature, top-k, top-p, min-p) kept for later
    calls of the same structure: without the caller's tensors, where the parse took each of
    them as it is (the right dtype, ``[B]``, contiguous); else None (parse every call)."""
    fields = (params.temperature, params.top_k, params.top_p, params.min_p)
    tensors = [type(x) is torch.Tensor for x in given]
    if not any(tensors):
        return params
    if not all(f is x for f, x, tensor in zip(fields, given, tensors) if tensor):
        return None
    return dataclasses.replace(params, **{name: None for name, tensor in
                                          zip(_TENSOR_FIELDS, tensors) if tensor})


def filled(template: SamplingParams, given: tuple, values: list) -> Optional[SamplingParams]:
    """A kept template (``params_template``) with this call's tensors put in (appended to
    ``values``, for the call's value checks, as a parse appends them); None where one is not
    contiguous (the parse then copies it)."""
    tensors = [x if type(x) is torch.Tensor else None for x in given]
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    values += tensors
    if all(t is None for t in tensors):
        return template
    return template.with_tensors(*tensors)


_TENSOR_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def _params_key(given: tuple, batch: int, vocab_size: int, device) -> Optional[tuple]:
    """The parsing cache's key of ``(temperature, top_k, top_p, min_p)``: Python numbers by
    type and value, plain tensors by shape, dtype and device (their values are the call's);
    None (parse afresh) for anything else, while tracing and under capture."""
    key = []
    for x in given:
        kind = type(x)
        if kind is torch.Tensor:
            key += (kind, x.shape, x.dtype, x.device)
        elif kind in _SCALAR_TYPES:
            key += (kind, x)
        else:
            return None
    if _tracing() or _types.capturing(device):
        return None
    key += (batch, vocab_size, device, _stream_key(device))
    return tuple(key)


def _parse_sampling(temperature, top_k, top_p, min_p, batch, vocab_size, device):
    """``(SamplingParams, [t, k, p, m])``: the parsed parameters and the tensors whose values
    a validated call checks (None for Python numbers, checked here)."""
    _check_scalar(temperature, "temperature", lambda t: t >= 0 and t != math.inf,
                  "finite values >= 0 (0 = greedy)")
    _check_scalar(top_k, "top_k", lambda k: k >= 0, "values >= 0 (0 disables)")
    _check_scalar(top_p, "top_p", lambda p: 0 < p <= 1, "values in (0, 1] (1 disables)")
    _check_scalar(min_p, "min_p", lambda m: 0 <= m <= 1, "values in [0, 1] (0 disables)")
    # float64 tensors are checked in float64 (then rounded, below), as Python numbers are.
    t = per_request(_clamp_temperature(temperature), "temperature", batch, device,
                    _float_dtype(temperature), 1.0)
    if isinstance(top_k, torch.Tensor):
        k = per_request(top_k, "top_k", batch, device, torch.int32, 0)
    else:  # clamped on the host: values past int32 disable the filter like V does
        k = per_request(_clamp_int32(top_k), "top_k", batch, device, torch.int32, 0)
    p = per_request(top_p, "top_p", batch, device, _float_dtype(top_p), 1.0)
    m = per_request(min_p, "min_p", batch, device, _float_dtype(min_p), 0.0)
    values = [x if isinstance(v, torch.Tensor) else None
              for x, v in ((t, temperature), (k, top_k), (p, top_p), (m, min_p))]
    uses_min_p = isinstance(min_p, torch.Tensor) or (min_p not in (None, 0, 0.0))
    uses_top_k = isinstance(top_k, torch.Tensor) or (top_k not in (None, 0) and top_k < vocab_size)
    uses_top_p = isinstance(top_p, torch.Tensor) or (top_p not in (None, 1, 1.0))
    all_greedy = (not isinstance(temperature, torch.Tensor)) and temperature == 0
    if k.dtype != torch.int32:  # an int64 tensor: values past int32 disable the filter
        k = k.clamp(0, 2**31 - 1).to(torch.int32)
    if t.dtype == torch.float64:  # finite temperatures past float32's range: its largest
        t = t.clamp(max=FLOAT32_MAX).to(torch.float32)
    if p.dtype != torch.float32:
        p = p.to(torch.float32)
    if m.dtype != torch.float32:
        m = m.to(torch.float32)
    return SamplingParams(t, k, p, uses_top_k, uses_top_p, all_greedy, m, uses_min_p), values


def sampling_checks(t: Optional[torch.Tensor], k: Optional[torch.Tensor],
                    p: Optional[torch.Tensor], m: Optional[torch.Tensor]) -> list[Check]:
    """The value checks of tensor parameters (None: a Python number, checked on the host):
    ``t`` temperatures (float32/64, before rounding), ``k`` top-k, ``p`` top-p, ``m`` min-p."""
    checks = []
    if t is not None:
        bad_t = ~(t >= 0) | torch.isinf(t)

        def temperature_error():
            raise ValueError(f"temperature: expected finite values >= 0 (0 = greedy), got "
                             f"{t[bad_t][0].item()}")
        checks.append((bad_t, temperature_error))
    if k is not None:
        bad_k = k < 0

        def top_k_error():
            raise ValueError(f"top_k: expected values >= 0 (0 disables), got "
                             f"{k[bad_k][0].item()}")
        checks.append((bad_k, top_k_error))
    if p is not None:
        bad_p = ~((p > 0) & (p <= 1))

        def top_p_error():
            raise ValueError(f"top_p: expected values in (0, 1] (1 disables), got "
                             f"{p[bad_p][0].item()}")
        checks.append((bad_p, top_p_error))
    if m is not None:
        bad_m = ~((m >= 0) & (m <= 1))

        def min_p_error():
            raise ValueError(f"min_p: expected values in [0, 1] (0 disables), got "
                             f"{m[bad_m][0].item()}")
        checks.append((bad_m, min_p_error))
    return checks


check_family("sampling")(lambda tensors, ints: sampling_checks(*tensors))


LOGPROB_KINDS = (None, "processed", "raw")


def check_return_logprobs(value) -> None:
    """``return_logprobs`` (contract section 9): None, ``"processed"`` or ``"raw"``."""
    if not (value is None or (isinstance(value, str) and value in LOGPROB_KINDS)):
        raise ValueError(f"return_logprobs: expected one of {LOGPROB_KINDS}, got {value!r}")


def check_token_bitmask(bitmask, lead_shape: Sequence[int], vocab: int,
                        device: torch.device, what: str) -> Optional[torch.Tensor]:
    """``token_bitmask`` (contract section 8): None, or int32 ``[*lead_shape, ceil(V/32)]`` on
    ``device`` (xgrammar's layout). Shape checks always run (a wrong width is a shape, so also
    with ``validate=False``); the bits themselves are never read here."""
    if bitmask is None:
        return None
    check_tensor(bitmask, "token_bitmask", dtypes=(torch.int32,), device=device)
    check_shape(bitmask, "token_bitmask", list(lead_shape) + [-(-vocab // 32)],
                f"{what}, ceil(V/32) = {-(-vocab // 32)} int32 words per row for V = {vocab}")
    return bitmask


# A finite temperature >= 3.4028e38 (past float32's range) is taken as float32's largest
# finite value: z = x / T is then ~0, the near-uniform law over the kept tokens, on every
# backend (README, semantics).
FLOAT32_MAX = torch.finfo(torch.float32).max


def _float_dtype(value) -> torch.dtype:
    """float64 for a float64 tensor (checked before rounding), else float32."""
    is_float64 = isinstance(value, torch.Tensor) and value.dtype == torch.float64
    return torch.float64 if is_float64 else torch.float32


def _clamp_temperature(value):
    if isinstance(value, float) and FLOAT32_MAX < value < math.inf:
        return FLOAT32_MAX
    if isinstance(value, int) and not isinstance(value, bool) and value > FLOAT32_MAX:
        return FLOAT32_MAX
    return value


def _check_scalar(value, name: str, ok, expected: str) -> None:
    """A Python-number parameter outside its range: ValueError (type errors come later)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
        raise ValueError(f"{name}: expected {expected}, got {value}")


def _clamp_int32(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return type(value)(min(max(value, 0), 2**31 - 1))
    return value


def narrow_int32(values: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """An index tensor as int32 for the kernels: int64 values are clamped to ``[low, high]``
    first (unvalidated values past int32 then clamp as the kernels clamp, instead of
    wrapping); int32 values go as they are (the kernels clamp them)."""
    if values.dtype == torch.int32:
        return values
    if values.dtype == torch.int64:
        values = values.clamp(low, high)
    return values.to(torch.int32)


class DeferredSeeds:
    """Seeds an adapter draws from an engine's ``torch.Generator`` objects, drawn only once
    the op has checked every other argument (``seeds_and_offsets`` runs last), so that a
    rejected call leaves the generators as they were. Calling it draws once (``draw()`` ->
    ``[B]`` int64) and returns the same seeds on later calls."""

    def __init__(self, draw):
        self._draw, self._seeds = draw, None

    def __call__(self) -> torch.Tensor:
        if self._seeds is None:
            self._seeds = self._draw()
        return self._seeds


def seeds_and_offsets(seed: PerRequest, offset: PerRequest, *, batch: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` int64 seeds and offsets; ``seed=None`` draws one seed per request from torch's
    default generator, so ``torch.manual_seed`` makes runs repeatable (a ``DeferredSeeds``
    draws its own). The draw is the op ``specdec::draw_seeds``: under ``torch.compile`` it
    runs on every call of the compiled step, as in eager mode, and under CUDA-graph capture
    it is a ``ValueError`` naming ``seed`` (a graph would replay one draw)."""
    if _ready(seed, batch, device) and _ready(offset, batch, device):
        return seed, offset  # an engine's steady state: int64 [B] tensors, nothing to parse
    # The offset first: a call rejected for its offset must not have advanced the generator.
    o = per_request(_as_int64(offset, "offset"), "offset", batch, device, torch.int64, 0)
    if isinstance(seed, DeferredSeeds):
        seed = seed()
    if seed is None:
        seed = _ops.call("draw_seeds", o)
    s = per_request(_as_int64(seed, "seed"), "seed", batch, device, torch.int64, 0)
    return s, o


# A call's plan (what its structure decides, once the host checks passed), kept per
# structure: ``call_key`` of its arguments. Engines repeat one structure every step.
_PLAN_SIZE = 64
_KEY_TYPES = frozenset((int, float, bool, str, type(None)))


_tracing = _types.tracing  # (at the bottom: the C++ path's helpers ask it too)


def call_key(*args) -> Optional[tuple]:
    """A hashable key of a call's structure: each plain tensor's shape, dtype and device, each
    Python number's type and value; None (parse afresh) for anything else, while tracing
    (``_tracing``), and while a CUDA graph is being captured (a plan holds tensors filled
    outside the graph)."""
    if _tracing():
        return None
    key = []
    cuda = None
    for x in args:
        kind = type(x)
        if kind is torch.Tensor:
            device = x.device
            key += (x.shape, x.dtype, device)
            if _types.device_type(device) == "cuda":
                cuda = device
        elif kind in _KEY_TYPES:
            key += (kind, x)
        else:
            return None
    if cuda is not None:
        if _types.capturing(cuda):
            return None
        key.append(_stream_key(cuda))
    return tuple(key)


def planned(plans: dict, build, *args):
    """The plan of a call with these arguments: kept in ``plans`` by the call's structure
    (``call_key``), else ``build(*args)`` (every host check, in the contract's order), kept
    from then on where the structure has a key."""
    key = call_key(*args)
    plan = plans.get(key) if key is not None else None
    if plan is None:
        plan = build(*args)
        if key is not None:
            remember(plans, key, plan)
    return plan


def remember(plans: dict, key: tuple, plan) -> None:
    """Keeps ``plan`` under ``key`` (bounded: the oldest out first)."""
    with _BROADCAST_LOCK:
        if len(plans) >= _PLAN_SIZE:
            plans.pop(next(iter(plans)))
        plans[key] = plan


def _ready(value, batch: int, device: torch.device) -> bool:
    """Whether ``value`` is already what ``per_request`` makes of a seed or offset: a plain
    contiguous int64 ``[batch]`` tensor on ``device``."""
    return (type(value) is torch.Tensor and value.dtype == torch.int64 and value.dim() == 1
            and value.shape[0] == batch and value.device == device and value.is_contiguous())


def _as_int64(value, name: str):
    """A Python int seed or offset as int64 bits: unsigned 64-bit values wrap (an engine's
    uint64 seed keys the same Philox stream as its two's-complement int64). An integral
    float is taken as that integer (other floats are a TypeError in ``per_request``)."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not -2**63 <= value < 2**64:
            raise ValueError(f"{name}: expected a 64-bit integer, got {value}")
        return value - 2**64 if value >= 2**63 else value
    return value


def draft_slots(slots, num_slots: int, batch: int, device: torch.device,
                validate: bool, checks: Optional[list] = None) -> Optional[torch.Tensor]:
    """``draft_slots`` (docs/semantics.md section 3.1): None, or an int32/int64 ``[B]``
    tensor on ``device`` naming each request's slot (dim 0) of the ``[S, K', V']`` draft
    tensor. With ``validate`` the values are checked to lie in ``[0, S)`` (one
    synchronisation; given ``checks``, the caller's family checks them: this appends the
    slots); without, every backend clamps them to ``[0, S - 1]``. Returned as given
    (contiguous): the kernels read it in place."""
    if slots is None:
        if checks is not None:
            checks.append(None)
        return None
    check_tensor(slots, "draft_slots", ndim=1, dtypes=INDEX_DTYPES, device=device)
    if slots.shape[0] != batch:
        raise ValueError(f"draft_slots: expected shape [{batch}] (one slot per request), got "
                         f"{list(slots.shape)}")
    if checks is not None:
        checks.append(slots)
    elif validate and batch:
        check_values("draft_slots", [slots], [num_slots])
    return slots.contiguous()


@check_family("draft_slots")
def slot_checks(tensors, ints) -> list[Check]:
    """``draft_slots`` in ``[0, S)`` (``ints = [S]``); none for None."""
    slots, = tensors
    if slots is None or slots.shape[0] == 0:
        return []
    num_slots, = ints
    bad = (slots < 0) | (slots >= num_slots)

    def slots_error():
        b = first_true(bad)
        raise ValueError(f"draft_slots: expected slots in [0, {num_slots}) (dim 0 of the "
                         f"draft tensor), got {int(slots[b])} for request {b}")
    return [(bad, slots_error)]


def draft_temperature(value: PerRequest, batch: int, device: torch.device,
                      validate: bool, checks: Optional[list] = None) -> Optional[torch.Tensor]:
    """``draft_temperature`` (docs/semantics.md section 3.1): None, a Python number or a
    0-D / ``[B]`` tensor, as ``temperature`` is parsed: float32 ``[B]``, finite values >= 0
    (0: the drafter took the draft row's arg-max); Python numbers are checked on the host
    always, tensors only with ``validate`` (given ``checks``: by the caller's family, this
    appends the tensor as parsed, before rounding)."""
    if value is None:
        if checks is not None:
            checks.append(None)
        return None
    _check_scalar(value, "draft_temperature", lambda t: t >= 0 and t != math.inf,
                  "finite values >= 0 (0 = the draft row's arg-max)")
    t = per_request(_clamp_temperature(value), "draft_temperature", batch, device,
                    _float_dtype(value), 1.0)
    tensor = t if isinstance(value, torch.Tensor) and batch else None
    if checks is not None:
        checks.append(tensor)
    elif validate and tensor is not None:
        check_values("draft_temperature", [tensor], [])
    if t.dtype == torch.float64:
        t = t.clamp(max=FLOAT32_MAX).to(torch.float32)
    return t


@check_family("draft_temperature")
def draft_temperature_checks(tensors, ints) -> list[Check]:
    t, = tensors
    if t is None:
        return []
    bad = ~(t >= 0) | torch.isinf(t)

    def temperature_error():
        raise ValueError(f"draft_temperature: expected finite values >= 0 (0 = the draft "
                         f"row's arg-max), got {t[bad][0].item()}")
    return [(bad, temperature_error)]
