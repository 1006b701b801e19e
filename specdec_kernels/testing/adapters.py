"""Engine-layout verifiers wrapped into the toolkit's layout, so that the checks run on them.

* :func:`from_vllm`: vLLM V1's flattened layout (``logits [T+B, V]``, inclusive
  ``cu_num_draft_tokens [B]``);
* :func:`from_flashinfer`: FlashInfer's ``chain_speculative_sampling`` (probabilities in);
* :func:`from_sglang`: SGLang's EAGLE tree kernel ``tree_speculative_sampling_target_only``
  (linked-list trees, probabilities and uniforms in, outputs written in place).

Engines that take probabilities expect the sampling parameters applied already: these
adapters apply them with the toolkit's float64 ``processed_probs`` (then float32), as an
engine's sampler would. Engines that take uniforms get them from torch's generator, which
the checks seed per call (declare ``seeded=False``: their per-request seeds are not ours).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _laws
from ._laws import SamplingSetting


def _setting(temperature=None, top_k=None, top_p=None, min_p=None) -> SamplingSetting:
    """The toolkit passes one setting for the whole batch; read it from the ``[B]`` tensors."""
    def first(x, cast):
        if x is None:
            return None
        return cast(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else cast(x)
    return SamplingSetting(first(temperature, float), first(top_k, int), first(top_p, float),
                           first(min_p, float))


def _probs(logits: torch.Tensor, params: dict) -> torch.Tensor:
    return _laws.processed_probs(logits.cpu(), _setting(**params)).float().to(logits.device)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def from_vllm(fn: Callable) -> Callable:
    """A chain verifier in the toolkit's layout from ``fn`` in vLLM's flattened one:

    ``fn(target_logits [T+B, V], draft_token_ids [T], cu_num_draft_tokens [B] (inclusive, as
    vLLM's SpecDecodeMetadata), *, draft_probs [T, V] or None, <params as given>, <seed/offset
    as given>) -> output_token_ids [B, K+1]`` with ``-1`` placeholders. Rows of request ``b``:
    its drafts' rows, then its bonus row (vLLM's order). ``draft_logits`` are passed through
    as ``[T, V]`` too."""
    def verify(target_logits, draft_token_ids, *, draft_probs=None, draft_logits=None, **kw):
        batch, rows, vocab = target_logits.shape
        num_drafts = rows - 1
        cu = torch.arange(1, batch + 1, device=target_logits.device) * num_drafts
        flat = {}
        if draft_probs is not None:
            flat["draft_probs"] = draft_probs.reshape(batch * num_drafts, vocab)
        else:
            flat["draft_probs"] = None
        if draft_logits is not None:
            flat["draft_logits"] = draft_logits.reshape(batch * num_drafts, vocab)
        return _first(fn(target_logits.reshape(batch * rows, vocab),
                         draft_token_ids.reshape(-1), cu, **flat, **kw))
    verify.__name__ = f"from_vllm({getattr(fn, '__name__', fn)})"
    return verify


def from_flashinfer(fn: Callable) -> Callable:
    """A chain verifier in the toolkit's layout from ``fn`` with FlashInfer's
    ``chain_speculative_sampling(draft_probs [B, K, V], draft_token_ids [B, K], target_probs
    [B, K+1, V], **seeds) -> output_token_ids [B, K+1]`` (or a tuple starting with it).
    Target (and draft-logit) rows are processed by the sampling parameters here; a one-hot
    drafter's ``draft_probs`` are built as one-hot rows (FlashInfer always takes them)."""
    def verify(target_logits, draft_token_ids, *, draft_probs=None, draft_logits=None,
               temperature=None, top_k=None, top_p=None, min_p=None, **seeds):
        params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        target_probs = _probs(target_logits, params)
        if draft_logits is not None:
            draft_probs = _probs(draft_logits, params)
        elif draft_probs is None:
            draft_probs = torch.zeros(*draft_token_ids.shape, target_logits.shape[-1],
                                      device=target_logits.device)
            draft_probs.scatter_(-1, draft_token_ids[..., None].long(), 1.0)
        return _first(fn(draft_probs.float(), draft_token_ids, target_probs, **seeds))
    verify.__name__ = f"from_flashinfer({getattr(fn, '__name__', fn)})"
    return verify


def parents_to_sglang(parents: torch.Tensor):
    """``parents [B, N]`` -> SGLang's ``(retrive_next_token, retrive_next_sibling)`` ``[B, N]``:
    a node's first child and its next sibling (children in increasing node index), ``-1``
    for none."""
    batch, nodes = parents.shape
    next_token = torch.full((batch, nodes), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, nodes), -1, dtype=torch.int64)
    parents = parents.cpu().long()
    for b in range(batch):
        last_child = {}
        for i in range(1, nodes):
            u = int(parents[b, i])
            if u < 0:
                continue
            if u in last_child:
                next_sibling[b, last_child[u]] = i
            else:
                next_token[b, u] = i
            last_child[u] = i
    return next_token, next_sibling


def sglang_to_parents(retrive_next_token: torch.Tensor,
                      retrive_next_sibling: torch.Tensor) -> torch.Tensor:
    """SGLang's linked lists -> ``parents [B, N]`` (``-1`` for the root and unreached nodes)."""
    batch, nodes = retrive_next_token.shape
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    first, sibling = retrive_next_token.cpu().long(), retrive_next_sibling.cpu().long()
    for b in range(batch):
        stack = [0]
        while stack:
            u = stack.pop()
            child = int(first[b, u])
            while child != -1:
                parents[b, child] = u
                stack.append(child)
                child = int(sibling[b, child])
    return parents


def from_sglang(fn: Callable, *, num_spec_step: Optional[int] = None) -> Callable:
    """A tree verifier in the toolkit's layout from ``fn`` with SGLang's
    ``tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num,
    candidates, retrive_index, retrive_next_token, retrive_next_sibling, uniform_samples,
    uniform_samples_for_final_sampling, target_probs, draft_probs, threshold_single,
    threshold_acc, deterministic)`` (outputs written in place; ``predicts [B*N]`` int32,
    ``accept_index [B, num_spec_step]`` int32 of flattened node indices, ``accept_token_num
    [B]``). Uniforms come from torch's generator. ``draft_probs=None`` passes zeros.
    Returns ``(output_token_ids [B, N], accepted_nodes [B, N])``."""
    def verify(target_logits, tree_token_ids, parents, *, draft_probs=None,
               draft_sampling="iid", temperature=None, top_k=None, top_p=None, min_p=None):
        batch, nodes, vocab = target_logits.shape
        device = target_logits.device
        params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        target_probs = _probs(target_logits, params)
        q = torch.zeros_like(target_probs) if draft_probs is None else draft_probs.float().clone()
        next_token, next_sibling = (x.to(device) for x in parents_to_sglang(parents))
        depth = _depths(parents.cpu().long())
        steps = num_spec_step or int(depth.max()) + 1
        predicts = torch.full((batch * nodes,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((batch, steps), -1, dtype=torch.int32, device=device)
        accept_token_num = torch.zeros(batch, dtype=torch.int32, device=device)
        retrive_index = torch.arange(batch * nodes, device=device).reshape(batch, nodes)
        fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
           candidates=tree_token_ids.long().to(device), retrive_index=retrive_index,
           retrive_next_token=next_token, retrive_next_sibling=next_sibling,
           uniform_samples=torch.rand(batch, nodes, device=device),
           uniform_samples_for_final_sampling=torch.rand(batch, device=device),
           target_probs=target_probs, draft_probs=q, threshold_single=1.0, threshold_acc=1.0,
           deterministic=True)
        return _sglang_outputs(tree_token_ids, predicts, accept_index, accept_token_num, nodes)
    verify.__name__ = f"from_sglang({getattr(fn, '__name__', fn)})"
    return verify


def _depths(parents: torch.Tensor) -> torch.Tensor:
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[:, i] = torch.where(parents[:, i] >= 0, depth.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1, 0)
    return depth


def _sglang_outputs(tokens, predicts, accept_index, accept_token_num, nodes):
    """SGLang's flattened outputs -> ``(output_token_ids, accepted_nodes)`` ``[B, N]``."""
    batch = tokens.shape[0]
    accepted = accept_index.cpu().long()
    num = accept_token_num.cpu().long()
    flat_predicts = predicts.cpu().long()
    path = torch.full((batch, nodes), -1, dtype=torch.int64)
    out = torch.full((batch, nodes), -1, dtype=torch.int64)
    steps = min(accepted.shape[1], nodes)
    base = torch.arange(batch)[:, None] * nodes
    live = torch.arange(steps)[None, :] <= num[:, None]
    path[:, :steps] = torch.where(live, accepted[:, :steps] - base, -1)
    node_tokens = tokens.cpu().long().gather(1, path.clamp(min=0))
    shifted = torch.full_like(out, -1)
    shifted[:, :nodes - 1] = node_tokens[:, 1:]
    keep = torch.arange(nodes)[None, :] < num[:, None]
    out = torch.where(keep, shifted, -1)
    last = accepted.gather(1, num[:, None].clamp(max=accepted.shape[1] - 1))[:, 0]
    out.scatter_(1, num[:, None], flat_predicts[last.clamp(min=0)][:, None])
    return out, path
