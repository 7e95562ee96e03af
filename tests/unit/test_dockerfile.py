"""The container image recipe (``Dockerfile``, ``.dockerignore``) and the image the manifests use.

Where a docker daemon answers, the image is built; everywhere else the recipe is linted:
parsed with BuildKit's own parser (the ``dockerfile`` package), base image pinned to
the SGLang version this package pins, the package installed with that pin, every COPY
source present in the build context and not excluded by ``.dockerignore``, and the
tag ``deploy k8s`` writes equal to the one the Dockerfile and docs/DEPLOY.md build."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml

from eldr_sglang.deploy import load_description
from eldr_sglang.deploy.image import BASE_IMAGES, DEFAULT_VENDOR, SGLANG_VERSION, build_command, default_image
from tests.unit.test_deploy_k8s import generate

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def ignore_patterns(text: str) -> list[tuple[str, bool]]:
    """(pattern, excluded) per line of a .dockerignore, in order (``!`` re-includes)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            out.append((line.lstrip("!").strip("/"), not negated))
    return out


def ignored(path: str, patterns: list[tuple[str, bool]]) -> bool:
    """Whether ``path`` (relative to the context) is left out; the last matching line wins,
    a pattern matching a parent folder matches everything below it."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern, excluded in patterns:
        deep = pattern.replace("**/", "")
        if any(fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p.split("/")[-1], deep) for p in prefixes):
            result = excluded
    return result


def sglang_pin() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    return next(r.split("==")[1] for r in extra if r.startswith("sglang=="))


def dockerfile_problems(text: str, ignore_text: str, context: Path) -> list[str]:
    """What is wrong with a Dockerfile and its .dockerignore; [] when nothing."""
    commands = dockerfile.parse_string(text)
    out: list[str] = []
    args = {}
    for c in commands:
        if c.cmd == "ARG":
            name, _, value = c.value[0].partition("=")
            args[name] = value
    froms = [c for c in commands if c.cmd == "FROM"]
    if len(froms) != 1:
        out.append(f"{len(froms)} FROM lines (one stage expected)")
    base = froms[0].value[0] if froms else ""
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), base)
    if base != BASE_IMAGES[DEFAULT_VENDOR]:
        out.append(f"base image {base!r} is not {BASE_IMAGES[DEFAULT_VENDOR]!r} (eldr_sglang/deploy/image.py)")
    for vendor, image in BASE_IMAGES.items():
        if not image.startswith("lmsysorg/sglang:") or f"v{SGLANG_VERSION}" not in image.split(":")[1]:
            out.append(f"{vendor} base image {image!r} is not SGLang's v{SGLANG_VERSION}")
    if args.get("SGLANG_VERSION") != SGLANG_VERSION or SGLANG_VERSION != sglang_pin():
        out.append(f"SGLang version: Dockerfile {args.get('SGLANG_VERSION')}, image.py {SGLANG_VERSION}, "
                   f"pyproject [sglang] {sglang_pin()}")
    runs = " ".join(" ".join(c.value) for c in commands if c.cmd == "RUN")
    if not re.search(r"pip install [^&]*\"?\.\[sglang\]\"?", runs):
        out.append('the package is not installed with its SGLang pin (pip install ".[sglang]")')
    if "SGLANG_VERSION" not in runs:
        out.append("the build does not check the installed SGLang version")
    patterns = ignore_patterns(ignore_text)
    copied = []
    for c in commands:
        if c.cmd in ("COPY", "ADD"):
            if any(f.startswith("--from") for f in c.flags):
                continue
            for source in c.value[:-1]:
                copied.append(source)
                if not (context / source).exists():
                    out.append(f"COPY {source}: not in the build context")
                elif ignored(source, patterns):
                    out.append(f"COPY {source}: excluded by .dockerignore")
    project = tomllib.loads((context / "pyproject.toml").read_text()) if (context / "pyproject.toml").exists() else {}
    needed = {project.get("project", {}).get("readme", "README.md"), "pyproject.toml",
              *(p.rstrip("*") for p in project.get("tool", {}).get("setuptools", {}).get("packages", {})
                .get("find", {}).get("include", []))}
    for path in sorted(needed):
        if not any(Path(c.rstrip("/")) == Path(path) for c in copied):
            out.append(f"{path}: the package build needs it, no COPY brings it")
    for heavy in (".venv", ".cache", "models", "benchmark", "tests"):
        if not ignored(heavy, patterns):
            out.append(f".dockerignore lets {heavy}/ into the build context")
    return out


def test_the_recipe_lints_clean():
    assert dockerfile_problems(DOCKERFILE.read_text(), DOCKERIGNORE.read_text(), ROOT) == []


def test_the_lint_finds_what_is_wrong():
    """Each rule of the lint fails on a recipe that breaks it."""
    good, ignore = DOCKERFILE.read_text(), DOCKERIGNORE.read_text()
    latest = good.replace(f"ARG BASE_IMAGE={BASE_IMAGES[DEFAULT_VENDOR]}", "ARG BASE_IMAGE=lmsysorg/sglang:latest")
    assert any("base image" in p for p in dockerfile_problems(latest, ignore, ROOT))
    missing = good.replace("COPY eldr_sglang ./eldr_sglang", "COPY eldr_sglang_x ./eldr_sglang")
    assert {"COPY eldr_sglang_x: not in the build context",
            "eldr_sglang: the package build needs it, no COPY brings it"} <= set(
        dockerfile_problems(missing, ignore, ROOT))
    unpinned = good.replace('".[sglang]"', ".")
    assert any("SGLang pin" in p for p in dockerfile_problems(unpinned, ignore, ROOT))
    assert "COPY README.md: excluded by .dockerignore" in dockerfile_problems(
        good, ignore.replace("!README.md", ""), ROOT)
    assert ".dockerignore lets .venv/ into the build context" in dockerfile_problems(good, "!eldr_sglang/", ROOT)


def test_dockerignore_matching():
    patterns = ignore_patterns("*\n!eldr_sglang/\n**/__pycache__\n")
    assert ignored(".venv/bin/python", patterns) and ignored("README.md", patterns)
    assert not ignored("eldr_sglang/router/app.py", patterns)
    assert ignored("eldr_sglang/router/__pycache__/app.cpython-311.pyc", patterns)


@pytest.mark.parametrize("vendor", sorted(BASE_IMAGES))
def test_manifests_run_the_image_the_dockerfile_builds(tmp_path, vendor):
    """``deploy k8s`` without --image writes the tag that the documented ``docker build`` makes."""
    doc = load_description(preset="qwen3-30b-a3b-8p16d-mi300x")
    doc["vendor"] = vendor
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    files = generate(tmp_path, [str(path)], clusters=16)
    images = {c["image"] for docs in files.values() for d in docs if "template" in d.get("spec", {})
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {default_image(vendor)}
    command = build_command(vendor)
    assert command.endswith(f"-t {default_image(vendor)} .")
    assert command in (ROOT / "docs" / "DEPLOY.md").read_text()
    header = " ".join(l.lstrip("# ") for l in DOCKERFILE.read_text().splitlines() if l.startswith("#"))
    assert command in header


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.timeout(7200)
@pytest.mark.skipif(not _docker_daemon(), reason="no docker daemon reachable (docker info fails): the recipe "
                                                  "is linted instead")
def test_the_image_builds():
    tag = default_image(DEFAULT_VENDOR)
    build = subprocess.run(["docker", "build", "-t", tag, str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run(["docker", "run", "--rm", tag, "python3", "-m", "eldr_sglang.deploy", "presets"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "qwen3-30b-a3b-8p16d-mi300x" in run.stdout, run.stderr[-2000:]
