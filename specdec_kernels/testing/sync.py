"""``forbid_host_sync()``: a guard that fails on any host read of tensor data (contract
section 15), for tests of an engine's decode step on any device, CPU included.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` catches the synchronisations that
happen; on CPU nothing synchronises, so a read that would stall a GPU goes unnoticed. This
guard catches the reads themselves, whatever the device: every aten op that hands a tensor's
value to the host (``item()``, ``int()``/``float()``/``bool()`` of a tensor,
``aten._local_scalar_dense``, ``aten.is_nonzero``, ``aten.equal``, ``aten.allclose``), every op
whose output shape depends on the data (``nonzero``, ``masked_select``, indexing with a bool
mask, ``unique``, ``repeat_interleave`` without ``output_size``, ...), every copy from an
accelerator to the CPU, and ``Tensor.tolist()`` / ``Tensor.numpy()`` (which read CPU memory
without dispatching an op).

A registered ``torch.library`` op (``specdec::*``, or any other library's) is checked at its
call, not inside: its kernel is the op's own business (CUDA kernels never read to the host;
``set_sync_debug_mode`` proves it on a GPU). So around ``specdec_kernels`` calls the guard
proves what the public layer does between the call and the kernel: argument parsing,
defaults, layouts and seeds.

>>> import torch, specdec_kernels as sk
>>> from specdec_kernels.testing import HostSyncError, forbid_host_sync
>>> logits, ids = torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.int64)
>>> seeds, offsets = torch.tensor([1, 2]), torch.tensor([0, 0])
>>> with forbid_host_sync():
...     out = sk.verify_chain(logits, ids, seed=seeds, offset=offsets, validate=False)
>>> try:
...     with forbid_host_sync():
...         out = sk.verify_chain(logits, ids, seed=seeds, offset=offsets)
... except HostSyncError:
...     print("validate=True reads the ids and lengths")
validate=True reads the ids and lengths
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "forbid_host_sync"]


class HostSyncError(RuntimeError):
    """A host read of tensor data (a device synchronisation on a GPU) inside the guard."""


_aten = torch.ops.aten

# Ops whose result is a tensor's value on the host, or whose output shape depends on the data.
_FORBIDDEN_PACKETS = (
    "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
    "nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "bincount", "histc", "histogram",
    "_assert_tensor_metadata_unused",
)
_FORBIDDEN = frozenset(getattr(_aten, name) for name in _FORBIDDEN_PACKETS
                       if hasattr(_aten, name))


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` reads tensor data on the host (None: it does not)."""
    packet = func.overloadpacket
    if packet in _FORBIDDEN:
        return "host read of tensor data (or an output shape that depends on it)"
    if packet is _aten.repeat_interleave and func is _aten.repeat_interleave.Tensor \
            and kwargs.get("output_size") is None and (len(args) < 2 or args[-1] is None):
        return "repeat_interleave without output_size: its output shape depends on the data"
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_) \
            and len(args) > 1 and _has_bool_index(args[1]):
        return "indexing with a bool mask: its output shape depends on the data"
    if packet is _aten._to_copy:
        source, device = args[0], kwargs.get("device")
        if isinstance(source, torch.Tensor) and source.device.type not in ("cpu", "meta") \
                and device is not None and torch.device(device).type == "cpu":
            return "a copy from the device to the host"
    if packet is _aten.copy_ and len(args) > 1:
        destination, source = args[0], args[1]
        if isinstance(source, torch.Tensor) and source.device.type not in ("cpu", "meta") \
                and destination.device.type == "cpu":
            return "a copy from the device to the host"
    return None


class _HostSyncGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _reason(func, args, kwargs)
        if why is not None:
            raise HostSyncError(f"{func}: {why}, inside forbid_host_sync()")
        return func(*args, **kwargs)


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_ORIGINALS: dict = {}


def _reader(name: str):
    def read(self, *args, **kwargs):
        raise HostSyncError(f"Tensor.{name}(): host read of tensor data, inside "
                            f"forbid_host_sync()")
    return read


@contextlib.contextmanager
def _patch_readers() -> Iterator[None]:
    """``Tensor.tolist`` and ``Tensor.numpy`` raise while any guard is open (they read a CPU
    tensor's memory without an op the dispatch mode could see)."""
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            for name in ("tolist", "numpy"):
                _ORIGINALS[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _reader(name))
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for name, original in _ORIGINALS.items():
                    setattr(torch.Tensor, name, original)
                _ORIGINALS.clear()


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise ``HostSyncError`` at the first host read of tensor data inside the block (see
    the module's docstring for what counts). Eager code only: under ``torch.compile``
    tracing, run the guard around the compiled function's call instead."""
    with _patch_readers(), _HostSyncGuard():
        yield
