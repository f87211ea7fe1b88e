"""The planner on a measured device (torchmeg.plan.calibrate / calibrated): `--calibrate` writes what it
measured under the planner's own op counter, a plan prices each op from it (and fails without it, in one
line), a plan for this CPU traces the CPU's program, and tools/plan_vs_run.py holds one layout's plan to
the run (memory within 10%; its times are reported, never asserted: docs/planning.md has the table).
"""
import json
import math
import contextlib
import os
import sys

import pytest

from launch import ROOT, run_one

sys.path.insert(0, ROOT)
from torchmeg.plan.calibrate import ROWS, WEIGHTS  # noqa: E402
from torchmeg.plan.calibrated import Calibration  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "debug_llama.toml")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _table(rate: float, bandwidth: float) -> dict:
    """A calibration of a made-up device: matmuls at `rate` FLOP/s from 1 GFLOP up (a tenth of it at 1
    MFLOP), memory-bound ops at `bandwidth` (silu at a quarter of it)."""
    mm = [[2 * n ** 3, 3 * 4 * n * n, 2 * n ** 3 / (rate * (0.1 if n < 200 else 1.0))] for n in (100, 800, 1600)]
    mem = [[b, b / bandwidth] for b in (1e4, 1e6, 1e8)]
    return {"device": "cpu", "name": "test", "threads": 1, "ranks": 1, "dispatch_s": 1e-5, "host_serial": True,
            "matmul": {"float32": mm}, "attention": {"float32": {"attention_causal": mm}},
            "memory": {"add": mem, "silu": [[b, 4 * t] for b, t in mem]}}


def test_an_op_is_priced_from_the_measured_points_nearest_it():
    cal = Calibration(_table(1e11, 1e10))
    n = 800
    at_point = cal.op_seconds(2 * n ** 3, 12 * n * n, "float32", "matmul")
    assert at_point == pytest.approx(2 * n ** 3 / 1e11, rel=1e-9)  # a measured shape: its own time
    big = cal.op_seconds(2 * 4096 ** 3, 12 * 4096 ** 2, "float32", "matmul")  # beyond the grid: the settled rate
    assert big == pytest.approx(2 * 4096 ** 3 / 1e11, rel=0.05)
    small = cal.op_seconds(2 * 100 ** 3, 12 * 100 ** 2, "float32", "matmul")
    assert small == pytest.approx(2 * 100 ** 3 / 1e10, rel=1e-9)  # a tiny matmul at a tenth of the rate
    assert cal.op_seconds(0, 1e6, "add", "memory") == pytest.approx(1e-4, rel=1e-9)
    assert cal.op_seconds(0, 1e6, "gelu", "memory") == pytest.approx(4e-4, rel=1e-9)  # its family's table (silu)
    assert cal.op_seconds(0, 1e6, "slice_backward", "memory") == pytest.approx(1e-4, rel=1e-9)  # unknown: a copy's
    assert cal.op_seconds(0, 1e6, "mul_", "memory") == pytest.approx(1e-4, rel=1e-9)  # (no mul table: add's)
    shaped = _table(1e11, 1e10)  # the same points with their shapes: a shaped matmul is priced by them
    shaped["matmul"]["float32"] = [[f, b, t, n, n, n] for (f, b, t), n in zip(shaped["matmul"]["float32"], (100, 800, 1600))]
    by_shape = Calibration(shaped)
    assert by_shape.op_seconds(2 * 100 ** 3, 0, "float32", "matmul@100x100x100") == pytest.approx(2e6 / 1e10, rel=1e-9)
    # 400^3 between the 100^3 point (a tenth of the rate) and 800^3's: slower than 800's rate, faster than 100's
    mid = by_shape.op_seconds(2 * 400 ** 3, 0, "float32", "matmul@400x400x400")
    assert 2 * 400 ** 3 / 1e11 < mid < 2 * 400 ** 3 / 1e10
    comm = Calibration({**_table(1e11, 1e10), "collectives": {"all_gather": [[2 ** 20, 2e-3], [65536, 1e-3]],
                                                               "overlap": 0.5, "after_work_s": 0.002}})
    assert set(comm.collectives) == {"all_gather"} and comm.overlap == 0.5  # (how it was timed is not a table)
    traffic = {"dp_shard/all_gather": {"count": 2, "bytes": 2 * 2 ** 21}, "pp/all_to_all": {"count": 1, "bytes": 65536},
               "tp/all_gather": {"count": 1, "bytes": 2 ** 20}}
    got = comm.comm_seconds(traffic)
    assert got["dp_shard/all_gather"] == pytest.approx(2 * 4e-3) and got["pp/all_to_all"] == pytest.approx(1e-3)
    assert got["tp/all_gather"] == pytest.approx(2e-3)  # (no functional table: c10d's)
    comm.collectives["dtensor/all_gather"] = [[65536, 2e-3], [2 ** 20, 5e-3]]
    comm.collectives["functional/all_to_all"] = [[65536, 3e-3]]
    traffic["ep/all_to_all"] = {"count": 1, "bytes": 65536}
    got = comm.comm_seconds(traffic)  # tensor parallel's through DTensor: its table; expert's functional; FSDP's c10d's
    assert got["tp/all_gather"] == pytest.approx(5e-3) and got["dp_shard/all_gather"] == pytest.approx(2 * 4e-3)
    assert got["ep/all_to_all"] == pytest.approx(3e-3) and got["pp/all_to_all"] == pytest.approx(1e-3)
    # a group of one rank (the loss over dp x cp = 1) waits for no one: free, not the table's latency
    assert comm.comm_seconds({"dp_cp/all_reduce": {"count": 2, "bytes": 40, "ranks": 1}}) == {"dp_cp/all_reduce": 0.0}
    by = cal.compute_seconds([(0, 1e6, "add", "memory", 0, 0)] * 3 + [(0, 0, None, "subclass", 0, 0)], compiled=True)
    assert by["memory"] == 0.0 and by["dispatch"] == 0.0  # fused away: no traffic, no kernel to dispatch
    # a fused silu keeps its arithmetic (4x a copy's time at its bytes: 3e-4 beyond the copy) and moves its
    # fused bytes at a copy's rate
    by = cal.compute_seconds([(0, 1e6, "silu", "memory", 5e5, 0)], compiled=True)
    assert by["memory"] == pytest.approx(3e-4 + 5e-5) and by["dispatch"] == pytest.approx(1e-5)
    by = cal.compute_seconds([(0, 1e6, "add", "memory", 1e6, 0)] * 3, compiled=False)
    assert by["dispatch"] == pytest.approx(3e-5) and cal.step_compute(by) == pytest.approx(3e-4 + 3e-5)


def test_a_pipelines_scalar_reductions_run_once_after_its_schedule():
    """The bubble stretches what runs inside the schedule (the stages' compute, their p2p, their tensor-parallel
    collectives); the loss's and the gradient norm's all-reduces over the stages and the data-parallel ranks
    run once after it: a 2-stage 1F1B of 2 microbatches (bubble 0.5) pays them once, not 1.5 times."""
    from torchmeg.plan.predict import _step
    comm = {"pp/send": 0.1, "pp/recv": 0.0, "tp/all_reduce": 0.05, "pp/all_reduce": 0.2, "dp_cp/all_reduce": 0.1}
    step, exposed, _, _ = _step(1.0, comm, 0.5)
    assert exposed == pytest.approx(0.45) and step == pytest.approx((1.0 + 0.15) * 1.5 + 0.3)
    assert _step(1.0, comm, 0.0)[0] == pytest.approx(1.45)  # (no pipeline: the same sum)


def test_a_pipelines_step_follows_each_stages_own_time():
    """Stages of unequal work (the last holds the output layer and the loss): the schedule's order played
    out with each rank's own busy seconds. 2-stage 1F1B, 2 microbatches: the last stage's T1 = 150, the
    first's T0 = 120 take T1 + T0 / 2 = 210 (rank 0 waits for rank 1's backward; rank 1 idles for one forward
    of rank 0's), not 1.5 x T1 = 225; equal stages keep the schedule's bubble. Outside the schedule (a scalar
    all-reduce: 7) stays added once; each rank's bubble becomes its own idle share."""
    from torchmeg.parallel.pipeline_order import makespan, one_f_one_b
    from torchmeg.plan.predict import stage_times
    assert makespan(one_f_one_b(2, 2), [120.0, 150.0]) == pytest.approx(210.0)
    assert makespan(one_f_one_b(2, 2), [150.0, 150.0]) == pytest.approx(225.0)
    assert makespan(one_f_one_b(4, 8), [100.0] * 4) == pytest.approx(100 * (1 + 3 / 8))  # (the schedule's own bubble)

    def row(pp_rank, busy):  # (a rank as predict returns it: its step the busy time stretched, plus 7 outside)
        step = busy * 1.5 + 7.0
        return {"pp_rank": pp_rank, "bubble": 0.5, "pipeline": {"schedule": "1F1B", "microbatches": 2},
                "busy_s": busy, "step_s": step, "mfu": 0.3, "predicted_busy_s": busy, "predicted_step_s": step,
                "predicted_mfu": 0.3}
    rows = [row(1, 150.0), row(0, 120.0)]
    stage_times(rows, 2)
    assert [r["predicted_step_s"] for r in rows] == pytest.approx([217.0, 217.0])
    assert rows[0]["step_s"] == pytest.approx(217.0) and rows[0]["predicted_mfu"] == pytest.approx(0.3 * 232 / 217)
    assert rows[0]["bubble"] == pytest.approx(210 / 150 - 1) and rows[1]["bubble"] == pytest.approx(210 / 120 - 1)
    lone = [row(0, 100.0)]
    stage_times(lone, 1)  # (no pipeline: unchanged)
    assert lone[0]["predicted_step_s"] == pytest.approx(157.0)


def test_each_collective_is_timed_after_work_as_a_step_makes_it(monkeypatch):
    """`--calibrate` times every collective after a rank's own work (calibrate_comm.step_work: a matmul chain),
    not back to back: a call after compute costs more on a CPU (a 2 MiB gloo all-gather 2.2 ms back to back,
    2.8-3.3 after matmuls). The work runs before each timed call and is not in its time: `seconds` with a
    10 ms `before` times a no-op at well under it; `collectives` (one gloo rank) runs the work before every
    call it times, says so in the table, and measures tensor parallel's gathers and reduce-scatters through
    DTensor's redistribute and the all-to-all through the functional collective."""
    import time

    import torch
    import torch.distributed as dist

    from torchmeg.plan import calibrate_comm
    from torchmeg.plan.timing import seconds
    calls = []

    def before():
        calls.append("work")
        time.sleep(0.01)
    t = seconds(lambda: calls.append("call"), torch.device("cpu"), 0.05, mean=True, before=before)
    assert t < 0.005 and calls[:2] == ["call", "work"], (t, calls[:4])  # (one warm-up call, then work, call, ...)
    assert all(a == "work" and b == "call" for a, b in zip(calls[1::2], calls[2::2])) and len(calls) >= 11
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        ran = []
        work = calibrate_comm.step_work(torch.device("cpu"), 1e-4)
        monkeypatch.setattr(calibrate_comm, "step_work", lambda device: lambda: ran.append(work()))
        monkeypatch.setattr(calibrate_comm, "overlap", lambda device: 0.0)
        monkeypatch.setattr(calibrate_comm, "COMM_MIN_TIME", 0.0)  # (5 calls a point)
        out = calibrate_comm.collectives(torch.device("cpu"), longest=1e-9, budget=0.0)
    finally:
        dist.destroy_process_group()
    points = sum(len(v) for k, v in out.items() if isinstance(v, list))
    assert out["after_work_s"] == calibrate_comm.WORK_S and points >= 7
    assert all(out[k] for k in ("dtensor/all_gather", "dtensor/reduce_scatter", "functional/all_to_all"))
    assert len(ran) >= 5 * points, (len(ran), points)  # (each point: a work before each of its >= 5 timed calls)


@pytest.mark.parametrize("foreach", [False, True], ids=["per_parameter", "foreach"])
def test_the_update_on_local_shards_counts_the_dtensor_ops_it_stands_for(foreach):
    """The plan traces AdamW's update on the DTensor parameters' local shards (plan.local_update: fast
    to trace); a real step runs it on DTensors, and each of those ops costs DTensor's host work (~25 us
    on this CPU, 303 of a TP 2 debug Llama step's ~1,000 DTensor ops). The shortcut counts one DTensor op
    for each op it runs on the shards or on what they made, as many as DTensor's own update dispatches
    over the same parameters (the per-parameter loop a CPU runs and the foreach one a GPU runs)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torchmeg.plan.local_update import on_local_shards
    from torchmeg.plan.step_cost import StepCost
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with FakeTensorMode():
            params = [torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False))
                      for _ in range(3)]
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
            for p in params:
                p.grad = DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
            opt.step()  # (the state made, as a plan's untracked first update makes it)
            counted = {}
            for how in ("dtensor", "local"):
                cost = StepCost()
                with cost, (on_local_shards(opt, cost) if how == "local" else contextlib.nullcontext()):
                    opt.step()
                counted[how] = [(name, op[3]) for name, op in zip(cost.op_names, cost.ops)]
    finally:
        dist.destroy_process_group()
    dtensor_ops = [name for name, kind in counted["dtensor"] if kind == "subclass"]
    assert len(dtensor_ops) >= (1 if foreach else 3) * 5, counted  # (AdamW: >= 5 ops a parameter)
    assert any(kind == "memory" for _, kind in counted["local"])  # (the shortcut ran its local kernels)
    assert counted["local"] == counted["dtensor"]  # (each DTensor op, then its local kernel, in order)


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bytes_read_long_after_they_were_written_are_priced_at_drams_rate():
    """torchmeg.plan.reuse: an op's input counts as cold when more than the cache's size of traffic went by
    since it was last touched (or it was never touched in the trace); a calibration with the device's cache
    size prices those bytes at its table's rate for the largest size measured, one without it prices every
    op warm (as before it was recorded)."""
    import torch
    from torchmeg.plan.reuse import reuse_distances
    from torchmeg.plan.step_cost import StepCost
    a, big = torch.ones(2 ** 16), torch.ones(2 ** 20)  # 256 KiB, 4 MiB
    for cache, want in ((2 ** 20, [2 ** 18, 0, 2 ** 22, 2 ** 18]), (0, [0, 0, 0, 0])):
        with reuse_distances(cache), StepCost() as cost:
            b = a * 2  # a: never touched in this trace (as optimizer state, read once a step): cold
            c = b * 3  # b: written by the op before: warm
            d = big * 2  # 8 MiB of traffic goes by (big: cold)
            e = b * 4  # b: last touched 8.5 MiB ago, more than the 1 MiB cache: cold
        del c, d, e
        assert [op[5] for name, op in zip(cost.op_names, cost.ops) if name == "aten.mul"] == want, cache
    mem = [[1e4, 1e4 / 1e10], [1e6, 1e6 / 1e10], [1e9, 1e9 / 1e9]]  # warm 10 GB/s; 1 GB/s at the largest size
    warm = Calibration({**_table(1e11, 1e10), "memory": {"add": mem}})
    cached = Calibration({**_table(1e11, 1e10), "memory": {"add": mem}, "cache_bytes": 2 ** 20})
    op = (0, 1e6, "add", "memory", 1e6, 5e5)  # 1 MB moved, half of it read cold
    assert warm.compute_seconds([op], compiled=False)["memory"] == pytest.approx(1e-4, rel=1e-9)
    assert cached.compute_seconds([op], compiled=False)["memory"] == pytest.approx(1e-4 + 5e5 * (1e-9 - 1e-10), rel=1e-9)


@pytest.mark.slow
def test_a_plan_for_a_calibrated_cpu_prices_every_op_from_the_file(tmp_path):
    """The same recipe on two made-up CPUs, one twice as fast at everything: the predicted step halves
    (no datasheet, no fitted factor in it); without a calibration, one line naming the fix."""
    steps = []
    for rate, bw in ((1e11, 1e10), (2e11, 2e10)):
        path = tmp_path / f"cal{rate:.0e}.json"
        cal = _table(rate, bw)
        cal["dispatch_s"] = 0.0
        path.write_text(json.dumps(cal))
        out = tmp_path / f"plan{rate:.0e}.json"
        p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", RECIPE, "--device", "cpu", "--calibration",
                     str(path), "--json", str(out)], ENV, 300)
        assert p.returncode == 0, p.stderr[-3000:]
        plan = json.load(open(out))
        assert plan["gpu"].startswith("CPU test") and plan["calibration"] == str(path)
        steps.append(plan["predicted_step_s"])
        assert "this device as measured" in p.stdout
    assert steps[1] == pytest.approx(steps[0] / 2, rel=1e-6)
    p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", RECIPE, "--device", "cpu", "--calibration",
                 str(tmp_path / "none.json")], ENV, 120)
    assert p.returncode == 2
    err = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "--calibrate --out" in err[0] and "none.json" in err[0], p.stderr


@pytest.mark.slow
def test_a_calibration_without_collectives_keeps_the_links_rates(tmp_path):
    """A GPU calibrated on one rank measured no collectives: its TP traffic is priced at the links' data-sheet
    rate as without a calibration (not free), while its compute comes from the file."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**_table(1e14, 1e12), "device": "cuda", "host_serial": False}))
    plans = {}
    for name, extra in (("datasheet", []), ("calibrated", ["--calibration", str(path)])):
        out = tmp_path / f"{name}.json"
        p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", RECIPE, "--world", "2", "--gpu", "h100",
                     "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                     "--json", str(out), *extra], ENV, 300)
        assert p.returncode == 0, p.stderr[-3000:]
        plans[name] = json.load(open(out))["ranks"][0]
    tp = {k: t for k, t in plans["datasheet"]["predicted_comm_exposed_by"].items() if k.startswith("tp/")}
    assert tp and all(t > 0 for t in tp.values())
    assert {k: plans["calibrated"]["predicted_comm_exposed_by"][k] for k in tp} == pytest.approx(tp, rel=1e-12)
    assert plans["calibrated"]["predicted_compute_s"] != plans["datasheet"]["predicted_compute_s"]


@pytest.mark.slow
def test_a_cpu_plan_traces_the_cpus_program():
    """torch's Adam runs a loop over the parameters on a CPU and one foreach kernel per formula step on a
    GPU: a plan for a CPU counts the loop's ops, a plan for a GPU the foreach ones (trace_step.gpu_optimizer)."""
    from torchmeg.config.schema import load_config
    from torchmeg.plan.dry_run import forget, run_jobs
    from torchmeg.plan.planner import prepare_plan
    names = {}
    for gpu in ("cpu", "h100"):
        cfg = load_config(RECIPE, ["--model.n_layers=2"])
        cfg.plan.gpu = gpu
        cfg.plan.calibration = ""
        p = prepare_plan(cfg, 1, "h100")  # (the program follows cfg.plan.gpu; the device record is not read here)
        try:
            ranks = p.run.finish(dict(zip(p.run.jobs, run_jobs(p.run.jobs, True))), True)
        finally:
            forget(p.run)
        names[gpu] = {op[2] for op in ranks[0]["ops"] if op[3] == "memory"}
    assert not any(n and n.startswith("_foreach") for n in names["cpu"]), names["cpu"]
    assert any(n and n.startswith("_foreach") for n in names["h100"]), names["h100"]


@pytest.mark.slow
def test_calibrate_then_plan_vs_run_on_one_layout(tmp_path):
    """`--calibrate` records each point with the planner's own counter's FLOPs, bytes and shape; then
    tools/plan_vs_run.py on one layout (one process, eager) with that calibration: two runs, its measured step (the faster),
    and the plan's peak within 10% of the real step's (memory does not depend on the machine's load; time
    does, so it is reported, not asserted)."""
    out = cal = tmp_path / "calibration-cpu-1rank.json"  # (the tool reuses its --out folder's calibration)
    p = run_one([sys.executable, "-m", "torchmeg.plan", "--calibrate", "--budget", "0.4", "--out", str(out)],
                dict(os.environ, OMP_NUM_THREADS="2"), 300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"-> {out}" in p.stdout
    data = json.load(open(out))
    assert data["device"] == "cpu" and data["threads"] == 2 and data["ranks"] == 1 and data["dispatch_s"] > 0
    # each matmul point is (FLOPs, bytes, seconds) as StepCost counts an mm: 2mnk, and the three operands'
    # bytes, mk + nk + mn in each of the forward / input-gradient / weight-gradient layouts
    grid = {(2 * m * n * k, 4 * (m * k + n * k + m * n)) for m in ROWS for n, k in WEIGHTS}
    sizes = set()
    for flops, nbytes, t, m, n, k in data["matmul"]["float32"]:
        assert t > 0 and (flops, nbytes) in grid and flops == 2 * m * n * k, (flops, nbytes, m, n, k)
        sizes.add(flops)
    assert len(sizes) >= 3
    assert {"add", "silu", "exp", "_softmax"} <= set(data["memory"]) and all(data["memory"].values())
    assert {"attention_causal", "attention_causal_backward"} <= set(data["attention"]["float32"])
    c = Calibration.load(str(out))
    assert c.best_rate() > 0 and math.isfinite(c.op_seconds(2 * 512 ** 3, 12 * 512 ** 2, "float32", "matmul"))
    rows = tmp_path / "rows.json"
    p = run_one([sys.executable, os.path.join(ROOT, "tools", "plan_vs_run.py"), "--recipes", "debug_llama",
                 "--layouts", "eager", "--steps", "4", "--passes", "2", "--out", str(tmp_path), "--json", str(rows)],
                dict(os.environ, OMP_NUM_THREADS="2"), 600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    (r,) = json.load(open(rows))
    assert r["recipe"] == "debug_llama" and r["layout"] == "eager" and r["calibration"] == str(cal)
    assert r["planned_step_s"] > 0 and r["measured_step_s"] > 0 and r["machine_speed"] > 0
    assert r["step_ratio"] == pytest.approx(r["planned_step_s"] / r["measured_step_s"])
    # (two passes: two runs of the step, the row's the faster; each printed)
    assert len(r["measured_steps_s"]) == 2 and r["measured_step_s"] == min(r["measured_steps_s"])
    assert "pass 2: debug_llama eager: measured" in p.stdout
    assert 0.9 <= r["memory_ratio"] <= 1.1, r
    assert "| debug_llama | eager | 1 |" in p.stdout
