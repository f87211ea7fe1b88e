"""Hugging Face causal LMs trained from a recipe (model.name = "hf"): every layout matches one
process; HF weights in, trained weights out, reloaded by transformers itself."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import FP32_PARITY, assert_close, assert_tensor_close, read_metrics
from launch import ROOT, launch_ranks, run_cli

# Three families with different module trees and TP plans: Llama, Qwen3 (per-head q/k norms whose
# weights need a TP gradient all-reduce), Mistral (sliding-window attention config); tiny configs
# built offline. tests/hf_parity_worker.py trains each through torchmeg.parallelize() next to the
# whole model on one process (the CLI path with the recipe's defaults is the end-to-end test below).
FAMILIES = ["llama", "qwen3", "mistral"]
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _worker(nproc: int, families: list[str], layouts: list[str]) -> dict:
    import sys
    cmd = [sys.executable, os.path.join(ROOT, "tests", "hf_parity_worker.py"), "--families", ",".join(families),
           "--layouts", ",".join(layouts)]
    p = launch_ranks(cmd, nproc, dict(os.environ), timeout=240)  # (the script puts the checkout on its path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(families) * len(layouts), p.stdout[-2000:]
    return {(r["family"], r["layout"]): r for r in rows}


def _check(r: dict) -> None:
    # fp32, same weights from (seed, FQN), same global batches: the parity rule (conftest), relative,
    # on the loss and the grad norm, every step.
    assert r["loss_rel_diff"] < FP32_PARITY and r["grad_norm_rel_diff"] < FP32_PARITY, r
    assert r["blocks"] == "model.layers", r
    if "fsdp2" in r["layout"]:
        assert r["fsdp_units"] == r["layers"] + 1, r  # one per decoder layer + the root
    if "compile" in r["layout"]:
        assert r["compiled_blocks"] == r["layers"] == r["recompute_blocks"], r
    if "tp2" in r["layout"]:
        # the model's own plan + embedding + LM head + SP: 2 block norms, attention and MLP inputs, final norm
        assert r["tp_entries"] == r["hf_plan_entries"] + 2 + 5, r


@pytest.mark.slow
@pytest.mark.parametrize("fam", FAMILIES)
def test_hf_tp2_fsdp2_compile_recompute_match_one_process(fam):
    """TP2, FSDP2 and FSDP2 + compile + full recompute, each vs the whole model on one process."""
    rows = _worker(2, [fam], ["tp2", "fsdp2", "fsdp2_compile_recompute"])
    for r in rows.values():
        _check(r)


@pytest.mark.slow
def test_hf_tp2_x_fsdp2_matches_one_process():
    rows = _worker(4, FAMILIES, ["tp2_fsdp2"])
    for r in rows.values():
        _check(r)


@pytest.mark.slow
def test_hf_moe_layouts_match_one_process():
    """transformers' own Qwen3-MoE and DeepSeek-V3 (tiny configs built offline: 4 routed experts,
    top 2; DeepSeek with MLA, a shared expert and a dense first layer), on 4 ranks: FSDP 4, expert
    parallel 2 x FSDP (dropless, and with capacity factor 2: the host-read-free dispatch, grouped
    matmuls over transformers' [out, in] expert weights), and TP 2 x EP 2 x FSDP each = the whole
    model on one process (fp32 rule, every
    step). Under EP every experts module sends its tokens to the experts' owners (its forward is
    torchmeg's dispatch, its weights 1/ep per rank); under TP the attention follows the model's own
    plan while the experts run whole per TP rank (sequence parallel off, said in the report)."""
    rows = _worker(4, ["qwen3_moe", "deepseek_v3"], ["fsdp2", "ep2_fsdp2", "ep2_capacity", "tp2_ep2_fsdp2"])
    for (fam, layout), r in rows.items():
        assert r["loss_rel_diff"] < FP32_PARITY and r["grad_norm_rel_diff"] < FP32_PARITY, r
        assert r["experts"] == (2 if fam == "qwen3_moe" else 1), r  # (DeepSeek's first layer is dense)
        assert r["experts_dispatched"] == (r["experts"] if "ep2" in layout else 0), r
        if "tp2" in layout:
            assert r["tp_entries"] > 2 and r["sp_off"].startswith("MoE experts run whole"), r


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["qwen3_moe", "deepseek_v3"])
def test_hf_moe_recipe_trains_under_expert_parallel(fam, tmp_path):
    """`model.name = "hf"` with a Qwen3-MoE / DeepSeek-V3 config.json, expert parallel 2 on two
    ranks through the CLI: finite, falling loss; the exported folder loads in transformers with
    every expert's weights (names kept, gathered from both ranks)."""
    import transformers
    from hf_parity_worker import FAMILIES as CONFIGS, MOE
    conf = getattr(transformers, CONFIGS[fam])(**dict(TINY, **MOE[fam]))
    conf.save_pretrained(str(tmp_path / "config"))
    run_cli(["--config", "recipes/hf_llama_debug.toml", f"--model.hf_config={tmp_path / 'config'}",
             "--model.vocab_size=-1", "--parallelism.expert_parallel_degree=2", "--training.steps=10",
             "--data.seq_len=64", "--training.local_batch_size=4", "--validation.steps=1",
             "--checkpoint.interval=10", "--metrics.enable_tensorboard=false"], tmp_path, nproc=2, timeout=240)
    rows = read_metrics(tmp_path)
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "checkpoint" / "hf"))
    experts = [m for m in hf.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(m.gate_up_proj.shape[0] == 4 and m.gate_up_proj.abs().sum((1, 2)).min() > 0
                           for m in experts)


def _batch(cfg_args, split, indices):
    """Samples `indices` of the recipe's train/val split, as torchmeg's loader reads them."""
    from torchmeg.config.schema import load_config
    from torchmeg.data import build_dataset, build_tokenizer, open_stores
    cfg = load_config(cfg_args[1], cfg_args[2:])
    ds = build_dataset(cfg, open_stores(cfg, build_tokenizer(cfg.data.tokenizer)), split)
    xs, ys = zip(*(ds[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)


def _loss(model, x, y):
    with torch.no_grad():
        logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item()


@pytest.mark.slow
def test_hf_recipe_loads_trains_exports_and_transformers_reloads(tmp_path):
    """recipes/hf_llama_debug.toml from HF weights, on TP 2 x FSDP 2 (each rank reads its own
    slices): step 1's loss is transformers' loss of those weights on the step-1 batch; after the
    step, the exported folder loads in transformers and gives the validation loss torchmeg logged,
    and the logits of torchmeg's own checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.load(open("recipes/hf/llama_debug.json"))
    cfg["vocab_size"] = 320
    torch.manual_seed(1)
    start = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    start.save_pretrained(str(tmp_path / "start"))
    args = ["--config", "recipes/hf_llama_debug.toml", "--training.steps=1", "--data.seq_len=64",
            "--validation.steps=2", "--metrics.enable_tensorboard=false",
            f"--checkpoint.initial_load_hf={tmp_path / 'start'}"]
    p = run_cli(args[2:] + args[:2] + ["--training.local_batch_size=4", "--parallelism.tensor_parallel_degree=2"],
                tmp_path, nproc=4, timeout=240)
    assert f"init       from Hugging Face weights in {tmp_path / 'start'}" in p.stdout
    row = read_metrics(tmp_path)[0]
    x, y = _batch(args, "train", range(8))
    assert_close(_loss(start, x, y), row["loss"], FP32_PARITY, "step-1 loss vs transformers")

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "checkpoint" / "hf")).eval()
    vx, vy = _batch(args, "val", range(16))
    val = (_loss(exported, vx[:8], vy[:8]) + _loss(exported, vx[8:], vy[8:])) / 2
    assert_close(val, row["val_loss"], FP32_PARITY, "val_loss vs transformers")
    # The step moved every weight by about lr (Adam's first step), from the loaded weights.
    d = (exported.model.layers[0].mlp.up_proj.weight - start.model.layers[0].mlp.up_proj.weight).abs()
    assert 0 < d.max().item() < 2 * row["lr"] and d.median().item() > 0.5 * row["lr"]

    # torchmeg's own checkpoint of the trained model: same logits as the transformers reload.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    tcfg = load_config(args[1], args[2:])
    from torchmeg.data import build_tokenizer
    ours = build_model(tcfg, build_tokenizer(tcfg.data.tokenizer).vocab_size, device="cpu")
    sd = get_model_state_dict(ours)
    step_dir = sorted(d for d in os.listdir(tmp_path / "run" / "checkpoint") if d.startswith("step-"))[-1]
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "run" / "checkpoint" / step_dir))
    set_model_state_dict(ours, sd)
    with torch.no_grad():
        assert_tensor_close(ours(vx).float(), exported(vx).logits.float(), FP32_PARITY, "logits")


@pytest.mark.slow
def test_hf_errors_are_one_line(tmp_path):
    from torchmeg.config.schema import ConfigError, load_config
    from torchmeg.train.validate import validate
    base = ["--training.steps=1"]
    p = run_cli(["--config", "recipes/hf_llama_debug.toml", "--model.hf_config=nope/config.json"] + base, tmp_path,
                check=False)
    err = [l for l in p.stderr.splitlines() if l.startswith("torchmeg: error")]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-2000:]
    assert "model.hf_config = 'nope/config.json': no such file" in err[0]
    for extra, world, needle in [
        (["--model.num_hiden_layers=2"], 1, "did you mean 'num_hidden_layers'?"),
        (["--parallelism.pipeline_parallel_degree=2"], 2, "cannot be split into pipeline stages"),
        (["--parallelism.context_parallel_degree=2"], 2, "has none"),
        (["--checkpoint.initial_load_hf=" + str(tmp_path)], 1, "not a directory holding .safetensors files"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(load_config("recipes/hf_llama_debug.toml", base + extra), world_size=world)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_hf_tp_plan_translation_and_refusals():
    """The model's own base_model_tp_plan in torchmeg roles (+ SP roles found in the tree); styles
    torchmeg cannot express are refused by name."""
    from transformers import Qwen3Config

    from torchmeg.models.hf_causal import HFArgs, HFCausalLM, args_from_config, tp_plan_from_hf
    cfg = Qwen3Config(**TINY)
    with torch.device("meta"):
        model = HFCausalLM(args_from_config(cfg))
    plan = dict(model.tp_plan())
    assert plan["model.embed_tokens"] == "embedding" and plan["lm_head"] == "output"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.*.self_attn.q_norm"] == "replicate_grad_allreduce"
    assert plan["model.layers.*.input_layernorm"] == "sp_norm_local" and plan["model.norm"] == "sp_norm_local"
    assert plan["model.layers.*.self_attn"] == plan["model.layers.*.mlp"] == "sp_input"
    assert isinstance(model.args, HFArgs) and model.args.head_dim == 16 and model.args.kv_heads == 2
    cfg.base_model_tp_plan = dict(cfg.base_model_tp_plan, **{"layers.*.mlp.gate_up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match="'packed_colwise' \\(for 'layers.\\*.mlp.gate_up_proj'\\) has no torchmeg"):
        tp_plan_from_hf(cfg)


def test_hf_mla_kv_a_proj_and_hub_kernel_routing():
    """transformers >= 5.25: DeepSeek-V3's plan shards MLA's attention, its joint KV down-projection
    styled `mla_kv_a_proj` (replicated, the rotary key's gradient summed over tp): torchmeg's
    head_shared_tail:<qk_rope_head_dim>. And with `kernels` installed, transformers wraps attention
    classes in a forward that sets a ContextVar (hub kernel routing), which a compiled, recomputed
    block refuses: every such module of an HFCausalLM runs its class's own forward."""
    import transformers
    from hf_parity_worker import MOE
    from torchmeg.models.hf_causal import HFCausalLM, args_from_config, tp_plan_from_hf
    ds = transformers.DeepseekV3Config(**dict(TINY, **MOE["deepseek_v3"]))
    ds.base_model_tp_plan = dict(ds.base_model_tp_plan or {}, **{"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"})
    plan = dict(tp_plan_from_hf(ds))
    assert plan["model.layers.*.self_attn.kv_a_proj_with_mqa"] == f"head_shared_tail:{ds.qk_rope_head_dim}"
    with torch.device("meta"):
        model = HFCausalLM(args_from_config(transformers.LlamaConfig(**TINY)))
    routed = [m for m in model.modules() if "_kernel_funcs" in m.__dict__]
    try:
        import kernels  # noqa: F401  (transformers >= 5.25 installs it)
        assert routed, "kernels is installed but no module carries its routing wrapper: the check below checks nothing"
    except ImportError:
        pass
    for m in routed:
        assert m.forward.__func__ is type(m).forward.__wrapped__, type(m).__name__
