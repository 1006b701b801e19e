"""pytest plugin (``-p engine_tests.vllm.swap``): docs/engines.md's swap line, run before
vLLM's test module imports ``RejectionSampler``. vLLM's files stay as the sdist ships them."""
import vllm.v1.sample.rejection_sampler

from specdec_kernels.adapters import vllm as sk_vllm

vllm.v1.sample.rejection_sampler.RejectionSampler = sk_vllm.RejectionSampler  # docs/engines.md
