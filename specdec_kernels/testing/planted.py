"""Textbook verifiers, correct and with planted bugs, that the toolkit must certify or catch.

Each is a plain function in the toolkit's layout (or an engine's, for ``from_sglang``),
written independently of the package's kernels, from torch's generator (``seeded=False``)
unless it says otherwise:

* ``token_chain`` / ``block_chain``: correct chain verification (token-level; block, Sun et
  al.), in float64;
* ``resample_from_p``: after a rejection, the correction is drawn from ``p`` instead of the
  residual ``max(p - q, 0)``;
* ``always_reject``: every draft rejected, one token drawn from ``p`` (the law is right, the
  acceptance is not);
* ``reused_uniform``: the acceptance uniform also drives the correction's inverse-CDF draw
  (vllm-ascend #16370);
* ``shared_noise``: the correction is drawn with the drafter's noise: ``sample()``'s stream
  at the draft's offset (vLLM #54282); seeded, needs ``draft_sampler=specdec_kernels.sample``;
* ``block_first_failure``: block verification that stops at the first failed ``h_j`` (no
  later success overrides it);
* ``sglang_target_only``: SGLang's tree kernel rule (cumulative target probability of the
  siblings against one coin, ``draft_probs`` ignored) in SGLang's call layout; with i.i.d.
  drafts duplicate siblings are counted twice. Wrap it with ``from_sglang``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _rng
from ..reference import sampling as _ref_sampling
from . import _laws
from .adapters import _setting


def _processed(target_logits, draft_probs, draft_logits, draft_token_ids, params):
    setting = _setting(**params)
    p = _laws.processed_probs(target_logits, setting)
    if draft_logits is not None:
        q = _laws.processed_probs(draft_logits, setting)
    elif draft_probs is not None:
        q = draft_probs.double()
    else:
        q = torch.zeros(*draft_token_ids.shape, p.shape[-1], dtype=torch.float64)
        q.scatter_(-1, draft_token_ids[..., None].long(), 1.0)
    return p, q


def _at(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return rows.gather(1, index[:, None, None].expand(-1, 1, rows.shape[-1]))[:, 0]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    probs = weights / weights.sum(-1, keepdim=True)
    return (probs.cumsum(-1) <= u[:, None]).sum(-1).clamp(max=weights.shape[-1] - 1)


def _chain(target_logits, draft_token_ids, *, draft_probs=None, draft_logits=None,
           temperature=None, top_k=None, top_p=None, min_p=None, method="token",
           bug: Optional[str] = None, seed=None, offset=None):
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    p, q = _processed(target_logits, draft_probs, draft_logits, draft_token_ids, params)
    batch, rows, vocab = p.shape
    num_drafts = rows - 1
    drafts = draft_token_ids.long()
    if bug == "shared_noise":
        u = _rng.uniform(seed[:, None], offset[:, None], torch.arange(1, rows),
                         _rng.PURPOSE_ACCEPT).double()
    else:
        u = torch.rand(batch, num_drafts, dtype=torch.float64)
    p_d = p[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    if method == "block":
        weight = torch.ones(batch, dtype=torch.float64)
        weights, h = [weight], []
        for j in range(num_drafts):
            weight = torch.where(q_d[:, j] > 0, torch.clamp(weight * p_d[:, j] / q_d[:, j], max=1.0), 0.0)
            weights.append(weight)
            if j == num_drafts - 1:
                h.append(weight)
            else:
                residual = (weight[:, None] * p[:, j + 1] - q[:, j + 1]).clamp(min=0).sum(-1)
                denominator = residual + 1 - weight
                h.append(torch.where(denominator > 0, residual / denominator.clamp(min=1e-300), 1.0))
        success = torch.stack(h, 1) > u
        index = torch.arange(1, rows)
        if bug == "block_first_failure":
            num_accepted = success.to(torch.int64).cumprod(-1).sum(-1)
        else:
            num_accepted = torch.where(success, index, 0).amax(-1)
        w_tau = torch.stack(weights, 1).gather(1, num_accepted[:, None])
        last = num_accepted.clamp(max=num_drafts - 1)
        scaled = w_tau * _at(p, num_accepted) - _at(q, last)
    else:
        accepted = u * q_d < p_d
        num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)
        last = num_accepted.clamp(max=num_drafts - 1)
        scaled = _at(p, num_accepted) - _at(q, last)
    p_final = _at(p, num_accepted)
    residual = scaled.clamp(min=0)
    rejected = num_accepted < num_drafts
    weights = torch.where((rejected & (residual.sum(-1) > 0))[:, None], residual, p_final)
    if bug == "resample_from_p":
        weights = p_final
    if bug == "always_reject":
        num_accepted = torch.zeros_like(num_accepted)
        weights = p[:, 0]
    if bug == "reused_uniform":
        u_used = torch.where(rejected, u.gather(1, last[:, None])[:, 0], torch.rand(batch, dtype=torch.float64))
        final = _inverse_cdf(weights, u_used)
    elif bug == "shared_noise":
        final = _ref_sampling.race(weights, seed, offset + num_accepted, 0,
                                   _rng.PURPOSE_SAMPLE).long()
    else:
        final = torch.multinomial(weights, 1)[:, 0]
    out = torch.full((batch, rows), -1, dtype=torch.int64)
    out[:, :num_drafts] = torch.where(torch.arange(num_drafts) < num_accepted[:, None], drafts, -1)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out


def token_chain(target_logits, draft_token_ids, **kw):
    """Correct token-level chain verification (section 3 of the contract)."""
    return _chain(target_logits, draft_token_ids, **kw)


def block_chain(target_logits, draft_token_ids, **kw):
    """Correct block verification (Sun et al., ICLR 2025); ``method`` is ignored."""
    kw.pop("method", None)
    return _chain(target_logits, draft_token_ids, method="block", **kw)


def resample_from_p(target_logits, draft_token_ids, **kw):
    return _chain(target_logits, draft_token_ids, bug="resample_from_p", **kw)


def always_reject(target_logits, draft_token_ids, **kw):
    return _chain(target_logits, draft_token_ids, bug="always_reject", **kw)


def reused_uniform(target_logits, draft_token_ids, **kw):
    return _chain(target_logits, draft_token_ids, bug="reused_uniform", **kw)


def shared_noise(target_logits, draft_token_ids, **kw):
    return _chain(target_logits, draft_token_ids, bug="shared_noise", **kw)


def block_first_failure(target_logits, draft_token_ids, **kw):
    kw.pop("method", None)
    return _chain(target_logits, draft_token_ids, method="block", bug="block_first_failure", **kw)


def sglang_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, uniform_samples,
                       uniform_samples_for_final_sampling, target_probs, draft_probs,
                       threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """SGLang's ``tree_speculative_sampling_target_only`` rule, outputs written in place."""
    batch, nodes, vocab = target_probs.shape
    for b in range(batch):
        removed = torch.zeros(vocab, dtype=target_probs.dtype)  # draft_probs ignored: zeros
        node, row, coin, prob_acc, num = 0, 0, float(uniform_samples[b, 0]), 0.0, 0
        accept_index[b, 0] = int(retrive_index[b, 0])
        last = int(retrive_index[b, 0])
        for _ in range(1, accept_index.shape[1]):
            child = int(retrive_next_token[b, node])
            while child != -1:
                token = int(candidates[b, child])
                target = float(target_probs[b, row, token])
                prob_acc += target
                if coin <= prob_acc / threshold_acc or target >= threshold_single:
                    prob_acc, row, coin = 0.0, child, float(uniform_samples[b, child])
                    predicts[last] = token
                    num += 1
                    accept_index[b, num] = int(retrive_index[b, child])
                    last = int(retrive_index[b, child])
                    removed = torch.zeros(vocab, dtype=target_probs.dtype)
                    break
                removed[token] = target
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            node = child
        accept_token_num[b] = num
        weights = (target_probs[b, row] - removed).clamp(min=0)
        if weights.sum() <= 0:
            weights = target_probs[b, row]
        u = uniform_samples_for_final_sampling[b:b + 1].double()
        predicts[last] = int(_inverse_cdf(weights[None].double(), u)[0])
