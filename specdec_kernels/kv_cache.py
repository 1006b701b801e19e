"""KV-cache rollback and compaction after verification (contract section 6).

Before a verify step request ``b`` had ``kv_lens[b]`` committed positions and the verify
forward wrote node ``i``'s K and V at ``kv_lens[b] + i``. These ops move the accepted path
(``accepted_nodes[b, 0..num_accepted[b]]``, root first, as returned by ``verify_tree``) to
``kv_lens[b] + 0..num_accepted[b]`` in every layer's K and V, in place, and return the new
lengths ``kv_lens + num_accepted + 1``.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from . import _backend, _ops, _params  # noqa: F401  (_ops registers the ops)
from ._params import INDEX_DTYPES, check_tensor

__all__ = ["compact_kv_cache", "compact_paged_kv_cache"]

Caches = Union[torch.Tensor, Sequence[torch.Tensor]]
LAYOUTS = ("bshd", "bhsd")


def _check_caches(caches: Caches, *, paged: bool, layout: str) -> list[torch.Tensor]:
    """Shapes, dtypes, devices and strides of the cache list (no synchronisation)."""
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    if not isinstance(caches, (list, tuple)) or not caches:
        raise TypeError(f"caches: expected a tensor or a non-empty list of tensors (every "
                        f"layer's K and V), got {type(caches).__name__}"
                        + (" of length 0" if isinstance(caches, (list, tuple)) else ""))
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"caches[{i}]: expected a torch.Tensor, got {type(cache).__name__}")
    first = caches[0]
    if not first.is_floating_point():
        raise ValueError(f"caches: expected a floating-point dtype (fp32, fp16, bf16, fp8), "
                         f"got {first.dtype}")
    if paged and first.dim() < 3:
        raise ValueError(f"caches: expected [num_blocks, block_size, ...] with at least 3 "
                         f"dimensions, got shape {list(first.shape)}")
    if not paged and first.dim() != 4:
        axes = "[B, S, H, D]" if layout == "bshd" else "[B, H, S, D]"
        raise ValueError(f"caches: expected 4-D {axes} tensors (layout={layout!r}), got shape "
                         f"{list(first.shape)}")
    shape, dtype, device, strides = first.shape, first.dtype, first.device, first.stride()
    for i, cache in enumerate(caches[1:], start=1):
        # One cheap comparison per tensor (this runs on every decode step for every layer);
        # the message is only built on failure.
        if (cache.shape != shape or cache.dtype != dtype or cache.device != device
                or cache.stride() != strides):
            for what, got, expected in (("shape", list(cache.shape), list(shape)),
                                        ("dtype", cache.dtype, dtype),
                                        ("device", cache.device, device),
                                        ("strides", cache.stride(), strides)):
                if got != expected:
                    raise ValueError(f"caches[{i}]: expected the same {what} as caches[0] "
                                     f"({expected}), got {got}")
    # Two tensors sharing an element would have it compacted twice (the moved positions
    # moved again). Addresses only, no synchronisation; not while torch.compile traces (its
    # fake tensors have no addresses). Empty tensors hold nothing.
    if not torch.compiler.is_compiling() and first.numel() > 0 and first.device.type != "meta":
        _check_disjoint(caches)
    if not _position_rows_ok(first, paged=paged, layout=layout):
        raise ValueError(f"caches: expected the elements of a cache position to be contiguous, "
                         f"or rows of a contiguous last dimension, got shape {list(first.shape)} "
                         f"with strides {first.stride()}")
    return list(caches)


def _check_disjoint(caches: Sequence[torch.Tensor]) -> None:
    """No two tensors of ``caches`` (same shape, strides and dtype) share a byte.

    Sorted by address, only neighbours whose storage spans overlap are compared exactly, so
    separate allocations cost one sort; interleaved views (K and V of one ``[.., 2, ..]``
    buffer) have overlapping spans but no common element and are accepted."""
    first = caches[0]
    element = first.element_size()
    dims = [(stride * element, size) for size, stride in zip(first.shape, first.stride())
            if size > 1 and stride != 0]
    span = element + sum((size - 1) * stride for stride, size in dims)
    # A byte offset d is shared iff d = sum c * stride + e with |c| < size and |e| < element:
    # the element's bytes are one more dimension of stride 1.
    dims = sorted(dims + [(1, element)], reverse=True)
    starts = sorted((cache.data_ptr(), i) for i, cache in enumerate(caches))
    for n, (start, i) in enumerate(starts):
        for other, j in starts[n + 1:]:
            if other >= start + span:
                break
            if other == start or _reachable(other - start, dims):
                i, j = min(i, j), max(i, j)
                raise ValueError(f"caches[{j}]: expected distinct tensors, got memory that "
                                 f"overlaps caches[{i}] (it would be compacted twice)")


def _reachable(offset: int, dims: list, budget: int = 4096) -> bool:
    """Whether ``offset = sum c * stride`` with ``|c| < size`` over ``dims`` (largest stride
    first). A depth-first search over the few coefficients that keep the rest reachable; past
    ``budget`` steps (pathological strides) it answers True, the safe side."""
    reach = [0] * (len(dims) + 1)  # reach[k]: the largest |sum| of dims[k:]
    for k in range(len(dims) - 1, -1, -1):
        reach[k] = reach[k + 1] + (dims[k][1] - 1) * dims[k][0]
    steps = 0
    stack = [(0, offset)]
    while stack:
        k, rest = stack.pop()
        if k == len(dims):
            if rest == 0:
                return True
            continue
        stride, size = dims[k]
        low = max(-(size - 1), -((reach[k + 1] - rest) // stride))
        high = min(size - 1, (rest + reach[k + 1]) // stride)
        for c in range(low, high + 1):
            steps += 1
            if steps > budget:
                return True
            stack.append((k + 1, rest - c * stride))
    return False


def _position_rows_ok(cache: torch.Tensor, *, paged: bool, layout: str) -> bool:
    """What the extension can address (csrc/torch/ops.cpp): a position's elements dense, or
    (``[.., H, D]`` trailing, and always for ``"bhsd"``) rows of a contiguous last dimension."""
    if cache.numel() == 0:  # nothing to address (zero-size dimensions get any stride)
        return True
    last_contiguous = cache.stride(-1) == 1 or cache.size(-1) == 1
    if not paged and layout == "bhsd":
        return last_contiguous
    expected, dense = 1, True
    for size, stride in zip(reversed(cache.shape[2:]), reversed(cache.stride()[2:])):
        dense &= size == 1 or stride == expected
        expected *= size
    return dense or (cache.dim() == 4 and last_contiguous)


def _check_indices(kv_lens, accepted_nodes, num_accepted, device: torch.device):
    check_tensor(accepted_nodes, "accepted_nodes", ndim=2, dtypes=INDEX_DTYPES)
    batch, nodes = accepted_nodes.shape
    if nodes < 1:
        raise ValueError(f"accepted_nodes: expected [B, N] with N >= 1 (the root), got shape "
                         f"{list(accepted_nodes.shape)}")
    check_tensor(accepted_nodes, "accepted_nodes", device=device)
    check_tensor(kv_lens, "kv_lens", ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor(num_accepted, "num_accepted", ndim=1, dtypes=INDEX_DTYPES, device=device)
    for name, tensor in (("kv_lens", kv_lens), ("num_accepted", num_accepted)):
        if tensor.shape[0] != batch:
            raise ValueError(f"{name}: expected shape [{batch}] (B = accepted_nodes.shape[0]), "
                             f"got {list(tensor.shape)}")
    return kv_lens.contiguous(), accepted_nodes.contiguous(), num_accepted.contiguous()


def _validate(kv_lens, accepted_nodes, num_accepted, *, seq_len=None, block_tables=None,
              block_size=None, num_blocks=None) -> None:
    """Value checks with one synchronisation, before anything is written."""
    batch, n = accepted_nodes.shape
    device = accepted_nodes.device
    entry = torch.arange(n, device=device)
    nodes = accepted_nodes.to(torch.int64)
    count = num_accepted.to(torch.int64)
    start = kv_lens.to(torch.int64)
    live = entry[None, :] <= count.clamp(0, n - 1)[:, None]  # the path, root included
    last = nodes.gather(1, count.clamp(0, n - 1)[:, None])[:, 0]
    # The last position the path reads; it can pass int64 only where an earlier check fails
    # (kv_lens near 2**63), and capacity - last below cannot (0 <= last < N by then).
    end = start + last
    no = torch.zeros(batch, dtype=torch.bool, device=device)
    bad_len = start < 0
    bad_count = (count < 0) | (count > n - 1)
    bad_root = nodes[:, 0] != 0
    bad_order = ((nodes[:, 1:] <= nodes[:, :-1]) & live[:, 1:]).any(1)
    bad_node = ((nodes >= n) & live).any(1)
    columns = None if block_tables is None else block_tables.shape[1]
    # Positions a new length can count: those of the cache, and no more than kv_lens' dtype
    # holds (kv_lens + num_accepted + 1 <= kv_lens + last + 1 <= capacity: no overflow).
    capacity = min(seq_len if columns is None else columns * block_size,
                   torch.iinfo(kv_lens.dtype).max)
    bad_end = start >= capacity - last
    capacity = torch.full_like(end, capacity)
    if block_tables is None:
        bad_block = no
    else:
        column = torch.arange(columns, device=device)[None, :]
        touched = ((column >= (start // block_size)[:, None])
                   & (column <= (end // block_size)[:, None]))
        table = block_tables.to(torch.int64)
        bad_block = (touched & ((table < 0) | (table >= num_blocks))).any(1)
    checks = [bad_len, bad_count, bad_root, bad_order, bad_node, bad_end, bad_block]
    failed = torch.stack([c.any() for c in checks]).tolist()
    if not any(failed):
        return
    b = _params.first_true(checks[failed.index(True)])
    path = nodes[b, :int(count[b].clamp(0, n - 1).item()) + 1].tolist()
    which = failed.index(True)
    if which == 0:
        raise ValueError(f"kv_lens: expected values >= 0, got {start[b].item()} for request {b}")
    if which == 1:
        raise ValueError(f"num_accepted: expected values in [0, {n - 1}] (N - 1), got "
                         f"{count[b].item()} for request {b}")
    if which == 2:
        raise ValueError(f"accepted_nodes: expected the path to start at the root "
                         f"(accepted_nodes[b, 0] == 0), got {nodes[b, 0].item()} for request {b}")
    if which == 3:
        raise ValueError(f"accepted_nodes: expected each path node strictly after its "
                         f"predecessor (increasing node indices), got path {path} for request {b}")
    if which == 4:
        raise ValueError(f"accepted_nodes: expected node indices < {n} (N), got path {path} for "
                         f"request {b}")
    where = "the cache (S)" if block_tables is None else "the request's block table"
    if which == 5:
        raise ValueError(f"accepted_nodes: request {b}'s path {path} reads position "
                         f"kv_lens + {path[-1]} = {start[b].item() + path[-1]}, past {where}: "
                         f"expected positions < {capacity[b].item()} (new length "
                         f"{start[b].item() + len(path)})")
    column = (torch.arange(block_tables.shape[1], device=device) >= start[b] // block_size) & (
        torch.arange(block_tables.shape[1], device=device) <= end[b] // block_size)
    table = block_tables[b].to(torch.int64)
    bad_column = _params.first_true(column & ((table < 0) | (table >= num_blocks)))
    raise ValueError(f"block_tables: expected block ids in [0, {num_blocks}) (the pool), got "
                     f"block_tables[{b}, {bad_column}] = {table[bad_column].item()}, which holds "
                     f"positions of request {b}'s accepted path")


def compact_kv_cache(caches: Caches, kv_lens: torch.Tensor, accepted_nodes: torch.Tensor,
                     num_accepted: torch.Tensor, *, layout: str = "bshd", backend: str = "auto",
                     validate: bool = True) -> torch.Tensor:
    r"""Move each request's accepted path to the front of its speculative region, in place.

    For every tensor of ``caches`` and request ``b``: position
    ``kv_lens[b] + accepted_nodes[b, k]`` moves to ``kv_lens[b] + k`` for
    ``k = 0..num_accepted[b]``. Overlapping moves are correct; a chain-shaped path
    (``accepted_nodes[b, k] == k``) moves nothing; positions below ``kv_lens[b]`` and other
    requests are never touched. Positions at or past the new length are free afterwards.

    Args:
        caches: every layer's K and V (a tensor or a list), updated in place. All of the same
            shape, dtype, device and strides; any floating-point dtype (fp32, fp16, bf16, fp8).
            Shape ``(batch_size, seq_len, num_heads, head_dim)`` for ``layout="bshd"``,
            ``(batch_size, num_heads, seq_len, head_dim)`` for ``"bhsd"``.
        kv_lens: committed positions before the verify step. Shape ``(batch_size,)``; int32
            or int64.
        accepted_nodes: the accepted path, root first, then any padding (``-1``), as returned
            by ``verify_tree``. Shape ``(batch_size, num_nodes)``; int32 or int64.
        num_accepted: accepted draft nodes (root excluded), in ``0..num_nodes - 1``.
            Shape ``(batch_size,)``; int32 or int64.
        layout: ``"bshd"`` or ``"bhsd"``.
        backend: ``"auto"`` (the compiled extension when built, else the reference),
            ``"extension"`` or ``"reference"``.
        validate: check index values first (one device synchronisation). With ``False`` bad
            entries are skipped by the kernels, never read or written out of bounds.

    Returns:
        new_kv_lens: ``kv_lens + num_accepted + 1``. Shape ``(batch_size,)``; kv_lens' dtype,
        on the caches' device (a new tensor).

    Raises:
        TypeError: caches not tensors, index tensors not int32/int64.
        ValueError: shapes, dtypes or strides that disagree, an index tensor on another
            device than the caches (nothing is copied across devices), an unknown ``layout``,
            and with ``validate=True``: ``num_accepted`` outside ``[0, N - 1]``, a path not
            starting at node 0 or not strictly increasing, a path or new length past the cache.
            Nothing is written when it raises.

    Example:
        >>> import torch
        >>> from specdec_kernels import compact_kv_cache
        >>> cache = torch.arange(8.0).view(1, 8, 1, 1)    # position t holds t
        >>> new_lens = compact_kv_cache([cache], torch.tensor([2]),
        ...                             torch.tensor([[0, 2, 3, -1]]), torch.tensor([2]))
        >>> new_lens.tolist(), cache.flatten()[:5].tolist()
        ([5], [0.0, 1.0, 2.0, 4.0, 5.0])
    """
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected a str, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    caches = _check_caches(caches, paged=False, layout=layout)
    device = caches[0].device
    kv_lens, accepted_nodes, num_accepted = _check_indices(kv_lens, accepted_nodes, num_accepted,
                                                           device)
    batch = accepted_nodes.shape[0]
    if caches[0].shape[0] != batch:
        raise ValueError(f"caches: expected {batch} requests (accepted_nodes.shape[0]) in "
                         f"dimension 0, got shape {list(caches[0].shape)}")
    seq_len = caches[0].shape[1 if layout == "bshd" else 2]
    if validate:
        _validate(kv_lens, accepted_nodes, num_accepted, seq_len=seq_len)
    if _backend.use_extension("compact_kv_cache", backend, device):
        return torch.ops.specdec.compact_kv_cache(caches, kv_lens, accepted_nodes, num_accepted,
                                                  layout)
    return _ops.call("reference_compact_kv_cache", caches, kv_lens, accepted_nodes,
                     num_accepted, layout)


def compact_paged_kv_cache(caches: Caches, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                           accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, *,
                           backend: str = "auto", validate: bool = True) -> torch.Tensor:
    r""":func:`compact_kv_cache` for paged caches.

    Position ``t`` of request ``b`` lives in block ``block_tables[b, t // block_size]`` at
    slot ``t % block_size``. Only blocks holding the request's positions
    ``kv_lens[b] .. kv_lens[b] + accepted_nodes[b, num_accepted[b]]`` are read or written.

    Args:
        caches: every layer's K and V (a tensor or a list), updated in place. All of the same
            shape, dtype, device and strides; any floating-point dtype.
            Shape ``(num_blocks, block_size, ...)`` (e.g. ``(..., num_heads, head_dim)``),
            the elements of one slot contiguous.
        block_tables: each request's blocks. Shape ``(batch_size, max_blocks)``; int32 or
            int64. Entries past a request's positions are ignored (any value).
        kv_lens: Shape ``(batch_size,)``; int32 or int64.
        accepted_nodes: Shape ``(batch_size, num_nodes)``; int32 or int64.
        num_accepted: Shape ``(batch_size,)``; int32 or int64.
        backend, validate: as in :func:`compact_kv_cache`.

    Returns:
        new_kv_lens: ``kv_lens + num_accepted + 1``. Shape ``(batch_size,)``; kv_lens' dtype,
        on the caches' device.

    Raises:
        TypeError, ValueError: as :func:`compact_kv_cache`; also (``validate=True``) a path
        past the request's block table, or a block id outside ``[0, num_blocks)`` where the
        path lies.

    Example:
        >>> import torch
        >>> from specdec_kernels import compact_paged_kv_cache
        >>> cache = torch.zeros(4, 2, 1, 1)                  # 4 blocks of 2 slots
        >>> tables = torch.tensor([[3, 1]])                  # positions 0-1: block 3, 2-3: block 1
        >>> cache[1, 1] = 7.0                                # position 3 holds node 2's K
        >>> compact_paged_kv_cache([cache], tables, torch.tensor([1]),
        ...                        torch.tensor([[0, 2, -1]]), torch.tensor([1])).tolist()
        [3]
        >>> cache[1, 0].item()                               # moved to position 2
        7.0
    """
    caches = _check_caches(caches, paged=True, layout="paged")
    device = caches[0].device
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=INDEX_DTYPES, device=device)
    kv_lens, accepted_nodes, num_accepted = _check_indices(kv_lens, accepted_nodes, num_accepted,
                                                           device)
    batch = accepted_nodes.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected {batch} rows (B = accepted_nodes.shape[0]), got "
                         f"shape {list(block_tables.shape)}")
    block_tables = block_tables.contiguous()
    num_blocks, block_size = caches[0].shape[:2]
    if block_size < 1:
        raise ValueError(f"caches: expected block_size >= 1, got shape {list(caches[0].shape)}")
    if validate:
        _validate(kv_lens, accepted_nodes, num_accepted, block_tables=block_tables,
                  block_size=block_size, num_blocks=num_blocks)
    if _backend.use_extension("compact_paged_kv_cache", backend, device):
        return torch.ops.specdec.compact_paged_kv_cache(caches, block_tables, kv_lens,
                                                        accepted_nodes, num_accepted)
    return _ops.call("reference_compact_paged_kv_cache", caches, block_tables, kv_lens,
                     accepted_nodes, num_accepted)
