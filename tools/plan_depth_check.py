#!/usr/bin/env python
"""The sampled-depth plan (the default: a few layers traced, torchmeg.plan.depth) beside the plan that
traces every layer (plan.trace_layers = "all"), for every shipped recipe at its world and every row of
tools/plan_vs_published.py: the largest relative difference over tokens/s (predicted and upper
bound), each rank's peak, model state, FLOPs and every collective's bytes and count, and both wall
times of `python -m torchmeg.plan`, measured one after the other on this machine (markdown).

    python tools/plan_depth_check.py [--match TEXT] [--jobs N]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)


def numbers(p: dict) -> dict[str, float]:
    """Every number the two plans must share, by name."""
    out = {"predicted tokens/s": p["predicted_tokens_per_s_per_gpu"], "upper-bound tokens/s": p["tokens_per_s_per_gpu"]}
    for r in p["ranks"]:
        for k in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "flops",
                  "model_state_bytes", "predicted_step_s"):
            out[f"rank {r['rank']} {k}"] = r[k]
        if r.get("rollout_peak_bytes") is not None:  # (GRPO: its rollout's phases, scaled on their own)
            out[f"rank {r['rank']} rollout_peak_bytes"] = r["rollout_peak_bytes"]
        for key, c in r["comm"].items():
            out[f"rank {r['rank']} {key} bytes"] = c["bytes"]
            out[f"rank {r['rank']} {key} count"] = c["count"]
    return out


def worst(a: dict, b: dict) -> tuple[float, str]:
    """(largest relative difference, its name) over the numbers of two plans; a number one plan lacks
    counts as a difference of 1."""
    na, nb = numbers(a), numbers(b)
    diffs = [(abs(na[k] - nb[k]) / abs(na[k]) if na[k] else float(nb[k] != 0), k) for k in na if k in nb]
    diffs += [(1.0, k) for k in set(na) ^ set(nb)]
    return max(diffs)


def plan(args: list[str], out: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "torchmeg.plan", *args, "--json", out], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip().splitlines()[-1]}")
    return json.load(open(out)), wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default="", help="only the rows / recipes whose name contains this")
    ap.add_argument("--jobs", type=int, default=1, help="rows planned at once (1: the timings are a quiet machine's)")
    a = ap.parse_args(argv)
    from plan_vs_published import RUNS
    from torchmeg.config.schema import load_config
    rows = []
    for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml"))):
        name = os.path.basename(path)[:-5]
        world = load_config(path).plan.world_size or 1
        rows.append((f"recipe {name}", ["--config", path, "--world", str(world)]))
    for name, recipe, gpu, world, args, _ in RUNS:
        rows.append((name, ["--config", os.path.join(ROOT, "recipes", recipe), "--world", str(world), "--gpu", gpu, *args]))
    rows = [r for r in rows if a.match in r[0]]
    tmp = tempfile.mkdtemp(prefix="plan_depth_")

    def one(k_row):
        k, (name, args) = k_row
        try:
            sampled, t_s = plan(args, os.path.join(tmp, f"{k}s.json"))
            every, t_a = plan(args + ["--plan.trace_layers=all"], os.path.join(tmp, f"{k}a.json"))
        except RuntimeError as e:
            return f"| {name} | failed: {e} |"
        diff, what = worst(every, sampled)
        traced = sampled["ranks"][0].get("traced_layers")
        return (f"| {name} | {traced} | {t_a:.1f} | {t_s:.1f} | {t_a / t_s:.1f}x | {diff:.1e} ({what}) |")
    print("| plan | layers traced (per trace) | all layers (s) | sampled (s) | speed-up | largest relative difference |")
    print("|---|---|---|---|---|---|")
    with ThreadPoolExecutor(a.jobs) as pool:
        for line in pool.map(one, enumerate(rows)):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
