"""Muon (optimizer.name = "muon"): the update is torch.optim.Muon's and AdamW's, op for op, in one process;
FSDP2 / TP2 / TP2 x FSDP2 / PP2 / EP2 = one process at every step; the optimizer state holds one momentum
per matrix element and two moments per other element; resume is exact; the planner counts its cost."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from conftest import TINY, assert_parity, assert_resumed, read_metrics, reference_run
from launch import ROOT, run_cli
from test_lora import _checkpoint_tensors
from test_plan import _plan
from torchmeg.config.schema import load_config
from torchmeg.models import build_model, materialize
from torchmeg.train.muon import MuonWithAdamW, newton_schulz
from torchmeg.train.optim import build_optimizer

P = "--parallelism."
# The layouts' bound is fp32's, so the Newton-Schulz iteration runs in float32 here: in bfloat16 (torch's
# default) its input is rounded to 8 bits, and two layouts whose gradients differ in the last fp32 bits
# (another reduction order) can round an element to neighbouring bf16 values — a difference of 2^-8 of
# the update, which one process and torch.optim.Muon share exactly (test_one_process_is_torchs_muon_and_adamw).
MUON = TINY + ["--optimizer.name=muon", "--optimizer.muon_ns_dtype=float32", "--optimizer.lr=1e-2",
               "--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8",
               "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]
LAYOUTS = {
    "fsdp2": (2, 4, [P + "data_parallel_shard_degree=2"]),
    "tp2": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "tp2_fsdp2": (4, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
    "pp2": (2, 8, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                   P + "pipeline_parallel_microbatches=4"]),
}
MOE = ["--config", "recipes/moe_debug.toml", "--data.seq_len=32", "--training.steps=4",
       "--training.deterministic=true", "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2",
       "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--optimizer.name=muon",
       "--optimizer.muon_ns_dtype=float32", "--checkpoint.enable=true", "--checkpoint.interval=4"]


def test_one_process_is_torchs_muon_and_adamw():
    """build_optimizer's muon groups on the debug Llama = torch.optim.Muon (matrices) + torch.optim.AdamW
    (embeddings, head, norms), bit for bit over 4 steps, in torch's bf16 iteration."""
    cfg = load_config(None, TINY + ["--optimizer.name=muon", "--optimizer.lr=1e-2"])
    torch.manual_seed(0)
    model = materialize(build_model(cfg, 320, "meta"), "cpu", seed=0)
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    assert [(g["algorithm"], g["weight_decay"]) for g in opt.param_groups] == [("muon", 0.1), ("adamw", 0.1),
                                                                                ("adamw", 0.0)]
    named = dict(ref.named_parameters())
    mats = [p for n, p in named.items() if p.ndim == 2 and not n.startswith(("tok_embeddings", "output"))]
    others = [p for n, p in named.items() if p.ndim != 2 or n.startswith(("tok_embeddings", "output"))]
    assert len(mats) == 2 * 7
    o = cfg.optimizer
    muon = torch.optim.Muon(mats, lr=o.lr, weight_decay=o.weight_decay, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in others if p.ndim == 2]},
                               {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0}],
                              lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    for _ in range(4):
        x = torch.randint(0, 320, (2, 32))
        for m, opts in ((model, [opt]), (ref, [muon, adamw])):
            nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            for op in opts:
                op.step()
                op.zero_grad()
    moved = 0
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
        moved += 1
    assert moved == len(named)


def test_expert_batches_are_orthogonalized_one_expert_at_a_time():
    """A [experts, in, out] weight = torch.optim.Muon on each expert's matrix (its own norm, its own
    iteration), with the rate of its [out, in] shape; a whole-batch norm would couple the experts."""
    torch.manual_seed(0)
    w = torch.randn(3, 16, 24)
    grads = [torch.randn(3, 16, 24) for _ in range(3)]
    p = nn.Parameter(w.clone())
    opt = MuonWithAdamW([{"params": [p], "algorithm": "muon", "weight_decay": 0.1, "in_out": True}], lr=0.02, betas=(0.9, 0.95),
                        eps=1e-8, adjust_lr="original")
    refs = [nn.Parameter(w[e].T.clone()) for e in range(3)]  # [out, in] as torch's Linear weights
    ref_opt = torch.optim.Muon(refs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for g in grads:
        p.grad = g.clone()
        opt.step()
        for e, r in enumerate(refs):
            r.grad = g[e].T.clone()
        ref_opt.step()
    got = torch.stack([r.detach().T for r in refs])
    assert torch.equal(p.detach(), got)


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, MUON + ["--training.local_batch_size=8"])


def _state_kinds(step_dir) -> dict:
    """{parameter FQN: sorted optimizer state names} read from a checkpoint's metadata."""
    _, meta = _checkpoint_tensors(step_dir)
    out = {}
    for k in meta:
        if k.startswith("optimizer.state."):
            fqn, name = k[len("optimizer.state."):].rsplit(".", 1)
            out.setdefault(fqn, []).append(name)
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_one_process(name, tmp_path, muon_reference):
    ranks, local, layout = LAYOUTS[name]
    p = run_cli(MUON + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    assert_parity(muon_reference, read_metrics(tmp_path))
    assert "optimizer  muon lr 0.01 (matrices 0.01, match_rms_adamw): muon matrices" in p.stdout, p.stdout[:3000]
    kinds = _state_kinds(tmp_path / "run" / "checkpoint" / "step-00000004")
    assert kinds["layers.1.attention.wq.weight"] == ["momentum_buffer"]
    assert kinds["tok_embeddings.weight"] == kinds["norm.weight"] == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.slow
def test_muon_with_compiled_blocks(tmp_path, muon_reference):
    """Compiled blocks under Muon = eager within 1e-4 (compiled kernels fuse and reorder floating-point
    work: tests/test_compiler.py's bound); the optimizer itself runs eagerly either way."""
    p = run_cli(MUON + ["--training.local_batch_size=8", "--compile.enable=true"], tmp_path, timeout=300)
    assert "compiled 2 blocks" in p.stdout, p.stdout[:3000]
    assert_parity(muon_reference, read_metrics(tmp_path), rtol=1e-4)


@pytest.mark.slow
def test_muon_resumes_exactly(tmp_path, muon_reference):
    """Stopped after step 2 and resumed under TP2 x FSDP2 (momentum and moments resharded by DCP) = the
    uninterrupted single-process run at steps 3 and 4."""
    ranks, local, layout = LAYOUTS["tp2_fsdp2"]
    args = MUON + [f"--training.local_batch_size={local}"] + layout
    run_cli(args + ["--training.steps=2"], tmp_path, nproc=ranks, name="re")
    p = run_cli(args, tmp_path, nproc=ranks, name="re")
    assert_resumed(p, 2)
    assert_parity(muon_reference[-2:], read_metrics(tmp_path, "re")[-2:], steps={3, 4})


@pytest.mark.slow
def test_muon_under_expert_parallel_matches_one_process(tmp_path_factory, tmp_path):
    """The MoE's experts ([experts, in, out], sharded over ep) take Muon one expert at a time on the rank
    that owns them; the router, shared expert and dense layers' matrices too: EP2 = one process."""
    ref = reference_run(tmp_path_factory, MOE + ["--training.local_batch_size=8"])
    run_cli(MOE + ["--training.local_batch_size=4", P + "expert_parallel_degree=2"], tmp_path, nproc=2)
    got = read_metrics(tmp_path)
    assert_parity(ref, got)
    kinds = _state_kinds(tmp_path / "run" / "checkpoint" / "step-00000004")
    experts = [k for k in kinds if ".experts." in k]
    assert experts and all(kinds[k] == ["momentum_buffer"] for k in experts), kinds


@pytest.mark.slow
def test_planner_counts_muons_iteration_gathers_and_state(tmp_path):
    """The dry run steps this optimizer on fake tensors: under FSDP 2 Muon's plan has the iteration's
    FLOPs (5 steps of 3 matmuls per matrix, on the whole matrix), one all-gather per sharded matrix in
    the update, and one momentum per matrix element where AdamW holds two moments (the real run's
    counts equal the plan's: tests/test_plan.py's tp2_fsdp2_muon layout); bf16 states halve AdamW's."""
    plans = {}
    for name, extra in (("adamw", []), ("muon", []), ("adamw_bf16", ["--optimizer.state_dtype=bfloat16"])):
        _plan(["--world", "2", "--json", str(tmp_path / f"{name}.json"), "--config", "recipes/debug_llama.toml",
               f"--job.dump_folder={tmp_path}", f"--optimizer.name={name.split('_')[0]}"] + extra)
        plans[name] = json.load(open(tmp_path / f"{name}.json"))["ranks"][0]
    # bf16 states: the plan's optimizer bytes halve (the step counters aside: one fp32 scalar per tensor)
    fp32, bf16 = plans["adamw"]["optimizer_bytes"], plans["adamw_bf16"]["optimizer_bytes"]
    assert 0 <= fp32 - 2 * (fp32 - bf16) <= 4 * 100, (fp32, bf16)
    a, m = plans["adamw"], plans["muon"]
    cfg = load_config(os.path.join(ROOT, "recipes", "debug_llama.toml"), [])
    mats = [p for n, p in build_model(cfg, 257).named_parameters() if p.ndim == 2
            and not n.startswith(("tok_embeddings", "output"))]
    gathers = m["comm"]["dp_shard/all_gather"]["count"] - a["comm"]["dp_shard/all_gather"]["count"]
    assert gathers == len(mats) == 4 * 7
    ns = sum(5 * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c) for r, c in (sorted(p.shape) for p in mats))
    assert m["flops"] - a["flops"] >= ns  # (plus the elementwise work the two updates differ in)
    elems = sum(p.numel() for p in mats)
    assert a["optimizer_bytes"] - m["optimizer_bytes"] == pytest.approx(4 * elems / 2, rel=0.01)  # fp32, FSDP 2
