"""The C++ CPU path (``backend="auto"`` on CPU tensors) against the reference, side by side:
``verify_chain`` with draft logits, with and without top-p 0.9 or a grammar bitmask
(temperature 1), and ``sample`` rows (mode ``sample``, with top-p 0.9). Inputs and minimal
bytes are the chain op's (``bench/ops/chain.py``, mode ``draft_logits``: every target and draft
logit read once, plus the bitmask words). A ``copy`` row copies the same bytes (the target and
draft logits, the bitmask) in the same run: the C++ path's bandwidth is read against it.
CPU only (on a GPU the rows are skipped: CUDA tensors take the Triton kernels).

``python -m bench.ops.cpu --out DIR`` times the C++ path's instruction-set builds
(baseline, AVX2, AVX-512: those the processor runs) and the copy interleaved, call by call,
at B=16, K=4, V=49152 (the issue-28 target), and writes ``DIR/cpu_isa.json`` with the
machine, its load and the build each row ran.
"""
from __future__ import annotations

import dataclasses

import torch

from ..harness import Case, Impl, Skip, torch_dtype
from . import chain

OP = "cpu"
SPEEDUP_BASELINE = "reference"

BYTES_FORMULA = ("chain modes: " + chain.BYTES_FORMULA + " (mode draft_logits); sample: "
                 "B*V*s + B*24")

MODES = ("draft_logits", "draft_logits_top_p", "draft_logits_bitmask")


def _as_chain(case: Case) -> Case:
    return dataclasses.replace(case, op=chain.OP, mode="draft_logits")


def min_bytes(case: Case) -> int:
    if case.mode == "sample":
        b, v = case.params["B"], case.params["V"]
        return b * v * torch.empty((), dtype=torch_dtype(case.dtype)).element_size() + b * 24
    total = chain.min_bytes(_as_chain(case))
    if case.mode == "draft_logits_bitmask":
        b, k, v = case.params["B"], case.params["K"], case.params["V"]
        total += b * (k + 1) * -(-v // 32) * 4
    return total


def _case(b, v, dtype, mode, skip=()):
    return Case(OP, {"B": b, "K": 4, "V": v}, dtype, mode, tuple(skip))


def cases(device: torch.device, preset: str) -> list[Case]:
    if device.type != "cpu":
        return []
    if preset == "quick":
        return [_case(4, 1000, "fp32", m) for m in MODES]
    # The issue-16 sweep; the reference at B = 64 only at V = 49152 (it takes seconds per call).
    out = [_case(16, 49152, dt, m) for dt in ("bf16", "fp32") for m in MODES]  # the target row
    out += [_case(b, v, dt, m, ("reference",) if b == 64 and v != 49152 else ())
            for b in (1, 16, 64) for v in (32000, 49152, 128256) for dt in ("fp32", "bf16")
            for m in MODES if not (b == 16 and v == 49152)]
    out += [_case(b, 128256, "bf16", "sample") for b in (1, 16)]
    return out


def make_inputs(case: Case, device: torch.device) -> dict:
    inputs = chain.make_inputs(_as_chain(case), device)
    if case.mode == "draft_logits_bitmask":  # about half of the vocabulary allowed
        b, k, v = case.params["B"], case.params["K"], case.params["V"]
        gen = torch.Generator().manual_seed(28)
        inputs["token_bitmask"] = torch.randint(-2**31, 2**31 - 1, (b, k + 1, -(-v // 32)),
                                                generator=gen, dtype=torch.int32).to(device)
    return inputs


def _copied(x: dict) -> list:
    """The tensors a call reads in full (what the ``copy`` row copies)."""
    return [x[name] for name in ("target_logits", "draft_logits", "token_bitmask") if name in x]


def copy_impl(inputs: dict):
    """A copy of the same bytes, into buffers allocated once."""
    sources = _copied(inputs)
    targets = [torch.empty_like(t) for t in sources]

    def run(x):
        for dst, src in zip(targets, _copied(x)):
            dst.copy_(src)
    return run


def implementations(case: Case, device: torch.device) -> list:
    import specdec_kernels as sk  # noqa: PLC0415
    from specdec_kernels import _cpu  # noqa: PLC0415
    filters = dict(top_p=0.9) if case.mode in ("draft_logits_top_p", "sample") else {}

    def ours(backend):
        masked = case.mode == "draft_logits_bitmask"
        if case.mode == "sample":
            return lambda x: sk.sample(x["target_logits"][:, 0], temperature=1.0, seed=x["seed"],
                                       offset=x["offset"], backend=backend, validate=False,
                                       **filters)
        return lambda x: sk.verify_chain(
            x["target_logits"], x["draft_token_ids"], draft_logits=x["draft_logits"],
            temperature=1.0, seed=x["seed"], offset=x["offset"], backend=backend,
            validate=False, token_bitmask=x["token_bitmask"] if masked else None, **filters)
    isa = _cpu.isa() if hasattr(_cpu, "isa") else "default"
    cpp = Impl("cpp", ours("auto"), note=f"isa {isa}") if _cpu.AVAILABLE else \
        Skip("cpp", "specdec_kernels._C not built with the CPU sampling ops", kind="ours")
    impls = [cpp, Impl("reference", ours("reference"))]
    if case.mode != "sample":
        impls.append(Impl("copy", lambda x, _run={}: _run.setdefault("fn", copy_impl(x))(x),
                          kind="baseline", note="copy of the same bytes"))
    return impls


def interleaved(modes=MODES, dtypes=("fp32", "bf16"), rounds: int = 40, isas=None) -> dict:
    """Per (dtype, mode): the median time of each build of the C++ path and of the copy of
    the same bytes, timed one call each in turn (round-robin, so that load changes hit all
    alike), with their ratio: the path's bandwidth as a share of the copy's."""
    import os  # noqa: PLC0415
    import platform  # noqa: PLC0415
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    from specdec_kernels import _cpu  # noqa: PLC0415
    from ..harness import device_name, git_commit  # noqa: PLC0415
    if hasattr(_cpu, "set_isa"):
        isas = [i for i in (isas or _cpu.ISAS) if _cpu.isa_supported(i)]
        chosen = _cpu.isa()
        select = _cpu.set_isa
    else:  # a build from before issue 28 (one dispatched build, not selectable)
        isas, chosen, select = ["default"], "default", lambda name: None
    results = []
    for dtype in dtypes:
        for mode in modes:
            case = _case(16, 49152, dtype, mode)
            x = make_inputs(case, torch.device("cpu"))
            run = {impl.backend: impl.fn for impl in implementations(case, torch.device("cpu"))}
            times = {name: [] for name in isas + ["copy"]}
            for name in times:  # warm-up (and the copy's buffers)
                if name != "copy":
                    select(name)
                (run["copy"] if name == "copy" else run["cpp"])(x)
            for _ in range(rounds):
                for name in times:
                    if name != "copy":
                        select(name)
                    start = time.perf_counter()
                    (run["copy"] if name == "copy" else run["cpp"])(x)
                    times[name].append(time.perf_counter() - start)
            copy_s = statistics.median(times["copy"])
            nbytes = min_bytes(case)
            row = {"dtype": dtype, "mode": mode, "B": 16, "K": 4, "V": 49152,
                   "min_bytes": nbytes, "copy_ms": round(copy_s * 1e3, 3),
                   "copy_gbps": round(2 * nbytes / copy_s / 1e9, 2)}
            for name in isas:
                t = statistics.median(times[name])
                row[f"{name}_ms"] = round(t * 1e3, 3)
                row[f"{name}_gbps"] = round(nbytes / t / 1e9, 2)
                row[f"{name}_pct_copy"] = round(100 * copy_s / (2 * t), 1)
            results.append(row)
    select(chosen)
    commit, dirty = git_commit()
    return {"device_name": device_name(torch.device("cpu")), "machine": platform.machine(),
            "cpu_isa_default": chosen, "isas": isas, "threads": torch.get_num_threads(),
            "load_average_after": os.getloadavg(), "git_commit": commit, "git_dirty": dirty,
            "rounds": rounds, "pct_copy": "copy time / (2 x call time): the call's bytes per "
            "second over the copy's read + write bytes per second", "rows": results}


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m bench.ops.cpu", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stem", default="cpu_isa")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isas", default="", help="comma-separated subset of baseline,avx2,avx512")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    result = interleaved(rounds=args.rounds,
                         isas=[i for i in args.isas.split(",") if i] or None)
    result["load_average_before"] = load_before
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
