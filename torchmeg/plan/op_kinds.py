"""What an aten op is to the planner's op counter (step_cost.StepCost): its FLOPs where torch's
flop_counter has no formula (a grouped matmul) or knows the op under another name (CPU flash
attention), a matmul's shape, an argument by its schema name, and whether the op moves data at all.
"""
from __future__ import annotations

import torch

from torchmeg.plan.memory import tensors as _tensors

aten = torch.ops.aten

# CPU flash attention takes the CUDA flash kernel's leading arguments (q, k, v / grad_out, q, k, v,
# out, lse) and does the same FLOPs; flop_counter has formulas for the CUDA kernels only.
ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """torch._grouped_mm (MoE experts; flop_counter has no formula, torch 2.13): each group a matmul.
    2-D x 2-D with offsets (the weight gradient, [k, T] x [T, n] -> [E, k, n]) contracts over all T
    rows once; every other form contracts `a`'s last dim once per output element."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


FORMULAS = {aten._grouped_mm: _grouped_mm_flops}


# Ops that allocate or re-describe storage without reading or writing it; and a functional
# collective's wait (it returns its buffer once the collective is done: a synchronisation, no kernel
# that reads or writes; counted as traffic it added 66.6 GB to a 2-layer 70B plan).
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
               "set_", "resize_", "resize_storage_bytes_", "detach", "alias", "wait_tensor"}


SHAPED = {"mm", "addmm", "_scaled_mm", "bmm", "baddbmm"}


def mnk(name: str, args) -> str:
    """"MxNxK" of a matmul (K contracted; a batched one's M counts every batch's rows)."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    m = a.shape[-2] * (a.shape[0] if a.dim() == 3 else 1)
    return f"{m}x{b.shape[-1]}x{a.shape[-1]}"


def argument(func, args, kwargs, name: str):
    """An op's argument by its schema name (positional or keyword); None when absent."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, a.default_value)
    return None


def moves_data(func, out) -> bool:
    """A kernel that reads or writes memory: not a view, not metadata, not a bare allocation."""
    if isinstance(func, torch._ops.HigherOrderOperator) or func.namespace == "prim":
        return False
    if func._overloadpacket.__name__ in _NO_TRAFFIC or next(_tensors(out), None) is None:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
