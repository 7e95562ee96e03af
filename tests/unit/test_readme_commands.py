"""Every shell command shown in README.md and docs/*.md names things that exist.

Fenced blocks labelled bash/sh/shell/console (and unlabelled blocks that start
with a command) are split into commands. Per command:

* ``python -m MODULE``: the module is found (without importing it); for
  ``eldr_sglang.*``, ``benchmark.*``, ``tools.*``, ``sglang.launch_server``,
  ``sglang.bench_serving`` and ``sglang_router.launch_router`` every ``--flag`` is
  one the CLI accepts (the repository's own from their ``--help``);
* ``python path.py`` / ``bash path.sh``: the file exists; scripts in tools/ and
  benchmark/ answer ``--help`` and accept every ``--flag`` used;
* ``make TARGET``: the Makefile defines the target;
* ``curl`` to the ELDR router: the path is one of its routes.

Nothing is started: flags come from ``--help`` output, from the parsers'
option strings (in a subprocess) or from the source.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console", "shell-session", "zsh"}
# first words that make an unlabelled block a shell block
SHELL_START = {"python", "python3", "make", "bash", "sh", "pip", "pip3", "curl", "git", "apt-get", "sudo",
               "export", "cd", ".", "source", "uv", "docker", "pytest"}
PREFIX_WORDS = {"sudo", "time", "nohup", "exec", "env"}
SEPARATORS = {"&&", "||", ";", "|", "&", "|&", ";;"}
ROUTER_PORT = 8000
PROMISED = ("make demo", "make test")
HELP_TIMEOUT_S = 120
#: the repository's own packages: their CLIs' ``--help`` lists the flags a doc may use
OWN_PACKAGES = ("eldr_sglang", "benchmark", "tools")


@dataclass(frozen=True)
class Command:
    """One simple command of a doc code block, after variable expansion."""

    file: str
    line: int
    argv: tuple[str, ...]
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


# ---------------------------------------------------------------- parsing


def code_blocks(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """Fenced blocks of a Markdown file: (language, [(line number, text)])."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence: str | None = None
    lang = ""
    body: list[tuple[int, str]] = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if m:
                fence, lang, body = m.group(1), m.group(2).lower(), []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            blocks.append((lang, body))
            fence = None
        else:
            body.append((no, line))
    return blocks


def _first_word(text: str) -> str:
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:].strip()
    return text.split()[0] if text.split() else ""


def _is_python(word: str) -> bool:
    return bool(re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", word))


def is_shell_block(lang: str, body: list[tuple[int, str]]) -> bool:
    """A shell block: labelled so, or unlabelled and starting with a command."""
    if lang in SHELL_LANGS:
        return True
    if lang:
        return False
    for _, text in body:
        if text.strip() and not text.strip().startswith("#"):
            w = _first_word(text)
            return w in SHELL_START or _is_python(w) or bool(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w))
    return False


def logical_lines(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join ``\\`` continuations; in console blocks keep only ``$ `` lines."""
    console = any(t.lstrip().startswith("$ ") for _, t in body)
    out: list[tuple[int, str]] = []
    cur: tuple[int, str] | None = None
    for no, text in body:
        if cur is None:
            s = text.lstrip()
            if console:
                if not s.startswith("$ "):
                    continue  # output
                s = s[2:]
            cur = (no, "")
            text = s
        joined = cur[1] + " " + text.rstrip()
        if joined.endswith("\\"):
            cur = (cur[0], joined[:-1])
            continue
        out.append((cur[0], joined.strip()))
        cur = None
    if cur is not None:
        out.append((cur[0], cur[1].strip()))
    return out


def _tokens(text: str) -> list[str]:
    text = re.sub(r"\d*>&\d+", " ", text)  # 2>&1
    lex = shlex.shlex(text, posix=True, punctuation_chars="&|;")
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes: prose, not a command
        return []


def _expand(tokens: list[str], env: dict[str, str]) -> list[str]:
    out: list[str] = []
    for tok in tokens:
        m = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", tok)
        if m and m.group(1) in env:
            out.extend(env[m.group(1)].split())
            continue
        out.append(re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda v: env.get(v.group(1), v.group(0)), tok))
    return out


def _drop_redirections(tokens: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif re.fullmatch(r"\d*(>>?|<)", tok):
            skip = True
        elif not re.match(r"\d*(>>?|<)", tok):
            out.append(tok)
    return out


_ASSIGN = re.compile(r"[A-Za-z_]\w*=")


def commands_of(path: Path, root: Path = ROOT) -> list[Command]:
    """Every simple command in the shell blocks of one Markdown file."""
    rel = str(path.relative_to(root))
    cmds: list[Command] = []
    for lang, body in code_blocks(path):
        if not is_shell_block(lang, body):
            continue
        env: dict[str, str] = {}
        for no, text in logical_lines(body):
            segment: list[str] = []
            for tok in [*_tokens(text), ";"]:
                if tok not in SEPARATORS:
                    segment.append(tok)
                    continue
                words = segment[1:] if segment[:1] == ["export"] else segment
                if words and all(_ASSIGN.match(w) for w in words):  # NAME=value lines
                    for w in words:
                        k, v = w.split("=", 1)
                        env[k] = " ".join(_expand([v], env))
                elif segment:
                    argv = _drop_redirections(_expand(segment, env))
                    while argv and (_ASSIGN.match(argv[0]) or argv[0] in PREFIX_WORDS):
                        argv = argv[1:]  # FOO=1 cmd, sudo cmd
                    if argv:
                        cmds.append(Command(rel, no, tuple(argv), text))
                segment = []
    return cmds


def _kind(cmd: Command) -> str | None:
    word = cmd.argv[0]
    if _is_python(word):
        return "python"
    if word in ("bash", "sh"):
        return "script"
    if re.fullmatch(r"[\w./-]+\.(sh|py)", word):
        return "script"
    if word == "make":
        return "make"
    if word == "curl":
        return "curl"
    return None


ALL_COMMANDS = [c for f in DOC_FILES if f.is_file() for c in commands_of(f)]
CHECKED = [c for c in ALL_COMMANDS if _kind(c)]


# ---------------------------------------------------------------- lookups


def find_module(name: str) -> Path | None:
    """File of a module (``__main__.py`` for a package), found without importing
    anything but the top-level package's spec."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    origin = Path(spec.origin) if spec.origin and spec.origin not in ("built-in", "frozen") else None
    for part in parts[1:]:
        found: Path | None = None
        for loc in locations:
            base = Path(loc)
            if (base / part).is_dir():
                found, locations = base / part / "__init__.py", [str(base / part)]
                break
            for suffix in importlib.machinery.all_suffixes():
                if (base / (part + suffix)).is_file():
                    found, locations = base / (part + suffix), []
                    break
            if found:
                break
        if found is None:
            return None
        origin = found
    if origin is not None and origin.name == "__init__.py" or (origin is None and locations):
        main = Path(locations[0]) / "__main__.py"
        return main if main.is_file() else None
    return origin


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="1000", PYTHONWARNINGS="ignore")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HELP_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def help_text(prefix: tuple[str, ...]) -> tuple[int, str]:
    """(exit code, output) of ``python PREFIX --help``, cached."""
    r = _run([sys.executable, *prefix, "--help"])
    return r.returncode, r.stdout + r.stderr


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", text))


def _subcommands(text: str) -> set[str]:
    m = re.search(r"^ {2}\{([\w,.-]+)\}\s*$", text, re.M)
    return set(m.group(1).split(",")) if m else set()


def help_flags(prefix: tuple[str, ...], args: list[str]) -> tuple[set[str], str]:
    """Flags accepted by a CLI (and its subcommand, if ``args`` names one)."""
    rc, text = help_text(prefix)
    assert rc == 0, f"`python {' '.join(prefix)} --help` exited {rc}:\n{text[-2000:]}"
    subs = _subcommands(text)
    sub = next((a for a in args if not a.startswith("-") and a in subs), None)
    if sub:
        rc, sub_text = help_text((*prefix, sub))
        assert rc == 0, f"`python {' '.join(prefix)} {sub} --help` exited {rc}:\n{sub_text[-2000:]}"
        text += sub_text
    return flags_in(text), text


@functools.lru_cache(maxsize=None)
def _option_strings(code: str) -> frozenset[str]:
    """Option strings printed (as a JSON list) by a small Python snippet."""
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr[-2000:]
    return frozenset(json.loads(r.stdout.strip().splitlines()[-1]))


_PRINT_OPTS = "print(json.dumps([o for a in p._actions for o in a.option_strings]))"


def sglang_server_flags() -> frozenset[str]:
    """Flags of ``sglang.launch_server`` (ServerArgs), imported in a subprocess."""
    return _option_strings("import argparse, json\nfrom sglang.srt.server_args import ServerArgs\n"
                           "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n" + _PRINT_OPTS)


def eldr_flags() -> frozenset[str]:
    """The ``--eldr-*`` flags the plugin takes out of launch_server's argv."""
    return _option_strings("import json\nfrom eldr_sglang.patches.flags import _parser\np = _parser()\n" + _PRINT_OPTS)


def sglang_router_flags() -> frozenset[str]:
    """Flags of ``sglang_router.launch_router`` (RouterArgs)."""
    return _option_strings("import argparse, json\nfrom sglang_router.router_args import RouterArgs\n"
                           "p = argparse.ArgumentParser()\nRouterArgs.add_cli_args(p, use_router_prefix=False)\n"
                           + _PRINT_OPTS)


@functools.lru_cache(maxsize=None)
def static_flags(module: str) -> frozenset[str]:
    """``add_argument`` string literals of a module's source, following its
    same-package imports when it defines none (deprecated shims)."""
    path = find_module(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {a.value for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
             for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")}
    if not found:
        top = module.split(".")[0]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == top and n.module != module:
                found |= static_flags(n.module)
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"([^\s:=#][^:=]*?)\s*::?(?!=)", line)
        if m:
            targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return frozenset(targets)


@functools.lru_cache(maxsize=None)
def router_routes() -> frozenset[str]:
    """Paths the ELDR router serves: the route table of a PD router's app and a
    co-located one's, built (nothing started, no worker reached)."""
    code = ("from eldr_sglang.router.app import Router\n"
            "from eldr_sglang.router.colocated import ColocatedRouter\n"
            "kw = dict(health_interval=0, load_interval=0)\n"
            "apps = [Router([('http://127.0.0.1:9', None)], ['http://127.0.0.1:10'], 'round_robin', **kw),\n"
            "        ColocatedRouter(['http://127.0.0.1:10'], policy='round_robin', **kw)]\n"
            "for r in apps:\n"
            "    for res in r.build_app().router.resources():\n"
            "        print(res.canonical)\n")
    done = _run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-2000:]
    return frozenset(done.stdout.split())


# ---------------------------------------------------------------- checks


def used_flags(args: list[str]) -> list[str]:
    """``--flags`` of an argument list (``[--opt`` usage brackets allowed),
    up to a bare ``--``."""
    out: list[str] = []
    for a in args:
        if a == "--":
            break
        a = a.lstrip("[(").rstrip("])")
        if re.match(r"--[A-Za-z0-9]", a) and "$" not in a:
            out.append(a.split("=", 1)[0])
    return out


def _assert_flags(cmd: Command, flags: list[str], accepted: set[str] | frozenset[str], what: str) -> None:
    bad = [f for f in flags if f not in accepted]
    hints = {f: difflib.get_close_matches(f, sorted(accepted), n=1) for f in bad}
    assert not bad, f"{cmd.id}: {what} does not accept " + ", ".join(
        f"{f} (did you mean {hints[f][0]}?)" if hints[f] else f for f in bad) + f"\n  {cmd.text}"


def _router_urls(args: list[str]) -> list[str]:
    out = []
    for a in args:
        u = urlparse(a.strip("[]'\""))
        if u.scheme in ("http", "https") and u.netloc and (u.port == ROUTER_PORT or u.path.startswith("/eldr/")):
            out.append(u.path or "/")
    return out


def check_python(cmd: Command) -> None:
    argv = list(cmd.argv[1:])
    module = script = None
    while argv:
        a = argv.pop(0)
        if a == "-m":
            module = argv.pop(0) if argv else None
            break
        if a == "-c":
            pytest.skip("python -c")
        if a in ("-X", "-W", "-Q"):
            argv = argv[1:]
        elif not a.startswith("-"):
            script = a
            break
    args = argv
    interpreter = cmd.argv[0]
    if module and "/" in interpreter and not interpreter.startswith(".venv/"):
        # another virtualenv's interpreter (an optional install, e.g. Dynamo's): its own modules
        path = ROOT / interpreter
        if not path.is_file():
            pytest.skip(f"{interpreter} is not installed here (an optional virtualenv)")
        found = subprocess.run([str(path), "-c", f"import importlib.util as u, sys; "
                                f"sys.exit(u.find_spec({module!r}) is None)"], capture_output=True, timeout=120)
        assert found.returncode == 0, f"{cmd.id}: {interpreter} has no module {module}"
        return
    if module:
        assert find_module(module) is not None, f"{cmd.id}: no module {module} (or no __main__ in the package)"
        flags = used_flags(args)
        if module.split(".")[0] in OWN_PACKAGES:
            accepted, _ = help_flags(("-m", module), args)
            _assert_flags(cmd, flags, accepted, f"python -m {module}")
        elif module == "sglang.launch_server":
            _assert_flags(cmd, [f for f in flags if f.startswith("--eldr-")], eldr_flags(), "the ELDR plugin")
            _assert_flags(cmd, [f for f in flags if not f.startswith("--eldr-")],
                          sglang_server_flags() | {"--help"}, "sglang.launch_server")
            for i, a in enumerate(args[:-1]):
                if a == "--eldr-publish":
                    for path in _router_urls([args[i + 1]]):
                        assert path in router_routes(), f"{cmd.id}: the router has no route {path}"
        elif module in ("sglang.bench_serving", "sglang.benchmark.serving"):
            _assert_flags(cmd, flags, static_flags(module) | {"--help"}, module)
        elif module == "sglang_router.launch_router":
            _assert_flags(cmd, flags, sglang_router_flags(), module)
        return
    if script is None:
        pytest.skip("interactive python")
    path = ROOT / script
    assert path.is_file(), f"{cmd.id}: no file {script}"
    if Path(script).parts[0] in ("tools", "benchmark") and path.suffix == ".py":
        accepted, _ = help_flags((script,), args)
        _assert_flags(cmd, used_flags(args), accepted, script)


def _generator_of(cmd: Command, script: str) -> tuple[Command, str] | None:
    """The nearest earlier ``python -m eldr_sglang...`` command of the same doc that writes
    ``--out DIR`` where ``script`` lies (a generated, git-ignored file), and the path
    of ``script`` inside DIR."""
    for earlier in reversed(ALL_COMMANDS):
        if earlier.file != cmd.file or earlier.line >= cmd.line or earlier.argv[1:2] != ("-m",):
            continue
        args = list(earlier.argv)
        if not args[2].startswith("eldr_sglang") or "--out" not in args[:-1]:
            continue
        out = args[args.index("--out") + 1].rstrip("/") + "/"
        if script.startswith(out):
            return earlier, script[len(out):]
    return None


@functools.lru_cache(maxsize=None)
def generated_files(gen: Command) -> frozenset[str]:
    """What the generator command writes, run into a temporary --out directory."""
    import tempfile
    args = list(gen.argv)
    out_at = args.index("--out") + 1
    with tempfile.TemporaryDirectory() as tmp:
        args[out_at] = tmp
        done = _run([sys.executable, *args[1:]])
        assert done.returncode == 0, f"{gen.id}: {gen.text}\n{done.stderr[-2000:]}"
        return frozenset(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*") if p.is_file())


def check_script(cmd: Command) -> None:
    argv = list(cmd.argv)
    if argv[0] in ("bash", "sh"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        if not rest or "-c" in argv[1:]:
            pytest.skip("no script file")
        script = rest[0]
    else:
        script = argv[0]
    found = _generator_of(cmd, script)
    if found is not None:  # written by an earlier command of the doc: run it and look
        gen, inside = found
        assert inside in generated_files(gen), f"{cmd.id}: {gen.id} writes no {script}"
        return
    assert (ROOT / script).is_file(), f"{cmd.id}: no file {script}"


def check_make(cmd: Command) -> None:
    args = list(cmd.argv[1:])
    if any(a in ("-C", "-f", "--directory", "--file") or a.startswith(("-C", "-f")) for a in args):
        pytest.skip("another Makefile")
    targets = [a for a in args if not a.startswith("-") and "=" not in a and not a.isdigit()]
    missing = [t for t in targets if t not in make_targets()]
    assert not missing, f"{cmd.id}: Makefile has no target {', '.join(missing)}\n  {cmd.text}"


def check_curl(cmd: Command) -> None:
    paths = _router_urls(list(cmd.argv[1:]))
    if not paths:
        pytest.skip("not a router URL")
    for path in paths:
        assert path in router_routes(), f"{cmd.id}: the router has no route {path} ({sorted(router_routes())})"


CHECKS = {"python": check_python, "script": check_script, "make": check_make, "curl": check_curl}


# ---------------------------------------------------------------- tests


def test_docs_have_commands() -> None:
    """The parser finds commands in the README (guards against a parser that
    silently matches nothing)."""
    assert any(c.file == "README.md" for c in CHECKED), [c.argv for c in ALL_COMMANDS]


@pytest.mark.parametrize("cmd", CHECKED, ids=[c.id for c in CHECKED])
def test_doc_command(cmd: Command) -> None:
    """What the command names (module, script, flags, target, route) exists."""
    kind = _kind(cmd)
    assert kind is not None
    CHECKS[kind](cmd)


def test_promised_commands() -> None:
    """README shows the top-level commands in a code block and the Makefile
    defines their targets."""
    shown = {" ".join(c.argv) for c in ALL_COMMANDS if c.file == "README.md"}
    for promised in PROMISED:
        assert promised in shown, f"README.md shows no `{promised}` command"
        target = promised.split()[1]
        assert target in make_targets(), f"Makefile has no target {target}"


def test_parser_handles_shell_syntax(tmp_path: Path) -> None:
    """Continuations, prompts, comments, chains, env prefixes, variables."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "Prose.\n\n```console\n$ FOO=1 make demo  # comment\nsome output line\n"
        "$ cd x && python -m a.b \\\n    --flag 1 [--opt v] 2>&1 | tee log\n```\n\n"
        "```\nA=\"--x 1 --y\"\npython tools/t.py $A --z\n```\n\n```\nnot a command\n```\n")
    got = [(c.line, c.argv) for c in commands_of(doc, tmp_path)]
    assert got == [
        (4, ("make", "demo")),
        (6, ("cd", "x")),
        (6, ("python", "-m", "a.b", "--flag", "1", "[--opt", "v]")),
        (6, ("tee", "log")),
        (12, ("python", "tools/t.py", "--x", "1", "--y", "--z")),
    ]
    assert used_flags(["--flag", "1", "[--opt", "v]", "--", "--after"]) == ["--flag", "--opt"]
