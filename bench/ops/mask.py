"""Tree-attention metadata (``build_tree_attention``): dense and bit-packed masks, depth and
position ids for EAGLE-like trees (see ``bench.ops.tree.eagle_tree``)."""
from __future__ import annotations

import math

import torch

from ..harness import Case, Impl, Skip
from . import extension_op
from .tree import eagle_tree

OP = "mask"
SPEEDUP_BASELINE = "reference"  # the speedup column divides this backend's time by ours

BYTES_FORMULA = ("B*N*4 (parents, int32) + B*8 + B*8 (num_nodes, prefix_lens, int64)"
                 " + B*N*N (dense bool mask) + B*N*ceil(N/32)*4 (packed int32 mask)"
                 " + B*N*4 (depth, int32) + B*N*8 (position ids, int64)")


def min_bytes(case: Case) -> int:
    b, n = case.params["B"], case.params["N"]
    return b * n * 4 + 16 * b + b * n * n + b * n * math.ceil(n / 32) * 4 + b * n * 12


def cases(device: torch.device, preset: str) -> list[Case]:
    if preset == "quick":
        return [Case(OP, {"B": b, "N": 16}, "int32") for b in (1, 4)]
    return [Case(OP, {"B": b, "N": n}, "int32") for b in (1, 64, 256) for n in (16, 64, 128)]


def make_inputs(case: Case, device: torch.device) -> dict:
    b, n = case.params["B"], case.params["N"]
    parents, _ = eagle_tree(n)
    gen = torch.Generator().manual_seed(7)
    return {"parents": torch.tensor(parents, dtype=torch.int32).expand(b, n).contiguous().to(device),
            "num_nodes": torch.randint(1, n + 1, (b,), generator=gen).to(device),
            "prefix_lens": torch.randint(0, 4096, (b,), generator=gen).to(device)}


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    ok, why, label = extension_op("build_tree_attention", device)
    if not hasattr(sk, "build_tree_attention"):
        why = "specdec_kernels.build_tree_attention does not exist yet (issue 3)"
        return [Skip(label, why, kind="ours"), Skip("reference", why)]

    def run(backend):
        return lambda x: sk.build_tree_attention(x["parents"], num_nodes=x["num_nodes"],
                                                 prefix_lens=x["prefix_lens"], backend=backend,
                                                 validate=False)
    return [Impl(label, run("extension"), graphable=True) if ok else Skip(label, why, kind="ours"),
            Impl("reference", run("reference"), kind="baseline",
                 note="vectorised torch (specdec_kernels.reference)")]
