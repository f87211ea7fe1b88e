"""Quantized Hub releases through python -m torchmeg.convert from-hf: folders written here in the
formats DeepSeek-V3 / Qwen3-FP8 (float8 e4m3 weights, a float32 scale per block) and gpt-oss (MXFP4
experts) ship, quantized by the test from transformers' models; the converted native model's logits
equal transformers' on the weights transformers' own dequantizers give (the judge), within the
parity bound: dequantization is exact in fp32 (an e4m3 / e2m1 value times a float32 or power-of-two
scale), so both sides hold the same weights and differ by summation order only."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FP32_PARITY, assert_tensor_close
from test_convert import _convert, _hf_folder, _native

FP8_MAX = 448.0  # e4m3's largest finite value


def _fp8_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w's blocks scaled to e4m3's range (DeepSeek's recipe: amax / 448 per block; partial edge blocks)."""
    rows, cols = w.shape
    R, C = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(R, C)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(R):
        for j in range(C):
            b = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = b.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (b / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _quantize_folder(folder, quantize, quantization_config: dict, judge: dict | None = None):
    """Rewrite the folder's model.safetensors with `quantize(name, tensor) -> {name: tensor}` applied; with
    `judge` ({name: transformers' dequantization}), a copy of the folder holding those weights instead,
    loaded in transformers: the reference model."""
    import shutil
    from transformers import AutoModelForCausalLM
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    out = {}
    for name, t in sd.items():
        out.update(quantize(name, t))
    ref = None
    if judge is not None:
        moved = max(((sd[n] - w).abs().max() / sd[n].abs().max()).item() for n, w in judge.items())
        assert moved > 1e-3  # quantization changed the weights: the judge is not the original model
        shutil.copytree(folder, folder.parent / "judge")
        save_file({**sd, **judge}, str(folder.parent / "judge" / "model.safetensors"), metadata={"format": "pt"})
        ref = AutoModelForCausalLM.from_pretrained(str(folder.parent / "judge")).eval()
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3"])
def test_fp8_block_scaled_release_converts_to_the_dequantized_model(kind, tmp_path):
    """Every Linear weight but the embedding, head and router in e4m3 with [16, 32] blocks (rows x cols;
    the toy widths leave partial blocks, e.g. the 40 rows of MLA's kv_a_proj), as DeepSeek's release
    stores its 128 x 128 ones."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    block = [16, 32]
    _hf_folder(tmp_path / "hf", kind)
    judge = {}

    def quantize(name, t):
        if t.dim() != 2 or "embed_tokens" in name or "lm_head" in name or name.endswith("mlp.gate.weight"):
            return {name: t}
        q, s = _fp8_quantize(t, block)
        judge[name] = _dequantize_fp8_weight(q, s, block, torch.float32)
        return {name: q, name + "_scale_inv": s}

    hf = _quantize_folder(tmp_path / "hf", quantize, {"quant_method": "fp8", "fmt": "e4m3",
                                                      "activation_scheme": "dynamic", "weight_block_size": block}, judge)
    assert len(judge) > 8
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", "--dtype", "float32")
    x = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_tensor_close(_native(tmp_path / "out")(x), hf(x).logits, FP32_PARITY, f"{kind} fp8 logits")


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_quantize(w_EIO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's storage of an experts tensor [E, in, out]: [E, out, in] in blocks of 32 along `in`, each an
    e8m0 exponent (floor(log2 amax) - 2, OCP MX) and 32 e2m1 values rounded to the nearest, packed two a
    byte, low nibble first."""
    w = w_EIO.transpose(1, 2)
    E, O, I = w.shape
    g = w.reshape(E, O, I // 32, 32)
    exp = torch.floor(torch.log2(g.abs().amax(-1).clamp_min(2.0 ** -100))) - 2
    x = g / torch.exp2(exp)[..., None]
    idx = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


@pytest.mark.slow
def test_mxfp4_experts_of_gpt_oss_convert_to_the_dequantized_model(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    _hf_folder(tmp_path / "hf", "gpt_oss")
    judge = {}

    def quantize(name, t):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {name: t}
        blocks, scales = _mxfp4_quantize(t)
        judge[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        return {name + "_blocks": blocks, name + "_scales": scales}

    hf = _quantize_folder(tmp_path / "hf", quantize, {"quant_method": "mxfp4",
                                                      "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
                          judge)
    assert len(judge) == 4  # two layers' gate_up and down
    _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", "--dtype", "float32")
    x = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_tensor_close(_native(tmp_path / "out")(x), hf(x).logits, FP32_PARITY, "gpt_oss mxfp4 logits")


@pytest.mark.slow
@pytest.mark.parametrize("config, named", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method = 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme = 'static'"),
])
def test_quantizations_it_cannot_read_are_refused_in_one_line(config, named, tmp_path):
    _hf_folder(tmp_path / "hf", "qwen3")
    _quantize_folder(tmp_path / "hf", lambda n, t: {n: t}, config)
    p = _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", check=False)
    assert p.returncode == 2 and named in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1


def _peak_rss_mib(folder, out) -> float:
    """The conversion's peak resident memory (MiB), in a fresh interpreter."""
    import subprocess
    import sys
    from launch import ROOT
    code = ("import resource, sys; from torchmeg.checkpoint.convert import main; rc = main(sys.argv[1:]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "from-hf", str(folder), "--out", str(out), "--dtype", "float32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return float(p.stdout.split("PEAK")[-1])


def _llama_fp8_folder(folder, dim: int, layers: int, vocab: int) -> int:
    """A Llama config.json and its weights in e4m3 with 128 x 128 blocks (random: only sizes matter);
    returns the bytes of the float32 model it converts to."""
    folder.mkdir()
    ffn = 3 * dim
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim, "intermediate_size": ffn,
              "num_hidden_layers": layers, "num_attention_heads": dim // 64, "num_key_value_heads": dim // 64,
              "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, dim, generator=g), "lm_head.weight": torch.randn(vocab, dim, generator=g),
          "model.norm.weight": torch.ones(dim)}
    shapes = {"self_attn.q_proj": (dim, dim), "self_attn.k_proj": (dim, dim), "self_attn.v_proj": (dim, dim),
              "self_attn.o_proj": (dim, dim), "mlp.gate_proj": (ffn, dim), "mlp.up_proj": (ffn, dim), "mlp.down_proj": (dim, ffn)}
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = torch.ones(dim)
        for name, (r, c) in shapes.items():
            sd[f"model.layers.{i}.{name}.weight"] = torch.randn(r, c, generator=g).to(torch.float8_e4m3fn)
            sd[f"model.layers.{i}.{name}.weight_scale_inv"] = torch.rand(-(-r // 128), -(-c // 128), generator=g)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for n, t in sd.items() if not n.endswith("_scale_inv")) * 4


@pytest.mark.slow
def test_conversion_streams_one_tensor_at_a_time(tmp_path):
    """Peak memory of converting an FP8 folder whose float32 model is 576 MiB, over that of a 2 MiB one:
    well under the model (each tensor is read, dequantized and written before the next); holding the
    converted share before saving, as a conversion without streaming does, would add all of it."""
    small = _llama_fp8_folder(tmp_path / "small", 128, 1, 1024)
    big = _llama_fp8_folder(tmp_path / "big", 1024, 12, 16384)
    base = _peak_rss_mib(tmp_path / "small", tmp_path / "small_out")
    peak = _peak_rss_mib(tmp_path / "big", tmp_path / "big_out")
    print(f"peak RSS {peak:.0f} MiB vs {base:.0f} MiB for a {small / 2 ** 20:.0f} MiB model; "
          f"the model: {big / 2 ** 20:.0f} MiB")
    assert peak - base < 0.25 * big / 2 ** 20, (peak, base, big / 2 ** 20)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing scale", "grid of other blocks"])
def test_a_damaged_fp8_release_is_refused_before_anything_is_written(damage, tmp_path):
    """convert from-hf on a Qwen3-FP8-shaped release with one scale missing, or one quantized with
    other blocks than its config.json declares: one line naming the tensor, exit 2, no --out folder
    (before: a 56-line traceback from inside DCP's write, or the weights silently wrong)."""
    block = [16, 32]
    _hf_folder(tmp_path / "hf", "qwen3")
    victim = []

    def quantize(name, t):
        if t.dim() != 2 or "embed_tokens" in name or "lm_head" in name:
            return {name: t}
        q, s = _fp8_quantize(t, block if victim or damage == "missing scale" else [8, 16])
        if not victim:
            victim.append(name)
            return {name: q} if damage == "missing scale" else {name: q, name + "_scale_inv": s}
        return {name: q, name + "_scale_inv": s}

    _quantize_folder(tmp_path / "hf", quantize, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                 "weight_block_size": block})
    p = _convert("from-hf", tmp_path / "hf", "--out", tmp_path / "out", check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and victim[0] in lines[0], p.stderr[-3000:]
    assert ("without a" if damage == "missing scale" else "weight_block_size [16, 32] blocks makes it") in lines[0]
    assert not (tmp_path / "out").exists()
