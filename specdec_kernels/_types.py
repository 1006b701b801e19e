"""Plain values shared by every layer (the bottom of the package, beside ``_rng``): the parsed
sampling parameters every backend takes, the public ops' result types (re-exported by
``sampling``, ``chain`` and ``tree``), and whether a device is capturing a CUDA graph.

Nothing here imports another module of the package (docs/layers.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

# The fields of ``SamplingParams`` in the order the registered ops take them (``_ops``).
PARAMS = ("temperature", "top_k", "top_p", "min_p", "uses_top_k", "uses_top_p", "all_greedy",
          "uses_min_p")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, each ``[B]`` on the logits' device.

    ``uses_top_k`` / ``uses_top_p`` are host-side hints: False only when the caller passed a
    scalar that disables the filter (or nothing), so kernels can skip that code entirely
    without reading the device tensors.
    """
    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor        # int32, 0 or >= V disables
    top_p: torch.Tensor        # float32, 1 disables
    uses_top_k: bool
    uses_top_p: bool
    all_greedy: bool           # host-known: every request is greedy
    min_p: Optional[torch.Tensor] = None  # float32 [B], 0 disables (contract section 8)
    uses_min_p: bool = False   # host-side hint like uses_top_k: False when min_p is off

    def with_tensors(self, temperature, top_k, top_p, min_p) -> "SamplingParams":
        """These parameters with each given (not None) tensor put in its field: a kept parse
        of one structure, for a call that passes its own tensors of that structure."""
        return SamplingParams(
            self.temperature if temperature is None else temperature,
            self.top_k if top_k is None else top_k, self.top_p if top_p is None else top_p,
            self.uses_top_k, self.uses_top_p, self.all_greedy,
            self.min_p if min_p is None else min_p, self.uses_min_p)


class SampleOutput(NamedTuple):
    """What :func:`sample` returns when ``return_logprobs`` is set."""
    token_ids: torch.Tensor  # [B] int32, -1 for a row with nothing to sample
    logprobs: torch.Tensor   # [B] float32, NaN where the token is -1


class ChainVerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, K+1] int32: accepted drafts, correction/bonus, then -1
    num_accepted: torch.Tensor      # [B] int32
    logprobs: Optional[torch.Tensor] = None  # [B, K+1] float32 with return_logprobs, NaN at -1


class TreeVerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, N] int32: accepted path's tokens, correction/bonus, then -1
    accepted_nodes: torch.Tensor    # [B, N] int32: root 0, the accepted nodes, then -1
    num_accepted: torch.Tensor      # [B] int32: accepted draft nodes (root excluded)
    logprobs: Optional[torch.Tensor] = None  # [B, N] float32 with return_logprobs, NaN at -1


_DEVICE_TYPES: dict = {}


def device_type(device: torch.device) -> str:
    """``device.type``, remembered per device (reading it costs more than a dict lookup, and
    every call asks it of the same few devices)."""
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        kind = _DEVICE_TYPES[device] = device.type
    return kind


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (False on CPU). A module
    function, so that CPU tests can simulate capture by replacing it."""
    if device_type(device) != "cuda":
        return False
    with torch.cuda.device(device):  # the capture state of the tensors' device, not the current
        return torch.cuda.is_current_stream_capturing()


_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, name)
                       for name in ("FAKE", "PROXY", "FUNCTIONAL"))


def tracing() -> bool:
    """Compiling, under a tracing dispatch mode (FakeTensorMode, make_fx's proxy mode, also
    pre-dispatch, functionalization) or a functorch transform: those must see the parsing
    and the torch code, and a tensor made there (a fake one) must never enter a cache that
    later eager calls read. Other modes (a profiler's or a test's op counter,
    ``with torch.device(...)``) run real tensors as eager calls do."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    # (Pre-dispatch tracing also enables a function mode: that flag is the cheap test.)
    if _PRE_DISPATCH_PROXY is not None and torch._C._is_torch_function_mode_enabled() and \
            _PRE_DISPATCH_PROXY() is not None:
        return True
    # (The stack's length counts the infra modes too: plain eager pays one call.)
    return bool(torch._C._len_torch_dispatch_stack()) and any(
        torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def _pre_dispatch_proxy():
    """make_fx(pre_dispatch=True)'s proxy mode, on its own stack (not the one above)."""
    return torch._ops._get_dispatch_mode_pre_dispatch(torch._C._TorchDispatchModeKey.PROXY)


_PRE_DISPATCH_PROXY = _pre_dispatch_proxy if hasattr(
    torch._ops, "_get_dispatch_mode_pre_dispatch") else None
