"""tools/gpu_check.py, the one prepared GPU call: its dry run on the CPU (every step's CPU part at toy
size, the GPU-only step skipped by name) so that a lent GPU's 15 minutes are not the script's first
run, and its budget and failure handling (a step that fails or cannot fit is recorded, the rest run)."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from launch import ROOT, own_tmp

sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402  (tools/, put on the path above)


@pytest.fixture(autouse=True)
def _work_in_tmp_path(tmp_path, monkeypatch):
    """Check's work folder (tempfile.mkdtemp) under the test's own folder, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_each_step_is_run_skipped_or_failed_by_name_and_the_rest_go_on(tmp_path):
    """A failing step is recorded with its error and the next one runs; a step the remaining budget
    cannot hold and a GPU-only step under --cpu are skipped, each saying why."""
    ran = []

    def ok(check, timeout):
        ran.append(timeout)
        return {"rows": [{"setting": "x"}]}

    def boom(check, timeout):
        raise RuntimeError("exit 1: python -m torchmeg.train ...")
    check = gpu_check.Check(True, str(tmp_path), budget=100)
    steps = [gpu_check.Step("first", 10, 5, False, ok), gpu_check.Step("broken", 10, 5, False, boom),
             gpu_check.Step("device", 10, 5, True, ok), gpu_check.Step("too_big", 10, 500, False, ok),
             gpu_check.Step("last", 10, 5, False, ok)]
    got = {r["step"]: r for r in gpu_check.run_steps(check, steps)}
    assert [got[s]["status"] for s in ("first", "broken", "device", "too_big", "last")] == \
        ["ok", "failed", "skipped", "skipped", "ok"]
    assert "exit 1: python -m torchmeg.train" in got["broken"]["why"]
    assert "needs a CUDA GPU" in got["device"]["why"]
    assert "budget" in got["too_big"]["why"] and "--only too_big" in got["too_big"]["why"]
    assert len(ran) == 2 and all(t <= 30 for t in ran)  # each step's time bounded by its cap (x3 on the CPU)
    env = dict(device="CPU", torch="2.x", cuda=None, torchao="0.18.0", torchdata="0.11.0", triton="-", python="3",
               commit="abc")
    md = gpu_check.markdown({"environment": env, "when": "now", "mode": "cpu dry run",
                             "seconds": 1.0, "steps": list(got.values())})
    assert all(f"### {s}: " in md for s in got)


def test_a_bench_cut_by_its_time_keeps_the_settings_it_measured(tmp_path, monkeypatch):
    """tools/bench.py writes bench.json after each setting (--one-at-a-time): a bench step whose time
    runs out reports the rows written so far, status "partial" with why; with none written it fails."""
    check = gpu_check.Check(True, str(tmp_path), budget=100)

    def cut(cmd, timeout, env=None):
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench.json"), "w") as fh:
            json.dump([{"setting": "eager", "median_step_ms": 1.0, "step_ms_all": [1.0]}], fh)
        raise TimeoutError("timed out after 5 s: python tools/bench.py ...")
    monkeypatch.setattr(check, "sh", cut)
    got = gpu_check.compile_vs_eager(check, 5)
    assert got["status"] == "partial" and "timed out after 5 s" in got["why"]
    assert got["rows"] == [{"setting": "eager", "median_step_ms": 1.0}]

    def nothing(cmd, timeout, env=None):
        raise TimeoutError("timed out after 5 s")
    monkeypatch.setattr(check, "sh", nothing)
    with pytest.raises(TimeoutError):
        gpu_check.float8(check, 5)


def test_a_gpu_benches_every_setting_and_the_dry_run_two():
    """The settings each bench step passes tools/bench.py, by the names bench gives them: on a GPU
    compile x recompute and compiled float8's recipes; the CPU dry run one compile (recompute full)."""
    def names(step, cpu):
        return [n for n, _ in gpu_check.bench_settings(step, cpu, "fp32" if cpu else "bf16")]
    assert names("compile_vs_eager", False) == ["eager bf16", "eager ac=full bf16", "compiled bf16",
                                                "compiled ac=full bf16"]
    assert names("float8", False) == ["compiled bf16", "compiled float8 tensorwise bf16", "compiled float8 rowwise bf16"]
    assert names("compile_vs_eager", True) == ["eager ac=full", "compiled ac=full"]
    assert names("float8", True) == ["eager", "eager float8 tensorwise", "eager float8 rowwise"]


@pytest.mark.slow
def test_a_step_past_its_time_is_killed_with_what_it_started(tmp_path):
    """A step's command and every process it started end at its timeout (its own process group)."""
    check = gpu_check.Check(True, str(tmp_path), budget=100)
    marker = tmp_path / "child.pid"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 2 s"):
        check.sh(["bash", "-c", f"sleep 60 & echo $! > {marker}; wait"], timeout=2)
    assert time.monotonic() - t0 < 30
    pid = int(marker.read_text())
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.slow
@pytest.mark.timeout(600)  # 157-215 s in the last .ci/runs (two workers); its own bound, 480 s, fires first
def test_the_gpu_call_runs_dry_on_the_cpu(tmp_path):
    """`tools/gpu_check.py --cpu`: every step but the GPU suite runs at toy size and reports what ran
    — the bench settings by name with compiled kernels counted, float8 changing the loss (it ran),
    the fused loss equal to the unfused one, each attention way through an SDPA kernel, the engine at
    two concurrencies, a plan beside each planned setting — and the report names every step."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=480, env=own_tmp(tmp))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.load(open(out / "gpu_check.json"))
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in gpu_check.STEPS]
    assert steps["gpu_suite"]["status"] == "skipped" and "needs a CUDA GPU" in steps["gpu_suite"]["why"]
    assert all(s["status"] == "ok" for n, s in steps.items() if n != "gpu_suite"), steps
    bench = {r["setting"]: r for r in steps["compile_vs_eager"]["rows"]}
    # (on the CPU at recompute full only: tools/gpu_check.BENCH; on a GPU all four, as
    # test_a_gpu_benches_every_setting_and_the_dry_run_two holds)
    assert list(bench) == ["eager ac=full", "compiled ac=full"]
    assert bench["eager ac=full"]["kernels"] == 0 and bench["compiled ac=full"]["kernels"] > 0
    # the same steps on the same data from the same seed: compile changes the loss by reordered fp32
    # sums only (~1e-6 relative over two steps); float8 (e4m3: 3 mantissa bits) by ~1e-3
    losses = [r["last_loss"] for r in bench.values()]
    assert max(losses) - min(losses) <= 1e-4 * losses[0], losses
    f8 = {r["setting"]: r for r in steps["float8"]["rows"]}
    assert list(f8) == ["eager", "eager float8 tensorwise", "eager float8 rowwise"]
    assert all(abs(f8[k]["last_loss"] - f8["eager"]["last_loss"]) > 1e-5 for k in list(f8)[1:]), f8
    assert all(abs(f8[k]["last_loss"] - f8["eager"]["last_loss"]) < 0.05 * f8["eager"]["last_loss"] for k in f8)
    ce = {r["way"]: r for r in steps["fused_ce"]["rows"]}
    assert list(ce) == ["unfused", "fused (torch ops)"]  # (the Triton kernel: CUDA only)
    assert ce["fused (torch ops)"]["loss_rel_diff"] < 1e-6 and ce["fused (torch ops)"]["grad_w_rel_diff"] < 1e-5
    assert ce["fused (torch ops)"]["predicted_peak_gib"] < ce["unfused"]["predicted_peak_gib"]
    attn = steps["sink_attention"]["rows"]
    assert len(attn) == 3 and all(r["sdpa_kernels"] and r["forward_backward_ms"] > 0 for r in attn)
    serve = steps["serving"]["rows"]
    # (eager and static decode side by side, then the same 8 at once sampled, with a presence penalty: it
    # ends with every token; the static rows ran the compiled step: one graph, every decode step through it)
    assert [(r["set"], r["decode"], r["concurrency"]) for r in serve] == [
        ("fixed", "eager", 1), ("fixed", "eager", 8), ("fixed", "static", 1), ("fixed", "static", 8),
        ("fixed, sampled", "eager", 8)]
    assert all(r["output_tokens_per_sec"] > 0 for r in serve) and serve[4]["output_tokens"] == serve[1]["output_tokens"]
    assert [r["compiles"] for r in serve[2:4]] == [1, 1] and sum(serve[3]["steps_by_size"].values()) > 0, serve
    prof = steps["serving"]["profile"]  # (the 8-at-once run again under the profiler: where its host time went)
    assert prof["concurrency"] == 8 and prof["steps"] > 0 and prof["forward_ms"] > 0 and prof["top_host_ops"], prof
    assert prof["top_device_ops"] == [] and "most device time: none (no device)" in steps["serving"]["note"]  # (CPU)
    plans = steps["planner"]["rows"]
    assert plans and all(r.get("predicted_step_ms", 0) > 0 and r.get("measured_step_ms", 0) > 0 for r in plans), plans
    md = (out / "gpu_check.md").read_text()
    assert all(f"### {name}: " in md for name in steps) and "| compiled ac=full |" in md
    assert steps["calibrate"]["calibration"] == "calibration.json" and "calibrated" in steps["calibrate"]["said"]
    cal = json.loads((out / "calibration.json").read_text())  # (the device measured: comes back to ship for it)
    assert cal["device"] == "cpu" and cal["matmul"]["float32"] and cal["memory"]["add"]
    assert sorted(os.listdir(out)) == ["calibration.json", "gpu_check.json", "gpu_check.log", "gpu_check.md"]
    assert not [f for f in os.listdir(tmp) if f.startswith("torchmeg-")], os.listdir(tmp)  # its work folders gone
