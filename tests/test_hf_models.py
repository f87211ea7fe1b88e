"""Hugging Face causal LMs trained from a recipe (model.name = "hf"): every layout matches one
process; HF weights in, trained weights out, reloaded by transformers itself."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import assert_parity, read_metrics, run_cli

# Three families with different module trees and TP plans: Llama, Qwen3 (per-head q/k norms whose
# weights need a TP gradient all-reduce), Mistral (sliding-window attention config). Tiny, built
# offline from transformers' config classes.
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}

# The shipped recipe with its defaults (validation, checkpoints, HF export all on), made small.
RUN = ["--config", "recipes/hf_llama_debug.toml", "--data.seq_len=32", "--training.global_batch_size=8",
       "--training.steps=3", "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--validation.steps=2",
       "--metrics.enable_tensorboard=false"]
LAYOUTS = {  # name: (ranks, extra)
    "tp2": (2, ["--training.local_batch_size=8", "--parallelism.tensor_parallel_degree=2",
                "--parallelism.data_parallel_shard_degree=1"]),
    "fsdp2": (2, ["--training.local_batch_size=4"]),
    "tp2_fsdp2": (4, ["--training.local_batch_size=4", "--parallelism.tensor_parallel_degree=2"]),
    "fsdp2_compile_recompute": (2, ["--training.local_batch_size=4", "--compile.enable=true",
                                    "--activation_checkpoint.mode=full"]),
}


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory):
    import transformers
    d = tmp_path_factory.mktemp("hf_configs")
    out = {}
    for fam, cls in FAMILIES.items():
        path = d / f"{fam}.json"
        getattr(transformers, cls)(**TINY).to_json_file(str(path))
        out[fam] = str(path)
    return out


_refs: dict = {}


def _reference(fam, hf_configs, tmp_path_factory):
    if fam not in _refs:
        d = tmp_path_factory.mktemp(f"ref_{fam}")
        run_cli(RUN + [f"--model.hf_config={hf_configs[fam]}", "--training.local_batch_size=8"], d)
        _refs[fam] = read_metrics(d)
    return _refs[fam]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_hf_layout_matches_one_process(fam, layout, hf_configs, tmp_path, tmp_path_factory):
    ref = _reference(fam, hf_configs, tmp_path_factory)
    n, extra = LAYOUTS[layout]
    p = run_cli(RUN + [f"--model.hf_config={hf_configs[fam]}"] + extra, tmp_path, nproc=n, timeout=240)
    got = read_metrics(tmp_path)
    assert_parity(ref, got, tol=1e-5)
    assert len(ref) == 3 and "val_loss" in ref[-1]
    line = next(l for l in p.stdout.splitlines() if l.startswith("parallel"))
    assert "blocks 2 at 'model.layers'" in line, line
    if "fsdp2" in layout:
        assert "FSDP 3 units" in line, line  # one per decoder layer + the root
    if "compile" in layout:
        assert "compiled 2 blocks" in line and "recompute 2 blocks" in line, line
    if "tp2" in layout:
        plan = json.loads(json.dumps(getattr(transformers_config(hf_configs[fam]), "base_model_tp_plan")))
        assert f"TP {len(plan) + 2 + 5}" in line, line  # HF plan + embedding/LM head + SP norms/inputs


def transformers_config(path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def _batch(cfg_args, split, indices):
    """Samples `indices` of the recipe's train/val split, as torchmeg's loader reads them."""
    from torchmeg.config import load_config
    from torchmeg.data import build_dataset, build_tokenizer, open_stores
    cfg = load_config(cfg_args[1], cfg_args[2:])
    ds = build_dataset(cfg, open_stores(cfg, build_tokenizer(cfg.data.tokenizer)), split)
    xs, ys = zip(*(ds[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)


def _loss(model, x, y):
    with torch.no_grad():
        logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item()


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
    assert abs(_loss(start, x, y) - row["loss"]) < 1e-5, (row["loss"], _loss(start, x, y))

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "checkpoint" / "hf")).eval()
    vx, vy = _batch(args, "val", range(16))
    val = (_loss(exported, vx[:8], vy[:8]) + _loss(exported, vx[8:], vy[8:])) / 2
    assert abs(val - row["val_loss"]) < 1e-5, (val, row["val_loss"])
    # The step moved every weight by about lr (Adam's first step), from the loaded weights.
    d = (exported.model.layers[0].mlp.up_proj.weight - start.model.layers[0].mlp.up_proj.weight).abs()
    assert 0 < d.max().item() < 2 * row["lr"] and d.median().item() > 0.5 * row["lr"]

    # torchmeg's own checkpoint of the trained model: same logits as the transformers reload.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torchmeg.config import load_config
    from torchmeg.models import build_model
    tcfg = load_config(args[1], args[2:])
    from torchmeg.data import build_tokenizer
    ours = build_model(tcfg, build_tokenizer(tcfg.data.tokenizer).vocab_size, device="cpu")
    sd = get_model_state_dict(ours)
    step_dir = sorted(d for d in os.listdir(tmp_path / "run" / "checkpoint") if d.startswith("step-"))[-1]
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "run" / "checkpoint" / step_dir))
    set_model_state_dict(ours, sd)
    with torch.no_grad():
        diff = (ours(vx).float() - exported(vx).logits.float()).abs().max().item()
    assert diff < 1e-4, diff


def test_hf_errors_are_one_line(tmp_path):
    base = ["--config", "recipes/hf_llama_debug.toml", "--training.steps=1"]
    for extra, needle in [
        (["--model.hf_config=nope/config.json"], "model.hf_config = 'nope/config.json': no such file"),
        (["--model.num_hiden_layers=2"], "did you mean 'num_hidden_layers'?"),
        (["--parallelism.pipeline_parallel_degree=2"], "cannot be split into pipeline stages"),
        (["--checkpoint.initial_load_hf=" + str(tmp_path)], "not a directory holding .safetensors files"),
    ]:
        p = run_cli(base + extra, tmp_path, check=False, env={"WORLD_SIZE": "2"} if "pipeline" in extra[0] else None)
        assert p.returncode == 2, p.stderr[-2000:]
        err = [l for l in p.stderr.splitlines() if l.startswith("torchmeg: error")]
        assert len(err) == 1 and needle in err[0], p.stderr[-2000:]


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
