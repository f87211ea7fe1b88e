"""The planner's predicted step time: the fusion model it uses under torch.compile, and the
prediction against published runs it was not calibrated on (torchmeg.plan.efficiency)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import ROOT
from torchmeg.config.schema import load_config
from torchmeg.plan.step_cost import StepCost

sys.path.insert(0, os.path.join(ROOT, "tools"))
from plan_vs_published import MEMORY, RUNS, planned_gib  # noqa: E402


def _rms_norm_chain(x, w):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return h.to(x.dtype) * w


def test_fused_bytes_are_what_crosses_the_fused_group():
    """An RMSNorm as eager ops (upcast, pow, mean, add, rsqrt, mul, downcast, mul) between two
    matmuls: fused, it reads x and the weight once and writes the output once; unfused every op
    reads and writes its own tensors. A collective in the middle splits the group in two."""
    n, d = 64, 256
    a, b = torch.randn(n, d, dtype=torch.bfloat16), torch.randn(d, d, dtype=torch.bfloat16)
    w = torch.randn(d, dtype=torch.bfloat16)
    with StepCost() as cost:
        y = _rms_norm_chain(a @ b, w) @ b
    mem = [op for op in cost.ops if op[3] == "memory"]
    assert len(mem) == 8 and [op[3] for op in cost.ops].count("matmul") == 2
    eager, fused = sum(op[1] for op in mem), sum(op[4] for op in mem)
    assert fused == 2 * n * d * 2 + d * 2, (fused, eager)  # x in, y out (bf16), the weight
    assert eager > 5 * fused
    assert y.shape == (n, d)

    with StepCost() as cost:
        h = (a @ b).float()
        cost._boundary = True  # as a collective between the two halves would
        (h * 2).to(torch.bfloat16) @ b
    fused = sum(op[4] for op in cost.ops if op[3] == "memory")
    # the upcast writes its fp32 output (read across the boundary), which the second group reads
    assert fused == (n * d * 2 + n * d * 4) + (n * d * 4 + n * d * 2)


def test_a_collectives_wait_is_not_memory_traffic():
    """A functional all-gather of a 16 MiB bf16 shard over 8 ranks, its wait, then a multiply of the
    gathered 128 MiB: the collective is counted once (its buffer, 7/8 of it on the wire), the wait
    moves nothing, the multiply reads and writes the gathered tensor."""
    import torch.distributed as dist  # lazy: this test's fake world only
    import torch.distributed._functional_collectives as funcol
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchmeg.plan.fake_world import fake_world
    fake_world(8, 0)
    try:
        with FakeTensorMode():
            x = torch.randn(1024, 8192, dtype=torch.bfloat16)
            with StepCost() as cost:
                y = funcol.all_gather_single(x, 0, dist.group.WORLD) * 2
        assert y.shape == (8192, 8192)
        shard = 1024 * 8192 * 2
        assert cost.comm_table() == {"0/all_gather": {"count": 1, "bytes": 8 * shard, "wire_bytes": 7 * shard,
                                                      "ranks": 8}}
        assert cost.op_names == ["aten.mul"] and [op[1] for op in cost.ops] == [2 * 8 * shard]
    finally:
        dist.destroy_process_group()


def test_async_tp_hides_tp_traffic_under_the_matmuls():
    """TP all-gather 0.3 s + reduce-scatter 0.1 s, EP all-to-all 0.05 s, FSDP all-gather 0.5 s, compute
    1.0 s, TP 8. Without async TP the TP and EP traffic is on the critical path: exposed 0.45 s, step
    1.45 s (FSDP's 0.5 s hides under the 1.0 s of compute). With async TP and 0.25 s of matmuls the TP
    traffic shows beyond them, 0.4 - 0.25 = 0.15 s (split 3:1 between its gather and reduce-scatter):
    exposed 0.2 s, step 1.2 s; with 1.0 s of matmuls only the first of 8 steps shows, 0.4 / 8 = 0.05 s.
    FSDP traffic longer than the compute shows its excess: 1.5 s over 1.0 s -> +0.5 s."""
    from torchmeg.plan.predict import _step, async_tp_exposed
    comm = {"tp/all_gather": 0.3, "tp/reduce_scatter": 0.1, "ep/all_to_all": 0.05, "dp_shard/all_gather": 0.5}
    step, exposed, overlapped, shown = _step(1.0, comm, 0.0)
    assert (step, exposed, overlapped) == pytest.approx((1.45, 0.45, 0.5)) and shown["dp_shard/all_gather"] == 0
    step, exposed, _, shown = _step(1.0, comm, 0.0, (0.25, 8))
    assert (step, exposed) == pytest.approx((1.2, 0.2))
    assert (shown["tp/all_gather"], shown["tp/reduce_scatter"], shown["ep/all_to_all"]) == pytest.approx((0.1125, 0.0375, 0.05))
    assert async_tp_exposed(0.4, 1.0, 8) == pytest.approx(0.05) and async_tp_exposed(0.0, 1.0, 8) == 0
    step, _, _, shown = _step(1.0, dict(comm, **{"dp_shard/all_gather": 1.5}), 0.0)
    assert step == pytest.approx(1.45 + 0.5) and shown["dp_shard/all_gather"] == pytest.approx(0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_prediction_matches_published_runs_it_was_not_calibrated_on():
    """torchtitan's Llama 3.1 8B on 8 H100 (96 GB, 500 W), FSDP 8, seq 8192, local batch 2, selective
    recompute, bf16: eager 5,762, compile 6,667, compile + float8 8,532 tokens/s per GPU (torchtitan
    benchmarks/llama3_h100_202412; arXiv 2410.06511). The prediction uses kernel-level efficiencies
    and one end-to-end factor measured on a different published run (Trainy's, H200): each of these
    three is within 15%. Each is also below its roofline upper bound, compile predicts faster than
    eager (fused memory-bound ops) and float8 faster than compile (fp8 matmuls counted as such)."""
    from torchmeg.plan.planner import plan  # lazy: imports the trainer's build (slow) only for this test
    got = {}
    for name, recipe, gpu, world, args, published in RUNS[:3]:
        p = plan(load_config(os.path.join(ROOT, "recipes", recipe), args), world, gpu, isolate=True)
        ratio = p["predicted_tokens_per_s_per_gpu"] / published
        assert abs(ratio - 1) <= 0.15, (name, p["predicted_tokens_per_s_per_gpu"], published)
        assert abs(planned_gib(p) / MEMORY[name] - 1) <= 0.15, (name, planned_gib(p), MEMORY[name])
        assert p["predicted_tokens_per_s_per_gpu"] < p["tokens_per_s_per_gpu"], name
        got[name] = p
    eager, comp, f8 = (got[r[0]] for r in RUNS[:3])
    by = lambda p: p["ranks"][0]["predicted_compute_s"]  # noqa: E731
    assert by(comp)["memory"] < 0.6 * by(eager)["memory"] and by(comp)["matmul"] == by(eager)["matmul"]
    # fp8 matmuls at H100's fp8 MAMF: the linear layers' time falls by more than a third
    assert by(f8)["matmul"] < 0.67 * by(comp)["matmul"]


TP_ROWS = [r for r in RUNS if "TP 8" in r[0]]
# Over-predicted: the model takes async TP's overlap as free; the micro-pipelined matmuls (each split
# in tp pieces) cost something it does not model. Published speed-up 1.10x, predicted 1.21x.
OVER = "torchtitan 8B FSDP 8 x TP 8, float8, async TP"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="predicts 1.16x: "
                                                                        "async TP's split matmuls not modelled"))
                                 if r[0] == OVER else r for r in TP_ROWS], ids=[r[0] for r in TP_ROWS])
def test_tp_rows_match_published_runs(row):
    """torchtitan's async TP benchmark (8B on 64 H100 as FSDP 8 x TP 8, 70B on 256 H100 as FSDP 32 x TP 8;
    compile, bf16 and float8 tensorwise, vanilla and async TP): each predicted within 15% of its published
    tokens/s per GPU, with the one end-to-end factor measured on the Trainy row (none fitted here). One
    row is a known miss (OVER, strict: it fails the day it enters the band)."""
    from torchmeg.plan.planner import plan  # lazy: imports the trainer's build (slow) only for this test
    name, recipe, gpu, world, args, published = row
    p = plan(load_config(os.path.join(ROOT, "recipes", recipe), args), world, gpu, isolate=True)
    ratio = p["predicted_tokens_per_s_per_gpu"] / published
    assert abs(ratio - 1) <= 0.15, (name, round(ratio, 3))
    assert p["predicted_tokens_per_s_per_gpu"] < p["tokens_per_s_per_gpu"], name


FSDP128 = [r for r in RUNS if "FSDP 128" in r[0]]


@pytest.mark.slow
@pytest.mark.parametrize("row", FSDP128, ids=[r[0] for r in FSDP128])
def test_fsdp_at_128_gpus_matches_published_runs_and_memory(row):
    """torchtitan's Llama 3.1 8B on 128 H100 (Table 3: FSDP 128, local batch 2, selective recompute;
    eager 5,605, compile 6,514, compile + float8 8,380 tokens/s per GPU; 67.0 / 62.0 / 61.8 GiB): tokens/s
    and memory each within 15%, with the end-to-end factor of the Trainy row (none fitted here)."""
    from torchmeg.plan.planner import plan  # lazy: imports the trainer's build (slow) only for this test
    name, recipe, gpu, world, args, published = row
    p = plan(load_config(os.path.join(ROOT, "recipes", recipe), args), world, gpu, isolate=True)
    assert abs(p["predicted_tokens_per_s_per_gpu"] / published - 1) <= 0.15, (name, p["predicted_tokens_per_s_per_gpu"])
    assert abs(planned_gib(p) / MEMORY[name] - 1) <= 0.15, (name, planned_gib(p), MEMORY[name])
