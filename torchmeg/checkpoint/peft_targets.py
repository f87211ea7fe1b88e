"""PEFT's default LoRA targets: what `LoraConfig()` adapts when `target_modules` is left out (None).
PEFT looks the model's `model_type` up in its table (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`,
peft/utils/constants.py, copied below: torchmeg's core install does not depend on peft) and adapts
every module whose name is one of those names or ends in "." + one of them (a string entry: a regular
expression the whole name must match). A model type the table lacks has no default: PEFT raises, and
so does torchmeg, in one line naming the key.

torchmeg's native modules have other names: a module matches by its transformers name, the one the
Hugging Face export writes it under (checkpoint.hf: `attention.wq` is `self_attn.q_proj`); GPT-2's
separate q, k and v projections are transformers' fused `attn.c_attn`. `hf` models carry transformers'
names already. The model type is the one the export writes (`llama`, `qwen3` for QK-normed heads,
`qwen3_moe`, `deepseek_v3`, `gpt_oss`) or the config's own for `hf`.
"""
from __future__ import annotations

import re

from torch import nn

from torchmeg.checkpoint.hf import hf_names
from torchmeg.checkpoint.hf_export import hf_config
from torchmeg.config.errors import ConfigError

# PEFT 0.21's table, entry for entry (tests/test_lora_peft.py holds it equal to the installed PEFT's).
PEFT_TARGETS: dict[str, list[str] | str] = {
    "t5": ["q", "v"], "mt5": ["q", "v"], "bart": ["q_proj", "v_proj"], "gpt2": ["c_attn"],
    "bloom": ["query_key_value"], "blip-2": ["q", "v", "q_proj", "v_proj"], "opt": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"], "gpt_neo": ["q_proj", "v_proj"],
    "bert": ["query", "value"], "roberta": ["query", "value"], "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"], "deberta-v2": ["query_proj", "value_proj"], "deberta": ["in_proj"],
    "layoutlm": ["query", "value"], "llama": ["q_proj", "v_proj"], "llama4": ["q_proj", "v_proj"],
    "chatglm": ["query_key_value"], "gpt_bigcode": ["c_attn"], "mpt": ["Wqkv"],
    "RefinedWebModel": ["query_key_value"], "RefinedWeb": ["query_key_value"], "falcon": ["query_key_value"],
    "btlm": ["c_proj", "c_attn"], "codegen": ["qkv_proj"], "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"], "stablelm": ["q_proj", "v_proj"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
    "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"], "gemma3_text": ["q_proj", "v_proj"],
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)", "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"], "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "rwkv": ["key", "value", "receptance", "output"],
    "rwkv7": ["r_proj", "k_proj", "v_proj", "o_proj", "key", "value"],
}

# Native GPT-2's modules in transformers' GPT2LMHeadModel (q, k and v are one fused c_attn there).
_GPT2 = {"attention.wq": "attn.c_attn", "attention.wk": "attn.c_attn", "attention.wv": "attn.c_attn",
         "attention.wo": "attn.c_proj", "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}
_GPT2_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def model_type(model_name: str, args) -> str:
    """The transformers model type of a torchmeg model: the config's own (`hf`), else the one the
    Hugging Face export writes; a native shape no transformers class computes keeps its family name."""
    if model_name == "hf":
        return args.model_type
    if model_name == "gpt2":
        return "gpt2"
    try:
        return hf_config(args)["model_type"]
    except (ConfigError, AttributeError):
        return model_name


def hf_module(fqn: str, model_name: str, args) -> str:
    """Module `fqn`'s transformers name ('' where it has none)."""
    if model_name == "hf":
        return fqn
    if model_name == "gpt2":
        m = _GPT2_LAYER.fullmatch(fqn)
        return f"transformer.h.{m[1]}.{_GPT2[m[2]]}" if m and m[2] in _GPT2 else ""
    try:
        return hf_names(f"{fqn}.weight", args)[0][:-len(".weight")]
    except KeyError:
        return ""


def peft_matches(target: list[str] | str, name: str) -> bool:
    """PEFT's `check_target_module_exists` for a table entry: a list of names matches a module named
    one of them or ending in "." + one; a string is a regular expression of the whole name."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def default_targets(model: nn.Module, model_name: str, args, skip=lambda fqn: False) -> list[str]:
    """The FQNs of the nn.Linear modules PEFT's `LoraConfig()` would adapt on this model."""
    kind = model_type(model_name, args)
    target = PEFT_TARGETS.get(kind)
    if target is None:
        raise ConfigError(f"lora.target_modules = [] (PEFT's default): PEFT has no default target modules for model "
                          f"type {kind!r} (its LoraConfig() raises too); name them, e.g. "
                          f"lora.target_modules = [\"all-linear\"]")
    return [fqn for fqn, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and not skip(fqn) and peft_matches(target, hf_module(fqn, model_name, args))]

