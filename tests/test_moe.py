"""Mixture-of-Experts: routing math, balancing, FLOPs, and expert parallel equal to one process."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from host_reads import HostReads
from conftest import FP32_PARITY, assert_close, reference_run, assert_parity, assert_tensor_close, read_metrics
from launch import ROOT, launch_ranks, run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.train.validate import validate
from torchmeg.models import active_params, build_model, count_params, flops_per_token, init_weights

P = "--parallelism."
MOE = ["--config", "recipes/moe_debug.toml", "--data.seq_len=32", "--training.steps=4", "--training.deterministic=true",
       "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1",
       "--metrics.enable_tensorboard=false"]


def _model(**over):
    cfg = load_config(None, ["--model.name=moe", "--model.flavor=debug"] + [f"--model.{k}={v}" for k, v in over.items()])
    m = build_model(cfg, 257, "cpu")
    init_weights(m, seed=0)
    return m


def test_routed_output_equals_dense_reference():
    """The sorted, grouped dispatch computes sum_k w_k * expert_k(x) for every token."""
    m = _model(balance="none", n_shared_experts=0)
    moe = m.layers["1"].moe
    x = torch.randn(2, 16, m.args.dim)
    y = moe(x)
    flat = x.reshape(-1, m.args.dim)
    scores = moe.router(flat).float().sigmoid()
    w, idx = scores.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(flat)
    e = moe.experts
    for t in range(flat.shape[0]):
        for k in range(2):
            i = idx[t, k]
            ref[t] += w[t, k] * ((F.silu(flat[t] @ e.w1[i]) * (flat[t] @ e.w3[i])) @ e.w2[i])
    assert_tensor_close(y.reshape(-1, m.args.dim), ref, FP32_PARITY, "MoE output")


def test_aux_loss_trains_router_without_changing_output():
    m = _model(balance="aux_loss", aux_loss_coef=0.1, n_shared_experts=0)
    moe = m.layers["1"].moe
    x = torch.randn(2, 16, m.args.dim)
    moe.eval()
    y_eval = moe(x)
    moe.train()
    y = moe(x)
    assert torch.equal(y, y_eval)
    y.sum().backward()
    g_with = moe.router.weight.grad.clone()
    m2 = _model(balance="none", n_shared_experts=0)
    m2.layers["1"].moe(x).sum().backward()
    assert not torch.allclose(g_with, m2.layers["1"].moe.router.weight.grad)


def test_bias_update_moves_toward_balance():
    moe = _model().layers["1"].moe
    load = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6])
    moe.update_bias(load)
    assert moe.expert_bias[0] < 0 and moe.expert_bias[1] > 0 and moe.expert_bias[7] < 0


def test_active_params_and_flops():
    m = _model()
    a = m.args
    experts = 3 * a.dim * a.moe_hidden * a.n_experts * (a.n_layers - a.n_dense_layers)
    assert count_params(m) - active_params(m) == experts - experts * a.top_k // a.n_experts
    dense = _model(n_experts=8, top_k=8)
    # every expert active: FLOPs rise by exactly the extra expert weights
    extra = 6 * (experts * 8 // 8 - experts * 2 // 8)
    assert flops_per_token(dense, dense.args, 64) - flops_per_token(m, a, 64) == extra


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, MOE + ["--training.local_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", [
    ("ep2", 2, 4, [P + "expert_parallel_degree=2"]),
    ("ep2_fsdp2", 4, 2, [P + "expert_parallel_degree=2"]),
    # experts HSDP-sharded: replicated over dp_replicate 2, each ep rank's experts whole (efsdp 1)
    ("ep2_hsdp_2x2", 4, 2, [P + "expert_parallel_degree=2", P + "data_parallel_replicate_degree=2"]),
    # each pipeline stage's experts over its own ep group (tokens per expert summed over the stages)
    ("pp2_ep2_fsdp2", 4, 4, [P + "expert_parallel_degree=2", P + "pipeline_parallel_degree=2"]),
    # ep borrows the cp ranks: a token's experts are wherever its sequence shard's peers hold them
    ("cp2_ep2", 2, 8, [P + "expert_parallel_degree=2", P + "context_parallel_degree=2"]),
    # fixed-size exchanges, no host read; capacity factor = ep: nothing can be dropped
    ("ep2_fsdp2_capacity", 4, 2, [P + "expert_parallel_degree=2", P + "expert_capacity_factor=2"]),
])
def test_moe_layouts_match_single_process(name, ranks, local, layout, tmp_path, reference):
    p = run_cli(MOE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(reference, got)
    for a, b in zip(reference, got):
        assert a["tokens_per_expert"] == b["tokens_per_expert"]  # the same routing, globally
    assert "experts max/mean" in p.stdout
    assert all(r["moe_dropped"] == 0 for r in got) if "capacity" in name else "moe_dropped" not in got[0]


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout, share", [
    ("tp2", 2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"], 2),
    ("tp2_ep2_fsdp2", 4, 4, [P + "tensor_parallel_degree=2", P + "expert_parallel_degree=2"], 4),
    ("tp2_no_sp", 2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                         P + "sequence_parallel=false"], 1),
], ids=["tp2", "tp2_ep2_fsdp2", "tp2_no_sp"])
def test_tp_spreads_the_routed_experts_over_its_ranks(name, ranks, local, layout, share, tmp_path, reference):
    """Under TP with sequence parallel each rank routes its own sequence shard and the routed experts
    spread over tp (x ep): a rank holds 1/tp (1/(tp ep)) of every expert weight, asserted from the
    parameters' local shapes, the router and shared expert whole; = one process, routing included.
    Without sequence parallel every TP rank holds the whole sequence and all experts."""
    rec = tmp_path / "ops"
    run_cli(MOE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks,
            env={"TORCHMEG_RECORD_OPS": str(rec)})
    got = read_metrics(tmp_path)
    assert_parity(reference, got)
    for a, b in zip(reference, got):
        assert a["tokens_per_expert"] == b["tokens_per_expert"]
    for rank in range(ranks):
        params = json.loads((tmp_path / f"ops.rank{rank}.json").read_text())["params"]
        experts = {k: v for k, v in params.items() if ".moe.experts." in k}
        assert experts and all(v["local"][0] * share == v["global"][0] for v in experts.values()), experts
        router = params["layers.1.moe.router.weight"]  # replicated over tp (FSDP may shard it over dp)
        assert all(p == "Replicate" for m, p in zip(router["mesh"], router["placements"]) if m == "tp"), router


@pytest.mark.slow
def test_moe_debug_recipe_trains_and_balances(tmp_path):
    # The recipe shortened to 80 of its 150 steps (the whole run takes ~40 s here).
    run_cli(["--config", "recipes/moe_debug.toml", "--metrics.enable_tensorboard=false", "--training.steps=80"],
            tmp_path, timeout=240)
    rows = read_metrics(tmp_path)
    assert rows[-1]["step"] == 80 and rows[-1]["loss"] < rows[0]["loss"] - 2.0
    assert len(rows[-1]["tokens_per_expert"]) == 8
    assert rows[-1]["moe_imbalance"] < rows[0]["moe_imbalance"]


@pytest.mark.parametrize("override, world, words", [
    ([P + "expert_parallel_degree=3"], 3, ["expert_parallel_degree = 3", "n_experts = 8"]),
    ([P + "expert_parallel_degree=4"], 2, ["expert_parallel_degree = 4", "divisor"]),
    ([P + "expert_parallel_degree=2", "--model.name=llama"], 2, ["has no experts"]),
])
def test_bad_ep_layouts(override, world, words):
    cfg = load_config("recipes/moe_debug.toml", MOE[2:] + override)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    for w in words:
        assert w in str(e.value), str(e.value)


def _periodic_store(tmp_path) -> str:
    """A corpus whose every training window is the same 33 tokens (one 32-byte sentence repeated,
    windows of seq 32 at stride 32, no BOS): microbatches are then identical to each other."""
    import subprocess
    import sys
    from launch import ROOT
    sentence = "The quick brown fox jumps over. "
    assert len(sentence) == 32
    (tmp_path / "rep.txt").write_text(sentence * 800)
    p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "rep.txt"),
                        "--output-prefix", str(tmp_path / "rep")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return str(tmp_path / "rep")


@pytest.mark.slow
def test_aux_loss_gradient_is_divided_by_accumulation(tmp_path):
    """With identical microbatches, 4 microbatches of 2 are exactly one batch of 8: the LM loss, the
    routing fractions f and P, hence the aux loss, are the same means. So losses and grad norms must
    agree; an aux gradient not divided by the 4 microbatches makes the router's gradient 4x too
    strong (a strong coefficient so that shows in the norm)."""
    store = _periodic_store(tmp_path)
    common = MOE + [f"--data.dataset={store}", "--model.balance=aux_loss", "--model.aux_loss_coef=1.0",
                    "--validation.enable=false", "--training.steps=3"]
    run_cli(common + ["--training.local_batch_size=8"], tmp_path, name="big")
    run_cli(common + ["--training.local_batch_size=2"], tmp_path, name="accum")
    big, acc = read_metrics(tmp_path, "big"), read_metrics(tmp_path, "accum")
    assert len(big) == len(acc) == 3
    assert_parity(big, acc)
    assert [r["tokens_per_expert"] for r in big] == [r["tokens_per_expert"] for r in acc]


@pytest.mark.slow
def test_recompute_does_not_count_routed_tokens_twice(tmp_path):
    """Recompute replays each block's forward in backward; the routed-token counts (which drive the
    balancing bias and the logged load) must be those of one forward: equal to the run without it,
    and exactly tokens x top_k per MoE layer."""
    common = MOE + ["--training.local_batch_size=8", "--training.steps=2", "--validation.enable=false"]
    run_cli(common, tmp_path, name="plain")
    run_cli(common + ["--activation_checkpoint.mode=full"], tmp_path, name="full")
    run_cli(common + ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"],
            tmp_path, name="op")
    plain = read_metrics(tmp_path, "plain")
    cfg = load_config("recipes/moe_debug.toml", [])
    args = build_model(cfg, 257, "meta").args
    layers = args.n_layers - args.n_dense_layers
    assert sum(plain[0]["tokens_per_expert"]) == 8 * 32 * args.top_k * layers
    for name in ("full", "op"):
        got = read_metrics(tmp_path, name)
        assert [r["tokens_per_expert"] for r in got] == [r["tokens_per_expert"] for r in plain], name
        assert_parity(plain, got)


def test_experts_run_without_a_host_sync():
    """The MoE model, forward and backward, with every host read of a tensor refused: routing counts
    stay on the device and the experts run as grouped matmuls (torch._grouped_mm). The loop over
    experts it replaced read the counts with .tolist() and is refused the same way."""
    from torchmeg.models import moe as M
    cfg = load_config("recipes/moe_debug.toml", [])
    model = build_model(cfg, 257, "cpu")
    init_weights(model, seed=0)
    x = torch.randint(0, 257, (4, 64))
    with HostReads():
        model(x).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    saved = M.grouped_mm_takes
    M.grouped_mm_takes = lambda *a: False  # the loop
    try:
        with pytest.raises(AssertionError, match="host sync"), HostReads():
            model(x)
    finally:
        M.grouped_mm_takes = saved


@pytest.mark.slow
def test_expert_parallel_host_reads():
    """EP 2 x FSDP 2 on gloo, forward and backward with every host read counted: the dropless
    dispatch's all_to_all_single takes its split sizes as host lists, so each MoE layer reads its
    token counts (sent and received, one tensor) once in forward and never in backward; the grouped
    matmul on the received tokens takes its offsets on the device. (The per-expert loop it replaced
    read three times per layer.) With a capacity factor: none at all (below)."""
    p = launch_ranks([sys.executable, os.path.join(ROOT, "tests", "ep_sync_worker.py")], 2,
                      dict(os.environ, PYTHONUNBUFFERED="1"), timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["moe_layers"] > 0
    free = got["dropless"]
    assert free["forward"] == got["moe_layers"] and free["backward"] == 0, got
    # Under a mode that refuses host reads: the dropless dispatch is refused at its count read; the
    # capacity-bound one (parallelism.expert_capacity_factor) runs forward and backward, with the
    # dropless loss and expert gradients at factor = ep (the fp32 rule) and rows dropped below it.
    assert got["dropless_refusing"]["refused"].startswith("host sync"), got
    full, tight = got["capacity_2.0"], got["capacity_0.5"]
    assert full["forward"] == full["backward"] == tight["forward"] == tight["backward"] == 0, got
    assert_close(full["loss"], free["loss"], FP32_PARITY, "capacity 2 vs dropless loss")
    for a, b in zip(full["expert_grads"], free["expert_grads"]):
        assert_close(a, b, FP32_PARITY, "capacity 2 vs dropless expert grad norm")
    assert full["dropped"] == 0 < tight["dropped"] and tight["loss"] != free["loss"], got
