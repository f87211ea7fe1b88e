"""Every command line in README.md and docs/ parses: the files it names exist, and the recipe keys it
overrides exist in the schema with values of the right type (torchmeg's own loader judges them).
A doc that drifts from the code fails here instead of on a reader's machine."""
from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from launch import ROOT
from torchmeg.config.schema import load_config, sections

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
STARTS = ("python", "python3", "torchrun", "bash", "sbatch")
LOCAL = ("recipes/", "tools/", "examples/", "docs/", "tests/", "torchmeg/")


def _commands(path: str) -> list[tuple[int, str]]:
    """(line number, command) for each shell command in the file's code blocks and inline code: a
    line of a fenced block, or a `$ `-prompted one, joined over trailing backslashes and split on &&."""
    lines = open(os.path.join(ROOT, path)).read().splitlines()
    out, fenced, pending, start = [], False, "", 0
    for n, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            out += [(n, m) for m in re.findall(r"`((?:python3?|torchrun) -m torchmeg[^`]*)`", line)]
            continue
        text = line.strip()
        text = text[2:] if text.startswith("$ ") else text
        if pending:
            text, n = pending + " " + text, start
        if text.endswith("\\"):
            pending, start = text[:-1], n if not pending else start
            continue
        pending = ""
        for part in text.split("&&"):
            part = part.strip()
            if part.split(" ", 1)[0] in STARTS:
                out.append((n, part))
    return out


def _check(cmd: str) -> str | None:
    try:
        toks = shlex.split(cmd, comments=True)
    except ValueError as e:
        return f"does not parse as a shell line ({e})"
    for t in toks:
        for p in re.split(r"[=,]", t):
            if p.startswith(LOCAL) and not glob.glob(os.path.join(ROOT, p.rstrip("/"))) and "*" not in p:
                if not os.path.exists(os.path.join(ROOT, os.path.dirname(p))) or p.endswith((".py", ".toml", ".md", ".sbatch", ".json")):
                    return f"{p}: no such file"
    if "torchmeg." not in cmd or "-m" not in toks:
        return None
    config, overrides, i = None, [], 0
    secs = set(sections())
    while i < len(toks):
        t = toks[i]
        if t == "--config" and i + 1 < len(toks):
            config, i = toks[i + 1], i + 2
            continue
        if t.startswith("--config="):
            config = t.split("=", 1)[1]
        elif t.startswith("--") and "." in t.split("=", 1)[0] and t[2:].split(".", 1)[0] in secs:
            if "=" in t:
                overrides.append(t)
            elif i + 1 < len(toks) and not toks[i + 1].startswith("--"):
                overrides += [t, toks[i + 1]]
                i += 1
            else:
                overrides.append(t)
        i += 1
    if config and not config.startswith(LOCAL):
        return None  # a user's own recipe (a placeholder path): nothing here to check it against
    try:
        load_config(os.path.join(ROOT, config) if config else None, overrides)
    except Exception as e:  # noqa: BLE001 - the loader's own one-line error is the finding
        return f"{type(e).__name__}: {e}"
    return None


CASES = [(doc, n, c) for doc in DOCS for n, c in _commands(doc)]


def test_the_docs_hold_commands():
    """Guards the test below against reading nothing: the README's quick start is found."""
    readme = [c for d, _, c in CASES if d == "README.md"]
    assert any("torchmeg.train --config recipes/debug_llama.toml" in c for c in readme), readme
    assert any("pytest" in c for c in readme) and len(CASES) > 40


def test_a_wrong_key_is_caught():
    assert "unknown key" in _check("python -m torchmeg.train --config recipes/debug_llama.toml --training.stpes=5")
    assert "no such file" in _check("python tools/no_such_tool.py --x 1")


@pytest.mark.parametrize("doc, line, cmd", CASES, ids=[f"{d}:{n}" for d, n, _ in CASES])
def test_every_documented_command_parses(doc, line, cmd):
    if "stpes" in cmd:  # the README's own example of a bad key
        return
    problem = _check(cmd)
    assert problem is None, f"{doc}:{line}: {cmd}\n  {problem}"


@pytest.mark.slow
def test_architecture_names_every_module():
    """docs/architecture.md, the map of the package by job, names every module of torchmeg/ (a module
    added without a place on the map fails here)."""
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    modules = [os.path.relpath(p, os.path.join(ROOT, "torchmeg")) for p in
               glob.glob(os.path.join(ROOT, "torchmeg", "**", "*.py"), recursive=True)]
    missing = sorted(m for m in modules if not m.endswith("__init__.py") and os.path.basename(m) not in text)
    assert len(modules) > 60 and not missing, f"modules docs/architecture.md does not name: {missing}"


def test_readme_is_one_screen():
    """The README stays one screen; the depth lives in docs/."""
    n = len(open(os.path.join(ROOT, "README.md")).read().splitlines())
    assert 50 < n <= 250, f"README.md has {n} lines; move detail into docs/"
