"""Engine adapters (contract sections 13-14): what the adapters share.

Each engine's adapter has its own file: test_adapter_vllm.py (V1 and MRV2),
test_adapter_flashinfer.py, test_adapter_sglang.py.
"""
from __future__ import annotations

import torch

from specdec_kernels.adapters import _common


def test_logits_from_probs_cost_and_zeros():
    probs = torch.tensor([[0.5, 0.0, 0.5]], dtype=torch.bfloat16)
    logits = _common.logits_from_probs(probs, "target_probs")
    assert logits.dtype == torch.float32 and logits[0, 1] == float("-inf")
    assert torch.allclose(torch.softmax(logits, -1), probs.float())
