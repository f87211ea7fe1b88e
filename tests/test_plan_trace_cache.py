"""plan.trace_cache (torchmeg/plan/trace_cache.py): a plan that traces the same program again reads
its traces back, gives the numbers of a fresh plan to the last bit, and traces anew whatever changes
the program or cannot be read."""
from __future__ import annotations

import json
import os
import sys

import pytest

from launch import ROOT, run_one
from torchmeg.config.schema import load_config

RECIPE = os.path.join(ROOT, "recipes", "debug_llama.toml")
# 10 layers: a sampled plan of 2 traces (4 and 5 layers), TP 2 so async TP is a choice
TP2 = ["--model.n_layers=10", "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
FAST = ["--compile.enable=true", "--parallelism.enable_async_tensor_parallel=true"]


def _plan(args: list[str], gpu: str, cache=None) -> dict:
    from torchmeg.plan.planner import plan  # lazy: imports the trainer's build (slow) only for these tests
    extra = [f"--plan.trace_cache={cache}"] if cache is not None else []
    return plan(load_config(RECIPE, args + extra), 2, gpu, isolate=True)


def _plan_in_a_process(args: list[str], gpu: str, cache, seed: str, out) -> dict:
    """`python -m torchmeg.plan` in an interpreter of its own with this string hash seed (a set of layer
    names prints in another order under another seed: the key must not)."""
    env = dict(os.environ, PYTHONHASHSEED=seed, TORCHMEG_TEST_NO_ZYGOTE="1", OMP_NUM_THREADS="1")
    p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", RECIPE, "--world", "2", "--gpu", gpu,
                  "--json", str(out), f"--plan.trace_cache={cache}"] + args, env, 300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.load(open(out))


def _numbers(p: dict) -> dict:
    """Everything a plan says but its wall time and what it read from the cache (as JSON holds it)."""
    return json.loads(json.dumps({k: v for k, v in p.items() if k not in ("dry_run_s", "traces_cached")}))


@pytest.mark.slow
def test_a_plan_of_the_same_program_reads_its_traces_and_equals_a_fresh_plan(tmp_path, capfd):
    cache = tmp_path / "traces"
    first = _plan_in_a_process(TP2 + FAST, "h100", cache, "1", tmp_path / "first.json")
    assert first["traces"] == 2 and first["traces_cached"] == 0
    # another GPU, compile and async TP off, another process: the same traced program (the dry run
    # traces eager ops)
    again = _plan_in_a_process(TP2, "a100", cache, "2", tmp_path / "again.json")
    assert again["traces_cached"] == again["traces"] == 2, again["traces_cached"]
    fresh = _plan(TP2, "a100")
    assert fresh["traces_cached"] == 0
    assert _numbers(again) == _numbers(fresh)
    # async TP still reaches the time model: the first plan hides TP traffic the others expose
    assert first["ranks"][0]["async_tp"] and not again["ranks"][0]["async_tp"]
    # a change to what is traced is a miss: a smaller local batch, one more layer
    assert _plan(TP2 + ["--training.local_batch_size=4"], "a100", cache)["traces_cached"] == 0
    assert _plan(TP2 + ["--model.n_layers=11"], "a100", cache)["traces_cached"] == 0
    assert _plan(TP2, "a100", cache)["traces_cached"] == 2
    # a damaged cache (a plan killed while writing, a disk filled up) is traced again, never an error
    pieces = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert pieces and all(f.endswith(".pickle") for f in pieces)  # (no temporary file left behind)
    for f in pieces:
        with open(f, "r+b") as h:
            h.truncate(10)
    damaged = _plan(TP2, "a100", cache)
    assert damaged["traces_cached"] == 0 and _numbers(damaged) == _numbers(fresh)
    # a folder that cannot be written: the plan says so and plans on
    (tmp_path / "a_file").write_text("")
    unwritable = _plan(TP2, "a100", tmp_path / "a_file")
    assert unwritable["traces_cached"] == 0 and _numbers(unwritable) == _numbers(fresh)
    assert "plan.trace_cache = " in capfd.readouterr().err
