"""LoRA adapters out of torchmeg: in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained` loads onto the exported base model), or merged into the base
weights (W + s · B A, s = alpha / r or, with rsLoRA, alpha / sqrt(r); computed in float32 before any cast).

Names: the adapter of torchmeg module `m` (torchmeg.models.lora: `m_lora.A` / `m_lora.B`) is PEFT's
`base_model.model.<M>.lora_A.weight` / `.lora_B.weight`, M the transformers name of `m` (the same for
`hf` models; for native families M is what checkpoint.hf maps `m.weight` to). B's rows are W's output
rows, so they take W's transformers layout (the RoPE row order of q / k projections); A's are inputs.
"""
from __future__ import annotations

import json
import os

import torch

from torchmeg.checkpoint.hf import hf_names, tensor_to_hf
from torchmeg.checkpoint.hf_files import write_safetensors
from torchmeg.models import lora
from torchmeg.models.lora import adapted_module, is_adapter

ADAPTER_DIR = "adapter"  # beside the base model's safetensors


def split(sd: dict) -> tuple[dict, dict]:
    """(base tensors, {base module FQN: (A, B)}) of a state dict holding LoRA adapters."""
    base = {k: v for k, v in sd.items() if not is_adapter(k)}
    pairs = {}
    for k, v in sd.items():
        if is_adapter(k):
            part = k[:-len(".weight")].rsplit(".", 1)[1]  # A | B
            pairs.setdefault(adapted_module(k), {})[part] = v
    return base, {m: (p["A"], p["B"]) for m, p in pairs.items()}


def scaling(lora_cfg) -> float:
    """The recipe's [lora] update factor, as the adapters compute it (models.lora.scaling)."""
    return lora.scaling(lora_cfg.rank, lora_cfg.alpha, lora_cfg.use_rslora)


def merge(base: dict, pairs: dict, scale: float) -> dict:
    """Base tensors with each adapter's update added: W + scale · B A, in float32 (a bf16 base included)."""
    out = dict(base)
    for module, (a, b) in pairs.items():
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = w.float() + scale * (b.float() @ a.float())  # cast by the writer
    return out


def hf_module(module: str, args, hf_native: bool) -> str:
    return module if hf_native else hf_names(f"{module}.weight", args)[0][:-len(".weight")]


def save_peft(pairs: dict, args, lora_cfg, folder: str, hf_native: bool, base_path: str = "",
              dtype: torch.dtype = torch.float32) -> None:
    """The adapters as a PEFT LoRA folder."""
    tensors, targets = {}, []
    for module, (a, b) in sorted(pairs.items()):
        name = hf_module(module, args, hf_native)
        b = b if hf_native else tensor_to_hf(f"{module}.weight", b, args)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous()
        targets.append(name)
    write_safetensors(tensors, folder, "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
              "lora_dropout": lora_cfg.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": lora_cfg.use_rslora, "init_lora_weights": lora_cfg.init_lora_weights, "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": base_path}
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
