"""Muon for the hidden matrices with AdamW for everything else, in one optimizer; states optionally in bf16.

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): momentum, then the
update orthogonalized by a quintic Newton-Schulz iteration, then a shape-dependent rate. The update
is torch.optim.Muon's, op for op (`newton_schulz` with the same coefficients, normalization and
addmm sequence; `adjusted_lr` is torch's `_adjust_lr`), so one process equals torch.optim.Muon +
torch.optim.AdamW groups (tests/test_muon.py). Groups carry `algorithm` = "muon" or "adamw".

Sharded matrices: the orthogonalization needs the whole matrix (it is not elementwise), so a
DTensor update is redistributed to whole matrices before the iteration and back to its placements
after: under FSDP2 and TP an all-gather per matrix, the iteration computed on every rank of the
matrix's mesh (the same input, the same result everywhere), the shard kept. Expert weights
[experts, in, out] are a batch of matrices: a shard over the expert dimension (EP, or FSDP over
experts) stays where it is and each rank orthogonalizes its own experts, one matrix at a time.
Why gather rather than distribute whole matrices across ranks (torchtitan's DistMuon, Megatron's
layer-wise optimizer): gathering is exact in every layout the trainer composes (FSDP x TP, strided
shards, uneven shards) with one code path and no ownership schedule; its price is the iteration
repeated on each rank of a matrix's mesh and an all-gather per matrix per step, which the planner
counts (torchmeg.plan runs this optimizer on fake tensors: FLOPs, collectives, state bytes).

States: Adam's moments and Muon's momentum are kept in `state_dtype` (float32 or bfloat16); with
bfloat16 they are read into float32, updated there and rounded back, so the update's arithmetic is
float32's and only the stored states are rounded (the weights keep their dtype).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch.optim.Muon's defaults (torch/optim/_muon.py): the quintic's coefficients and the normalization's eps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalized matrix (or batch of matrices, one at a time), as torch.optim.Muon computes it."""
    if g.ndim == 3:
        if g.shape[0] == 0:
            return g.to(dtype)
        return torch.stack([newton_schulz(m, steps, dtype, coefficients, eps) for m in g.unbind(0)])
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, shape, in_out: bool = False) -> float:
    """torch.optim.Muon's rate for a matrix of `shape`: its last two dimensions [out, in] (a Linear's
    weight), or [in, out] with `in_out` (torchmeg's grouped experts)."""
    rows, cols = (shape[-1], shape[-2]) if in_out else (shape[-2], shape[-1])
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`newton_schulz` of a plain or DTensor update: a DTensor is made whole first (an expert batch keeps
    its shards over the expert dimension) and returned in its own placements."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    mesh, placements = update.device_mesh, update.placements
    whole = [p if update.ndim == 3 and isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements]
    local = update.redistribute(mesh, whole).to_local()
    out = DTensor.from_local(newton_schulz(local, steps, dtype), mesh, whole, run_check=False,
                             shape=update.shape, stride=update.stride())
    return out.redistribute(mesh, placements)


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer, two update rules: groups with algorithm "muon" (2-D matrices or 3-D expert
    batches) and "adamw" (anything). `adam=True` makes the AdamW groups Adam (L2 weight decay)."""

    def __init__(self, groups, *, lr: float, betas, eps: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_dtype: str = "bfloat16", adjust_lr: str = "match_rms_adamw",
                 state_dtype: str = "float32", adam: bool = False):
        defaults = dict(lr=lr, weight_decay=0.0, betas=tuple(betas), eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, adjust_lr=adjust_lr, state_dtype=state_dtype,
                        algorithm="adamw", decoupled=not adam, in_out=False)
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["algorithm"] == "muon":
                bad = [tuple(p.shape) for p in g["params"] if p.ndim not in (2, 3)]
                if bad:
                    raise ValueError(f"Muon takes matrices (2-D) or expert batches (3-D); got a parameter of "
                                     f"shape {bad[0]}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            (self._muon if g["algorithm"] == "muon" else self._adamw)(g)
        return loss

    def _state(self, p, names, dtype):
        st = self.state[p]
        if not st:
            if "exp_avg" in names:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for n in names:
                st[n] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return st

    def _muon(self, g) -> None:
        lr, wd, mom = g["lr"], g["weight_decay"], g["momentum"]
        sdt = DTYPES[g["state_dtype"]]
        for p in g["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            buf = self._state(p, ("momentum_buffer",), sdt)["momentum_buffer"]
            if sdt == grad.dtype:
                m = buf.lerp_(grad, 1 - mom)
            else:
                m = buf.to(grad.dtype).lerp_(grad, 1 - mom)
                buf.copy_(m)
            update = grad.lerp(m, mom) if g["nesterov"] else m
            update = orthogonalize(update, g["ns_steps"], DTYPES[g["ns_dtype"]])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted_lr(lr, g["adjust_lr"], p.shape, g["in_out"]))

    def _adamw(self, g) -> None:
        lr, wd, eps = g["lr"], g["weight_decay"], g["eps"]
        b1, b2 = g["betas"]
        sdt = DTYPES[g["state_dtype"]]
        for p in g["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            st = self._state(p, ("exp_avg", "exp_avg_sq"), sdt)
            st["step"] += 1
            t = float(st["step"])
            if wd != 0 and g["decoupled"]:
                p.mul_(1 - lr * wd)
            elif wd != 0:
                grad = grad.add(p, alpha=wd)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            low = sdt != grad.dtype
            m32 = (m.to(grad.dtype) if low else m).lerp_(grad, 1 - b1)
            v32 = (v.to(grad.dtype) if low else v).mul_(b2).addcmul_(grad, grad, value=1 - b2)
            if low:
                m.copy_(m32)
                v.copy_(v32)
            denom = (v32.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
            p.addcdiv_(m32, denom, value=-lr / (1 - b1 ** t))
