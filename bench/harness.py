"""Timing, environment capture and result rows shared by every op benchmark.

GPU timing follows ``triton.testing.do_bench``: warm up, then take the median of many timed
samples measured with CUDA events. Two things differ, both so that the cache never flatters
a memory-bound kernel:

* inputs rotate: each op module builds one input set, and the harness clones it until the
  copies together exceed twice the L2 (H200: 50-60 MB), so consecutive calls read memory
  that the previous call did not leave in L2. One timed sample is one pass over all copies;
  the per-call time is the sample divided by the number of copies.
* a CUDA-graph variant captures one pass over the copies and replays it: for small batches it
  shows the kernel time without Python and launch overhead, which is what an engine that
  captures its decode step sees.

CPU timing is ``time.perf_counter`` around single calls (median after warm-up); the inputs
are not rotated because the CPU ops here are compute-bound.

Every run also measures the copy bandwidth of its device (a large device-to-device copy,
counting bytes read plus bytes written) so "% of copy bandwidth" compares with the same
machine in the same run.

Importing this module imports torch and nothing CUDA-specific; the GPU is first touched by
:func:`environment` or a timing function called with a CUDA device.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

# ---------------------------------------------------------------------------------------------
# What an op module hands the harness
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One point of a sweep: an op at one shape, dtype and mode."""
    op: str
    params: dict            # shape axes: B, K, V, N, ... (ints)
    dtype: str              # "bf16", "fp32", ...
    mode: str = ""          # op-specific variant, e.g. "draft_probs", "onehot", "greedy"
    skip_backends: tuple = ()  # backends a preset leaves out at this point (to save time)

    @property
    def shape(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params.items())

    def label(self) -> str:
        return f"{self.op}[{self.shape},{self.dtype}{',' + self.mode if self.mode else ''}]"


@dataclass
class Impl:
    """One way of running a case.

    ``fn(inputs)`` runs the op on one input set (a dict built by the op module). ``prepare``,
    when given, turns an input set into what ``fn`` takes, outside the timed region (used to
    time one stage of a pipeline on the previous stage's outputs).
    """
    backend: str
    fn: Callable[[Any], Any]
    kind: str = "ours"                # "ours", "baseline" or "stage"
    stage: str = ""                   # pipeline stage name for kind == "stage"
    graphable: bool = False           # try a CUDA-graph variant too (small batches)
    compilable: bool = False          # a torch.compile(fullgraph=True) variant too
    prepare: Optional[Callable[[dict], Any]] = None
    note: str = ""


@dataclass
class Skip:
    """An implementation that cannot run here, with the reason (it becomes a row)."""
    backend: str
    reason: str
    kind: str = "baseline"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> tuple[str, bool]:
    """(commit, dirty). ``SPECDEC_GIT_COMMIT`` overrides, for copies of the tree without .git."""
    env = os.environ.get("SPECDEC_GIT_COMMIT")
    if env:
        return env, False
    commit = _git("rev-parse", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def triton_version() -> str:
    try:
        import triton  # noqa: PLC0415 -- optional, and never needed to import the harness
        return triton.__version__
    except Exception:  # noqa: BLE001 -- any import failure means "not available"
        return "none"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


@dataclass
class Environment:
    device: torch.device
    device_name: str
    torch: str
    triton: str
    git_commit: str
    git_dirty: bool
    host: str
    timestamp: str
    copy_bw_gbps: float = float("nan")
    l2_bytes: int = 0
    cpu_isa: str = ""  # the C++ CPU path's instruction-set build (specdec_kernels._cpu.isa)

    def row_fields(self) -> dict:
        return {
            "device": self.device.type, "device_name": self.device_name, "cpu_isa": self.cpu_isa,
            "torch": self.torch, "triton": self.triton, "git_commit": self.git_commit,
            "git_dirty": self.git_dirty, "host": self.host, "timestamp": self.timestamp,
            "copy_bw_gbps": round(self.copy_bw_gbps, 2),
        }


def environment(device: torch.device) -> Environment:
    commit, dirty = git_commit()
    return Environment(
        device=device, device_name=device_name(device), torch=torch.__version__,
        triton=triton_version(), git_commit=commit, git_dirty=dirty, host=platform.node(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        l2_bytes=l2_bytes(device), cpu_isa=cpu_isa())


def cpu_isa() -> str:
    """The build the C++ CPU path runs here ("baseline", "avx2", "avx512"; "none" unbuilt)."""
    try:
        from specdec_kernels import _cpu  # noqa: PLC0415
        return _cpu.isa()
    except Exception:  # noqa: BLE001 -- the bench runs without the package's extension too
        return "none"


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    calls_per_sample: int
    times_us: list = field(default_factory=list, repr=False)


def _summarise(per_call_us: Sequence[float], calls_per_sample: int) -> Timing:
    xs = sorted(per_call_us)
    def q(f):  # noqa: E306 -- nearest-rank quantile, enough for 10+ samples
        return xs[min(len(xs) - 1, max(0, int(round(f * (len(xs) - 1)))))]
    return Timing(statistics.median(xs), q(0.2), q(0.8), len(xs), calls_per_sample, list(xs))


def time_cpu(fn: Callable[[Any], Any], inputs: Sequence[Any], *, warmup: int = 1,
             min_samples: int = 3, max_samples: int = 50, budget_s: float = 1.0) -> Timing:
    """Median of single calls with ``time.perf_counter``; samples until ``budget_s`` has passed
    (at least ``min_samples``, at most ``max_samples``)."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    start = time.perf_counter()
    while len(times) < max_samples:
        x = inputs[len(times) % len(inputs)]
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e6)
        if len(times) >= min_samples and time.perf_counter() - start > budget_s:
            break
    return _summarise(times, 1)


def time_cuda(fn: Callable[[Any], Any], inputs: Sequence[Any], *, warmup_ms: float = 25.0,
              rep_ms: float = 100.0, min_samples: int = 10, max_samples: int = 500,
              graph: bool = False) -> Timing:
    """do_bench-style timing on the current CUDA stream; one sample = one call on each input
    copy in turn, timed with a pair of CUDA events, divided by the number of copies.

    ``graph=True`` captures one pass over the copies in a CUDA graph and times its replay.
    Raises whatever capture raises (an op that synchronises cannot be captured).
    """
    n = len(inputs)

    def one_pass():
        for x in inputs:
            fn(x)

    one_pass()  # first call: JIT compilation, autotuning, lazy allocations
    torch.cuda.synchronize()
    run = one_pass
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                one_pass()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            one_pass()
        run = cuda_graph.replay
        run()
        torch.cuda.synchronize()

    # Estimate the cost of one pass, then size warm-up and samples from it.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        run()
    end.record()
    torch.cuda.synchronize()
    pass_ms = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / pass_ms))):
        run()
    samples = int(min(max_samples, max(min_samples, rep_ms / pass_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / n for s, e in zip(starts, ends)]
    return _summarise(per_call, n)


def copy_bandwidth_gbps(device: torch.device, nbytes: Optional[int] = None) -> float:
    """Bytes read plus bytes written per second by ``dst.copy_(src)`` of a large buffer:
    1 GiB by default, past the L2 of any GPU and past the last-level cache of the CPUs here
    (260 MB of L3 on this project's build machine), so it is a DRAM/HBM figure."""
    if nbytes is None:
        nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        timing = time_cuda(lambda x: dst.copy_(x), [src], rep_ms=200.0, min_samples=20)
    else:
        timing = time_cpu(lambda x: dst.copy_(x), [src], warmup=2, min_samples=5, budget_s=1.0)
    del src, dst
    return 2 * nbytes / (timing.median_us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------
# Input rotation
# ---------------------------------------------------------------------------------------------


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def clone_inputs(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_inputs(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_inputs(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_inputs(v) for v in obj)
    return obj


def rotation_copies(input_bytes: int, env: Environment, *, max_total_bytes: int = 8 << 30,
                    max_copies: int = 512) -> int:
    """How many input copies keep each call off the previous call's L2 lines: enough that the
    copies together exceed twice the L2, at least 2, within a memory cap."""
    if env.device.type != "cuda":
        return 1
    want = math.ceil(2 * env.l2_bytes / max(input_bytes, 1)) + 1
    fit = max(1, max_total_bytes // max(input_bytes, 1))
    return int(max(2, min(want, fit, max_copies)))


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

REQUIRED_KEYS = ("op", "shape", "dtype", "mode", "backend", "kind", "stage", "variant", "status",
                 "median_us", "min_bytes", "gbps", "pct_copy_bw", "device", "device_name",
                 "torch", "triton", "git_commit")


def make_row(case: Case, impl_backend: str, kind: str, env: Environment, *, stage: str = "",
             variant: str = "eager", timing: Optional[Timing] = None, min_bytes: int = 0,
             status: str = "ok", note: str = "", input_copies: int = 0) -> dict:
    row = {"op": case.op, "shape": case.shape, "dtype": case.dtype, "mode": case.mode,
           **{k: v for k, v in case.params.items()},
           "backend": impl_backend, "kind": kind, "stage": stage, "variant": variant,
           "status": status, "note": note, "min_bytes": int(min_bytes)}
    if timing is not None:
        seconds = timing.median_us * 1e-6
        gbps = min_bytes / seconds / 1e9 if min_bytes and seconds > 0 else float("nan")
        row.update(median_us=round(timing.median_us, 3), p20_us=round(timing.p20_us, 3),
                   p80_us=round(timing.p80_us, 3), samples=timing.samples,
                   calls_per_sample=timing.calls_per_sample, input_copies=input_copies,
                   gbps=round(gbps, 3),
                   pct_copy_bw=round(100 * gbps / env.copy_bw_gbps, 3)
                   if env.copy_bw_gbps == env.copy_bw_gbps and env.copy_bw_gbps > 0 else float("nan"))
    else:
        row.update(median_us=float("nan"), p20_us=float("nan"), p80_us=float("nan"), samples=0,
                   calls_per_sample=0, input_copies=0, gbps=float("nan"), pct_copy_bw=float("nan"))
    row.update(env.row_fields())
    return row


def add_speedups(rows: list[dict], baselines: Optional[dict] = None,
                 default: str = "torch_unfused") -> None:
    """``speedup_vs_baseline``: the op's baseline median over this row's median, same case and
    variant (graph rows compare with the baseline's graph row when there is one, else eager).
    ``baselines`` maps op -> baseline backend (``default`` otherwise); stage rows get NaN."""
    baselines = baselines or {}
    base = {}
    for r in rows:
        if r["backend"] == baselines.get(r["op"], default) and r["status"] == "ok" and not r["stage"]:
            base[(r["op"], r["shape"], r["dtype"], r["mode"], r["variant"])] = r["median_us"]
    for r in rows:
        key = (r["op"], r["shape"], r["dtype"], r["mode"])
        ref = base.get(key + (r["variant"],), base.get(key + ("eager",)))
        ok = r["status"] == "ok" and not r["stage"] and ref is not None and r["median_us"] > 0
        r["baseline"] = baselines.get(r["op"], default)
        r["speedup_vs_baseline"] = round(ref / r["median_us"], 3) if ok else float("nan")


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def write_results(rows: list[dict], out_dir: Path, stem: str = "results") -> tuple[Path, Path]:
    """``<stem>.json`` (a list of row dicts) and ``<stem>.csv`` (union of the columns)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=1, default=str, allow_nan=True))
    tmp.replace(json_path)
    cols = _columns(rows)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


# ---------------------------------------------------------------------------------------------
# Running one case
# ---------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    quick: bool = False
    graph_max_batch: int = 64         # CUDA-graph variant for batches up to this
    compiled: bool = True             # "compiled" variants of the compilable impls
    compiled_max_batch: int = 1       # ... at batches up to this (the launch-bound case)
    cpu_budget_s: float = 1.0         # per measurement on CPU
    gpu_rep_ms: float = 100.0         # per measurement on GPU
    backends: Optional[set] = None    # only these backends (None: all)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def compiled(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``torch.compile(fn, fullgraph=True)`` (Inductor), compiled on its first call (the timers'
    warm-up), with Dynamo's caches cleared first: the impls of every case share a few code
    objects, and their recompilations would otherwise run into Dynamo's cache limit."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)


def run_case(case: Case, op_module, env: Environment, cfg: RunConfig) -> list[dict]:
    """Build the inputs, time every implementation, return one row per (impl, variant)."""
    device = env.device
    min_bytes = op_module.min_bytes(case)
    rows = []
    try:
        base_inputs = op_module.make_inputs(case, device)
    except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: report and move on
        return [make_row(case, "inputs", "ours", env, min_bytes=min_bytes,
                         status="error", note=_one_line(exc))]
    copies = rotation_copies(tensor_bytes(base_inputs), env)
    inputs = [base_inputs] + [clone_inputs(base_inputs) for _ in range(copies - 1)]
    for impl in op_module.implementations(case, device):
        if impl.backend in case.skip_backends or (
                cfg.backends is not None and impl.backend not in cfg.backends):
            continue
        if isinstance(impl, Skip):
            rows.append(make_row(case, impl.backend, impl.kind, env, min_bytes=min_bytes,
                                 status="skipped", note=impl.reason))
            continue
        variants = ["eager"]
        if device.type == "cuda" and impl.graphable and case.params.get("B", 0) <= cfg.graph_max_batch:
            variants.append("graph")
        if cfg.compiled and impl.compilable and case.params.get("B", 0) <= cfg.compiled_max_batch:
            variants.append("compiled")
        try:
            prepared = [impl.prepare(x) for x in inputs] if impl.prepare else inputs
        except Exception as exc:  # noqa: BLE001
            rows.append(make_row(case, impl.backend, impl.kind, env, stage=impl.stage,
                                 min_bytes=min_bytes, status="error", note=_one_line(exc)))
            continue
        for variant in variants:
            try:
                fn = compiled(impl.fn) if variant == "compiled" else impl.fn
                if device.type == "cuda":
                    timing = time_cuda(fn, prepared, rep_ms=cfg.gpu_rep_ms,
                                       graph=(variant == "graph"))
                else:
                    timing = time_cpu(fn, prepared, budget_s=cfg.cpu_budget_s,
                                      max_samples=5 if cfg.quick else 50,
                                      min_samples=2 if cfg.quick else 3)
                rows.append(make_row(case, impl.backend, impl.kind, env, stage=impl.stage,
                                     variant=variant, timing=timing, min_bytes=min_bytes,
                                     note=impl.note, input_copies=len(prepared)))
            except Exception as exc:  # noqa: BLE001 -- one failing impl must not end the sweep
                rows.append(make_row(case, impl.backend, impl.kind, env, stage=impl.stage,
                                     variant=variant, min_bytes=min_bytes, status="error",
                                     note=_one_line(exc)))
                if device.type == "cuda":
                    try:  # a failed capture or launch can leave an error pending: clear it here
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
        del prepared
    del inputs, base_inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
