"""specdec_kernels: exact, fused speculative-decoding verification.

Every op has a pure-PyTorch reference (``specdec_kernels.reference``), Triton kernels
(``specdec_kernels.triton``) and, for tree attention and the KV cache, a C++/CUDA extension.
The specification is docs/semantics.md; the manual starts at docs/index.md.
"""
from .sampling import SampleOutput, processed_probs, sample
from .chain import ChainVerifyOutput, verify_chain, verify_chain_packed
from .tree import TreeVerifyOutput, verify_tree
from .tree_attention import TreeAttention, build_tree_attention
from .kv_cache import compact_kv_cache, compact_paged_kv_cache
from .vocab_parallel import VocabShard

__all__ = [
    "processed_probs", "sample", "SampleOutput",
    "ChainVerifyOutput", "verify_chain", "verify_chain_packed",
    "TreeVerifyOutput", "verify_tree",
    "TreeAttention", "build_tree_attention",
    "compact_kv_cache", "compact_paged_kv_cache",
    "VocabShard",
]
