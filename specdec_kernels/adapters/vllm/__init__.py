"""vLLM's spec-decode verification steps, by engine version, on our exact kernels.

* :mod:`.v1_0_33` -- vLLM 0.33.0's V1 ``RejectionSampler`` (``forward``, ``parse_output``) and
  :func:`rejection_sample` (the step with the bonus fused), on the flattened ``[T+B, V]``
  logits. Its names are this package's: ``from specdec_kernels.adapters import vllm as
  sk_vllm; sk_vllm.RejectionSampler``.
* :mod:`.mrv2_0_33` -- vLLM 0.33.0's MRV2 ``rejection_sample`` and ``RejectionSampler`` (also
  importable as ``specdec_kernels.adapters.vllm_mrv2``).
* :mod:`.mrv2_0_34` -- vLLM 0.34.0's MRV2 ``rejection_sample`` (its ``DraftLogitsCache``) and
  ``RejectionSampler``; ``mrv2_0_34.swap()`` is its swap line.

What the V1 step's modules share, each in one place: :mod:`._types` (vLLM's types mirrored by
field name), :mod:`._layout` (parsing the layout, the metadata and the sampling parameters:
every check that needs no device read), :mod:`._history` (the draft-aware history),
:mod:`._features` (the sampling features applied to the rows), :mod:`._logprobs` (vLLM's
``LogprobsTensors``) and :mod:`._delegate` (vLLM's own classes, for the modes we delegate).
No module imports vLLM at import time.
"""
from __future__ import annotations

from . import mrv2_0_33, mrv2_0_34, v1_0_33
from ._history import row_history
from ._logprobs import PROCESSED_LOGPROBS_MODES, gather_logprobs
from ._types import (MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID, LogprobsLists, LogprobsTensors,
                     SamplerOutput, SamplingMetadata, SpecDecodeMetadata)
from .v1_0_33 import RejectionSampler, rejection_sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "MAX_SPEC_LEN", "SpecDecodeMetadata", "SamplingMetadata",
           "LogprobsTensors", "LogprobsLists", "SamplerOutput", "RejectionSampler",
           "rejection_sample"]

# The re-exported entry points' examples, for doctest.testmod of this package.
__test__ = {"rejection_sample": rejection_sample}
