"""Tree-attention metadata (contract section 5): what an attention kernel needs to verify a
draft tree in one forward pass."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _backend, _ops, _params  # noqa: F401  (_ops registers the ops)
from ._params import INDEX_DTYPES, check_tensor
from .reference.tree_attention import TreeAttention

__all__ = ["TreeAttention", "build_tree_attention"]

PerRequestInt = Union[int, torch.Tensor, None]


def _per_request(value: PerRequestInt, name: str, batch: int, device: torch.device,
                 expected: str) -> Optional[torch.Tensor]:
    """None (the op's default), or ``_params.per_request``'s ``[batch]`` tensor (an int32 or
    int64 tensor keeps its dtype: the extension reads both). ``expected`` says the valid
    values, for a Python int that does not even fit int64."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        check_tensor(value, name, dtypes=INDEX_DTYPES)
        dtype = value.dtype
    else:
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise ValueError(f"{name}: expected {expected}, got {value}")
        dtype = torch.int64
    return _params.per_request(value, name, batch, device, dtype, 0)


def _validate(parents: torch.Tensor, num_nodes: Optional[torch.Tensor],
              prefix_lens: Optional[torch.Tensor]) -> None:
    """Value checks with one synchronisation; a failure raises naming the first bad request."""
    checks = _params.tree_checks(parents, num_nodes)
    if prefix_lens is not None:
        # position_ids = prefix_lens + depth, depth <= N - 1: it must fit int64.
        nodes = parents.shape[1]
        prefix = prefix_lens.to(torch.int64)
        bad_prefix = (prefix < 0) | (prefix > 2**63 - nodes)

        def prefix_error():
            b = _params.first_true(bad_prefix)
            raise ValueError(f"prefix_lens: expected values in [0, 2**63 - {nodes}] (>= 0, "
                             f"position ids fit int64), got {prefix_lens[b].item()} for "
                             f"request {b}")
        checks.append((bad_prefix, prefix_error))
    _params.raise_first_failure(checks)


def build_tree_attention(parents: torch.Tensor, *, num_nodes: PerRequestInt = None,
                         prefix_lens: PerRequestInt = None, backend: str = "auto",
                         validate: bool = True) -> TreeAttention:
    r"""Attention mask, bit-packed mask, depth and position ids of a batch of draft trees.

    Node ``j`` is visible to node ``i`` iff ``j`` is ``i`` or one of its ancestors. Padding
    nodes (``>= num_nodes[b]``) see only themselves (no attention row is empty), have depth 0
    and position id ``prefix_lens[b]``.

    Args:
        parents: the parent of each node: ``parents[b, 0] == -1`` and
            ``0 <= parents[b, i] < i`` for real nodes; padding entries are ignored.
            Shape ``(batch_size, num_nodes)``; int32 or int64.
        num_nodes: int or ``(batch_size,)`` int tensor on ``parents``' device, in ``1..N``:
            nodes ``>= num_nodes[b]`` are padding. Default: every node is real.
        prefix_lens: int or ``(batch_size,)`` int tensor on ``parents``' device, in
            ``[0, 2**63 - N]`` (position ids fit int64): committed tokens before the root (the
            root's position). Default 0.
        backend: ``"auto"`` (the compiled extension when built, else the reference),
            ``"extension"`` or ``"reference"``.
        validate: check the values of ``parents``, ``num_nodes`` and ``prefix_lens`` (one
            device synchronisation). Shapes and dtypes are always checked.

    Returns:
        TreeAttention(mask, packed_mask, depth, position_ids), on ``parents``' device:

        * ``mask``: Shape ``(batch_size, N, N)``; bool.
        * ``packed_mask``: Shape ``(batch_size, N, ceil(N / 32))``; int32. Bit ``j % 32``
          (least significant first) of word ``j // 32`` is ``mask[b, i, j]``.
        * ``depth``: Shape ``(batch_size, N)``; int32, root 0.
        * ``position_ids``: Shape ``(batch_size, N)``; int64, ``prefix_lens + depth``.

    Raises:
        TypeError: an argument of the wrong type or integer dtype.
        ValueError: wrong shapes, a tensor on another device than ``parents`` (nothing is
            copied across devices), or (``validate=True``) parents that are not a tree in
            topological order, ``num_nodes`` outside ``[1, N]``, ``prefix_lens`` outside
            ``[0, 2**63 - N]``; Python ints past int64 whatever ``validate`` says.

    Example:
        >>> import torch
        >>> from specdec_kernels import build_tree_attention
        >>> parents = torch.tensor([[-1, 0, 0, 1]])   # 0 -> {1, 2}, 1 -> 3
        >>> out = build_tree_attention(parents, prefix_lens=torch.tensor([10]))
        >>> out.mask[0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [1, 0, 1, 0],
                [1, 1, 0, 1]], dtype=torch.int32)
        >>> out.packed_mask[0, :, 0].tolist(), out.depth.tolist(), out.position_ids.tolist()
        ([1, 3, 5, 11], [[0, 1, 1, 2]], [[10, 11, 11, 12]])
    """
    check_tensor(parents, "parents", ndim=2, dtypes=INDEX_DTYPES)
    batch, n = parents.shape
    if n < 1:
        raise ValueError(f"parents: expected at least one node (the root), got shape "
                         f"{list(parents.shape)}")
    device = parents.device
    num_nodes = _per_request(num_nodes, "num_nodes", batch, device, f"values in [1, {n}] (N)")
    prefix_lens = _per_request(prefix_lens, "prefix_lens", batch, device,
                               f"values in [0, 2**63 - {n}] (position ids fit int64)")
    if validate:
        _validate(parents, num_nodes, prefix_lens)
    if _backend.use_extension("build_tree_attention", backend, device):
        return TreeAttention(*torch.ops.specdec.build_tree_attention(
            parents.contiguous(), num_nodes, prefix_lens))
    return TreeAttention(*_ops.call("reference_build_tree_attention", parents, num_nodes,
                                    prefix_lens))
