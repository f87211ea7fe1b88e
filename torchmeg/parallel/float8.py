"""Float8 training with torchao: nn.Linear -> Float8Linear (dynamic scaling).

Recipes (torchao's names): tensorwise (one scale per tensor; FSDP can all-gather weights in
float8), rowwise (one scale per row, power-of-two scales), rowwise_with_gw_hp (rowwise, with the
weight gradient kept in high precision). `emulate` runs the float8 math in higher precision where
the hardware has no FP8 matmul (every CPU; GPUs before sm_89), so the same recipe is testable here.

Order: conversion runs inside parallelize() right before tensor parallelism, so the TP step sees
Float8Linear modules and picks torchao's Float8 TP styles (float8 casts before the collectives).
"""
from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn


def hardware_has_fp8(device_type: str) -> bool:
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def resolve_emulate(emulate, device_type: str) -> bool:
    return (not hardware_has_fp8(device_type)) if emulate == "auto" else bool(emulate)


def _filter(filter_fqns):
    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        if any(fqn == f or fqn.endswith("." + f) or f in fqn.split(".") for f in filter_fqns):
            return False
        # Float8 matmuls need both dims divisible by 16; smaller/odd layers stay in high precision.
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0
    return keep


def apply_float8(model: nn.Module, f8, device_type: str) -> bool:
    """Convert in place; returns True if any Linear was converted."""
    # torchao is imported here, lazily: only runs with float8 on pay for it (~1 s, pytree registrations).
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: see above
    from torchao.float8.float8_linear import Float8Linear  # lazy: see above
    config = Float8LinearConfig.from_recipe_name(f8.recipe)
    config = dataclasses.replace(
        config, emulate=resolve_emulate(f8.emulate, device_type),
        enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather and f8.recipe == "tensorwise")
    convert_to_float8_training(model, module_filter_fn=_filter(f8.filter_fqns), config=config)
    return any(isinstance(m, Float8Linear) for m in model.modules())


def is_float8_linear(mod: nn.Module) -> bool:
    # No module can be a Float8Linear before torchao's float8 module is loaded (by apply_float8).
    f8 = sys.modules.get("torchao.float8.float8_linear")
    return f8 is not None and isinstance(mod, f8.Float8Linear)


def precomputes_scales(cfg, dims) -> bool:
    """Whether the trainer computes the float8 weights' scales after each update, for FSDP's float8
    all-gather (tensorwise only; the planner traces the same)."""
    f8 = cfg.float8
    return (f8.enable and f8.enable_fsdp_float8_all_gather and f8.recipe == "tensorwise"
            and (dims.fsdp > 1 or cfg.training.mixed_precision == "bf16"))


def precompute_scales(model: nn.Module) -> None:
    """With float8 FSDP all-gather: compute all weight scales in one fused op after the optimizer step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # lazy: see apply_float8
    precompute_float8_dynamic_scale_for_fsdp(model)
