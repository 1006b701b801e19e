"""The torch Philox-4x32-10 of specdec_kernels._rng: Random123's known answers, and Python's
arbitrary-precision integers on random inputs (the torch version relies on int64 multiplies
wrapping modulo 2**64)."""
import math
import random
import struct

import torch

from specdec_kernels import _rng

M32 = 0xFFFFFFFF


def _uniform_python(word: int) -> float:
    """``_rng``'s uniform in plain Python: ``min(max(rn(word), 1/2), 2**32 - 256) * 2**-32``
    (struct's float32 packing rounds the exact double ``word`` to nearest, ties to even)."""
    rounded = struct.unpack("f", struct.pack("f", float(word)))[0]
    return min(max(rounded, 0.5), 2.0 ** 32 - 256) * 2.0 ** -32


def _philox_python(c, k):
    c, k = list(c), list(k)
    for _ in range(_rng.PHILOX_ROUNDS):
        p0, p1 = _rng.PHILOX_M0 * c[0], _rng.PHILOX_M1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
        k = [(k[0] + _rng.PHILOX_W0) & M32, (k[1] + _rng.PHILOX_W1) & M32]
    return c


def test_random123_known_answers():
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        assert tuple(int(w) for w in _rng.philox4x32(*counter, *key)) == expected
        assert tuple(_philox_python(counter, key)) == expected


def test_matches_python_integers():
    rng = random.Random(0)
    words = [[rng.choice([0, 1, M32, M32 - 1, rng.getrandbits(32)]) for _ in range(6)]
             for _ in range(2000)]
    cols = torch.tensor(words, dtype=torch.int64).T
    got = torch.stack(_rng.philox4x32(*cols), 1).tolist()
    assert got == [_philox_python(w[:4], w[4:]) for w in words]


def test_key_and_counter_layout():
    seed, offset = -(2 ** 40) - 3, 2 ** 33 + 5  # negative seeds use their two's complement
    word = _rng.random_words(torch.tensor(seed), torch.tensor(offset), 7, _rng.PURPOSE_RESAMPLE,
                             index=11)
    # Index 11 is word 11 % 4 = 3 of counter 11 // 4 = 2.
    counter = (2, 7 | (_rng.PURPOSE_RESAMPLE << 16), offset & M32, offset >> 32)
    key = (seed & M32, (seed >> 32) & M32)
    assert int(word) == _philox_python(counter, key)[3]
    u = _rng.uniform(torch.tensor(seed), torch.tensor(offset), 7, _rng.PURPOSE_RESAMPLE, 11)
    assert float(u) == _uniform_python(int(word))


EDGE_WORDS = torch.tensor(
    [0, 1, 2, 3, 255, 256, 257, 2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, 2 ** 24 + 2, 2 ** 24 + 3,
     2 ** 25 + 2, 2 ** 25 + 6, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 128, 2 ** 31 + 129, 2 ** 31 + 384,
     2 ** 32 - 385, 2 ** 32 - 384, 2 ** 32 - 257, 2 ** 32 - 256, 2 ** 32 - 129, 2 ** 32 - 128,
     2 ** 32 - 2, 2 ** 32 - 1])


def _some_words(count=1 << 20):
    words = torch.randint(0, 2 ** 32, (count,), generator=torch.Generator().manual_seed(4))
    return torch.cat([EDGE_WORDS, words])


def test_uniform_is_the_rounded_word():
    """u = min(max(rn(word), 1/2), 2**32 - 256) * 2**-32 to the bit, ties to even included."""
    words = torch.cat([EDGE_WORDS, _some_words(20_000)])
    got = _rng.word_uniform(words)
    assert got.dtype == torch.float32
    assert got.tolist() == [_uniform_python(int(w)) for w in words]


def test_uniform_precision():
    """The tail precision of contract section 11: u is never 0 (word 0 gives 2**-33, the middle
    of its cell), the next smallest u is 2**-32, u < 1 always, u exact below 2**24, and
    P(u < t) equals t to within half a float32 ulp of t or 2**-32 (the grid of u below 2**-8),
    whichever is larger."""
    assert float(_rng.word_uniform(torch.tensor(0))) == 2.0 ** -33
    assert float(_rng.word_uniform(torch.tensor(1))) == 2.0 ** -32
    assert float(_rng.word_uniform(torch.tensor(2 ** 32 - 1))) == 1 - 2.0 ** -24
    # Every word below 2**24: exact (but word 0) and strictly increasing.
    small = torch.arange(2 ** 24)
    u = _rng.word_uniform(small)
    assert torch.equal(u[1:].double(), small[1:].double() * 2.0 ** -32)
    assert (u[1:] > u[:-1]).all()
    # Non-decreasing over the whole range (rounding is monotone): sorted words, sorted u.
    words = _some_words().sort().values
    u = _rng.word_uniform(words)
    assert (u[1:] >= u[:-1]).all() and (u < 1).all() and (u > 0).all()
    # P(u < t) = (number of words with u < t) / 2**32, by bisection on the monotone map.
    for t in (2.0 ** -34, 2.0 ** -33, 2.0 ** -32, 3 * 2.0 ** -32, float(torch.tensor(1e-9)),
              2.0 ** -24, float(torch.tensor(1e-3)), float(torch.tensor(0.1)), 0.5, 0.75,
              1 - 2.0 ** -24):
        low, high = 0, 2 ** 32  # smallest word with u >= t, 2**32 if none
        while low < high:
            mid = (low + high) // 2
            if float(_rng.word_uniform(torch.tensor(mid))) >= t:
                high = mid
            else:
                low = mid + 1
        t32 = torch.tensor(t)
        half_ulp = float(t32.nextafter(torch.tensor(2.0)) - t32) / 2
        assert abs(low * 2.0 ** -32 - t) <= max(half_ulp, 2.0 ** -32), t


def test_noise_precision():
    """-log1p(-u) to within 3 ulps of float64 (Goldberg's log1p), finite and positive (never
    0 or -0.0): 2**-33 for word 0, 2**-32 for word 1, at most 24 ln 2."""
    words = _some_words()
    noise = _rng.word_noise(words)
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all() and (noise > 0).all()
    assert float(noise[0]) == 2.0 ** -33  # EDGE_WORDS[0] == 0
    assert float(_rng.word_noise(torch.tensor(1))) == 2.0 ** -32
    exact = -torch.log1p(-_rng.word_uniform(words).double())
    ulp = (exact.float().nextafter(torch.tensor(math.inf)) - exact.float()).double()
    assert ((noise.double() - exact).abs() <= 3 * ulp).all()
    assert abs(float(noise.max()) - 24 * math.log(2)) <= 2e-6
    # The old -log(1 - u) of 24-bit uniforms: -0.0 at word 0 (score w / -0.0 = -inf).
    old = -torch.log(1.0 - (EDGE_WORDS[:1] >> 8).float() * 2.0 ** -24)
    assert torch.signbit(old).all()


def test_uniforms_and_noise_ranges():
    u = _rng.uniform(torch.tensor(3), torch.tensor(0), 1, _rng.PURPOSE_ACCEPT,
                     torch.arange(100_000))
    assert u.dtype == torch.float32 and (u >= 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    e = _rng.exponential(torch.tensor(3), torch.tensor(0), 1, _rng.PURPOSE_ACCEPT,
                         torch.arange(100_000))
    assert torch.isfinite(e).all() and (e >= 0).all() and abs(float(e.mean()) - 1) < 0.02


def test_four_tokens_per_philox():
    """Index i is word i % 4 of counter i // 4; ``token_words`` (the race's layout, one Philox
    per four tokens) equals ``random_words`` element by element, for ragged V too."""
    seed, offset = torch.tensor([[5], [-(2 ** 62)]]), torch.tensor([[0], [2 ** 40 + 1]])
    for vocab in (1, 3, 4, 5, 37):
        fast = _rng.token_words(seed, offset, 9, _rng.PURPOSE_SAMPLE, vocab)
        slow = _rng.random_words(seed, offset, 9, _rng.PURPOSE_SAMPLE, torch.arange(vocab))
        assert fast.shape == (2, vocab) and torch.equal(fast, slow)
    for index in range(8):
        counter = (index // 4, 9 | (_rng.PURPOSE_SAMPLE << 16), 0, 0)
        expected = _philox_python(counter, (5, 0))[index % 4]
        assert int(_rng.random_words(torch.tensor(5), torch.tensor(0), 9, _rng.PURPOSE_SAMPLE,
                                     index)) == expected
    noise = _rng.token_exponential(seed, offset, 9, _rng.PURPOSE_SAMPLE, 37)
    assert torch.equal(noise, _rng.exponential(seed, offset, 9, _rng.PURPOSE_SAMPLE,
                                               torch.arange(37)))


def test_group_noise_has_its_own_indices():
    """The two-level race's group ``g`` takes the noise of index ``GROUP_INDEX_BASE + g``:
    above every token id (V < 2**31), four groups per Philox like tokens."""
    seed, offset = torch.tensor([[5], [-(2 ** 62)]]), torch.tensor([[0], [2 ** 40 + 1]])
    groups = _rng.token_exponential(seed, offset, 3, _rng.PURPOSE_RESAMPLE, 9,
                                    start=_rng.GROUP_INDEX_BASE)
    assert torch.equal(groups, _rng.exponential(seed, offset, 3, _rng.PURPOSE_RESAMPLE,
                                                _rng.GROUP_INDEX_BASE + torch.arange(9)))
    assert _rng.GROUP_INDEX_BASE >= 2 ** 31 and _rng.GROUP_INDEX_BASE + 2 ** 20 < 2 ** 32
    assert _rng.RACE_GROUP % 4 == 0 and _rng.RACE_GROUP & (_rng.RACE_GROUP - 1) == 0
    # A group's tokens start at a multiple of 4: ``start`` picks the same words as index i.
    tokens = _rng.token_words(seed, offset, 3, _rng.PURPOSE_RESAMPLE, 8, start=torch.tensor([[4], [12]]))
    assert torch.equal(tokens[0], _rng.random_words(seed[0], offset[0], 3, _rng.PURPOSE_RESAMPLE,
                                                    4 + torch.arange(8)))
    assert torch.equal(tokens[1], _rng.random_words(seed[1], offset[1], 3, _rng.PURPOSE_RESAMPLE,
                                                    12 + torch.arange(8)))
