"""The README and the manual (docs/*.md): every relative link points at a file that exists and,
with a `#fragment`, at a heading of that page; the README stays a landing page."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_anchors(text: str) -> set[str]:
    """The fragment ids GitHub gives a page's headings: lower case, punctuation dropped (word
    characters, spaces and hyphens kept), spaces to hyphens, repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(page: pathlib.Path):
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        yield target


def test_anchor_rules_match_github():
    text = "# Tree verification (`verify_tree`)\n## §7. Errors, validation\n## A b\n## A b\n"
    assert github_anchors(text) == {"tree-verification-verify_tree", "7-errors-validation",
                                    "a-b", "a-b-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and \
                fragment not in github_anchors(resolved.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repo(page):
    assert "../shared" not in page.read_text(), "the repo documents itself: no ../shared"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual is docs/"
    head = "\n".join(lines[:8])
    assert "make demo" in head and "make test" in head, "the two commands open the README"
    assert "docs/index.md" in text


def test_readme_example_runs():
    """The README's 30-second example runs as printed (CPU tensors)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## In 30 seconds\n+```python\n(.*?)```", text, re.S)
    assert block, "the README's example block"
    exec(compile(block.group(1), "README.md", "exec"), {"print": lambda *a, **k: None})
