"""Optimizer, LR schedule and gradient-norm clipping that is correct over DTensors."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Weight decay on matrices and embeddings only; norms and biases are not decayed."""
    o = cfg.optimizer
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.betas[0])
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def lr_factor(step: int, cfg) -> float:
    """Multiplier of optimizer.lr for 0-based `step`: linear warmup, then cosine/linear/constant."""
    s, t = cfg.lr_scheduler, cfg.training.steps
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.decay_type == "constant" or t <= s.warmup_steps:
        return 1.0
    p = min(1.0, (step - s.warmup_steps) / max(1, t - s.warmup_steps - 1))
    if s.decay_type == "linear":
        return 1.0 - (1.0 - s.min_lr_ratio) * p
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipe's schedule as it stands after `step` completed steps (0: a fresh run; a resume
    passes the checkpoint's step). The schedule is a function of (recipe, step), so a resumed run
    needs no scheduler state: every group's base rate is the recipe's lr, and LambdaLR, told the
    last step taken, sets the rate of the next one."""
    for g in opt.param_groups:
        g["initial_lr"] = cfg.optimizer.lr
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg), last_epoch=step - 1)


def grad_norm(params, extra_groups=()) -> torch.Tensor:
    """Global L2 norm of all gradients, whatever mesh/placements each parameter has.

    Gradients are grouped by (mesh, placements) so each group costs one reduction; plain tensors
    are local. `extra_groups`: process groups (e.g. pipeline stages) whose squared norms add up.
    """
    groups = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups[key].append(g)
    total_sq = None
    for key, grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        if key is not None:
            n = n.full_tensor()
        sq = n.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if total_sq is None:
        total_sq = torch.zeros(())
    for pg in extra_groups:
        dist.all_reduce(total_sq, group=pg)
    return total_sq.sqrt()


def clip_grads(params, max_norm: float, total_norm: float | torch.Tensor) -> None:
    if max_norm <= 0:
        return
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
