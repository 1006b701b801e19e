"""Engine-layout verifiers wrapped into the toolkit's layout, so that the checks run on them.

* :func:`from_vllm`: vLLM V1's ``RejectionSampler.forward(metadata, draft_probs, logits,
  sampling_metadata)`` (flattened ``logits [T+B, V]``), the call
  :mod:`specdec_kernels.adapters.vllm` implements;
* :func:`from_flashinfer`: FlashInfer's ``chain_speculative_sampling`` (probabilities in);
* :func:`from_sglang`: SGLang's EAGLE tree kernel ``tree_speculative_sampling_target_only``
  (linked-list trees, probabilities and uniforms in, outputs written in place).

The engine layouts are built by :mod:`specdec_kernels.adapters` (vLLM's metadata, SGLang's
linked lists), so the toolkit and the engine adapters agree on them by construction.
Engines that take probabilities expect the sampling parameters applied already: these
adapters apply them with the toolkit's float64 ``processed_probs`` (then float32), as an
engine's sampler would. Engines that take uniforms get them from torch's generator, which
the checks seed per call (declare ``seeded=False``: their per-request seeds are not ours).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..adapters import sglang, vllm
from ..tree_attention import build_tree_attention
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
    """A chain verifier in the toolkit's layout from ``fn`` with vLLM V1's call,
    ``RejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata, **seeds)``:
    ``metadata`` a ``SpecDecodeMetadata`` (``adapters.vllm``'s, built by its
    ``from_draft_token_ids``), ``draft_probs [T, V]`` or None (a one-hot drafter), the
    flattened ``logits [T+B, V]`` (request ``b``'s draft rows, then its bonus row) and a
    ``SamplingMetadata`` holding the declared parameters as ``[B]`` tensors (temperature 0:
    greedy). ``seed``/``offset`` are passed when the check is seeded (our
    :func:`specdec_kernels.adapters.vllm.rejection_sample` takes them; declare
    ``seeded=False`` for vLLM's own sampler). Returns ``[B, K+1]`` token ids with ``-1``
    placeholders, a ``SamplerOutput`` or a tuple starting with them. vLLM takes the
    drafter's probabilities only: ``draft_logits`` are processed into ``draft_probs`` here."""
    def verify(target_logits, draft_token_ids, *, draft_probs=None, draft_logits=None,
               temperature=None, top_k=None, top_p=None, min_p=None, **seeds):
        batch, rows, vocab = target_logits.shape
        device = target_logits.device
        params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        if draft_logits is not None:
            draft_probs = _probs(draft_logits, params)
        metadata = vllm.SpecDecodeMetadata.from_draft_token_ids(draft_token_ids.tolist(),
                                                                device=device)
        flat_probs = None if draft_probs is None else draft_probs.reshape(-1, vocab)
        out = fn(metadata, flat_probs, target_logits.reshape(batch * rows, vocab),
                 _vllm_sampling(batch, device, **params), **seeds)
        return _first(getattr(out, "sampled_token_ids", out))
    verify.__name__ = f"from_vllm({getattr(fn, '__name__', fn)})"
    return verify


def _vllm_sampling(batch: int, device, temperature, top_k, top_p, min_p):
    """vLLM's ``SamplingMetadata`` for one call: ``[B]`` tensors, ``temperature`` None when
    every request is greedy (as vLLM's model runner builds it)."""
    def per_request(value, dtype):
        if value is None or isinstance(value, torch.Tensor):
            return value
        return torch.full((batch,), value, dtype=dtype, device=device)
    temperature = per_request(1.0 if temperature is None else temperature, torch.float32)
    greedy = temperature == 0
    all_greedy, any_greedy = bool(greedy.all()), bool(greedy.any())
    return vllm.SamplingMetadata(temperature=None if all_greedy else temperature,
                                 all_greedy=all_greedy, all_random=not any_greedy,
                                 top_p=per_request(top_p, torch.float32),
                                 top_k=per_request(top_k, torch.int64),
                                 min_p=per_request(min_p, torch.float32))


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
        parents = parents.to(device)
        tree = sglang.tree_to_sglang(parents, tree_token_ids.to(device))
        steps = num_spec_step or int(build_tree_attention(parents, validate=False).depth.max()) + 1
        predicts = torch.full((batch * nodes,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((batch, steps), -1, dtype=torch.int32, device=device)
        accept_token_num = torch.zeros(batch, dtype=torch.int32, device=device)
        fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
           candidates=tree.candidates, retrive_index=tree.retrive_index,
           retrive_next_token=tree.retrive_next_token,
           retrive_next_sibling=tree.retrive_next_sibling,
           uniform_samples=torch.rand(batch, nodes, device=device),
           uniform_samples_for_final_sampling=torch.rand(batch, device=device),
           target_probs=target_probs, draft_probs=q, threshold_single=1.0, threshold_acc=1.0,
           deterministic=True)
        return _sglang_outputs(tree_token_ids, predicts, accept_index, accept_token_num, nodes)
    verify.__name__ = f"from_sglang({getattr(fn, '__name__', fn)})"
    return verify


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
