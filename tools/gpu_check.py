#!/usr/bin/env python
"""torchmeg's GPU claims, measured in ONE command on a lent GPU machine (one H100 or H200):

    python3 tools/gpu_check.py --out $OUT                 # on the GPU machine (docs/gpu-results.md: the call)
    python tools/gpu_check.py --cpu --out DIR             # the dry run: every step's CPU part, toy sizes

Steps, in this order, each a process of its own, bounded in time, its failure recorded without
stopping the rest (a step the remaining --budget cannot hold is skipped, by name, with why; a bench
step cut short by its time keeps the settings it measured, status "partial"):

  calibrate         python -m torchmeg.plan --calibrate: this device's matmuls by shape and dtype (float8
                    where it has them), attention, memory-bound ops, an eager op's host cost; the file
                    comes back in <out>/calibration.json and the planner step below predicts from it
  compile_vs_eager  a 1B Llama (Llama 3.2 1B's shape, bf16, seq 2,048, batch 4) eager and compiled,
                    without and with full activation recompute: tokens/s, MFU against the device's
                    datasheet peak, peak memory, compile time (tools/bench.py --one-at-a-time)
  float8            the same model compiled, bf16 vs torchao float8 tensorwise vs rowwise with the
                    hardware's float8 matmuls: tokens/s and the loss after the same 20 steps
  fused_ce          the fused LM head + loss (Triton kernel and torch ops) vs unfused at vocab
                    128,256: peak memory against the fake-tensor prediction, time, agreement
  sink_attention    gpt-oss-20b's attention shape: sink attention (full and windowed) vs plain
                    causal SDPA, forward and backward
  serving           the 1B's engine, 32 requests one by one vs 32 at once, each with the eager decode
                    step and the static one (CUDA graphs), side by side: tokens/s, TTFT, TPOT; then the
                    32 at once sampled (temperature, top_p, a presence penalty): it must end
  planner           the planner's prediction (python -m torchmeg.plan --world 1 --gpu <this GPU>, with
                    --calibration from the calibrate step when it ran) for every compile_vs_eager and
                    float8 setting beside what ran (planned on the CPU while the GPU steps run)
  gpu_suite         pytest tests/gpu, every test's outcome

--cpu runs each step at toy size on the CPU (fp32, float8 emulated, eager float8, no Triton,
compile_vs_eager at recompute full only), and reports the steps only a GPU can run (gpu_suite) as
skipped by name: so the GPU call is not the script's first run (tests/test_gpu_check.py runs it in the
suite). Writes <out>/gpu_check.json and <out>/gpu_check.md (the table docs/gpu-results.md holds) and
<out>/gpu_check.log (each step's command and the end of its output); the runs' own files go to a
temporary folder.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), ROOT]
from gpu_check_report import environment, markdown  # noqa: E402  (tools/ and the root, put on the path above)
from torchmeg.plan.gpus import key_for_device  # noqa: E402

RECIPE = ["--config", "recipes/debug_llama.toml"]
MODEL_GPU = ["--model.flavor=1B", "--data.seq_len=2048", "--training.local_batch_size=4",
             "--data.document_masking=false", "--training.device=cuda"]
MODEL_CPU = ["--model.n_layers=1", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--data.seq_len=64", "--training.local_batch_size=2", "--training.device=cpu", "--float8.emulate=true"]
# the two bench steps' settings, as tools/bench.py takes them (its settings_from names the rows)
# (--cpu: recompute full only, eager and compiled: the same code at toy size with one compile, not two;
# tests/test_tools.py benches all four settings on the same model, and their kernels are shared)
BENCH = {"compile_vs_eager": lambda cpu: dict(compile="off,on", ac="full" if cpu else "none,full", float8="off"),
         # float8's speed is the compiled program's (torchao's casts fuse there); on the CPU emulated, eager
         "float8": lambda cpu: dict(compile="off" if cpu else "on", ac="none", float8="off,tensorwise,rowwise")}


@dataclass
class Step:
    name: str
    cap_s: int          # at most this long on the GPU
    least_s: int        # not started with less than this left
    device_only: bool
    run: Callable


class Check:
    """What the steps share: mode, work folder, the log, the remaining budget, the planner's thread."""

    def __init__(self, cpu: bool, out: str, budget: float):
        self.cpu, self.out, self.budget, self.t0 = cpu, out, budget, time.monotonic()
        # the runs' files (checkpoints, bench folders) stay out of <out>: what comes back from a lent
        # machine's $OUT is a few small files
        self.work = tempfile.mkdtemp(prefix="torchmeg-gpu-check-")
        self.log = open(os.path.join(out, "gpu_check.log"), "w")
        self.model = MODEL_CPU if cpu else MODEL_GPU
        self.precision = "fp32" if cpu else "bf16"
        self.plans: dict[str, dict] = {}
        self.planner: threading.Thread | None = None
        self.calibrated = threading.Event()  # set when the calibrate step has ended (or is not run)
        self.calibration = os.path.join(out, "calibration.json")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def sh(self, cmd: list[str], timeout: float, env: dict | None = None) -> str:
        """Run cmd from the repository root in a process group of its own; on timeout the whole group
        is killed (nothing it started keeps running). Raises on a non-zero exit or timeout, with the
        end of its output; returns its output."""
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out = p.communicate()[0]
            self.log.write(out[-6000:])
            raise TimeoutError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:4])} ...; last output: {out[-300:]!r}")
        self.log.write(out[-6000:])
        self.log.flush()
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {' '.join(cmd[:4])} ...; last output: {out[-600:]!r}")
        return out


def bench(check: Check, name: str, timeout: float) -> dict:
    out = os.path.join(check.work, name)
    steps = ["--steps", "1", "--warmup", "0", "--repeats", "1"] if check.cpu else \
            ["--steps", "8", "--warmup", "3", "--repeats", "2"]
    settings = [x for key, value in BENCH[name](check.cpu).items() for x in (f"--{key}", value)]
    path, partial = os.path.join(out, "bench.json"), {}
    try:
        check.sh([sys.executable, "tools/bench.py", *RECIPE, "--one-at-a-time", "--precision", check.precision, *steps,
                  *settings, "--out", out, *check.model, "--metrics.log_freq=1"], timeout)
    except TimeoutError as e:  # the settings measured before the time ran out are kept (bench writes each)
        if not os.path.exists(path):
            raise
        partial = {"status": "partial", "why": str(e)[:600]}
    rows = json.load(open(path))
    for r in rows:
        r.pop("step_ms_all", None)
    return {"rows": rows, **partial}


def compile_vs_eager(check: Check, timeout: float) -> dict:
    return bench(check, "compile_vs_eager", timeout)


def float8(check: Check, timeout: float) -> dict:
    return bench(check, "float8", timeout)


def kernels(what: str):
    def run(check: Check, timeout: float) -> dict:
        path = os.path.join(check.work, f"{what}.json")
        check.sh([sys.executable, "tools/gpu_check_kernels.py", what, "--json", path]
                 + (["--toy", "--device", "cpu"] if check.cpu else ["--device", "cuda"]), timeout)
        return json.load(open(path))
    return run


def serving(check: Check, timeout: float) -> dict:
    """One training step writes a checkpoint of the model (serving needs one), then the engine in
    one process (tools/serve_bench.py --engine: no HTTP, none of its packages needed)."""
    t0 = time.monotonic()
    run = [*RECIPE, *check.model, f"--training.mixed_precision={check.precision}", "--compile.enable=false",
           f"--job.dump_folder={os.path.join(check.work, 'serving')}", "--metrics.enable_tensorboard=false"]
    check.sh([sys.executable, "-m", "torchmeg.train", *run, "--training.steps=1", "--validation.enable=false",
              "--checkpoint.enable=true", "--checkpoint.interval=1", "--checkpoint.last_save_model_only=true"], timeout)
    # (32 x 64 tokens one by one did not end in the 76 s left on an H200, 2026-11-29: 2,048 eager decode
    # steps of a 1B after its load; 32 tokens each halves that)
    n, tokens = (8, 8) if check.cpu else (32, 32)
    path = os.path.join(check.work, "serve.json")
    # --profile: the 32-at-once run once more under torch's profiler, after the measured rows (how the
    # H200 of 2026-11-29 was found host-bound in cuDNN's attention: docs/gpu-results.md)
    # --decode eager,static: every row with the eager decode step and with the static one (CUDA graphs on
    # a GPU; compiled on the CPU), side by side (batching.static_decode); the profile and the sampled run
    # take the server's default (static on a GPU)
    check.sh([sys.executable, "tools/serve_bench.py", "--engine", *run, "--sets", "fixed", "--concurrency", f"1,{n}",
              "--requests", str(n), "--max-tokens", str(tokens), "--max-seqs", str(n), "--json", path,
              "--decode", "eager,static", "--profile", os.path.join(check.work, "serve_profile")],
             timeout - (time.monotonic() - t0))
    rows = json.load(open(path))
    prof = rows[-1].pop("profile")
    # Sampled (temperature 1, top_p 0.9, a presence penalty) at the same concurrency: every draw's
    # counters and the penalty's counts on the device (until 2026-12-06 a sampled request failed on a
    # GPU, mixing the host's step counts with the device's streams; every GPU serving run was greedy)
    sampled_path = os.path.join(check.work, "serve_sampled.json")
    check.sh([sys.executable, "tools/serve_bench.py", "--engine", *run, "--sets", "fixed", "--concurrency", str(n),
              "--requests", str(n), "--max-tokens", str(tokens), "--max-seqs", str(n), "--json", sampled_path,
              "--temperature", "1", "--top-p", "0.9", "--presence-penalty", "0.5"], timeout - (time.monotonic() - t0))
    rows.append(dict(json.load(open(sampled_path))[0], set="fixed, sampled"))
    def line(ops):  # the profile's top ops (a kernel's name can run to hundreds of characters)
        return "; ".join(f"{t['op'][:80]} {t['ms']:,.0f} ms in {t['calls']:,} calls ({t['share']:.0%})" for t in ops)
    top, kernels = line(prof["top_host_ops"]), line(prof["top_device_ops"][:3]) or "none (no device)"
    return {"shape": f"{n} requests of 12-139 prompt tokens, {tokens} tokens out each, greedy (the last row: "
                     f"temperature 1, top_p 0.9, presence penalty 0.5)",
            "note": f"profiled once more at concurrency {n}: {prof['steps']} steps, their forwards {prof['forward_ms']:,.0f} ms "
                    f"(device synchronized); ops' time on the host {prof['host_ms']:,.0f} ms, on the device "
                    f"{prof['device_ms']:,.0f} ms; most host time: {top}; most device time: {kernels}",
            "profile": prof, "rows": rows}


def bench_settings(name: str, cpu: bool, precision: str) -> list[tuple[str, list[str]]]:
    """A bench step's settings as tools/bench.py names them, each with its overrides."""
    from bench import settings_from  # lazy: tools/bench.py, beside this file
    return settings_from(argparse.Namespace(**BENCH[name](cpu), precision=precision, batch=""))


def plan_settings(check: Check) -> dict[str, list[str]]:
    """The bench steps' settings the planner predicts: tools/bench.py's own names and overrides, so a
    plan meets its measured row by name (float8's bf16 baseline is a compile_vs_eager row again)."""
    out = {}
    for name in BENCH:
        out.update(bench_settings(name, check.cpu, check.precision))
    if check.cpu:  # toy size: two settings show the plumbing
        out = dict(list(out.items())[:1] + list(out.items())[-1:])
    return out


def calibrate(check: Check, timeout: float) -> dict:
    """This device measured for the planner (its file comes back in <out>); the planner thread waits for it."""
    try:
        out = check.sh([sys.executable, "-m", "torchmeg.plan", "--calibrate", "--out", check.calibration]
                       + (["--budget", "0.3"] if check.cpu else []), timeout)
        return {"calibration": os.path.basename(check.calibration), "said": out.strip().splitlines()[-1][:300]}
    finally:
        check.calibrated.set()


def start_planner(check: Check, gpu: str) -> None:
    """Plans every setting on the CPU, one after another, in a thread beside the GPU steps (the dry
    runs use fake tensors: no GPU memory, few cores), from the calibrate step's file when it made one."""
    def work():
        check.calibrated.wait(timeout=check.left())
        cal = ["--calibration", check.calibration] if os.path.exists(check.calibration) and not check.cpu else []
        for name, ov in plan_settings(check).items():
            path = os.path.join(check.work, f"plan {name}.json".replace(" ", "_").replace("=", "-"))
            try:
                check.sh([sys.executable, "-m", "torchmeg.plan", *RECIPE, "--world", "1", "--gpu", gpu, "--json", path,
                          *cal, *check.model, *ov], 600, env={"OMP_NUM_THREADS": "2" if check.cpu else "4"})
                p = json.load(open(path))
                check.plans[name] = {"predicted_step_ms": 1000 * p["predicted_step_s"], "predicted_mfu": p["predicted_mfu"],
                                     "roofline_step_ms": 1000 * p["step_s"], "calibrated": bool(cal),
                                     "predicted_memory_gib": p["ranks"][0]["peak_bytes"] / 2 ** 30,
                                     "fits": p["fits"]}
            except Exception as e:  # recorded per setting; the others are still planned
                check.plans[name] = {"error": str(e)[:400]}
    check.planner = threading.Thread(target=work, daemon=True)
    check.planner.start()


def planner(check: Check, timeout: float) -> dict:
    check.planner.join(timeout)
    measured = {}
    for part in ("compile_vs_eager", "float8"):
        path = os.path.join(check.work, part, "bench.json")
        if os.path.exists(path):
            for r in json.load(open(path)):
                measured.setdefault(r["setting"], r)  # (float8's baseline repeats a compile_vs_eager row)
    rows = []
    for name in plan_settings(check):
        p, m = check.plans.get(name, {"error": "not planned in time"}), measured.get(name)
        row = {"setting": name, **p}
        if m:
            row.update(measured_step_ms=m["median_step_ms"], measured_mfu=m["mfu"], measured_memory_gib=m["memory_gib"],
                       measured_allocated_gib=m.get("memory_allocated_gib"))
            if "predicted_step_ms" in p:
                row["measured_over_predicted_step"] = round(m["median_step_ms"] / p["predicted_step_ms"], 3)
        rows.append(row)
    note = ("CPU dry run: the predictions are for the named GPU, the measurements this CPU's (not comparable)"
            if check.cpu else ("measured on this GPU by compile_vs_eager / float8; memory: the allocator's peak (reserved), "
                                "and its tensors' (allocated): a plan counts tensors' bytes"))
    return {"note": note, "rows": rows}


def gpu_suite(check: Check, timeout: float) -> dict:
    """pytest tests/gpu on two workers; the planner-vs-run test is deselected here (two tests share
    the GPU under -n 2, and the planner step above compares the same numbers with the GPU to itself)."""
    import xml.etree.ElementTree as ET  # lazy: this step only
    xml = os.path.join(check.work, "gpu_suite.xml")
    try:
        check.sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-n", "2",
                  f"--timeout={int(min(200, timeout))}", f"--junitxml={xml}",
                  "--deselect", "tests/gpu/test_gpu.py::test_planner_step_time_against_a_real_run"], timeout)
        failed = None
    except RuntimeError as e:  # failures are in the XML; any other error propagates
        failed = str(e)
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        msg = next((c.get("message", "") for c in case if c.tag in ("failure", "error", "skipped")), "")
        text = next((c.text or "" for c in case if c.tag in ("failure", "error")), "")
        rows.append({"test": case.get("name"), "outcome": kind, "seconds": float(case.get("time", 0)),
                     "message": msg[:300], **({"detail": text[-2000:]} if text else {})})  # (the error: its end)
    bad = [r["test"] for r in rows if r["outcome"] in ("failure", "error")]
    # (a test that failed fails the step: the first lent H200 said "ok" above a table of failures)
    return {"rows": rows, **({"status": "failed", "why": f"{len(bad)} failed: {', '.join(bad)}"} if bad else {}),
            **({"pytest": failed[:600]} if failed else {})}


STEPS = [Step("calibrate", 90, 30, False, calibrate),
         Step("compile_vs_eager", 210, 60, False, compile_vs_eager),
         Step("float8", 160, 60, False, float8),
         Step("fused_ce", 60, 20, False, kernels("fused_ce")),
         Step("sink_attention", 60, 20, False, kernels("sink_attention")),
         Step("serving", 200, 60, False, serving),
         Step("planner", 60, 5, False, planner),
         Step("gpu_suite", 240, 60, True, gpu_suite)]


def run_steps(check: Check, steps: list[Step]) -> list[dict]:
    """Each step in turn within the budget: ok / failed (why) / skipped (why), seconds, its results."""
    results = []
    for s in steps:
        rec = {"step": s.name}
        left = check.left()
        if s.device_only and check.cpu:
            rec.update(status="skipped", why="needs a CUDA GPU (--cpu dry run)")
        elif left < s.least_s:
            rec.update(status="skipped", why=f"budget: {left:.0f} s left, the step needs {s.least_s} s or more; "
                                             f"rerun with --only {s.name}")
        else:
            t0 = time.monotonic()
            try:
                rec.update(status="ok")
                rec.update(s.run(check, min(s.cap_s * (3 if check.cpu else 1), left)))  # (may say "partial", why)
            except Exception as e:  # recorded; the next step runs
                rec.update(status="failed", why=f"{type(e).__name__}: {e}"[:1500])
            rec["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[gpu_check] {s.name}: {rec['status']}" + (f" ({rec['why'][:200]})" if "why" in rec else "")
              + (f" in {rec['seconds']} s" if "seconds" in rec else ""), flush=True)
        results.append(rec)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Steps: " + ", ".join(s.name for s in STEPS))
    ap.add_argument("--cpu", action="store_true", help="the dry run: toy sizes on the CPU, GPU-only steps skipped")
    ap.add_argument("--out", default=os.environ.get("OUT") or "outputs/gpu_check")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all steps (the device time)")
    ap.add_argument("--only", default="", help="comma list of steps (default: all)")
    a = ap.parse_args(argv)
    only = [x for x in a.only.split(",") if x]
    unknown = sorted(set(only) - {s.name for s in STEPS})
    if unknown:
        ap.error(f"--only {','.join(unknown)}: no such step; the steps are " + ", ".join(s.name for s in STEPS))
    os.makedirs(a.out, exist_ok=True)
    check = Check(a.cpu, os.path.abspath(a.out), a.budget * (4 if a.cpu else 1))
    env = environment(a.cpu)
    print(f"[gpu_check] {env['device']} | torch {env['torch']} | torchao {env['torchao']} | "
          f"torchdata {env['torchdata']}", flush=True)
    steps = [s for s in STEPS if not only or s.name in only]
    if not any(s.name == "calibrate" for s in steps):
        check.calibrated.set()
    if any(s.name == "planner" for s in steps):
        gpu = "h100" if a.cpu else key_for_device(env["device"])
        if gpu is None:
            steps = [s for s in steps if s.name != "planner"]
            print(f"[gpu_check] planner: {env['device']} is not in the planner's GPU table; skipped", flush=True)
        else:
            start_planner(check, gpu)
    try:
        results = run_steps(check, steps)
    finally:  # the runs' files (a checkpoint, bench folders): what they measured is in the report
        shutil.rmtree(check.work, ignore_errors=True)
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "mode": "cpu dry run" if a.cpu else "gpu", "environment": env, "steps": results,
              "seconds": round(time.monotonic() - check.t0, 1)}
    with open(os.path.join(a.out, "gpu_check.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as fh:
        fh.write(markdown(report))
    print(markdown(report))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
