"""Optimizer, LR schedule and gradient-norm clipping that is correct over DTensors."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from torchmeg.config.checks import decay_steps


KINDS = ("matrices", "embeddings", "head", "norms", "biases", "adapters")


def parameter_kinds(model: nn.Module, head: str) -> dict[str, list]:
    """The trainable parameters by kind, each once (a tied head is the embedding): embeddings (nn.Embedding
    weights), head (the top-level module `head`), adapters (LoRA's A and B), biases (a module's `bias_names`
    too: grouped experts' per-expert biases), norms (every other 1-D weight) and matrices (the rest: the hidden Linears, experts, routers)."""
    kinds, seen = {k: [] for k in KINDS}, set()
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(mod, nn.Embedding):
                kind = "embeddings"
            elif mname == head:
                kind = "head"
            elif mname.endswith("_lora") or "_lora." in mname:
                kind = "adapters"
            elif pname.endswith("bias") or pname in getattr(mod, "bias_names", ()):  # (grouped experts' b1 .. b3: 2-D)
                kind = "biases"
            elif p.ndim < 2:
                kind = "norms"
            else:
                kind = "matrices"
            kinds[kind].append(p)
    return kinds


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The recipe's optimizer over the model's trainable parameters, grouped by kind: kinds in
    optimizer.weight_decay_exempt never decay; under muon the matrices take Muon's update and every
    other kind AdamW's. `opt.torchmeg_groups` says which kinds went where (the run header's line)."""
    o = cfg.optimizer
    kinds = parameter_kinds(model, _head_name(cfg))
    exempt = set(o.weight_decay_exempt)
    in_out = _in_out_ids(model) if o.name == "muon" else set()
    groups, desc = [], []
    for algorithm, members in _partition(o.name, kinds):
        for decays in (True, False):
            names = [k for k in members if kinds[k] and (k not in exempt) == decays]
            params = [p for k in names for p in kinds[k]]
            if not params:
                continue
            g = {"params": params, "weight_decay": o.weight_decay if decays else 0.0}
            if o.name == "muon":
                g.update(algorithm=algorithm, base_lr=(o.muon_lr or o.lr) if algorithm == "muon" else o.lr)
            groups += _split_in_out(g, in_out) if algorithm == "muon" else [g]
            desc.append((algorithm, decays, names, sum(p.numel() for p in params)))
    if o.name == "sgd":
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.betas[0])
    elif o.name == "muon" or o.state_dtype != "float32":
        from torchmeg.train.muon import MuonWithAdamW  # lazy: only muon / low-precision-state runs use it
        opt = MuonWithAdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, ns_dtype=o.muon_ns_dtype,
                            adjust_lr=o.muon_adjust_lr, state_dtype=o.state_dtype, adam=o.name == "adam")
    else:
        cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
        opt = cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    opt.torchmeg_groups = desc
    return opt


def _in_out_ids(model: nn.Module) -> set[int]:
    """Muon's rate depends on which side of a matrix is its output: torchmeg's grouped experts store
    [experts, in, out]; Linear weights and transformers' experts [.., out, in]."""
    from torchmeg.models.moe import is_grouped_experts  # lazy: only muon runs ask
    return {id(p) for m in model.modules() if is_grouped_experts(m) for p in m.parameters(recurse=False)}


def _split_in_out(group: dict, in_out: set[int]) -> list[dict]:
    """`group` split into its [.., out, in] matrices and its `in_out` ones (a group with in_out=True)."""
    split = [dict(group, params=[p for p in group["params"] if (id(p) in in_out) == flag]) for flag in (False, True)]
    split[1]["in_out"] = True
    return [g for g in split if g["params"]]


def _head_name(cfg) -> str:
    from torchmeg.models.spec import get_spec  # lazy: the registry imports every model module
    return get_spec(cfg.model.name).head


def _partition(name: str, kinds: dict) -> list[tuple[str, list[str]]]:
    if name == "muon":
        return [("muon", ["matrices"]), ("adamw", [k for k in KINDS if k != "matrices"])]
    return [(name, list(KINDS))]


def describe_groups(opt, cfg) -> str:
    """'muon matrices 2.95M (wd 0.1); adamw embeddings, head 0.16M (wd 0.1); adamw norms 2.3K (wd 0)' — what
    each update rule trains and what decays, from the groups build_optimizer made."""
    parts = []
    for algorithm, decays, names, n in getattr(opt, "torchmeg_groups", []):
        wd = cfg.optimizer.weight_decay if decays else 0.0
        size = f"{n / 1e6:.2f}M" if n >= 10 ** 5 else f"{n / 1e3:.1f}K"
        parts.append(f"{algorithm} {', '.join(names)} {size} (wd {wd:g})")
    dtype = "" if cfg.optimizer.state_dtype == "float32" else f"; states in {cfg.optimizer.state_dtype}"
    return "; ".join(parts) + dtype


def lr_factor(step: int, cfg) -> float:
    """Multiplier of the base rate for 0-based `step`: linear warmup, then a decay to min_lr_ratio over
    every later step, or (warmup-stable-decay) the peak held until the last `decay_steps` steps, which
    decay. The factor depends on (recipe, step) alone, so a run resumed from a stable-phase checkpoint
    with another training.steps / decay length decays as the new recipe says."""
    s, t = cfg.lr_scheduler, cfg.training.steps
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.decay_type == "constant" or t <= s.warmup_steps:
        return 1.0
    wsd = decay_steps(cfg)
    if wsd is None:
        p = min(1.0, (step - s.warmup_steps) / max(1, t - s.warmup_steps - 1))
    elif step < t - wsd:
        return 1.0
    else:
        p = min(1.0, (step - (t - wsd) + 1) / wsd)
    if s.decay_type == "linear":
        shape = 1.0 - p
    elif s.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(p)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * p))
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * shape


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipe's schedule as it stands after `step` completed steps (0: a fresh run; a resume
    passes the checkpoint's step). The schedule is a function of (recipe, step), so a resumed run
    needs no scheduler state: every group's base rate is the recipe's (optimizer.lr; Muon's matrices
    optimizer.muon_lr), and LambdaLR, told the last step taken, sets the rate of the next one."""
    for g in opt.param_groups:
        g["initial_lr"] = g.get("base_lr", cfg.optimizer.lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg), last_epoch=step - 1)


def reduce_partial_grads(params) -> list:
    """Settle every gradient DTensor left as a partial sum onto its parameter's placements, once per step,
    in one all-reduce per (mesh, placements, dtype) bucket; returns `params`.

    Under sequence parallel a weight replicated over the tensor-parallel ranks (a norm's, a router's)
    meets sharded activations, so autograd leaves its gradient Partial. Left so, every later op that
    needs its value redistributes it again: the grad norm once, AdamW's lerp_ and addcmul_ (twice: both
    operands) each step, clipping too, one blocking all-reduce a call (a TP 2 moe_debug step made 90
    where 2 carry data; each waits for the slower rank). A sum over a mesh dim becomes an in-place
    all-reduce of the bucket's flat local buffer on that dim's group (elementwise, so flattening is
    exact); a partial dim that should end sharded, or a reduction other than sum, redistributes that
    gradient alone. FSDP2's own reduce-scatter settles the gradients it manages before this sees them."""
    buckets = defaultdict(list)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            buckets[(g.device_mesh, tuple(g.placements), tuple(p.placements), g.dtype)].append(p)
    for (mesh, have, want, _), ps in buckets.items():
        if not all(h.is_replicate() or h == w or (h.is_partial() and h.reduce_op == "sum" and w.is_replicate())
                   for h, w in zip(have, want)):
            for p in ps:
                p.grad = p.grad.redistribute(mesh, want)
            continue
        local = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, h in enumerate(have):
            if h.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        settled = tuple(Replicate() if h.is_partial() else h for h in have)
        for p, t, piece in zip(ps, local, flat.split([t.numel() for t in local])):
            shape = p.grad.shape  # (global; the bucket's pieces are contiguous, so is the settled gradient)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            p.grad = DTensor.from_local(piece.view(t.shape), mesh, settled, run_check=False, shape=shape, stride=stride)
    return params


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
