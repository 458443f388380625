"""README.md and docs/*.md link only to paths that exist, and benchmarks/results/ holds only what they cite.

Every relative link (``[text](path)``, images, reference definitions) in README.md, docs/*.md and the results
index resolves to a file or folder of the checkout. benchmarks/results/ keeps the files the docs cite (or a
cited report embeds), each listed in its README.md index, at most MAX_RESULT_FILES of them; older runs live
in git history."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RESULTS_INDEX = os.path.join(RESULTS, "README.md")
MAX_RESULT_FILES = 30  # the index included

# [text](target "title") and ![alt](target); the text may span lines. Reference definitions: [id]: target
INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
RESULT_PATH = re.compile(r"`(benchmarks/results/[^`\s*{}]+)`")


def _docs():
    docs = [os.path.join(ROOT, "README.md")]
    docs += sorted(os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return docs


def links(text: str) -> list[str]:
    """The link targets of a markdown text, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [m.group(1) for m in INLINE.finditer(text)] + [m.group(1) for m in REFERENCE.finditer(text)]


def local_target(doc: str, target: str) -> str | None:
    """The path a relative link points to (anchor and query dropped), or None for URLs and in-page anchors."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    return os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else None


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _result_files():
    out = []
    for root, dirs, files in os.walk(RESULTS):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
    return out


@pytest.mark.parametrize("doc", _docs() + [RESULTS_INDEX], ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(doc):
    text = _read(doc)
    broken = [t for t in links(text) if (p := local_target(doc, t)) and not os.path.exists(p)]
    # Result paths written as code (`benchmarks/results/...`) are citations too.
    broken += [p for p in RESULT_PATH.findall(text) if not os.path.exists(os.path.join(ROOT, p))]
    assert broken == [], f"{os.path.relpath(doc, ROOT)} links to missing paths: {broken}"


def test_results_are_few_indexed_and_cited():
    files = _result_files()
    assert len(files) <= MAX_RESULT_FILES, f"benchmarks/results/ holds {len(files)} files (at most {MAX_RESULT_FILES}): move older runs to git history"
    indexed = {local_target(RESULTS_INDEX, t) for t in links(_read(RESULTS_INDEX))}
    cited = {local_target(d, t) for d in _docs() for t in links(_read(d))}
    cited |= {os.path.join(ROOT, p) for d in _docs() for p in RESULT_PATH.findall(_read(d))}
    # Files a cited report embeds (its plots) count as cited.
    cited |= {local_target(f, t) for f in files if f in cited and f.endswith(".md") for t in links(_read(f))}
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    for f in files:
        if f == RESULTS_INDEX:
            continue
        assert f in indexed, f"{rel(f)} is not listed in benchmarks/results/README.md"
        assert f in cited, f"{rel(f)} is cited by neither README.md nor docs/*.md: cite it or remove it (git keeps it)"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("see [the format](docs/format.md#blocks) and ![plot](a.png)", ["docs/format.md#blocks", "a.png"]),
        ("[a\nlink across lines](../x/y.md)", ["../x/y.md"]),
        ("[url](https://example.com) `[not](a link)`\n```\n[nor](this)\n```", ["https://example.com"]),
        ("[ref]: ../benchmarks/results/README.md", ["../benchmarks/results/README.md"]),
    ],
)
def test_link_extraction(text, expected):
    assert links(text) == expected


def test_local_target():
    doc = os.path.join(ROOT, "docs", "x.md")
    assert local_target(doc, "https://example.com/a.md") is None
    assert local_target(doc, "#section") is None
    assert local_target(doc, "../README.md#try-it") == os.path.join(ROOT, "README.md")
