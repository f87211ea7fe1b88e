"""The KV cache sized from the memory it is given, as vLLM sizes its own: `--kv-cache-gib` (default:
90% of the GPU memory left free once the weights are loaded; 4 GiB on a CPU), divided among
`--max-seqs` slots. Without `--max-model-len` a slot holds what the budget allows, at most the
model's context (a converted Llama-3.1 8B at 128k would need 512 GiB at 32 slots: it serves at the
length that fits, and the header says so); with it, a size beyond the budget fails at start in one
line naming the flags.
"""
from __future__ import annotations

import os

import torch

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
    sizes its slots from the least budget of any rank, or a rank with less memory free would fill
    first and die mid-request while rank 0 still admits it. One all-reduce, before anything can fail."""
    import torch.distributed as dist  # (lazy: only TP serving agrees)
    t = torch.tensor([budget, -budget], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    least, most = int(t[0]), -int(t[1])
    if least == most:
        return least, source
    gib = 2 ** 30
    return least, f"{source}: the least of {dist.get_world_size()} ranks', {least / gib:.2f} to {most / gib:.2f} GiB"


def slot_length(max_seqs: int, asked: int, limit: int, per_token: int, budget: int, source: str) -> tuple[int, str]:
    """Positions per slot -> (max_len, a note for the header: why it is not the model's context).
    `asked`: --max-model-len (0: as the budget allows); `per_token`: KV bytes one position takes."""
    if per_token <= 0:  # a model that keeps its own cache (transformers'): it grows as it goes
        return asked or limit, ""
    fits = budget // (max_seqs * per_token)
    gib = 2 ** 30
    if asked:
        if asked > fits:
            raise ConfigError(f"--max-seqs {max_seqs} x --max-model-len {asked}: the KV cache needs "
                              f"{max_seqs * asked * per_token / gib:.2f} GiB, the budget is {budget / gib:.2f} GiB "
                              f"({source}); lower either or raise --kv-cache-gib")
        return asked, ""
    if fits < 2:
        raise ConfigError(f"--max-seqs {max_seqs}: the KV cache budget {budget / gib:.2f} GiB ({source}) holds "
                          f"{fits} positions per slot ({per_token} bytes each); lower --max-seqs or raise --kv-cache-gib")
    if fits < limit:
        return fits, f"--max-model-len {fits} of the model's {limit}: what {max_seqs} slots hold in {source}"
    return limit, ""
