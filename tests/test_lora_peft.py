"""LoRA as PEFT defines it, judged by PEFT itself: `LoraConfig()`'s defaults (rank, alpha, dropout,
init, rsLoRA and the default targets by architecture) and PEFT's adapters in both directions (an rsLoRA
export PEFT loads, a PEFT adapter torchmeg imports). In process, no launch: the quick tier. The
trained-run tests (layouts, resume, PEFT loading a run's export) are tests/test_lora.py's."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import FP32_PARITY, assert_tensor_close
from launch import ROOT


def test_lora_defaults_init_and_rslora_are_pefts(tmp_path):
    """[lora]'s defaults are PEFT's `LoraConfig()` (r, lora_alpha, lora_dropout, use_rslora,
    init_lora_weights); A is drawn as PEFT's default draws it (kaiming-uniform, a = sqrt(5): uniform
    within 1/sqrt(in), PEFT's own adapters on the same model judged the same way), "gaussian" as PEFT's
    N(0, 1/r), B = 0; and with rsLoRA (update x alpha / sqrt(r)) the exported adapter loads in PEFT
    with torchmeg's logits, as do the merged weights."""
    import math
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from torchmeg.checkpoint import lora_export
    from torchmeg.checkpoint.hf_files import save_hf_native
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model, init_weights, model_args
    from torchmeg.models.lora import adapters
    from torchmeg.train.build import add_adapters
    recipe = os.path.join(ROOT, "recipes/hf_llama_debug.toml")
    cfg = load_config(recipe, ["--lora.enable=true"])
    peft_default = LoraConfig()
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.use_rslora, cfg.lora.init_lora_weights) == \
        (peft_default.r, peft_default.lora_alpha, peft_default.lora_dropout, peft_default.use_rslora,
         peft_default.init_lora_weights)
    assert cfg.lora.target_modules == [] and peft_default.target_modules is None  # [] spells PEFT's None

    def built(overrides):
        c = load_config(recipe, ["--lora.enable=true"] + overrides)
        model = build_model(c, 257, "cpu")
        add_adapters(model, c)
        init_weights(model, seed=0)
        return c, model

    def spread(a: torch.Tensor) -> tuple[float, float]:
        """(max |a|, std) in units of PEFT's default bound 1/sqrt(in)."""
        bound = 1 / math.sqrt(a.shape[1])
        return a.abs().max().item() / bound, a.std().item() / bound
    # kaiming-uniform: max |A| just under the bound, std = bound / sqrt(3); N(0, 1/r) at r = 8 and in >= 256
    # has std >= 2 bounds (1/8 vs at most 1/16), its tails far past the bound
    _, ours = built([])
    peft = get_peft_model(AutoModelForCausalLM.from_config(model_args(cfg, 257).config), LoraConfig())
    got = {m: spread(a.A.weight.detach()) for m, a in adapters(ours).items()}
    theirs = {n[len("base_model.model."):-len(".lora_A.default.weight")]: spread(p.detach())
              for n, p in peft.named_parameters() if ".lora_A." in n}
    assert set(got) == set(theirs) and len(got) >= 4, (sorted(got), sorted(theirs))
    for m, (top, std) in list(got.items()) + list(theirs.items()):
        assert 0.95 < top <= 1.0 and abs(std * math.sqrt(3) - 1) < 0.1, (m, top, std)
    assert all(not a.B.weight.any() for a in adapters(ours).values())
    _, gauss = built(["--lora.init_lora_weights=gaussian"])
    for a in adapters(gauss).values():
        assert abs(a.A.weight.std().item() * 8 - 1) < 0.1, a.A.weight.std()  # N(0, 1/r), r = 8
    # rsLoRA, rank 4, alpha 8: x4 (alpha / r would be x2); B trained (non-zero)
    c, model = built(["--lora.use_rslora=true", "--lora.rank=4", "--lora.alpha=8"])
    assert {a.scale for a in adapters(model).values()} == {4.0}
    with torch.no_grad():
        for a in adapters(model).values():
            a.B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    args = model_args(c, 257)
    base, pairs = lora_export.split(model.state_dict())
    save_hf_native(base, args, str(tmp_path / "hf"))
    lora_export.save_peft(pairs, args, c.lora, str(tmp_path / "hf" / "adapter"), True)
    save_hf_native(lora_export.merge(base, pairs, lora_export.scaling(c.lora)), args, str(tmp_path / "merged"))
    assert json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())["use_rslora"] is True
    x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.eval()(x)
        want = want.logits if hasattr(want, "logits") else want
        load = lambda f: AutoModelForCausalLM.from_pretrained(str(tmp_path / f)).eval()  # noqa: E731
        assert_tensor_close(PeftModel.from_pretrained(load("hf"), str(tmp_path / "hf" / "adapter")).eval()(x).logits,
                            want, FP32_PARITY, "peft's logits (rsLoRA) vs torchmeg's")
        assert_tensor_close(load("merged")(x).logits, want, FP32_PARITY, "merged (rsLoRA) logits vs torchmeg's")
        assert (load("hf")(x).logits - want).abs().max() > 100 * FP32_PARITY * want.abs().max()  # the adapters matter


def test_lora_default_targets_are_pefts(tmp_path):
    """`lora.target_modules` left at [] adapts what PEFT's `LoraConfig()` (target_modules=None) adapts on
    the same architecture: PEFT's table (copied: the core install has no peft) equals the installed
    PEFT's entry for entry; on native Llama, Qwen3 (QK norm) and GPT-2 (q, k, v = transformers' fused
    c_attn) and on `hf` models of two types, the targets in transformers' names are the modules PEFT
    puts adapters on in transformers' model of the same config; a type PEFT has no default for is one
    line naming the key, as PEFT's own LoraConfig() raises."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFTS
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config
    from torchmeg.checkpoint import peft_targets
    from torchmeg.checkpoint.hf_export import hf_config
    from torchmeg.config.errors import ConfigError
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    from torchmeg.train.build import add_adapters
    assert peft_targets.PEFT_TARGETS == dict(PEFTS)

    def ours(recipe, overrides):
        cfg = load_config(os.path.join(ROOT, "recipes", recipe), ["--lora.enable=true"] + overrides)
        model = build_model(cfg, 257, "cpu")
        names = add_adapters(model, cfg)
        return {peft_targets.hf_module(n, cfg.model.name, model.args) for n in names}, names, model.args

    def pefts(config) -> set:
        model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig())
        return {n[len("base_model.model."):-len(".lora_A")] for n, _ in model.named_modules() if n.endswith(".lora_A")}

    for flavor in ([], ["--model.qk_norm=true"]):  # LlamaForCausalLM, Qwen3ForCausalLM
        got, names, args = ours("debug_llama.toml", flavor)
        hf = hf_config(args)
        kind = hf.pop("model_type")
        assert kind == ("qwen3" if flavor else "llama")
        want = pefts(AutoConfig.for_model(kind, **{k: v for k, v in hf.items() if k != "architectures"}))
        assert got == want and len(names) == 2 * args.n_layers, (sorted(got), sorted(want))
    got, names, args = ours("gpt2_124m.toml", ["--model.flavor=debug"])
    want = pefts(GPT2Config(n_layer=args.n_layers, n_embd=args.dim, n_head=args.n_heads, vocab_size=257))
    assert got == want and len(names) == 3 * args.n_layers, (sorted(got), sorted(want))  # wq, wk, wv: c_attn
    got, names, args = ours("hf_llama_debug.toml", [])
    assert got == pefts(args.config) == set(names)
    neox = tmp_path / "neox"
    neox.mkdir()
    (neox / "config.json").write_text(json.dumps({
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 256}))
    got, names, args = ours("hf_llama_debug.toml", [f"--model.hf_config={neox}"])
    assert got == pefts(args.config) == set(names) and len(names) == 2, names  # query_key_value
    for recipe in ("deepseek_v3_debug.toml", "gpt_oss_debug.toml", "moe_debug.toml"):
        with pytest.raises(ConfigError, match=r"^lora.target_modules = \[\] .*PEFT has no default .*all-linear"):
            ours(recipe, [])
    assert all(PEFTS.get(kind) is None for kind in ("deepseek_v3", "gpt_oss", "qwen3_moe"))


def test_a_peft_adapter_converts_beside_its_model_with_peft_logits(tmp_path):
    """`convert from-hf BASE --adapter FOLDER`: a PEFT adapter (rsLoRA, on q, k, v, o and down: the RoPE
    row order of q and k included) saved by PEFT next to its Llama goes into the converted checkpoint,
    its [lora] keys into the recipe, and torchmeg's model built from that recipe gives PeftModel's
    logits (not the base's); a DoRA adapter is refused naming the key."""
    import json as json_
    import torch.distributed.checkpoint as dcp
    import transformers
    from peft import LoraConfig, get_peft_model
    from torchmeg.checkpoint.convert import main as convert
    from torchmeg.checkpoint.peft_import import read_config
    from torchmeg.config.errors import ConfigError
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    from torchmeg.train.build import add_adapters
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    base.save_pretrained(str(tmp_path / "hf"))
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, use_rslora=True,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])).eval()
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # (trained: B is no longer zero)
    peft.save_pretrained(str(tmp_path / "adapter"))
    out = tmp_path / "out"
    assert convert(["from-hf", str(tmp_path / "hf"), "--out", str(out), "--adapter", str(tmp_path / "adapter")]) == 0
    cfg = load_config(str(out / "recipe.toml"))
    assert (cfg.lora.enable, cfg.lora.rank, cfg.lora.alpha, cfg.lora.use_rslora) == (True, 4, 16.0, True)
    assert sorted(cfg.lora.target_modules) == [f"layers.*.{m}" for m in ("attention.wk", "attention.wo", "attention.wq",
                                                                        "attention.wv", "feed_forward.w2")]
    model = build_model(cfg, 320, "cpu")
    assert len(add_adapters(model, cfg)) == 5 * 2
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(out / "checkpoint" / "step-00000000"), no_dist=True)
    model.load_state_dict(sd["model"])
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = peft(x).logits
        assert_tensor_close(model.eval()(x), want, FP32_PARITY, "torchmeg's logits vs PeftModel's")
        with peft.disable_adapter():
            assert (peft(x).logits - want).abs().max() > 100 * FP32_PARITY * want.abs().max()  # the adapter matters
    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    adapter_config.write_text(json_.dumps({**json_.loads(adapter_config.read_text()), "use_dora": True}))
    with pytest.raises(ConfigError, match=r"adapter_config.json: use_dora = True: torchmeg's LoRA adapters compute"):
        read_config(str(tmp_path / "adapter"))  # (the CLI prints it as its one line, exit 2)
