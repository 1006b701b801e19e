"""Every registered Triton kernel (``COMPILE_SPECS`` of each ``specdec_kernels.triton``
module) compiles for sm_80 and sm_90 on this machine, without a GPU, with no register spills.

The compile runs ``bench/resources.py`` in a subprocess without TRITON_INTERPRET (the
interpreter replaces ``@triton.jit``), once per session; each (kernel, arch) is its own test.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["sm_80", "sm_90"]


def _registered() -> list[str]:
    import specdec_kernels.triton as package
    names = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names += [spec["name"] for spec in getattr(module, "COMPILE_SPECS", [])]
    return names


def _has_nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend")


@pytest.fixture(scope="module")
def resources(tmp_path_factory):
    out = tmp_path_factory.mktemp("resources") / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "resources.py"), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-6000:])
    if not out.exists():
        pytest.fail(f"bench/resources.py wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {(row["name"], row["arch"]): row for row in json.loads(out.read_text())}


def test_registry_covers_the_chain_kernels():
    names = _registered()
    # (acceptance runs inside the race kernel: no accept kernel of its own)
    for kernel in ("row_stats[", "row_stats_finish[", "race["):
        assert any(name.startswith(kernel) for name in names), kernel
    for stage in (",groups", ",tokens"):  # the race split over chunks, and its second level
        assert any(name.startswith("race[") and (stage + "]" in name or stage + "," in name)
                   for name in names), stage
    # and the race merging split statistics, the target's and the draft logits'
    assert any(",stats_chunks=" in name for name in names)
    assert any(",q_stats_chunks=" in name for name in names)
    assert len(names) == len(set(names)), "spec names must be unique"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", _registered())
def test_kernel_compiles_without_spills(resources, name, arch):
    row = resources[(name, arch)]
    assert "error" not in row, row.get("error")
    assert row["spills"] == 0, (f"{name} on {arch}: {row['spill_stores']} B spill stores, "
                                f"{row['spill_loads']} B spill loads at {row['registers']} registers")
    assert row["registers"] <= 255
