"""Data parallelism: FSDP2 (ZeRO), HSDP and DDP, with mixed precision.

ZeRO mapping (Rajbhandari et al. 2020): FSDP2 always shards optimizer state and gradients
(ZeRO-2); `fsdp_reshard_after_forward = true` also frees the gathered parameters after each
block's forward (ZeRO-3), `false` keeps them until backward (ZeRO-2 memory, fewer all-gathers).
HSDP = replicate over dp_replicate, shard over dp_shard (x cp). DDP when only dp_replicate > 1.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchmeg.models.blocks import blocks, extra_blocks
from torchmeg.parallel.expert import is_expert_module


def mp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    if mixed_precision == "bf16":
        # bf16 compute, fp32 gradient reduction: the sum of many bf16 shards loses bits.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh, mixed_precision: str, reshard_after_forward: bool,
               expert_mesh=None, blocks_path: str = "") -> int:
    """fully_shard each block, then the root (embeddings, final norm, output); returns the number
    of FSDP units.

    expert_mesh: with expert parallelism, expert weights are already sharded over `ep`; their own
    FSDP unit shards them over the remaining `efsdp` ranks, nested inside the block's unit.
    """
    kw = dict(mesh=mesh, mp_policy=mp_policy(mixed_precision))
    units = 1
    for block in blocks(model, blocks_path) + extra_blocks(model):
        if expert_mesh is not None:
            for m in block.modules():
                if is_expert_module(m):
                    fully_shard(m, mesh=expert_mesh, mp_policy=mp_policy(mixed_precision),
                                reshard_after_forward=reshard_after_forward)
                    units += 1
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
        units += 1
    # The root's parameters are needed right at the start of backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kw)
    return units


def apply_ddp(model: nn.Module, mesh, mixed_precision: str, blocks_path: str = "") -> int:
    """Pure replication with gradient all-reduce: FSDP2 over a (dp_replicate, 1) mesh, i.e.
    parameters replicated on every rank and gradients averaged, composable with TP DTensors."""
    return apply_fsdp(model, mesh, mixed_precision, reshard_after_forward=False, blocks_path=blocks_path)


def fsdp_modules(model: nn.Module) -> list:
    """The modules fully_shard wrapped (none without FSDP)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """Free every unsharded parameter FSDP holds — the root (reshard_after_forward False) keeps its own
    after a forward, as every block does under fsdp_reshard_after_forward = false — so the next forward
    gathers the sharded values as they are now: call it after writing into the parameters in place
    between forwards (a reference model's weights swapped in and out)."""
    for m in fsdp_modules(model):
        m.reshard()
