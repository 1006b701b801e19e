"""sample and processed_probs through the public API, on every backend: greedy rows, rows
without a finite logit, determinism, the default generator, boundary ties, bad input."""
from __future__ import annotations

import os

import pytest
import torch

import specdec_kernels as sk

from conftest import SAMPLE_BACKENDS


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_sample_greedy_dead_rows_and_determinism(backend):
    logits = torch.randn(6, 21)
    logits[2] = float("-inf")
    greedy = sk.sample(logits, temperature=0.0, backend=backend)
    expected = logits.argmax(-1).int()
    expected[2] = -1
    assert torch.equal(greedy, expected)
    a = sk.sample(logits, seed=torch.arange(6), offset=1, top_p=0.9, backend=backend)
    b = sk.sample(logits, seed=torch.arange(6), offset=1, top_p=0.9, backend=backend)
    assert torch.equal(a, b) and int(a[2]) == -1
    assert torch.equal(a, sk.sample(logits, seed=torch.arange(6), offset=1, top_p=0.9,
                                    backend="reference"))


def test_seed_none_uses_torch_generator():
    logits = torch.randn(8, 50)
    torch.manual_seed(123)
    a = sk.sample(logits)
    torch.manual_seed(123)
    b = sk.sample(logits)
    assert torch.equal(a, b)


def test_processed_probs_boundary_ties_are_kept():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    p = sk.processed_probs(logits, top_k=2)  # the 2nd largest is tied: keep both
    assert (p[0, :3] > 0).all() and p[0, 3] == 0
    flat = torch.zeros(1, 4)
    assert torch.equal(sk.processed_probs(flat, top_p=0.3), torch.full((1, 4), 0.25))
    peaked = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = sk.processed_probs(peaked, top_p=0.8)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert sk.processed_probs(torch.tensor([2.0, 7.0, 7.0]), temperature=0).tolist() == [0, 1, 0]


def test_sample_bad_input():
    with pytest.raises(ValueError, match="logits"):
        sk.sample(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="top_p"):
        sk.sample(torch.randn(2, 4), top_p=2.0)
    with pytest.raises(TypeError, match="logits"):
        sk.processed_probs(torch.ones(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_top_k_compares_z_not_the_shifted_logits(backend):
    """top-k keeps the tokens whose z = x / T reaches the k-th largest z. At T = 1e6,
    (1e-5 - 1000) and (0 - 1000) round to the same float32, but z = 1e-11 and 0 differ:
    top-2 keeps tokens 0 and 1 only, on every backend."""
    logits = torch.tensor([[1000.0, 1e-5, 0.0]]).expand(64, 3).contiguous()
    probs = sk.processed_probs(logits[:1], temperature=1e6, top_k=2)
    assert probs[0, 2] == 0 and probs[0, :2].tolist() == pytest.approx([0.5, 0.5], abs=1e-3)
    tokens = sk.sample(logits, temperature=1e6, top_k=2, seed=torch.arange(64), backend=backend)
    assert set(tokens.tolist()) == {0, 1}


def test_float64_logits_take_the_reference_path():
    logits = torch.randn(4, 9, dtype=torch.float64)
    assert torch.equal(sk.sample(logits, seed=torch.arange(4)),
                       sk.sample(logits, seed=torch.arange(4), backend="reference"))
    if os.environ.get("TRITON_INTERPRET") == "1":  # the Triton backend runs on CPU tensors
        with pytest.raises(TypeError, match="logits"):
            sk.sample(logits, seed=0, backend="triton")
