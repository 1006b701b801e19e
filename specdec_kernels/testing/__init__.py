"""``specdec_kernels.testing``: calibrated exactness tests any engine can run on its verifier.

``check_chain_verifier``, ``check_tree_verifier`` and ``check_sampler`` take a callable in
the package's padded layout and return a :class:`Report` (``print(report)``; ``report.passed``
is the verdict). ``from_vllm``, ``from_flashinfer`` and ``from_sglang`` wrap engine-layout
callables into that layout (built by ``specdec_kernels.adapters``: vLLM's metadata, SGLang's
linked lists). ``planted`` holds textbook verifiers with planted bugs, which
the checks must catch. ``forbid_host_sync()`` fails on any host read of tensor data inside
its block (docs/graphs.md). See docs/testing.md.
"""
from .report import Report, TestResult
from .chain import check_chain_verifier
from .tree import check_tree_verifier
from .sampler import check_sampler
from .adapters import from_flashinfer, from_sglang, from_vllm
from .sync import HostSyncError, forbid_host_sync

__all__ = ["Report", "TestResult", "check_chain_verifier", "check_tree_verifier",
           "check_sampler", "from_vllm", "from_flashinfer", "from_sglang", "HostSyncError",
           "forbid_host_sync"]
