"""One step's verification with the public ops: ``verify_chain_packed`` for chains,
``verify_tree`` plus ``compact_kv_cache`` for trees; which verification methods the
installed ops accept."""
from __future__ import annotations

import functools
import inspect
import time
from typing import Optional

import torch

import specdec_kernels as sk

from .config import DEFAULT_METHOD, Sampling, Speculation
from .model import SlotCache
from .plans import DraftPlan

METHOD_CANDIDATES = ("token", "block", "traversal")


@functools.lru_cache(maxsize=None)
def takes_method(op) -> bool:
    return "method" in inspect.signature(op).parameters


def verify_methods(kind: str = "chain") -> tuple[str, ...]:
    """The verification methods the installed ``verify_chain_packed`` / ``verify_tree`` accept
    (``("token",)`` when the op has no ``method`` parameter), found by trying each candidate
    on a one-request problem."""
    op = sk.verify_chain_packed if kind == "chain" else sk.verify_tree
    if not takes_method(op):
        return (DEFAULT_METHOD,)
    logits = torch.zeros(1, 2, 4)
    found = []
    for method in METHOD_CANDIDATES:
        try:
            if kind == "chain":  # the packed op: what the loop calls for chains
                op(logits[0], torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]),
                   max_draft_tokens=1, temperature=1.0, seed=0, method=method)
            else:  # sampled children (traversal's condition: drafts drawn from q)
                op(logits, torch.tensor([[-1, 0]]), torch.tensor([[-1, 0]]),
                   draft_probs=torch.full((1, 2, 4), 0.25), temperature=1.0, seed=0,
                   method=method)
            found.append(method)
        except (TypeError, ValueError, NotImplementedError):
            continue
    return tuple(found)


def methods_for(spec: "Speculation") -> tuple[str, ...]:
    """The installed methods that apply to ``spec``: a chain's, or a tree's ("traversal" only
    with sampled children: it verifies children drawn from ``q``)."""
    if spec.trie:  # an n-gram trie: deterministic candidates ("traversal" needs q)
        return tuple(m for m in verify_methods("tree") if m != "traversal")
    if not spec.tree:
        return verify_methods("chain")
    return tuple(m for m in verify_methods("tree")
                 if m != "traversal" or spec.children != "top_k")


def method_kwargs(op, method: str) -> dict:
    if takes_method(op):
        return {"method": method}
    if method != DEFAULT_METHOD:
        raise ValueError(f"method: the installed {op.__name__} takes no method parameter, "
                         f"so only {DEFAULT_METHOD!r} runs; got {method!r}")
    return {}


def pack_chain_rows(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, n, ...]`` -> the first ``lengths[b]`` rows of each request, request-major
    (``verify_chain_packed``'s layout)."""
    valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < lengths[:, None]
    return rows[valid]


def unpack_rows(packed: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_chain_rows`: ``[sum(lengths), ...]`` -> ``[B, width, ...]``
    (zeros past each request's ``lengths[b]`` rows)."""
    valid = torch.arange(width, device=packed.device)[None, :] < lengths[:, None]
    out = packed.new_zeros((lengths.numel(), width) + tuple(packed.shape[1:]))
    out[valid] = packed
    return out


def verify_step(logits, plan: DraftPlan, cache: Optional[SlotCache], kv_lens,
                sampling: Sampling, spec: Speculation, seeds, offsets,
                planted_bug: Optional[str] = None, profile: Optional[dict] = None):
    """(output_token_ids, num_accepted, new kv_lens). ``logits``: a tree's ``[B, N, V]``;
    a chain's packed rows ``[sum(num_draft + 1), V]`` (``verify_chain_packed``); a tree's
    accepted path is compacted in ``cache``. ``profile``: adds ``verify_op`` and
    ``compaction`` seconds (:data:`~.config.PHASES`)."""
    start = time.perf_counter()
    params = sampling.kwargs()
    if planted_bug == "rows_one_late" and not plan.is_tree:
        # Planted: draft j is checked against row j + 1, as if row 0 were the first draft's
        # (each request's last row stays its own).
        row = torch.arange(logits.shape[0], device=logits.device)
        last = torch.cumsum(plan.num_draft.to(torch.long) + 1, 0) - 1
        is_last = torch.zeros_like(row, dtype=torch.bool)
        is_last[last] = True
        logits = logits[torch.where(is_last, row, row + 1)]
    if plan.is_tree:
        out = sk.verify_tree(logits, plan.tree_tokens(), plan.parents,
                             draft_probs=plan.draft_probs, draft_sampling=plan.draft_sampling,
                             num_nodes=plan.num_nodes, seed=seeds, offset=offsets, **params,
                             **method_kwargs(sk.verify_tree, spec.method))
        plan.accepted_nodes = out.accepted_nodes
        verified = time.perf_counter()
        new_kv_lens = (kv_lens + out.num_accepted + 1 if cache is None else  # no cache:
                       sk.compact_kv_cache(cache.tensors(), kv_lens, out.accepted_nodes,
                                           out.num_accepted, layout="bhsd"))  # a law check
        if profile is not None:
            profile["verify_op"] += verified - start
            profile["compaction"] += time.perf_counter() - verified
        return out.output_token_ids, out.num_accepted.to(torch.long), new_kv_lens
    num_draft = plan.num_draft.to(torch.long)
    cu = torch.zeros(num_draft.numel() + 1, dtype=torch.long, device=num_draft.device)
    cu[1:] = torch.cumsum(num_draft, 0)
    draft_logits = (None if plan.draft_logits is None
                    else pack_chain_rows(plan.draft_logits, num_draft))
    out = sk.verify_chain_packed(logits, pack_chain_rows(plan.tokens, num_draft), cu,
                                 max_draft_tokens=plan.tokens.shape[1],
                                 draft_logits=draft_logits, seed=seeds, offset=offsets,
                                 **params, **method_kwargs(sk.verify_chain_packed,
                                                            spec.method))
    num_accepted = out.num_accepted.to(torch.long)
    if profile is not None:
        profile["verify_op"] += time.perf_counter() - start
    # A chain's accepted path is nodes 0..num_accepted: already in place, nothing to move.
    return out.output_token_ids, num_accepted, kv_lens + num_accepted + 1
