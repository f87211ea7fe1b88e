"""python -m torchmeg.convert against transformers, the reference: folders transformers writes itself
(tiny configs built here, random weights, nothing downloaded) are converted to native torchmeg models
whose logits and greedy tokens equal transformers' — at positions beyond the rope's original range,
so a scaling computed wrong or dropped shows — and a trained checkpoint goes back to sharded
safetensors that transformers loads with the same logits."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import FP32_PARITY, assert_parity, assert_tensor_close, read_metrics, rel_diff
from launch import run_one, run_cli

ORIGINAL = 16  # the rope's pretraining context in these configs: every test runs past it

CONFIGS = {
    "llama31": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL})),
    "llama_yarn": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": ORIGINAL})),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True)),
    # DeepSeek-V3 as its config.json (YaRN with mscale, low-rank q, group-limited routing, a dense
    # first layer, routed scaling) at toy width.
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, num_hidden_layers=3,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # gpt-oss (sinks, a windowed layer then a full one, biased router and experts, the clamped SwiGLU,
    # YaRN without truncation) at toy width: a window of 8 in 96-token sequences; a clamp of 1.5 that
    # these weights reach
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0})),
}
FAMILY = {"llama31": "llama", "llama_yarn": "llama", "qwen3": "llama", "qwen3_moe": "moe", "deepseek_v3": "deepseek_v3",
          "gpt_oss": "gpt_oss"}


def _hf_folder(path, kind: str, **extra):
    import transformers
    cls, kw = CONFIGS[kind]
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    config = getattr(transformers, cls)(**{**base, **kw, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights large enough that greedy decoding is not one repeated token
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():  # a trained selection bias: it must steer routing here too
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(str(path))
    return model


def _convert(*args, check=True):
    p = run_one([sys.executable, "-m", "torchmeg.convert", *map(str, args)], dict(os.environ), 120)  # (the zygote's fork)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _native(out, overrides=()):
    import torch.distributed.checkpoint as dcp
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    cfg = load_config(str(out / "recipe.toml"), list(overrides))
    model = build_model(cfg, 257, "cpu").eval()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(out / "checkpoint" / "step-00000000"), no_dist=True)
    model.load_state_dict(sd["model"])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_from_hf_gives_transformers_logits_and_greedy_tokens(kind, tmp_path):
    hf = _hf_folder(tmp_path / "hf", kind)
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out")
    recipe = (tmp_path / "out" / "recipe.toml").read_text()
    assert f'name = "{FAMILY[kind]}"' in recipe and ("qk_norm = true" in recipe) == kind.startswith("qwen3"), recipe
    x = torch.randint(0, 320, (2, 6 * ORIGINAL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        assert_tensor_close(_native(tmp_path / "out")(x), want, FP32_PARITY, f"{kind} logits")
        if not kind.startswith("qwen3"):  # the test sees the scaling: plain RoPE gives other logits past the original range
            plain = _native(tmp_path / "out", ["--model.rope_type=default"])(x)
            assert (plain - want).abs().max() > 100 * FP32_PARITY * want.abs().max()
        if kind == "gpt_oss":  # and the windows, the clamp and the sinks: each changes the logits
            for off in (["--model.full_every=1"], ["--model.swiglu_limit=100"]):
                other = _native(tmp_path / "out", off)(x)
                assert (other - want).abs().max() > 100 * FP32_PARITY * want.abs().max(), off
            m = _native(tmp_path / "out")
            for layer in m.layers.values():
                layer.attention.sinks.weight.fill_(-1e4)
            assert (m(x) - want).abs().max() > 100 * FP32_PARITY * want.abs().max()
    p = run_one([sys.executable, "-m", "torchmeg.generate", "--config", str(tmp_path / "out" / "recipe.toml"),
                        "--prompt", "def main(argv):", "--prompt", "x", "--max-new-tokens", "48", "--ignore-eos",
                        "--json"], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        ids = torch.tensor([r["prompt_tokens"]])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert r["tokens"] == ref[0, ids.shape[1]:].tolist(), (kind, r["prompt"])
        assert len(r["tokens"]) == 48 and len(set(r["tokens"])) > 4  # not a degenerate repetition


@pytest.mark.slow
@pytest.mark.parametrize("kind, cls", [("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                       ("deepseek_v3", "DeepseekV3ForCausalLM"), ("gpt_oss", "GptOssForCausalLM")])
def test_trained_checkpoint_to_sharded_hf_reloads_in_transformers(kind, cls, tmp_path):
    from transformers import AutoModelForCausalLM
    _hf_folder(tmp_path / "hf", kind)
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out")
    recipe = str(tmp_path / "out" / "recipe.toml")
    args = ["--config", recipe, "--training.steps=3", "--data.seq_len=32", "--training.local_batch_size=2",
            "--metrics.log_freq=1", "--validation.enable=false", "--metrics.enable_tensorboard=false"]
    p = run_cli(args, tmp_path, name="ft")
    assert "init       from the model-only checkpoint" in p.stdout  # the converted weights, not a fresh init
    assert len(read_metrics(tmp_path, "ft")) == 3
    ckpt = tmp_path / "out" / "checkpoint"
    _convert("to-hf", ckpt, "--config", recipe, "--out", tmp_path / "back", "--max-shard-gb", "0.0001")
    files = sorted(f for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors"))
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)  # sharded, every file indexed
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(hf).__name__ == cls
    import torch.distributed.checkpoint as dcp
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    ours = build_model(load_config(recipe, []), 257, "cpu").eval()
    sd = {"model": ours.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt / "step-00000003"), no_dist=True)
    ours.load_state_dict(sd["model"])
    x = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_tensor_close(ours(x), hf(x).logits, FP32_PARITY, "to-hf logits")
    start = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():  # and it is the trained model, not the converted start
        assert rel_diff(start(x).logits.abs().sum().item(), hf(x).logits.abs().sum().item()) > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("field, value, named", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type = 'dynamic'"),
    ("attention_bias", True, "attention_bias = True"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
])
def test_fields_the_native_family_lacks_are_refused_in_one_line(field, value, named, tmp_path):
    _hf_folder(tmp_path / "hf", "llama31", **{field: value})
    p = _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", check=False)
    assert p.returncode == 2 and named in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_model_type_without_a_native_family_trains_through_hf(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM
    MistralForCausalLM(MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(tmp_path / "hf"))
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out")
    recipe = (tmp_path / "out" / "recipe.toml").read_text()
    assert 'name = "hf"' in recipe and f'initial_load_hf = "{tmp_path / "hf"}"' in recipe, recipe
    run_cli(["--config", str(tmp_path / "out" / "recipe.toml"), "--training.steps=2", "--data.seq_len=32",
             "--training.local_batch_size=2", "--validation.enable=false", "--metrics.enable_tensorboard=false"],
            tmp_path, name="mistral")
    assert all(r["loss"] == r["loss"] for r in read_metrics(tmp_path, "mistral"))


@pytest.mark.slow
def test_from_hf_under_torchrun_shares_the_tensors_out(tmp_path):
    """Two ranks convert, each its share of the tensors into its own files: the checkpoint holds the
    same tensors as a one-process conversion, and every rank wrote a part of it."""
    import torch.distributed.checkpoint as dcp
    from launch import launch_ranks
    _hf_folder(tmp_path / "hf", "qwen3")
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "one")
    p = launch_ranks([sys.executable, "-m", "torchmeg.convert", "from-hf", str(tmp_path / "hf"), "--out",
                       str(tmp_path / "two")], 2, dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    two, one = (tmp_path / d / "checkpoint" / "step-00000000" for d in ("two", "one"))
    files = [f for f in os.listdir(two) if f.endswith(".distcp")]  # __{rank}_{i}: one file a tensor
    assert {f.split("_")[2] for f in files} == {"0", "1"} and len(files) == len(
        dcp.FileSystemReader(str(two)).read_metadata().state_dict_metadata)
    meta = dcp.FileSystemReader(str(one)).read_metadata().state_dict_metadata
    assert set(meta) == set(dcp.FileSystemReader(str(two)).read_metadata().state_dict_metadata)
    for path in (one, two):
        sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
        if path == one:
            first = sd
    assert all(torch.equal(first[k], sd[k]) for k in meta)


@pytest.mark.slow
def test_deepseek_v3_mtp_module_goes_to_hf_and_back(tmp_path):
    """A native DeepSeek-V3 with its MTP module, trained, then exported: the MTP module is written
    as DeepSeek's checkpoints store it (model.layers.{n_layers}.*: enorm, hnorm, eh_proj,
    shared_head.norm and a decoder layer) and from-hf imports it back, every tensor equal; transformers
    (which builds no MTP module) loads the export with the same logits."""
    from transformers import AutoModelForCausalLM
    import torch.distributed.checkpoint as dcp
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    recipe = "recipes/deepseek_v3_debug.toml"
    ckpt = tmp_path / "ck"
    run_cli(["--config", recipe, "--training.steps=2", "--data.seq_len=32", "--training.local_batch_size=2",
             "--validation.enable=false", "--metrics.enable_tensorboard=false", "--checkpoint.enable=true",
             f"--checkpoint.folder={ckpt}"], tmp_path, name="ds")
    _convert("to-hf", ckpt, "--config", recipe, "--out", tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f"model.layers.4.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")} <= set(index)
    assert "model.layers.4.self_attn.kv_b_proj.weight" in index and "model.layers.4.mlp.experts.7.up_proj.weight" in index
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert "mtp_depth = 1" in (tmp_path / "back" / "recipe.toml").read_text()
    model = build_model(load_config(recipe, []), 257, "cpu")
    want = {"model": model.state_dict()}
    dcp.load(want, checkpoint_id=str(ckpt / "step-00000002"), no_dist=True)
    got = {"model": {k: torch.empty_like(v) for k, v in want["model"].items()}}
    dcp.load(got, checkpoint_id=str(tmp_path / "back" / "checkpoint" / "step-00000000"), no_dist=True)
    assert any(k.startswith("mtp.4.") for k in got["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    model.load_state_dict(want["model"])
    x = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_tensor_close(model.eval()(x), hf(x).logits, FP32_PARITY, "deepseek_v3 to-hf logits")


@pytest.mark.slow
def test_hf_moe_trains_on_one_process_fsdp2_and_tp2(tmp_path):
    """transformers' own Qwen3-MoE (`--family hf`) through the converted recipe: one process, FSDP2
    and TP2 train it alike. Under TP its plan's expert styles (packed_colwise, moe_tp_experts) are
    dropped: attention is TP-sharded by the plan, the experts run whole on each TP rank (sequence
    parallel off, said in the header). (From a fresh init: the Hub's per-expert tensors do not load
    into transformers' packed experts through checkpoint.initial_load_hf yet; docs/limits.md.)"""
    _hf_folder(tmp_path / "hf", "qwen3_moe")
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", "--family", "hf")
    args = ["--config", str(tmp_path / "out" / "recipe.toml"), "--checkpoint.initial_load_hf=",
            "--training.steps=3", "--data.seq_len=32",
            "--training.global_batch_size=4", "--training.deterministic=true", "--validation.enable=false",
            "--metrics.enable_tensorboard=false", "--metrics.log_freq=1"]
    run_cli(args + ["--training.local_batch_size=4"], tmp_path, name="one")
    run_cli(args + ["--training.local_batch_size=2"], tmp_path, name="fsdp", nproc=2)
    one = read_metrics(tmp_path, "one")
    assert len(one) == 3 and one[-1]["loss"] < one[0]["loss"], one
    assert_parity(one, read_metrics(tmp_path, "fsdp"))
    p = run_cli(args + ["--training.local_batch_size=4", "--parallelism.tensor_parallel_degree=2",
                        "--parallelism.data_parallel_shard_degree=1"], tmp_path, name="tp", nproc=2)
    assert_parity(one, read_metrics(tmp_path, "tp"))
    assert "MoE experts run whole on every TP rank" in p.stdout, p.stdout[-2000:]


@pytest.mark.slow
def test_a_bf16_release_converts_to_bf16_by_default(tmp_path):
    """A folder whose config.json says bfloat16 (as most releases) converts to a bf16 checkpoint, not
    one twice its size; --dtype float32 asks for float32; the converted recipe trains from either."""
    import torch.distributed.checkpoint as dcp
    import transformers
    _hf_folder(tmp_path / "fp32", "qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"), dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("dtype") == "bfloat16"
    for out, extra, want in (("auto", [], torch.bfloat16), ("f32", ["--dtype", "float32"], torch.float32)):
        _convert("from-hf", tmp_path / "hf", "--out", tmp_path / out, *extra)
        meta = dcp.FileSystemReader(str(tmp_path / out / "checkpoint" / "step-00000000")).read_metadata()
        dtypes = {m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.startswith("model.")}
        assert dtypes == {want}, (out, dtypes)
    run_cli(["--config", str(tmp_path / "auto" / "recipe.toml"), "--training.steps=1", "--data.seq_len=32",
             "--training.local_batch_size=2", "--validation.enable=false", "--metrics.enable_tensorboard=false"],
            tmp_path, name="ft")
    assert read_metrics(tmp_path, "ft")[0]["loss"] > 0


@pytest.mark.parametrize("positions, seq_len", [(128, 128), (4096, 256), (None, 256)])
def test_a_converted_recipe_fits_its_models_context(positions, seq_len, tmp_path):
    """A folder whose max_position_embeddings is under data.seq_len's default (256) converts to a recipe
    whose seq_len is the model's context: generate, eval and serve take it as written (before, they
    refused the converted model until the user passed --data.seq_len)."""
    from torchmeg.checkpoint.convert import write_recipe
    from torchmeg.config.schema import load_config
    write_recipe(str(tmp_path / "recipe.toml"), "llama", {"dim": 64}, "byte", str(tmp_path / "ckpt"), "src", positions)
    assert load_config(str(tmp_path / "recipe.toml")).data.seq_len == seq_len
