"""Every ```python block of README.md and docs/ runs as a reader runs it: pasted into a file in an
empty folder and started in a fresh process — under torchrun with the world size its first line
names (`# torchrun --nproc_per_node=N file.py`), else `python file.py`. A block that prints losses
must show the last below the first (it trains). A snippet that stops working fails here."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from launch import ROOT

DOCS = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))


def snippets() -> list[tuple[str, int, str]]:
    """(doc, line, source) for each fenced ```python block."""
    out = []
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc)).read().splitlines()
        start = None
        for n, line in enumerate(lines, 1):
            if start is None and line.strip() == "```python":
                start = n
            elif start is not None and line.strip() == "```":
                out.append((doc, start, "\n".join(lines[start:n - 1]) + "\n"))
                start = None
    return out


SNIPPETS = snippets()


def test_the_docs_hold_snippets():
    """Guards the test below against reading nothing: docs/models.md's "Your own model" is found."""
    assert any(doc == "docs/models.md" and "torchmeg.parallelize(" in src for doc, _, src in SNIPPETS), SNIPPETS


@pytest.mark.slow
@pytest.mark.parametrize("doc, line, source", SNIPPETS, ids=[f"{d}:{n}" for d, n, _ in SNIPPETS])
def test_every_python_snippet_runs(doc, line, source, tmp_path):
    first = source.splitlines()[0]
    world = re.match(r"#\s*torchrun\b.*--nproc_per_node[= ](\d+)", first)
    path = tmp_path / "snippet.py"
    path.write_text(source)
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world.group(1)}"]
                              if world else []) + [str(path)]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"{doc}:{line} exits {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    losses = [float(x) for x in re.findall(r"\bloss[ =:|]+([0-9.]+)", p.stdout)]
    if losses:
        assert len(losses) >= 2 and losses[-1] < losses[0], f"{doc}:{line}: the loss did not fall: {losses}"
