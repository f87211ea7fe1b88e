"""Tensor and sequence parallelism from a plan given as data.

A plan is a list of (FQN pattern, role); '*' matches one path component. Roles:
  embedding            vocab-sharded nn.Embedding (torchmeg.parallel.vocab_embedding: each rank's
                       gradient for its own rows); output sequence-sharded (SP) or replicated
  embedding_replicate  vocab-sharded nn.Embedding with a replicated output (e.g. positions are
                       added after it)
  sp_enter             a module whose replicated input should become sequence-sharded (SP only)
  sp_norm              a norm run on sequence shards (SP only; Korthikanti et al. 2022, sec. 4.2.2)
  sp_norm_local        sp_norm with a plain local output shard (models that add norm outputs to the
                       residual stream, e.g. Gemma's post-norms; any module applied to each position
                       alone with replicated weights, e.g. DeepSeek-V3's MTP eh_proj)
  sp_input             a module (attention, MLP) whose first input is sequence-sharded and must be
                       all-gathered before its column-parallel projections (SP only)
  sp_input_local       sp_input with the gathered input as a plain tensor (a module whose replicated
                       layers take no DTensor: MLA's down-projections); its gradient must be whole
                       on every rank, which column-parallel consumers and head_shared make it
  head_shared          an identity on a tensor every head reads (MLA's rotary key): each rank's heads
                       give part of its gradient, summed over tp in backward (no forward traffic)
  head_shared_tail:N   a replicated module whose output's last N features every head reads (MLA's
                       joint KV down-projection, transformers' `mla_kv_a_proj`): head_shared on them
  sp_replicated        a module computed whole on every TP rank: input gathered, output re-sharded
                       (SP only)
  experts_over_tp      a MoE layer on this rank's sequence shard (SP only): router and shared experts
                       replicated, their gradients summed over tp (each rank routes other tokens), the
                       balance losses' token statistics summed over tp; the routed experts are spread
                       over the tp ranks by expert parallel (torchmeg.parallel.expert)
  head_sharded         a module holding one parameter entry per query head (gpt-oss's sinks): each
                       rank gets its heads' entries, read as a plain tensor
  colwise / rowwise    Megatron column / row parallel nn.Linear (Shoeybi et al. 2019, eq. 3 and 4)
  output               column-parallel LM head: vocab-sharded logits for loss_parallel, else gathered
  replicate_grad_allreduce
                       a module with replicated weights applied to head-sharded activations (Qwen3's
                       per-head q/k norms after column-parallel projections): each TP rank's weight
                       gradient covers its heads only, so gradients are summed over the TP group
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchmeg.parallel.expert import sum_over_shards
from torchmeg.parallel.lora_dropout import draw_whole
from torchmeg.parallel.float8 import is_float8_linear
from torchmeg.parallel.vocab_embedding import VocabParallelEmbedding, takes_vocab_parallel
from torchmeg.models import lora
from torchmeg.models.blocks import fqn_matches
from torchmeg.models.tying import get_param_owner, retie, tied_pairs

ROLES = ("embedding", "embedding_replicate", "sp_enter", "sp_norm", "sp_norm_local", "sp_input", "sp_input_local",
         "sp_replicated", "experts_over_tp", "colwise", "rowwise", "output", "replicate_grad_allreduce",
         "head_shared", "head_sharded")


def _tail_features(role: str) -> int:
    """N of a head_shared_tail:N role (a positive count of features); 0 for any other role."""
    kind, _, n = role.partition(":")
    return int(n) if kind == "head_shared_tail" and n.isdigit() else 0


def _n_positional(module: nn.Module) -> int:
    sig = inspect.signature(module.forward)
    return sum(1 for p in sig.parameters.values()
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def _takes_kwargs(module: nn.Module) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(module.forward).parameters.values())


def _local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor as a plain tensor (a replicated one: its whole value)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _GatherFirstInput(ParallelStyle):
    """sp_input for modules that may receive their input by keyword (Hugging Face decoder layers call
    `self.self_attn(hidden_states=...)`), which PrepareModuleInput's positional layouts cannot see:
    the first input, positional or by its name, goes from sequence shards to replicated."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def pre_hook(mod, args, kwargs):
            if args:
                args = (gather(args[0]),) + tuple(args[1:])
            elif first in kwargs:
                kwargs = dict(kwargs, **{first: gather(kwargs[first])})
            return args, kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


class _ReplicateGradAllReduce(ParallelStyle):
    """Weights replicated over TP as DTensors; the (head-sharded, plain) input enters as a DTensor
    sharded on its leading dim, so autograd sees each rank's weight gradient as a partial sum and
    reduces it over the group. The module must be elementwise over its input's leading dims (a norm
    over the last dim is); the output leaves as the plain local tensor it came in as."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Shard(0),), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(module, device_mesh, input_fn=input_fn,
                                 output_fn=lambda mod, out, mesh: _local_part(out))


class _ExpertsOverTP(ParallelStyle):
    """experts_over_tp (see the module docstring). The router and shared experts are per-token maps,
    so _ReplicateGradAllReduce applies to them with the flattened tokens as its leading dim."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in ("router", "shared"):
            if getattr(module, name, None) is not None:
                _ReplicateGradAllReduce()._apply(getattr(module, name), device_mesh)
        sum_over_shards(module, device_mesh.get_group(), sum_grads=False)
        # (the sequence-parallel norm before it hands a DTensor sequence shard: its local part)
        module.register_forward_pre_hook(lambda mod, args: tuple(a.to_local() if isinstance(a, DTensor) else a
                                                                 for a in args))
        return module


class _ShardHeads(ParallelStyle):
    """head_sharded: the module's parameters sharded on dim 0 (heads), its output this rank's part."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for key, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]), p.requires_grad))

        return distribute_module(module, device_mesh, partition_fn=partition,
                                 output_fn=lambda mod, out, mesh: _local_part(out))


def _grad_summed(x: torch.Tensor, device_mesh) -> torch.Tensor:
    """x unchanged; in backward its gradient, a partial sum on each rank, is summed over the group
    (to_local's grad_placements mark it Partial; from_local's backward reduces it)."""
    return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class _SumGradOverTP(ParallelStyle):
    """head_shared: forward unchanged; the input's gradient is summed over the group."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_pre_hook(lambda mod, args: (_grad_summed(args[0], device_mesh),) + tuple(args[1:]))
        return module


class _SumTailGradOverTP(ParallelStyle):
    """head_shared_tail:N: a replicated module whose output's last N features every head reads
    (MLA's kv_a_proj_with_mqa: [compressed KV | rotary key], transformers' `mla_kv_a_proj`). The
    compressed part feeds a column-parallel projection, whose input gradient is already whole on
    every rank; the rotary key's gradient comes from this rank's heads only and is summed over tp."""

    def __init__(self, tail: int):
        super().__init__()
        self.tail = tail

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(mod, args, out):
            head, tail = out.split([out.shape[-1] - self.tail, self.tail], dim=-1)
            return torch.cat([head, _grad_summed(tail, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module


def _float8_styles():
    # lazy: torchao is imported only where float8 is on (its import costs ~1 s and registers pytree nodes)
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def style_for(role: str, module: nn.Module, sp: bool, loss_parallel: bool, float8_tp: bool = False):
    """The DTensor ParallelStyle for a role, or None where the role is a no-op in this setting.

    float8_tp: the model holds tensorwise Float8Linear layers; use torchao's styles, which cast to
    float8 before the all-gather so the collective moves half the bytes.
    """
    seq = Shard(1) if sp else Replicate()
    f8 = False
    if float8_tp:
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        f8 = bool(linears) and all(is_float8_linear(m) for m in linears)
    Col, Row, Prep = _float8_styles() if f8 else (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    if role == "colwise":
        return Col()
    if role == "rowwise":
        return Row(output_layouts=seq)
    if role == "replicate_grad_allreduce":
        return _ReplicateGradAllReduce()
    if role == "head_shared":
        return _SumGradOverTP()
    if _tail_features(role):
        return _SumTailGradOverTP(_tail_features(role))
    if role == "head_sharded":
        return _ShardHeads()
    if role == "sp_input_local" and sp:
        rest = (None,) * (_n_positional(module) - 1)
        return Prep(input_layouts=(Shard(1),) + rest, desired_input_layouts=(Replicate(),) + rest,
                    use_local_output=True)
    if role == "sp_input" and sp and not f8 and _takes_kwargs(module):
        return _GatherFirstInput()
    if role == "sp_input" and sp:
        rest = (None,) * (_n_positional(module) - 1)
        return Prep(input_layouts=(Shard(1),) + rest, desired_input_layouts=(Replicate(),) + rest)
    if role in ("embedding", "embedding_replicate"):
        # torchmeg.parallel.vocab_embedding: each rank's gradient only for its own rows
        Emb = VocabParallelEmbedding if takes_vocab_parallel(module) else RowwiseParallel
        return Emb(input_layouts=Replicate(), output_layouts=seq if role == "embedding" else Replicate())
    if role == "output":
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if not sp:
        return None
    if role == "sp_replicated":
        # Whole-sequence module run redundantly on every TP rank (e.g. MoE experts, parallelised by EP).
        return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True)
    if role == "experts_over_tp":
        return _ExpertsOverTP()
    if role == "sp_norm":
        return SequenceParallel()
    if role == "sp_norm_local":
        return SequenceParallel(use_local_output=True)
    if role == "sp_enter":
        rest = (None,) * (_n_positional(module) - 1)
        # Local output: the block's residual stream must be a plain shard like its sublayers' outputs.
        return PrepareModuleInput(input_layouts=(Replicate(),) + rest, desired_input_layouts=(Shard(1),) + rest,
                                  use_local_output=True)
    raise ValueError(f"unknown TP role {role!r}; known roles: {', '.join(ROLES)}")


def expand_plan(model: nn.Module, plan, sp: bool, loss_parallel: bool, float8_tp: bool = False,
                matched: dict | None = None) -> dict:
    """Pattern plan -> {module FQN: ParallelStyle} for the modules this (stage) model has.
    `matched`, if given, receives {pattern: number of modules it matched}."""
    out = {}
    for pattern, role in plan:
        if role not in ROLES and not _tail_features(role):
            raise ValueError(f"TP plan entry {pattern!r}: unknown role {role!r}; known roles: {', '.join(ROLES)}, "
                             f"head_shared_tail:N")
        n = 0
        for fqn, mod in model.named_modules():
            if fqn and mod is not None and fqn_matches(pattern, fqn):
                n += 1
                style = style_for(role, mod, sp, loss_parallel, float8_tp)
                if style is not None:
                    out[fqn] = style
        if matched is not None:
            matched[pattern] = matched.get(pattern, 0) + n
    return out


def unmatched_patterns(matched: dict, strict: bool) -> list[str]:
    """Plan patterns that matched no module; with `strict` (a plan written for this model, applied
    to all of it: a pipeline stage legitimately lacks other stages' modules) the first is an error."""
    missing = [pat for pat, n in matched.items() if n == 0]
    if missing and strict:
        raise ValueError(f"TP plan entry {missing[0]!r} matches no module of the model; fix the pattern "
                         f"('*' matches one path component) or drop the entry")
    return missing


def apply_tp(model: nn.Module, tp_mesh, plan, sp: bool, loss_parallel: bool, float8_tp: bool = False) -> dict:
    """Shard `model` in place over `tp_mesh` following `plan`; tied weights stay tied. Returns
    {pattern: modules matched}."""
    tied = tied_pairs(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # (LoRA's base)
    matched: dict = {}
    styles = expand_plan(model, plan, sp, loss_parallel, float8_tp, matched)
    parallelize_module(model, tp_mesh, styles)
    shard_adapters(model, tp_mesh, styles)
    for m in model.modules():  # a model reading tensors outside its modules' forwards (MLA's cached attention)
        if hasattr(m, "tp_local"):
            m.tp_local = _local_part
    for n, p in model.named_parameters():  # SequenceParallel's replicated weights come back trainable
        if n in frozen:
            p.requires_grad_(False)
    # parallelize_module replaces each module's parameter separately; re-tie when both sides
    # ended up with the same sharding (embedding rows and output rows are both Shard(0)).
    for src, dst in tied:
        a, b = (getattr(*get_param_owner(model, fqn)) for fqn in (src, dst))
        if getattr(a, "placements", None) != getattr(b, "placements", None):
            raise ValueError(f"tied parameters {src} and {dst} got different TP shardings; untie them or "
                             f"give both the same plan role")
    retie(model, tied)
    return matched


def shard_adapters(model: nn.Module, tp_mesh, styles: dict) -> None:
    """LoRA adapters (torchmeg.models.lora) follow their base Linear's role, their update added to the
    base's output before the style's output hook: a column-parallel base (output sharded by rows of W):
    A replicated, B sharded by its output rows; a row-parallel base (input sharded): A sharded by its
    input columns, its output a partial sum reduced with the base's, B replicated. A base TP leaves
    whole keeps plain adapters. Their dropout draws the whole input's noise and keeps this rank's
    part (torchmeg.parallel.lora_dropout): the masks of one process."""
    for base, adapter in lora.adapters(model).items():
        style = styles.get(base)
        if style is None:
            continue
        if isinstance(style, ColwiseParallel):
            placements = (Replicate(), Shard(0))
        elif isinstance(style, RowwiseParallel):
            placements = (Shard(1), Replicate())
        else:
            raise ValueError(f"LoRA on {base}: its TP role is not colwise / rowwise; leave it out of "
                             f"lora.target_modules")
        for linear, placement in zip((adapter.A, adapter.B), placements):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight, tp_mesh, [placement]), requires_grad=True)
        draw_whole(adapter)  # its dropout's masks: one process's (parallel.lora_dropout)
