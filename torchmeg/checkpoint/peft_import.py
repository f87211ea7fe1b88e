"""A PEFT LoRA adapter folder read into torchmeg (`convert from-hf BASE --adapter FOLDER`): what
`PeftModel.save_pretrained` writes (adapter_config.json + adapter_model.safetensors) for a base a native
family implements. Each `base_model.model.<M>.lora_A.weight` / `.lora_B.weight` becomes the adapter of
the torchmeg module transformers' M is (checkpoint.hf's names; B's rows take the module's own layout,
the RoPE row order of q and k projections, as its weight's do), written into the converted checkpoint
beside the base; the recipe gets the adapter's [lora] keys (r, lora_alpha, lora_dropout, use_rslora, the
adapted modules by name), so generate, eval and serve run base + adapter and a run continues training
it. What torchmeg's adapters do not compute is refused in one line naming the key: DoRA, biases,
modules_to_save, per-module ranks or alphas, adapters on layers other than nn.Linear (embeddings, the
grouped MoE experts), gpt-oss's fused projections.
"""
from __future__ import annotations

import json
import os
import re

from torchmeg.checkpoint.hf import tensor_from_hf, torchmeg_fqns
from torchmeg.config.errors import ConfigError
from torchmeg.models.lora import SUFFIX, adapted_module

PREFIX = "base_model.model."
# adapter_config.json keys whose other values torchmeg's adapters do not compute -> the value they need
NEEDED = {"peft_type": "LORA", "use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
          "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "target_parameters": None,
          "lora_bias": False, "layer_replication": None}


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        raise ConfigError(f"--adapter {folder}: not a PEFT adapter folder (adapter_config.json + "
                          f"adapter_model.safetensors, what PeftModel.save_pretrained writes)")
    with open(path) as fh:
        config = json.load(fh)
    for key, need in NEEDED.items():
        have = config.get(key, need)
        if have != need and not (need in ({}, None) and not have):
            raise ConfigError(f"{path}: {key} = {have!r}: torchmeg's LoRA adapters compute {key} = {need!r} only; "
                              f"merge the adapter with PEFT (merge_and_unload) and convert the merged model")
    return config


def read_adapter(folder: str, args, shapes: dict) -> tuple[dict, dict]:
    """-> ({torchmeg adapter tensor name: tensor}, [lora] keys for the recipe). `shapes`: the base
    model's {tensor name: shape}."""
    from safetensors.torch import load_file  # lazy: only an adapter import reads one
    if hasattr(args, "sliding_window"):
        raise ConfigError("--adapter: gpt-oss's adapters are not read (its q, k, v and experts are fused "
                          "differently in torchmeg); merge the adapter with PEFT and convert the merged model")
    config = read_config(folder)
    tensors, out = load_file(os.path.join(folder, "adapter_model.safetensors")), {}
    for key, t in sorted(tensors.items()):
        part = next((p for p in ("lora_A", "lora_B") if key.startswith(PREFIX) and key.endswith(f".{p}.weight")), None)
        if part is None:
            raise ConfigError(f"{folder}: tensor {key!r} is not a LoRA A or B of a Linear layer (only those are read)")
        module = key[len(PREFIX):-len(f".{part}.weight")]
        fqns = torchmeg_fqns(f"{module}.weight", args)
        base = fqns[0][:-len(".weight")] if len(fqns) == 1 and fqns[0].endswith(".weight") else None
        shape = shapes.get(f"{base}.weight") if base else None
        if shape is None or len(shape) != 2:
            raise ConfigError(f"{folder}: {module} is not a Linear layer of torchmeg's model (adapters on the "
                              f"grouped MoE experts or embeddings are not computed); merge the adapter with PEFT")
        want = (config["r"], shape[1]) if part == "lora_A" else (shape[0], config["r"])
        if tuple(t.shape) != want:
            raise ConfigError(f"{folder}: {key} is {tuple(t.shape)}, where r = {config['r']} and {module} make {want}")
        t = t if part == "lora_A" else tensor_from_hf(f"{base}.weight", t, args)  # B's rows are the weight's
        out[f"{base}{SUFFIX}.{'A' if part == 'lora_A' else 'B'}.weight"] = t.contiguous()
    modules = sorted({adapted_module(k) for k in out})
    if not modules or any(f"{m}{SUFFIX}.{p}.weight" not in out for m in modules for p in "AB"):
        raise ConfigError(f"{folder}: every adapted module needs its lora_A and lora_B")
    keys = {"enable": True, "rank": config["r"], "alpha": float(config.get("lora_alpha", 8)),
            "dropout": float(config.get("lora_dropout", 0.0)), "use_rslora": bool(config.get("use_rslora", False)),
            "target_modules": _patterns(modules, args.n_layers)}
    return out, keys


def _patterns(modules: list[str], n_layers: int) -> list[str]:
    """The adapted modules as recipe patterns: 'layers.*.attention.wq' where every layer has it, else
    the names themselves."""
    groups: dict[str, list[str]] = {}
    for m in modules:
        groups.setdefault(re.sub(r"^layers\.\d+\.", "layers.*.", m), []).append(m)
    out = []
    for pattern, names in sorted(groups.items()):
        out += [pattern] if pattern.startswith("layers.*.") and len(names) == n_layers else names
    return out
