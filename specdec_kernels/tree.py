"""Public tree verification (contract section 4)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _backend, _cpu, _ops, _params
from ._params import PerRequest
from ._types import TreeVerifyOutput  # the result type lives at the bottom (docs/layers.md)
from .reference import tree as _reference


@_backend.on_input_device
def verify_tree(target_logits: torch.Tensor, tree_token_ids: torch.Tensor, parents: torch.Tensor,
                *, draft_probs: Optional[torch.Tensor] = None, draft_sampling: str = "iid",
                num_nodes: PerRequest = None, temperature: PerRequest = None,
                top_k: PerRequest = None, top_p: PerRequest = None, seed: PerRequest = None,
                offset: PerRequest = None, method: str = "token", backend: str = "auto",
                validate: bool = True, min_p: PerRequest = None,
                token_bitmask: Optional[torch.Tensor] = None,
                return_logprobs: Optional[str] = None,
                vocab_shard=None) -> TreeVerifyOutput:
    r"""Verify a batch of draft trees exactly (multi-draft speculative sampling).

    From the root, at node ``u`` with processed target distribution ``p`` and children
    ``x_1, x_2, ...`` in increasing node index:

    * no ``draft_probs`` (deterministic candidates, e.g. top-k trees): accept child ``i`` if
      ``u_i < p(x_i)``; on rejection remove ``x_i`` from ``p`` and renormalise;
    * ``draft_sampling="iid"`` (children drawn independently from ``q``): accept if
      ``u_i * q(x_i) < p(x_i)``; on rejection ``p <- norm(max(p - q, 0))`` (SpecInfer);
    * ``draft_sampling="without_replacement"``: as i.i.d. with ``q_1 = q`` and
      ``q_{i+1} = q_i`` with ``x_i`` removed and renormalised (recursive rejection sampling);
    * greedy (``temperature == 0``): accept the first child whose token is ``argmax p``.

    That is ``method="token"``. ``method="traversal"`` (traversal verification, Weng et al.
    2025; ``"iid"`` and ``"without_replacement"`` drafts, so ``draft_probs`` is required):
    sequence-level weights ``w_v = min(1, w_u P_u(x_v) / Q_u(x_v))`` (``w_root = 1``); the
    first leaf of the remaining tree in depth-first order is accepted when ``u_v < w_v``
    (emit its path and a sample of its current ``P_v``), else removed, and its parent ``u``
    updated: ``S = sum(max(w_u P_u - Q_u, 0))``, ``P_u <- norm(max(w_u P_u - Q_u, 0))``,
    ``w_u <- S / (S + 1 - w_u)`` (without replacement: ``x_v`` leaves ``Q_u``). The root is
    never rejected. Exact; a chain-shaped tree gives ``verify_chain(method="block")``'s
    tokens, greedy requests the token walk's.

    An accepted child becomes ``u``. When no child is accepted, one sample of the current
    ``p`` is emitted (a correction); at a leaf, one sample of its ``p`` (a bonus). The emitted
    tokens are distributed exactly as tokens sampled one by one from the processed target
    distribution, and a chain-shaped tree gives exactly :func:`verify_chain`'s tokens for the
    same ``seed`` and ``offset``.

    Args:
        target_logits: row ``i`` holds the target logits after the path root..i.
            Shape ``(batch_size, num_nodes, vocab_size)``; dtype float32, bfloat16 or float16.
        tree_token_ids: the token of each node (node 0's is ignored; padding may be ``-1``).
            Shape ``(batch_size, num_nodes)``; int32 or int64.
        parents: the parent of each node: ``parents[b, 0] == -1`` and
            ``0 <= parents[b, i] < i`` for the real nodes. Shape ``(batch_size, num_nodes)``;
            int32 or int64.
        draft_probs: row ``i`` is the distribution node ``i``'s children were drawn from.
            Shape ``(batch_size, num_nodes, vocab_size)``; float dtype. None: deterministic
            candidates (``q`` one-hot at each drafted token).
        draft_sampling: ``"iid"`` (with replacement) or ``"without_replacement"``; how the
            children of a node were drawn from its ``draft_probs`` row.
        num_nodes: int or ``(batch_size,)`` int tensor in ``1..N``: nodes ``>= num_nodes[b]``
            are padding; default N.
        temperature, top_k, top_p, min_p: per request, as in :func:`processed_probs`.
        seed, offset: per request, as in :func:`sample`; acceptance uniforms use the tested
            node's index, the correction/bonus noise the index of the node it is drawn from.
        method: ``"token"`` (default) or ``"traversal"``.
        vocab_shard: as in :func:`~specdec_kernels.verify_chain`: this rank's vocabulary
            slice (every drafting mode and method; docs/vocab_parallel.md).
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ CPU path for CPU tensors where
            it covers the call, else the reference),
            ``"reference"`` or ``"triton"`` (CPU tensors need ``TRITON_INTERPRET=1``).
        validate: check the tree, ids, lengths and parameter values (reads only those small
            tensors, never the ``[.., V]`` ones).
        token_bitmask: allowed tokens of each node's target row, as in :func:`verify_chain`.
            Shape ``(batch_size, num_nodes, ceil(vocab_size / 32))``; int32.
        return_logprobs: None, ``"processed"`` or ``"raw"``, as in :func:`verify_chain`; an
            accepted node's token is scored at its parent's row, the final token at the last
            accepted node's row.

    Returns:
        TreeVerifyOutput with
        ``output_token_ids``: Shape ``(batch_size, num_nodes)``; int32: the accepted path's
        tokens (root excluded), one correction or bonus token, then ``-1``.
        ``accepted_nodes``: Shape ``(batch_size, num_nodes)``; int32: node indices of the
        accepted path, root 0 first, then ``-1`` (feeds :func:`compact_kv_cache`).
        ``num_accepted``: Shape ``(batch_size,)``; int32; accepted draft nodes, root excluded:
        the request emits ``num_accepted + 1`` tokens.
        ``logprobs``: Shape ``(batch_size, num_nodes)``; float32, NaN where the token is
        ``-1``; None without ``return_logprobs``.

    >>> import torch, specdec_kernels as sk
    >>> logits = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0],
    ...                         [9.0, 0.0, 0.0]]])
    >>> out = sk.verify_tree(logits, torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[-1, 0, 0, 2]]),
    ...                      temperature=0.0)
    >>> out.output_token_ids, out.accepted_nodes, out.num_accepted
    (tensor([[ 1,  2,  0, -1]], dtype=torch.int32), tensor([[ 0,  2,  3, -1]], dtype=torch.int32), tensor([2], dtype=torch.int32))
    >>> sk.verify_tree(logits, torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[-1, 0, 0, 2]]),
    ...                temperature=0.0, return_logprobs="processed").logprobs
    tensor([[0., 0., 0., nan]])
    """
    if vocab_shard is not None:  # contract section 17
        from . import vocab_parallel
        return vocab_parallel.verify_tree(
            target_logits, tree_token_ids, parents, vocab_shard=vocab_shard,
            draft_probs=draft_probs, draft_sampling=draft_sampling, num_nodes=num_nodes,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
            method=method, backend=backend, validate=validate, min_p=min_p,
            token_bitmask=token_bitmask, return_logprobs=return_logprobs)
    plan = _params.planned(_TREE_PLANS, _tree_plan, target_logits, tree_token_ids, parents,
                           draft_probs, draft_sampling, num_nodes, temperature, top_k, top_p,
                           min_p, method, backend, token_bitmask, return_logprobs)
    batch, nodes, vocab, device, use_triton, cpp, params, counts = plan
    values: list = []  # the tensors whose values a validated call checks, in one read
    params = _params.planned_params(params, temperature, top_k, top_p, min_p, batch=batch,
                                    vocab_size=vocab, device=device, validate=validate,
                                    checks=values)
    if counts is None:
        counts = _params.per_request(num_nodes, "num_nodes", batch, device, torch.int32, nodes)
    if validate:
        _params.check_values("verify_tree", values + [tree_token_ids, parents,
                                                      None if num_nodes is None else counts],
                             [vocab])
    num_nodes = _params.narrow_int32(counts, 1, nodes)
    # Last: seed=None draws from torch's generator, which a rejected call must not advance.
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    if cpp:
        return TreeVerifyOutput(*_cpu.verify_tree(
            target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes,
            params, seeds, offsets, token_bitmask, return_logprobs, method))
    op = "triton_verify_tree" if use_triton else "reference_verify_tree"
    out, path, accepted, *logprobs = _ops.call(
        op,
        target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes,
        *_ops.params_args(params), seeds, offsets, token_bitmask, method, return_logprobs)
    return TreeVerifyOutput(out, path, accepted,
                            _ops.logprobs_or_none(logprobs))


@_params.check_family("verify_tree")
def _tree_checks(tensors, ints) -> list:
    """The parameters, the tree (``_params.tree_checks``) and the real non-root nodes' ids."""
    t, k, p, m, tree_token_ids, parents, num_nodes = tensors
    vocab, = ints
    if _cpu.tree_ok(parents, num_nodes, tree_token_ids, vocab):
        return _params.sampling_checks(t, k, p, m)  # (one C++ pass on CPU tensors)
    index = torch.arange(1, parents.shape[1], device=parents.device)  # the non-root nodes
    ids = tree_token_ids[:, 1:]
    out_of_range = (ids < 0) | (ids >= vocab)
    if num_nodes is not None:  # (None: every node is real)
        out_of_range &= index < num_nodes[:, None]

    def ids_error():
        b = _params.first_true(out_of_range.any(1))
        i = _params.first_true(out_of_range[b])
        raise ValueError(f"tree_token_ids: expected ids in [0, {vocab}) for the real non-root "
                         f"nodes, got {int(ids[b, i])} at [{b}, {i + 1}]")
    return (_params.sampling_checks(t, k, p, m) + _params.tree_checks(parents, num_nodes)
            + [(out_of_range, ids_error)])


_TREE_PLANS: dict = {}


def _tree_plan(target_logits, tree_token_ids, parents, draft_probs, draft_sampling, num_nodes,
               temperature, top_k, top_p, min_p, method, backend, token_bitmask,
               return_logprobs):
    """Every host check of a tree call, in the contract's order (tensor values are checked
    per call), and what the structure decides."""
    batch, nodes, vocab = _params.check_verify_logits(target_logits, "target_logits", "N")
    device = target_logits.device
    for name, index in (("tree_token_ids", tree_token_ids), ("parents", parents)):
        _params.check_tensor(index, name, dtypes=_params.INDEX_DTYPES, device=device)
        _params.check_shape(index, name, [batch, nodes], "[B, N] from target_logits [B, N, V]")
    if not isinstance(draft_sampling, str) or draft_sampling not in _reference.DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling: expected one of {_reference.DRAFT_SAMPLING}, "
                         f"got {draft_sampling!r}")
    if not isinstance(method, str) or method not in _reference.METHODS:
        raise ValueError(f"method: expected one of {_reference.METHODS}, got {method!r}")
    if method == "traversal" and draft_probs is None:
        raise ValueError("method: 'traversal' needs draft_probs (children drawn from q, "
                         "'iid' or 'without_replacement'); got draft_probs=None "
                         "(deterministic candidates: use method='token')")
    if draft_probs is not None:
        _params.check_tensor(draft_probs, "draft_probs",
                             dtypes=_params.LOGIT_DTYPES + (torch.float64,), device=device)
        _params.check_shape(draft_probs, "draft_probs", [batch, nodes, vocab],
                            "[B, N, V] like target_logits")
    _params.check_token_bitmask(token_bitmask, [batch, nodes], vocab, device,
                                "[B, N, W] like target_logits [B, N, V]")
    _params.check_return_logprobs(return_logprobs)
    use_triton = _backend.resolve(backend, device) == "triton"
    params = _params.sampling_params(temperature, top_k, top_p, batch=batch, vocab_size=vocab,
                                     device=device, validate=False, min_p=min_p, checks=[])
    params = _params.params_template(params, (temperature, top_k, top_p, min_p))
    counts = _params.per_request(num_nodes, "num_nodes", batch, device, torch.int32, nodes)
    cpp = not use_triton and _cpu.selected(backend, device) and \
        _cpu.runs_tree(target_logits, draft_probs, method)
    return (batch, nodes, vocab, device, use_triton, cpp, params,
            None if isinstance(num_nodes, torch.Tensor) else counts)
