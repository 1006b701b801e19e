"""``make engine-tests-vllm``: vLLM's own verification tests against our adapters, by release.

``VLLM_VERSIONS="0.33.0 0.34.0"`` picks the releases (default: the newest, 0.34.0). For each,
at run time (nothing of vLLM is committed), under ``build/engine-tests/vllm-<version>``: a
venv that sees the project's torch/triton (a ``.pth`` naming its site-packages) plus vLLM's
wheel and its small import-chain wheels (requirements.txt, ``--no-deps``), and the sdist's
``tests/`` (building the sdist's metadata fails, ``--no-clean`` keeps it unpacked).

* 0.33.0: ``tests/v1/sample/test_rejection_sampler.py`` with our V1 class swapped in
  (``-p engine_tests.vllm.swap``), then ``check_vllm.py`` (vLLM's runner and Sampler, MRV2).
* 0.34.0: the four MRV2 files with ``mrv2_0_34.swap()`` (``-p engine_tests.vllm.swap_0_34``).

Each file runs in its own pytest process under a memory cap (``ENGINE_TESTS_MEMORY_GB``,
default 12: ``RLIMIT_AS``, as ``ulimit -v``; vLLM's largest stochastic tests build 4.7 GB of
inputs themselves and peak at 5.5 GB resident with ours, which an 8 GB address-space cap
refuses), a per-test limit (``ENGINE_TEST_TIMEOUT`` s,
default 300) and a per-file limit (``ENGINE_TESTS_FILE_TIMEOUT`` s, default 5400), with
``TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu`` and no CUDA device unless one is present. Rows
go to engine_tests/table.py's table; each test that does not pass is listed with its reason.
A test stopped by the memory cap or the time limit is reported skipped with the limit named
(swap_0_34.py), as are the tests known to need a GPU for time. Exit status: non-zero when a
test failed; an expected failure (marked in the plugin: a
difference documented in docs/engines.md) is counted apart in the table's note, not as a pass,
and does not fail the run.
"""
from __future__ import annotations

import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from engine_tests import table  # noqa: E402

NEWEST = "0.34.0"
SUITES = {
    "0.33.0": ("engine_tests.vllm.swap", ["tests/v1/sample/test_rejection_sampler.py"]),
    "0.34.0": ("engine_tests.vllm.swap_0_34", [
        "tests/v1/spec_decode/test_rejection_sampler_utils.py",
        "tests/v1/worker/test_gpu_rejection_sampler_chunking.py",
        "tests/v1/worker/test_gpu_rejection_sampler_i64.py",
        "tests/v1/spec_decode/test_synthetic_rejection_sampler_utils.py"]),
}


def sh(cmd, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], text=True, **kwargs)


def prepare(version: str) -> pathlib.Path:
    """The venv with vLLM ``version`` and the sdist's tests: ``home`` (``venv/``, ``src/``)."""
    home = ROOT / "build" / "engine-tests" / f"vllm-{version}"
    python = home / "venv" / "bin" / "python"
    if not python.exists():
        home.mkdir(parents=True, exist_ok=True)
        sh([sys.executable, "-m", "venv", home / "venv"], check=True)
        site = sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  capture_output=True, check=True).stdout.strip()
        import sysconfig
        pathlib.Path(site, "_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shown = sh([python, "-m", "pip", "show", "vllm"], capture_output=True).stdout
    if f"Version: {version}\n" not in shown:
        dist = home / "download"
        sh([python, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}", "-d", dist],
           check=True)
        wheel = sorted(dist.glob(f"vllm-{version}-*.whl"))[-1]
        sh([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
    marker = home / ".requirements-installed"
    requirements = ROOT / "engine_tests" / "vllm" / "requirements.txt"
    if not marker.exists() or marker.read_text() != requirements.read_text():
        sh([python, "-m", "pip", "install", "-q", "--no-deps", "-r", requirements], check=True)
        marker.write_text(requirements.read_text())
    if not (home / "src" / SUITES.get(version, SUITES[NEWEST])[1][0]).exists():
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            sh([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                "--no-clean", f"vllm=={version}", "-d", pathlib.Path(tmp, "sdist")],
               env=dict(os.environ, TMPDIR=tmp), capture_output=True)
            unpacked = [p.parent for p in pathlib.Path(tmp).glob("*/vllm_*/PKG-INFO")]
            if not unpacked:
                sys.exit(f"could not unpack the vllm=={version} sdist")
            shutil.rmtree(home / "src", ignore_errors=True)
            (home / "src").mkdir()
            shutil.copytree(unpacked[0] / "tests", home / "src" / "tests")
    return home


def _limits():
    cap = int(float(os.environ.get("ENGINE_TESTS_MEMORY_GB", "12")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def environment(home: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(home / "src")]))
    if not _has_cuda(home):
        env.update(TRITON_INTERPRET="1", VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def _has_cuda(home: pathlib.Path) -> bool:
    out = sh([home / "venv" / "bin" / "python", "-c",
              "import torch; print(torch.cuda.is_available())"], capture_output=True)
    return out.stdout.strip() == "True"


def run_file(version: str, home: pathlib.Path, plugin: str, test_file: str, env: dict,
             extra: list) -> bool:
    report = home / "reports" / (pathlib.Path(test_file).stem + ".xml")
    report.parent.mkdir(exist_ok=True)
    report.unlink(missing_ok=True)
    cmd = [home / "venv" / "bin" / "python", "-m", "pytest", "-p", plugin, "--noconftest",
           "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={report}", test_file, *extra]
    log = report.with_suffix(".log")
    log.unlink(missing_ok=True)
    env = dict(env, ENGINE_TESTS_LOG=str(log),
               ENGINE_TESTS_MEMORY_GB=os.environ.get("ENGINE_TESTS_MEMORY_GB", "12"))
    start = time.monotonic()
    limit = int(os.environ.get("ENGINE_TESTS_FILE_TIMEOUT", "5400"))
    try:
        result = sh(cmd, cwd=home / "src", env=env, preexec_fn=_limits, timeout=limit,
                    capture_output=True)
        print(result.stdout[-6000:], result.stderr[-2000:], sep="\n", flush=True)
        note = "" if result.returncode in (0, 1) else f"pytest exit {result.returncode}"
    except subprocess.TimeoutExpired:
        note = f"file time limit {limit} s"
    seconds = time.monotonic() - start
    name = pathlib.Path(test_file).name
    if not report.exists():  # stopped: what the per-test log says ran
        lines = [line.split("\t") for line in log.read_text().splitlines()] \
            if log.exists() else []
        done = {line[0] for line in lines}
        bad = {line[0] for line in lines if line[2] != "passed"}
        table.add_row("vllm", version, name, len(done - bad), len(done), seconds,
                      (note or "no report") + f"; {len(done)} tests ran before it stopped")
        for line in lines:
            if line[2] != "passed":
                print(f"  {line[0]}: {line[2]} ({line[1]}): {line[4] if len(line) > 4 else ''}")
        return False
    passed, total, _, notes, xfailed = table.junit_counts(report)
    failed = sum(outcome in ("failure", "error") for _, outcome, _ in notes)
    skipped = total - passed - xfailed - failed
    note = "; ".join(filter(None, [note] + [f"{n} {what}" for n, what in (
        (xfailed, "expected failures (documented)"), (skipped, "not run here (named)"),
        (failed, "failed")) if n]))
    table.add_row("vllm", version, name, passed, total, seconds, note)
    for test, outcome, message in notes:
        print(f"  {name}::{test}: {outcome}: {message}")
    return not failed and not note.startswith(("pytest", "file"))


def main() -> int:
    versions = (os.environ.get("VLLM_VERSIONS") or os.environ.get("VLLM_VERSION")
                or NEWEST).split()
    extra = sys.argv[1:]
    ok = True
    for version in versions:
        if version not in SUITES:
            table.add_row("vllm", version, "-", 0, 0, 0, "no suite for this release here")
            ok = False
            continue
        home = prepare(version)
        env = environment(home)
        plugin, files = SUITES[version]
        for test_file in files:
            ok &= run_file(version, home, plugin, test_file, env, extra)
        if version == "0.33.0":
            start = time.monotonic()
            result = sh([home / "venv" / "bin" / "python",
                         ROOT / "engine_tests" / "vllm" / "check_vllm.py"], cwd=home / "src",
                        env=env, preexec_fn=_limits, capture_output=True)
            print(result.stdout[-6000:], result.stderr[-2000:], sep="\n", flush=True)
            table.add_row("vllm", version, "check_vllm.py", int(result.returncode == 0), 1,
                          time.monotonic() - start)
            ok &= result.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
