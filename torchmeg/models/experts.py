"""The experts' FFN: E gated FFNs over expert-sorted tokens, each expert a contiguous slice.

Two ways, the same numbers: three grouped matmuls (`torch._grouped_mm`, the slices' ends a device
tensor: no host sync) where the kernel takes the dtype and layout, else a loop over experts (never
over tokens) over the counts read on the host, run outside torch.compile. Used by the MoE block's
local dispatch (torchmeg.models.moe) and by expert parallelism's (torchmeg.parallel.expert).
Legend: T tokens, D model dim, H expert hidden, E experts.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


class ExpertWeights(NamedTuple):
    """An experts module's weights as its FFN reads them (EP passes each rank's local shards): w1 / w3
    [E, D, H] gate and up, w2 [E, H, D] down; b1 / b3 [E, H] and b2 [E, D] their biases or None;
    `act` the gated activation of (gate, up)."""
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    b1: torch.Tensor | None
    b2: torch.Tensor | None
    b3: torch.Tensor | None
    act: Callable


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped above at `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1) (transformers' GptOssExperts._apply_gate)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


def _plus(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x if b is None else x + b


def expert_ffn(w: ExpertWeights, x_TD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The gated FFN of each expert over its contiguous slice of expert-sorted tokens."""
    def one(e, x):
        b = [None if t is None else t[e] for t in (w.b1, w.b2, w.b3)]
        h = w.act(_plus(x @ w.w1[e], b[0]), _plus(x @ w.w3[e], b[2]))
        return _plus(h @ w.w2[e], b[1])
    outs = [one(e, x) for e, x in enumerate(torch.split(x_TD, counts)) if x.shape[0]]
    return torch.cat(outs) if outs else x_TD.new_zeros(0, w.w2.shape[-1])


def grouped_ffn(w: ExpertWeights, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The same FFN in three grouped matmuls: expert e's rows end at offs[e], a device tensor,
    so nothing waits for the counts on the host (biases gathered per row, the row count known)."""
    offs = counts_E.cumsum(0).to(torch.int32)
    row = None
    if w.b1 is not None:
        row = torch.repeat_interleave(torch.arange(counts_E.numel(), device=x_TD.device), counts_E,
                                      output_size=x_TD.shape[0])

    def bias(b):
        return None if b is None else b[row]
    h = w.act(_plus(torch._grouped_mm(x_TD, w.w1, offs=offs), bias(w.b1)),
              _plus(torch._grouped_mm(x_TD, w.w3, offs=offs), bias(w.b3)))
    return _plus(torch._grouped_mm(h, w.w2, offs=offs), bias(w.b2))


def grouped_mm_takes(x_TD: torch.Tensor, w_EDH: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands (torch 2.13): fp32 / bf16 on CPU, bf16 on
    CUDA from sm_90, on fake tensors and under torch.compile; every row 16-byte aligned."""
    item = x_TD.element_size()
    aligned = all(n * item % 16 == 0 for n in (x_TD.shape[-1], w_EDH.shape[-1]))
    if isinstance(x_TD, FakeTensor) or torch.compiler.is_compiling():
        # the planner's fake tensors and torch.compile's tracing: the op's shape rule takes bf16
        # only (as CUDA's kernel), whatever the CPU kernel accepts
        return aligned and x_TD.dtype == torch.bfloat16
    if x_TD.device.type == "cpu":
        return aligned and x_TD.dtype in (torch.float32, torch.bfloat16)
    if x_TD.device.type == "cuda":
        return aligned and x_TD.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_TD.device) >= (9, 0)
    return False


EXPERT_WEIGHTS = ("w1", "w2", "w3", "b1", "b2", "b3")


def expert_weights(experts: nn.Module, view: Callable = lambda t: t) -> ExpertWeights:
    """An experts module's weights as the FFN reads them, each through `view` (EP: its local shard);
    a module without biases or `act` (a user's own, duck-typed) reads as plain SwiGLU."""
    return ExpertWeights(*(None if getattr(experts, n, None) is None else view(getattr(experts, n))
                           for n in EXPERT_WEIGHTS), getattr(experts, "act", swiglu))


@torch._dynamo.disable
def expert_loop(w: ExpertWeights, x_TD: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """expert_ffn over the host's counts, outside torch.compile: the slices' sizes are host values, so
    each new routing would be a new graph (the gpt-oss debug model compiled in fp32 recompiled this to
    dynamo's limit of 8 in 4 steps, then ran it eagerly anyway: 100 s of a 4-step run); it runs eagerly
    between the block's compiled pieces, as expert parallel's exchange does."""
    return expert_ffn(w, x_TD, counts.tolist())
