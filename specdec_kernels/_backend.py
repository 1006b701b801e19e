"""Backend choice for every public op, in one place.

Each op has the reference path (pure PyTorch: the definition, also the CPU path) and one
accelerated backend: the Triton kernels for ``sample``/``verify_chain``/``verify_tree``
(``"triton"``), the compiled extension ``specdec_kernels._C`` for tree attention and the KV
cache (``"extension"``). ``"auto"`` picks the accelerated one where it runs (Triton: CUDA
tensors; the extension: where it has a kernel for the device) and the reference elsewhere.
On CPU tensors, ``_cpu`` then swaps in the C++ CPU path for the ``"auto"`` calls it covers.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from . import _extension, _types

BACKENDS = ("auto", "reference", "triton")               # sample, verify_chain, verify_tree
EXTENSION_BACKENDS = ("auto", "reference", "extension")  # build_tree_attention, compact_*


def _check(backend, choices: tuple[str, ...]) -> None:
    if backend not in choices:
        raise ValueError(f"backend: expected one of {choices}, got {backend!r}")


def resolve(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"reference"``: the backend of a Triton-family op on ``device``."""
    _check(backend, BACKENDS)
    if backend == "auto":
        return "triton" if _types.device_type(device) == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                         f"triton is imported; got tensors on {device}")
    return backend


def use_extension(op: str, backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the extension op ``op`` on ``device`` (else the reference).

    ``"auto"``: the extension when it has a kernel for the device, else the reference.
    """
    _check(backend, EXTENSION_BACKENDS)
    if backend == "reference":
        return False
    available = _extension.KERNELS.get((op, device.type), False)
    if backend == "extension" and not available:
        why = (f"specdec_kernels._C is not built ({_extension.IMPORT_ERROR})"
               if not _extension.HAS_EXTENSION else
               f"specdec_kernels._C has no {device.type} kernel for {op}")
        raise ValueError(f"backend: 'extension' needs the compiled op for tensors on {device}; "
                         f"{why}")
    return available


def on_input_device(op):
    """Runs ``op`` with its first argument's CUDA device current (as the C++ ops do with a
    device guard): Triton launches on the current device and its current stream, and the
    CUDA-graph and stream checks of ``_params`` ask the current device, so a call with
    tensors on ``cuda:1`` while ``cuda:0`` is current must switch first. CPU tensors: as is."""
    first_name = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def guarded(*args, **kwargs):
        first = args[0] if args else kwargs.get(first_name)
        if not (isinstance(first, torch.Tensor) and first.is_cuda):
            return op(*args, **kwargs)  # (no context manager: a B = 1 call counts each µs)
        with torch.cuda.device(first.device):
            return op(*args, **kwargs)
    return guarded
