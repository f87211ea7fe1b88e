"""tools/bench.py runs settings side by side and writes its table, JSON and chart (no timing asserted)."""
import pytest
import json
import os
import subprocess
import sys

from conftest import ROOT, TINY


@pytest.mark.slow
def test_bench_writes_reports(tmp_path):
    model = [a for a in TINY if a.startswith(("--model.", "--data.seq_len"))]
    p = subprocess.run([sys.executable, "tools/bench.py", "--config", "recipes/debug_llama.toml", "--compile", "off,on",
                        "--ac", "none,full", "--steps", "2", "--warmup", "1", "--repeats", "2",
                        "--out", str(tmp_path)] + model,
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.load(open(tmp_path / "bench.json"))
    assert sorted(r["setting"] for r in rows) == ["compiled", "compiled ac=full", "eager", "eager ac=full"]
    for r in rows:
        assert len(r["step_ms_all"]) == 4 and r["tokens_per_sec"] > 0 and r["memory_gib"] > 0
        # A compiled setting really ran inductor kernels; an eager one none.
        assert (r["kernels"] > 0) == r["setting"].startswith("compiled"), r
    assert next(r for r in rows if r["setting"] == "eager")["speedup"] == 1.0
    assert "| eager ac=full |" in open(tmp_path / "bench.md").read()
    assert os.path.getsize(tmp_path / "bench.png") > 1000
