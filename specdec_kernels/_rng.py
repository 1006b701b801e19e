"""The one random-number scheme every backend shares (contract section 2).

Every random number is one 32-bit word of Philox-4x32-10 (Salmon et al., SC'11) with

    key     = (seed_lo, seed_hi)                      the request's 64-bit seed
    counter = (index // 4, position | purpose << 16, offset_lo, offset_hi)
    word    = index % 4                               of the four output words

where ``index`` is the vocabulary index for per-token noise (0 for a per-draft uniform, so
word 0 of counter 0), ``GROUP_INDEX_BASE + g`` for the noise of token group ``g`` (see
below), ``position`` the node or row it belongs to (< 2**16) and ``purpose`` one of the
streams below. One Philox evaluation serves four consecutive indices, so noise costs a
quarter of a Philox per token. Nothing depends on the request's row in the batch, the batch
size, the backend or the device.

The sampling race is two-level. Tokens fall into groups of ``RACE_GROUP`` consecutive ids;
the group is drawn first, by an exponential race over the groups' masses (group noise at
indices ``GROUP_INDEX_BASE + g``), then the token, by an exponential race over the weights
of that group's tokens (token noise at their ids). Both races are exact, so the token has
probability ``mass(g) / total * weight(i) / mass(g) = weight(i) / total``; a kernel then
evaluates Philox for one group per request instead of every token of the row.

Positions:
  * ACCEPT: the draft being tested -- chain draft ``j`` (1-based, as in the contract) or tree
    node ``i``; a chain-shaped tree uses the same numbers as the chain.
  * RESAMPLE: the target row the correction or bonus token is drawn from -- chain row
    ``num_accepted`` or tree node ``u``.
  * SAMPLE: 0 (``sample()`` draws one token per call).

Words become numbers the same way on every backend (contract section 11, tail exactness):

    uniform  u = min(max(rn(word), 1/2), 2**32 - 256) * 2**-32  float32, in [2**-33, 1 - 2**-24]
    noise    E = u                                  if y == 1  (y = 1 - u, rounded)
               = -log(y) * (u / (1 - y))            otherwise  (= -log1p(-u), Goldberg)

``rn`` is the IEEE round-to-nearest-even uint32 -> float32 conversion and ``2**32 - 256`` the
largest float32 below 2**32, so ``u < 1`` always. Word 0 gives ``2**-33`` (the middle of its
cell ``[0, 2**-32)``) instead of 0, so ``u > 0`` and ``E > 0`` always; every other word below
2**24 gives exactly ``word * 2**-32``, and the rest are within half a float32 ulp of it. Hence:

* An acceptance test ``u * q < p`` never accepts a draft with ``p/q < 2**-33`` (``u * q >=
  2**-33 q > p``; rounding is monotone), whose exact acceptance probability is below 2**-33.
* ``1 - y`` is exact, so the noise is ``-log1p(-u)`` to within 3 ulps with no libdevice
  ``log1p``: finite, in ``[2**-33, 24 ln 2]``, never 0 or -0.0. A race score ``w / E`` of a
  positive weight is finite and positive, and a token never beats one whose weight is more than
  ``24 ln 2 / 2**-33`` (1.4e11) times its own: a token of probability 1e-12 never beats one of
  ``1 - 1e-12``, at either level of the race, whatever the vocabulary size.
"""
from __future__ import annotations

import torch

PURPOSE_ACCEPT = 0
PURPOSE_RESAMPLE = 1
PURPOSE_SAMPLE = 2

MAX_POSITION = 1 << 16

# Tokens per group of the two-level race (a power of two, a multiple of 4), and the first
# index of the group noise: indices below it are token ids (V < 2**31), above it groups.
RACE_GROUP = 2048
GROUP_INDEX_BASE = 1 << 31

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
UNIFORM_SCALE = 2.0 ** -32
UNIFORM_MIN = 0.5  # word 0 -> 2**-33, the middle of its cell: u > 0, so E > 0
UNIFORM_MAX = 2.0 ** 32 - 256  # the largest float32 below 2**32: u < 1

_MASK32 = 0xFFFFFFFF


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox-4x32 on int64 tensors holding uint32 values; returns the four output words.

    The 32x32-bit products can exceed int64's range; the multiply wraps modulo 2**64 (two's
    complement on every torch device), so its bits -- and the masked halves -- are exact. The
    tests check this against Python integers and Random123's known answers. The counters are
    broadcast to the common shape first so that every round works in place on its products.
    """
    c0, c1, c2, c3, k0, k1 = (torch.as_tensor(x, dtype=torch.int64) & _MASK32
                              for x in (c0, c1, c2, c3, k0, k1))
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    c0, c1, c2, c3 = (c.expand(shape) for c in (c0, c1, c2, c3))
    for _ in range(rounds):
        product0 = c0 * PHILOX_M0
        product1 = c2 * PHILOX_M1
        c0 = (product1 >> 32).bitwise_and_(_MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (product0 >> 32).bitwise_and_(_MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1 = product1.bitwise_and_(_MASK32)
        c3 = product0.bitwise_and_(_MASK32)
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _counter_words(seed, offset, position, purpose: int, counter):
    """The four Philox words of ``counter`` (int64 tensors holding uint32; arguments broadcast)."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    offset = torch.as_tensor(offset, dtype=torch.int64, device=seed.device)
    position = torch.as_tensor(position, dtype=torch.int64, device=seed.device)
    c1 = (position & 0xFFFF) | (purpose << 16)
    return philox4x32(counter, c1, offset & _MASK32, offset >> 32, seed & _MASK32, seed >> 32)


def random_words(seed: torch.Tensor, offset: torch.Tensor, position, purpose: int,
                 index=0) -> torch.Tensor:
    """Word ``index % 4`` of counter ``index // 4`` for each element (int64 holding uint32)."""
    index = torch.as_tensor(index, dtype=torch.int64, device=torch.as_tensor(seed).device) & _MASK32
    w0, w1, w2, w3 = _counter_words(seed, offset, position, purpose, index >> 2)
    lane = index & 3
    return torch.where(lane == 0, w0, torch.where(lane == 1, w1, torch.where(lane == 2, w2, w3)))


def token_words(seed, offset, position, purpose: int, count: int, start=0) -> torch.Tensor:
    """``random_words`` for indices ``start .. start + count - 1`` along a new last dimension
    (the other arguments broadcast against it, as ``[B, 1]`` for one row per request), with
    one Philox per four indices (the layout the kernels use). ``start`` is a multiple of 4."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    start = torch.as_tensor(start, dtype=torch.int64, device=seed.device)
    counters = start // 4 + torch.arange((count + 3) // 4, device=seed.device)
    words = torch.stack(_counter_words(seed, offset, position, purpose, counters), -1)
    return words.flatten(-2)[..., :count]


def word_uniform(word: torch.Tensor) -> torch.Tensor:
    """The uniform of ``word`` (int64 holding uint32): float32 ``min(max(rn(word), 1/2),
    2**32 - 256) * 2**-32`` in ``[2**-33, 1 - 2**-24]`` (torch's int64 -> float32 rounds to
    nearest)."""
    return word.to(torch.float32).clamp(min=UNIFORM_MIN, max=UNIFORM_MAX) * UNIFORM_SCALE


def uniform_noise(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise ``-log1p(-u)`` of float32 uniforms, by Goldberg's ``log1p``: ``1 - y`` is
    exact, so ``u / (1 - y)`` corrects the rounding of ``y = 1 - u``. Positive for u > 0."""
    y = 1.0 - u
    tiny = y == 1.0  # u <= 2**-25: -log1p(-u) is u to within u / 2 relative
    return torch.where(tiny, u, -torch.log(y) * (u / torch.where(tiny, 1.0, 1.0 - y)))


def word_noise(word: torch.Tensor) -> torch.Tensor:
    """The race noise of ``word``: ``uniform_noise(word_uniform(word))``."""
    return uniform_noise(word_uniform(word))


def uniform(seed, offset, position, purpose: int, index=0) -> torch.Tensor:
    """float32 uniforms in (0, 1) (``word_uniform``)."""
    return word_uniform(random_words(seed, offset, position, purpose, index))


def exponential(seed, offset, position, purpose: int, index=0) -> torch.Tensor:
    """float32 Exp(1) noise (``word_noise``): finite and positive."""
    return word_noise(random_words(seed, offset, position, purpose, index))


def token_exponential(seed, offset, position, purpose: int, count: int, start=0) -> torch.Tensor:
    """``exponential`` for indices ``start .. start + count - 1`` along a new last dimension."""
    return word_noise(token_words(seed, offset, position, purpose, count, start))
