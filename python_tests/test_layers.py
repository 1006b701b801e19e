"""One direction of dependence (docs/layers.md): no import circle and no upward import among
the package's modules, no include circle under csrc/, and the CPU path's headers in their
order. The order lives in docs/layers.md's tables, read here; a module missing from them fails
with a message saying where to add it. Reads files only (no import): fast."""
from __future__ import annotations

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specdec_kernels"
LAYERS_DOC = ROOT / "docs" / "layers.md"
CPP_ORDERED = re.compile(r"sampling_cpu.*\.h")  # csrc/core headers with a rank


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------


def read_table(text: str, heading: str) -> dict[str, int]:
    """``{name: layer}`` from the table under the ``## heading...`` section of docs/layers.md:
    the first column is the layer, the second the backticked names."""
    section = re.split(r"^## ", text, flags=re.M)
    body = next(s for s in section if s.startswith(heading))
    table = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([^`]+)`", cells[1]):
                table[name] = int(cells[0])
    return table


def layer_of(module: str, table: dict[str, int]):
    """The layer of ``module`` (dotted, without the package prefix; ``__init__`` for the
    package): an exact entry, else the longest ``prefix.*`` entry covering it, else None."""
    if module in table:
        return table[module]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        star = ".".join(parts[:n]) + ".*"
        if star in table:
            return table[star]
    return None


# ---------------------------------------------------------------------------------------------
# Python imports
# ---------------------------------------------------------------------------------------------


def python_modules(package_dir: Path) -> dict[str, Path]:
    """``{module: file}``, module names relative to the package (``__init__``: the package
    itself, ``x`` for ``x/__init__.py``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def python_imports(package_dir: Path, package: str, extra=()) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` among the package's modules, from every import
    statement (module level, inside functions, under ``TYPE_CHECKING`` alike). ``extra``:
    modules without a .py file (the compiled ``_C``)."""
    modules = python_modules(package_dir)
    known = set(modules) | set(extra)

    def absolute(module: str, level: int, target):
        if level == 0:
            if not (target or "").startswith(package):
                return None
            rest = target[len(package):].lstrip(".")
            return rest or "__init__"
        base = [] if module == "__init__" else module.split(".")
        if modules[module].name != "__init__.py":
            base = base[:-1]
        base = base[:len(base) - (level - 1)] if level > 1 else base
        name = ".".join(base + ([target] if target else []))
        return name or "__init__"

    def owner(name: str):
        """The module a dotted name lives in (``a.b.f`` -> ``a.b`` if that is a module)."""
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or "__init__"

    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = absolute(module, node.level, node.module)
                if base is None:
                    continue
                prefix = "" if base == "__init__" else base + "."
                subs = [prefix + a.name for a in node.names if prefix + a.name in known]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                targets = [t for t in (absolute(module, 0, a.name) for a in node.names) if t]
            for target in targets:
                target = owner(target)
                if target != module:
                    edges[module].setdefault(target, node.lineno)
    return edges


def circles(edges: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in edges), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def python_problems(edges: dict[str, dict[str, int]], table: dict[str, int],
                    files: dict[str, Path], base: Path) -> list[str]:
    """Every unknown module, upward import and circle, as messages naming the files
    (relative to ``base``)."""
    def where(module):
        return str(files[module].relative_to(base)) if module in files else module

    problems = []
    for module in sorted(set(edges) | {t for e in edges.values() for t in e}):
        if layer_of(module, table) is None:
            problems.append(f"{where(module)}: module {module!r} has no layer: add it to a "
                            f"row of the Python table in docs/layers.md")
    for module, targets in sorted(edges.items()):
        mine = layer_of(module, table)
        for target, line in sorted(targets.items()):
            theirs = layer_of(target, table)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{where(module)}:{line}: imports {target!r} (layer {theirs}) "
                                f"from layer {mine}: an upward import (docs/layers.md)")
    for component in circles(edges):
        problems.append("import circle: " + " <-> ".join(where(m) for m in component))
    return problems


# ---------------------------------------------------------------------------------------------
# C++ includes
# ---------------------------------------------------------------------------------------------

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
SOURCES = ("*.h", "*.hpp", "*.cuh", "*.cpp", "*.cc", "*.cu")


def cpp_includes(csrc: Path) -> dict[str, list[tuple[str, int]]]:
    """``{file: [(included file, line), ...]}`` (paths relative to ``csrc``, in order) for the
    quoted includes that name a file under ``csrc`` (its own folder first, then by name)."""
    files = sorted({p for pattern in SOURCES for p in csrc.rglob(pattern)})
    by_name: dict[str, list[Path]] = {}
    for path in files:
        by_name.setdefault(path.name, []).append(path)
    result = {}
    for path in files:
        text = path.read_text(errors="replace")
        found = []
        for match in INCLUDE.finditer(text):
            name = match.group(1)
            line = text.count("\n", 0, match.start()) + 1
            local = path.parent / name
            target = local if local.exists() else \
                (by_name.get(Path(name).name) or [None])[0]
            if target is not None:
                found.append((str(target.relative_to(csrc)), line))
        result[str(path.relative_to(csrc))] = found
    return result


def cpp_problems(includes: dict[str, list[tuple[str, int]]], ranks: dict[str, int],
                 ordered=CPP_ORDERED) -> list[str]:
    """Include circles anywhere; for the ranked headers (file names matching ``ordered``): a
    missing rank, an include of a higher rank, includes out of bottom-up order."""
    problems = []
    for component in circles({f: dict(i) for f, i in includes.items()}):
        problems.append("include circle: " + " <-> ".join(component))

    def rank(path):
        return ranks.get(Path(path).name)

    for path, found in sorted(includes.items()):
        name = Path(path).name
        if ordered.fullmatch(name) and rank(path) is None:
            problems.append(f"csrc/{path}: header {name!r} has no rank: add it to a row of the "
                            f"C++ table in docs/layers.md")
            continue
        previous = None
        for target, line in found:
            theirs = rank(target)
            if theirs is None:
                continue
            mine = rank(path)
            if mine is not None and theirs > mine:
                problems.append(f"csrc/{path}:{line}: includes {Path(target).name} (rank "
                                f"{theirs}) from rank {mine}: an upward include (docs/layers.md)")
            if previous is not None and theirs < previous[1]:
                problems.append(f"csrc/{path}:{line}: includes {Path(target).name} (rank "
                                f"{theirs}) after {previous[0]} (rank {previous[1]}): "
                                f"include the CPU path's headers from the bottom up")
            previous = (Path(target).name, theirs)
    return problems


# ---------------------------------------------------------------------------------------------
# The repository
# ---------------------------------------------------------------------------------------------


def _tables():
    text = LAYERS_DOC.read_text()
    return read_table(text, "Python"), read_table(text, "C++")


def test_python_layers_one_direction():
    table, _ = _tables()
    package_dir = ROOT / PACKAGE
    edges = python_imports(package_dir, PACKAGE, extra=("_C",))
    problems = python_problems(edges, table, python_modules(package_dir), ROOT)
    assert not problems, "\n".join(problems)


def test_every_table_entry_names_a_module():
    """A stale row (a module renamed or removed) is as misleading as a missing one."""
    table, _ = _tables()
    modules = set(python_modules(ROOT / PACKAGE)) | {"_C"}
    stale = [n for n in table if not (n in modules or (n.endswith(".*") and any(
        m == n[:-2] or m.startswith(n[:-1]) for m in modules)))]
    assert not stale, f"docs/layers.md names modules that do not exist: {stale}"


def test_cpp_includes_have_no_circle():
    problems = [p for p in cpp_problems(cpp_includes(ROOT / "csrc"), {})
                if p.startswith("include circle")]
    assert not problems, "\n".join(problems)


def test_cpp_headers_in_order():
    _, ranks = _tables()
    headers = {p.name for p in (ROOT / "csrc").rglob("*.h")}
    problems = [f"docs/layers.md ranks {n}, which does not exist" for n in ranks
                if n not in headers]
    problems += cpp_problems(cpp_includes(ROOT / "csrc"), ranks)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Planted cases: the checker catches what it must
# ---------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_planted_upward_import_and_circle_are_caught(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .top import f\n",
        "pkg/low.py": "def g():\n    from .top import f  # planted: reaches up\n    return f\n",
        "pkg/top.py": "from . import low\nf = low\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/kernel.py": "from .. import low\nfrom pkg import top  # planted\n",
        "pkg/new.py": "import pkg.low\n",
    })
    table = {"low": 0, "sub.*": 1, "top": 2, "__init__": 3}
    edges = python_imports(tmp_path / "pkg", "pkg")
    assert edges["low"] == {"top": 2} and edges["sub.kernel"] == {"low": 1, "top": 2}
    problems = python_problems(edges, table, python_modules(tmp_path / "pkg"), tmp_path / "pkg")
    text = "\n".join(problems)
    assert "low.py:2: imports 'top' (layer 2) from layer 0" in text
    assert "sub/kernel.py:2: imports 'top' (layer 2) from layer 1" in text
    assert "import circle: low.py <-> top.py" in text
    assert "new.py: module 'new' has no layer: add it" in text
    assert len(problems) == 4, text


def test_planted_include_circle_and_order_are_caught(tmp_path):
    _write(tmp_path, {
        "core/sampling_cpu_low.h": '#include "sampling_cpu_high.h"  // planted\n',
        "core/sampling_cpu_high.h": '#include "sampling_cpu_low.h"\n#include <vector>\n',
        "core/sampling_cpu_body.h": '#include "sampling_cpu_high.h"\n'
                                    '#include "sampling_cpu_low.h"\n',
        "core/sampling_cpu_new.h": "",
        "torch/ops.cpp": '#include "sampling_cpu_body.h"\n',
    })
    includes = cpp_includes(tmp_path)
    assert includes["torch/ops.cpp"] == [("core/sampling_cpu_body.h", 1)]
    ranks = {"sampling_cpu_low.h": 0, "sampling_cpu_high.h": 1, "sampling_cpu_body.h": 2}
    text = "\n".join(cpp_problems(includes, ranks))
    assert "include circle: core/sampling_cpu_high.h <-> core/sampling_cpu_low.h" in text
    assert "core/sampling_cpu_low.h:1: includes sampling_cpu_high.h (rank 1) from rank 0" in text
    assert "core/sampling_cpu_body.h:2: includes sampling_cpu_low.h (rank 0) after " \
           "sampling_cpu_high.h (rank 1)" in text
    assert "sampling_cpu_new.h' has no rank: add it" in text


def test_tables_are_read():
    table, ranks = _tables()
    assert table["_rng"] == 0 and table["triton.*"] == 2 and table["__init__"] == 6
    assert layer_of("triton.chain", table) == 2 and layer_of("adapters", table) == 7
    assert ranks["sampling_cpu.h"] < ranks["sampling_cpu_race.h"]
