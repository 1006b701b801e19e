"""Backend choice: ``"auto"`` picks the kernels for CUDA tensors and the reference on CPU."""
from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch

BACKENDS = ("auto", "reference", "triton")


def resolve(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                         f"triton is imported; got tensors on {device}")
    return backend


def on_input_device(op):
    """Runs ``op`` with its first argument's CUDA device current (as the C++ ops do with a
    device guard): Triton launches on the current device and its current stream, and the
    CUDA-graph and stream checks of ``_params`` ask the current device, so a call with
    tensors on ``cuda:1`` while ``cuda:0`` is current must switch first. CPU tensors: as is."""
    first_name = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def guarded(*args, **kwargs):
        first = args[0] if args else kwargs.get(first_name)
        on_cuda = isinstance(first, torch.Tensor) and first.device.type == "cuda"
        with torch.cuda.device(first.device) if on_cuda else contextlib.nullcontext():
            return op(*args, **kwargs)
    return guarded
