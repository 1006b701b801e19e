"""KV-cache compaction after tree verification: 32 layers x (K, V), H=8, D=128.

Each request verified an EAGLE-like tree of 64 nodes written at ``kv_lens[b] + i``; its
accepted path (root to a random node, so depth 1..6) moves to ``kv_lens[b] + 0..``. Modes are
the cache layouts: ``bshd``, ``bhsd`` and ``paged`` (blocks of 16 positions, shuffled block
tables). The caches are updated in place; repeated calls repeat the same moves.
"""
from __future__ import annotations

import torch

from ..bench_extension import root_paths
from ..harness import Case, Impl, Skip, torch_dtype
from . import extension_op
from .tree import eagle_tree

OP = "compact"
SPEEDUP_BASELINE = "reference"  # the speedup column divides this backend's time by ours

LAYERS, HEADS, HEAD_DIM, TREE_NODES, BLOCK_SIZE = 32, 8, 128, 64, 16

BYTES_FORMULA = (
    "2 * moved * (2*L) * H*D*s  (read and write each moved position of every layer's K and V;"
    " moved = accepted path positions i >= 1 whose node != i, counted from the data)"
    " + B*8 + B*N*4 + B*4 + B*8  (kv_lens, accepted_nodes, num_accepted read; new lengths written)")


def _paths(batch: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """``accepted_nodes [B, N]`` (root first, then -1) and ``num_accepted [B]``."""
    parents, _ = eagle_tree(TREE_NODES)
    gen = torch.Generator().manual_seed(seed)
    ends = torch.randint(1, TREE_NODES, (batch,), generator=gen).tolist()
    return root_paths([parents] * batch, ends, TREE_NODES)


def moved_positions(accepted: torch.Tensor, num: torch.Tensor) -> int:
    index = torch.arange(accepted.shape[1])
    live = (index >= 1) & (index <= num[:, None].to(torch.int64))
    return int((live & (accepted != index)).sum())


def min_bytes(case: Case) -> int:
    b = case.params["B"]
    s = torch.empty((), dtype=torch_dtype(case.dtype)).element_size()
    moved = moved_positions(*_paths(b))
    return 2 * moved * 2 * case.params["L"] * HEADS * HEAD_DIM * s + b * (8 + TREE_NODES * 4 + 4 + 8)


def cases(device: torch.device, preset: str) -> list[Case]:
    def case(b, prefix, mode, layers=LAYERS):
        return Case(OP, {"B": b, "L": layers, "S": prefix + TREE_NODES}, "bf16", mode)
    if preset == "quick":
        return [case(2, 16, "bshd", layers=2), case(2, 16, "paged", layers=2)]
    if preset == "cpu":
        return [case(b, 256, m) for b in (1, 64) for m in ("bshd", "bhsd", "paged")]
    prefix = 1024 if preset == "gpu_check" else 4096
    return [case(b, prefix, m) for b in (1, 64) for m in ("bshd", "bhsd", "paged")]


def make_inputs(case: Case, device: torch.device) -> dict:
    b, layers, seq = case.params["B"], case.params["L"], case.params["S"]
    prefix = seq - TREE_NODES
    dtype = torch_dtype(case.dtype)
    accepted, num = _paths(b)
    kv_lens = torch.full((b,), prefix, dtype=torch.int64)
    inputs = {"kv_lens": kv_lens.to(device), "accepted_nodes": accepted.to(device),
              "num_accepted": num.to(device)}
    if case.mode == "paged":
        blocks_per_request = -(-seq // BLOCK_SIZE)
        gen = torch.Generator().manual_seed(3)
        pool = torch.randperm(b * blocks_per_request, generator=gen).to(torch.int32)
        inputs["block_tables"] = pool.view(b, blocks_per_request).to(device)
        shape = (b * blocks_per_request, BLOCK_SIZE, HEADS, HEAD_DIM)
    elif case.mode == "bhsd":
        shape = (b, HEADS, seq, HEAD_DIM)
    else:
        shape = (b, seq, HEADS, HEAD_DIM)
    # Uninitialised memory is fine for timing moves; empty() keeps setup fast on CPU.
    inputs["caches"] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 * layers)]
    return inputs


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    paged = case.mode == "paged"
    op_name = "compact_paged_kv_cache" if paged else "compact_kv_cache"
    ok, why, label = extension_op(op_name, device)
    if not hasattr(sk, op_name):
        why = f"specdec_kernels.{op_name} does not exist yet (issue 3)"
        return [Skip(label, why, kind="ours"), Skip("reference", why)]
    op = getattr(sk, op_name)

    def run(backend):
        if paged:
            return lambda x: op(x["caches"], x["block_tables"], x["kv_lens"], x["accepted_nodes"],
                                x["num_accepted"], backend=backend, validate=False)
        return lambda x: op(x["caches"], x["kv_lens"], x["accepted_nodes"], x["num_accepted"],
                            layout=case.mode, backend=backend, validate=False)
    return [Impl(label, run("extension"), graphable=True) if ok else Skip(label, why, kind="ours"),
            Impl("reference", run("reference"), kind="baseline",
                 note="vectorised torch (specdec_kernels.reference)")]
