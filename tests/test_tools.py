"""tools/bench.py runs settings side by side and writes its table, JSON and chart (no timing asserted);
tools/optimizer_sweep.py runs optimizers and rates side by side."""
import pytest
import json
import os
import subprocess
import sys

from launch import ROOT, own_tmp

sys.path.insert(0, os.path.join(ROOT, "tools"))
from gpu_check import MODEL_CPU  # noqa: E402  (tools/, put on the path above)


@pytest.mark.slow
def test_bench_workers_start_under_a_deep_temporary_folder(tmp_path):
    """tools/bench.py's forkserver listens on an AF_UNIX socket (107 bytes at most on Linux) in a folder
    multiprocessing makes under TMPDIR: under a test's own deep folder it did not start ("AF_UNIX path
    too long", seen in a .ci/run once pytest's run number had three digits). A fresh process with a
    TMPDIR of 120 characters starts a worker from it."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    code = ("import os, sys; sys.path.insert(0, 'tools'); import bench\n"
            "ctx = bench._forkserver(['os'])\n"
            "p = ctx.Process(target=os.getpid); p.start(); p.join(30)\n"
            "print('exit', p.exitcode)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TMPDIR=str(deep)),
                       capture_output=True, text=True, timeout=120)
    assert len(str(deep)) > 120 and p.returncode == 0 and "exit 0" in p.stdout, p.stderr[-3000:]


@pytest.mark.slow
def test_bench_writes_reports(tmp_path):
    # the GPU call's dry-run model (tools/gpu_check.py --cpu benches two of these settings on it, eager
    # and compiled at recompute full): of the two tests, the one that runs second finds that compiled
    # setting's kernels in the suite's inductor cache
    model = MODEL_CPU
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, "tools/bench.py", "--config", "recipes/debug_llama.toml", "--compile", "off,on",
                        "--ac", "none,full", "--steps", "2", "--warmup", "1", "--repeats", "2",
                        "--out", str(tmp_path)] + model,
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=own_tmp(tmp))
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
    assert not [f for f in os.listdir(tmp) if f.startswith("torchmeg-bench-")], os.listdir(tmp)  # the runs' folder gone


@pytest.mark.slow
def test_optimizer_sweep_prints_both_optimizers_and_their_ratio(tmp_path):
    """tools/optimizer_sweep.py: one run per (optimizer, lr), a row each, each optimizer's best lr and the
    ratio of the best losses; sweep.json holds the rows (docs/optimizers.md quotes its output)."""
    tiny = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--data.seq_len=32",
            "--training.local_batch_size=4", "--lr_scheduler.warmup_steps=1", "--validation.steps=1"]
    p = subprocess.run([sys.executable, "tools/optimizer_sweep.py", "--config", "recipes/debug_llama.toml", "--steps",
                        "3", "--adamw-lr", "1e-3", "--muon-lr", "1e-3,1e-2", "--out", str(tmp_path), "--"] + tiny,
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.load(open(tmp_path / "sweep.json"))
    assert [(r["optimizer"], r["lr"]) for r in rows] == [("adamw", 1e-3), ("muon", 1e-3), ("muon", 1e-2)]
    assert all(r["val_loss"] is not None and r["tail_loss"] > 0 for r in rows)
    assert "best adamw: lr 0.001" in p.stdout and "muon / adamw val_loss at their best lr:" in p.stdout, p.stdout
