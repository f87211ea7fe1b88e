"""The planner's children that trace job after job of one fake world (torchmeg/plan/trace_lanes.py):
a child traces the next job of its own lane (world, rank, parallel dims) as it finishes one, never
another lane's, and each piece is what a child of its own traces, number for number."""
from __future__ import annotations

import json
import os

import pytest

from launch import ROOT
from torchmeg.config.schema import load_config

RECIPE = os.path.join(ROOT, "recipes", "debug_llama.toml")
# debug blocks at a width where a trace's shapes matter; TP 2 x FSDP 2 on 4 ranks: layouts of one
# lane differ in local batch and recompute (the search's chains), PP 2 makes two lanes of one layout
TP2 = ["--model.n_layers=10", "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]
LAYOUTS = [TP2 + ["--training.local_batch_size=2", "--activation_checkpoint.mode=none"],
           TP2 + ["--training.local_batch_size=4", "--activation_checkpoint.mode=full"],
           ["--model.n_layers=10", "--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
            "--training.local_batch_size=4", "--parallelism.pipeline_parallel_microbatches=2"]]


@pytest.mark.slow
def test_a_child_traces_its_lanes_jobs_in_turn_with_a_fresh_childs_numbers():
    from torchmeg.plan import dry_run  # lazy: the trainer's build, only for this test
    from torchmeg.plan.planner import prepare_plan
    from torchmeg.plan.trace_lanes import run_lanes
    prepared = [prepare_plan(load_config(RECIPE, a), 4, "h100") for a in LAYOUTS]
    try:
        jobs = [j for p in prepared for j in p.run.jobs]
        todo, got = list(jobs), {}

        def pick(want):
            job = next((j for j in todo if want(dry_run.job_lane(j))), None)
            if job is not None:
                todo.remove(job)
            return job

        before = []  # (a child's own copy: the traces it ran before this one)

        def trace(job):  # -> (the child, by a name drawn at its first trace: a pid can be reused, ...)
            if not before:
                before.append(os.urandom(8).hex())
            before.append(job)
            return before[0], len(before) - 2, dry_run.trace_job(job)
        run_lanes(2, dry_run.job_lane, pick, lambda job, r: got.__setitem__(job, r), trace)
        assert set(got) == set(jobs)
        lanes: dict = {}
        for job, (child, _, _) in got.items():
            lanes.setdefault(child, set()).add(dry_run.job_lane(job))
        assert all(len(ls) == 1 for ls in lanes.values()), lanes  # a child is one world, one rank, one set of meshes
        assert len({dry_run.job_lane(j) for j in jobs}) == 3, jobs  # (TP 2 x FSDP 2; PP 2's two ranks)
        assert len(lanes) < len(jobs), (len(lanes), len(jobs))  # children were kept for their lane's next job
        # each piece a child traced after others is what a child of its own traces (one job, isolated),
        # to the last number
        later = [job for job in jobs if got[job][1] > 0]
        assert later
        for job in later:
            alone, = dry_run.run_jobs([job], isolate=True)
            assert json.dumps(got[job][2], sort_keys=True, default=str) == json.dumps(alone, sort_keys=True, default=str), job
    finally:
        for p in prepared:
            dry_run.forget(p.run)


@pytest.mark.slow
def test_a_trace_that_fails_or_dies_is_raised_and_no_child_is_left():
    """A trace's exception reaches the planner as it was raised; a child that dies is said with its exit
    code and the job it was tracing; either way every child is gone when the planner goes on."""
    import multiprocessing as mp

    from torchmeg.plan.trace_lanes import run_lanes

    def trace(job):
        if job == "boom":
            raise ValueError("this op's shape depends on the data")
        if job == "dies":
            os._exit(3)
        return job
    for bad, said in (("boom", "depends on the data"), ("dies", "exit code 3\\) tracing job dies")):
        todo, got = ["a", bad, "b", "c"], {}
        with pytest.raises((ValueError, RuntimeError), match=said):
            run_lanes(2, lambda job: 0, lambda want: todo.pop(0) if todo else None, got.__setitem__, trace)
        assert not mp.active_children()
        assert set(got) <= {"a", "b", "c"}
