"""Which block of a full parameter this rank holds, for any DTensor placements (FSDP, TP, both)."""
from __future__ import annotations

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_block(param) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's local tensor, its offset in the full tensor, one index per dim).

    The same computation DCP uses to place a shard in a checkpoint; the local tensor is a view
    into the parameter's storage, so writing it initialises the parameter in place.
    """
    if not hasattr(param, "device_mesh"):
        return param, (0,) * param.dim()
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"placements {param.placements} of a {tuple(param.shape)} parameter: the local shard "
                           f"is {tuple(local.shape)}, not the block {tuple(shape)} at {tuple(offset)}")
    return local, tuple(offset)
