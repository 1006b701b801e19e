"""Triton tile helpers shared by the kernel modules: reading logits, the processed
probability of a row described by its statistics (``stats.py``), and arg-max reductions."""
from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
LOG2E = tl.constexpr(1.4426950408889634)

# The LOGPROBS constexpr of the consuming kernels (``return_logprobs``): none, "processed"
# (log p of the emitting row, from its statistics), "raw" (log_softmax of the sanitised row
# at T = 1, before the bitmask, from ``row_stats(raw=True)``).
LOGPROBS_NONE = tl.constexpr(0)
LOGPROBS_PROCESSED = tl.constexpr(1)
LOGPROBS_RAW = tl.constexpr(2)
LOGPROBS_KINDS = {None: 0, "processed": 1, "raw": 2}


@triton.jit
def load_logits(ptr, offs, mask):
    """Logits as float32 with NaN and +-inf mapped to -inf (never sampled); ``mask`` None
    for a full tile."""
    if mask is None:
        x = tl.load(ptr + offs).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    # |NaN| < inf is false, so one comparison keeps exactly the finite logits.
    return tl.where(tl.abs(x) < float("inf"), x, float("-inf"))


@triton.jit
def exp2_scale(temperature):
    """``log2(e) / T``, so that ``exp(z) = exp2((x - x_max) * scale)`` with ``z = (x - x_max) / T``
    (one multiply per logit, and exp2 is the hardware's exponential). Greedy rows take T = 1
    (their z is x - x_max, as in the reference). Clamped so that a denormal T never turns
    ``0 * scale`` into NaN."""
    greedy = temperature == 0.0
    safe = tl.where(greedy, 1.0, temperature)
    inv = tl.math.div_rn(tl.full([], LOG2E, tl.float32) + tl.zeros_like(safe), safe)
    return tl.minimum(inv, FLT_MAX)


@triton.jit
def processed_prob(x, x_max, x_thr, norm, scale):
    """p(x) of a row described by (x_max, x_thr, norm) for sanitised float32 logits ``x``,
    divided correctly rounded (acceptance tests compare it with ``u * q``)."""
    kept = (x > float("-inf")) & (x >= x_thr)
    e = tl.exp2((x - x_max) * scale)
    return tl.where(kept, tl.math.div_rn(tl.where(kept, e, 0.0), norm), 0.0)


@triton.jit
def block_best(score, offs):
    """(max score, lowest offset holding it) of a 1-D block."""
    top = tl.max(score, axis=0)
    return top, tl.min(tl.where(score == top, offs, 2147483647), axis=0)


@triton.jit
def tile_best(score, offs):
    """``block_best`` of a 2-D tile."""
    top = tl.max(tl.max(score, axis=1), axis=0)
    return top, tl.min(tl.min(tl.where(score == top, offs, 2147483647), axis=1), axis=0)


@triton.jit
def quad_offsets(start, QUADS: tl.constexpr):
    """Token ids ``start + [0, 4*QUADS)`` as a ``[QUADS, 4]`` tile, the shape of
    ``trng.token_noise`` (``start`` a multiple of 4): one Philox per row of the tile."""
    return start + tl.arange(0, QUADS)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def allowed_logits(x, offs, mask, bm_row_ptr, HAS_BITMASK: tl.constexpr):
    """``x`` with the tokens whose bit is cleared in the row's ``token_bitmask`` as -inf
    (bit ``v % 32`` of int32 word ``v // 32``: one word read per 32 logits). ``mask`` None
    for a full tile. Without HAS_BITMASK, ``x`` unchanged (nothing compiled in)."""
    if HAS_BITMASK:
        if mask is None:
            words = tl.load(bm_row_ptr + offs // 32)
        else:
            words = tl.load(bm_row_ptr + offs // 32, mask=mask, other=0)
        x = tl.where(((words >> (offs % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def token_logprob(x, x_max, x_thr, norm, scale, greedy, raw_max, raw_log_sum, token,
                  LOGPROBS: tl.constexpr):
    """The logprob of emitted ``token`` with allowed, sanitised logit ``x``: processed,
    ``log p`` from the row statistics (0.0 on a greedy row); raw, ``x - max - log(sum(exp(x -
    max)))`` over the whole row at T = 1 (``load_raw_stats``). NaN where ``token`` is -1."""
    if LOGPROBS == LOGPROBS_PROCESSED:
        value = tl.where(greedy, 0.0, tl.log(processed_prob(x, x_max, x_thr, norm, scale)))
    else:
        value = x - raw_max - raw_log_sum
    return tl.where(token >= 0, value, float("nan"))
