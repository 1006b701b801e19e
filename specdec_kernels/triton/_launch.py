"""Host-side helpers of the launchers, kept cheap: they run on every call.

``triton.next_power_of_2`` and ``triton.cdiv`` are Triton ``constexpr_function``s whose Python
call costs several microseconds in Triton 3.8; these plain versions cost well under one.
"""
from __future__ import annotations

import functools
import threading

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


def block_size(vocab: int, device: torch.device, cap_gpu: int = 2048, cap_cpu: int = 8192) -> int:
    """A power of two covering V up to a cap: no huge padded blocks for small V."""
    cap = cap_cpu if interpreted(device) else cap_gpu
    return max(16, min(next_pow2(vocab), cap))


# Register bound (PTX .maxnreg) of the race and the tree walk on a GPU. Without one, ptxas
# settles at 80 registers for the race with draft logits on sm_80 and spills 24 B; bounded at
# 128 it takes 96 and spills nothing. (A bound makes ptxas use more registers, so the
# statistics kernels, which do not spill, go without.)
MAX_REGISTERS = 128


def launch_options(device: torch.device, num_warps: int) -> dict:
    """``num_warps`` and the register bound on a GPU; one warp, no options, in the interpreter."""
    if interpreted(device):
        return dict(num_warps=1)
    return dict(num_warps=num_warps, maxnreg=MAX_REGISTERS)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_SCRATCH: dict = {}  # (dtype, device) -> one element; never evicted
_SCRATCH_LOCK = threading.Lock()


def scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for kernel arguments that the chosen mode never reads (never
    filled: no kernel), one per device and dtype, kept for the life of the process (so a
    captured graph may hold it)."""
    key = (dtype, device)
    cached = _SCRATCH.get(key)
    if cached is None:
        with _SCRATCH_LOCK:
            cached = _SCRATCH.setdefault(key, torch.empty(1, dtype=dtype, device=device))
    return cached


def row_chunks(rows: int, vocab: int, device: torch.device, *, cap_gpu: int,
               programs_per_sm: int, max_chunks: int, override: int | None = None
               ) -> tuple[int, int, int]:
    """(chunk_size, num_chunks, BLOCK) of a pass over ``rows`` rows of ``vocab``: each row split
    until there are about ``programs_per_sm`` programs per SM, at most ``max_chunks`` (a
    shape-only choice, so no synchronisation); one chunk in the interpreter. ``override``
    (tests): that chunk size, with a block no larger."""
    block = block_size(vocab, device, cap_gpu=cap_gpu)
    if override is not None:
        block = min(block, max(16, next_pow2(override)))
        chunk = override
    elif interpreted(device):
        chunk = vocab
    else:
        chunk = cdiv(vocab, min(cdiv(programs_per_sm * num_sms(device), rows), max_chunks))
    chunk = cdiv(max(chunk, block), block) * block
    return chunk, cdiv(vocab, chunk), block
