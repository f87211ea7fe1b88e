"""Official releases' layouts, tensor for tensor, as their published files show them — DeepSeek-V3 and
Qwen3-FP8 (below; gpt-oss-20b's MXFP4 experts with its modules_to_not_convert: tests/test_hf_quant.py).
DeepSeek-V3
(deepseek-ai/DeepSeek-V3's safetensors headers and config.json): every Linear of attention, the dense
MLP, the routed and the shared experts in F8_E4M3 with an F32 `weight_scale_inv` of ceil(rows / 128) x
ceil(cols / 128) blocks (kv_a_proj_with_mqa 576 x 7168 has 5 x 56: partial edge blocks); the embedding,
the norms and the router in BF16, `e_score_correction_bias` in F32; the MTP module stored as layer
`num_hidden_layers` (61): its decoder layer quantized as the others, `eh_proj`, `enorm`, `hnorm`,
`shared_head.norm` and its own copies of the embedding and the head (`embed_tokens`,
`shared_head.head`) in BF16; `quantization_config` {"activation_scheme": "dynamic", "fmt": "e4m3",
"quant_method": "fp8", "weight_block_size": [128, 128]} and `torch_dtype` bfloat16 in config.json; the
tensors in shards named by an index, a weight's scales not always in its own shard. Built offline at the
debug width (dim 128: 192-row and 256-row weights make two blocks, the second partial), it converts with
the release's own defaults (`--dtype auto`: bf16) to exactly the model its dequantized weights make."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from launch import run_cli
from test_convert import _convert, _hf_folder
from test_hf_quant import _fp8_quantize

BLOCK = [128, 128]
QUANTIZED = re.compile(r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|q_proj|k_proj|v_proj|o_proj)|"
                       r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")


def _read_folder(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
        with safe_open(str(folder / file), "pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def _write_shards(folder, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}  # (a weight and its scales may part)
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == f}, str(folder / f),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))


def _native_state(out) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    path = str(out / "checkpoint" / "step-00000000")
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd


def _release(trained: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """-> (the release's tensors: QUANTIZED weights in e4m3 + F32 scales of 128 x 128 blocks, routing
    biases F32, every other tensor BF16; the judge's: the values those stand for, in fp32, dequantized
    by transformers)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    release, judge = {}, {}
    for name, t in trained.items():
        if QUANTIZED.search(name):
            q, s = _fp8_quantize(t.float(), BLOCK)
            release[name], release[name + "_scale_inv"] = q, s
            judge[name] = _dequantize_fp8_weight(q, s, BLOCK, torch.float32)  # transformers' W = q x its block's scale
        elif name.endswith("e_score_correction_bias"):
            release[name] = judge[name] = t.float()
        else:
            release[name] = t.to(torch.bfloat16)
            judge[name] = release[name].float()
    moved = max(((trained[n].float() - judge[n]).abs().max() / trained[n].float().abs().max()).item()
                for n in trained if QUANTIZED.search(n))
    assert moved > 1e-3  # e4m3 changed the weights: the comparison is not of the original ones
    return release, judge


def _convert_both(tmp_path, source, config: dict, release: dict, judge: dict, extra: dict):
    """The release folder and the judge's (no quantization_config), each in 3 shards with an index,
    converted with from-hf's defaults (--dtype auto: the release's bf16) -> (release's, judge's) native
    state dicts."""
    for name, tensors, quant in (("rel", release, True), ("judge", judge, False)):
        folder = tmp_path / name
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        _write_shards(folder, tensors, 3)
        c = dict(config, torch_dtype="bfloat16", **extra)
        c.pop("dtype", None)
        if quant:
            c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": BLOCK}
        (folder / "config.json").write_text(json.dumps(c))
        _convert("from-hf", folder, "--out", tmp_path / f"out_{name}")
    got, want = _native_state(tmp_path / "out_rel"), _native_state(tmp_path / "out_judge")
    assert set(got) == set(want) and any(v.dtype == torch.bfloat16 for v in got.values())  # (auto: bf16)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    return got, want


@pytest.mark.slow
def test_deepseek_v3_in_its_release_layout_converts_to_its_dequantized_weights(tmp_path):
    ckpt = tmp_path / "ck"
    run_cli(["--config", "recipes/deepseek_v3_debug.toml", "--training.steps=1", "--data.seq_len=32",
             "--training.local_batch_size=2", "--validation.enable=false", "--metrics.enable_tensorboard=false",
             "--checkpoint.enable=true", f"--checkpoint.folder={ckpt}"], tmp_path, name="ds")
    _convert("to-hf", ckpt, "--config", "recipes/deepseek_v3_debug.toml", "--out", tmp_path / "hf")
    trained = _read_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    mtp = config["num_hidden_layers"]  # DeepSeek stores its MTP module as the layer after the last
    trained.setdefault(f"model.layers.{mtp}.embed_tokens.weight", trained["model.embed_tokens.weight"])
    trained.setdefault(f"model.layers.{mtp}.shared_head.head.weight", trained["lm_head.weight"])
    release, judge = _release(trained)
    # what the release's layout holds: quantized decoder layers and MTP decoder, BF16 eh_proj, partial blocks
    assert release[f"model.layers.{mtp}.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert release[f"model.layers.{mtp}.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert release[f"model.layers.{mtp}.eh_proj.weight"].dtype == torch.bfloat16
    assert release["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert release["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert list(release["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape) == [2, 1]  # 192 rows
    got, _ = _convert_both(tmp_path, tmp_path / "hf", config, release, judge, {"num_nextn_predict_layers": 1})
    assert any(k.startswith("model.mtp.") for k in got)
    assert "mtp_depth = 1" in (tmp_path / "out_rel" / "recipe.toml").read_text()


@pytest.mark.slow
def test_qwen3_fp8_in_its_release_layout_converts_to_its_dequantized_weights(tmp_path):
    """Qwen3's FP8 releases (Qwen/Qwen3-8B-FP8 and its siblings): q, k, v, o and the MLP's gate, up, down
    in F8_E4M3 with F32 128 x 128 `weight_scale_inv`; the embedding, the untied head and every norm
    (q_norm and k_norm included) in BF16; the same quantization_config as DeepSeek's."""
    from safetensors.torch import load_file
    _hf_folder(tmp_path / "hf", "qwen3", tie_word_embeddings=False)
    trained = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    release, judge = _release(trained)
    assert release["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert release["model.layers.0.self_attn.q_norm.weight"].dtype == torch.bfloat16
    assert release["lm_head.weight"].dtype == torch.bfloat16
    assert list(release["model.layers.0.mlp.up_proj.weight_scale_inv"].shape) == [2, 1]  # 160 rows
    _convert_both(tmp_path, tmp_path / "hf", config, release, judge, {})
