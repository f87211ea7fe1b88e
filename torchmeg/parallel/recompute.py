"""Activation recompute (Chen et al. 2016; selective: Korthikanti et al. 2022).

full          every block's activations are recomputed in backward
selective N   every Nth block is recomputed in full
selective op  per-op: matmul and attention outputs are saved, cheap pointwise ops recomputed
selective op_half  the same, but every other matmul output recomputed too (torchtitan's per-op
              policy): less memory for one extra forward matmul in two
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchmeg.models.blocks import find_blocks


def _save_ops() -> set:
    """Ops whose outputs are worth keeping: the expensive ones (matmuls, attention on every
    backend this torch has) and collectives (re-running them costs communication)."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention", "_scaled_mm"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return ops


def _op_policy(save_ops, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _half_mm_contexts(save_ops):
    """op_half's context_fn: a fresh matmul count per checkpointed call, kept apart for the forward
    and its recompute so both make the same choice for the same matmul."""
    count = {False: 0, True: 0}
    mm = torch.ops.aten.mm.default

    def policy(ctx, op, *args, **kwargs):
        if op is mm:
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _op_policy(save_ops, ctx, op)
    return create_selective_checkpoint_contexts(policy)


@contextlib.contextmanager
def _stats_off(modules: list[nn.Module]):
    """While backward replays a block's forward, modules that record statistics in their forward
    (MoE's routed-token counts: `record_stats`) must not record them a second time."""
    for m in modules:
        m.record_stats = False
    try:
        yield
    finally:
        for m in modules:
            m.record_stats = True


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _contexts(selective_ctx, recorders: list[nn.Module]):
    """checkpoint's context_fn: (forward context, recompute context); entered later by checkpoint."""
    fwd, rec = selective_ctx() if selective_ctx is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return fwd, _both(rec, _stats_off(recorders))


def _wrap(block: nn.Module, selective_op: str | None) -> nn.Module:
    sac = {None: None, "op": partial(create_selective_checkpoint_contexts, partial(_op_policy, _save_ops())),
           "op_half": partial(_half_mm_contexts, _save_ops())}[selective_op]
    recorders = [m for m in block.modules() if hasattr(m, "record_stats")]
    if recorders:  # a custom context only where needed: dense blocks keep the plain (compile-traceable) path
        return checkpoint_wrapper(block, context_fn=partial(_contexts, sac, recorders), preserve_rng_state=False)
    if sac is not None:
        return checkpoint_wrapper(block, context_fn=sac, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_recompute(model: nn.Module, ac_cfg, blocks_path: str = "") -> int:
    """Wrap blocks for recompute in place; returns how many were wrapped."""
    _, layers = find_blocks(model, blocks_path)
    if layers is None:
        raise ValueError(f"activation_checkpoint.mode = {ac_cfg.mode!r}: no blocks found to recompute (no "
                         f"ModuleList / ModuleDict / Sequential of layers in the model); name them with "
                         f"model.blocks / parallelize(blocks=...)")
    selective_op = ac_cfg.selective_option if ac_cfg.mode == "selective" and ac_cfg.selective_option in (
        "op", "op_half") else None
    wrapped = 0
    for i, (name, block) in enumerate(list(layers.named_children())):
        if recomputed(name, i, ac_cfg):
            layers.register_module(name, _wrap(block, selective_op))
            wrapped += 1
    return wrapped


def recomputed(name: str, i: int, ac_cfg) -> bool:
    """Whether block `name` (the i-th of its container) is wrapped for recompute. Counted by the
    model's own layer number where it has one, so a pipeline stage holding layers 4..7 (or a plan
    tracing a few of the layers) recomputes the same layers as the whole model would."""
    if ac_cfg.mode == "none":
        return False
    every = ac_cfg.selective_option if ac_cfg.mode == "selective" and isinstance(ac_cfg.selective_option, int) else 1
    n = int(name) if name.isdigit() else i
    return (n + 1) % every == 0
