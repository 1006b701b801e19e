"""Run an engine's own unit tests of a kernel against our adapter, fetched at run time.

Used by ``engine_tests/flashinfer/run.py`` and ``engine_tests/sglang/run.py`` (``make
engine-tests-flashinfer`` / ``engine-tests-sglang``). Nothing third-party is committed:

1. a venv under ``build/engine-tests/<engine>`` that sees the project's venv (a ``.pth`` file
   naming its site-packages: torch, pytest and this checkout come from there; nothing is
   installed into either);
2. the engine's released artifacts are downloaded from the package index with pip (wheels:
   an sdist is fetched only where pip can do so without building it) and searched for test
   files that call the kernel; ``<ENGINE>_TESTS=/path/to/tests`` (a source checkout's test
   directory or files) is searched as well;
3. the test files found are copied, unmodified, into ``build/engine-tests/<engine>/tests``
   beside the engine's ``conftest.py`` shim from this directory (it maps the engine's module
   to our adapter, and on a machine without CUDA maps their ``device="cuda"`` literals to the
   CPU), and run with pytest;
4. a report (what was searched, what ran, passed, failed, could not run and why) is printed
   and written to ``build/engine-tests/<engine>/report.txt``.

Exit status: pytest's when tests ran; 0 when none were found (the report says so), unless
``ENGINE_TESTS_STRICT=1``.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

from engine_tests import table

ROOT = pathlib.Path(__file__).resolve().parent.parent
_VERSION: dict = {}  # engine -> the released versions searched (the table's column)


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kwargs)


def make_venv(engine: str) -> pathlib.Path:
    home = ROOT / "build" / "engine-tests" / engine
    python = home / "venv" / "bin" / "python"
    if not python.exists():
        home.mkdir(parents=True, exist_ok=True)
        result = _run([sys.executable, "-m", "venv", home / "venv"])
        if result.returncode:
            sys.exit(f"could not create the venv: {result.stderr}")
        # The project's venv's packages, seen from this one (a venv made from a venv with
        # --system-site-packages would see the base interpreter's instead).
        site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        parent = [p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
        pathlib.Path(site.stdout.strip(), "project_venv.pth").write_text("\n".join(parent) + "\n")
    return home


def download(home: pathlib.Path, requirement: str, log: list) -> list:
    """The requirement's wheel from the package index (pip download, no dependencies, no
    build): the files saved, or [] with the reason logged."""
    dist = home / "dist"
    dist.mkdir(exist_ok=True)
    before = set(dist.iterdir())
    result = _run([home / "venv" / "bin" / "python", "-m", "pip", "download", "--no-deps",
                   "--only-binary", ":all:", requirement, "-d", dist])
    if result.returncode:
        log.append(f"{requirement}: not downloaded ({result.stderr.strip().splitlines()[-1]})")
        return []
    saved = re.findall(r"(?:Saved|File was already downloaded) (\S+)", result.stdout)
    files = [pathlib.Path(p) for p in saved] or sorted(set(dist.iterdir()) - before)
    log.append(f"{requirement}: downloaded {', '.join(f.name for f in files)}")
    return files


def _members(archive: pathlib.Path):
    """(name, read) pairs of an archive's Python files."""
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if name.endswith(".py"):
                    yield name, (lambda n=name: z.read(n).decode("utf-8", "replace"))
    elif archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive) as t:
            for member in t.getmembers():
                if member.isfile() and member.name.endswith(".py"):
                    yield member.name, (lambda m=member: t.extractfile(m).read().decode(
                        "utf-8", "replace"))


def find_tests(sources: list, kernels: list, log: list) -> dict:
    """Test files (``test_*.py``) in the archives or directories that call one of
    ``kernels``: {file name: text}. The search is logged per source."""
    found = {}
    for source in sources:
        source = pathlib.Path(source)
        if source.is_dir():
            members = ((str(p.relative_to(source)), p.read_text) for p in source.rglob("*.py"))
        elif source.is_file() and source.suffix == ".py":
            members = [(source.name, source.read_text)]
        elif source.is_file():
            members = _members(source)
        else:
            log.append(f"{source}: not found")
            continue
        tests = hits = 0
        for name, read in members:
            if not pathlib.PurePath(name).name.startswith("test_"):
                continue
            tests += 1
            text = read()
            if any(re.search(rf"\b{k}\b", text) for k in kernels):
                hits += 1
                found[pathlib.PurePath(name).name] = text
        log.append(f"{source.name}: {tests} test files, {hits} calling "
                   f"{' / '.join(kernels)}")
    return found


def run_tests(engine: str, home: pathlib.Path, tests: dict, pytest_args: list,
              log: list) -> int:
    """Copy the tests (unmodified) beside the engine's shim and run pytest on them."""
    where = home / "tests"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    shutil.copy(ROOT / "engine_tests" / engine / "conftest.py", where / "conftest.py")
    for name, text in tests.items():
        (where / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    junit = home / "report.xml"
    junit.unlink(missing_ok=True)
    cmd = [home / "venv" / "bin" / "python", "-m", "pytest", "-p", "no:cacheprovider",
           "-rA", "-q", f"--junitxml={junit}", *sorted(tests), *pytest_args]
    print("+", " ".join(str(c) for c in cmd), flush=True)
    result = subprocess.run(cmd, cwd=where, env=env, text=True, capture_output=True)
    print(result.stdout[-20000:], result.stderr[-4000:], sep="\n")
    summary = [line for line in result.stdout.splitlines()
               if re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)]
    log.append(f"ran {', '.join(sorted(tests))} with pytest {' '.join(pytest_args)}:")
    log.extend("  " + line for line in summary)
    log.append("  " + (result.stdout.strip().splitlines() or ["(no output)"])[-1])
    if junit.exists():
        for name, (passed, total, seconds) in sorted(table.junit_by_file(junit).items()):
            table.add_row(engine, _VERSION.get(engine, "?"), name, passed, total, seconds)
    else:
        table.add_row(engine, _VERSION.get(engine, "?"), ", ".join(sorted(tests)), 0, 0, 0,
                      "no report")
    return result.returncode


def report(home: pathlib.Path, log: list) -> None:
    text = "\n".join(log) + "\n"
    (home / "report.txt").write_text(text)
    print("\n==== engine tests report ====\n" + text, flush=True)


def main(engine: str, requirements: list, kernels: list, env_var: str,
         pytest_args: list, notes: list) -> int:
    home = make_venv(engine)
    log = [f"engine: {engine}; kernels: {', '.join(kernels)}"]
    sources = []
    for requirement in requirements:
        sources += download(home, requirement, log)
    extra = os.environ.get(env_var)
    if extra:
        sources += [pathlib.Path(p) for p in extra.split(os.pathsep) if p]
    tests = find_tests(sources, kernels, log)
    log += notes
    _VERSION[engine] = " ".join(r.split("==")[-1] for r in requirements)
    if not tests:
        table.add_row(engine, _VERSION[engine], "-", 0, 0, 0,
                      f"NOT RUN: no released test of {' / '.join(kernels)} ({env_var})")
        log.append(f"NOT RUN: no released artifact above ships a test of {' / '.join(kernels)}; "
                   f"point {env_var} at a source checkout's tests to run them")
        report(home, log)
        return 1 if os.environ.get("ENGINE_TESTS_STRICT") == "1" else 0
    status = run_tests(engine, home, tests, pytest_args, log)
    report(home, log)
    return status
