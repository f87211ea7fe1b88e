"""Pipeline parallelism: all six torch schedules, compositions, uneven splits — each equal to one
process (fp32, deterministic, same global batch, tolerance 1e-5) — plus bad layouts and the
schedule picture."""
import os
import subprocess
import sys

import pytest

from conftest import reference_run, assert_parity as compare, TINY, read_metrics
from launch import ROOT, run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.train.validate import validate

P = "--parallelism."
# 4 layers so that every schedule (2 stages per rank at pp 2 for the looped / V ones) gets a layer.
BASE = [a for a in TINY if not a.startswith("--model.n_layers")] + [
    "--model.n_layers=4", "--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8",
    "--validation.freq=2"]  # evaluation mid-run and at the end: train and val losses both compared
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, BASE + ["--training.local_batch_size=8"])



@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                                      "ZBVZeroBubble", "DualPipeV"])
def test_schedule_matches_single_process(schedule, tmp_path, reference):
    p = run_cli(BASE + ["--training.local_batch_size=8", P + "pipeline_parallel_degree=2",
                        P + f"pipeline_parallel_schedule={schedule}"], tmp_path, nproc=2)
    assert schedule in p.stdout
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got if "val_loss" in r] == [2, 4]
    compare(reference, got)  # loss, grad norm and val_loss


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", [
    ("pp2_fsdp2", 4, 4, [P + "pipeline_parallel_degree=2"]),  # weights gathered once a step (the default)
    ("pp2_fsdp2_regather", 4, 4, [P + "pipeline_parallel_degree=2", P + "fsdp_reshard_per_microbatch=true"]),
    # split-backward schedule x FSDP: weights stay gathered until the W pass (parallelize.py)
    ("pp2_fsdp2_zbv", 4, 4, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_schedule=ZBVZeroBubble"]),
    ("pp2_tp2", 4, 8, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2"]),
    ("pp2_uneven_1_3", 2, 8, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_layers_per_stage=[1, 3]"]),
    ("pp2_grad_accum", 2, 4, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("pp2_tp2_fsdp2_interleaved", 8, 4, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2",
                                         P + "pipeline_parallel_schedule=Interleaved1F1B"]),
])
def test_composition_matches_single_process(name, ranks, local, layout, tmp_path, reference):
    p = run_cli(BASE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks, timeout=180)
    compare(reference, read_metrics(tmp_path))
    # under TP the schedule's loss takes the last stage's vocab-sharded logits (loss parallel)
    assert ("vocab-sharded logits (loss parallel)" in p.stdout) == ("tp2" in name), p.stdout[-2000:]
    if "fsdp2" in name:  # what FSDP did between microbatches (parallelize.reshard_after_forward)
        assert ("per microbatch" if "regather" in name else "once per step") in p.stdout, p.stdout[-2000:]


@pytest.mark.parametrize("override, words", [
    ([P + "pipeline_parallel_layers_per_stage=[1, 2]"], ["pipeline_parallel_layers_per_stage", "summing to"]),
    ([P + "pipeline_parallel_layers_per_stage=[1, 1, 2]"], ["pipeline_parallel_layers_per_stage", "multiple of 2"]),
    ([P + "pipeline_parallel_schedule=Interleaved1F1B", P + "pipeline_parallel_layers_per_stage=2"],
     ["Interleaved1F1B", "virtual stages"]),
    ([P + "pipeline_parallel_schedule=ZBVZeroBubble", P + "pipeline_parallel_layers_per_stage=[0, 1, 1, 1, 1, 0]"],
     ["ZBVZeroBubble", "exactly 2 stages per rank"]),
    ([P + "pipeline_parallel_schedule=GPipe", P + "pipeline_parallel_layers_per_stage=1"], ["GPipe", "one stage"]),
    ([P + "pipeline_parallel_microbatches=1"], ["pipeline_parallel_microbatches", "too few"]),
    ([P + "pipeline_parallel_schedule=ZBVZeroBubble", P + "fsdp_reshard_per_microbatch=true"],
     ["fsdp_reshard_per_microbatch = true", "ZBVZeroBubble", "set it false"]),
    ([P + "pipeline_parallel_microbatches=3"], ["pipeline_parallel_microbatches", "divide"]),
    (["--model.n_layers=3"], ["n_layers = 3", "[1, 2]"]),
    (["--model.tie_embeddings=true"], ["tie_embeddings"]),
])
def test_bad_pipeline_layouts(override, words):
    cfg = load_config(None, BASE + ["--training.local_batch_size=8", P + "pipeline_parallel_degree=2"] + override)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.slow
def test_schedule_picture_bubble_matches_formula(tmp_path):
    out = tmp_path / "s.png"
    p = subprocess.run([sys.executable, "tools/pipeline_schedule.py", "--schedule", "Interleaved1F1B", "--pp", "4",
                        "--microbatches", "8", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    measured = float(p.stdout.split("measured on torch's action lists: ")[1].split()[0])
    assert abs(measured - 3 / 16) < 1e-9 and "(4 - 1) / (2 * 8) = 0.1875" in p.stdout
    assert os.path.getsize(out) > 10_000
    for sched, expect in (("GPipe", 3 / 8), ("1F1B", 3 / 8)):
        q = subprocess.run([sys.executable, "tools/pipeline_schedule.py", "--schedule", sched, "--pp", "4",
                            "--microbatches", "8", "--out", str(tmp_path / f"{sched}.png")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert float(q.stdout.split("measured on torch's action lists: ")[1].split()[0]) == pytest.approx(expect)


@pytest.mark.slow
def test_checkpoint_reshards_between_pp2_and_one_process(tmp_path, reference):
    """Save under PP2 (stage FQNs are the whole model's), resume on one process, and back."""
    ck = ["--checkpoint.enable=true", "--checkpoint.interval=2", f"--checkpoint.folder={tmp_path / 'ck'}"]
    run_cli(BASE + ck + ["--training.local_batch_size=8", P + "pipeline_parallel_degree=2"], tmp_path, nproc=2,
            name="pp", env={"TORCHMEG_TEST_KILL_AT_STEP": "2"}, check=False)
    p = run_cli(BASE + ck + ["--training.local_batch_size=8"], tmp_path, name="one")
    assert "resumed   from step 2" in p.stdout
    got = {r["step"]: r for r in read_metrics(tmp_path, "one")}
    compare(reference[2:], [got[3], got[4]])
    import shutil
    shutil.rmtree(tmp_path / "ck" / "step-00000004")
    p = run_cli(BASE + ck + ["--training.local_batch_size=8", P + "pipeline_parallel_degree=2",
                             P + "pipeline_parallel_schedule=ZBVZeroBubble"], tmp_path, nproc=2, name="pp_again")
    assert "resumed   from step 2" in p.stdout
    got = {r["step"]: r for r in read_metrics(tmp_path, "pp_again")}
    compare(reference[2:], [got[3], got[4]])


def test_the_schedule_keeps_no_outputs_between_steps():
    """torch's schedules keep every microbatch's last-stage output (the logits) from its forward to the
    next step (`return_outputs` defaults to True, pytorch/pytorch#159251): n_micro x a microbatch's
    logits on the last pipeline rank, through the update. The trainer reads only the losses, so its
    Pipeline asks for none; torch's own default, run beside it, keeps them (so this test fails if
    the Pipeline passed nothing). One stage on a one-rank gloo group, in this process."""
    import torch
    import torch.distributed as dist  # lazy: this test's one-rank group only
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleGPipe
    from torchmeg.parallel.pipeline import Pipeline
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kept = {}
        for name, run in (("torch's default", lambda s, *a, **k: s.step(*a, **k)),
                          ("Pipeline", lambda s, *a, **k: Pipeline(s).step(*a, **k))):
            stage = PipelineStage(torch.nn.Linear(8, 16), 0, 1, torch.device("cpu"))
            schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: (out - y).pow(2).mean())
            for _ in range(2):
                losses = []
                run(schedule, torch.randn(8, 8), target=torch.randn(8, 16), losses=losses)
                assert len(losses) == 4
            kept[name] = len(stage.output_chunks)
            assert Pipeline(schedule).recv_buffers() == []  # (one stage: first and last, nothing received)
        assert kept == {"torch's default": 4, "Pipeline": 0}
    finally:
        dist.destroy_process_group()
