#!/usr/bin/env python
"""The planner held to the runs it plans, on this machine: planned vs measured step time and memory.

    python tools/plan_vs_run.py [--recipes debug_llama,moe_debug] [--layouts eager,compiled,recompute,fsdp2,tp2,pp2]
                                [--steps 8] [--passes 2] [--calibrate] [--out outputs/plan_vs_run] [--json FILE]

Per recipe and layout: the real trainer runs `--steps` steps (`python -m torchmeg.train`, or torchrun for two
ranks) and its step time is the median `elapsed_ms` of the steps after the first two (compilation, the
optimizer's first update), the fastest of `--passes` such runs made one pass over the layouts after another
(a shared machine's slow spells last minutes: one pass's row may fall in one); its tensors' peak is step 2 under the planner's own tracker in a real run
(`python -m torchmeg.plan --measure`: MemTracker over the real tensors); the plan is `python -m torchmeg.plan
--device cpu` with the calibration of this machine for that many ranks (made first if missing, or with
--calibrate). Printed side by side with the ratios, and how fast the machine is just before each run
against when it was calibrated (one matmul, timed as the calibration times: machine_speed); a quiet
machine gives the numbers docs/planning.md holds. Tests run it on one layout and check what it reports (tests/test_plan_calibrated.py), never timings.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# name -> (ranks, recipe overrides)
LAYOUTS = {
    "eager": (1, []),
    "compiled": (1, ["--compile.enable=true"]),
    "recompute": (1, ["--activation_checkpoint.mode=full"]),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                "--parallelism.pipeline_parallel_schedule=1F1B"]),
}
RUN = ["--checkpoint.enable=false", "--validation.enable=false", "--metrics.log_freq=1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(_port())]


def _run(cmd: list[str], timeout: float) -> str:
    """Run cmd in a session of its own; past `timeout` the whole session is killed (torchrun's workers too)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"{' '.join(cmd[-12:])}: still running after {timeout:.0f} s, killed") from None
    if p.returncode:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[-12:])} failed ({p.returncode}):\n{tail}")
    return out


def calibration(ranks: int, fresh: bool, out: str) -> str:
    """This machine's calibration for `ranks` ranks (python -m torchmeg.plan --calibrate), made if missing."""
    path = os.path.join(out, f"calibration-cpu-{ranks}rank.json")
    if fresh or not os.path.exists(path):
        print(_run(launcher(ranks) + ["-m", "torchmeg.plan", "--calibrate", "--out", path], 600).strip().splitlines()[-1],
              flush=True)
    return path


def measured_step(recipe: str, ranks: int, args: list[str], steps: int, folder: str) -> float:
    """Median seconds of the run's steps after the first two (metrics.jsonl's elapsed_ms)."""
    _run(launcher(ranks) + ["-m", "torchmeg.train", "--config", recipe, f"--training.steps={steps}",
                            f"--job.dump_folder={folder}", *RUN, *args], 900)
    rows = []
    for dirpath, _, files in os.walk(folder):
        if "metrics.jsonl" in files:
            with open(os.path.join(dirpath, "metrics.jsonl")) as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
    times = [r["elapsed_ms"] / 1000 for r in rows if r["step"] > 2]
    if not times:
        raise RuntimeError(f"{folder}: no metrics.jsonl rows after step 2 (steps {steps}: need at least 3)")
    return statistics.median(times)


def measured_memory(recipe: str, ranks: int, args: list[str], folder: str) -> list[float]:
    """Per rank, the tensors' peak of a real step 2 (torchmeg.plan --measure: the planner's tracker)."""
    out = os.path.join(folder, "measure.json")
    _run(launcher(ranks) + ["-m", "torchmeg.plan", "--config", recipe, "--measure", "--json", out, *args], 900)
    return [json.load(open(f"{out}.rank{r}"))["memory"]["Total"] for r in range(ranks)]


def planned(recipe: str, ranks: int, args: list[str], cal: str, folder: str) -> dict:
    out = os.path.join(folder, "plan.json")
    _run([sys.executable, "-m", "torchmeg.plan", "--config", recipe, "--device", "cpu", "--calibration", cal,
          "--world", str(ranks), "--json", out, *args], 600)
    with open(out) as fh:
        return json.load(fh)


PROBE = 1024  # the probe's matmul: PROBE^3, float32, on the calibration's own threads


def machine_speed(cal_path: str) -> float:
    """This machine's speed now against when `cal_path` was measured: a 1024^3 float32 matmul's rate, timed as
    the calibration times, over the rate the calibration prices it at (a shared machine drifts by tens of
    percent within an hour; a row measured at 0.8 was run on a machine 20% slower than it was calibrated on)."""
    code = (f"import torch, json; from torchmeg.plan.calibrate import seconds, shaped; "
            f"from torchmeg.plan.calibrated import Calibration; torch.set_num_threads(json.load(open({cal_path!r}))['threads']); "
            f"x = torch.randn({PROBE}, {PROBE}); fn = lambda: x @ x; f, b, *mnk = shaped(fn); t = seconds(fn, torch.device('cpu'), 0.3); "
            f"c = Calibration.load({cal_path!r}); print(c.op_seconds(f, b, 'float32', 'matmul@' + 'x'.join(map(str, mnk))) / t)")
    return float(_run([sys.executable, "-c", code], 120).strip().splitlines()[-1])


def compare(recipe: str, layout: str, steps: int, cal: str, out: str) -> dict:
    ranks, args = LAYOUTS[layout]
    name = os.path.basename(recipe)[:-5] if recipe.endswith(".toml") else recipe
    path = recipe if os.path.exists(recipe) else os.path.join(ROOT, "recipes", f"{recipe}.toml")
    folder = os.path.join(os.path.abspath(out), f"{name}-{layout}")
    plan = planned(path, ranks, args, cal, folder)
    speed = machine_speed(cal)
    step = measured_step(path, ranks, args, steps, folder)
    memory = measured_memory(path, ranks, args, folder)
    planned_mem = [r["peak_bytes"] for r in sorted(plan["ranks"], key=lambda r: r["rank"])]
    # (a pipeline plan holds one rank per stage; the run measures every rank: compare stage by stage)
    by_rank = {r["rank"]: r["peak_bytes"] for r in plan["ranks"]}
    pairs = [(by_rank[r], m) for r, m in enumerate(memory) if r in by_rank] or [(max(planned_mem), max(memory))]
    worst = max(pairs, key=lambda pm: abs(pm[0] / pm[1] - 1))
    return {"recipe": name, "recipe_path": path, "layout": layout, "ranks": ranks, "planned_step_s": plan["predicted_step_s"],
            "measured_step_s": step, "measured_steps_s": [step], "step_ratio": plan["predicted_step_s"] / step,
            "planned_peak_bytes": worst[0], "measured_peak_bytes": worst[1], "memory_ratio": worst[0] / worst[1],
            "predicted_compute_s": plan["ranks"][0]["predicted_compute_s"], "calibration": cal,
            "machine_speed": speed}


def again(row: dict, steps: int, out: str) -> None:
    """Measure `row`'s step once more (a later pass); the row keeps the fastest of its passes."""
    ranks, args = LAYOUTS[row["layout"]]
    folder = os.path.join(os.path.abspath(out), f"{row['recipe']}-{row['layout']}-pass{len(row['measured_steps_s']) + 1}")
    row["measured_steps_s"].append(measured_step(row["recipe_path"], ranks, args, steps, folder))
    row["measured_step_s"] = min(row["measured_steps_s"])
    row["step_ratio"] = row["planned_step_s"] / row["measured_step_s"]
    print(f"pass {len(row['measured_steps_s'])}: {row['recipe']} {row['layout']}: measured "
          f"{1000 * row['measured_steps_s'][-1]:.0f} ms", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="debug_llama,moe_debug")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--calibrate", action="store_true", help="measure this machine again (else reuse --out's files)")
    ap.add_argument("--out", default=os.path.join("outputs", "plan_vs_run"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--passes", type=int, default=2, help="measure every layout's step this many times, one pass "
                    "over the layouts after another, and keep each row's fastest")
    a = ap.parse_args(argv)
    if a.passes < 1:
        print(f"plan_vs_run: --passes {a.passes}: must be at least 1", file=sys.stderr)
        return 2
    layouts = a.layouts.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        print(f"plan_vs_run: --layouts {','.join(unknown)}: unknown; choose from {','.join(LAYOUTS)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    cals = {n: calibration(n, a.calibrate, a.out) for n in sorted({LAYOUTS[x][0] for x in layouts})}
    # pass 1 plans, measures and probes each row; every later pass measures each step again, the layouts
    # in turn: a slow spell of a shared machine (minutes long: moe_debug's compiled step 234 ms in one
    # run, 134-144 in the others of the hour) then slows one of a row's passes, and the row keeps its fastest
    rows = []
    for recipe in a.recipes.split(","):
        for layout in layouts:
            rows.append(compare(recipe, layout, a.steps, cals[LAYOUTS[layout][0]], a.out))
            print(f"pass 1: {rows[-1]['recipe']} {layout}: planned {1000 * rows[-1]['planned_step_s']:.0f} ms, "
                  f"measured {1000 * rows[-1]['measured_step_s']:.0f} ms", flush=True)
    for _ in range(1, a.passes):
        for r in rows:
            again(r, a.steps, a.out)
    print("| recipe | layout | ranks | planned step (ms) | measured (ms) | planned / measured | machine vs its calibration | "
          "planned peak (MiB) | measured (MiB) | planned / measured | each pass (ms) |", flush=True)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for r in rows:
        print(f"| {r['recipe']} | {r['layout']} | {r['ranks']} | {1000 * r['planned_step_s']:.0f} | "
              f"{1000 * r['measured_step_s']:.0f} | {r['step_ratio']:.2f} | {r['machine_speed']:.2f} | "
              f"{r['planned_peak_bytes'] / 2 ** 20:.1f} | {r['measured_peak_bytes'] / 2 ** 20:.1f} | "
              f"{r['memory_ratio']:.3f} | {', '.join(f'{1000 * t:.0f}' for t in r['measured_steps_s'])} |", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
