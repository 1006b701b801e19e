"""Engine adapters (contract section 13): an engine's own call shapes, our exact kernels.

* :mod:`specdec_kernels.adapters.vllm` -- a package, one module per vLLM version and runner:
  ``vllm.v1_0_33``, vLLM 0.33.0's V1 ``RejectionSampler`` (its constructor, ``forward`` and
  ``parse_output``) on its flattened ``[T+B, V]`` logits, via
  :func:`specdec_kernels.verify_chain_packed` (read in place), whose names the package
  exports; ``vllm.mrv2_0_33``, vLLM 0.33.0's MRV2 ``rejection_sample`` and
  ``RejectionSampler`` (also importable as :mod:`specdec_kernels.adapters.vllm_mrv2`).
* :mod:`specdec_kernels.adapters.flashinfer` -- ``chain_speculative_sampling``
  (flashinfer-python 0.7.4).
* :mod:`specdec_kernels.adapters.sglang` -- EAGLE trees (``retrive_*`` linked lists) to and from
  ``parents``, ``tree_speculative_sampling_target_only`` and ``verify_tree_greedy`` (sglang
  0.5.23 / sgl-kernel 0.3.21); the tree conversions live in ``_sglang_trees``.

Each module names the engine version whose layout it follows and every difference; none
imports its engine. ``docs/engines.md`` shows the lines that swap each one in.
"""
from . import flashinfer, sglang, vllm, vllm_mrv2

__all__ = ["flashinfer", "sglang", "vllm", "vllm_mrv2"]
