"""The core install, emulated in the test venv (which holds every extra): with TORCHMEG_CORE_ONLY=1 and
this folder on PYTHONPATH, every package that torchmeg's own requirements do not bring (pip install -e .,
no extras) is not found, in this process and in every Python process it starts.

Which packages are core is read, not listed: the closure of torchmeg's requirements without extras (each
requirement's own requirements, markers evaluated for this interpreter) plus what a fresh venv holds
(pip, setuptools). Every other installed distribution's top-level modules are hidden from every import
finder, so `import fastapi` raises ModuleNotFoundError and `importlib.util.find_spec("fastapi")` is None,
exactly as where it was never installed.
"""
import os
import sys

if os.environ.get("TORCHMEG_CORE_ONLY") == "1":
    import importlib.machinery
    import importlib.metadata as md
    import re

    def _norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    def _requires(dist):
        from packaging.requirements import Requirement  # pytest's own requirement: in the test venv
        out = []
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                out.append(_norm(req.name))
        return out

    dists = {}
    for d in md.distributions():
        dists.setdefault(_norm(d.metadata["Name"]), d)
    core, todo = {"pip", "setuptools"}, ["torchmeg"]
    while todo:
        name = todo.pop()
        if name in core and name != "torchmeg" or name not in dists:
            continue
        core.add(name)
        todo.extend(r for r in _requires(dists[name]) if r not in core)
    owners = {}
    for top, names in md.packages_distributions().items():
        owners[top] = {_norm(n) for n in names}
    HIDDEN = frozenset(top for top, names in owners.items() if not names & core and top not in sys.stdlib_module_names)
    CORE_TOPS = frozenset(top for top, names in owners.items() if names & core)

    def _inside_core(entries):
        """The path entries inside a core package's own folder: setuptools puts its vendored copies
        (setuptools/_vendor: more_itertools, jaraco, ...) on sys.path, and a core install finds a
        hidden name there (torch's cpp_extension, which inductor's CPU compile imports, needs them)."""
        out = []
        for entry in entries or ():
            parts = os.path.normpath(str(entry)).split(os.sep)
            if "site-packages" in parts:
                i = len(parts) - 1 - parts[::-1].index("site-packages")
                if i + 1 < len(parts) and parts[i + 1] in CORE_TOPS:
                    out.append(entry)
        return out

    class _Hide:
        """Wraps an import finder: a hidden package is not there, except a core package's own copy."""

        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            find = getattr(self.inner, "find_spec", None)
            if find is None:
                return None
            if name.partition(".")[0] in HIDDEN:
                if self.inner is not importlib.machinery.PathFinder:
                    return None
                where = _inside_core(sys.path if path is None else path)
                if not where or (path is not None and len(where) != len(list(path))):
                    return None
                return find(name, where, target)
            return find(name, path, target)

        def invalidate_caches(self):
            if hasattr(self.inner, "invalidate_caches"):
                self.inner.invalidate_caches()

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
