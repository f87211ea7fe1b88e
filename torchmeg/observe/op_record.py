"""What actually ran in a training step: the dtypes reaching each matmul/attention op, every dtype
any op touched, the modules float8 converted, and how every parameter is laid out (DTensor mesh,
placements, local and global shape). A feature that silently does nothing (a bf16 policy left in
fp32, a float8 conversion that matched no Linear, a tensor parallel that replicated) shows up here,
where comparing two runs of the same silent no-op cannot see it.

The trainer records step 1 when TORCHMEG_RECORD_OPS=PATH is set (rank r writes PATH.rank<r>.json).
Ops inside compiled graphs run as inductor kernels and are not seen.
"""
from __future__ import annotations

import functools
import inspect
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchmeg.parallel.float8 import is_float8_linear
from torchmeg.parallel.mxfp8 import is_mx_linear

# The ops whose operand dtype *is* the compute precision.
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "linear", "_grouped_mm",
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "scaled_dot_product_attention", "flex_attention", "flex_attention_backward", "_scaled_grouped_mm"}


# The leading arguments that are the op's operands, where others ride along in another dtype by
# design: _scaled_mm's float32 scales; attention's float32 log-sum-exp (flex's backward takes it, and
# an H200's bf16 run recorded flex_attention_backward as "bfloat16, float32" for it). Other ops: every
# tensor input.
OPERANDS = {"_scaled_mm": 2, "_scaled_grouped_mm": 2}


def _operands(op: str, args: tuple, kwargs: dict) -> tuple:
    n = OPERANDS.get(op, 3 if "attention" in op else None)
    return args[:n] if n is not None else (args, kwargs)


def _unwrapping(types) -> type | None:
    """The tensor subclass whose own dispatch runs the op, when it hides its data's dtype: torchao's
    float8 and MX training tensors say "bfloat16" and hold float8 (the same H200 run recorded its float8
    matmuls as a bf16 `mm`). DTensor (duck-typed by `placements`: this module imports nothing
    distributed) says its local tensors' dtype and is recorded as it is."""
    return next((cls for cls in types if _hides_dtype(cls)), None)


@functools.cache
def _hides_dtype(cls: type) -> bool:
    # (asked of every op a recorded step dispatches: decided once per class)
    return cls is not torch.Tensor and "placements" not in dir(cls) and \
        isinstance(inspect.getattr_static(cls, "__torch_dispatch__", None), classmethod)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class OpRecorder(TorchDispatchMode):
    # higher-order ops (flex_attention: document masks on CUDA) reach the mode too, recorded by name;
    # without this torch raises "no rule registered for HigherOrderOperator flex_attention" (found on
    # an H200: every recorded GPU run of the debug recipe failed at step 1)
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.matmul: dict[str, set[str]] = {}
        self.seen: set[str] = set()
        self._flex_eager = None
        self._depth = 0  # (entered again inside a subclass's dispatch: the flag is set and put back once)

    # torch.compile skips every frame while a dispatch mode like this one is on, and torch >= 2.12's
    # eager flex_attention is itself a fullgraph compile of the op: under the mode it raises "found no
    # compiled frames". Recording, flex_attention runs as the plain op (the reference implementation,
    # which has autograd on CUDA), so it reaches this mode; the flag is put back on exit.
    def __enter__(self):
        if self._depth == 0:
            import torch.nn.attention.flex_attention as flex  # lazy: only a recorded step needs it
            self._flex_eager = getattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
            if self._flex_eager is not None:
                flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._flex_eager is not None:
            import torch.nn.attention.flex_attention as flex  # lazy: as in __enter__
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex_eager
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sub = _unwrapping(types)
        if sub is not None:
            # the subclass's own dispatch with this mode on again (torch takes it off while the mode
            # runs): the ops it runs on its plain data are recorded, _scaled_mm and its float8 included
            with self:
                out = sub.__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)  # (a subclass that leaves the op to another one: torch's order, recorded here)
        packet = getattr(func, "overloadpacket", None)
        op = packet.__name__ if packet is not None else func.name()  # (a higher-order op has no packet)
        ins = {_name(t.dtype) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = {_name(t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        self.seen |= ins | outs
        if op in MATMUL_OPS:
            operands = {_name(t.dtype) for t in tree_leaves(_operands(op, args, kwargs)) if isinstance(t, torch.Tensor)}
            self.matmul.setdefault(op, set()).update(operands - {"int64", "int32", "bool"})  # (indices, offsets)
        return out

    def report(self, model: torch.nn.Module) -> dict:
        return {"matmul_dtypes": {k: sorted(v) for k, v in sorted(self.matmul.items())},
                "dtypes_seen": sorted(self.seen),
                "float8_modules": sorted(_clean(n) for n, m in model.named_modules() if is_float8_linear(m)),
                "mxfp8_modules": sorted(_clean(n) for n, m in model.named_modules() if is_mx_linear(m)),
                "params": {_clean(n): _layout(p) for n, p in model.named_parameters()}}


def _placement(x) -> str:
    if x.is_shard():
        return f"Shard({x.dim})"
    if x.is_replicate():
        return "Replicate"
    return "Partial" if x.is_partial() else f"{type(x).__name__}({getattr(x, 'dim', '')})"  # e.g. _StridedShard(0)


def _layout(p: torch.Tensor) -> dict:
    if hasattr(p, "placements"):  # a DTensor (duck-typed: this module imports nothing distributed)
        return {"mesh": list(p.device_mesh.mesh_dim_names or ()), "placements": [_placement(x) for x in p.placements],
                "local": list(p.to_local().shape), "global": list(p.shape)}
    return {"mesh": [], "placements": [], "local": list(p.shape), "global": list(p.shape)}


def _clean(fqn: str) -> str:
    """The model's own FQN, without the wrappers' path parts (recompute, compile)."""
    return ".".join(p for p in fqn.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod"))


def write(path: str, rank: int, report: dict) -> None:
    with open(f"{path}.rank{rank}.json", "w") as fh:
        json.dump(report, fh, indent=1)
