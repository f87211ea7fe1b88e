"""torchmeg's dependencies, run at both ends of their ranges; the test install's lock moved forward.

    python tools/deps.py range low          # every package at the lower bound pyproject declares
    python tools/deps.py range new          # every package at its newest release within the bounds
    python tools/deps.py lock               # the newest releases; the whole suite; the lock rewritten if green

`range END` builds a fresh venv (this machine's torch wheel, `--torch`), installs torchmeg with the test
extra with every package pyproject bounds held at that end (low: `name==lower bound`; new: nothing held,
pip takes the newest release inside the bounds), and runs the tests that touch those packages
(TOUCHES below) and the quick tier. One line per package at the end: the version that ran.

`lock` builds a fresh venv with the newest releases (no lock), runs the README's test command's
pytest there, and writes `constraints-test.txt` (every installed package but torchmeg, `pip freeze`)
only when the suite is green; else it prints what failed and the packages whose versions differ from
the committed lock, and leaves the lock as it was. The README's test command and .ci/run install the
test extra against that file (`pip install -c constraints-test.txt`): a release on PyPI cannot turn
main red between two commits; moving the lock is a commit of its own.

Why a pip constraints file and not uv's lock: the README installs with pip, and this machine's CPU
torch wheel is found by pip alone (uv resolves torch from the index: a CUDA build of ~3 GB); a
constraints file holds versions without asking pip to install what the extra does not name.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "constraints-test.txt")

# The test files that exercise each package torchmeg's code imports (core and extras); the range
# run takes their union with the quick tier.
TOUCHES = {
    # core: tests/test_core_install.py runs pretraining, SFT, DPO, GRPO, generate, eval, plan and
    # convert on the core packages alone; the files beside it use each one more
    "torchao": ["tests/test_core_install.py", "tests/test_compiler.py"],
    "torchdata": ["tests/test_core_install.py", "tests/test_data.py"],
    "tensorboard": ["tests/test_core_install.py", "tests/test_train.py"],
    "numpy": ["tests/test_core_install.py", "tests/test_data.py"],
    "tokenizers": ["tests/test_core_install.py", "tests/test_chat_targets.py"],
    "safetensors": ["tests/test_core_install.py", "tests/test_convert.py"],
    "jinja2": ["tests/test_core_install.py", "tests/test_chat_targets.py"],
    # extras
    "transformers": ["tests/test_hf_models.py", "tests/test_convert.py", "tests/test_chat_targets.py"],
    "fastapi": ["tests/test_serve.py"],
    "uvicorn": ["tests/test_serve.py"],
    "prometheus_client": ["tests/test_serve.py"],
    "pyarrow": ["tests/test_data.py", "tests/test_sft.py"],
}


def bounds() -> dict[str, tuple[str | None, str | None]]:
    """{package: (lower, upper)} of every requirement pyproject bounds, core and extras."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    out = {}
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-\[\]]+?)(?:\[[^\]]*\])?\s*((?:[<>=!~]=?\s*[^,;]+,?\s*)*)(;.*)?$", r)
        name, spec = m.group(1).lower().replace("-", "_"), m.group(2)
        low = re.search(r">=\s*([^,;\s]+)", spec) or re.search(r"==\s*([^,;\s]+)", spec)
        high = re.search(r"<\s*([^,;=\s]+)", spec)
        prev = out.get(name, (None, None))
        out[name] = (low.group(1) if low else prev[0], high.group(1) if high else prev[1])
    return out


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def venv(path: str, torch_version: str, constraints: str | None) -> str:
    shutil.rmtree(path, ignore_errors=True)
    run([sys.executable, "-m", "venv", path], check=True)
    py = os.path.join(path, "bin", "python")
    run([py, "-m", "pip", "install", "-q", f"torch=={torch_version}"], check=True)
    extra = ["-c", constraints] if constraints else []
    run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"] + extra, check=True)
    return py


def pins(text: str) -> dict[str, str]:
    """{package: version} of the `name==version` lines of a freeze or a constraints file."""
    return {n.lower().replace("-", "_"): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", text, re.M)}


def versions(py: str) -> dict[str, str]:
    return pins(subprocess.run([py, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                               check=True).stdout)


def pytest(py: str, args: list[str]) -> subprocess.CompletedProcess:
    """pytest in the venv, its output shown as it comes (a run of the suite takes minutes) and kept."""
    cmd = [py, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--timeout=300", "-p", "no:cacheprovider"] + args
    print("+ " + " ".join(cmd), flush=True)
    with subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as p:
        lines = []
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    return subprocess.CompletedProcess(cmd, p.returncode, "".join(lines), "")


def range_end(end: str, torch_version: str, base: str) -> int:
    b = bounds()
    # (the packages torchmeg's code imports; test-only references resolve to what fits beside them)
    held = {n: b[n][0] for n in TOUCHES if b.get(n, (None,))[0]} if end == "low" else {}
    cons = os.path.join(base, f"{end}.txt")
    os.makedirs(base, exist_ok=True)
    with open(cons, "w") as fh:
        fh.writelines(f"{n}=={v}\n" for n, v in sorted(held.items()))
    py = venv(os.path.join(base, f"venv-{end}"), torch_version, cons)
    got = versions(py)
    files = sorted({f for fs in TOUCHES.values() for f in fs if os.path.exists(os.path.join(ROOT, f))})
    t0 = time.monotonic()
    quick = pytest(py, ["-m", "not slow", "tests"])
    touched = pytest(py, files)
    print(f"\n== {end} end (torch {torch_version}), {time.monotonic() - t0:.0f} s of tests")
    for n in sorted(TOUCHES):
        lo, hi = b.get(n, (None, None))
        print(f"{n:<18} ran {got.get(n, 'absent'):<10} declared >= {lo or '-'}{f', < {hi}' if hi else ''}")
    print(f"quick tier: {_last(quick.stdout)}")
    print(f"{len(files)} files touching them: {_last(touched.stdout)}")
    return 0 if quick.returncode == touched.returncode == 0 else 1


def lock(torch_version: str, base: str) -> int:
    py = venv(os.path.join(base, "venv-lock"), torch_version, None)
    got = {n: v for n, v in versions(py).items() if n != "torch"}  # (torch: the README's own pin)
    old = {}
    if os.path.exists(LOCK):
        with open(LOCK) as fh:
            old = pins(fh.read())
    moved = [f"{n} {old.get(n, '-')} -> {v}" for n, v in sorted(got.items()) if old.get(n) != v]
    p = pytest(py, ["-x", "tests"])
    print("versions that moved: " + ("; ".join(moved) or "none"))
    if p.returncode != 0:
        print(f"suite red ({_last(p.stdout)}): the lock stays as it was; what broke is above")
        return 1
    with open(LOCK, "w") as fh:
        fh.write(f"# The test install's lock: every package the README's test command installed on "
                 f"{time.strftime('%Y-%m-%d')}, with torch {torch_version},\n# when the whole suite passed "
                 f"({_last(p.stdout)}). Written by `python tools/deps.py lock`; pip install -c this file.\n")
        fh.writelines(f"{n}=={v}\n" for n, v in sorted(got.items()))
    print(f"suite green ({_last(p.stdout)}): {LOCK} written")
    return 0


def _last(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return lines[-1].strip("= ") if lines else "no result"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("range")
    r.add_argument("end", choices=["low", "new"])
    sub.add_parser("lock")
    ap.add_argument("--torch", default="2.13.0", help="the torch release the venvs install (default: this machine's wheel)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "torchmeg-deps"), help="where the venvs go")
    a = ap.parse_args()
    return range_end(a.end, a.torch, a.dir) if a.cmd == "range" else lock(a.torch, a.dir)


if __name__ == "__main__":
    sys.exit(main())
