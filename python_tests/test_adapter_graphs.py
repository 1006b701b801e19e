"""Graph safety of the adapters (contract section 15): each adapter's engine path compiles
with ``torch.compile(fullgraph=True)`` to the eager result, and reads nothing on the host
(``specdec_kernels.testing.forbid_host_sync``) — the path an engine captures in its decode
step. On CPU the adapters' value checks run by default (``validate=None``: free there, no
device to wait for); under compile and on CUDA they are skipped, so the guarded calls here pass
``validate=False`` as an engine's CUDA call effectively runs."""
from __future__ import annotations

import pytest
import torch

from specdec_kernels.adapters import flashinfer, sglang, vllm
from specdec_kernels.testing import forbid_host_sync

import test_adapter_flashinfer as flashinfer_tests
import test_adapter_sglang as sglang_tests
import test_adapter_vllm as vllm_tests


def _vllm_inputs():
    metadata, logits, draft_probs = vllm_tests._vllm_problem(vllm_tests.VLLM_NUM_DRAFTS)
    batch, vocab = len(vllm_tests.VLLM_NUM_DRAFTS), logits.shape[-1]
    sampling = vllm.SamplingMetadata(
        all_greedy=False, all_random=False, temperature=torch.tensor([0.0, 0.8, 1.0, 0.0, 1.3]),
        top_k=torch.tensor([vocab, 4, vocab, 2, 3], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.7, 1.0, 1.0]))
    keys = dict(seed=torch.arange(batch) * 1_000_003, offset=torch.full((batch,), 9))
    return metadata, draft_probs, logits, sampling, keys


def _vllm_function():
    metadata, draft_probs, logits, sampling, keys = _vllm_inputs()
    return lambda: (vllm.rejection_sample(metadata, draft_probs, logits, sampling,
                                          validate=False, **keys),)


def _vllm_class():
    metadata, draft_probs, logits, sampling, keys = _vllm_inputs()
    sampler = vllm.RejectionSampler(None, fused_bonus=True)  # its default: validate=False
    return lambda: (sampler.forward(metadata, draft_probs, logits.clone(), sampling,
                                    **keys).sampled_token_ids,)


def _flashinfer():
    example = flashinfer_tests.FLASHINFER_EXAMPLE
    return lambda: flashinfer.chain_speculative_sampling(
        **example, seed=torch.tensor([3]), offset=torch.tensor([5]), validate=False)[:3]


def _sglang_tree():
    tree, target_logits = sglang_tests._sglang_example()

    def step():
        outputs = sglang_tests._sglang_outputs(2, 6, 4)
        sglang.tree_speculative_sampling_target_only(
            *outputs, **tree, target_logits=target_logits,
            temperature=torch.tensor([0.01, 0.7]), seed=torch.tensor([5, 6]), validate=False)
        return outputs
    return step


def _sglang_greedy():
    tree, target_logits = sglang_tests._sglang_example()
    target_predict = target_logits.argmax(-1)

    def step():
        outputs = sglang_tests._sglang_outputs(2, 6, 4)
        sglang.verify_tree_greedy(*outputs, **tree, target_predict=target_predict,
                                  validate=False)
        return outputs
    return step


STEPS = {"vllm.rejection_sample": _vllm_function, "vllm.RejectionSampler": _vllm_class,
         "flashinfer.chain_speculative_sampling": _flashinfer,
         "sglang.tree_speculative_sampling_target_only": _sglang_tree,
         "sglang.verify_tree_greedy": _sglang_greedy}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_adapter_fullgraph_compile_gives_the_eager_result(name):
    torch._dynamo.reset()
    step = STEPS[name]()
    expected = step()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")()
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_adapter_engine_path_reads_nothing_on_the_host(name):
    step = STEPS[name]()
    with forbid_host_sync():
        step()
