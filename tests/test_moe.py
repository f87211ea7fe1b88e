"""Mixture-of-Experts: routing math, balancing, FLOPs, and expert parallel equal to one process."""
import pytest
import torch
import torch.nn.functional as F

from conftest import reference_run, assert_parity, read_metrics, run_cli
from torchmeg.config import ConfigError, load_config, validate
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
    assert torch.allclose(y.reshape(-1, m.args.dim), ref, atol=1e-5)


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


@pytest.mark.parametrize("name, ranks, local, layout", [
    ("ep2", 2, 4, [P + "expert_parallel_degree=2"]),
    ("ep2_fsdp2", 4, 2, [P + "expert_parallel_degree=2"]),
    ("tp2_dense", 2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("ep2_tp2", 4, 4, [P + "expert_parallel_degree=2", P + "tensor_parallel_degree=2"]),
])
def test_moe_layouts_match_single_process(name, ranks, local, layout, tmp_path, reference):
    p = run_cli(MOE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(reference, got)
    for a, b in zip(reference, got):
        assert a["tokens_per_expert"] == b["tokens_per_expert"]  # the same routing, globally
    assert "experts max/mean" in p.stdout


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
