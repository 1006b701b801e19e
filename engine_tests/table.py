"""One table for ``make engine-tests``: every engine runner appends its rows to
``build/engine-tests/table.tsv`` (engine, version, file, passed, total, seconds, note) and
``python engine_tests/table.py`` prints them; ``--reset`` empties it first."""
from __future__ import annotations

import pathlib
import sys
import xml.etree.ElementTree as ElementTree

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE = ROOT / "build" / "engine-tests" / "table.tsv"


def add_row(engine: str, version: str, file: str, passed: int, total: int, seconds: float,
            note: str = "") -> None:
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    with TABLE.open("a") as out:
        out.write("\t".join([engine, version, file, str(passed), str(total),
                             f"{seconds:.0f}", note.replace("\t", " ")]) + "\n")


def junit_counts(path: pathlib.Path) -> tuple:
    """(passed, total, seconds, [(test, outcome, message)], expected failures) of a pytest
    ``--junitxml``; an expected failure (xfail: a documented difference) is not a pass, it is
    counted apart."""
    passed = total = xfailed = 0
    seconds = 0.0
    notes = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        total += 1
        seconds += float(case.get("time", 0))
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        if not bad:
            passed += 1
            continue
        tag, message = bad[0].tag, (bad[0].get("message") or "").splitlines()
        message = message[0][:200] if message else ""
        if tag == "skipped" and bad[0].get("type") == "pytest.xfail":
            xfailed += 1
            notes.append((case.get("name"), "xfail (documented difference)", message))
        else:
            notes.append((case.get("name"), tag, message))
    return passed, total, seconds, notes, xfailed


def junit_by_file(path: pathlib.Path) -> dict:
    """{test file: (passed, total, seconds)} of a pytest ``--junitxml`` (an expected failure
    is not a pass)."""
    out = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = (case.get("classname") or "?").split(".")[0] + ".py"
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        passed, total, seconds = out.get(name, (0, 0, 0.0))
        out[name] = (passed + (not bad), total + 1, seconds + float(case.get("time", 0)))
    return out


def main() -> int:
    if "--reset" in sys.argv:
        TABLE.unlink(missing_ok=True)
        return 0
    rows = [line.split("\t") for line in TABLE.read_text().splitlines()] \
        if TABLE.exists() else []
    header = ["engine", "version", "file", "passed/total", "seconds", "note"]
    body = [[r[0], r[1], r[2], f"{r[3]}/{r[4]}", r[5], r[6] if len(r) > 6 else ""]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)] if body else \
        [len(h) for h in header]
    print("\n==== engine tests ====")
    for row in [header, ["-" * w for w in widths]] + body:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
