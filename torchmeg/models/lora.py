"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen
Linear W gains a trainable low-rank update, h = W x + s · B A dropout(x), A [r, in] and B [out, r],
s = alpha / r (PEFT's default) or alpha / sqrt(r) (rsLoRA, Kalajdzievski 2023: PEFT's `use_rslora`);
B starts at zero, so the adapted model starts as the base model.

Plain single-device PyTorch, as every model file. The adapter of module `...wq` is a sibling module
`...wq_lora` (`A`, `B`: nn.Linear without bias) whose output a forward hook adds to the base Linear's:
the base keeps its own name, weights and TP role, and a tensor-parallel style that shards the base
(which acts on the module's own parameters, recursively) never touches the adapter; the parallel code
shards A and B to match the base's role (the tensor-parallel pass). PEFT names the same tensors
`<module>.lora_A.weight` / `<module>.lora_B.weight` (torchmeg.checkpoint.lora_export).

Initialisation as PEFT's `init_lora_weights`: `True` (PEFT's default) draws A as nn.Linear's own
default init does, kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); "gaussian" draws
A ~ N(0, 1/r); B = 0 either way (`init_rule` below, applied by torchmeg.models.init from (seed, name)
like every parameter, so every layout draws one process's values).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from torchmeg.models.blocks import canonical_fqn, fqn_matches

SUFFIX = "_lora"
ALL_LINEAR = "all-linear"
_ROUTERS = ("router", "gate")  # MoE routers: Linear layers that all-linear leaves alone


class InputDropout(nn.Module):
    """The adapter's input dropout (PEFT's `lora_dropout`, an nn.Dropout) spelled out as ATen computes
    it on a CPU (`_dropout_impl`: noise of x's shape drawn Bernoulli(1 - p) from the default generator,
    divided by 1 - p, times x), bit for bit nn.Dropout's there, so that where x is a shard of a
    tensor-parallel input the same noise can be drawn whole and this rank's part kept: the masks one
    process draws (torchmeg.parallel.lora_dropout). (On CUDA nn.Dropout runs a fused kernel with
    other draws: the same distribution, not the same numbers.)"""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def noise(self, shape, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - self.p).div_(1 - self.p)

    def forward(self, x):
        return x * self.noise(x.shape, x) if self.training else x

    def extra_repr(self) -> str:
        return f"p={self.p}"


def scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """The update's factor s (PEFT's `scaling`): alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False, init: bool | str = True):
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        self.dropout = InputDropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha, self.scale = rank, alpha, scaling(rank, alpha, use_rslora)
        self.init = init  # PEFT's init_lora_weights: True (kaiming-uniform A) or "gaussian"
        self.enabled = True  # (adapters_off: the base model's forward)

    def forward(self, x):
        return self.B(self.A(self.dropout(x))) * self.scale


def _add_update(module, args, out):
    """The base Linear's forward hook. The adapter is found through the module at each call (a plain
    attribute, not a submodule), so a copy of the model (a pipeline stage) uses its own adapter."""
    if not module.lora_adapter.enabled:
        return out
    return out + module.lora_adapter(args[0])


class adapters_off:
    """The base model for the block: every adapter's update left out (PEFT's `disable_adapter()`, the
    reference TRL's trainers use under PEFT: no copy of any weight)."""

    def __init__(self, model: nn.Module):
        self.mods = [m for m in model.modules() if isinstance(m, LoRA)]

    def __enter__(self):
        for m in self.mods:
            m.enabled = False

    def __exit__(self, *exc):
        for m in self.mods:
            m.enabled = True


def targets(model: nn.Module, patterns: list[str], block_root: str) -> list[str]:
    """FQNs of the nn.Linear modules `patterns` select: module patterns ('*' one name, as TP plans),
    or "all-linear": every Linear inside the repeated blocks (under `block_root`) but MoE routers, as
    PEFT's all-linear leaves the output head."""
    out = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or is_adapter_module(fqn):
            continue
        leaf = fqn.rsplit(".", 1)[-1]
        for p in patterns:
            if (p == ALL_LINEAR and block_root and fqn.startswith(block_root + ".") and leaf not in _ROUTERS) \
                    or (p != ALL_LINEAR and fqn_matches(p, fqn)):
                out.append(fqn)
                break
    return out


def attach(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float, use_rslora: bool = False,
           init: bool | str = True) -> None:
    """An adapter beside each named Linear, every other parameter frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    for fqn in names:
        base = model.get_submodule(fqn)
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lora = LoRA(base.in_features, base.out_features, rank, alpha, dropout, use_rslora, init).to(base.weight.device)
        parent.add_module(leaf + SUFFIX, lora)
        object.__setattr__(base, "lora_adapter", lora)  # not registered: the base's own parameters stay its own
        base.register_forward_hook(_add_update)


def adapters(model: nn.Module) -> dict[str, LoRA]:
    """{base module FQN: its adapter} (wrapper components of compile / recompute / FSDP removed)."""
    return {canonical_fqn(fqn)[:-len(SUFFIX)]: m for fqn, m in model.named_modules() if isinstance(m, LoRA)}


def is_adapter_module(fqn: str) -> bool:
    """An adapter or a module inside one (never a target itself)."""
    return fqn.endswith(SUFFIX) or f"{SUFFIX}." in fqn


def adapted_module(fqn: str) -> str:
    """The base module an adapter tensor belongs to ('layers.0.attention.wq_lora.A.weight' ->
    'layers.0.attention.wq')."""
    return fqn.split(SUFFIX + ".")[0]


def is_adapter(fqn: str) -> bool:
    return f"{SUFFIX}.A." in fqn or f"{SUFFIX}.B." in fqn


def init_rule(model: nn.Module, name: str, fqn: str, shape) -> tuple | None:
    """An adapter weight's init, as PEFT's `init_lora_weights` of its adapter: ("uniform", bound) for A
    under True (kaiming-uniform, a = sqrt(5): bound 1/sqrt(in)), ("normal", 1/r) for A under "gaussian",
    ("zero",) for B; None for other parameters. `name`: the parameter's name in `model` (wrappers
    included), `fqn` its canonical name."""
    if fqn.endswith(f"{SUFFIX}.B.weight"):
        return ("zero",)
    if not fqn.endswith(f"{SUFFIX}.A.weight"):
        return None
    adapter = model.get_submodule(name.rsplit(".", 2)[0])
    if adapter.init == "gaussian":
        return ("normal", 1.0 / shape[0])
    return ("uniform", 1.0 / math.sqrt(shape[1]))
