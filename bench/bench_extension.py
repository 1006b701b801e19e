"""C++ extension against the vectorised PyTorch reference, on this machine's CPU (or a GPU).

    python -m bench.bench_extension [--device cpu] [--threads 1] [--json out.json]

Mask building (``build_tree_attention``): B in {1, 64, 256}, N in {16, 64, 128}, random
trees. Compaction: 32 layers x (K, V) = 64 cache tensors, H=8, D=128, bf16, B in {1, 64},
layouts bshd / bhsd / paged (blocks of 16), 64-node trees written after a 192-token prefix
(S = 256; 2.1 GB of caches at B = 64), paths to a random node. Both sides are called as ops
(``torch.ops.specdec.*`` and ``specdec_kernels.reference.*``), without Python validation.
Times are medians of ``repeats`` calls after ``warmup`` calls (``time.perf_counter``; on CUDA
with a synchronisation around each call).

``bench_tree_attention`` and ``bench_compaction`` return lists of rows
``{op, backend, B, N, ..., time_us, bytes}``; ``bytes`` is the minimum traffic the op must
cause (see ``_tree_bytes`` / ``_compaction_bytes``), so ``bytes / time_us`` is an effective
bandwidth in MB/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Iterable

import torch

from specdec_kernels import _extension
from specdec_kernels.reference import kv_cache as kv_reference
from specdec_kernels.reference import tree_attention as tree_reference

LAYERS, HEADS, HEAD_DIM, NODES, PREFIX, BLOCK = 32, 8, 128, 64, 192, 16


def _time_us(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _backends(op: str, device: torch.device, backends: Iterable[str]) -> list[str]:
    return [b for b in backends if b == "reference" or _extension.KERNELS.get((op, device.type))]


def random_parents(batch: int, nodes: int, seed: int = 0) -> torch.Tensor:
    """int32 ``[batch, nodes]``: node i's parent uniform in ``[0, i)`` (depth ~ ln N)."""
    gen = torch.Generator().manual_seed(seed)
    parents = (torch.rand(batch, nodes, generator=gen) * torch.arange(nodes)).to(torch.int32)
    parents[:, 0] = -1
    return parents


def _tree_bytes(batch: int, nodes: int) -> int:
    # parents + prefix_lens read; mask, packed mask, depth (int32), position ids (int64) written.
    return batch * nodes * 4 + batch * 8 + batch * nodes * nodes + \
        batch * nodes * ((nodes + 31) // 32) * 4 + batch * nodes * 12


def bench_tree_attention(batch_sizes=(1, 64, 256), node_counts=(16, 64, 128),
                         backends=("extension", "reference"), device="cpu", warmup=3,
                         repeats=20) -> list[dict]:
    device = torch.device(device)
    rows = []
    for batch in batch_sizes:
        for nodes in node_counts:
            parents = random_parents(batch, nodes, seed=batch + nodes).to(device)
            prefix_lens = torch.randint(0, 4096, (batch,)).to(device)
            calls = {
                "extension": lambda: torch.ops.specdec.build_tree_attention(parents, None,
                                                                            prefix_lens),
                "reference": lambda: tree_reference.build_tree_attention(
                    parents, prefix_lens=prefix_lens),
            }
            for backend in _backends("build_tree_attention", device, backends):
                rows.append({"op": "build_tree_attention", "backend": backend,
                             "device": device.type, "B": batch, "N": nodes,
                             "time_us": _time_us(calls[backend], device, warmup, repeats),
                             "bytes": _tree_bytes(batch, nodes)})
    return rows


def root_paths(parents, ends, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-first paths to ``ends[b]`` in the tree ``parents[b]`` (lists of parent indices,
    -1 at the root): ``accepted_nodes`` int32 ``[B, nodes]`` padded with -1 and
    ``num_accepted`` int32 ``[B]``, as ``verify_tree`` returns them."""
    accepted = torch.full((len(ends), nodes), -1, dtype=torch.int32)
    num_accepted = torch.zeros(len(ends), dtype=torch.int32)
    for b, node in enumerate(ends):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[b][node]
        accepted[b, :len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        num_accepted[b] = len(path) - 1
    return accepted, num_accepted


def random_paths(batch: int, nodes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-first paths to a random node of a random tree: int32 ``[B, N]`` and ``[B]``."""
    parents = random_parents(batch, nodes, seed).tolist()
    gen = torch.Generator().manual_seed(seed + 1)
    ends = torch.randint(0, nodes, (batch,), generator=gen).tolist()
    return root_paths(parents, ends, nodes)


def _compaction_bytes(accepted: torch.Tensor, num_accepted: torch.Tensor, tensors: int,
                      position_bytes: int) -> int:
    # Every moved position is read and written in every tensor; index tensors are read.
    entry = torch.arange(accepted.shape[1])
    moved = int(((entry >= 1) & (entry <= num_accepted[:, None].long())
                 & (accepted != entry)).sum())
    batch = accepted.shape[0]
    return 2 * moved * tensors * position_bytes + batch * (8 + accepted.shape[1] * 4 + 4 + 8)


def bench_compaction(batch_sizes=(1, 64), layouts=("bshd", "bhsd", "paged"),
                     backends=("extension", "reference"), device="cpu", layers=LAYERS,
                     dtype=torch.bfloat16, warmup=3, repeats=20) -> list[dict]:
    device = torch.device(device)
    rows = []
    seq = PREFIX + NODES
    for batch in batch_sizes:
        accepted, num_accepted = random_paths(batch, NODES, seed=batch)
        kv_lens = torch.full((batch,), PREFIX, dtype=torch.int64)
        nbytes = _compaction_bytes(accepted, num_accepted, 2 * layers,
                                   HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size())
        accepted, num_accepted, kv_lens = (t.to(device) for t in (accepted, num_accepted, kv_lens))
        for layout in layouts:
            if layout == "paged":
                blocks = -(-seq // BLOCK)
                tables = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
                tables = tables.to(device)
                shape = (batch * blocks, BLOCK, HEADS, HEAD_DIM)
            else:
                shape = (batch, seq, HEADS, HEAD_DIM) if layout == "bshd" else \
                    (batch, HEADS, seq, HEAD_DIM)
            # Written once: reads of never-touched pages would hit the kernel's shared zero
            # page and flatter the CPU numbers.
            caches = [torch.empty(shape, dtype=dtype, device=device).fill_(1.0)
                      for _ in range(2 * layers)]
            if layout == "paged":
                calls = {
                    "extension": lambda: torch.ops.specdec.compact_paged_kv_cache(
                        caches, tables, kv_lens, accepted, num_accepted),
                    "reference": lambda: kv_reference.compact_paged_kv_cache(
                        caches, tables, kv_lens, accepted, num_accepted),
                }
                op = "compact_paged_kv_cache"
            else:
                calls = {
                    "extension": lambda: torch.ops.specdec.compact_kv_cache(
                        caches, kv_lens, accepted, num_accepted, layout),
                    "reference": lambda: kv_reference.compact_kv_cache(
                        caches, kv_lens, accepted, num_accepted, layout=layout),
                }
                op = "compact_kv_cache"
            for backend in _backends(op, device, backends):
                rows.append({"op": op, "backend": backend, "device": device.type,
                             "layout": layout, "B": batch, "L": layers, "S": seq,
                             "H": HEADS, "D": HEAD_DIM, "dtype": str(dtype).replace("torch.", ""),
                             "time_us": _time_us(calls[backend], device, warmup, repeats),
                             "bytes": nbytes})
            del caches
    return rows


def _table(rows: list[dict], keys: list[str]) -> str:
    """Markdown: one line per shape, extension and reference times and the speedup."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), {})[row["backend"]] = row
    lines = ["| " + " | ".join(keys) + " | extension (us) | reference (us) | speedup | "
             "extension GB/s |", "|" + "---|" * (len(keys) + 4)]
    for key, by_backend in groups.items():
        ext, ref = by_backend.get("extension"), by_backend.get("reference")
        cells = [str(k) for k in key]
        cells.append(f"{ext['time_us']:.1f}" if ext else "-")
        cells.append(f"{ref['time_us']:.1f}" if ref else "-")
        cells.append(f"{ref['time_us'] / ext['time_us']:.1f}x" if ext and ref else "-")
        cells.append(f"{ext['bytes'] / ext['time_us'] / 1e3:.2f}" if ext else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the CPU run (default: torch's choice)")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"extension built: {_extension.HAS_EXTENSION}")
    tree_rows = bench_tree_attention(device=args.device, repeats=args.repeats)
    print("\nbuild_tree_attention\n" + _table(tree_rows, ["B", "N"]))
    compaction_rows = bench_compaction(device=args.device, repeats=args.repeats)
    print("\ncompaction (64 tensors, H=8, D=128, bf16, S=256)\n"
          + _table(compaction_rows, ["layout", "B"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tree_rows + compaction_rows, f, indent=1)


if __name__ == "__main__":
    main()
