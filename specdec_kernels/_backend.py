"""Backend choice: ``"auto"`` picks the kernels for CUDA tensors and the reference on CPU."""
from __future__ import annotations

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
