"""torchmeg's shape, read from its source with `ast`: the import graph (function-level imports
included) has no cycle and points one way down the layers of docs/architecture.md.

How the graph models Python: `from P import name` is an edge to submodule P.name when there is one,
else to module P. Importing a submodule also runs its parent packages' `__init__`, so each module
depends on those too. A package `__init__` contributes only its module-level imports: its public
names resolve lazily in `__getattr__` (PEP 562), which runs only when a user touches the name, and
no torchmeg module may import such a lazily-resolved name (checked below), so those imports never
run inside torchmeg's own import chains.
"""
from __future__ import annotations

import ast
import os
import re
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "torchmeg")
MAX_LINES = 400

# The packages, bottom up: each may import itself and those listed (docs/architecture.md draws it).
PACKAGE_DEPS = {
    "config": set(),                               # the recipe, its checks, the Layout record, errors
    "kernels": set(),                              # fused ops: plain tensors in, tensors out
    "models": {"config"},                          # plain single-device PyTorch
    "data": {"config", "kernels"},                 # (labels the loss skips: kernels.fused_ce.IGNORE)
    "runtime": {"config"},                         # process group, timeouts, watchdog, exit policy
    "parallel": {"config", "models", "kernels"},   # parallelize() and the compiler-side transforms
    "checkpoint": {"config", "models", "data", "runtime"},  # (data: a converted model's tokenizer)
    "observe": {"config", "models", "kernels", "parallel", "runtime"},
    "batching": {"config", "models"},              # generation: sampling, the continuous-batching engine
    "train": {"config", "models", "kernels", "data", "runtime", "parallel", "checkpoint", "observe", "batching"},
    "inference": {"config", "models", "kernels", "data", "runtime", "parallel", "checkpoint", "observe", "train",
                  "batching"},
    "plan": {"config", "models", "kernels", "data", "runtime", "parallel", "checkpoint", "observe", "train"},
    "serving": {"config", "models", "kernels", "data", "runtime", "parallel", "checkpoint", "observe", "train",
                "inference", "batching"},                      # the HTTP server over inference's sampling and loading
}
# Within config: errors and the Layout record import nothing of torchmeg; the schema only errors.
ALLOWED = {
    "torchmeg.config.errors": {"torchmeg.config"},
    "torchmeg.config.layout": {"torchmeg.config"},
    "torchmeg.config.sections": {"torchmeg.config"},
    "torchmeg.config.schema": {"torchmeg.config", "torchmeg.config.errors", "torchmeg.config.sections"},
}
# The top of the package: its __init__ and the thin `python -m torchmeg.X` entry modules.
ENTRY_MODULES = {"torchmeg", "torchmeg.generate", "torchmeg.eval", "torchmeg.launch", "torchmeg.convert",
                 "torchmeg.serve", "torchmeg.replicas"}
ENTRY_MAX_LINES = 12
ABOVE_PARALLEL = ("torchmeg.models.spec", "torchmeg.models.args")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.endswith("__init__.py")}


def _parents(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class Import:
    def __init__(self, src: str, target: str, line: int, function_level: bool, lazy_name: bool, text: str):
        self.src, self.target, self.line = src, target, line
        self.function_level, self.lazy_name, self.text = function_level, lazy_name, text


def _module_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


_TREES = {m: ast.parse(open(p).read(), p) for m, p in MODULES.items()}
_SOURCES = {m: open(p).read().splitlines() for m, p in MODULES.items()}


def _in_functions(tree: ast.Module) -> set[int]:
    """ids of the import statements inside a function (they run when it is called, not at import)."""
    out = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _imports(mod: str) -> list[Import]:
    """Every import statement of `mod` that reaches a torchmeg module, resolved."""
    tree = _TREES[mod]
    base = mod if mod in PACKAGES else mod.rpartition(".")[0]
    in_functions = _in_functions(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        fn_level = id(node) in in_functions
        text = "\n".join(_SOURCES[mod][node.lineno - 2:node.end_lineno])
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torchmeg":
                    out.append(Import(mod, a.name, node.lineno, fn_level, False, text))
            continue
        if node.level:
            parts = base.split(".")
            parent = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            parent = node.module or ""
        if parent.split(".")[0] != "torchmeg":
            continue
        for a in node.names:
            sub = f"{parent}.{a.name}"
            if sub in MODULES:
                out.append(Import(mod, sub, node.lineno, fn_level, False, text))
            else:
                lazy = parent in PACKAGES and a.name not in _module_level_names(_TREES[parent])
                out.append(Import(mod, parent, node.lineno, fn_level, lazy, text))
    return out


IMPORTS = {m: _imports(m) for m in MODULES}


def _graph() -> dict[str, set[str]]:
    g = defaultdict(set)
    for mod, imps in IMPORTS.items():
        for p in _parents(mod):
            g[mod].add(p)
        for imp in imps:
            if mod in PACKAGES and imp.function_level:
                continue  # a facade's lazy names (see the module docstring)
            g[mod].add(imp.target)
            g[mod].update(_parents(imp.target))
        g[mod].discard(mod)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(MODULES):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_code():
    """Guards the checks below against reading nothing: known edges, function-level ones included."""
    g = _graph()
    assert "torchmeg.train.validate" in g["torchmeg.train.cli"]
    assert "torchmeg.models.spec" in g["torchmeg.train.validate"]
    assert "torchmeg.models" in g["torchmeg.models.llama"]  # parent package
    assert any(i.function_level for imps in IMPORTS.values() for i in imps)  # the facades' lazy names
    assert len(MODULES) > 50


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_detected():
    """The detector itself, on the real modules with one cycle added."""
    fake = {m: set() for m in MODULES}
    fake["torchmeg.config.errors"] = {"torchmeg.config"}
    fake["torchmeg.config"] = {"torchmeg.config.errors"}
    assert ["torchmeg.config", "torchmeg.config.errors"] in _cycles(fake)


def _offenders(pred) -> list[str]:
    return [f"{i.src}:{i.line} imports {i.target}" for imps in IMPORTS.values() for i in imps if pred(i)]


def test_layers_point_down():
    bad = []
    for mod, allowed in ALLOWED.items():
        bad += _offenders(lambda i, m=mod, a=allowed: i.src == m and i.target not in a)
    # The parallel code gets what it needs about a model as data; it never reads the registry.
    bad += _offenders(lambda i: i.src.startswith("torchmeg.parallel") and i.target.startswith(ABOVE_PARALLEL))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and f"torchmeg.{parts[1]}" in PACKAGES else None


def test_packages_import_only_the_packages_below():
    """Package-level rules: the graph of packages has no cycle (each imports only those listed
    below it in PACKAGE_DEPS), and every package of torchmeg is in the table."""
    assert {m.split(".")[1] for m in PACKAGES if m != "torchmeg"} == set(PACKAGE_DEPS)
    bad = []
    for imps in IMPORTS.values():
        for i in imps:
            src, dst = _package(i.src), _package(i.target)
            if src and dst and src != dst and dst not in PACKAGE_DEPS[src]:
                bad.append(f"{i.src}:{i.line} ({src}) imports {i.target} ({dst})")
            if src and dst is None and i.target != "torchmeg" and i.target not in ENTRY_MODULES:
                bad.append(f"{i.src}:{i.line} imports {i.target}, outside every package")
            if src and i.target in ENTRY_MODULES - {"torchmeg"}:
                bad.append(f"{i.src}:{i.line} imports the entry module {i.target}")
    assert not bad, "imports against the package rules:\n" + "\n".join(bad)
    order = list(PACKAGE_DEPS)
    assert all(order.index(d) < order.index(p) for p, deps in PACKAGE_DEPS.items() for d in deps)


def test_the_top_holds_only_entry_modules_and_packages():
    top = {m for m in MODULES if m.count(".") == 1 and m not in PACKAGES}
    assert top == ENTRY_MODULES - {"torchmeg"}, top
    for m in top:
        assert len(_SOURCES[m]) <= ENTRY_MAX_LINES, f"{MODULES[m]}: an entry module only delegates"


def test_models_import_nothing_distributed():
    bad = []
    for mod, tree in _TREES.items():
        if not mod.startswith("torchmeg.models"):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{mod}:{node.lineno} {n}" for n in names if n.startswith("torch.distributed")]
    assert not bad, bad


DTENSOR_CALLS = {"to_local", "full_tensor", "redistribute", "from_local", "device_mesh", "placements"}


def test_models_handle_no_dtensor():
    """Nor do they read DTensors themselves (duck-typed or not): a sharded tensor is handed to a model
    as a plain one by the parallel code (a style's hooks, or a swappable view such as `tp_local`)."""
    bad = [f"{mod}:{node.lineno} .{node.attr}" for mod, tree in _TREES.items() if mod.startswith("torchmeg.models")
           for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in DTENSOR_CALLS]
    bad += [f"{mod}:{node.lineno} hasattr(.., {node.args[1].value!r})" for mod, tree in _TREES.items()
            if mod.startswith("torchmeg.models") for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr", "getattr") and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in DTENSOR_CALLS]
    assert not bad, bad


def test_no_module_imports_a_facade_name():
    """Internal code imports from the submodule that defines a name, never through a package's lazy
    facade (which would hide the real edge and could close a cycle at first use)."""
    bad = _offenders(lambda i: i.lazy_name and i.src not in PACKAGES)
    assert not bad, bad


def test_package_inits_import_nothing_at_module_level():
    # but the root's own helper (torchmeg._facade): importing a subpackage has run torchmeg/__init__ already
    bad = _offenders(lambda i: i.src in PACKAGES and not i.function_level and not (i.target == "torchmeg"
                                                                                  and not i.lazy_name))
    assert not bad, bad


def test_function_level_imports_say_why():
    """Imports sit at the top of files; one inside a function (heavy optional packages: transformers,
    torchao; a facade's lazy names) carries a comment saying 'lazy' on its line or the line above."""
    bad = []
    for mod, tree in _TREES.items():
        in_functions = _in_functions(tree)
        lines = _SOURCES[mod]
        for node in ast.walk(tree):
            if id(node) in in_functions:
                around = " ".join(lines[max(0, node.lineno - 2):node.end_lineno])
                if "lazy" not in around.lower() and not (mod in PACKAGES and _in_getattr(tree, node)):
                    bad.append(f"{MODULES[mod]}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "function-level imports without a reason:\n" + "\n".join(bad)


def _in_getattr(tree: ast.Module, node: ast.AST) -> bool:
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
            if any(n is node for n in ast.walk(fn)):
                return True
    return False


def test_modules_stay_readable():
    long = {MODULES[m]: len(lines) for m, lines in _SOURCES.items() if len(lines) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("pattern, allowed", [
    (r"ParallelDims\.from_config\(", {"torchmeg/train/validate.py"}),  # the layout is derived once
    (r"Trainer\.__new__", set()),                                # no forged trainers
    (r"global_batch_size\s*//", {"torchmeg/train/validate.py"}),       # the accumulation formula
    (r"\.uses_loss_parallel\(", {"torchmeg/train/validate.py", "torchmeg/parallel/parallelize.py"}),
])
def test_derived_in_one_place(pattern, allowed):
    found = {os.path.relpath(MODULES[m], ROOT) for m, lines in _SOURCES.items()
             if any(re.search(pattern, line) for line in lines)}
    assert found <= allowed and (found or not allowed), (pattern, found)
