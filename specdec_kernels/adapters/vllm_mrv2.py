"""Another name of :mod:`specdec_kernels.adapters.vllm.mrv2_0_33` (vLLM 0.33.0's MRV2
``rejection_sample`` and ``RejectionSampler``), kept for the swap lines that import it."""
import sys

from .vllm import mrv2_0_33

# One module object under both names: whatever is read or patched through one is the other's.
sys.modules[__name__] = mrv2_0_33
