"""Philox-4x32-10 in Triton, bit for bit the stream of ``specdec_kernels._rng``.

Key ``(seed_lo, seed_hi)``, counter ``(index // 4, position | purpose << 16, offset_lo,
offset_hi)``, word ``index % 4``. All arithmetic is uint32 (``tl.umulhi`` for the high half of
the 32x32 products), so the words equal the int64 emulation of the reference exactly.
Uniforms and noise follow ``specdec_kernels._rng`` (its docstring: the definitions and their
precision) operation for operation: the uint32 -> float32 conversion rounds to nearest
(``cvt.rn``; numpy in the interpreter) as torch's does and the one division is ``div_rn``, so
the uniforms are equal to the bit and the noise differs only by ``log``'s last-ulp rounding.
"""
import triton
import triton.language as tl

from .. import _rng

# The constants live once, in specdec_kernels._rng; compiled kernels need them as constexprs.
PHILOX_M0 = tl.constexpr(_rng.PHILOX_M0)
PHILOX_M1 = tl.constexpr(_rng.PHILOX_M1)
PHILOX_W0 = tl.constexpr(_rng.PHILOX_W0)
PHILOX_W1 = tl.constexpr(_rng.PHILOX_W1)

PURPOSE_ACCEPT = tl.constexpr(_rng.PURPOSE_ACCEPT)
PURPOSE_RESAMPLE = tl.constexpr(_rng.PURPOSE_RESAMPLE)
PURPOSE_SAMPLE = tl.constexpr(_rng.PURPOSE_SAMPLE)
GROUP_INDEX_BASE = tl.constexpr(_rng.GROUP_INDEX_BASE)
UNIFORM_SCALE = tl.constexpr(_rng.UNIFORM_SCALE)
UNIFORM_MIN = tl.constexpr(_rng.UNIFORM_MIN)
UNIFORM_MAX = tl.constexpr(_rng.UNIFORM_MAX)


@triton.jit
def philox(c0, c1, c2, c3, k0, k1):
    """The four words of Philox-4x32-10; every argument uint32 (scalars broadcast against ``c0``)."""
    m0 = tl.full([], PHILOX_M0, tl.uint32)
    m1 = tl.full([], PHILOX_M1, tl.uint32)
    w0 = tl.full([], PHILOX_W0, tl.uint32)
    w1 = tl.full([], PHILOX_W1, tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + w0
        k1 = k1 + w1
    return c0, c1, c2, c3


@triton.jit
def _keyed_philox(seed, offset, position, purpose: tl.constexpr, counter):
    """The four words of ``counter`` (a uint32 tensor) for int64 scalars ``seed``/``offset``
    and an int scalar ``position`` (< 2**16)."""
    seed = seed.to(tl.int64)
    offset = offset.to(tl.int64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((position.to(tl.int64) & 0xFFFF) | (purpose << 16)).to(tl.uint32)
    zero = tl.zeros_like(counter)
    return philox(counter, c1 + zero, c2 + zero, c3 + zero, k0, k1)


@triton.jit
def _select_word(w0, w1, w2, w3, lane):
    return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))


@triton.jit
def word_uniform(word):
    """``_rng.word_uniform``: float32 ``min(max(rn(word), 1/2), 2**32 - 256) * 2**-32`` of a
    uint32 word, in ``[2**-33, 1 - 2**-24]``."""
    return tl.minimum(tl.maximum(word.to(tl.float32), UNIFORM_MIN), UNIFORM_MAX) * UNIFORM_SCALE


@triton.jit
def _exponential(word):
    """``_rng.word_noise``: Exp(1) noise ``-log1p(-u)`` (Goldberg) of ``u = word_uniform(word)``:
    finite and positive."""
    u = word_uniform(word)
    y = 1.0 - u
    tiny = y == 1.0
    return tl.where(tiny, u, -tl.log(y) * tl.math.div_rn(u, tl.where(tiny, 1.0, 1.0 - y)))


@triton.jit
def _random_word(seed, offset, position, purpose: tl.constexpr, index):
    """Word ``index % 4`` of counter ``index // 4`` (``index`` an int scalar or tensor)."""
    index = (index.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    w0, w1, w2, w3 = _keyed_philox(seed, offset, position, purpose, index >> 2)
    return _select_word(w0, w1, w2, w3, index & 3)


@triton.jit
def uniform(seed, offset, position, purpose: tl.constexpr, index):
    """float32 in (0, 1): ``word_uniform`` of word ``index % 4`` of counter ``index // 4``
    (``index`` an int scalar or tensor)."""
    return word_uniform(_random_word(seed, offset, position, purpose, index))


@triton.jit
def token_noise(seed, offset, position, purpose: tl.constexpr, quad, QUADS: tl.constexpr):
    """Exp(1) noise of tokens ``4 * quad + [0, 4*QUADS)`` as a ``[QUADS, 4]`` tile (row r,
    column c: token ``4 * (quad + r) + c``): one Philox per row, its four words across."""
    counter = (quad + tl.arange(0, QUADS)).to(tl.uint32)
    w0, w1, w2, w3 = _keyed_philox(seed, offset, position, purpose, counter)
    lane = tl.arange(0, 4)[None, :]
    word = _select_word(w0[:, None], w1[:, None], w2[:, None], w3[:, None], lane)
    return _exponential(word)


@triton.jit
def group_noise(seed, offset, position, purpose: tl.constexpr, group):
    """Exp(1) noise of token group ``group`` (an int scalar) in the two-level race: the
    noise of index ``GROUP_INDEX_BASE + group``."""
    index = group.to(tl.int64) + GROUP_INDEX_BASE
    return _exponential(_random_word(seed, offset, position, purpose, index))


@triton.jit
def _uniform_test_kernel(seed_ptr, offset_ptr, position_ptr, index_ptr, word_ptr, u_ptr, e_ptr,
                         n, PURPOSE: tl.constexpr, BLOCK: tl.constexpr):
    """Testing hook: per element i, the word, uniform and exponential of
    (seed[i], offset[i], position[i], PURPOSE, index[i]). Reads 32 B, writes 12 B per element."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    seed = tl.load(seed_ptr + i, mask=mask, other=0)
    offset = tl.load(offset_ptr + i, mask=mask, other=0)
    position = tl.load(position_ptr + i, mask=mask, other=0)
    index = tl.load(index_ptr + i, mask=mask, other=0)
    # The kernels' own keying (_random_word), here with a key and counter per element.
    word = _random_word(seed, offset, position, PURPOSE, index)
    tl.store(word_ptr + i, word.to(tl.int64), mask=mask)
    tl.store(u_ptr + i, word_uniform(word), mask=mask)
    tl.store(e_ptr + i, _exponential(word), mask=mask)


def philox_reference_check(seed, offset, position, index, purpose: int):
    """Launcher of the testing hook: int64 ``[n]`` tensors -> (words int64, uniforms, exponentials)."""
    import torch
    n = seed.numel()
    word = torch.empty(n, dtype=torch.int64, device=seed.device)
    u = torch.empty(n, dtype=torch.float32, device=seed.device)
    e = torch.empty(n, dtype=torch.float32, device=seed.device)
    block = 256
    _uniform_test_kernel[((n + block - 1) // block,)](seed, offset, position, index, word, u, e, n,
                                                   PURPOSE=purpose, BLOCK=block)
    return word, u, e


@triton.jit
def _word_test_kernel(word_ptr, weight, u_ptr, e_ptr, score_ptr, n, BLOCK: tl.constexpr):
    """Testing hook: the uniform and noise of given words (int64 holding uint32), and the race
    score ``weight / noise`` with the races' fast division (finite: the noise is never 0)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    word = (tl.load(word_ptr + i, mask=mask, other=0) & 0xFFFFFFFF).to(tl.uint32)
    noise = _exponential(word)
    tl.store(u_ptr + i, word_uniform(word), mask=mask)
    tl.store(e_ptr + i, noise, mask=mask)
    tl.store(score_ptr + i, tl.where(weight > 0, weight / noise, -1.0), mask=mask)


def word_numbers_check(words, weight: float = 1.0):
    """Launcher of the word hook: int64 ``[n]`` words -> (uniforms, noise, race scores)."""
    import torch
    n = words.numel()
    u, e, score = (torch.empty(n, dtype=torch.float32, device=words.device) for _ in range(3))
    block = 1024
    _word_test_kernel[((n + block - 1) // block,)](words, weight, u, e, score, n, BLOCK=block)
    return u, e, score


# Kernels compiled by bench/resources.py and python_tests/test_triton_compile.py for sm_80 and
# sm_90 (no GPU needed): (kernel, argument types, constexprs, num_warps).
COMPILE_SPECS = [
    dict(name="philox_test_hook", kernel=_uniform_test_kernel,
         signature=dict(seed_ptr="*i64", offset_ptr="*i64", position_ptr="*i64", index_ptr="*i64",
                        word_ptr="*i64", u_ptr="*fp32", e_ptr="*fp32", n="i32"),
         constexprs=dict(PURPOSE=1, BLOCK=256), num_warps=4),
]
