"""Reference target distribution (contract section 1) and the sampling race (section 2).

Per-request parameters are ``[B]`` tensors applying to dim 0 of the logits. Computation is in
float32 (float64 when the logits are float64, which the exactness tests use).
"""
from __future__ import annotations

import torch

from .. import _rng


def _per_row(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` broadcasting over the rows and the vocabulary of ``like``."""
    return param.reshape(param.shape + (1,) * (like.dim() - 1))


def sanitised_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits in the compute dtype (float32; float64 for float64 logits) with NaN and
    +-inf as -inf (never sampled)."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)
    return torch.where(torch.isfinite(x), x, -torch.inf)


def allowed_tokens(token_bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[..., V]`` from an int32 bitmask ``[..., ceil(V/32)]``: bit ``v % 32`` (least
    significant first) of word ``v // 32``; bits past V are ignored."""
    bits = (token_bitmask[..., None].to(torch.int64)
            >> torch.arange(32, device=token_bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def min_p_log_threshold(min_p: torch.Tensor) -> torch.Tensor:
    """``log(min_p)``, the min-p cut of ``z - max(z)``: ``-inf`` (nothing cut) where min_p is 0,
    or NaN (unvalidated); min_p above 1 (unvalidated) counts as 1."""
    return torch.where(min_p > 0, torch.log(min_p.clamp(max=1.0)), -torch.inf)


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None,
                    token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution verification preserves, ``[..., V]`` like ``logits``; rows with no finite
    (allowed) logit are all zero. ``temperature``/``top_k``/``top_p``/``min_p`` are ``[B]`` for
    dim 0; ``token_bitmask`` is int32 ``[..., ceil(V/32)]`` (a cleared bit makes that logit
    -inf before everything else)."""
    x = sanitised_logits(logits)
    compute = x.dtype
    vocab = x.shape[-1]
    if token_bitmask is not None:
        x = torch.where(allowed_tokens(token_bitmask, vocab), x, -torch.inf)
    temp = _per_row(temperature.to(compute), x)
    k = _per_row(top_k.to(torch.int64), x)
    top_p = _per_row(top_p.to(compute), x)

    x_max = x.amax(-1, keepdim=True)
    has_finite = x_max > -torch.inf
    greedy = temp == 0
    finite = x > -torch.inf
    safe_temp = torch.where(greedy, 1.0, temp)
    # The softmax's exponent z - max(z), as (x - max) / T: never overflows for small T.
    exponent = torch.where(finite, (x - x_max) / safe_temp, -torch.inf)

    filtered = bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any())
    use_min_p = min_p is not None and bool((min_p > 0).any())
    if filtered or use_min_p:
        # top-k compares z = x / T itself (contract 1.2), not the exponent: rounding in
        # x - max must not tie logits that z tells apart. z and p both follow x's order.
        z = torch.where(finite, x / safe_temp, -torch.inf)
    if filtered:
        order = x.argsort(dim=-1, descending=True, stable=True)
        k_eff = torch.where((k <= 0) | (k >= vocab), vocab, k).expand(*z.shape[:-1], 1)
        kth = z.gather(-1, order).gather(-1, k_eff - 1)  # the k-th largest z
        exponent = torch.where(z >= kth, exponent, -torch.inf)  # boundary ties kept
    if use_min_p:
        # Contract 8.3: z >= max(z) + log(min_p), after top-k (which keeps the max).
        log_min_p = _per_row(min_p_log_threshold(min_p.to(compute)), x)
        z_max = z.amax(-1, keepdim=True)
        exponent = torch.where(z >= z_max + log_min_p, exponent, -torch.inf)
    e = torch.exp(exponent)
    probs = e / e.sum(-1, keepdim=True)
    if filtered:
        p_sorted = probs.gather(-1, order)  # x order is p order
        reached = p_sorted.cumsum(-1) >= top_p
        first = (~reached).sum(-1, keepdim=True).clamp(max=vocab - 1)
        tau = p_sorted.gather(-1, first)  # largest tau whose kept mass reaches top_p
        kept = torch.where((top_p >= 1) | (probs >= tau), probs, 0.0)
        probs = kept / kept.sum(-1, keepdim=True)

    one_hot = torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(greedy, one_hot, probs)  # argmax: lowest id among ties
    return torch.where(has_finite, probs, 0.0)


def _race_scores(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: ``argmax_i weights_i / noise_i`` over ``weights_i > 0`` (first
    index among ties), along the last dimension."""
    return torch.where(weights > 0, weights / noise, -1.0).argmax(-1)


def _group_masses(groups: torch.Tensor) -> torch.Tensor:
    """The first level's weights: each group's total weight (``[B, G, width]`` -> ``[B, G]``)."""
    return groups.sum(-1)


def race(weights: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, position,
         purpose: int) -> torch.Tensor:
    """One sample per row of the unnormalised ``weights`` ``[B, V]``, with the two-level
    exponential race of ``_rng`` (noise keyed by ``seed``/``offset`` ``[B]``, ``position``
    ``[B]`` or a scalar, and ``purpose``): a group of ``RACE_GROUP`` tokens by the race over
    the groups' masses, then a token of that group by the race over its weights.
    Returns int32 ``[B]``; ``-1`` where no weight is positive or one is NaN."""
    batch, vocab = weights.shape
    group = _rng.RACE_GROUP
    num_groups = -(-vocab // group)
    seed, offset = seed[:, None], offset[:, None]
    position = torch.as_tensor(position, device=seed.device)
    position = position[:, None] if position.dim() == 1 else position
    width = group if num_groups > 1 else vocab  # (one group: no padding, no noise past V)
    groups = torch.nn.functional.pad(weights, (0, num_groups * width - vocab)).view(
        batch, num_groups, width)
    group_noise = _rng.token_exponential(seed, offset, position, purpose, num_groups,
                                         start=_rng.GROUP_INDEX_BASE)
    winner = _race_scores(_group_masses(groups), group_noise)
    members = groups.gather(1, winner[:, None, None].expand(batch, 1, width))[:, 0]
    first = winner * group
    token_noise = _rng.token_exponential(seed, offset, position, purpose, width,
                                         start=first[:, None])
    token = first + _race_scores(members, token_noise)
    return torch.where(weights.amax(-1) > 0, token, -1).to(torch.int32)


def token_logprobs(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                   tokens: torch.Tensor, greedy: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 ``[B, M]`` log-probabilities (contract section 9) of ``tokens`` ``[B, M]``
    (``-1``: NaN), token ``m`` emitted at row ``rows[b, m]`` of ``logits`` / ``probs``
    ``[B, R, V]``. ``"processed"``: ``log probs`` (0.0 on greedy requests); ``"raw"``: the
    log-softmax of the sanitised logits row, no temperature, filter or bitmask."""
    emitted = tokens >= 0
    row = rows.to(torch.int64).clamp(0, logits.shape[1] - 1)
    token = torch.where(emitted, tokens.to(torch.int64), 0)
    if kind == "raw":
        x = sanitised_logits(logits).gather(1, row[..., None].expand(-1, -1, logits.shape[-1]))
        value = torch.log_softmax(x, -1).gather(-1, token[..., None])[..., 0]
    else:
        p = probs.gather(1, row[..., None].expand(-1, -1, probs.shape[-1]))
        value = torch.log(p.gather(-1, token[..., None])[..., 0])
        value = torch.where(greedy[:, None], 0.0, value)
    return torch.where(emitted, value, torch.nan).to(torch.float32)


def sample(logits: torch.Tensor, temperature, top_k, top_p, seed, offset,
           min_p: torch.Tensor | None = None, token_bitmask: torch.Tensor | None = None,
           return_logprobs: str | None = None):
    """int32 ``[B]``: one token per row of ``logits`` ``[B, V]`` (``-1`` for a row with no
    finite logit); with ``return_logprobs``, ``(tokens, logprobs float32 [B])``."""
    probs = processed_probs(logits, temperature, top_k, top_p, min_p, token_bitmask)
    tokens = race(probs, seed, offset, 0, _rng.PURPOSE_SAMPLE)
    if return_logprobs is None:
        return tokens
    logprobs = token_logprobs(logits[:, None], probs[:, None], torch.zeros_like(tokens[:, None]),
                              tokens[:, None], temperature == 0, return_logprobs)
    return tokens, logprobs[:, 0]
