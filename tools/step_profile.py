"""Where a training step's time goes, from the traces `[profiling]` writes.

    python -m torchmeg.train --config recipes/debug_llama.toml --training.steps=12 \
        --profiling.enable=true --profiling.profile_freq=12 --profiling.active_steps=4 --profiling.memory=false
    python tools/step_profile.py outputs/debug_llama/profile/step-000012/rank*.trace.json

For each rank's chrome trace: the recorded steps' wall time split into kinds of work by operator
self time (an operator's time minus its children's, so nothing counts twice), plus the time the
step's thread spent in no operator at all (Python, hooks, the framework between ops), and the
trainer's phases (forward, backward, optimizer, ...: its `torchmeg:` profiler ranges). The matmul
line also gives the FLOP/s the matmuls reached (from the recorded shapes) against the machine's
measured peak (the same one the run's MFU uses), i.e. how close the matmul kernels themselves run
to the roofline, and MFU = model FLOP/s / peak for the whole step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

# Kinds of work, by operator name. Exact names and prefixes, not substrings: "aten::to" must not take
# aten::topk, "broadcast" not aten::broadcast_tensors (a view), "all_gather" not FSDP's copy-in.
MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
           "aten::_scaled_mm", "aten::_int_mm"}
COPIES = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::to", "aten::_to_copy", "aten::empty",
          "aten::empty_like", "aten::empty_strided", "aten::zero_", "aten::fill_", "aten::zeros", "aten::zeros_like",
          "aten::_foreach_copy_", "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat"}
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms", "nccl:", "gloo:")
ATTENTION_PARTS = ("flash_attention", "efficient_attention", "cudnn_attention", "scaled_dot_product", "_sdpa")
COMPILED_PARTS = ("Torch-Compiled Region", "CompiledFunction", "inductor", "triton_", "cpp_fused")
OPTIMIZER_PREFIXES = ("aten::_fused_adam", "aten::_foreach_")  # (foreach copies are FSDP's: COPIES, first)
OTHER = "other ops (elementwise, norms, loss, ...)"


def kind_of(name: str) -> str:
    if name in MATMULS:
        return "matmul"
    if name in COPIES:
        return "copies"
    if any(k in name for k in ATTENTION_PARTS):
        return "attention"
    if name.startswith(COMM_PREFIXES):
        return "communication"
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer"
    if any(k in name for k in COMPILED_PARTS):
        return "compiled kernels"
    return OTHER


def matmul_flops(name: str, dims) -> float:
    """2·M·N·K from the recorded input shapes of mm/addmm/bmm (0 when they are missing)."""
    try:
        if name in ("aten::mm",):
            (m, k), (_, n) = dims[0], dims[1]
            return 2.0 * m * k * n
        if name in ("aten::addmm", "aten::addmm_"):
            (m, k), (_, n) = dims[1], dims[2]
            return 2.0 * m * k * n
        if name in ("aten::bmm", "aten::baddbmm"):
            a, b = (dims[0], dims[1]) if name == "aten::bmm" else (dims[1], dims[2])
            return 2.0 * a[0] * a[1] * a[2] * b[2]
    except (IndexError, TypeError, ValueError):
        pass
    return 0.0


def self_times(events):
    """Per-thread nesting -> each op's self time (µs). Yields (event, self_us)."""
    by_tid = defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, child = [], {}
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                child[id(stack[-1])] = child.get(id(stack[-1]), 0.0) + e["dur"]
            stack.append(e)
        for e in evs:
            yield e, max(0.0, e["dur"] - child.get(id(e), 0.0))


def covered(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, -math.inf
    for s, t in sorted(intervals):
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def analyse(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    if not steps:
        sys.exit(f"{path}: no ProfilerStep ranges (is this a trace written by [profiling]?)")
    step_tid = steps[0]["tid"]
    wall = sum(e["dur"] for e in steps)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]

    def inside(e):
        return any(s <= e["ts"] < t for s, t in windows)

    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and inside(e)
           and not e["name"].startswith("ProfilerStep#")]
    kinds, names, phases = defaultdict(float), defaultdict(float), defaultdict(float)
    flops = mm_time = 0.0
    for e, self_us in self_times([o for o in ops if o.get("cat") == "cpu_op"]):
        k = kind_of(e["name"])
        if e["tid"] != step_tid and k == "communication":
            continue  # a collective's own threads: its time on the step's thread is what the step waited
        kinds[k] += self_us
        names[e["name"]] += self_us
        if k == "matmul":
            flops += matmul_flops(e["name"], e.get("args", {}).get("Input Dims"))
            mm_time += e["dur"]
    for e in ops:
        if e.get("cat") == "user_annotation" and e["name"].startswith("torchmeg:"):
            phases[e["name"][len("torchmeg:"):].strip()] += e["dur"]
    top = [e for e in ops if e["tid"] == step_tid and e.get("cat") == "cpu_op"]
    busy = covered([(e["ts"], e["ts"] + e["dur"]) for e in top])
    return {"path": path, "steps": len(steps), "wall_us": wall, "kinds": dict(kinds), "names": dict(names),
            "phases": dict(phases), "idle_us": max(0.0, wall - busy), "mm_flops": flops, "mm_us": mm_time}


def cached_peak(threads: int) -> float | None:
    """The fp32 CPU matmul peak the trainer measured and cached for this many threads per process
    (torchmeg.observe.peak; under torchrun each rank runs with its share of the cores), if there is one."""
    import torch

    from torchmeg.observe import peak
    from torchmeg.data.sources import cache_dir

    torch.set_num_threads(threads)
    return peak.cached_peak(torch.float32, cache_dir())


def report(r: dict, peak: float | None, top: int) -> None:
    n, wall = r["steps"], r["wall_us"]
    per = wall / n / 1e3
    print(f"{r['path']}: {n} steps, {per:.1f} ms per step")
    print(f"  {'work':42s} {'ms/step':>9s} {'share':>7s}")
    rows = sorted(r["kinds"].items(), key=lambda kv: -kv[1]) + [("no operator (Python, hooks, framework)", r["idle_us"])]
    for k, us in rows:
        print(f"  {k:42s} {us / n / 1e3:9.1f} {100 * us / wall:6.1f}%")
    if r["mm_us"] > 0 and r["mm_flops"] > 0:
        rate = r["mm_flops"] / (r["mm_us"] / 1e6)
        line = f"  matmuls ran at {rate / 1e12:.3f} TFLOP/s"
        if peak:
            line += f" = {100 * rate / peak:.0f}% of the measured peak ({peak / 1e12:.3f} TFLOP/s)"
        print(line)
    if r["phases"]:
        print("  phases: " + ", ".join(f"{k} {us / n / 1e3:.1f} ms ({100 * us / wall:.0f}%)"
                                        for k, us in sorted(r["phases"].items(), key=lambda kv: -kv[1])))
    print("  top operators by self time:")
    for name, us in sorted(r["names"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {name:60s} {us / n / 1e3:8.2f} ms {100 * us / wall:6.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="rank*.trace.json files written by [profiling]")
    ap.add_argument("--top", type=int, default=12, help="how many operators to list")
    ap.add_argument("--json", action="store_true", help="print one JSON object per trace instead")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads each traced process ran with (the peak is looked up for it); 0 = this process's")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the peak to compare with, instead of the cached one")
    args = ap.parse_args(argv)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else cached_peak(args.threads or os.cpu_count() or 1)
    for path in args.traces:
        if not os.path.isfile(path):
            print(f"{path}: no such file", file=sys.stderr)
            return 2
        r = analyse(path)
        if args.json:
            print(json.dumps({k: v for k, v in r.items() if k != "names"}))
        else:
            report(r, peak, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
