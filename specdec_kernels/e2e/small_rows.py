"""CPU matmuls of few rows: which of ``F.linear`` (``x W^T``) and ``W @ x^T`` is faster for
a handful of rows depends on the machine (MKL's choice of kernel), so it is measured on the
model's own weights and every ``nn.Linear`` of the model takes the faster path per row count.
"""
from __future__ import annotations

import time
import types
from typing import Optional

import torch

SMALL_ROWS = 16  # row counts whose matmul path is measured; more rows take F.linear
# A row count's path: F.linear (x W^T), W @ x^T, or W @ [x, x]^T for one row (duplicated).
LINEAR, COLUMNS, TWO_COLUMNS = "linear", "columns", "two_columns"
_CALIBRATION_BYTES = 64 << 20  # weights per timed pass: more than most L2s and many L3s
_CALIBRATION_CALLS = 256  # matmuls per timed pass at most (a small model's weights cycle)
_MIN_GAIN = 1.1  # a path other than F.linear must beat it by this factor (stable choices)
_ROW_PATHS: dict = {}  # (dtype, threads, weight shapes) -> ({rows: path}, {rows: {path: seconds}})


def _linear_rows(weight: torch.Tensor, flat: torch.Tensor, path: str) -> torch.Tensor:
    """``flat @ weight^T`` by ``path`` (no bias)."""
    if path == LINEAR:
        return torch.nn.functional.linear(flat, weight)
    rows = flat.shape[0]
    columns = torch.cat([flat, flat]) if path == TWO_COLUMNS else flat
    return torch.mm(weight, columns.t())[:, :rows].t().contiguous()


def small_row_paths(model, *, repeats: int = 3) -> tuple[dict, dict]:
    """({rows: path}, {rows: {path: seconds}}) for 1..SMALL_ROWS rows on this CPU, dtype and
    thread count, measured once per process on the model's own decoder weights.

    Which of F.linear and ``W @ x^T`` is faster for few rows depends on the machine: MKL on
    an AMD EPYC took ``x W^T`` with 2..5 rows one row at a time and a one-column ``W @ x``
    slowly, while on an Intel Xeon one column was its fastest and 5..15 rows of F.linear
    took twice 16 rows' time (a whole forward: 1 row 118 -> 58 ms, 13 rows 180 -> 145 ms).
    Each timed pass runs every path over the first 64 MiB of the model's linear weights
    (weights streaming from memory, as in a forward), interleaved, best of ``repeats``; a
    path replaces F.linear only where it is ``_MIN_GAIN`` faster."""
    weights = [m.weight for m in model.modules()
               if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    if not weights:
        return {}, {}
    key = (weights[0].dtype, torch.get_num_threads(), frozenset(w.shape for w in weights))
    if key in _ROW_PATHS:
        return _ROW_PATHS[key]
    chosen, total = [], 0  # in forward order (the first layers'), cycled for a small model
    while total < _CALIBRATION_BYTES and len(chosen) < _CALIBRATION_CALLS:
        weight = weights[len(chosen) % len(weights)]
        chosen.append(weight)
        total += weight.numel() * weight.element_size()
    paths, seconds = {}, {}
    with torch.no_grad():
        for rows in range(1, SMALL_ROWS + 1):
            inputs = {n: torch.randn(rows, n, dtype=key[0]) for n in {w.shape[1] for w in chosen}}
            candidates = (LINEAR, COLUMNS) + ((TWO_COLUMNS,) if rows == 1 else ())
            best = dict.fromkeys(candidates, float("inf"))
            for _ in range(repeats + 1):  # the first round warms up
                for path in candidates:
                    start = time.perf_counter()
                    for weight in chosen:
                        _linear_rows(weight, inputs[weight.shape[1]], path)
                    best[path] = min(best[path], time.perf_counter() - start)
            fastest = min(candidates, key=best.get)
            paths[rows] = fastest if best[fastest] * _MIN_GAIN < best[LINEAR] else LINEAR
            seconds[rows] = best
    _ROW_PATHS[key] = (paths, seconds)
    return paths, seconds


def _small_row_linear(self, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` for CPU tensors of few rows by the path :func:`small_row_paths` measured
    fastest for that row count."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    path = self._row_paths.get(rows, LINEAR)
    if path == LINEAR or x.device.type != "cpu" or (
            torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    # Row-major x (x^T a transposed operand) is the fast case; so is a row-major result.
    out = _linear_rows(self.weight, x.reshape(rows, x.shape[-1]).contiguous(), path)
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def use_small_row_linear(model, enable: bool = True, paths: Optional[dict] = None) -> dict:
    """Route every plain ``nn.Linear`` of ``model`` through :func:`_small_row_linear` (in
    place) with ``paths`` ({rows: path}; default: :func:`small_row_paths`, measured);
    ``enable=False`` gives them back the stock ``forward``. Returns the paths."""
    if enable and paths is None:
        paths = small_row_paths(model)[0]
    for module in model.modules():
        if type(module) is torch.nn.Linear:  # not subclasses (quantised, LoRA): own forward
            if enable:
                module._row_paths = dict(paths)
                module.forward = types.MethodType(_small_row_linear, module)
            else:
                module.__dict__.pop("forward", None)
                module.__dict__.pop("_row_paths", None)
    return paths if enable else {}


def row_paths_in_use(model) -> dict:
    """The path of each row count the model's linears take where it is not the stock
    ``F.linear`` (``{}``: stock everywhere), as :func:`use_small_row_linear` installed them."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            return {rows: path for rows, path in
                    sorted(getattr(module, "_row_paths", {}).items()) if path != LINEAR}
    return {}
