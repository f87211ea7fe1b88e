"""Shared helpers: run the real CLI (one process or torchrun with N ranks) and read its metrics."""
from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a 4-rank run fits in seconds on 2 cores, big enough that every
# parallel dimension divides it (heads 4, kv heads 2, FFN 192, vocab 320, seq 32).
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=64", "--data.seq_len=32", "--training.local_batch_size=4",
        "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--validation.enable=true",
        "--validation.steps=2", "--metrics.enable_tensorboard=false"]
# Validation is on as in the shipped recipes: it runs after the last step of every parity run, and
# its val_loss is compared too.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ranks(cmd: list[str], nproc: int, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Start nproc real processes with the environment torchrun gives its workers (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, one OpenMP thread each), ~1 s cheaper per run than torchrun's agent. The
    first rank to fail ends the others, and the whole run is bounded by `timeout`."""
    port, procs, outs = _free_port(), [], []
    for r in range(nproc):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                 GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        f_out, f_err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=f_out, stderr=f_err, text=True))
        outs.append((f_out, f_err))
    deadline, rc = time.time() + timeout, 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.time() > deadline:
            rc = failed[0] if failed else 124
            time.sleep(1.0)  # let the others report, then stop them
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    rc = rc or next((p.returncode for p in procs if p.returncode), 0)
    text = []
    for f_out, f_err in outs:
        f_out.seek(0)
        f_err.seek(0)
        text.append((f_out.read(), f_err.read()))
    return subprocess.CompletedProcess(cmd, rc, text[0][0], "\n".join(e for _, e in text))


def run_cli(args: list[str], tmp_path, nproc: int = 1, name: str = "run", timeout: int = 120,
            env: dict | None = None, check: bool = True, torchrun: bool = False) -> subprocess.CompletedProcess:
    """`python -m torchmeg.train` on one process, or on nproc ranks (torchrun --standalone when
    `torchrun`, else the same worker environment set up directly)."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "TORCHMEG_PG_TIMEOUT": "60"})
    full_env.update(env or {})
    train = ["-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", f"--job.name={name}"] + list(args)
    if nproc > 1 and not torchrun:
        p = _launch_ranks([sys.executable] + train, nproc, full_env, timeout)
    else:
        launcher = [sys.executable] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        p = subprocess.run(launcher + train, cwd=ROOT, env=full_env, capture_output=True, text=True,
                           timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(p.args)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
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
        assert ("val_loss" in a) == ("val_loss" in b), f"step {a['step']}: val_loss in only one run"
        for k in ("loss", "grad_norm") + (("val_loss",) if "val_loss" in a else ()):
            scale = abs(a[k]) if (rel or k == "grad_norm") and abs(a[k]) > 1 else 1.0
            assert abs(a[k] - b[k]) <= tol * scale, f"step {a['step']} {k}: reference {a[k]!r} vs layout {b[k]!r}"


def reference_run(tmp_path_factory, args: list[str]) -> list[dict]:
    """The single-process run a layout is compared against: its logged metrics."""
    d = tmp_path_factory.mktemp("ref")
    run_cli(list(args), d)
    return read_metrics(d)


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory):
    """A store of short documents (stdlib functions), so 32-token windows cross boundaries."""
    d = tmp_path_factory.mktemp("short")
    texts = [inspect.getsource(f) for f in vars(json.decoder).values() if inspect.isfunction(f)]
    texts += [inspect.getsource(f) for f in vars(inspect).values() if inspect.isfunction(f)][:200]
    src = d / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                        str(d / "fns")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return d / "fns"
