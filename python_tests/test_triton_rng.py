"""The Triton Philox-4x32-10 stream equals ``specdec_kernels._rng`` bit for bit."""
from __future__ import annotations

import pytest
import torch

from specdec_kernels import _rng
from conftest import DEVICE, needs_triton

pytestmark = needs_triton


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
    # -log1p(-u) of the same float32 u; log's last ulp may differ between libms.
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


def test_word_conversions_match_the_reference():
    """Uniforms of edge words (0, 1, rounding ties, 2**32 - 1) and random ones equal the
    reference's to the bit; the noise within 3 ulps (log's last-ulp rounding), positive; the
    race score ``w / E`` (the kernels' fast division) finite and never NaN, for a normal and
    a subnormal weight."""
    from specdec_kernels.triton._rng import word_numbers_check
    edges = [0, 1, 2, 255, 256, 2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, 2 ** 24 + 3, 2 ** 25 + 2,
             2 ** 31 + 128, 2 ** 31 + 384, 2 ** 32 - 257, 2 ** 32 - 129, 2 ** 32 - 128, 2 ** 32 - 1]
    gen = torch.Generator().manual_seed(5)
    words = torch.cat([torch.tensor(edges), torch.randint(0, 2 ** 32, (1 << 14,), generator=gen)])
    for weight in (1.0, 1e-40):
        uniforms, noise, score = (t.cpu() for t in word_numbers_check(words.to(DEVICE), weight))
        assert torch.equal(uniforms, _rng.word_uniform(words))
        assert float(uniforms[0]) == 2.0 ** -33 and float(uniforms[1]) == 2.0 ** -32
        assert float(uniforms[len(edges) - 1]) == 1 - 2.0 ** -24
        ref_noise = _rng.word_noise(words)
        assert (noise > 0).all() and torch.isfinite(noise).all() and float(noise[0]) == 2.0 ** -33
        ulp = (ref_noise.nextafter(torch.tensor(float("inf"))) - ref_noise)
        assert ((noise - ref_noise).abs() <= 3 * ulp).all()
        assert torch.isfinite(score).all() and (score >= 0).all()
        if weight == 1.0:
            assert (score > 0).all()
    print(f"noise equal to the reference's in {(noise == ref_noise).float().mean().item():.1%} "
          f"of {len(words)} words, else within 3 ulps")
