"""No run ends badly: a failure or a hang on one rank ends every rank in seconds, the profiler key
writes real traces, non-finite runs stop, and metrics stay valid JSON."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import TINY, read_metrics
from launch import ROOT, free_port, run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.train.validate import validate

P = "--parallelism."


def launch_unsupervised(args, tmp_path, nproc, env, timeout=90):
    """Start the ranks with torchrun's worker environment and NO supervisor: nobody kills a rank
    when another fails, so whatever ends them is torchmeg's own doing. -> (codes, stderrs, wall s)."""
    port, procs = free_port(), []
    cmd = [sys.executable, "-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", "--job.name=run"] + args
    t0 = time.time()
    for r in range(nproc):
        e = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, timeout - (time.time() - t0))))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], [e for _, e in outs], time.time() - t0


@pytest.mark.slow
def test_exception_on_one_rank_ends_every_rank(tmp_path):
    env = {"TORCHMEG_TEST_RAISE_AT_STEP": "3", "TORCHMEG_TEST_FAULT_RANK": "1"}
    codes, errs, wall = launch_unsupervised(TINY + ["--training.steps=50", P + "data_parallel_shard_degree=2",
                                                    "--training.local_batch_size=2"], tmp_path, 2, env)
    assert all(c not in (0, None) for c in codes), codes
    assert wall < 60, f"{wall:.0f} s"  # start-up included; the collective timeout is 300 s
    assert "injected failure at step 3 on rank 1" in errs[1] and "[rank 1]" in errs[1]
    assert errs[0].count("injected failure") == 1 and "stopping because rank 1" in errs[0]
    assert "Traceback" not in errs[0]  # the root cause is printed once, by the rank that had it
    assert max(r["step"] for r in read_metrics(tmp_path)) == 2


@pytest.mark.slow
def test_hang_on_one_rank_dumps_stacks_and_ends(tmp_path):
    env = {"TORCHMEG_TEST_HANG_AT_STEP": "5", "TORCHMEG_TEST_FAULT_RANK": "1"}
    args = TINY + ["--model.n_layers=2", "--training.steps=50", "--training.local_batch_size=4",
                   P + "pipeline_parallel_degree=2", "--training.watchdog_min_s=4", "--training.watchdog_factor=5"]
    codes, errs, wall = launch_unsupervised(args, tmp_path, 2, env)
    assert codes[1] == 3 and codes[0] not in (0, None), codes
    assert wall < 60, f"{wall:.0f} s"
    assert "past the watchdog limit" in errs[1] and "pipeline: last action" in errs[1]
    assert "inject_fault" in errs[1] and "Thread 0x" in errs[1]  # faulthandler's all-thread dump
    # The waiting rank dumps where it was stuck: its own watchdog fired, or it saw the peer go and
    # printed the traceback of the collective it was waiting in.
    own = "past the watchdog limit" in errs[0] and "Thread 0x" in errs[0]
    peer = "hung in step 5" in errs[0] and "[rank 0]" in errs[0]
    assert own or peer, errs[0][-3000:]


@pytest.mark.slow
def test_profiling_writes_a_trace_per_rank(tmp_path):
    p = run_cli(TINY + ["--training.steps=4", "--profiling.enable=true", "--profiling.profile_freq=4",
                        "--profiling.active_steps=1", P + "data_parallel_shard_degree=2",
                        "--training.local_batch_size=2"], tmp_path, nproc=2)
    folder = tmp_path / "run" / "profile" / "step-000004"
    assert "[profile] step 4: trace, memory per operator" in p.stdout, p.stdout[-2000:]
    for r in (0, 1):
        trace = json.load(open(folder / f"rank{r}.trace.json"))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"aten::mm", "aten::addmm"} & names, sorted(n for n in names if n and "aten" in n)[:20]
        assert "aten::mm" in open(folder / f"rank{r}.memory_ops.txt").read()
        # tools/step_profile.py reads the same trace: the step's time by kind of work and by phase
        prof = subprocess.run([sys.executable, "tools/step_profile.py", "--json", str(folder / f"rank{r}.trace.json")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert prof.returncode == 0, prof.stderr[-2000:]
        rep = json.loads(prof.stdout)
        assert rep["steps"] == 1 and rep["mm_flops"] > 0 and 0 < rep["kinds"]["matmul"] < rep["wall_us"], rep
        assert rep["kinds"]["communication"] > 0, rep  # FSDP2's all-gathers and reduce-scatters
        assert {"forward", "backward", "optimizer", "data"} <= set(rep["phases"]), rep["phases"]
        # torch's timeline exporter sometimes asserts (pytorch/pytorch#167838): then the rank says
        # so on its stderr (the harness keeps every rank's stderr, rank 0's stdout)
        timeline = folder / f"rank{r}.memory_timeline.html"
        assert (os.path.exists(timeline) and os.path.getsize(timeline) > 1000) or \
            f"[profile] rank {r} step 4: no memory timeline" in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
def test_consecutive_skips_stop_the_run(tmp_path):
    args = TINY + ["--training.steps=10", "--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0",
                   "--training.max_norm=0", "--training.max_consecutive_skips=3"]
    p = run_cli(args, tmp_path, check=False)
    assert p.returncode == 1 and "max_consecutive_skips = 3" in p.stderr
    rows = read_metrics(tmp_path)
    assert sum(1 for r in rows if r.get("skipped")) == 3 and max(r["step"] for r in rows) < 10


@pytest.mark.slow
def test_metrics_jsonl_is_strict_json_with_nonfinite_values(tmp_path):
    run_cli(TINY + ["--training.steps=3"], tmp_path, env={"TORCHMEG_TEST_NAN_AT_STEP": "2"})
    lines = open(tmp_path / "run" / "metrics.jsonl").read().splitlines()

    def no_constants(name):
        raise ValueError(f"bare {name} in metrics.jsonl")
    rows = [json.loads(line, parse_constant=no_constants) for line in lines]
    assert rows[1]["step"] == 2 and rows[1]["loss"] is None and rows[1]["skipped"] is True


@pytest.mark.parametrize("override, words", [
    (["--job.name=../../x"], ["job.name", "inside job.dump_folder"]),
    (["--job.name=/tmp/elsewhere"], ["job.name", "inside job.dump_folder"]),
    (["--optimizer.lr=nan"], ["optimizer.lr", "finite"]),
    (["--optimizer.lr=inf"], ["optimizer.lr", "finite"]),
    (["--training.max_norm=-inf"], ["training.max_norm"]),
    (["--profiling.enable=true", "--profiling.profile_freq=2"], ["profiling.profile_freq", "active_steps + 2"]),
])
def test_bad_values_are_refused(override, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, override))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.slow
def test_job_name_may_nest_inside_dump_folder(tmp_path):
    validate(load_config(None, ["--job.name=sweep/lr_1"]))
    p = run_cli(TINY + ["--training.steps=1"], tmp_path, name="../escape", check=False)
    assert p.returncode == 2 and "job.name" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path.parent / "escape").exists()


@pytest.mark.slow
def test_failure_under_torchrun_max_restarts_resumes(tmp_path):
    """The fail-fast exit hands torchrun a failed group; with --max-restarts it restarts it, the
    restart resumes from the newest checkpoint and finishes (metrics: each step once)."""
    args = TINY + ["--training.steps=6", "--checkpoint.enable=true", "--checkpoint.interval=3",
                   P + "data_parallel_shard_degree=2", "--training.local_batch_size=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", "--job.name=run"] + args
    env = dict(os.environ, TORCHMEG_TEST_RAISE_AT_STEP="5", TORCHMEG_TEST_FAULT_RANK="1", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "injected failure at step 5 on rank 1" in p.stderr and "resumed   from step 3" in p.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))


@pytest.mark.slow
def test_collective_timeouts_follow_the_phase_and_stay_above_the_watchdog():
    """comm.init_timeout_seconds on every group (the mesh's too: torch gives those gloo's 30 min, not
    the init's) until the steady steps, then comm.train_timeout_seconds -- or 1.25 x the watchdog's
    step limit when that is longer -- except on the async checkpoint's group; long again for
    evaluation and checkpoint I/O. Read back from each gloo backend's options."""
    script = textwrap.dedent("""
        import datetime, json, os, torch, torch.distributed as dist
        from torchmeg.config.schema import load_config
        from torchmeg.runtime.process import CollectiveTimeouts, init_distributed
        cfg = load_config(None, ["--comm.init_timeout_seconds=900", "--comm.train_timeout_seconds=200"])
        init_distributed(torch.device("cpu"), cfg.comm.init_timeout_seconds)
        mesh_group, ckpt_group = dist.new_group([0]), dist.new_group([0])
        def read():
            return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for g in (dist.group.WORLD, mesh_group, ckpt_group)]
        out = {"made": read()}
        t = CollectiveTimeouts(cfg, keep_long=[ckpt_group])
        out["start"] = read()
        t.steady(120.0)
        out["steady"] = read()
        t.steady(400.0)
        out["slow_steps"] = read()
        t.long()
        out["eval"] = read()
        print(json.dumps(out))
        dist.destroy_process_group()
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["made"][0] == 900 and out["made"][1] == 1800  # torch's own default for a new gloo group
    assert out["start"] == [900, 900, 900]
    assert out["steady"] == [200, 200, 900]
    assert out["slow_steps"] == [500, 500, 900]  # 1.25 x a watchdog limit of 400 s
    assert out["eval"] == [900, 900, 900]


@pytest.mark.slow
@pytest.mark.parametrize("keys, msg", [
    (["--comm.init_timeout_seconds=600"], "comm.init_timeout_seconds = 600: must exceed training.watchdog_startup_s"),
    (["--comm.train_timeout_seconds=60"], "comm.train_timeout_seconds = 60: must exceed training.watchdog_min_s"),
])
def test_timeouts_below_the_watchdog_are_refused(keys, msg, tmp_path):
    p = run_cli(TINY + keys, tmp_path, check=False)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
