"""Host-side helpers of the launchers, kept cheap: they run on every call.

``triton.next_power_of_2`` and ``triton.cdiv`` are Triton ``constexpr_function``s whose Python
call costs several microseconds in Triton 3.8; these plain versions cost well under one.
"""
from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def interpreted(device: torch.device) -> bool:
    """Kernels on CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1)."""
    return device.type != "cuda"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (queried once per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
