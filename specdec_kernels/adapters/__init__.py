"""Engine adapters (contract section 13): an engine's own call shapes, our exact kernels.

* :mod:`specdec_kernels.adapters.vllm` -- vLLM V1's spec-decode rejection sampling step on its
  flattened ``[T+B, V]`` logits, via :func:`specdec_kernels.verify_chain_packed` (no copy).
* :mod:`specdec_kernels.adapters.flashinfer` -- ``chain_speculative_sampling``
  (flashinfer-python 0.7.4).
* :mod:`specdec_kernels.adapters.sglang` -- EAGLE trees (``retrive_*`` linked lists) to and from
  ``parents``, ``tree_speculative_sampling_target_only`` and ``verify_tree_greedy`` (sglang
  0.5.23 / sgl-kernel 0.3.21).

Each module names the engine version whose layout it follows and every difference; none
imports its engine. ``docs/engines.md`` shows the lines that swap each one in.
"""
from . import flashinfer, sglang, vllm

__all__ = ["flashinfer", "sglang", "vllm"]
