"""MXFP8 (float8.recipe = "mxfp8", torchao's MX training path): the converted Linears and grouped experts by
name, e4m3 elements and e8m0 block scales cast in step 1, the debug recipe close to fp32's held-out loss, and
FSDP2 / TP2 / EP2 = one process within the bound of the format. Emulated here (no sm_100); the header says so."""
from __future__ import annotations

import json

import pytest

from conftest import LOW_PRECISION_VS_FP32, TINY, assert_parity, assert_resumed, read_metrics
from launch import run_cli
from test_compiler import _float8_fqns
from test_plan import _plan
from torchmeg.parallel.mxfp8 import torch_has_mx_training

# torchao's MX training needs DTensor features torch 2.11 lacks (the recipe check refuses there, tested
# below on every torch); these runs need them
needs_mx_torch = pytest.mark.skipif(not torch_has_mx_training(),
                                    reason="this torch lacks what torchao's MXFP8 training needs (torch >= 2.13)")

P = "--parallelism."
MX = ["--float8.enable=true", "--float8.recipe=mxfp8"]
BASE = TINY + MX + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8"]
MOE = ["--config", "recipes/moe_debug.toml", "--data.seq_len=32", "--training.steps=4", "--training.deterministic=true",
       "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1",
       "--metrics.enable_tensorboard=false"] + MX
# Bound for a layout vs one process, both in MXFP8. The MX blocks are the same in every layout (32 elements
# along each matmul's contraction dimension; a rank's microbatch holds whole 32-token blocks, which the
# recipe check enforces), so the layouts differ only where fp32 sums run in another order (sharded
# matmuls, all-reduces): ~n 2^-24 relative (n <= 192 here, ~1.1e-5). e4m3 keeps 3 mantissa bits
# (rounding boundaries 2^-4 apart, relative), so a fraction p ~ 1.1e-5 / 2^-4 ~ 2e-4 of the cast elements
# lands on the other side of one and moves by one e4m3 ulp (2^-3); independent flips move a norm by
# <= 2^-3 sqrt(p) ~ 1.8e-3 a step, 4 steps add: 1e-2 — float8's TP rule (tests/test_compiler.py).
MX_LAYOUT = 1e-2


def _record(tmp_path) -> dict:
    return json.loads((tmp_path / "ops.rank0.json").read_text())


def test_mxfp8_on_a_torch_without_it_is_one_line_before_anything_starts(monkeypatch):
    """On a torch whose DTensor lacks what torchao's MX training needs (torch 2.11), the recipe
    check names the key, the torch and the fix, before any model is built."""
    from torchmeg.config.errors import ConfigError
    from torchmeg.config.schema import load_config
    from torchmeg.train import validate as v
    monkeypatch.setattr(v, "torch_has_mx_training", lambda: False)
    cfg = load_config("recipes/debug_llama.toml", ["--float8.enable=true", "--float8.recipe=mxfp8"])
    with pytest.raises(ConfigError, match=r"float8.recipe = 'mxfp8': torchao's MXFP8 training needs .* install torch>=2.13"):
        v.validate(cfg, 1)


@pytest.mark.slow
@needs_mx_torch
def test_mxfp8_trains_debug_recipe_close_to_fp32(tmp_path, fp32_debug_run):
    """30 steps of the debug recipe's model: every block Linear converted (the head is not), e4m3 elements and e8m0
    scales cast in step 1, the header naming the emulation, and the held-out loss at step 30 (8 batches)
    within 5% of the fp32 run's (float8's rule; conftest.LOW_PRECISION_VS_FP32, the run both compare with)."""
    p = run_cli(LOW_PRECISION_VS_FP32 + MX, tmp_path, name="mx", timeout=300,
                env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    assert "mxfp8 28 linears (EMULATED: " in p.stdout, p.stdout[:3000]
    rec = _record(tmp_path)
    assert rec["mxfp8_modules"] == _float8_fqns(4) and rec["float8_modules"] == [], rec["mxfp8_modules"]
    assert {"float8_e4m3fn", "float8_e8m0fnu"} <= set(rec["dtypes_seen"]), rec["dtypes_seen"]
    a, b = read_metrics(fp32_debug_run, "fp32")[-1], read_metrics(tmp_path, "mx")[-1]
    assert a["step"] == b["step"] == 30
    assert abs(b["val_loss"] - a["val_loss"]) <= 0.05 * a["val_loss"], (a["val_loss"], b["val_loss"])
    assert b["val_loss"] != a["val_loss"]  # (the casts changed the numbers: MX ran, not fp32 under its name)
    assert b["loss"] < read_metrics(tmp_path, "mx")[0]["loss"] - 1.5


# Under TP an MX Linear needs whole 32-blocks on every shard (dimensions multiple of 32 x tp): the tiny
# model's wk / wv (32 outputs) stay in high precision, in the reference run too (filter_fqns).
KV_HIGH = ["--float8.filter_fqns=['output', 'wk', 'wv']"]


@pytest.mark.slow
@needs_mx_torch
@pytest.mark.parametrize("name, ranks, local, layout", [
    ("fsdp2", 2, 4, [P + "data_parallel_shard_degree=2"]),
    ("tp2", 2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"] + KV_HIGH),
    ("tp2_fsdp2", 4, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"] + KV_HIGH),
    ("pp2", 2, 8, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                   P + "pipeline_parallel_microbatches=2"]),
])
def test_mxfp8_layouts_match_single_process(name, ranks, local, layout, tmp_path):
    run_cli(BASE + ["--training.local_batch_size=8"] + (KV_HIGH if "tp2" in name else []), tmp_path, name="one")
    run_cli(BASE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks, name="par",
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    rec = _record(tmp_path)
    want = [f for f in _float8_fqns(2) if (name != "pp2" or f.startswith("layers.0."))  # (rank 0: stage 0's)
            and ("tp2" not in name or not f.endswith(("wk", "wv")))]
    assert rec["mxfp8_modules"] == want, rec["mxfp8_modules"]
    assert {"float8_e4m3fn", "float8_e8m0fnu"} <= set(rec["dtypes_seen"]), rec["dtypes_seen"]
    placements = {"fsdp2": ["Shard(0)"], "tp2": ["Shard(0)"], "tp2_fsdp2": ["_StridedShard(0)", "Shard(0)"],
                  "pp2": []}[name]  # (the converted weights are sharded as the layout says)
    assert rec["params"]["layers.0.attention.wq.weight"]["placements"] == placements, rec["params"]
    if "tp2" in name:
        assert rec["params"]["layers.0.attention.wo.weight"]["placements"][-1] == "Shard(1)"
    assert_parity(read_metrics(tmp_path, "one"), read_metrics(tmp_path, "par"), rtol=MX_LAYOUT)


@pytest.mark.slow
@needs_mx_torch
def test_mxfp8_grouped_experts_under_expert_parallel(tmp_path):
    """The MoE's grouped experts run torchao's MXFP8 grouped matmul (its emulation dequantizes into bf16:
    the grouped matmul's operands are bf16 in this fp32 run, where unconverted experts would be fp32),
    with the Linears; EP2 = one process."""
    run_cli(MOE + ["--training.local_batch_size=8"], tmp_path, name="one",
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "one_ops")})
    one_rec = json.loads((tmp_path / "one_ops.rank0.json").read_text())
    p = run_cli(MOE + ["--training.local_batch_size=4", P + "expert_parallel_degree=2"], tmp_path, nproc=2,
                name="ep", env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    assert "+ 3 grouped experts (EMULATED: " in p.stdout, p.stdout[:3000]
    for rec in (one_rec, _record(tmp_path)):
        assert rec["matmul_dtypes"]["_grouped_mm"] == ["bfloat16"], rec["matmul_dtypes"]
        assert "float8_e8m0fnu" in rec["dtypes_seen"]
    assert_parity(read_metrics(tmp_path, "one"), read_metrics(tmp_path, "ep"), rtol=MX_LAYOUT)


@pytest.mark.slow
@needs_mx_torch
def test_mxfp8_refuses_partial_token_blocks_and_planning(tmp_path):
    """Refused in one line each: a microbatch of 60 tokens (MX blocks are 32) and the planner (it cannot
    trace torchao's GPU kernels on fake tensors)."""
    p = run_cli(TINY + MX + ["--data.seq_len=20", "--training.local_batch_size=3"], tmp_path, check=False)
    assert p.returncode != 0 and "a microbatch holds 60 tokens per rank" in p.stderr, p.stderr[-2000:]
    p = _plan(["--world", "2", "--config", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}"] + MX)
    assert p.returncode != 0 and "the planner cannot trace torchao's MXFP8 kernels" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
@needs_mx_torch
def test_mxfp8_checkpoint_resumes_exactly(tmp_path):
    """FSDP2: the MX-wrapped weights and their moments are saved as plain tensors (a checkpoint holds no
    tensor subclass; a pickled one would not load) and a run stopped after step 2 resumes into the
    uninterrupted run's steps 3 and 4."""
    args = BASE + ["--training.local_batch_size=4", P + "data_parallel_shard_degree=2", "--checkpoint.enable=true",
                   "--checkpoint.interval=2", "--validation.enable=false"]
    run_cli(args, tmp_path, nproc=2, name="whole")
    run_cli(args + ["--training.steps=2"], tmp_path, nproc=2, name="re")
    assert_resumed(run_cli(args, tmp_path, nproc=2, name="re"), 2)  # (a restart from 0 would repeat steps 3-4 too)
    assert_parity(read_metrics(tmp_path, "whole")[-2:], read_metrics(tmp_path, "re")[-2:], steps={3, 4})
