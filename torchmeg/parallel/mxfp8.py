"""MXFP8 training with torchao (OCP Microscaling: float8 e4m3 elements, one power-of-two e8m0 scale per
32 consecutive elements), float8.recipe = "mxfp8" / "mxfp8_wgrad_with_hp".

torchao 0.18's training path (torchao.prototype.moe_training): `quantize_` with an MXFP8TrainingOpConfig
wraps each selected weight in MXFP8TrainingWeightWrapperTensor, whose matmuls cast both operands to
MXFP8 per 32-element block along the contraction dimension, forward and backward (the weight gradient
in high precision with wgrad_with_hp). The wrapper carries FSDP2's all-gather hooks; under TP its
override (a __torch_function__) is below DTensor's dispatch, so each TP Linear runs on its local shards
here (`mx_tensor_parallel`). Real MXFP8 matmuls need the
block-scaled tensor cores of sm_100 (Blackwell) and torchao's CUDA build; elsewhere (every CPU, Hopper
and older) torchao's EMULATED kernels quantize and dequantize with the same rounding and run the
matmul in high precision, and the run header says which.

Selected: the blocks' bias-free Linears whose in/out features are multiples of 32 (the block size;
under TP, of 32 x tp, so every shard holds whole blocks), except float8.filter_fqns (the LM head by default). torchao's MX linear drops a bias, so a Linear with
one stays in high precision (named by the run header's count). The grouped MoE experts are not
converted: torchao's MXFP8 grouped matmul takes weights stored [experts, out, in] (K-major), where
torchmeg's experts are [experts, in, out] (docs/limits.md).
"""
from __future__ import annotations

import dataclasses
import sys
import types

import torch
from torch import nn

from torchmeg.models.moe import is_grouped_experts

MX_RECIPES = ("mxfp8", "mxfp8_wgrad_with_hp")
BLOCK = 32


def torch_has_mx_training() -> bool:
    """Whether this torch has what torchao's MXFP8 training asks of DTensor (its own check, in
    torchao.prototype.moe_training.conversion_utils): torch 2.13 and 2.14.1 have it, 2.11 does not."""
    from torch.distributed.tensor import _dispatch, _ops  # lazy: DTensor's internals, read only here
    return hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler")


def hardware_has_mxfp8(device_type: str) -> bool:
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (10, 0)


def _keep(filter_fqns, tp: int):
    """Bias-free Linears outside filter_fqns whose dimensions hold whole 32-blocks — on every TP shard."""
    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or mod.bias is not None:
            return False
        if any(fqn == f or fqn.endswith("." + f) or f in fqn.split(".") for f in filter_fqns):
            return False
        return mod.in_features % (BLOCK * tp) == 0 and mod.out_features % (BLOCK * tp) == 0
    return keep


def apply_mxfp8(model: nn.Module, f8, device_type: str, out_dtype: torch.dtype, tp: int = 1) -> bool:
    """Wrap the selected Linears' weights in place; True if any was."""
    # torchao's prototype is imported here, lazily: only runs with an MX recipe pay for it.
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig  # lazy: see above
    from torchao.prototype.mx_formats.config import ScaleCalculationMode  # lazy: see above
    from torchao.quantization import quantize_  # lazy: see above
    from torchao.quantization.quantize_.common import KernelPreference  # lazy: see above
    emulate = resolve_emulate(f8.emulate, device_type)
    config = MXFP8TrainingOpConfig(
        kernel_preference=KernelPreference.EMULATED if emulate else KernelPreference.AUTO, out_dtype=out_dtype,
        wgrad_with_hp=f8.recipe == "mxfp8_wgrad_with_hp", scale_calculation_mode=ScaleCalculationMode.RCEIL)
    quantize_(model, config, filter_fn=_keep(f8.filter_fqns, tp))
    if f8.mx_experts:
        # bf16 out: the grouped GEMM's output (sm_100's kernel; the emulation's bf16 grouped matmul, whose CPU
        # kernel writes its input dtype), as torchtitan runs it; MX values are exact in bf16.
        experts_config = dataclasses.replace(config, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=True)
        cls = _k_major_class()
        for m in model.modules():
            if _mx_experts(m):
                for name, p in list(m.named_parameters(recurse=False)):
                    setattr(m, name, nn.Parameter(cls(p.data, experts_config), requires_grad=p.requires_grad))
    return any(is_mx_linear(m) or is_mx_experts(m) for m in model.modules())


_K_MAJOR = []


def _k_major_class():
    """torchao's MXFP8 weight wrapper whose grouped matmul first lays the weight out K-major: torchao's
    grouped GEMM takes B as the transpose of a contiguous [experts, out, in] tensor, torchmeg's experts
    are a contiguous [experts, in, out] (one copy per forward; FSDP2 shards contiguous parameters only,
    so the parameter itself keeps its layout)."""
    if not _K_MAJOR:
        from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor  # lazy: see apply_mxfp8

        class KMajorMXFP8Weight(MXFP8TrainingWeightWrapperTensor):
            @classmethod
            def __torch_function__(cls, func, types, args, kwargs={}):
                if func.__name__ == "_grouped_mm" and isinstance(args[1], cls) and args[1].stride(-2) != 1:
                    args = (args[0], args[1].mT.contiguous().mT, *args[2:])
                return super().__torch_function__(func, types, args, kwargs)
        _K_MAJOR.append(KMajorMXFP8Weight)
    return _K_MAJOR[0]


def mx_tensor_parallel(model: nn.Module) -> None:
    """Under TP, run each MX Linear on its local shards: DTensor's own linear would call the local
    wrapper below its matmul override (no MX cast at all). The shard math is the colwise / rowwise
    Linear's: input replicated x weight Shard(0) -> output Shard(-1); input Shard(-1) x weight Shard(1)
    -> Partial (the TP style's output hook then reduces it). MX blocks run along each shard's own
    contraction slice, the global blocks when K / tp is a multiple of 32 (the conversion's filter)."""
    for mod in model.modules():
        if is_mx_linear(mod) and any(p.is_shard() for p in getattr(mod.weight, "placements", ())):
            mod.forward = types.MethodType(_local_mx_forward, mod)


def _local_mx_forward(self, x):
    from torch.distributed.tensor import DTensor, Partial, Shard  # lazy: TP runs only
    w = self.weight
    if isinstance(x, DTensor):
        # A replicated input meets a Shard(0) weight: each rank's input gradient is a partial sum.
        grad = [Partial() if wp.is_shard() and wp.dim == 0 and xp.is_replicate() else xp
                for xp, wp in zip(x.placements, w.placements)]
        x = x.to_local(grad_placements=grad)
    y = torch.nn.functional.linear(x, w.to_local())
    out = [Shard(y.ndim - 1) if p.is_shard() and p.dim == 0 else Partial() if p.is_shard() else p
           for p in w.placements]
    return DTensor.from_local(y, w.device_mesh, out, run_check=False)


def _mx_experts(mod: nn.Module) -> bool:
    return is_grouped_experts(mod) and all(
        p.ndim == 3 and p.shape[-1] % BLOCK == 0 and p.shape[-2] % BLOCK == 0 for p in mod.parameters(recurse=False))


def is_mx_experts(mod: nn.Module) -> bool:
    w = getattr(mod, "w1", None)
    return isinstance(w, torch.Tensor) and w.ndim == 3 and _is_mx_weight(w)


def resolve_emulate(emulate, device_type: str) -> bool:
    return (not hardware_has_mxfp8(device_type)) if emulate == "auto" else bool(emulate)


def is_mx_linear(mod: nn.Module) -> bool:
    """A Linear whose weight (or, under FSDP2 / TP, its local shard) is torchao's MXFP8 wrapper."""
    return isinstance(mod, nn.Linear) and _is_mx_weight(mod.weight)


def _is_mx_weight(w: torch.Tensor) -> bool:
    """`w` (a parameter, or a DTensor whose local shard is) holds torchao's MXFP8 weight wrapper."""
    # No tensor can be one before torchao's module is loaded (by apply_mxfp8).
    tensor = sys.modules.get("torchao.prototype.moe_training.tensor")
    if tensor is None:
        return False
    w = getattr(w, "_local_tensor", w)
    return isinstance(w, tensor.MXFP8TrainingWeightWrapperTensor) or isinstance(
        getattr(w, "data", None), tensor.MXFP8TrainingWeightWrapperTensor)
