"""Fused chain verification (contract section 3).

Launches, all asynchronous (no host synchronisation, CUDA-graph capturable with tensor seeds):

1. ``_row_stats_kernel`` over the ``B*(K+1)`` target rows (and again over the ``B*K`` draft
   rows when ``draft_logits`` is given): one streaming pass per row, plus pivot passes for rows
   whose top-k/top-p is active (``sampling.py``).
2. ``_accept_kernel`` (grid B): the acceptance loop over the drafts, gathering one logit (and
   one draft probability or draft logit) per draft; writes the accepted drafts, ``-1`` padding
   and ``num_accepted``.
3. ``_race_kernel`` (grid B x chunks) and, when V is split, ``_race_reduce_kernel``: the
   correction or bonus token from row ``num_accepted``.

Memory: the stats are ``[B*(K+1), 3]`` float32 + ``[B*(K+1)]`` int32 (and the same for draft
rows); the race partials ``[B, chunks, 6]``. Nothing grows with ``B*K*V``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._params import scratch
from .._rng import PURPOSE_ACCEPT, PURPOSE_RESAMPLE
from ._launch import next_pow2
from . import _rng as trng
from .sampling import (Q_LOGITS, Q_NONE, Q_ONE_HOT, Q_PROBS, _last_dim_contiguous, exp2_scale,
                       load_logits, processed_prob, race, row_stats)


@triton.jit
def _accept_kernel(logits_ptr, stride_req, stride_row, stats_ptr, argmax_ptr,
                   q_ptr, stride_q_req, stride_q_row, q_stats_ptr,
                   draft_ids_ptr, stride_ids, num_draft_ptr, temperature_ptr, seed_ptr, offset_ptr,
                   out_ptr, stride_out, num_accepted_ptr, V, K,
                   PURPOSE: tl.constexpr, Q_MODE: tl.constexpr, K_P2: tl.constexpr):
    """Accept/reject the drafts of one request (grid B).

    Bytes per request, for each draft tested (stops at the first rejection): reads the id
    (4-8 B), 12 + 4 B of target stats, one target logit, and one draft probability or draft
    logit + 12 B of draft stats; then writes (K+1) * 4 B of output ids and 4 B num_accepted.
    Out-of-range ids (validate=False) are rejected without being read through.
    """
    req = tl.program_id(0)
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature == 0.0
    scale = exp2_scale(temperature)
    seed = tl.load(seed_ptr + req)
    offset = tl.load(offset_ptr + req)
    num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + req), 0), K)
    ids_row = draft_ids_ptr + req.to(tl.int64) * stride_ids
    logits_row = logits_ptr + req.to(tl.int64) * stride_req
    q_row = q_ptr + req.to(tl.int64) * stride_q_req

    accepting = num_draft > 0
    num_accepted = tl.full([], 0, tl.int32)
    for j in range(0, K):
        j64 = tl.zeros([], tl.int64) + j  # the interpreter's loop index is a Python int
        live = accepting & (j < num_draft)
        draft = tl.load(ids_row + j, mask=live, other=0).to(tl.int64)
        valid = live & (draft >= 0) & (draft < V)
        token = tl.where(valid, draft, 0)
        row = req * (K + 1) + j
        x_max = tl.load(stats_ptr + row * 3 + 0, mask=valid, other=float("-inf"))
        x_thr = tl.load(stats_ptr + row * 3 + 1, mask=valid, other=0.0)
        norm = tl.load(stats_ptr + row * 3 + 2, mask=valid, other=1.0)
        argmax = tl.load(argmax_ptr + row, mask=valid, other=-1)
        x = load_logits(logits_row + j64 * stride_row, token, valid)
        p = processed_prob(x, x_max, x_thr, norm, scale)
        if Q_MODE == 1:
            q = tl.full([], 1.0, tl.float32)
        elif Q_MODE == 2:
            q = tl.load(q_row + j64 * stride_q_row + token, mask=valid,
                        other=0.0).to(tl.float32)
        else:
            q_stat_row = req * K + j
            q_max = tl.load(q_stats_ptr + q_stat_row * 3 + 0, mask=valid, other=float("-inf"))
            q_thr = tl.load(q_stats_ptr + q_stat_row * 3 + 1, mask=valid, other=0.0)
            q_norm = tl.load(q_stats_ptr + q_stat_row * 3 + 2, mask=valid, other=1.0)
            xq = load_logits(q_row + j64 * stride_q_row, token, valid)
            q = processed_prob(xq, q_max, q_thr, q_norm, scale)
        u = trng.uniform(seed, offset, j64 + 1, PURPOSE, tl.zeros([], tl.int32))
        # Greedy p is one-hot at the arg-max (zero everywhere on a row with no finite logit).
        greedy_ok = (token == argmax) & (x_max > float("-inf"))
        accepted = valid & tl.where(greedy, greedy_ok, u * q < p)
        accepting = accepting & accepted
        num_accepted += accepting.to(tl.int32)

    positions = tl.arange(0, K_P2)
    drafts = tl.load(ids_row + positions, mask=positions < num_accepted, other=-1)
    tl.store(out_ptr + req.to(tl.int64) * stride_out + positions, drafts.to(tl.int32),
             mask=positions < K + 1)
    tl.store(num_accepted_ptr + req, num_accepted)


def verify_chain(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, draft_logits: torch.Tensor | None,
                 num_draft_tokens: torch.Tensor, params, seeds: torch.Tensor,
                 offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(output_token_ids [B, K+1] int32, num_accepted [B] int32)``; arguments parsed
    by the public layer (``num_draft_tokens`` int32 ``[B]``, seeds/offsets int64 ``[B]``)."""
    target_logits = _last_dim_contiguous(target_logits)
    batch, rows, vocab = target_logits.shape
    num_drafts = rows - 1
    device = target_logits.device
    out = torch.empty((batch, rows), dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return out, num_accepted
    draft_ids = draft_token_ids if draft_token_ids.stride(-1) == 1 or num_drafts <= 1 \
        else draft_token_ids.contiguous()
    if num_drafts == 0:
        draft_ids = torch.zeros((batch, 1), dtype=torch.int32, device=device)
    stride_ids = draft_ids.stride(0)
    num_draft = num_draft_tokens.to(torch.int32).contiguous()

    stats, argmax = row_stats(target_logits, params, rows, target_logits.stride(0),
                              target_logits.stride(1))
    q, q_stats, q_strides = None, None, (0, 0)
    if draft_logits is not None:
        q_mode = Q_LOGITS
        q = _last_dim_contiguous(draft_logits)
        if num_drafts > 0:
            q_stats, _ = row_stats(q, params, num_drafts, q.stride(0), q.stride(1))
    elif draft_probs is not None:
        q_mode = Q_PROBS
        q = _last_dim_contiguous(draft_probs)
    else:
        q_mode = Q_ONE_HOT
    if q is not None:
        q_strides = (q.stride(0), q.stride(1))
    if num_drafts == 0:
        q_mode = Q_NONE  # no draft: the race is a bonus sample of p
    dummy = scratch(device, torch.float32)

    _accept_kernel[(batch,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), stats, argmax,
        q if q is not None else dummy, q_strides[0], q_strides[1],
        q_stats if q_stats is not None else dummy,
        draft_ids, stride_ids, num_draft, params.temperature, seeds, offsets,
        out, out.stride(0), num_accepted, vocab, num_drafts,
        PURPOSE=PURPOSE_ACCEPT, Q_MODE=max(q_mode, Q_ONE_HOT),
        K_P2=next_pow2(rows), num_warps=1)
    race(target_logits, target_logits.stride(0), target_logits.stride(1), rows, stats, argmax,
         params, seeds, offsets, out, out.stride(0), purpose=PURPOSE_RESAMPLE,
         q=q, q_mode=q_mode, q_strides=q_strides, q_stats=q_stats, draft_ids=draft_ids,
         num_draft=num_draft, num_accepted=num_accepted, num_drafts=num_drafts)
    return out, num_accepted


def _accept_spec(dtype: str, q_dtype: str, q_mode: int) -> dict:
    mode = ["", "one_hot", "draft_probs", "draft_logits"][q_mode]
    return dict(
        name=f"accept[{dtype},{mode}]", kernel=_accept_kernel,
        signature=dict(logits_ptr=f"*{dtype}", stride_req="i32", stride_row="i32",
                       stats_ptr="*fp32", argmax_ptr="*i32", q_ptr=f"*{q_dtype}",
                       stride_q_req="i32", stride_q_row="i32", q_stats_ptr="*fp32",
                       draft_ids_ptr="*i64", stride_ids="i32", num_draft_ptr="*i32",
                       temperature_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64",
                       out_ptr="*i32", stride_out="i32", num_accepted_ptr="*i32", V="i32", K="i32"),
        constexprs=dict(PURPOSE=PURPOSE_ACCEPT, Q_MODE=q_mode, K_P2=8), num_warps=1)


# Compiled for sm_80/sm_90 by bench/resources.py and python_tests/test_triton_compile.py.
COMPILE_SPECS = [_accept_spec("bf16", "fp32", Q_ONE_HOT), _accept_spec("bf16", "fp32", Q_PROBS),
                 _accept_spec("bf16", "bf16", Q_LOGITS)]
