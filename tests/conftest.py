"""Shared helpers: run the real CLI (one process or torchrun with N ranks) and read its metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a 4-rank run fits in seconds on 2 cores, big enough that every
# parallel dimension divides it (heads 4, kv heads 2, FFN 192, vocab 320, seq 32).
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=64", "--data.seq_len=32", "--training.local_batch_size=4",
        "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--validation.enable=false",
        "--metrics.enable_tensorboard=false"]


def run_cli(args: list[str], tmp_path, nproc: int = 1, name: str = "run", timeout: int = 120,
            env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m torchmeg.train` (nproc 1) or torchrun --standalone with nproc ranks."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "TORCHMEG_PG_TIMEOUT": "60"})
    full_env.update(env or {})
    launcher = [sys.executable, "-m", "torchmeg.train"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "-m", "torchmeg.train"]
    cmd = launcher + [f"--job.dump_folder={tmp_path}", f"--job.name={name}"] + list(args)
    p = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def read_metrics(tmp_path, name: str = "run") -> list[dict]:
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="session")
def tiny_args():
    return list(TINY)


def assert_parity(ref: list[dict], got: list[dict], tol: float = 1e-5, rel: bool = False) -> None:
    """Per-step loss and grad norm of a layout vs the reference run.

    The loss is compared absolutely (it is O(1)); the grad norm relatively unless `rel` is False
    AND it is below 1: a norm of ~10 carries fp32 rounding of ~1e-6 per reduction, so an absolute
    1e-5 on it would test the float format rather than the parallelism.
    """
    assert [r["step"] for r in got] == [r["step"] for r in ref], "different steps logged"
    for a, b in zip(ref, got):
        for k in ("loss", "grad_norm"):
            scale = abs(a[k]) if (rel or k == "grad_norm") and abs(a[k]) > 1 else 1.0
            assert abs(a[k] - b[k]) <= tol * scale, f"step {a['step']} {k}: reference {a[k]!r} vs layout {b[k]!r}"
