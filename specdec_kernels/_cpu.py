"""The C++ CPU path (``csrc/core/sampling_cpu.*``) behind ``backend="auto"`` on CPU tensors.

It runs ``verify_chain`` (and ``verify_chain_packed``, in place) and ``sample`` for float32,
bfloat16 and float16 logits: one-hot, ``draft_probs`` (float32/bf16/fp16) and
``draft_logits`` drafts, greedy and sampled requests, temperature, top-k, top-p, min-p and
``token_bitmask``. Everything else takes the reference (the definition): ``return_logprobs``,
float64 logits or draft probabilities, ``verify_tree``, and ``processed_probs`` (which has no
backend argument and stays the definition). ``backend="reference"`` is always the pure-PyTorch
path. The arguments arrive parsed (``_params``) and validated as for the other backends.
"""
from __future__ import annotations

import torch

from . import _extension

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

AVAILABLE = _extension.HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key(
    "specdec::cpu_verify_chain", "CPU")


def selected(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` asks for the C++ CPU path on ``device`` (before the op's own checks)."""
    return AVAILABLE and backend == "auto" and device.type == "cpu"


def runs_chain(target_logits, draft_probs, return_logprobs) -> bool:
    """Whether the C++ chain covers this (parsed) call."""
    return (return_logprobs is None and target_logits.dtype in _FLOATS
            and (draft_probs is None or draft_probs.dtype in _FLOATS))


def runs_sample(logits, return_logprobs) -> bool:
    return return_logprobs is None and logits.dtype in _FLOATS


def verify_chain(target_logits, draft_token_ids, draft_probs, draft_logits, n, params, seeds,
                 offsets, token_bitmask, layout=None):
    """``(output_token_ids, num_accepted)``; ``layout``: packed inputs, read in place."""
    min_p = params.min_p if params.uses_min_p else None
    if layout is not None:
        return torch.ops.specdec.cpu_verify_chain_packed(
            target_logits, draft_token_ids, draft_probs, draft_logits, layout.target_rows,
            layout.draft_rows, n, params.temperature, params.top_k, params.top_p, min_p,
            token_bitmask, seeds, offsets)
    return torch.ops.specdec.cpu_verify_chain(
        target_logits, draft_token_ids, draft_probs, draft_logits, n, params.temperature,
        params.top_k, params.top_p, min_p, token_bitmask, seeds, offsets)


def sample(logits, params, seeds, offsets, token_bitmask):
    min_p = params.min_p if params.uses_min_p else None
    return torch.ops.specdec.cpu_sample(logits, params.temperature, params.top_k, params.top_p,
                                        min_p, token_bitmask, seeds, offsets)


def processed_probs(logits, params, token_bitmask=None):
    """The C++ ``processed_probs`` of ``[B, ..., V]`` logits (benchmarks and tests; the public
    function is the reference)."""
    min_p = params.min_p if params.uses_min_p else None
    rows = logits.reshape(-1, logits.shape[-1])
    mask = None if token_bitmask is None else token_bitmask.reshape(rows.shape[0], -1)
    return torch.ops.specdec.cpu_processed_probs(rows, params.temperature, params.top_k,
                                                 params.top_p, min_p, mask).view(logits.shape)
