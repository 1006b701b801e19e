"""SGLang's EAGLE trees and ``tree_speculative_sampling_target_only``, on our exact tree walk.

Follows sgl-project/sglang's sgl-kernel as read at commits 6bfad8f1
(``python/sgl_kernel/speculative.py``), b227f632 (``csrc/speculative/speculative_sampling.cuh``),
c28bdc90 (``speculative_sampling.cu``) and 29bd4e85 (``csrc/speculative/eagle_utils.cu``,
``build_tree_kernel_efficient``). SGLang describes a request's tree of ``N`` nodes (node 0 is
the root, the last verified token) by linked lists, all ``[bs, N]``:

* ``candidates[b, i]``: node ``i``'s token;
* ``retrive_next_token[b, i]``: node ``i``'s first child (local index), ``-1`` if a leaf;
* ``retrive_next_sibling[b, i]``: the next child of node ``i``'s parent, ``-1`` at the end;
* ``retrive_index[b, i]``: node ``i``'s flat position in ``predicts`` (``b * N + i``).

``build_tree_kernel_efficient`` puts parents before children and lists each node's children
in increasing node index; :func:`tree_from_sglang` and :func:`tree_to_sglang` convert between
these lists and our ``parents`` (``parents[b, i] < i``), round trip exact for such trees.

The outputs, as SGLang's kernel writes them (in place, int32): ``accept_index[b, 0..m]`` the
flat indices of the accepted path, root first (later entries untouched: callers fill ``-1``);
``accept_token_num[b] = m``, the accepted drafts; ``predicts[accept_index[b, i]]`` the token
emitted after path node ``i`` -- the next accepted draft, and after the last one the
correction or bonus token (other entries untouched).

What differs from sgl-kernel (each also in the docstring):
* SGLang's call works as it is (one import changed): the same arguments, its coins and its
  zero-filled ``draft_probs`` scratch included.
* Exact, with the drafter's probabilities: SGLang's ``_target_only`` kernel ignores
  ``draft_probs`` (scratch it writes into) and accepts child ``x`` by adding ``p(x)`` to a
  running sum compared with one coin: the target's law only when a node's children are
  distinct tokens (sampled children can repeat a token, which it then over-accepts), and
  never the higher acceptance of speculative sampling with ``q``. We verify requests whose
  ``draft_probs`` are all zero (that scratch), or ``draft_probs=None``, as deterministic
  candidates (EAGLE's top-k trees: the same law as SGLang's, repeats handled), and the
  others with ``q``, the distribution each node's children were sampled from
  (``draft_sampling="iid"`` by default, or ``"without_replacement"``), exactly.
* Randomness: Philox keyed per request. ``seed``/``offset`` (keyword) key it directly;
  otherwise SGLang's ``uniform_samples`` and ``uniform_samples_for_final_sampling`` do (their
  bits become each request's seed and offset); they are not the acceptance uniforms.
* ``threshold_single``/``threshold_acc`` below 1 are SGLang's relaxed (inexact) acceptance:
  a ``ValueError`` here; only the exact 1.0 is accepted.
* Probabilities in: ``log(target_probs)`` is used as logits with temperature 1 (a zero is
  ``-inf``, never sampled): one pass writing a float32 ``[bs, N, V]`` copy. Cheaper: pass the
  raw ``target_logits`` with ``temperature``/``top_k``/``top_p``/``min_p`` and skip SGLang's
  softmax and renorm passes too.
* Children are tried in increasing node index, SGLang's in list order: the same for trees
  built by ``build_tree_kernel_efficient``; a hand-made list in another order gives the same
  law but other tokens for a given seed.
* A node that no list reaches is a ``ValueError`` (SGLang prints a warning and skips it),
  as is a tree deeper than ``accept_index`` has columns for (SGLang stops there).
* Only ``predicts``, ``accept_index`` and ``accept_token_num`` are written; SGLang's kernel
  also writes into its ``draft_probs`` scratch, ours never does.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from .. import _params
from ..tree import verify_tree
from ..tree_attention import _validate as _validate_parents
from ..tree_attention import build_tree_attention
from ._common import logits_from_probs

__all__ = ["EagleTree", "ParentTree", "tree_from_sglang", "tree_to_sglang",
           "tree_speculative_sampling_target_only"]


class EagleTree(NamedTuple):
    """SGLang's tree layout, each ``[bs, N]`` int64."""
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    candidates: torch.Tensor


class ParentTree(NamedTuple):
    """Our tree layout (contract section 4)."""
    parents: torch.Tensor         # [bs, N] int64, -1 for the root
    tree_token_ids: torch.Tensor  # [bs, N], the candidates as given


def tree_from_sglang(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                     candidates: torch.Tensor, *, validate: bool = True) -> ParentTree:
    r"""SGLang's first-child / next-sibling lists as ``parents`` and ``tree_token_ids``.

    Args:
        retrive_next_token: each node's first child, ``-1`` for a leaf.
            Shape ``(bs, N)``; int32 or int64.
        retrive_next_sibling: the next child of the same parent, ``-1`` at the end.
            Shape ``(bs, N)``; int32 or int64.
        candidates: each node's token (node 0's is ignored by verification).
            Shape ``(bs, N)``; int32 or int64.
        validate: check that every non-root node is reached by exactly one link, the root
            by none, and that parents come before children (one synchronisation).

    Returns:
        ParentTree(parents ``(bs, N)`` int64, tree_token_ids = ``candidates``). No host
        synchronisation without ``validate``: ``log2(N)`` pointer-jumping steps.

    >>> import torch
    >>> from specdec_kernels.adapters.sglang import tree_from_sglang
    >>> tree_from_sglang(torch.tensor([[1, 2, -1, 4, 5, -1]]),   # 0 -> {1, 3}, 1 -> 2, 3 -> 4 -> 5
    ...                  torch.tensor([[-1, 3, -1, -1, -1, -1]]),
    ...                  torch.tensor([[0, 1, 2, 3, 4, 5]])).parents
    tensor([[-1,  0,  1,  0,  3,  4]])
    """
    links = {"retrive_next_token": retrive_next_token,
             "retrive_next_sibling": retrive_next_sibling, "candidates": candidates}
    for name, index in links.items():
        _params.check_tensor(index, name, ndim=2, dtypes=_params.INDEX_DTYPES,
                             device=retrive_next_token.device)
        _params.check_shape(index, name, list(retrive_next_token.shape),
                            "[bs, N] like retrive_next_token")
    batch, nodes = retrive_next_token.shape
    if nodes < 1:
        raise ValueError(f"retrive_next_token: expected at least one node (the root), got "
                         f"shape {list(retrive_next_token.shape)}")
    device = retrive_next_token.device
    node = torch.arange(nodes, device=device).expand(batch, nodes)
    sink = nodes  # one extra column takes the writes of "-1" (and of bad values)

    def targets(links: torch.Tensor) -> torch.Tensor:
        links = links.to(torch.int64)
        return torch.where((links >= 0) & (links < nodes), links, sink)

    first_child, next_sibling = targets(retrive_next_token), targets(retrive_next_sibling)
    parent_of_head = torch.full((batch, nodes + 1), -1, dtype=torch.int64, device=device)
    parent_of_head.scatter_(1, first_child, node)
    previous = torch.full((batch, nodes + 1), -1, dtype=torch.int64, device=device)
    previous.scatter_(1, next_sibling, node)
    # The head of each sibling list by pointer jumping: 2**steps >= N - 1 links.
    head = torch.where(previous[:, :nodes] >= 0, previous[:, :nodes], node)
    for _ in range(max(1, (nodes - 1).bit_length())):
        head = head.gather(1, head)
    parents = parent_of_head.gather(1, head)
    parents[:, 0] = -1
    if validate:
        _check_links(retrive_next_token, retrive_next_sibling, first_child, next_sibling,
                     parents)
    return ParentTree(parents, candidates)


def _check_links(retrive_next_token, retrive_next_sibling, first_child, next_sibling,
                 parents) -> None:
    batch, nodes = parents.shape
    node = torch.arange(nodes, device=parents.device)
    incoming = torch.zeros((batch, nodes + 1), dtype=torch.int64, device=parents.device)
    ones = torch.ones_like(first_child)
    incoming.scatter_add_(1, first_child, ones).scatter_add_(1, next_sibling, ones)
    incoming = incoming[:, :nodes]
    bad_range = [((x < -1) | (x >= nodes)) for x in (retrive_next_token, retrive_next_sibling)]
    bad_incoming = incoming != (node > 0).to(torch.int64)
    bad_order = (node > 0) & ((parents < 0) | (parents >= node))
    failed = torch.stack([bad_range[0].any(), bad_range[1].any(), bad_incoming.any(),
                          bad_order.any()]).tolist()
    for name, bad, links, flag in (("retrive_next_token", bad_range[0], retrive_next_token,
                                    failed[0]),
                                   ("retrive_next_sibling", bad_range[1], retrive_next_sibling,
                                    failed[1])):
        if flag:
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}: expected node indices in [-1, {nodes}) (-1: none), "
                             f"got {int(links[b, i])} at [{b}, {i}]")
    if failed[2]:
        b, i = (int(x) for x in bad_incoming.nonzero()[0])
        raise ValueError(f"retrive_next_token, retrive_next_sibling: expected one tree, every "
                         f"node but the root reached by exactly one link and the root by none; "
                         f"node {i} of request {b} is reached by {int(incoming[b, i])}")
    if failed[3]:
        b, i = (int(x) for x in bad_order.nonzero()[0])
        raise ValueError(f"retrive_next_token, retrive_next_sibling: expected parents before "
                         f"children (build_tree_kernel_efficient's order), got node {i} of "
                         f"request {b} under node {int(parents[b, i])}")


def tree_to_sglang(parents: torch.Tensor, tree_token_ids: torch.Tensor, *,
                   num_nodes=None, validate: bool = True) -> EagleTree:
    r"""``parents`` and ``tree_token_ids`` as SGLang's lists, children in increasing index.

    Args:
        parents: ``parents[b, 0] == -1``, ``0 <= parents[b, i] < i``. Shape ``(bs, N)``;
            int32 or int64.
        tree_token_ids: each node's token. Shape ``(bs, N)``; int32 or int64.
        num_nodes: int or ``(bs,)``: nodes ``>= num_nodes[b]`` are padding, left out of every
            list (their own lists are ``-1``). Default N.
        validate: check that ``parents`` is a tree (one synchronisation).

    Returns:
        EagleTree(retrive_index ``b * N + i``, retrive_next_token, retrive_next_sibling,
        candidates), each ``(bs, N)`` int64. Builds ``[bs, N, N]`` comparisons: for trees of
        up to a few hundred nodes.

    >>> import torch
    >>> from specdec_kernels.adapters.sglang import tree_to_sglang
    >>> tree = tree_to_sglang(torch.tensor([[-1, 0, 1, 0, 3, 4]]), torch.arange(6)[None])
    >>> tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist()
    ([[1, 2, -1, 4, 5, -1]], [[-1, 3, -1, -1, -1, -1]])
    """
    _params.check_tensor(parents, "parents", ndim=2, dtypes=_params.INDEX_DTYPES)
    _params.check_tensor(tree_token_ids, "tree_token_ids", dtypes=_params.INDEX_DTYPES,
                         device=parents.device)
    _params.check_shape(tree_token_ids, "tree_token_ids", list(parents.shape), "like parents")
    batch, nodes = parents.shape
    device = parents.device
    count = _params.per_request(num_nodes, "num_nodes", batch, device, torch.int64, nodes)
    if validate:
        _validate_parents(parents, count, None)
    node = torch.arange(nodes, device=device)
    parent = parents.to(torch.int64)
    real = (node > 0) & (node < count[:, None])                                    # [bs, N]
    # children[b, u, c]: c is a real child of u; siblings[b, c, s]: s is a later sibling of c.
    children = real[:, None, :] & (parent[:, None, :] == node[None, :, None])
    siblings = (real[:, None, :] & real[:, :, None] & (node[None, None, :] > node[None, :, None])
                & (parent[:, None, :] == parent[:, :, None]))
    none = torch.tensor(nodes, device=device)

    def first(mask: torch.Tensor) -> torch.Tensor:
        index = torch.where(mask, node, none).amin(-1)
        return torch.where(index == nodes, -1, index)

    retrive_index = torch.arange(batch, device=device)[:, None] * nodes + node
    return EagleTree(retrive_index, first(children), first(siblings),
                     tree_token_ids.to(torch.int64))


def tree_speculative_sampling_target_only(
        predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
        candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
        retrive_next_sibling: torch.Tensor, uniform_samples: Optional[torch.Tensor] = None,
        uniform_samples_for_final_sampling: Optional[torch.Tensor] = None,
        target_probs: Optional[torch.Tensor] = None, draft_probs: Optional[torch.Tensor] = None,
        threshold_single: float = 1.0, threshold_acc: float = 1.0, deterministic: bool = True,
        *, draft_sampling: Optional[str] = None, target_logits: Optional[torch.Tensor] = None,
        temperature=None, top_k=None, top_p=None, min_p=None, seed=None, offset=None,
        backend: str = "auto", validate: bool = True) -> None:
    r"""SGLang's tree verification step, exact; writes ``predicts``, ``accept_index`` and
    ``accept_token_num`` in place as sgl-kernel does. SGLang's call works unchanged (same
    positional and keyword arguments); the keyword-only ones are ours.

    Args:
        predicts: Shape ``(bs * N,)`` (at least every ``retrive_index``); int32. Written at
            the accepted path's ``retrive_index`` only.
        accept_index: Shape ``(bs, num_spec_step)``; int32 (callers fill ``-1``). Entries
            ``0..accept_token_num[b]`` written; the tree's depth must be below
            ``num_spec_step``.
        accept_token_num: Shape ``(bs,)``; int32. Set to the number of accepted drafts.
        candidates, retrive_index, retrive_next_token, retrive_next_sibling: SGLang's tree
            (see the module docstring). Shape ``(bs, N)``; int32 or int64.
        uniform_samples, uniform_samples_for_final_sampling: SGLang's coins, ``(bs, N)`` and
            ``(bs,)`` float32 (``torch.rand``), or None. Our acceptance uniforms and sampling
            noise are Philox words, so when ``seed`` is None the coins key the stream:
            request ``b``'s seed is the bits of ``uniform_samples[b, 0]`` and
            ``uniform_samples_for_final_sampling[b]`` (48 random bits) and its offset those
            of ``uniform_samples[b, 1]`` -- repeatable under ``torch.manual_seed``, row
            independent. An explicit ``seed`` takes precedence over the coins.
        target_probs: the target's processed distribution after each node (SGLang's
            softmax/renorm output). Shape ``(bs, N, V)``; float dtype. Taken as logits
            ``log(target_probs)``, temperature 1 (one pass writing a float32 copy).
        draft_probs: row ``i`` = the distribution node ``i``'s children were sampled from,
            ``(bs, N, V)``, or None for deterministic candidates (EAGLE's top-k trees). A
            request whose ``draft_probs`` are all zero (SGLang's scratch buffer, which its
            kernel ignores) is verified as deterministic candidates, exactly.
        threshold_single, threshold_acc: only 1.0 (exact); lower values are a ValueError.
        deterministic: accepted; ours is always deterministic.
        draft_sampling: how children were drawn from ``draft_probs``: ``"iid"`` or
            ``"without_replacement"``, used as given. None (SGLang's call): ``"iid"``,
            except for the all-zero requests above, found with one read of ``draft_probs``
            (and, with ``validate=True``, one synchronisation choosing the rule; with
            ``validate=False``, or when the batch mixes both, both rules run and each
            request takes its own).
        target_logits: instead of ``target_probs``: raw logits ``(bs, N, V)``, processed
            with ``temperature``, ``top_k``, ``top_p``, ``min_p`` (per request, as in
            :func:`specdec_kernels.verify_tree`) -- no copy.
        seed, offset: per request (``(bs,)`` int64) or ints.
        backend, validate: as in :func:`specdec_kernels.verify_tree`.

    sgl-kernel's test (``tests/test_speculative_sampling.py``), whose target rows are one-hot
    so that every decision is forced, called as SGLang calls its kernel:

    >>> import torch
    >>> from specdec_kernels.adapters import sglang
    >>> candidates = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    >>> retrive_index = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    >>> retrive_next_token = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    >>> retrive_next_sibling = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    >>> target_logits = torch.zeros(2, 6, 20)
    >>> for b, i, token in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
    ...     target_logits[b, i, token] = 10
    >>> target_logits[target_logits.amax(-1) < 10, 18] = 10
    >>> target_probs = torch.softmax(target_logits / 0.01, -1)
    >>> predicts = torch.full((12,), -1, dtype=torch.int32)
    >>> accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    >>> accept_token_num = torch.zeros(2, dtype=torch.int32)
    >>> sglang.tree_speculative_sampling_target_only(
    ...     predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
    ...     candidates=candidates, retrive_index=retrive_index,
    ...     retrive_next_token=retrive_next_token, retrive_next_sibling=retrive_next_sibling,
    ...     uniform_samples=torch.rand(2, 6), uniform_samples_for_final_sampling=torch.rand(2),
    ...     target_probs=target_probs, draft_probs=torch.zeros_like(target_probs),
    ...     threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    >>> predicts.tolist()
    [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    >>> accept_index.tolist(), accept_token_num.tolist()
    ([[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])
    """
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1:
            raise ValueError(f"{name}: expected 1.0 (exact acceptance; lower values are "
                             f"SGLang's relaxed, inexact rule), got {value!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    _params.check_tensor(candidates, "candidates", ndim=2, dtypes=_params.INDEX_DTYPES)
    batch, nodes = candidates.shape
    device = candidates.device
    _params.check_tensor(retrive_index, "retrive_index", dtypes=_params.INDEX_DTYPES,
                         device=device)
    _params.check_shape(retrive_index, "retrive_index", [batch, nodes], "[bs, N] like candidates")
    for name, out, ndim in (("predicts", predicts, 1), ("accept_index", accept_index, 2),
                            ("accept_token_num", accept_token_num, 1)):
        _params.check_tensor(out, name, ndim=ndim, dtypes=(torch.int32,), device=device)
    _params.check_shape(accept_index, "accept_index", [batch, None], "[bs, num_spec_step]")
    _params.check_shape(accept_token_num, "accept_token_num", [batch], "[bs]")
    num_spec_step = accept_index.shape[1]
    if num_spec_step < 1 or predicts.numel() < 1:
        raise ValueError(f"accept_index, predicts: expected at least one column / entry, got "
                         f"shapes {list(accept_index.shape)} and {list(predicts.shape)}")
    filters = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if (target_probs is None) == (target_logits is None):
        raise ValueError("target_probs, target_logits: expected exactly one of them, got "
                         + ("both" if target_probs is not None else "neither"))
    if target_probs is not None:
        given = [name for name, value in filters.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: target_probs are already processed; pass "
                             f"target_logits to apply sampling parameters")
        _params.check_tensor(target_probs, "target_probs", ndim=3, device=device)
        target_logits = logits_from_probs(target_probs, "target_probs")
        filters["temperature"] = 1.0

    if draft_probs is not None:
        _params.check_tensor(draft_probs, "draft_probs", ndim=3, device=device)
        _params.check_shape(draft_probs, "draft_probs", [batch, nodes, target_logits.shape[-1]],
                            "[bs, N, V] like the target")
    seed, offset = _coin_seeds(seed, offset, uniform_samples, uniform_samples_for_final_sampling,
                               batch, nodes, device)
    tree = tree_from_sglang(retrive_next_token, retrive_next_sibling, candidates,
                            validate=validate)
    if validate:
        _check_outputs(retrive_index, predicts, tree.parents, num_spec_step)
    # One set of seeds for every run below (seed=None draws them once).
    seeds, offsets = _params.seeds_and_offsets(seed, offset, batch=batch, device=device)
    verify = functools.partial(verify_tree, target_logits, candidates, tree.parents, seed=seeds,
                               offset=offsets, backend=backend, validate=validate, **filters)
    if draft_probs is None:
        out = verify()
    elif draft_sampling is not None:
        out = verify(draft_probs=draft_probs, draft_sampling=draft_sampling)
    else:
        out = _verify_scratch_or_probs(verify, draft_probs, validate)

    # Path step i (root first) of the first num_spec_step: its flat index and the token
    # emitted after it. Unused steps repeat step 0's write, so nothing else changes.
    width = min(num_spec_step, nodes)
    accepted = out.num_accepted.to(torch.int64).clamp(max=num_spec_step - 1)
    used = torch.arange(width, device=device) <= accepted[:, None]
    path = out.accepted_nodes[:, :width].to(torch.int64).clamp(min=0)
    flat = retrive_index.to(torch.int64).gather(1, path).clamp(0, predicts.numel() - 1)
    tokens = out.output_token_ids[:, :width]
    predicts.scatter_(0, torch.where(used, flat, flat[:, :1]).flatten(),
                      torch.where(used, tokens, tokens[:, :1]).flatten())
    accept_index[:, :width] = torch.where(used, flat.to(torch.int32), accept_index[:, :width])
    accept_token_num.copy_(accepted)


def _coin_seeds(seed, offset, uniform_samples, final_coins, batch: int, nodes: int, device):
    """SGLang's coins as Philox keys (when no seed is given): seed from the float32 bits of
    ``uniform_samples[:, 0]`` and ``final_coins`` (each below 2**30), offset from
    ``uniform_samples[:, 1]``."""
    for name, coins, shape in (("uniform_samples", uniform_samples, [batch, nodes]),
                               ("uniform_samples_for_final_sampling", final_coins, [batch])):
        if coins is not None:
            _params.check_tensor(coins, name, dtypes=(torch.float32,), device=device)
            _params.check_shape(coins, name, shape, "SGLang's coins")
    if seed is not None or uniform_samples is None or final_coins is None:
        return seed, offset
    bits = lambda coins: coins.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    seed = (bits(uniform_samples[:, 0]) << 32) | bits(final_coins)
    if offset is None and nodes > 1:
        offset = bits(uniform_samples[:, 1])
    return seed, offset


def _verify_scratch_or_probs(verify, draft_probs: torch.Tensor, validate: bool):
    """Requests whose ``draft_probs`` are all zero (SGLang's scratch) as deterministic
    candidates, the others with their ``q`` (i.i.d. children)."""
    batch = draft_probs.shape[0]
    scratch = ~draft_probs.reshape(batch, -1).any(-1)
    if validate:  # one synchronisation: usually the whole batch takes one rule
        all_scratch, no_scratch = torch.stack([scratch.all(), (~scratch).all()]).tolist()
        if all_scratch:
            return verify()
        if no_scratch:
            return verify(draft_probs=draft_probs, draft_sampling="iid")
    as_candidates = verify()
    with_probs = verify(draft_probs=draft_probs, draft_sampling="iid")
    pick = lambda a, b: None if a is None else torch.where(
        scratch.view((batch,) + (1,) * (a.dim() - 1)), a, b)
    return type(as_candidates)(*(pick(a, b) for a, b in zip(as_candidates, with_probs)))


def _check_outputs(retrive_index: torch.Tensor, predicts: torch.Tensor, parents: torch.Tensor,
                   num_spec_step: int) -> None:
    bad_index = (retrive_index < 0) | (retrive_index >= predicts.numel())
    depth = build_tree_attention(parents, validate=False).depth
    failed = torch.stack([bad_index.any(), depth.amax() >= num_spec_step]).tolist()
    if failed[0]:
        b, i = (int(x) for x in bad_index.nonzero()[0])
        raise ValueError(f"retrive_index: expected flat indices into predicts, in "
                         f"[0, {predicts.numel()}), got {int(retrive_index[b, i])} at [{b}, {i}]")
    if failed[1]:
        raise ValueError(f"accept_index: expected more columns than the tree's depth "
                         f"({int(depth.amax())}: a path of {int(depth.amax()) + 1} nodes), got "
                         f"num_spec_step = {num_spec_step}")
