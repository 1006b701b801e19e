"""Compile-time resources of every Triton kernel of the package, for sm_80 and sm_90, on a
machine without a GPU.

Every module of ``specdec_kernels.triton`` that defines ``COMPILE_SPECS`` (a list of dicts:
``name``, ``kernel`` (or ``fn``), ``signature`` {argument: type}, ``constexprs`` {argument: value},
``num_warps``, optionally ``maxnreg``) is collected; each spec is compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``. Registers, spills and
stack come from ``ptxas -v`` on the generated PTX (the ptxas Triton itself uses), shared
memory from the kernel's metadata. The driver-filled ``n_regs``/``n_spills`` are not used:
they need a GPU.

    python bench/resources.py [--out bench/results/resources.json] [--arch 80 90]

Writes the JSON report and prints a table. ``TRITON_INTERPRET=1`` (set for the tests) turns
``@triton.jit`` into the interpreter, so the script then re-runs itself without it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "resources.json"


def collect_specs() -> list[tuple[str, dict]]:
    """(module name, spec) for every COMPILE_SPECS entry of every specdec_kernels.triton module."""
    import specdec_kernels.triton as package
    specs = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for spec in getattr(module, "COMPILE_SPECS", []):
            specs.append((module.__name__, spec))
    return specs


def _ptxas() -> str:
    import triton
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if bundled.exists():
        return str(bundled)
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"
    if cuda.exists():
        return str(cuda)
    found = shutil.which("ptxas")
    if found is None:
        raise RuntimeError("ptxas not found (Triton's bundled one, $CUDA_HOME/bin or PATH)")
    return found


def _ptxas_usage(ptx: str) -> dict:
    """Registers, spill bytes and stack frame from ``ptxas -v`` on the kernel's PTX."""
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        proc = subprocess.run([_ptxas(), "-v", f"-arch={arch}", str(path), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{log}")
    num = lambda pattern: sum(int(m) for m in re.findall(pattern, log))
    return dict(registers=max(int(m) for m in re.findall(r"Used (\d+) registers", log)),
                spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"),
                stack_frame=num(r"(\d+) bytes stack frame"),
                ptxas_arch=arch)


def spec_kernel(spec: dict):
    """The jitted function of a spec (``kernel``, or ``fn`` as some modules spell it)."""
    return spec["kernel"] if "kernel" in spec else spec["fn"]


def _alignment_attrs(kernel, spec: dict) -> dict:
    """The divisibility-by-16 hints Triton's launcher derives at run time from the arguments,
    for the shapes the benchmarks use: every pointer (torch allocations are aligned), every
    stride, ``V`` and ``chunk_size`` (32000, 128256 and 151936 are multiples of 16). Without
    them the compile would assume unaligned rows and never vectorise a load. A spec may name
    its own with ``divisible``."""
    names = spec.get("divisible")
    if names is None:
        names = [name for name, kind in spec["signature"].items()
                 if kind.startswith("*") or name.startswith("stride") or name in ("V", "chunk_size")]
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def compile_spec(spec: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = dict(spec["signature"])
    signature.update({name: "constexpr" for name in spec["constexprs"]})
    kernel = spec_kernel(spec)
    # Constexprs keyed by argument position: the form every Triton 3.x ASTSource accepts.
    constexprs = {(kernel.arg_names.index(name),): value for name, value in spec["constexprs"].items()}
    source = ASTSource(kernel, signature, constexprs, _alignment_attrs(kernel, spec))
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=spec["num_warps"],
                                           **({"maxnreg": spec["maxnreg"]} if "maxnreg" in spec else {})))
    meta = compiled.metadata
    shared = meta["shared"] if isinstance(meta, dict) else getattr(meta, "shared", None)
    usage = _ptxas_usage(compiled.asm["ptx"])
    return dict(kernel=spec_kernel(spec).__name__, arch=f"sm_{arch}", num_warps=spec["num_warps"],
                shared_memory_bytes=shared, spills=usage["spill_stores"] + usage["spill_loads"],
                **usage)


def report(archs=(80, 90)) -> list[dict]:
    import triton
    rows = []
    for module, spec in collect_specs():
        for arch in archs:
            row = dict(name=spec["name"], module=module)
            try:
                row.update(compile_spec(spec, arch))
            except Exception as err:  # reported per kernel; the others still compile
                row.update(kernel=spec_kernel(spec).__name__, arch=f"sm_{arch}",
                           num_warps=spec["num_warps"],
                           error=f"{type(err).__name__}: {err}".strip()[-2000:])
            row["constexprs"] = {k: (v if isinstance(v, (int, float, bool, str)) else str(v))
                                 for k, v in spec["constexprs"].items()}
            row["signature"] = spec["signature"]
            row["triton"] = triton.__version__
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
                               if argv is None else
                               [sys.executable, str(Path(__file__).resolve()), *argv], env=env)
    sys.path.insert(0, str(ROOT))
    rows = report(tuple(args.arch))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'kernel config':44s} {'arch':6s} {'warps':>5s} {'regs':>5s} {'spill B':>7s} "
          f"{'stack B':>7s} {'smem B':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:44s} {r['arch']:6s} {r['num_warps']:5d} COMPILE ERROR: "
                  f"{r['error'].splitlines()[-1][:120]}")
            continue
        print(f"{r['name']:44s} {r['arch']:6s} {r['num_warps']:5d} {r['registers']:5d} "
              f"{r['spills']:7d} {r['stack_frame']:7d} {r['shared_memory_bytes']:7d}")
    print(f"wrote {out}")
    return 1 if any(r.get("spills") or "error" in r for r in rows) else 0

if __name__ == "__main__":
    sys.exit(main())
