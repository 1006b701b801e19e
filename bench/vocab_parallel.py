"""Vocabulary-parallel verification against all-gather + the unsharded op (docs/vocab_parallel.md).

Spawns P gloo processes on 127.0.0.1 (CPU). Each holds its shard ``[B, K+1, V/P]`` of the
same logits; per call it times (median of ``--iters``, all ranks behind a barrier):
  * sharded: ``verify_chain(shard, vocab_shard=...)`` (summaries only);
  * gather:  ``all_gather`` of the shards, then the unsharded ``verify_chain`` on the rows,
    with ``backend="reference"`` (the same PyTorch arithmetic) and ``"auto"`` (the C++ CPU
    path where built).
and the bytes each rank receives (the sharded op's counted collectives; the gather's
``(P - 1) x rows x W x 4``). ``--model`` adds the bytes of the sharded call at V = 152k,
B = 64, K = 4, P = 8 (measured: they do not depend on V) and the transfer-time model.

    python bench/vocab_parallel.py --world 2 4 --vocab 32000 --batch 8 --k 4
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cfg, outdir):
    import torch.distributed as dist
    import specdec_kernels as sk
    from specdec_kernels import vocab_parallel as vp
    from specdec_kernels.vocab_parallel.shards import even_shards, shard_columns
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    batch, k, vocab = cfg["batch"], cfg["k"], cfg["vocab"]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    ids = (logits[:, :k] + torch.randn(batch, k, vocab, generator=gen)).argmax(-1)
    start, width = even_shards(vocab, world, 64)[rank]
    shard = vp.VocabShard(start, vocab)
    local = shard_columns(logits, start, width, -float("inf"))
    kw = dict(temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"],
              seed=torch.arange(batch), offset=1)

    def sharded():
        return sk.verify_chain(local, ids, vocab_shard=shard, **kw)

    def gathered(backend):
        def call():
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local)
            full = torch.cat(parts, -1)[..., :vocab]
            return sk.verify_chain(full, ids, backend=backend, **kw)
        return call

    result = {}
    timed = [("sharded", sharded)]
    if cfg["time_gather"]:
        timed += [(f"gather_{b}", gathered(b)) for b in ("reference", "auto")]
    for name, fn in timed:
        fn()
        times = []
        for _ in range(cfg["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        result[name] = statistics.median(times) * 1e3
        result[name + "_tokens"] = out.output_token_ids
    with vp.count_collectives() as stats:
        sharded()
    result["sharded_bytes"] = stats.bytes_received
    result["sharded_collectives"] = stats.calls
    result["gather_bytes"] = (world - 1) * local.numel() * local.element_size()
    tokens = result.pop("sharded_tokens")
    result["same_tokens"] = all(bool(torch.equal(tokens, result.pop(f"{name}_tokens")))
                                for name, _ in timed[1:])
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world, _free_port(), cfg, outdir), nprocs=world,
                           join=True, start_method="spawn")
        results = [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(world)]
    keys = [k for k in results[0] if k == "sharded" or k.startswith("gather_") and
            not k.endswith("bytes")]
    worst = {f"{key}_ms": max(r[key] for r in results) for key in keys}  # the slowest rank
    return dict(world=world, **worst,
                sharded_bytes=results[0]["sharded_bytes"],
                sharded_collectives=results[0]["sharded_collectives"],
                gather_bytes=results[0]["gather_bytes"],
                same_tokens=all(r["same_tokens"] for r in results))


# The transfer model (stated assumptions, not measurements): per collective a fixed latency,
# plus bytes over the per-GPU bandwidth an all-gather sees.
LINKS = {"NVLink (H100, ~350 GB/s per GPU, 15 us per collective)": (350e9, 15e-6),
         "InfiniBand (NDR 400 Gb/s = 50 GB/s per GPU, 30 us per collective)": (50e9, 30e-6)}


def model(sharded_bytes: int, collectives: int, rows: int, vocab: int, world: int) -> list:
    gather_bytes = (world - 1) * rows * (-(-vocab // world)) * 2  # bf16 shards
    lines = []
    for link, (bandwidth, latency) in LINKS.items():
        gather = latency + gather_bytes / bandwidth
        shard = collectives * latency + sharded_bytes / bandwidth
        lines.append(dict(link=link, gather_bytes=gather_bytes, sharded_bytes=sharded_bytes,
                          gather_us=gather * 1e6, sharded_us=shard * 1e6))
    return lines


# --- The real model, its LM head split over two processes ------------------------------
REAL_MODES = (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9))
PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n    if n < 2:\n"


def _lookup(context: list, k: int) -> list:
    """Prompt-lookup drafts: the k tokens after the last earlier match of the final two."""
    tail = context[-2:]
    for i in range(len(context) - 3, 0, -1):
        if context[i - 1:i + 1] == tail:
            follow = context[i + 1:i + 1 + k]
            return follow + [context[-1]] * (k - len(follow))
    return [context[-1]] * k


def _generate(step_logits, prompt: list, steps: int, k: int, mode: dict, verify) -> list:
    """Speculative generation: ``step_logits(context, drafts)`` -> ``[1, k+1, width]``;
    ``verify(logits, drafts, offset)`` -> the emitted tokens."""
    context = list(prompt)
    for _ in range(steps):
        drafts = _lookup(context, k)
        context += verify(step_logits(context, drafts), drafts, len(context))
    return context


def _real_rank1(port, head, cfg):
    import torch.distributed as dist
    import specdec_kernels as sk
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1,
                            world_size=2, timeout=datetime.timedelta(seconds=900))
    shard = sk.VocabShard(cfg["start"], cfg["vocab"])
    k, hidden = cfg["k"], head.shape[1]
    for mode in REAL_MODES:
        for _ in range(cfg["steps"]):
            h = torch.empty(k + 1, hidden)
            meta = torch.empty(k + 1, dtype=torch.int64)  # drafts, then the offset
            dist.broadcast(h, 0)
            dist.broadcast(meta, 0)
            sk.verify_chain((h @ head.T)[None], meta[None, :k], vocab_shard=shard, seed=7,
                            offset=int(meta[k]), **mode)
    dist.destroy_process_group()


def real_model_run(steps: int, k: int) -> dict:
    """The embedded model (specdec_kernels.e2e) generates with prompt-lookup speculation,
    its LM head split over this process (rank 0, which runs the transformer and broadcasts
    each step's hidden states) and one more; then unsharded. Tokens must be identical."""
    import torch.distributed as dist
    import specdec_kernels as sk
    from specdec_kernels.e2e.model import load_model
    from specdec_kernels.vocab_parallel.shards import even_shards
    model, tokenizer = load_model()
    head = model.lm_head.weight.detach().float()
    vocab = head.shape[0]
    (start0, width0), (start1, width1) = even_shards(vocab, 2, 64)
    port = _free_port()
    cfg = dict(start=start1, vocab=vocab, k=k, steps=steps)
    ctx = mp.get_context("spawn")
    head1 = torch.nn.functional.pad(head[start1:], (0, 0, 0, start1 + width1 - vocab),
                                    value=0.0)  # padding rows: their logits are ignored
    peer = ctx.Process(target=_real_rank1, args=(port, head1.contiguous(), cfg))
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=2, timeout=datetime.timedelta(seconds=900))
    prompt = tokenizer(PROMPT).input_ids
    shard = sk.VocabShard(start0, vocab)

    def hidden(context, drafts):
        ids = torch.tensor([context + drafts])
        with torch.no_grad():
            return model.model(ids).last_hidden_state[0, -(k + 1):].float().contiguous()

    record = dict(model=model.name_or_path, vocab=vocab, steps=steps, k=k, modes=[])
    for mode in REAL_MODES:
        def sharded_logits(context, drafts):
            h = hidden(context, drafts)
            dist.broadcast(h, 0)
            dist.broadcast(torch.tensor(drafts + [len(context)]), 0)
            return (h @ head[start0:start0 + width0].T)[None]

        def sharded_verify(logits, drafts, offset):
            out = sk.verify_chain(logits, torch.tensor([drafts]), vocab_shard=shard, seed=7,
                                  offset=offset, **mode)
            return out.output_token_ids[0, :int(out.num_accepted[0]) + 1].tolist()

        def full_verify(logits, drafts, offset):
            out = sk.verify_chain(logits, torch.tensor([drafts]), seed=7, offset=offset,
                                  backend="reference", **mode)
            return out.output_token_ids[0, :int(out.num_accepted[0]) + 1].tolist()
        t0 = time.perf_counter()
        sharded = _generate(sharded_logits, prompt, steps, k, mode, sharded_verify)
        t1 = time.perf_counter()
        full = _generate(lambda c, d: (hidden(c, d) @ head.T)[None], prompt, steps, k, mode,
                         full_verify)
        record["modes"].append(dict(mode=mode, identical=sharded == full,
                                    tokens=len(sharded) - len(prompt),
                                    sharded_s=t1 - t0, text=tokenizer.decode(sharded)))
        print(json.dumps(record["modes"][-1]))
    peer.join(120)
    dist.destroy_process_group()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--model", action="store_true",
                        help="also run P = 8, B = 64, K = 4 once for the bytes at V = 152k")
    parser.add_argument("--out", default="")
    parser.add_argument("--real-model", action="store_true",
                        help="only the two-process run of the embedded model (minutes)")
    args = parser.parse_args()
    if args.real_model:
        record = real_model_run(steps=12, k=args.k)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        return
    cfg = dict(batch=args.batch, k=args.k, vocab=args.vocab, iters=args.iters,
               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
               time_gather=True)
    record = dict(machine=f"{platform.processor() or platform.machine()}, "
                          f"{os.cpu_count()} cores (shared, loaded)",
                  torch=torch.__version__, config=cfg, runs=[])
    for world in args.world:
        row = run(world, cfg)
        record["runs"].append(row)
        print(json.dumps(row))
    if args.model:
        # Bytes do not depend on V (the tests assert it); 8 processes share the cores, so
        # only the sharded call runs here.
        big = dict(cfg, batch=64, k=4, vocab=20000, iters=1, time_gather=False)
        row = run(8, big)
        rows = 64 * (4 + 1)
        record["model"] = dict(measured_at=dict(world=8, batch=64, k=4, vocab=20000),
                               sharded_bytes=row["sharded_bytes"],
                               sharded_collectives=row["sharded_collectives"],
                               at_152k=model(row["sharded_bytes"], row["sharded_collectives"],
                                             rows, 152064, 8))
        print(json.dumps(record["model"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
