"""Tree verification (``verify_tree``) on EAGLE-like top-k trees of 8, 32 and 64 nodes.

Trees are grown best-first as EAGLE-2 grows them: every node offers its top-4 children with
confidence weights (0.6, 0.2, 0.1, 0.05), and the frontier child with the highest product of
weights along its path is added next. Node tokens are the parent's draft top-k tokens in rank
order (the draft is the target plus noise), so deterministic trees accept often.

Modes: ``deterministic`` (no draft distribution), ``iid`` and ``without_replacement``
(fp32 ``[B, N, V]`` draft probabilities), ``greedy``.
"""
from __future__ import annotations

import heapq

import torch

from ..harness import Case, Impl, Skip, torch_dtype
from . import triton_backend_available

OP = "tree"
SPEEDUP_BASELINE = "reference"  # the speedup column divides this backend's time by ours

CHILD_WEIGHTS = (0.6, 0.2, 0.1, 0.05)

BYTES_FORMULA = (
    "B*N*V*s  (each node's target logits read once) + B*N*4 + B*N*4  (token ids and parents, int32)"
    " + iid/without_replacement: B*N*4 (gathered q) + B*V*4 (at least one fp32 draft row per"
    " request for the final residual; rejected siblings read more, data-dependent and not counted)"
    " + B*N*4*2 + B*4  (output ids, accepted nodes, num_accepted) + B*20 (seed, offset, temperature)")


def eagle_tree(num_nodes: int, weights=CHILD_WEIGHTS) -> tuple[list[int], list[int]]:
    """``(parents, child_rank)`` of a best-first top-k tree with ``num_nodes`` nodes."""
    parents, rank = [-1], [0]
    frontier = [(-w, 0, r) for r, w in enumerate(weights)]  # (-score, parent, rank)
    heapq.heapify(frontier)
    score = [1.0]
    while len(parents) < num_nodes:
        neg, parent, r = heapq.heappop(frontier)
        node = len(parents)
        parents.append(parent)
        rank.append(r)
        score.append(-neg)
        for r2, w in enumerate(weights):
            heapq.heappush(frontier, (-score[node] * w, node, r2))
    return parents, rank


def min_bytes(case: Case) -> int:
    b, n, v = case.params["B"], case.params["N"], case.params["V"]
    s = torch.empty((), dtype=torch_dtype(case.dtype)).element_size()
    total = b * n * v * s + 2 * b * n * 4 + 2 * b * n * 4 + b * 4 + b * 20
    if case.mode in ("iid", "without_replacement"):
        total += b * n * 4 + b * v * 4
    return total


def _case(b, n, v, dtype, mode):
    return Case(OP, {"B": b, "N": n, "V": v}, dtype, mode)


def cases(device: torch.device, preset: str) -> list[Case]:
    if preset == "quick":
        return [_case(2, 8, 1000, "fp32", m) for m in ("deterministic", "iid")]
    if preset == "cpu":
        return [_case(b, n, 32000, "bf16", m) for b in (1, 16) for n in (8, 32)
                for m in ("deterministic", "iid")]
    if preset == "gpu_check":
        return [_case(b, n, 128256, "bf16", "iid") for b in (1, 16, 64) for n in (8, 32, 64)] + \
               [_case(64, 32, 128256, "bf16", m) for m in ("deterministic", "without_replacement")]
    return [_case(b, n, 128256, "bf16", m) for m in ("deterministic", "iid", "without_replacement")
            for b in (1, 16, 64) for n in (8, 32, 64)]


def make_inputs(case: Case, device: torch.device) -> dict:
    b, n, v = case.params["B"], case.params["N"], case.params["V"]
    gen = torch.Generator(device=device).manual_seed(4321)
    parents_list, rank_list = eagle_tree(n)
    parents = torch.tensor(parents_list, dtype=torch.int32, device=device).expand(b, n).contiguous()
    rank = torch.tensor(rank_list, dtype=torch.int64, device=device)
    target = (3 * torch.randn(b, n, v, generator=gen, device=device)).to(torch_dtype(case.dtype))
    draft_logits = target.float() + torch.randn(b, n, v, generator=gen, device=device)
    top = draft_logits.topk(len(CHILD_WEIGHTS), dim=-1).indices  # [B, N, 4]
    parent_idx = parents.clamp(min=0).to(torch.int64)
    tokens = top.gather(1, parent_idx[..., None].expand(b, n, top.shape[-1]))  # parent's top-k
    tokens = tokens.gather(-1, rank.expand(b, n)[..., None])[..., 0].to(torch.int32)
    tokens[:, 0] = 0
    inputs = {"target_logits": target, "tree_token_ids": tokens, "parents": parents,
              "seed": torch.arange(b, dtype=torch.int64, device=device) + 5,
              "offset": torch.zeros(b, dtype=torch.int64, device=device)}
    if case.mode in ("iid", "without_replacement"):
        inputs["draft_probs"] = torch.softmax(draft_logits, dim=-1)
    return inputs


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    if not hasattr(sk, "verify_tree"):
        why = "specdec_kernels.verify_tree does not exist yet (issue 4)"
        return [Skip("triton", why, kind="ours"), Skip("reference", why, kind="ours")]
    temperature = 0.0 if case.mode == "greedy" else 1.0
    sampling = case.mode if case.mode in ("iid", "without_replacement") else "iid"

    def ours(backend):
        def run(x):
            return sk.verify_tree(x["target_logits"], x["tree_token_ids"], x["parents"],
                                  draft_probs=x.get("draft_probs"), draft_sampling=sampling,
                                  temperature=temperature, seed=x["seed"], offset=x["offset"],
                                  backend=backend, validate=False)
        return run
    ok, why = triton_backend_available(device, "tree")
    # A "compiled" variant (torch.compile(fullgraph=True), at B = 1) for the i.i.d. trees.
    compilable = case.mode == "iid"
    impls = [Impl("triton", ours("triton"), graphable=True, compilable=compilable) if ok
             else Skip("triton", why, kind="ours")]
    if device.type == "cpu":  # "auto" on CPU tensors: the C++ path (docs/cpu.md)
        from specdec_kernels import _cpu  # noqa: PLC0415
        impls.append(Impl("cpp", ours("auto"), compilable=compilable) if _cpu.AVAILABLE else
                     Skip("cpp", "specdec_kernels._C not built with the CPU sampling ops",
                          kind="ours"))
    return impls + [Impl("reference", ours("reference"), compilable=compilable)]
