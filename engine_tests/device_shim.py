"""Map an engine test's ``device="cuda"`` literals to the CPU on a machine without CUDA.

The engines' kernel tests build their inputs with ``torch.rand(..., device="cuda:0")`` and
the like; that literal is the only thing that stops them here. ``install()`` wraps torch's
tensor factories and ``Tensor.to``/``Tensor.cuda`` so that a CUDA device argument becomes
``"cpu"`` and ``pin_memory=True`` becomes False (nothing else changes: shapes, dtypes, values and the test's assertions are the
engine's). It does nothing when CUDA is available.
"""
from __future__ import annotations

import functools

import torch

FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "full", "empty", "rand", "randn",
             "randint", "randperm", "arange", "zeros_like", "ones_like", "full_like",
             "empty_like", "rand_like", "randn_like", "randint_like", "eye", "linspace")


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _to_cpu(kwargs: dict) -> dict:
    if _is_cuda(kwargs.get("device")):
        kwargs = dict(kwargs, device="cpu")
    if kwargs.get("pin_memory"):  # pinning needs a CUDA driver; the copy is on the CPU anyway
        kwargs = dict(kwargs, pin_memory=False)
    return kwargs


def install() -> bool:
    """Wrap the factories (once); True when the shim is active."""
    if torch.cuda.is_available() or getattr(torch, "_engine_tests_cpu_shim", False):
        return False
    for name in FACTORIES:
        original = getattr(torch, name)

        @functools.wraps(original)
        def factory(*args, _original=original, **kwargs):
            return _original(*args, **_to_cpu(kwargs))
        setattr(torch, name, factory)

    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return original_to(self, *args, **_to_cpu(kwargs))
    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch._engine_tests_cpu_shim = True
    return True
