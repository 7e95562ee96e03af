"""Every relative link in README.md and docs/*.md resolves, and the README stays short.

A link ``[text](path)``, ``![alt](path)``, ``[ref]: path`` or an HTML
``href``/``src`` outside code names a file or folder of the repository; an
anchor ``#name`` (alone: the same file) names a heading of that Markdown file
(GitHub's slugs: lower case, punctuation dropped, spaces to ``-``, ``-1``,
``-2``, ... for repeats) or an explicit ``<a id="name">``. External links
(``http:``, ``https:``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 20_000


def doc_files(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


# ---------------------------------------------------------------- parsing

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ATTR = re.compile(r"""<[a-zA-Z][^>]*?\s(?:href|src)\s*=\s*["']([^"']+)["']""")
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*?(?:id|name)\s*=\s*["']([^"']+)["']""")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        out.append((no, _INLINE_CODE.sub("", line)))
    return out


def links_of(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    found: list[tuple[int, str]] = []
    for no, line in prose_lines(text):
        m = _REF_DEF.match(line)
        if m:
            found.append((no, m.group(1)))
            continue
        found += [(no, t) for t in _INLINE_LINK.findall(line)]
        found += [(no, t) for t in _HTML_ATTR.findall(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    kept = [c for c in text.strip().lower()
            if c.isalnum() or c in "-_ " or unicodedata.category(c).startswith("M")]
    return "".join(kept).replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """Heading slugs (repeats numbered as GitHub does) and explicit ``<a id>`` anchors."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        anchors.update(_HTML_ANCHOR.findall(line))
    fence: str | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        h = _HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every link of one Markdown file that does not resolve, as 'file:line: target (why)'."""
    rel = path.relative_to(root)
    problems: list[str] = []
    for no, target in links_of(path.read_text(encoding="utf-8")):
        where = f"{rel}:{no}: {target}"
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if not file_part:
            dest = path
        elif file_part.startswith("/"):
            dest = (root / file_part.lstrip("/")).resolve()
        else:
            dest = (path.parent / file_part).resolve()
        if dest != root and root not in dest.parents:
            problems.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            problems.append(f"{where} (no such file)")
            continue
        if anchor and dest.suffix.lower() == ".md":
            if unquote(anchor) not in anchors_of(dest.read_text(encoding="utf-8")):
                problems.append(f"{where} (no heading #{anchor} in {dest.relative_to(root)})")
    return problems


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n  " + "\n  ".join(problems)


def test_readme_links_every_docs_page() -> None:
    """Each docs page is reachable from the README's docs index."""
    targets = {t.partition("#")[0] for _, t in links_of((ROOT / "README.md").read_text(encoding="utf-8"))}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in targets]
    assert not missing, f"README.md links no docs page {missing}"


def test_readme_fits_on_a_screen() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes (limit {README_MAX_BYTES}): move detail to docs/"


def test_checker_finds_broken_links(tmp_path: Path) -> None:
    """The checker is not vacuous: a missing file, a missing heading and a link
    leaving the repository are reported; links in code and external ones are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("# Page A\n\n## Online calibration (`--online`)\n\n## Step\n\n## Step\n"
                                            '<a id="cpu-tpot"></a>text\n')
    (tmp_path / "README.md").write_text(
        "[ok](docs/A.md) [ok](docs/A.md#online-calibration---online) [ok](docs/A.md#step-1)\n"
        "[ok](docs/A.md#cpu-tpot) [ok](#readme) [ok](https://example.com/x) ![ok](docs/A.md)\n"
        "# README\n\n`[code](missing.md)`\n\n```\n[code](missing.md)\n```\n\n"
        "[bad](docs/B.md) [bad](docs/A.md#nowhere) [bad](#nothing) [bad](../outside.md)\n"
        "[ref]: docs/C.md\n")
    problems = broken_links(tmp_path / "README.md", tmp_path)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "docs/B.md", "docs/A.md#nowhere", "#nothing", "../outside.md", "docs/C.md"], problems


def test_slug_matches_github() -> None:
    assert slug("Online calibration (`--online`)") == "online-calibration---online"
    assert slug("CPU compatibility (plugin, never edited site-packages)") == \
        "cpu-compatibility-plugin-never-edited-site-packages"
    assert slug("`make demo`") == "make-demo"
    assert slug("Signature message (engine → router)") == "signature-message-engine--router"
    assert slug("2. Place experts (TP×EP decode servers only)") == "2-place-experts-tpep-decode-servers-only"
