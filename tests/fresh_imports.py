"""Run each import statement as the first torchmeg line of a fresh interpreter, cheaply.

    python tests/fresh_imports.py < cases.json      # [["label", "python source"], ...]

Importing torch costs ~2 s a process; a hundred fresh interpreters would cost minutes. This process
imports the libraries the cases would (torch, dynamo, transformers...: what a first child running
every case leaves in sys.modules) but no torchmeg module, then forks one child per case: each child
starts with no torchmeg module loaded, exactly as a user's first line does, and runs its source. Prints one JSON line: {"label": null} for a case that ran, else the error's last
line (a RecursionError in a facade shows as itself). Exit 1 if torchmeg was imported before forking.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback



def _ours(name: str) -> bool:
    return name == "torchmeg" or name.startswith("torchmeg.") or name == "__case__"


def _run(source: str) -> str | None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = ""
        try:
            exec(compile(source, "<case>", "exec"), {"__name__": "__case__"})
        except BaseException as e:  # noqa: BLE001 - reported, whatever it is
            msg = (traceback.format_exception_only(type(e), e)[-1].strip() or type(e).__name__)[:500]
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return f"the child exited with {os.waitstatus_to_exitcode(status)}"
    return out.decode() or None


def _warm(cases) -> None:
    """Import here what the cases import beyond torchmeg: a first child runs every case and reports
    its sys.modules; each module that is not torchmeg's is imported here, parents first."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        _run("\n".join(f"try:\n    exec({src!r}, {{}})\nexcept BaseException:\n    pass" for _, src in cases)
             + f"\nimport json, sys\nopen({path!r}, 'w').write(json.dumps(sorted(sys.modules)))")
        names = json.load(open(path))
    finally:
        os.unlink(path)
    for name in sorted((n for n in names if not _ours(n)), key=lambda n: (n.count("."), n)):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that imports only in its own context: skipped
            pass


def main() -> int:
    cases = json.load(sys.stdin)
    _warm(cases)
    loaded = sorted(m for m in sys.modules if _ours(m))
    if loaded:
        print(f"torchmeg modules loaded before forking: {loaded}", file=sys.stderr)
        return 1
    print(json.dumps({label: _run(source) for label, source in cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
