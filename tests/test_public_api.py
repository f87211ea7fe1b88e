"""The documented API works in a fresh interpreter: every public name of every package facade, in
each import form (`import P; P.X`, `from P import X`), and every `from torchmeg... import X` and
`torchmeg.X` that README.md, docs/, examples/ and the package docstrings show, each run as the first
torchmeg line of a process (tests/fresh_imports.py forks one child per case from a process that has
imported torch but nothing of torchmeg). The suite imports everything up front, so only a fresh
process shows a facade that cannot resolve its own names (`torchmeg.Config()` was a RecursionError)."""
from __future__ import annotations

import glob
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from launch import ROOT

PKG = os.path.join(ROOT, "torchmeg")
INITS = sorted(glob.glob(os.path.join(PKG, "**", "__init__.py"), recursive=True))
PACKAGES = [os.path.relpath(os.path.dirname(p), ROOT).replace(os.sep, ".") for p in INITS]
SOURCES = (["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT)) + sorted(glob.glob("examples/*.py", root_dir=ROOT))
           + [os.path.relpath(p, ROOT) for p in INITS])
FILE_SUFFIXES = {"json", "toml", "md", "py", "txt", "log", "jsonl", "bin", "idx"}


def _is_module(dotted: str) -> bool:
    path = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def documented_forms() -> dict[str, str]:
    """label -> source, for each import form the docs show a reader."""
    out = {}
    for rel in SOURCES:
        text = open(os.path.join(ROOT, rel)).read()
        for m in re.finditer(r"from (torchmeg(?:\.\w+)*) import \(?([\w ,]+)", text):
            for name in filter(None, (n.strip().split(" as ")[0] for n in m.group(2).split(","))):
                out[f"from {m.group(1)} import {name}"] = f"from {m.group(1)} import {name}"
        for m in re.finditer(r"(?<![\w./-])torchmeg((?:\.\w+)+)", text):
            parts = ["torchmeg"] + m.group(1).lstrip(".").split(".")
            if parts[-1] in FILE_SUFFIXES:
                continue  # a file name (torchmeg.pending.json), not Python
            k = max(i for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i])))
            module = ".".join(parts[:k])
            if k == len(parts):
                out[f"import {module}"] = f"import {module}"
            else:
                out[f"{module}.{parts[k]}"] = f"import {module}\n{module}.{parts[k]}"
    return out


def facade_forms() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        for name in getattr(mod, "__all__", ()):
            out[f"{pkg}.{name}"] = f"import {pkg}\n{pkg}.{name}"
            out[f"from {pkg} import {name}"] = f"from {pkg} import {name}"
    return out


def _run_fresh(cases: dict[str, str]) -> dict[str, str | None]:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fresh_imports.py")], cwd=ROOT, text=True,
                       input=json.dumps(sorted(cases.items())), capture_output=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_facade_lists_its_lazy_names():
    """A package that resolves names lazily says which (`__all__`), each resolving to an object, and
    torchmeg's docstring lists exactly its public names."""
    lazy = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        if "__getattr__" in vars(mod):
            lazy.append(pkg)
            assert mod.__all__, pkg
            for name in mod.__all__:
                assert getattr(mod, name) is not None, f"{pkg}.{name}"
    assert {"torchmeg", "torchmeg.config", "torchmeg.models", "torchmeg.parallel"} <= set(lazy), lazy
    import torchmeg
    listed = re.search(r"Public API[^:]*:\s*([\w,\s]+)\.", torchmeg.__doc__).group(1)
    assert sorted(n.strip() for n in listed.split(",")) == torchmeg.__all__


def test_the_docs_forms_are_found():
    """Guards the test below against reading nothing: the forms issue #48 was found with."""
    forms = documented_forms()
    assert {"torchmeg.Config", "torchmeg.ParallelDims", "torchmeg.parallelize", "torchmeg.models.register",
            "from torchmeg.config import load_config"} <= set(forms), sorted(forms)
    assert "import torchmeg.train" in forms  # a module path stays a module path
    assert not any("pending" in k for k in forms)  # torchmeg.pending.json is a file


@pytest.mark.slow
def test_public_names_resolve_in_a_fresh_interpreter():
    cases = {**facade_forms(), **documented_forms()}
    # An unknown name is an AttributeError naming it (ImportError for the from-import), not a recursion.
    cases["unknown name"] = ("import torchmeg\ntry:\n    torchmeg.no_such_name\nexcept AttributeError as e:\n"
                             "    assert \"'no_such_name'\" in str(e), e\nelse:\n    raise AssertionError('resolved')")
    cases["unknown from-import"] = ("try:\n    from torchmeg.config import no_such_name\nexcept ImportError as e:\n"
                                    "    assert 'no_such_name' in str(e), e\nelse:\n    raise AssertionError('resolved')")
    cases["the issue's first line"] = "import torchmeg\ncfg = torchmeg.Config()\nassert cfg.training.steps > 0"
    assert len(cases) > 60
    failed = {k: v for k, v in _run_fresh(cases).items() if v is not None}
    assert not failed, "\n".join(f"{k!r}: {v}" for k, v in sorted(failed.items()))
