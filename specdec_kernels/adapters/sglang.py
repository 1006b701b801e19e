"""SGLang's EAGLE trees, ``tree_speculative_sampling_target_only`` and ``verify_tree_greedy``,
on our exact tree walk.

Follows sglang 0.5.23 and sgl-kernel 0.3.21, the newest releases on the package index:
sgl-kernel's ``sgl_kernel/speculative.py`` (the two signatures), and SGLang 0.5.23's own
kernels that its CUDA path calls -- ``sglang/kernels/jit/include/sgl_kernel/speculative/
sampling.cuh`` (``TreeSpeculativeSamplingTargetOnly``) and ``.../eagle.cuh``
(``VerifyTreeGreedy``) -- with the verify step of ``sglang/srt/speculative/eagle_utils.py``
(how they are called) and ``sampling_batch_info.py`` (``temperatures`` ``[bs, 1]``).
SGLang describes a request's tree of ``N`` nodes (node 0 is the root, the last verified
token) by linked lists, all ``[bs, N]``:

* ``candidates[b, i]``: node ``i``'s token;
* ``retrive_next_token[b, i]``: node ``i``'s first child (local index), ``-1`` if a leaf;
* ``retrive_next_sibling[b, i]``: the next child of node ``i``'s parent, ``-1`` at the end;
* ``retrive_index[b, i]``: node ``i``'s flat position in ``predicts`` (``b * N + i``).

``build_tree_kernel_efficient`` puts parents before children and lists each node's children
in increasing node index; :func:`tree_from_sglang` and :func:`tree_to_sglang` convert between
these lists and our ``parents`` (``parents[b, i] < i``), round trip exact for such trees.

The outputs, as SGLang's kernels write them (in place, int32): ``accept_index[b, 0..m]`` the
flat indices of the accepted path, root first (later entries untouched: callers fill ``-1``);
``accept_token_num[b] = m``, the accepted drafts; ``predicts[accept_index[b, i]]`` the token
emitted after path node ``i`` -- the next accepted draft, and after the last one the
correction or bonus token (other entries untouched). ``predicts`` never holds ``-1`` where
the kernel writes a token: a row with no mass to sample from gives ``V - 1``, as SGLang's
kernel writes. Batch size 0 writes nothing, after the checks every batch gets (a bad
argument raises at ``bs = 0`` as at ``bs = 1``). ``sampling_info.temperatures`` (``[bs, 1]``)
and the ``[bs]`` ``top_ks``/``top_ps``/``min_ps`` are taken as SGLang holds them.

What differs from SGLang (each also in the docstrings and docs/engines.md), each where ours
is exact and SGLang's is not:
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
  bits become each request's seed and offset); they are not the acceptance uniforms. Tokens
  for given coins differ from SGLang's; laws agree where SGLang's is exact.
* ``threshold_single``/``threshold_acc`` below 1 are SGLang's relaxed (lossy) acceptance:
  delegated to SGLang's own kernel when it is importable (CUDA tensors), else a
  ``NotImplementedError`` (also a ``ValueError``) naming them.
* Probabilities in: ``log(target_probs)`` is used as logits with temperature 1 (a zero is
  ``-inf``, never sampled): one pass writing a float32 ``[bs, N, V]`` copy. Cheaper: pass the
  raw ``target_logits`` with ``temperature``/``top_k``/``top_p``/``min_p`` and skip SGLang's
  softmax and renorm passes too.
* Children are tried in increasing node index, SGLang's in list order: the same for trees
  built by ``build_tree_kernel_efficient``; a hand-made list in another order gives the same
  law but other tokens for a given seed. (``verify_tree_greedy`` follows list order, as
  SGLang: its answer is SGLang's, token for token.)
* Validation (``validate=None``: where it costs no synchronisation, i.e. CPU tensors,
  eager): a node that no list reaches is a ``ValueError`` (SGLang prints a warning and
  skips it), as is a tree deeper than ``accept_index`` has columns for (SGLang stops there).
* Only ``predicts``, ``accept_index`` and ``accept_token_num`` are written; SGLang's kernel
  also writes into its ``draft_probs`` scratch, ours never does.
* The ``retrive_*`` arguments may also be spelled ``retrieve_*`` (keywords; SGLang's own
  call sites and some of sgl-kernel's tests use that spelling).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _cpu, _params
from ..reference.tree import DRAFT_SAMPLING
from ..tree import verify_tree
from ..tree_attention import build_tree_attention
from ._common import (capturing_cuda_graph, logits_from_probs, restoring_generator,
                      value_checks_wanted)
from ._sglang_trees import (EagleTree, ParentTree, sibling_rank, tree_from_sglang,
                            tree_to_sglang)

__all__ = ["EagleTree", "ParentTree", "UnsupportedModeError", "tree_from_sglang",
           "tree_to_sglang", "tree_speculative_sampling_target_only", "verify_tree_greedy"]

ENGINE_VERSION = "sglang 0.5.23 / sgl-kernel 0.3.21"


class UnsupportedModeError(NotImplementedError, ValueError):
    """A mode SGLang has and we do not implement (lossy), with SGLang's kernel not importable
    here. Also a ``ValueError``: the arguments are refused, nothing is written."""


# The examples of the tree conversions (in _sglang_trees), for doctest.testmod of this module.
__test__ = {"tree_from_sglang": tree_from_sglang, "tree_to_sglang": tree_to_sglang}


def tree_speculative_sampling_target_only(
        predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
        candidates: torch.Tensor, retrive_index: Optional[torch.Tensor] = None,
        retrive_next_token: Optional[torch.Tensor] = None,
        retrive_next_sibling: Optional[torch.Tensor] = None,
        uniform_samples: Optional[torch.Tensor] = None,
        uniform_samples_for_final_sampling: Optional[torch.Tensor] = None,
        target_probs: Optional[torch.Tensor] = None, draft_probs: Optional[torch.Tensor] = None,
        threshold_single: float = 1.0, threshold_acc: float = 1.0, deterministic: bool = True,
        *, draft_sampling: Optional[str] = None, target_logits: Optional[torch.Tensor] = None,
        temperature=None, top_k=None, top_p=None, min_p=None, seed=None, offset=None,
        retrieve_index: Optional[torch.Tensor] = None,
        retrieve_next_token: Optional[torch.Tensor] = None,
        retrieve_next_sibling: Optional[torch.Tensor] = None,
        backend: str = "auto", validate: Optional[bool] = None) -> None:
    r"""SGLang's tree verification step, exact; writes ``predicts``, ``accept_index`` and
    ``accept_token_num`` in place as SGLang's kernel does. SGLang's call works unchanged (same
    positional and keyword arguments); the keyword-only ones are ours.

    Args:
        predicts: Shape ``(bs * N,)`` (at least every ``retrive_index``); int32. Written at
            the accepted path's ``retrive_index`` only; never ``-1`` there (a row with no
            mass gives ``V - 1``, as SGLang's kernel).
        accept_index: Shape ``(bs, num_spec_step)``; int32 (callers fill ``-1``). Entries
            ``0..accept_token_num[b]`` written; the tree's depth must be below
            ``num_spec_step``.
        accept_token_num: Shape ``(bs,)``; int32. Set to the number of accepted drafts.
        candidates, retrive_index, retrive_next_token, retrive_next_sibling: SGLang's tree
            (see the module docstring). Shape ``(bs, N)``; int32 or int64. ``retrieve_*``
            spellings are taken as keywords.
        uniform_samples, uniform_samples_for_final_sampling: SGLang's coins, ``(bs, N)`` and
            ``(bs,)`` float32 (``torch.rand``), or None. Our acceptance uniforms and sampling
            noise are Philox words, so when ``seed`` is None the coins key the stream:
            request ``b``'s seed is the bits of ``uniform_samples[b, 0]`` and
            ``uniform_samples_for_final_sampling[b]`` (48 random bits) and its offset those
            of ``uniform_samples[b, 1]`` -- repeatable under ``torch.manual_seed``, row
            independent. An explicit ``seed`` takes precedence over the coins. Without
            either, one seed per request is drawn from torch's generator, only by a call
            that is not rejected.
        target_probs: the target's processed distribution after each node (SGLang's
            softmax/renorm output). Shape ``(bs, N, V)``; float dtype. Taken as logits
            ``log(target_probs)``, temperature 1 (one pass writing a float32 copy).
        draft_probs: row ``i`` = the distribution node ``i``'s children were sampled from,
            ``(bs, N, V)``, or None for deterministic candidates (EAGLE's top-k trees). A
            request whose ``draft_probs`` are all zero (SGLang's scratch buffer, which its
            kernel ignores) is verified as deterministic candidates, exactly.
        threshold_single, threshold_acc: 1.0 is exact acceptance; lower values (SGLang's
            relaxed, lossy rule) run SGLang's own kernel when it is importable, else raise
            :class:`UnsupportedModeError` (a ``NotImplementedError`` and ``ValueError``).
        deterministic: accepted; ours is always deterministic.
        draft_sampling: how children were drawn from ``draft_probs``: ``"iid"`` or
            ``"without_replacement"``, used as given. None (SGLang's call): ``"iid"``,
            except for the all-zero requests above, found with one read of ``draft_probs``
            (and, where value checks run, one read choosing the rule; otherwise both rules
            run and each request takes its own).
        target_logits: instead of ``target_probs``: raw logits ``(bs, N, V)``, processed
            with ``temperature``, ``top_k``, ``top_p``, ``min_p`` (per request: scalars,
            ``(bs,)`` or SGLang's ``(bs, 1)`` ``sampling_info.temperatures``) -- no copy.
        seed, offset: per request (``(bs,)`` int64) or ints.
        backend: as in :func:`specdec_kernels.verify_tree`.
        validate: None (default): the checks that read tensor values run where they cost no
            synchronisation (CPU tensors, eager); True/False force them.

    sgl-kernel's test (``tests/speculative/test_speculative_sampling.py``), whose target rows
    are one-hot so that every decision is forced, called as SGLang calls its kernel:

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
    retrive_index, retrive_next_token, retrive_next_sibling = _tree_lists(
        retrive_index, retrive_next_token, retrive_next_sibling, retrieve_index,
        retrieve_next_token, retrieve_next_sibling)
    exact = True
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: expected a float in [0, 1], got {type(value).__name__}")
        if not 0 <= value <= 1:
            raise ValueError(f"{name}: expected a float in [0, 1], got {value!r}")
        exact = exact and value == 1
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    # Checked here, not only by verify_tree: without draft_probs it is not passed on.
    if draft_sampling is not None and (not isinstance(draft_sampling, str)
                                       or draft_sampling not in DRAFT_SAMPLING):
        raise ValueError(f"draft_sampling: expected one of {DRAFT_SAMPLING}, "
                         f"got {draft_sampling!r}")
    if not exact:
        return _sglang_relaxed(predicts, accept_index, accept_token_num, candidates,
                               retrive_index, retrive_next_token, retrive_next_sibling,
                               uniform_samples, uniform_samples_for_final_sampling,
                               target_probs, draft_probs, threshold_single, threshold_acc,
                               deterministic)
    _params.check_tensor(candidates, "candidates", ndim=2, dtypes=_params.INDEX_DTYPES)
    batch, nodes = candidates.shape
    device = candidates.device
    values = value_checks_wanted(validate, device)
    _params.check_tensor(retrive_index, "retrive_index", dtypes=_params.INDEX_DTYPES,
                         device=device)
    _params.check_shape(retrive_index, "retrive_index", [batch, nodes], "[bs, N] like candidates")
    _check_output_tensors(predicts, accept_index, accept_token_num, batch, device)
    num_spec_step = accept_index.shape[1]
    filters = {name: _sglang_per_request(value, name, batch) for name, value in
               (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                ("min_p", min_p))}
    if (target_probs is None) == (target_logits is None):
        raise ValueError("target_probs, target_logits: expected exactly one of them, got "
                         + ("both" if target_probs is not None else "neither"))
    if target_probs is not None:
        given = [name for name, value in filters.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: target_probs are already processed; pass "
                             f"target_logits to apply sampling parameters")
        _params.check_tensor(target_probs, "target_probs", ndim=3, device=device)
        _params.check_shape(target_probs, "target_probs", [batch, nodes, None],
                            "[bs, N, V] like candidates")
        if target_probs.shape[-1] < 1:  # else verify_tree would name target_logits
            raise ValueError(f"target_probs: expected V >= 1 tokens (dim 2), got shape "
                             f"{list(target_probs.shape)}")
        target_logits = logits_from_probs(target_probs, "target_probs")
        filters["temperature"] = 1.0
    else:
        _params.check_tensor(target_logits, "target_logits", ndim=3, device=device)
        _params.check_shape(target_logits, "target_logits", [batch, nodes, None],
                            "[bs, N, V] like candidates")
    vocab = target_logits.shape[-1]
    if draft_probs is not None:
        _params.check_tensor(draft_probs, "draft_probs", ndim=3,
                             dtypes=_params.LOGIT_DTYPES + (torch.float64,), device=device)
        _params.check_shape(draft_probs, "draft_probs", [batch, nodes, vocab],
                            "[bs, N, V] like the target")
    seed, offset = _coin_seeds(seed, offset, uniform_samples, uniform_samples_for_final_sampling,
                               batch, nodes, device)
    tree = tree_from_sglang(retrive_next_token, retrive_next_sibling, candidates,
                            validate=values)
    if values and batch and not _cpu.sglang_outputs_ok(retrive_index, predicts.numel(),
                                                       tree.parents, num_spec_step):
        _check_outputs(retrive_index, predicts, tree.parents, num_spec_step)
    # seed=None: one seed per request from torch's generator, drawn by the first verify_tree
    # once it has checked its arguments, and reused by the second; a rejected call puts the
    # generator back.
    drawn = None
    if seed is None:
        if capturing_cuda_graph(device):
            raise ValueError("seed: expected seed and offset tensors (or SGLang's coins) while "
                             "capturing a CUDA graph (drawn seeds would be baked into it)")
        drawn = _params.DeferredSeeds(lambda: torch.randint(
            -2**63, 2**63 - 1, (batch,), dtype=torch.int64).to(device))
    with restoring_generator(torch.default_generator if seed is None else None):
        verify = functools.partial(verify_tree, target_logits, candidates, tree.parents,
                                   seed=seed if drawn is None else drawn, offset=offset,
                                   backend=backend, validate=values, **filters)
        if draft_probs is None:
            out = verify()
        elif draft_sampling is not None or batch == 0:
            out = verify(draft_probs=draft_probs, draft_sampling=draft_sampling or "iid")
        else:
            out = _verify_scratch_or_probs(verify, draft_probs, values)
    if batch == 0:  # checked as every batch is (verify_tree checks its arguments at B = 0 too)
        return None
    _write_path(predicts, accept_index, accept_token_num, retrive_index, out.accepted_nodes,
                out.output_token_ids, out.num_accepted, vocab)


def verify_tree_greedy(
        predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
        candidates: torch.Tensor, retrive_index: Optional[torch.Tensor] = None,
        retrive_next_token: Optional[torch.Tensor] = None,
        retrive_next_sibling: Optional[torch.Tensor] = None,
        target_predict: Optional[torch.Tensor] = None, *,
        retrieve_index: Optional[torch.Tensor] = None,
        retrieve_next_token: Optional[torch.Tensor] = None,
        retrieve_next_sibling: Optional[torch.Tensor] = None,
        validate: Optional[bool] = None) -> None:
    r"""sgl-kernel's ``verify_tree_greedy`` (SGLang's all-greedy verify step): writes
    ``predicts``, ``accept_index`` and ``accept_token_num`` in place, token for token as
    SGLang's ``VerifyTreeGreedy`` kernel does. Pure integer work: no probabilities, no
    randomness, no host synchronisation (``log2 N`` pointer-jumping steps and one gather per
    accepted level; on CPU tensors whose lists are one tree, one C++ op: the same writes).

    From the root, at node ``u``, children are tried in list order (``retrive_next_token``,
    then ``retrive_next_sibling``); the first whose candidate equals
    ``target_predict[retrive_index[b, u]]`` (flat) is accepted and becomes ``u``; at most
    ``num_spec_step - 1`` are. ``predicts`` at each accepted path node's flat index holds the
    next accepted token, and at the last one ``target_predict`` there.

    Args:
        predicts: ``(bs * N,)`` int32 (at least every ``retrive_index``).
        accept_index: ``(bs, num_spec_step)`` int32; entries ``0..accept_token_num[b]`` set.
        accept_token_num: ``(bs,)`` int32.
        candidates, retrive_index, retrive_next_token, retrive_next_sibling: ``(bs, N)``
            int32/int64 (``retrieve_*`` spellings taken as keywords).
        target_predict: ``(bs, N)`` int32/int64, the target's arg-max after each node
            (SGLang: ``argmax(logits, -1).reshape(bs, N)``).
        validate: None (default): list checks only where they cost no synchronisation (CPU
            tensors, eager); True/False force them.

    >>> import torch
    >>> from specdec_kernels.adapters.sglang import verify_tree_greedy
    >>> candidates = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    >>> target_predict = torch.tensor([[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]])
    >>> predicts = torch.full((12,), -1, dtype=torch.int32)
    >>> accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    >>> accept_token_num = torch.zeros(2, dtype=torch.int32)
    >>> verify_tree_greedy(predicts, accept_index, accept_token_num, candidates,
    ...     retrive_index=torch.arange(12).view(2, 6),
    ...     retrive_next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
    ...     retrive_next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
    ...     target_predict=target_predict)
    >>> predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()
    ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])
    """
    retrive_index, retrive_next_token, retrive_next_sibling = _tree_lists(
        retrive_index, retrive_next_token, retrive_next_sibling, retrieve_index,
        retrieve_next_token, retrieve_next_sibling)
    _params.check_tensor(candidates, "candidates", ndim=2, dtypes=_params.INDEX_DTYPES)
    batch, nodes = candidates.shape
    device = candidates.device
    values = value_checks_wanted(validate, device)
    for name, tensor in (("retrive_index", retrive_index), ("target_predict", target_predict)):
        _params.check_tensor(tensor, name, dtypes=_params.INDEX_DTYPES, device=device)
        _params.check_shape(tensor, name, [batch, nodes], "[bs, N] like candidates")
    _check_output_tensors(predicts, accept_index, accept_token_num, batch, device)
    tree = tree_from_sglang(retrive_next_token, retrive_next_sibling, candidates,
                            validate=values)
    if batch == 0:
        return None
    if values and not _cpu.sglang_outputs_ok(retrive_index, predicts.numel(), tree.parents,
                                             nodes + 1):  # (no depth limit here)
        _check_flat_indices(retrive_index, predicts)
    if _cpu.sglang_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                          retrive_next_token, retrive_next_sibling, target_predict):
        return None  # (CPU tensors, one tree: one C++ op, the same writes as below)
    num_spec_step = accept_index.shape[1]
    node = torch.arange(nodes, device=device)
    flat = retrive_index.to(torch.int64).clamp(0, predicts.numel() - 1)
    predicted = target_predict.reshape(-1).to(torch.int64)
    # target_predict is read at flat indices (SGLang's kernel does): clamp into its range.
    at_flat = lambda index: predicted[index.clamp(0, predicted.numel() - 1)]
    parent = tree.parents.clamp(min=0)
    matches = (node > 0) & (tree.parents >= 0) & (
        candidates.to(torch.int64) == at_flat(flat.gather(1, parent)))
    # The accepted child of each node: its first matching child in list order.
    rank = sibling_rank(retrive_next_sibling)
    none = nodes * (nodes + 1)
    key = torch.where(matches, rank * (nodes + 1) + node, none)
    first = torch.full((batch, nodes + 1), none, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, torch.where(matches, tree.parents, nodes), key, "amin")
    chosen = torch.where(first[:, :nodes] < none, first[:, :nodes] % (nodes + 1), -1)
    # Walk from the root: one gather per level, at most num_spec_step - 1 levels.
    current = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    path, tokens = [current], []
    for _ in range(min(num_spec_step, nodes) - 1):
        child = chosen.gather(1, current[:, None])[:, 0]
        alive = alive & (child >= 0)
        current = torch.where(alive, child, current)
        tokens.append(candidates.to(torch.int64).gather(1, current[:, None])[:, 0])
        path.append(torch.where(alive, current, -1))
    accepted = torch.stack(path, 1)                                   # [bs, width], -1 after
    num_accepted = (accepted >= 0).sum(1) - 1
    last_flat = flat.gather(1, current[:, None])[:, 0]
    final = at_flat(last_flat)
    emitted = torch.stack(tokens + [final], 1) if tokens else final[:, None]
    # Token after path step i: the next accepted draft, or target_predict at the last node.
    step = torch.arange(accepted.shape[1], device=device)
    emitted = torch.where(step < num_accepted[:, None], emitted,
                          torch.where(step == num_accepted[:, None], final[:, None], -1))
    _write_path(predicts, accept_index, accept_token_num, retrive_index, accepted,
                emitted, num_accepted, None)


def _tree_lists(retrive_index, retrive_next_token, retrive_next_sibling, retrieve_index,
                retrieve_next_token, retrieve_next_sibling):
    """The ``retrive_*`` lists, from either spelling (exactly one each)."""
    lists = []
    for name, given, alias in (("retrive_index", retrive_index, retrieve_index),
                               ("retrive_next_token", retrive_next_token, retrieve_next_token),
                               ("retrive_next_sibling", retrive_next_sibling,
                                retrieve_next_sibling)):
        if (given is None) == (alias is None):
            raise TypeError(f"{name}: expected exactly one of {name} and "
                            f"{name.replace('retrive', 'retrieve')}, got "
                            + ("both" if given is not None else "neither"))
        lists.append(given if given is not None else alias)
    return lists


def _check_output_tensors(predicts, accept_index, accept_token_num, batch: int, device) -> None:
    for name, out, ndim in (("predicts", predicts, 1), ("accept_index", accept_index, 2),
                            ("accept_token_num", accept_token_num, 1)):
        _params.check_tensor(out, name, ndim=ndim, dtypes=(torch.int32,), device=device)
    _params.check_shape(accept_index, "accept_index", [batch, None], "[bs, num_spec_step]")
    _params.check_shape(accept_token_num, "accept_token_num", [batch], "[bs]")
    if accept_index.shape[1] < 1 or (batch > 0 and predicts.numel() < 1):
        raise ValueError(f"accept_index, predicts: expected at least one column / entry, got "
                         f"shapes {list(accept_index.shape)} and {list(predicts.shape)}")


def _sglang_per_request(value, name: str, batch: int):
    """A sampling parameter as SGLang holds it: ``sampling_info.temperatures`` is
    ``[bs, 1]``, the others ``[bs]``; a ``[bs, 1]`` tensor is taken as ``[bs]``."""
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == 1 \
            and value.shape[0] == batch:
        return value.reshape(batch)
    return value


def _write_path(predicts, accept_index, accept_token_num, retrive_index, accepted_nodes,
                output_token_ids, num_accepted, vocab: Optional[int]) -> None:
    """Path step ``i`` (root first) of the first ``num_spec_step``: its flat index into
    ``accept_index``, the token emitted after it into ``predicts`` (a ``-1`` -- a row with no
    mass -- as ``vocab - 1``, what SGLang's sampling kernel writes). Unused steps repeat step
    0's write, so nothing else changes. (CPU tensors: one C++ op, the same writes.)"""
    if _cpu.sglang_write_path(predicts, accept_index, accept_token_num, retrive_index,
                              accepted_nodes, output_token_ids, num_accepted, vocab):
        return
    num_spec_step = accept_index.shape[1]
    width = min(num_spec_step, accepted_nodes.shape[1])
    device = predicts.device
    accepted = num_accepted.to(torch.int64).clamp(0, num_spec_step - 1)
    used = torch.arange(width, device=device) <= accepted[:, None]
    path = accepted_nodes[:, :width].to(torch.int64).clamp(min=0)
    flat = retrive_index.to(torch.int64).gather(1, path).clamp(0, predicts.numel() - 1)
    tokens = output_token_ids[:, :width].to(torch.int32)
    if vocab is not None:
        tokens = torch.where(tokens < 0, vocab - 1, tokens).to(torch.int32)
    predicts.scatter_(0, torch.where(used, flat, flat[:, :1]).flatten(),
                      torch.where(used, tokens, tokens[:, :1]).flatten())
    accept_index[:, :width] = torch.where(used, flat.to(torch.int32), accept_index[:, :width])
    accept_token_num.copy_(accepted)


def _sglang_relaxed(*args):
    """SGLang's relaxed acceptance (thresholds below 1, lossy): SGLang's own kernel when it
    is importable for these tensors, else :class:`UnsupportedModeError`."""
    engine = _engine_kernel()
    candidates = args[3]
    if engine is None or not isinstance(candidates, torch.Tensor) or not candidates.is_cuda:
        raise UnsupportedModeError(
            "threshold_single, threshold_acc: values below 1.0 are SGLang's relaxed (lossy) "
            "acceptance, which specdec_kernels does not implement (exact acceptance: 1.0); "
            "SGLang's own kernel is not importable here (needs sglang or sgl_kernel on CUDA)")
    return engine(*args)


def _engine_kernel():
    """SGLang's own ``tree_speculative_sampling_target_only`` (0.5.23's JIT kernel, else
    sgl-kernel's), or None; never this adapter (a test shim may alias the modules)."""
    import importlib
    for module, name in (("sglang.kernels.ops.speculative.sampling",
                          "tree_speculative_sampling_target_only"),
                         ("sgl_kernel", "tree_speculative_sampling_target_only")):
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception:  # not installed, or no CUDA build: not importable
            continue
        if fn is not tree_speculative_sampling_target_only:
            return fn
    return None


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


def _check_flat_indices(retrive_index: torch.Tensor, predicts: torch.Tensor) -> None:
    bad_index = (retrive_index < 0) | (retrive_index >= predicts.numel())
    if bool(bad_index.any()):
        b, i = (int(x) for x in bad_index.nonzero()[0])
        raise ValueError(f"retrive_index: expected flat indices into predicts, in "
                         f"[0, {predicts.numel()}), got {int(retrive_index[b, i])} at [{b}, {i}]")


def _check_outputs(retrive_index: torch.Tensor, predicts: torch.Tensor, parents: torch.Tensor,
                   num_spec_step: int) -> None:
    _check_flat_indices(retrive_index, predicts)
    depth = build_tree_attention(parents, validate=False).depth
    if bool(depth.amax() >= num_spec_step):
        raise ValueError(f"accept_index: expected more columns than the tree's depth "
                         f"({int(depth.amax())}: a path of {int(depth.amax()) + 1} nodes), got "
                         f"num_spec_step = {num_spec_step}")
