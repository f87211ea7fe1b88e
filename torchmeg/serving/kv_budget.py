"""The KV pool sized from the memory it is given, as vLLM sizes its own: `--kv-cache-gib` (default:
90% of the GPU memory left free once the weights are loaded; 4 GiB on a CPU) in blocks of 16
positions (batching.blocks), shared by the running sequences as their tokens arrive. At most what
`--max-seqs` sequences of `--max-model-len` would fill (more could only keep finished prefixes
longer); less when the budget is less: then more sequences run than fit at their longest, and the
scheduler preempts when the blocks run out. One sequence must fit: without `--max-model-len` it is
the model's context or what the pool holds when that is less (a converted Llama-3.1 8B at 128k in
4 GiB: the header says the length it serves at); with it, a length beyond the budget fails at start
in one line naming the flags.
"""
from __future__ import annotations

import os

import torch

from torchmeg.batching.blocks import BLOCK, blocks_for, pool_blocks
from torchmeg.config.errors import ConfigError

CPU_DEFAULT_GIB = 4.0
GPU_FRACTION = 0.9


def budget_bytes(gib: float, device: torch.device) -> tuple[int, str]:
    """-> (bytes the KV cache may take on this rank, where that number comes from)."""
    # Test hook: TORCHMEG_TEST_KV_BUDGET_SCALE scales this rank's budget (a rank with less memory free).
    scale = float(os.environ.get("TORCHMEG_TEST_KV_BUDGET_SCALE", "1"))
    if gib > 0:
        return int(scale * gib * 2 ** 30), f"--kv-cache-gib {gib:g}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(scale * GPU_FRACTION * free), f"{GPU_FRACTION:.0%} of the GPU memory free after the weights"
    return int(scale * CPU_DEFAULT_GIB * 2 ** 30), f"{CPU_DEFAULT_GIB:g} GiB, the CPU default (--kv-cache-gib)"


def agreed_budget(budget: int, source: str, device: torch.device) -> tuple[int, str]:
    """TP ranks hold one cache shape (each its share of the heads at the same positions): every rank
    sizes its pool from the least budget of any rank, or a rank with less memory free would fill
    first and die mid-request while rank 0 still admits it. One all-reduce, before anything can fail."""
    import torch.distributed as dist  # (lazy: only TP serving agrees)
    t = torch.tensor([budget, -budget], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    least, most = int(t[0]), -int(t[1])
    if least == most:
        return least, source
    gib = 2 ** 30
    return least, f"{source}: the least of {dist.get_world_size()} ranks', {least / gib:.2f} to {most / gib:.2f} GiB"


def pool_size(max_seqs: int, asked: int, limit: int, per_token: int, budget: int, source: str) -> tuple[int, int, str]:
    """-> (max_len, the pool's blocks with the null block (0: a model that keeps its own cache), a note
    for the header: why max_len is not the model's context). `asked`: --max-model-len (0: as the
    budget allows); `per_token`: KV bytes one position takes on this rank."""
    if per_token <= 0:  # a model that keeps its own cache (transformers'): it grows as it goes
        return asked or limit, 0, ""
    usable = budget // (per_token * BLOCK) - 1  # (block 0 is the null block)
    gib, note = 2 ** 30, ""
    if asked:
        if blocks_for(asked) > usable:
            raise ConfigError(f"--max-model-len {asked}: one sequence's KV takes {asked * per_token / gib:.2f} GiB, the "
                              f"budget is {budget / gib:.2f} GiB ({source}); lower it or raise --kv-cache-gib")
        max_len = asked
    else:
        max_len = min(limit, usable * BLOCK)
        if max_len < 2:
            raise ConfigError(f"the KV cache budget {budget / gib:.2f} GiB ({source}) holds {max(usable, 0)} blocks "
                              f"of {BLOCK} positions ({per_token} bytes each); raise --kv-cache-gib")
        if max_len < limit:
            note = f"--max-model-len {max_len} of the model's {limit}: what the pool holds in {source}"
    return max_len, min(1 + usable, pool_blocks(max_seqs, max_len)), note
