"""From one measured step (torchmeg.plan.dry_run) to a predicted step time, MFU and fit on a GPU.

Compute: a roofline per op — each op takes max(FLOPs / peak for its dtype, bytes read+written /
HBM bandwidth) — summed over every op the rank runs (recompute included). This is a floor: real
kernels reach 60-80% of peak on large bf16 matmuls and launch gaps are not modelled, so read the
MFU as an upper bound.
Communication: each collective's bytes on the wire per rank (ring algorithms) over the link its
group spans: NVLink when all its ranks sit in one node (ranks are numbered node by node, tp
innermost), the network otherwise. FSDP's all-gathers / reduce-scatters and the context-parallel
ring are overlapped with compute (prefetch, next hop posted before the current pair); what
exceeds the compute time shows. Tensor-parallel and expert/all-to-all collectives, the pipeline's
p2p and the small reductions are on the critical path.
Pipeline: the bubble of the schedule's own action order (torchmeg.parallel.pipeline_order)
stretches the per-rank busy time.
Memory: the tracker's peak over the step plus the caching allocator's slack (fragmentation,
assumed 10%: PyTorch's caching allocator typically reserves 5-15% above live tensors) and a fixed 2 GiB for the CUDA context, NCCL
buffers and workspace; the plan fits when that is within the GPU's memory.
"""
from __future__ import annotations

from torchmeg.plan.gpus import GPU

OVERLAPPED = ("dp_shard", "dp_shard_cp", "dp_replicate", "dp", "cp", "efsdp")
ALLOCATOR_SLACK = 0.10
RUNTIME_BYTES = 2 * 2 ** 30


def compute_seconds(ops, gpu: GPU, float8: bool) -> tuple[float, float, float]:
    """(roofline time, of which compute-bound, of which memory-bound)."""
    total = flop_bound = mem_bound = 0.0
    for flops, nbytes, dtype in ops:
        if flops:
            kind = "fp8" if (float8 and dtype and "float8" in dtype) else ("fp32" if dtype == "float32" else "bf16")
            tc = flops / gpu.peak(kind)
        else:
            tc = 0.0
        tm = nbytes / gpu.hbm_bw
        total += max(tc, tm)
        if tc >= tm:
            flop_bound += tc
        else:
            mem_bound += tm
    return total, flop_bound, mem_bound


def comm_seconds(comm: dict, dims, gpu: GPU) -> dict[str, float]:
    """'mesh dim/collective' -> seconds on the wire (fast links inside a node, the network across:
    ParallelDims.group_within_node, the rule a run's header uses too)."""
    strides = dims.strides()
    out = {}
    for key, c in comm.items():
        dim = key.split("/")[0]
        # (pipeline p2p: a pair of neighbouring stages, world / pp ranks apart)
        intra = dims.group_within_node(2 if dim == "pp" else c["ranks"], strides.get(dim, 1), gpu.gpus_per_node)
        out[key] = c["wire_bytes"] / (gpu.nvlink_bw if intra else gpu.network_bw)
    return out


def predict(rank: dict, cfg, dims, gpu: GPU, model_flops_per_rank: float) -> dict:
    """Step time, MFU and memory fit for one planned rank."""
    float8 = cfg.float8.enable
    t_compute, t_flop, t_mem = compute_seconds(rank["ops"], gpu, float8)
    comm = comm_seconds(rank["comm"], dims, gpu)
    overlapped = sum(t for k, t in comm.items() if k.split("/")[0] in OVERLAPPED)
    exposed = sum(t for k, t in comm.items() if k.split("/")[0] not in OVERLAPPED)
    bubble = rank.get("pipeline", {}).get("bubble", 0.0)
    busy = t_compute + exposed
    step = busy * (1 + bubble) + max(0.0, overlapped - t_compute)
    dtype = "bf16" if cfg.training.mixed_precision == "bf16" else "fp32"
    peak = gpu.peak(dtype)
    mem = rank["memory"]["Total"]
    need = mem * (1 + ALLOCATOR_SLACK) + RUNTIME_BYTES
    return {"step_s": step, "compute_s": t_compute, "compute_flop_bound_s": t_flop, "compute_memory_bound_s": t_mem,
            "comm_exposed_s": exposed, "comm_overlapped_s": overlapped, "bubble": bubble,
            "comm_s": comm, "mfu": model_flops_per_rank / (step * peak) if step else 0.0,
            "peak_tensor_bytes": mem, "need_bytes": need, "fits": need <= gpu.hbm_bytes}
