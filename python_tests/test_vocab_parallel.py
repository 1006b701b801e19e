"""Vocabulary-parallel verification (contract section 17) across real processes.

One spawn per world size P = 1, 2, 3, 4 (gloo on 127.0.0.1, a free port, every collective
under a process-group timeout, every child joined with a deadline and killed past it). Each
child runs every case: it holds its shard (uneven cuts, some at multiples of 32, some not,
the last shard padded past the vocabulary), runs the sharded op, runs the unsharded reference
on the whole rows itself, and records both. The parent checks that every rank returned the
same outputs and that they equal the unsharded op's, token for token (a differing request is
allowed only as a float near-tie, counted and bounded; none has been seen), that the bytes
received stay within an ``O(rows x P)`` bound independent of V, and that bad input is the same
ValueError on every rank and a rank that fails does not leave the others blocked.

The law: the sharded ops return the unsharded op's tokens for the same seeds, so their law is
the unsharded op's, which test_chain_exactness.py / test_one_law.py check in float64 and by
chi-square; the equality here (P = 1..4, every parameter) is what carries it over.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 60
FAULT_TIMEOUT_S = 3  # the group of the fault case: a missing rank fails the others this fast
JOIN_TIMEOUT_S = 420
MAX_MISMATCH_RATE = 0.01  # conftest's bound (not imported: the children import this module)
INF = float("inf")


# ---------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------
def _cuts(vocab: int, world: int) -> list[tuple[int, int]]:
    """Uneven (start, width) shards; the last runs past the vocabulary."""
    if world == 1:
        points = [0, vocab]
    elif world == 2:
        points = [0, vocab // 2 + 3, vocab]
    elif world == 3:
        points = [0, min(1024, vocab // 3 * 32 // 32) if vocab > 2048 else 96, 2 * vocab // 3 + 7,
                  vocab]
    else:
        points = [0, vocab // 5, vocab // 2 + 1, 3 * vocab // 4 + 32 - (3 * vocab // 4) % 32,
                  vocab]
    spans = [(a, b - a) for a, b in zip(points, points[1:])]
    start, width = spans[-1]
    spans[-1] = (start, width + 29)  # padding columns
    return spans


def _inputs(gen: torch.Generator, batch: int, k: int, vocab: int, ties: bool):
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2.5
    if ties:
        logits = logits.round()
    logits[0, -1, : vocab // 3] = -INF  # masked logits
    if batch > 3:
        logits[3, 1] = -INF  # a row with no finite logit
    draft_logits = logits[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen)
    draft_logits = torch.where(torch.isfinite(logits[:, :k]), draft_logits, -INF)
    return logits, draft_logits


def _params(gen, batch, variant):
    """Per-request parameter sets, mixed inside a batch."""
    r = lambda *v: torch.tensor([v[i % len(v)] for i in range(batch)])  # noqa: E731
    return [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=r(0.0, 0.7, 1.0, 1.6), top_k=r(0, 3, 40, 0)),
        dict(temperature=0.8, top_p=r(1.0, 0.6, 0.95, 0.3)),
        dict(temperature=r(1.0, 0.9, 0.0, 1.2), min_p=r(0.0, 0.05, 0.3, 0.1)),
        dict(temperature=0.9, top_k=r(50, 7, 0, 1), top_p=r(0.9, 1.0, 0.5, 0.99),
             min_p=r(0.0, 0.02, 0.0, 0.0), return_logprobs="processed"),
        dict(temperature=1.1, top_p=0.8, return_logprobs="raw"),
    ][variant]


def _drafts(gen, kind, params, logits, draft_logits, sk):
    """Draft ids drawn from q (so some drafts are accepted), -1 padding in a few places."""
    batch, rows, vocab = logits.shape
    k = rows - 1
    extra = {}
    if kind == "probs":
        q = torch.softmax(draft_logits, -1).nan_to_num(0.0)
        extra["draft_probs"] = q
    elif kind == "logits":
        q = sk.processed_probs(draft_logits.reshape(batch, k * vocab).view(batch, k, vocab),
                               **{n: v for n, v in params.items()
                                  if n in ("temperature", "top_k", "top_p", "min_p")})
        extra["draft_logits"] = draft_logits
    else:
        q = torch.softmax(logits[:, :k].nan_to_num(-1e30), -1)
    flat = (q.reshape(-1, vocab).nan_to_num(0.0) + 1e-12)
    ids = torch.multinomial(flat, 1, generator=gen).view(batch, k)
    if batch > 2 and k > 2:
        ids[2, 2] = -1  # -1 padding past request 2's num_draft_tokens (2)
    return ids, extra


def _shard(x, start, width, fill):
    from specdec_kernels.vocab_parallel.shards import shard_columns
    return None if x is None else shard_columns(x, start, width, fill)


def _compare(results, name, ref, out, stats, rows):
    ref_tokens = ref[0] if isinstance(ref, tuple) else ref
    results.append(dict(name=name, ref=[t for t in ref if t is not None] if isinstance(
        ref, tuple) else [ref], out=[t for t in out if t is not None] if isinstance(
        out, tuple) else [out], calls=stats.calls, bytes=stats.bytes_received, rows=rows,
        kinds=dict(stats.kinds), requests=ref_tokens.shape[0]))


def _job_equal(rank, world):
    import specdec_kernels as sk
    from specdec_kernels import vocab_parallel as vp
    from specdec_kernels.vocab_parallel.shards import shard_bitmask, even_shards
    results = []
    for vocab in (300, 5000):
        layouts = {"uneven": _cuts(vocab, world), "even64": even_shards(vocab, world, 64)}
        for layout_name, spans in layouts.items():
            if world >= 3 and (layout_name == "even64") == (vocab > 2048):
                continue  # 4 processes share 2 cores: half the layouts at P = 3, 4
            start, width = spans[rank]
            shard = vp.VocabShard(start, vocab)
            for variant in range(7):
                if world >= 3 and variant not in (1, 2, 5, 6):
                    continue  # P = 3, 4: the variants that together hold every parameter
                for kind_index, kind in enumerate(("none", "probs", "logits")):
                    # Every variant meets both methods across the draft kinds (not all
                    # pairs: 4 processes share 2 cores); the packed layout runs with one-hot
                    # drafts and the token rule.
                    methods = ("token", "block")[:1 + variant % 2] if kind == "none" else \
                        (("block", "token")[(variant + kind_index) % 2],)
                    for method in methods:
                        if layout_name == "even64" and kind == "probs":
                            continue
                        case = f"V={vocab} {layout_name} params{variant} {kind} {method}"
                        gen = torch.Generator().manual_seed(hash((vocab, variant)) % 2**31)
                        batch, k = 5, 3
                        logits, dlogits = _inputs(gen, batch, k, vocab, ties=variant == 2)
                        params = _params(gen, batch, variant)
                        ids, extra = _drafts(gen, kind, params, logits, dlogits, sk)
                        bitmask = None
                        if variant in (3, 6):
                            allowed = torch.rand(batch, k + 1, vocab, generator=gen) < 0.7
                            allowed[1, 0] = False  # nothing allowed: -1
                            from specdec_kernels.vocab_parallel.shards import pack_bits
                            bitmask = pack_bits(allowed)
                        common = dict(num_draft_tokens=torch.tensor([3, 0, 2, 1, 3][:batch]),
                                      seed=torch.arange(batch) * 1000003 + variant,
                                      offset=torch.tensor([5, 0, 2**40, 7, 1][:batch]),
                                      method=method, **params)
                        ref = sk.verify_chain(logits, ids, backend="reference",
                                              token_bitmask=bitmask, **extra, **common)
                        sharded = {n: _shard(v, start, width, 0.0 if n == "draft_probs"
                                             else -INF) for n, v in extra.items()}
                        mask = None if bitmask is None else shard_bitmask(
                            bitmask, start, width, vocab)
                        with vp.count_collectives() as stats:
                            out = vp.verify_chain(_shard(logits, start, width, -INF), ids,
                                                  vocab_shard=shard, token_bitmask=mask,
                                                  **sharded, **common)
                        _compare(results, case, tuple(ref), tuple(out), stats,
                                 batch * (2 * k + 1))
                        if kind == "none" and method == "token":
                            _packed_case(results, sk, vp, case, logits, ids, bitmask, mask,
                                         shard, start, width, common)
                _sample_case(results, sk, vp, vocab, variant, shard, start, width)
                if variant in (1, 2, 5, 6):
                    _tree_cases(results, sk, vp, vocab, variant, shard, start, width, world)
    if world == 2:
        _dtype_cases(results, vp, world, rank)
    return results


def _dtype_cases(results, vp, world, rank):
    """float64 rows (the 64-bit threshold search) and bf16 / fp16 logits, against the
    reference's definition itself (the public op takes no float64 logits)."""
    from specdec_kernels import _params
    from specdec_kernels.reference import chain as reference
    vocab, batch, k = 5000, 4, 3
    start, width = _cuts(vocab, world)[rank]
    shard = vp.VocabShard(start, vocab)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(7)
        logits = (torch.randn(batch, k + 1, vocab, generator=gen, dtype=torch.float64) * 2)
        logits = logits.to(dtype)
        q = torch.softmax(torch.randn(batch, k, vocab, generator=gen, dtype=torch.float64), -1)
        q = q if dtype == torch.float64 else q.float()
        ids = torch.multinomial(q.reshape(-1, vocab).float(), 1, generator=gen).view(batch, k)
        for kw in (dict(temperature=1.0, top_k=17), dict(temperature=0.9, top_p=0.85),
                   dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.01)):
            for method in ("token", "block"):
                p = _params.sampling_params(kw.get("temperature"), kw.get("top_k"),
                                            kw.get("top_p"), batch=batch, vocab_size=vocab,
                                            device=torch.device("cpu"), validate=True,
                                            min_p=kw.get("min_p"))
                seed, offset = torch.arange(batch) + 5, torch.full((batch,), 3)
                ref = reference.verify_chain(logits, ids, q, None, torch.full((batch,), k),
                                             p.temperature, p.top_k, p.top_p, seed, offset,
                                             min_p=p.min_p, method=method)
                with vp.count_collectives() as stats:
                    out = vp.verify_chain(_shard(logits, start, width, -INF), ids,
                                          vocab_shard=shard, draft_probs=_shard(q, start, width,
                                                                                0.0),
                                          seed=seed, offset=offset, method=method, **kw)
                _compare(results, f"{dtype} {kw} {method}", tuple(ref[:2]), tuple(out[:2]),
                         stats, batch * (k + 1))
    # A NaN draft probability (validation never reads [.., V] values): the reference's race
    # gives -1 on a row with a NaN weight; the sharded race must too, whichever rank holds it.
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    q[1, 0, 3] = float("nan")
    q[2, 0, vocab - 2] = float("nan")  # on the last shard, where rank 0 holds the other
    logits[1, 0, ids[1, 0]] = logits[2, 0, ids[2, 0]] = -INF  # rejected: the residual races
    seed, offset = torch.arange(batch) + 9, torch.zeros(batch, dtype=torch.int64)
    ref = vp_reference_chain(logits, ids, q, seed, offset)
    with vp.count_collectives() as stats:
        out = vp.verify_chain(_shard(logits, start, width, -INF), ids, vocab_shard=shard,
                              draft_probs=_shard(q, start, width, 0.0), seed=seed,
                              offset=offset, temperature=1.0, validate=False)
    _compare(results, "NaN draft probs", tuple(ref[:2]), tuple(out[:2]), stats, batch * (k + 1))


def vp_reference_chain(logits, ids, q, seed, offset):
    import specdec_kernels as sk
    return sk.verify_chain(logits, ids, draft_probs=q, seed=seed, offset=offset,
                           temperature=1.0, backend="reference", validate=False)


def _tree_cases(results, sk, vp, vocab, variant, shard, start, width, world):
    """Trees: deterministic candidates, i.i.d. and without-replacement children, the token
    walk and traversal, chain-shaped and branching, with duplicate siblings."""
    gen = torch.Generator().manual_seed(100 + variant)
    batch, nodes = 5, 7
    logits = torch.randn(batch, nodes, vocab, generator=gen) * 2.5
    if variant == 2:
        logits = logits.round()
    q = torch.softmax(logits + 0.6 * torch.randn(batch, nodes, vocab, generator=gen), -1)
    parents = torch.full((batch, nodes), 0, dtype=torch.int64)
    parents[:, 0] = -1
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    parents[0, 1:] = torch.arange(nodes - 1)  # request 0: a chain
    ids = torch.zeros(batch, nodes, dtype=torch.int64)
    for i in range(1, nodes):
        ids[:, i] = torch.multinomial(q[torch.arange(batch), parents[:, i]], 1,
                                      generator=gen)[:, 0]
    ids[1, 2] = ids[1, 1] if int(parents[1, 2]) == int(parents[1, 1]) else ids[1, 2]
    params = _params(gen, batch, variant)
    common = dict(seed=torch.arange(batch) + 7 * variant, offset=torch.arange(batch) * 3,
                  num_nodes=torch.tensor([7, 5, 1, 7, 6]), **params)
    modes = [("none", "token"), ("iid", "token"), ("without_replacement", "token"),
             ("iid", "traversal"), ("without_replacement", "traversal")]
    for mode, method in modes[::2] if world == 4 else modes:
        extra = {} if mode == "none" else dict(draft_probs=q, draft_sampling=mode)
        ref = sk.verify_tree(logits, ids, parents, backend="reference", method=method,
                             **extra, **common)
        sharded = {n: _shard(v, start, width, 0.0) if torch.is_tensor(v) else v
                   for n, v in extra.items()}
        with vp.count_collectives() as stats:
            out = vp.verify_tree(_shard(logits, start, width, -INF), ids, parents,
                                 vocab_shard=shard, method=method, **sharded, **common)
        _compare(results, f"tree V={vocab} params{variant} {mode} {method}", tuple(ref),
                 tuple(out), stats, None)


def _packed_case(results, sk, vp, case, logits, ids, bitmask, mask, shard, start, width,
                 common):
    counts = common["num_draft_tokens"]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    rows = [logits[b, : int(counts[b]) + 1] for b in range(len(counts))]
    packed = torch.cat(rows)
    packed_ids = torch.cat([ids[b, : int(counts[b])] for b in range(len(counts))]).clamp(min=0)
    kw = {n: v for n, v in common.items() if n != "num_draft_tokens"}
    packed_mask = None
    if bitmask is not None:
        packed_mask = torch.cat([bitmask[b, : int(counts[b]) + 1] for b in range(len(counts))])
    ref = sk.verify_chain_packed(packed, packed_ids, cu, max_draft_tokens=ids.shape[1],
                                 backend="reference", token_bitmask=packed_mask, **kw)
    from specdec_kernels.vocab_parallel.shards import shard_bitmask
    shard_mask = None if packed_mask is None else shard_bitmask(packed_mask, start, width,
                                                                 shard.vocab_size)
    with vp.count_collectives() as stats:
        out = vp.verify_chain_packed(_shard(packed, start, width, -INF), packed_ids, cu,
                                     max_draft_tokens=ids.shape[1], vocab_shard=shard,
                                     token_bitmask=shard_mask, **kw)
    # The rows processed: the padded layout's B (K+1), not T + B (docs/vocab_parallel.md).
    _compare(results, "packed " + case, tuple(ref), tuple(out), stats,
             len(counts) * (ids.shape[1] + 1))


def _sample_case(results, sk, vp, vocab, variant, shard, start, width):
    gen = torch.Generator().manual_seed(variant + 17)
    batch = 6
    logits = torch.randn(batch, vocab, generator=gen) * 3
    if variant == 2:
        logits = logits.round()
    params = _params(gen, batch, variant)
    common = dict(seed=torch.arange(batch) + 11 * variant, offset=3, **params)
    ref = sk.sample(logits, backend="reference", **common)
    with vp.count_collectives() as stats:
        out = vp.sample(_shard(logits, start, width, -INF), vocab_shard=shard, **common)
    ref = tuple(ref) if isinstance(ref, tuple) else (ref,)
    out = tuple(out) if isinstance(out, tuple) else (out,)
    _compare(results, f"sample V={vocab} params{variant}", ref, out, stats, batch)


def _job_bad(rank, world):
    """Arguments that differ between ranks: the same ValueError on every rank."""
    import specdec_kernels as sk
    from specdec_kernels import vocab_parallel as vp
    vocab, batch, k = 400, 3, 2
    spans = _cuts(vocab, world)
    start, width = spans[rank]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    ids = logits[:, :k].argmax(-1)
    base = dict(temperature=0.7, seed=torch.arange(batch), offset=2)
    last = rank == world - 1
    cases = {
        "batch": lambda: (logits[: batch - 1] if last else logits, ids[: batch - 1] if last
                          else ids, base, vp.VocabShard(start, vocab)),
        "temperature": lambda: (logits, ids, dict(base, temperature=0.5 if last else 0.7),
                                vp.VocabShard(start, vocab)),
        "seed": lambda: (logits, ids, dict(base, seed=torch.arange(batch) + int(last)),
                         vp.VocabShard(start, vocab)),
        "vocab_size": lambda: (logits, ids, base, vp.VocabShard(start, vocab + int(last))),
        "overlap": lambda: (logits, ids, base, vp.VocabShard(start - int(last), vocab)),
        "gap": lambda: (logits, ids, base, vp.VocabShard(start + int(last), vocab)),
        "local error": lambda: (logits, ids.float() if last else ids, base,
                                vp.VocabShard(start, vocab)),
    }
    outcome = {}
    for name, make in cases.items():
        full, draft_ids, kw, shard = make()
        t0 = time.monotonic()
        try:
            vp.verify_chain(_shard(full, shard.start, width, -INF), draft_ids,
                            vocab_shard=shard, **kw)
            outcome[name] = ("no error", "", time.monotonic() - t0)
        except (ValueError, TypeError) as err:
            outcome[name] = (type(err).__name__, str(err), time.monotonic() - t0)
    # seed=None: each rank draws from its own generator; all take the first shard's draw.
    torch.manual_seed(1000 + rank)
    out = vp.verify_chain(_shard(logits, start, width, -INF), ids, vocab_shard=vp.VocabShard(
        start, vocab), temperature=1.0)
    torch.manual_seed(1000)  # rank 0 holds the first shard: its draw is the one used
    ref = sk.verify_chain(logits, ids, temperature=1.0, backend="reference")
    outcome["seed None"] = (out.output_token_ids, torch.equal(out.output_token_ids,
                                                              ref.output_token_ids))
    # A rank that fails before the call: the others fail within the group's timeout.
    import torch.distributed as dist
    group = dist.new_group(timeout=datetime.timedelta(seconds=FAULT_TIMEOUT_S))
    t0 = time.monotonic()
    if last:
        outcome["fault"] = ("skipped the call", "", 0.0)
    else:
        try:
            vp.verify_chain(_shard(logits, start, width, -INF), ids,
                            vocab_shard=vp.VocabShard(start, vocab, group), **base)
            outcome["fault"] = ("no error", "", time.monotonic() - t0)
        except Exception as err:  # gloo's timeout: RuntimeError / DistBackendError
            outcome["fault"] = (type(err).__name__, str(err)[:200], time.monotonic() - t0)
    return outcome


def _entry(rank, world, port, job, outdir):
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        result = globals()[job](rank, world)
    except BaseException:  # noqa: BLE001 -- reported to the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    os._exit(0)  # no teardown collective: a failed peer must not hang this one


# ---------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict = {}


def _results(world: int, job: str) -> list:
    """One spawn per (world, job) for the whole module."""
    if (world, job) not in _RESULTS:
        _RESULTS[world, job] = _spawn(world, job)
    return _RESULTS[world, job]


def _spawn(world: int, job: str) -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, job, outdir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        assert not hung, f"ranks {hung} of {world} still running after {JOIN_TIMEOUT_S} s"
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pt")
            assert os.path.exists(path), f"rank {r} of {world} wrote no result"
            results.append(torch.load(path, weights_only=False))
    for r, res in enumerate(results):
        assert not (isinstance(res, dict) and "error" in res), f"rank {r}:\n{res.get('error')}"
    return results


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-4, rtol=0,
                                                          equal_nan=True))
    return torch.equal(a, b)


def _bytes_bound(rows: int, world: int) -> int:
    """What a call may receive: a few all-gathers of up to 48 float64 numbers per row per
    rank, and at most 8 all-reduces (top-k and top-p searches) of 256 int64 counts per row,
    plus the agreement vector. Nothing grows with the vocabulary."""
    return 8 * (world - 1) * (64 + 48 * rows) + 8 * 2 * 256 * 8 * rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_ops_equal_the_unsharded_op(world):
    results = _results(world, "_job_equal")
    cases = results[0]
    differing_requests = total_requests = 0
    for i, case in enumerate(cases):
        for r in range(1, world):  # every rank: the same outputs
            other = results[r][i]
            assert other["name"] == case["name"]
            assert all(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
                a, b, equal_nan=True, atol=0, rtol=0)) for a, b in zip(case["out"], other["out"])), \
                f"{case['name']}: rank {r} differs from rank 0"
        ref, out = case["ref"], case["out"]
        assert len(ref) == len(out), case["name"]
        tokens_equal = torch.equal(ref[0], out[0])
        rest_equal = all(_same(a, b) for a, b in zip(ref[1:], out[1:]))
        if case["name"] == "NaN draft probs":  # no near-tie here: exactly the reference's
            assert tokens_equal and rest_equal and bool((ref[0][1:3, 0] == -1).all()), \
                (ref, case["out"])
        total_requests += case["requests"]
        if not (tokens_equal and rest_equal):
            differ = (ref[0] != out[0]).reshape(ref[0].shape[0], -1).any(1).sum()
            differing_requests += max(int(differ), 1)
            print(f"near-tie? {case['name']}\nref {ref}\nout {out}")
        if case["rows"] is not None:
            assert case["bytes"] <= _bytes_bound(case["rows"], world), case
        else:  # a tree: a few [B, 2] rounds per node besides the row statistics' rounds
            assert case["bytes"] <= _bytes_bound(5 * 7, world) + 8 * (world - 1) * 5 * 7 * 12, \
                case
    # A mismatch is allowed only as a float near-tie: none is expected at these sizes.
    assert differing_requests <= MAX_MISMATCH_RATE * total_requests, \
        f"{differing_requests} of {total_requests} requests differ"
    print(f"P={world}: {len(cases)} calls, {total_requests} requests, "
          f"{differing_requests} differing")


def test_bytes_do_not_grow_with_the_vocabulary():
    """Same call, V = 5000 and V = 300 (one race group less): bytes differ only by the
    group round; at two multi-group vocabularies they are equal."""
    results = _results(2, "_job_equal")[0]
    by_name = {c["name"]: c for c in results}
    for name, case in by_name.items():
        if "V=5000" in name and not name.startswith("tree"):
            small = by_name[name.replace("V=5000", "V=300")]
            assert small["calls"] <= case["calls"] <= small["calls"] + 1, name
            assert case["bytes"] - small["bytes"] <= 8 * 6 * case["rows"], name


def test_disagreeing_ranks_fail_alike_and_a_failed_rank_blocks_no_one():
    world = 3
    results = _results(world, "_job_bad")
    for name in ("batch", "temperature", "seed", "vocab_size", "overlap", "gap",
                 "local error"):
        kinds = {res[name][0] for res in results}
        messages = {res[name][1] for res in results}
        assert len(kinds) == 1 and kinds.pop() in ("ValueError", "TypeError"), (name, results)
        assert len(messages) == 1, (name, messages)
        message = messages.pop()
        assert "vocab_shard" in message, message
    assert "seed" in results[0]["seed"][1] and "temperature" in results[0]["temperature"][1]
    assert "draft_token_ids" in results[0]["local error"][1]
    for r in range(1, world):  # seed=None: the same tokens on every rank
        assert torch.equal(results[r]["seed None"][0], results[0]["seed None"][0])
    assert all(res["seed None"][1] for res in results)  # = the first shard's draw, unsharded
    for r in range(world - 1):
        kind, message, elapsed = results[r]["fault"]
        assert kind != "no error", message
        assert elapsed < FAULT_TIMEOUT_S + 20, elapsed


def test_a_bad_vocab_shard_is_an_error_naming_it_before_any_collective():
    """In this process (no process group): the shard's own fields, a wrong type, and no
    initialised process group are errors raised before anything is exchanged."""
    import specdec_kernels as sk
    with pytest.raises(ValueError, match="vocab_shard.start"):
        sk.VocabShard(-1, 10)
    with pytest.raises(ValueError, match="vocab_shard.vocab_size"):
        sk.VocabShard(0, 0)
    with pytest.raises(TypeError, match="vocab_shard.start"):
        sk.VocabShard(1.0, 10)
    logits = torch.zeros(2, 3, 8)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="vocab_shard"):
        sk.verify_chain(logits, ids, vocab_shard=(0, 8))
    for call in (lambda: sk.verify_chain(logits, ids, vocab_shard=sk.VocabShard(0, 8)),
                 lambda: sk.sample(logits[:, 0], vocab_shard=sk.VocabShard(0, 8)),
                 lambda: sk.verify_tree(logits, ids.new_zeros(2, 3),
                                        torch.tensor([[-1, 0, 1]] * 2),
                                        vocab_shard=sk.VocabShard(0, 8))):
        with pytest.raises(ValueError, match="torch.distributed is not initialised"):
            call()
