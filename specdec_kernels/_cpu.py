"""The C++ CPU path (``csrc/core/sampling_cpu.*``) behind ``backend="auto"`` on CPU tensors.

It runs ``verify_chain`` (and ``verify_chain_packed``, in place; methods ``"token"`` and
``"block"``), ``verify_tree`` (``"token"`` and ``"traversal"``) and ``sample`` for float32,
bfloat16 and float16 logits: one-hot, ``draft_probs`` (float32/bf16/fp16) and
``draft_logits`` drafts, deterministic, i.i.d. and without-replacement trees, greedy and
sampled requests, temperature, top-k, top-p, min-p, ``token_bitmask`` and
``return_logprobs``. Everything else takes the reference (the definition): float64 logits or
draft probabilities, and ``processed_probs`` (which has no backend argument and stays the
definition). ``backend="reference"`` is always the pure-PyTorch path. The arguments arrive
parsed (``_params``) and validated as for the other backends.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import _extension, _types

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_LOGPROBS = {None: 0, "processed": 1, "raw": 2}
CHAIN_METHODS = {"token": 0, "block": 1}
TREE_METHODS = {"token": 0, "traversal": 1}



def _registered() -> bool:
    """Whether the extension has this module's ops (an older build lacks cpu_verify_tree)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("specdec::cpu_verify_tree", "CPU")
    except RuntimeError:  # no such operator
        return False


AVAILABLE = _extension.HAS_EXTENSION and _registered()
# This version's packed op (it reads cu_num_draft_tokens) and value checks; an older build
# without them leaves packed calls to the reference.
PACKED = AVAILABLE and hasattr(torch.ops.specdec, "cpu_packed_layout_ok")
# The engine adapters' ops (csrc/torch/ops_adapters_cpu.cpp), all of them: an older build
# lacks some, and then the adapters keep their torch code.
_ADAPTER_OPS = ("cpu_flashinfer_counts", "cpu_sglang_parents", "cpu_sglang_outputs_ok",
                "cpu_sglang_write_path", "cpu_sglang_greedy", "cpu_mrv2_layout",
                "cpu_mrv2_indices_ok", "cpu_mrv2_outputs")
ADAPTERS = PACKED and all(hasattr(torch.ops.specdec, name) for name in _ADAPTER_OPS)

# The instruction-set builds of the C++ path (csrc/core/sampling_cpu*.cpp), as PyTorch's own
# CPU kernels dispatch DEFAULT / AVX2 / AVX512: every build gives the same tokens.
ISAS = ("baseline", "avx2", "avx512")
ISA_ENV = "SPECDEC_CPU_ISA"


def _has_isa_op() -> bool:
    return AVAILABLE and hasattr(torch.ops.specdec, "cpu_isa")  # (an older build lacks it)


def isa() -> str:
    """The build the C++ path runs now: ``"baseline"``, ``"avx2"`` or ``"avx512"`` (the best
    the processor has, unless ``SPECDEC_CPU_ISA`` or :func:`set_isa` chose another);
    ``"none"`` without the extension."""
    if not _has_isa_op():
        return "none"
    return torch.ops.specdec.cpu_isa("")


def isa_supported(name: str) -> bool:
    """Whether this processor runs the build ``name``."""
    return name in ISAS and _has_isa_op() and torch.ops.specdec.cpu_isa_supported(name)


def set_isa(name: str) -> str:
    """Switches the C++ path to the build ``name`` (tests and benchmarks compare them);
    returns the previous one. ``ValueError`` for an unknown name or one this processor cannot
    run."""
    if name not in ISAS:
        raise ValueError(f"isa: expected one of {ISAS}, got {name!r}")
    before = isa()
    if not isa_supported(name):
        raise ValueError(f"isa: this processor cannot run the {name!r} build (it runs "
                         f"{[i for i in ISAS if isa_supported(i)]})")
    torch.ops.specdec.cpu_isa(name)
    return before


def _check_isa_env() -> None:
    """``SPECDEC_CPU_ISA`` names a build this processor runs, or is unset (the C++ core
    honours a valid value by itself; a bad one is an error here, not a silent fallback)."""
    requested = os.environ.get(ISA_ENV)
    if requested and _has_isa_op() and isa() != requested:
        set_isa(requested)  # raises the ValueError naming the builds this processor runs


_check_isa_env()


def selected(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` asks for the C++ CPU path on ``device`` (before the op's own checks)."""
    return AVAILABLE and backend == "auto" and _types.device_type(device) == "cpu"


def runs_chain(target_logits, draft_probs, method) -> bool:
    """Whether the C++ chain covers this (parsed) call."""
    return (method in CHAIN_METHODS and target_logits.dtype in _FLOATS
            and (draft_probs is None or draft_probs.dtype in _FLOATS))


def runs_tree(target_logits, draft_probs, method) -> bool:
    return runs_chain(target_logits, draft_probs, "token") and method in TREE_METHODS


def runs_sample(logits) -> bool:
    return logits.dtype in _FLOATS


def _logprobs(values, return_logprobs):
    return None if return_logprobs is None else values


def verify_chain(target_logits, draft_token_ids, draft_probs, draft_logits, n, params, seeds,
                 offsets, token_bitmask, packed=None, method="token", return_logprobs=None,
                 draft_slots=None, draft_temperature=None):
    """``(output_token_ids, num_accepted, logprobs)``; ``packed``: ``(cu_num_draft_tokens,
    max_draft_tokens)`` of packed inputs, read in place (the C++ op derives each request's
    rows from the offsets; ``n`` is then unused); ``draft_slots`` / ``draft_temperature``:
    per-slot draft rows ``[S, K', V']`` read in place through the slots, the draft logits' own
    temperature (parsed by ``chain``)."""
    min_p = params.min_p if params.uses_min_p else None
    flags = (CHAIN_METHODS[method], _LOGPROBS[return_logprobs], draft_slots, draft_temperature)
    if packed is not None:
        out, accepted, logprobs = torch.ops.specdec.cpu_verify_chain_packed(
            target_logits, draft_token_ids, draft_probs, draft_logits, *packed,
            params.temperature, params.top_k, params.top_p, min_p, token_bitmask, seeds,
            offsets, *flags)
    else:
        out, accepted, logprobs = torch.ops.specdec.cpu_verify_chain(
            target_logits, draft_token_ids, draft_probs, draft_logits, n, params.temperature,
            params.top_k, params.top_p, min_p, token_bitmask, seeds, offsets, *flags)
    return out, accepted, _logprobs(logprobs, return_logprobs)


def _plain_cpu(*tensors) -> bool:
    """The C++ helpers below run: the extension has them (``PACKED``), nothing is tracing
    (``_types.tracing``: a trace records the torch code), and every argument is a plain CPU
    tensor or None."""
    if not PACKED or _types.tracing():
        return False
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or not t.is_cpu):
            return False
    return True


def packed_layout_ok(cu_num_draft_tokens, draft_token_ids, max_draft_tokens: int,
                     vocab: int) -> bool:
    """Whether the C++ op finds a packed call's offsets and ids valid (contract section 10),
    in one pass; False where it does not run (``_plain_cpu``) or finds a fault: the caller's
    own checks then decide, and name it."""
    return _plain_cpu(cu_num_draft_tokens, draft_token_ids) and \
        torch.ops.specdec.cpu_packed_layout_ok(cu_num_draft_tokens, draft_token_ids,
                                               max_draft_tokens, vocab)


def tree_ok(parents, num_nodes, tree_token_ids, vocab: int) -> bool:
    """As ``packed_layout_ok``, for a tree call's trees and real nodes' ids."""
    return _plain_cpu(parents, num_nodes, tree_token_ids) and \
        torch.ops.specdec.cpu_tree_ok(parents, num_nodes, tree_token_ids, vocab)


def uniform(seed, offset, position, purpose: int) -> Optional[torch.Tensor]:
    """``_rng.uniform`` (word 0 of each element's stream; the arguments broadcast) by the C++
    path's Philox, bit for bit the same (``test_cpu_path``) in one op instead of ~80 small
    torch ops; None where it does not run (``_plain_cpu``): the caller takes ``_rng``."""
    if not _plain_cpu(seed, offset, position):
        return None
    seed, offset, position = torch.broadcast_tensors(seed, offset, position)
    flat = [t.reshape(-1).to(torch.int64) for t in (seed, offset, position)]
    _, u, _ = torch.ops.specdec.cpu_random_words(*flat, purpose, torch.zeros_like(flat[0]))
    return u.view(seed.shape)


def _adapters_run(*tensors) -> bool:
    return ADAPTERS and _plain_cpu(*tensors)


def flashinfer_counts(target_probs, draft_probs, draft_token_ids, num_accepted, seeds, offsets,
                      accepted, emitted) -> bool:
    """The FlashInfer adapter's two counters (``_independently_accepted`` and the adds) by one
    C++ op, in place; False, and nothing written, where it does not run (``_plain_cpu``, a
    counter that is not contiguous): the caller takes its torch code."""
    tensors = (target_probs, draft_probs, draft_token_ids, num_accepted, seeds, offsets,
               accepted, emitted)
    if not _adapters_run(*tensors) or not (accepted.is_contiguous() and emitted.is_contiguous()):
        return False
    torch.ops.specdec.cpu_flashinfer_counts(*tensors)
    return True


def sglang_parents(retrive_next_token, retrive_next_sibling):
    """``(parents, one_tree)`` of SGLang's lists by one C++ op (``tree_from_sglang``'s pointer
    jumping, and whether ``_check_links`` passes); None where it does not run."""
    if not _adapters_run(retrive_next_token, retrive_next_sibling):
        return None
    return torch.ops.specdec.cpu_sglang_parents(retrive_next_token, retrive_next_sibling)


def sglang_outputs_ok(retrive_index, flat_size: int, parents, num_spec_step: int) -> bool:
    """Whether the SGLang adapter's output checks (``_check_outputs``) pass, in one pass; False
    where the op does not run or finds a fault: the torch checks then decide, and name it."""
    return _adapters_run(retrive_index, parents) and torch.ops.specdec.cpu_sglang_outputs_ok(
        retrive_index, flat_size, parents, num_spec_step)


def sglang_write_path(predicts, accept_index, accept_token_num, retrive_index, accepted_nodes,
                      output_token_ids, num_accepted, vocab) -> bool:
    """The SGLang adapter's ``_write_path`` by one C++ op (in place); False, and nothing
    written, where it does not run (also for outputs that are not contiguous)."""
    outputs = (predicts, accept_index, accept_token_num)
    if not _adapters_run(*outputs, retrive_index, accepted_nodes, output_token_ids,
                         num_accepted) or not all(t.is_contiguous() for t in outputs):
        return False
    torch.ops.specdec.cpu_sglang_write_path(*outputs, retrive_index, accepted_nodes,
                                            output_token_ids, num_accepted,
                                            -1 if vocab is None else vocab)
    return True


def sglang_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                  retrive_next_token, retrive_next_sibling, target_predict) -> bool:
    """The SGLang adapter's ``verify_tree_greedy`` walk and writes by one C++ op, where the
    lists are one tree; False, and nothing written, where it does not run or they are not
    (the caller's torch code then gives its answer)."""
    outputs = (predicts, accept_index, accept_token_num)
    if not _adapters_run(*outputs, candidates, retrive_index, retrive_next_token,
                         retrive_next_sibling, target_predict) or \
            not all(t.is_contiguous() for t in outputs):
        return False
    return torch.ops.specdec.cpu_sglang_greedy(*outputs, candidates, retrive_index,
                                               retrive_next_token, retrive_next_sibling,
                                               target_predict)


def mrv2_layout(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                row_mapping, num_slots: int, num_rows: int):
    """vLLM MRV2's ``packed_layout`` by one C++ op (a tuple in ``PackedLayout``'s order); None
    where it does not run."""
    if not _adapters_run(cu_num_logits, draft_sampled, pos, idx_mapping, temperature, seed,
                         row_mapping):
        return None
    return torch.ops.specdec.cpu_mrv2_layout(cu_num_logits, draft_sampled, pos, idx_mapping,
                                             temperature, seed, row_mapping, num_slots,
                                             num_rows)


def mrv2_indices_ok(cu_num_logits, idx_mapping, num_slots: int, num_logits: int,
                    max_drafts: int, row_mapping=None, num_rows: int = 0) -> bool:
    """Whether a validated MRV2 step's index checks pass, in one C++ pass; False where it does
    not run or finds a fault: the torch checks then decide, and name it."""
    return _adapters_run(cu_num_logits, idx_mapping, row_mapping) and \
        torch.ops.specdec.cpu_mrv2_indices_ok(cu_num_logits, idx_mapping, num_slots, num_logits,
                                              max_drafts, row_mapping, num_rows)


def mrv2_outputs(output_token_ids, num_accepted, zero_missing: bool):
    """vLLM MRV2's ``(sampled, num_sampled)`` from ours by one C++ op; None where it does not
    run."""
    if not _adapters_run(output_token_ids, num_accepted) or num_accepted.dtype != torch.int32:
        return None
    return torch.ops.specdec.cpu_mrv2_outputs(output_token_ids, num_accepted, zero_missing)


def verify_tree(target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes,
                params, seeds, offsets, token_bitmask, return_logprobs, method="token"):
    """``(output_token_ids, accepted_nodes, num_accepted, logprobs)``."""
    min_p = params.min_p if params.uses_min_p else None
    out, path, accepted, logprobs = torch.ops.specdec.cpu_verify_tree(
        target_logits, tree_token_ids, parents, draft_probs,
        int(draft_sampling == "without_replacement"), num_nodes, params.temperature,
        params.top_k, params.top_p, min_p, token_bitmask, seeds, offsets, TREE_METHODS[method],
        _LOGPROBS[return_logprobs])
    return out, path, accepted, _logprobs(logprobs, return_logprobs)


def sample(logits, params, seeds, offsets, token_bitmask, return_logprobs=None):
    """int32 tokens ``[B]``, or ``(tokens, logprobs)`` with ``return_logprobs``."""
    min_p = params.min_p if params.uses_min_p else None
    tokens, logprobs = torch.ops.specdec.cpu_sample(
        logits, params.temperature, params.top_k, params.top_p, min_p, token_bitmask, seeds,
        offsets, _LOGPROBS[return_logprobs])
    return tokens if return_logprobs is None else (tokens, logprobs)


def processed_probs(logits, params, token_bitmask=None):
    """The C++ ``processed_probs`` of ``[B, ..., V]`` logits (benchmarks and tests; the public
    function is the reference)."""
    min_p = params.min_p if params.uses_min_p else None
    rows = logits.reshape(-1, logits.shape[-1])
    mask = None if token_bitmask is None else token_bitmask.reshape(rows.shape[0], -1)
    return torch.ops.specdec.cpu_processed_probs(rows, params.temperature, params.top_k,
                                                 params.top_p, min_p, mask).view(logits.shape)
