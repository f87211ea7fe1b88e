#!/usr/bin/env python
"""Layouts of one recipe side by side: the step time and tokens/s of each, in alternated rounds.

    python tools/layout_bench.py --config recipes/moe_debug.toml --layout 1 \
        --layout "2 --parallelism.expert_parallel_degree=2" \
        --layout "2 --parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1" \
        --steps 30 --rounds 2 --repo /path/to/an/older/checkout

Each layout ("NPROC [overrides]") trains under torchrun for --steps steps (checkpoints, validation
and TensorBoard off), the settings one at a time in rounds (A B C, A B C, ...) so drift in the
machine's speed hits each alike. A run's step time is the median of its steps after the first 5
(warm-up); a setting's, the median over its rounds. --repo (repeatable): also run every layout
from another checkout of torchmeg (an older commit's worktree: before / after), in the same
rounds. Prints one row per (layout, checkout): step ms, tokens/s and the ratio to the first row.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(repo: str, config: str, layout: str, steps: int) -> tuple[float, float]:
    """-> (median step seconds after warm-up, tokens per step) of one training run."""
    nproc, *over = shlex.split(layout)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", "-m", "torchmeg.train", "--config", os.path.join(repo, config),
               f"--training.steps={steps}", "--checkpoint.enable=false", "--validation.enable=false",
               "--metrics.enable_tensorboard=false", "--metrics.log_freq=1", f"--job.dump_folder={out}", *over]
        p = subprocess.run(cmd, cwd=repo, env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"layout_bench: {layout!r} in {repo} failed:\n{p.stderr[-3000:]}")
        rows = [json.loads(line) for f in glob.glob(os.path.join(out, "**", "metrics.jsonl"), recursive=True)
                for line in open(f) if line.strip()]
    rows = [r for r in rows if "elapsed_ms" in r and r["step"] > 5]
    if not rows:
        sys.exit(f"layout_bench: {layout!r}: no step after the 5 warm-up steps; raise --steps")
    step_s = statistics.median(r["elapsed_ms"] for r in rows) / 1000
    tokens = statistics.median(r["tokens_per_sec"] * r["elapsed_ms"] / 1000 for r in rows)
    return step_s, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="recipe path, relative to each checkout")
    ap.add_argument("--layout", action="append", required=True, help='"NPROC [--key=value ...]"')
    ap.add_argument("--repo", action="append", default=[], help="another torchmeg checkout to run too")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    settings = [(layout, repo) for layout in a.layout for repo in [HERE] + [os.path.abspath(r) for r in a.repo]]
    times: dict = {s: [] for s in settings}
    tokens = {}
    for r in range(a.rounds):
        for s in settings:
            step_s, tokens[s] = run(s[1], a.config, s[0], a.steps)
            times[s].append(step_s)
            print(f"round {r + 1}: {s[0]!r} ({s[1]}): {step_s * 1000:.1f} ms/step", flush=True)
    base = None
    print(f"\n| layout | checkout | step (ms) | tokens/s | vs first |\n|---|---|---|---|---|")
    for s in settings:
        t = statistics.median(times[s])
        tps = tokens[s] / t
        base = base or tps
        print(f"| {s[0]} | {os.path.basename(s[1])} | {t * 1000:.1f} | {tps:,.0f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
