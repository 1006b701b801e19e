"""A short run of every GPU op at small shapes, compared with the reference path.

``bench/gpu_check.sh`` runs it under ``compute-sanitizer`` (memcheck), where a stray read or
write in a Triton kernel or the CUDA extension shows up; it also prints how many tokens differ
from the reference (the contract allows near-tie differences only). Exit status 1 when an op
raises or an exact op (masks, compaction, greedy tokens) disagrees.

    python bench/cuda_smoke.py [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import sys
import traceback

import torch


def _check(name: str, fn, failures: list) -> None:
    try:
        message = fn()
        print(f"ok   {name}: {message}")
    except Exception as exc:  # noqa: BLE001 -- report every op, then fail at the end
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    import specdec_kernels as sk

    kernel_backend = "triton" if device.type == "cuda" else "reference"
    gen = torch.Generator(device=device).manual_seed(0)
    failures: list = []
    batch, k, vocab = 8, 3, 1003  # V not a power of two: masked tails
    logits = (3 * torch.randn(batch, k + 1, vocab, generator=gen, device=device)).to(torch.bfloat16)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen, device=device), -1)
    drafts = logits[:, :k].float().argmax(-1).to(torch.int32)
    seed = torch.arange(batch, dtype=torch.int64, device=device)
    offset = torch.zeros(batch, dtype=torch.int64, device=device)

    def chain(mode):
        def run():
            kw = {"draft_probs": draft_probs} if mode == "draft_probs" else {}
            temperature = 0.0 if mode == "greedy" else 1.0
            got = sk.verify_chain(logits, drafts, temperature=temperature, seed=seed, offset=offset,
                                  backend=kernel_backend, **kw)
            ref = sk.verify_chain(logits, drafts, temperature=temperature, seed=seed, offset=offset,
                                  backend="reference", **kw)
            torch.cuda.synchronize() if device.type == "cuda" else None
            differ = int((got.output_token_ids != ref.output_token_ids).any(-1).sum())
            if mode == "greedy" and differ:
                raise AssertionError(f"greedy tokens differ from the reference in {differ} rows")
            return f"{differ}/{batch} requests differ from the reference"
        return run

    for mode in ("greedy", "onehot", "draft_probs"):
        _check(f"verify_chain[{kernel_backend},{mode}]", chain(mode), failures)

    def sample():
        got = sk.sample(logits[:, 0], seed=seed, offset=offset, backend=kernel_backend)
        ref = sk.sample(logits[:, 0], seed=seed, offset=offset, backend="reference")
        return f"{int((got != ref).sum())}/{batch} tokens differ from the reference"
    _check(f"sample[{kernel_backend}]", sample, failures)

    if hasattr(sk, "verify_tree"):
        from bench.ops.tree import eagle_tree
        parents = torch.tensor(eagle_tree(16)[0], dtype=torch.int32, device=device).expand(batch, 16)
        tokens = torch.randint(0, vocab, (batch, 16), generator=gen, device=device, dtype=torch.int32)
        tree_logits = torch.randn(batch, 16, vocab, generator=gen, device=device)
        tree_q = torch.softmax(torch.randn(batch, 16, vocab, generator=gen, device=device), -1)
        has_triton_tree = device.type == "cuda"
        try:
            import specdec_kernels.triton.tree  # noqa: F401
        except ImportError:
            has_triton_tree = False

        def tree():
            backend = "triton" if has_triton_tree else "reference"
            got = sk.verify_tree(tree_logits, tokens, parents.contiguous(), draft_probs=tree_q,
                                 seed=seed, offset=offset, backend=backend)
            ref = sk.verify_tree(tree_logits, tokens, parents.contiguous(), draft_probs=tree_q,
                                 seed=seed, offset=offset, backend="reference")
            differ = int((got.output_token_ids != ref.output_token_ids).any(-1).sum())
            return f"backend {backend}: {differ}/{batch} requests differ from the reference"
        _check("verify_tree", tree, failures)

    if hasattr(sk, "build_tree_attention"):
        from bench.ops.tree import eagle_tree

        def mask():
            parents = torch.tensor(eagle_tree(40)[0], dtype=torch.int32, device=device).expand(3, 40)
            num = torch.tensor([40, 17, 1], device=device)
            got = sk.build_tree_attention(parents.contiguous(), num_nodes=num, prefix_lens=5)
            ref = sk.build_tree_attention(parents.contiguous(), num_nodes=num, prefix_lens=5,
                                          backend="reference")
            for a, b, name in zip(got, ref, got._fields):
                if not torch.equal(a, b):
                    raise AssertionError(f"{name} differs from the reference")
            return "mask, packed_mask, depth, position_ids equal the reference"
        _check("build_tree_attention", mask, failures)

    if hasattr(sk, "compact_kv_cache"):
        from bench.ops.compact import _paths

        def compact():
            accepted, num = (t.to(device) for t in _paths(4))
            kv_lens = torch.tensor([3, 0, 10, 7], dtype=torch.int64, device=device)
            caches = [torch.randn(4, 80, 2, 64, generator=gen, device=device).to(torch.bfloat16)
                      for _ in range(3)]
            mirror = [c.clone() for c in caches]
            new = sk.compact_kv_cache(caches, kv_lens, accepted, num)
            new_ref = sk.compact_kv_cache(mirror, kv_lens, accepted, num, backend="reference")
            if not torch.equal(new, new_ref):
                raise AssertionError("new lengths differ from the reference")
            for c, m in zip(caches, mirror):
                for b in range(4):  # committed region: positions below the new length
                    if not torch.equal(c[b, :int(new[b])], m[b, :int(new[b])]):
                        raise AssertionError(f"request {b}: committed cache differs")
            return "committed positions equal the reference"
        _check("compact_kv_cache", compact, failures)

    print(f"{len(failures)} failure(s)" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
