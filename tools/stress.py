#!/usr/bin/env python
"""Launch many short multi-rank runs of a layout under torchrun and count the ones that exit badly.

    python tools/stress.py --layout pp2 fsdp2 tp2 --runs 100
    python tools/stress.py --layout pp2 --runs 20 -- --parallelism.pipeline_parallel_schedule=ZBVZeroBubble

Each run is `torchrun --standalone --nproc_per_node=N -m torchmeg.train` on a tiny model for a few
steps with validation and a checkpoint save on (the defaults users hit), exactly as a user launches
it. A run counts as bad if torchrun exits non-zero, or a worker printed "terminate called" (an
exit-time abort that torchrun may still report as success on some versions). Prints one line per
layout and the tail of each bad run's output (the whole of it goes to --logs); exits 1 if any run
was bad.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--model.dim=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.multiple_of=64",
        "--data.seq_len=32", "--training.local_batch_size=8", "--training.steps=4", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", "--validation.enable=true", "--validation.freq=2",
        "--validation.steps=1", "--checkpoint.enable=true", "--checkpoint.interval=2", "--lr_scheduler.warmup_steps=1"]

P = "--parallelism."
LAYOUTS = {  # name -> (ranks, overrides)
    "pp2": (2, [P + "pipeline_parallel_degree=2"]),
    "fsdp2": (2, [P + "data_parallel_shard_degree=2"]),
    "tp2": (2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "ddp2": (2, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=1"]),
    "cp2": (2, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "pp2_tp2": (4, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2"]),
}


def one_run(ranks: int, args: list[str], workdir: str, timeout: int) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "torchmeg.train", "--config", os.path.join(ROOT, "recipes", "debug_llama.toml"),
           f"--job.dump_folder={workdir}", "--job.name=stress"] + args
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    if rc == 0 and "terminate called" in out:
        rc = -6
    return rc, time.perf_counter() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", nargs="+", default=["pp2", "fsdp2", "tp2"], choices=sorted(LAYOUTS))
    ap.add_argument("--runs", type=int, default=100, help="runs per layout")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per run before it counts as a hang")
    ap.add_argument("--logs", default="outputs/stress", help="where the full output of each bad run is kept")
    ap.add_argument("extra", nargs="*", help="more overrides for every run, after --")
    a = ap.parse_args(argv)
    bad_total = 0
    print(f"torchrun runs of {a.runs} per layout; tiny llama, 4 steps, validation + checkpoints on", flush=True)
    for name in a.layout:
        ranks, layout = LAYOUTS[name]
        codes, times, bad = [], [], []
        for i in range(a.runs):
            with tempfile.TemporaryDirectory(prefix="torchmeg-stress-") as d:
                rc, dt, out = one_run(ranks, TINY + layout + a.extra, d, a.timeout)
            codes.append(rc)
            times.append(dt)
            if rc != 0:
                bad.append((i, rc, out))
                os.makedirs(a.logs, exist_ok=True)
                with open(os.path.join(a.logs, f"{name}-run{i}.log"), "w") as fh:
                    fh.write(out)
            print(f"\r{name}: {i + 1}/{a.runs} runs, {len(bad)} bad", end="", flush=True)
        print(f"\r{name:8s} ranks {ranks}: {a.runs} runs, {len(bad)} non-zero exits "
              f"(codes: {sorted(set(c for c in codes if c)) or '-'}), median {statistics.median(times):.1f} s/run",
              flush=True)
        for i, rc, out in bad[:3]:
            tail = "\n    ".join(out.strip().splitlines()[-12:])
            print(f"  run {i}: exit {rc}\n    {tail}", flush=True)
        bad_total += len(bad)
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
