"""The Triton Philox-4x32-10 stream equals ``specdec_kernels._rng`` bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from specdec_kernels import _rng

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _counters(n=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 2**16, (n,), generator=gen)
    index = torch.randint(0, 2**32, (n,), generator=gen)
    # Extremes: zero, -1 (all ones), the int64 limits, words that carry across 32 bits.
    edges = torch.tensor([0, -1, 2**63 - 1, -2**63, 1, 2**32, 2**32 - 1, -2**32])
    seeds[:8] = edges
    offsets[:8] = edges.flip(0)
    offsets[8:16] = edges
    positions[:4] = torch.tensor([0, 1, 2**16 - 1, 2**15])
    index[:4] = torch.tensor([0, 2**32 - 1, 2**31, 1])
    small = slice(16, 64)  # the common case: small seeds and offsets
    seeds[small] = torch.arange(48)
    offsets[small] = torch.arange(48) * 3
    return seeds, offsets, positions, index


@pytest.mark.parametrize("purpose", [_rng.PURPOSE_ACCEPT, _rng.PURPOSE_RESAMPLE, _rng.PURPOSE_SAMPLE])
def test_philox_words_and_uniforms_are_bit_exact(purpose):
    from specdec_kernels.triton._rng import philox_reference_check
    seeds, offsets, positions, index = _counters(seed=purpose)
    words, uniforms, noise = philox_reference_check(*(t.to(DEVICE) for t in (seeds, offsets, positions, index)),
                                                   purpose)
    ref_words = _rng.random_words(seeds, offsets, positions, purpose, index)
    assert torch.equal(words.cpu(), ref_words), "Philox words differ"
    assert torch.equal(uniforms.cpu(), _rng.uniform(seeds, offsets, positions, purpose, index))
    # -log(1 - u): the same float32 input; log's last ulp may differ between libms.
    ref_noise = _rng.exponential(seeds, offsets, positions, purpose, index)
    torch.testing.assert_close(noise.cpu(), ref_noise, rtol=4e-7, atol=1e-12)
    print(f"purpose {purpose}: exponential noise equal in "
          f"{(noise.cpu() == ref_noise).float().mean().item():.1%} of {len(seeds)} draws, "
          f"else within 1 ulp")


def test_purposes_and_positions_are_distinct_streams():
    from specdec_kernels.triton._rng import philox_reference_check
    n = 512
    seeds = torch.full((n,), 1234, dtype=torch.int64, device=DEVICE)
    zeros = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    index = torch.arange(n, device=DEVICE)
    words = [philox_reference_check(seeds, zeros, zeros + pos, index, purpose)[0]
             for purpose in range(3) for pos in (0, 1)]
    for a in range(len(words)):
        for b in range(a + 1, len(words)):
            assert (words[a] != words[b]).float().mean() > 0.99
