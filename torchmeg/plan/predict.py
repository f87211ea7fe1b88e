"""From one measured step (torchmeg.plan.dry_run) to a step time, MFU and fit on a GPU, twice:

upper bound  a roofline per op: each op takes max(FLOPs / peak for its dtype, bytes read+written /
             HBM bandwidth), summed over every op the rank runs (recompute included), links at
             their data-sheet rate. No GPU runs that fast: read its MFU as a ceiling.
predicted    the same sum with each op class at the fraction of peak it is measured to reach
             (torchmeg.plan.efficiency: matmuls at MAMF, attention at FlashAttention-2's, memory-bound
             ops at a device copy's bandwidth, links at NCCL's), causal attention at half its FLOPs,
             and under torch.compile the memory-bound ops fused (torchmeg.plan.op_fusion): each
             moves only what crosses its fused group's boundary; then the compute time over one end-to-end factor
             for what kernel benchmarks do not show, measured on a published run (END_TO_END).
             With a calibration (torchmeg.plan.calibrated: the device measured by --calibrate; --device cpu
             is this machine) each op is priced from what that device measured instead, plus its host cost,
             collectives from the measured tables and FSDP's overlap as measured: no efficiency, no factor.
Communication: each collective's bytes on the wire per rank (ring algorithms) over the link its
group spans: NVLink when all its ranks sit in one node (ranks are numbered node by node, tp
innermost), the network otherwise. FSDP's all-gathers / reduce-scatters and the context-parallel
ring are overlapped with compute (prefetch, next hop posted before the current pair); what
exceeds the compute time shows. Tensor-parallel and expert/all-to-all collectives, the pipeline's
p2p and the small reductions are on the critical path; under async TP the TP gathers and
reduce-scatters that torch's pass fuses with a matmul run inside it (async_tp_exposed), the others
stay exposed (fused_fractions). Each collective's exposed
seconds: `predicted_comm_exposed_by`.
Pipeline: the bubble of the schedule's own action order (torchmeg.parallel.pipeline_order)
stretches the per-rank busy time; the reductions of the step's scalars over the stages and the
data-parallel ranks (the loss, the gradient norm: AFTER_SCHEDULE) run once after it, unstretched.
Memory: the tracker's peak over the step plus the caching allocator's slack (fragmentation,
assumed 10%: PyTorch's caching allocator typically reserves 5-15% above live tensors) and a fixed 2 GiB for the CUDA context, NCCL
buffers and workspace; the plan fits when that is within the GPU's memory.
"""
from __future__ import annotations

from torchmeg.plan.efficiency import END_TO_END
from torchmeg.plan.gpus import GPU

OVERLAPPED = ("dp_shard", "dp_shard_cp", "dp_replicate", "dp", "cp", "efsdp")
AFTER_SCHEDULE = ("pp", "dp_cp")
ALLOCATOR_SLACK = 0.10
RUNTIME_BYTES = 2 * 2 ** 30


def compute_seconds(ops, gpu: GPU, float8: bool, compiled: bool = False) -> tuple[float, float, float]:
    """(roofline time, of which compute-bound, of which memory-bound); compiled: fused bytes."""
    total = flop_bound = mem_bound = 0.0
    for flops, nbytes, dtype, kind, fused, _ in ops:
        if compiled and kind == "memory":
            nbytes = fused
        tm = nbytes / gpu.hbm_bw
        if not flops:  # bytes alone: linear in them (a sampled plan's correction op may be negative: depth.combine_ops)
            total += tm
            mem_bound += tm
            continue
        tc = flops / gpu.peak(_kind(dtype, float8))
        total += max(tc, tm)
        if tc >= tm:
            flop_bound += tc
        else:
            mem_bound += tm
    return total, flop_bound, mem_bound


def predicted_compute_seconds(ops, gpu: GPU, float8: bool, compiled: bool) -> dict[str, float]:
    """Seconds per op class at the measured efficiencies (see the module doc)."""
    eff = gpu.efficiency
    bw = gpu.hbm_bw * eff.memory
    out = {"matmul": 0.0, "attention": 0.0, "memory": 0.0}
    for flops, nbytes, dtype, kind, fused, _ in ops:
        if kind == "memory":
            out["memory"] += (fused if compiled else nbytes) / bw
        elif kind.startswith("attention"):
            work = flops / 2 if kind.startswith("attention_causal") else flops
            out["attention"] += max(work / (gpu.peak("bf16") * eff.attention), nbytes / bw)
        else:
            k = _kind(dtype, float8)
            if k == "fp8" and not gpu.fp8_flops:
                k = "bf16"
            out["matmul"] += max(flops / (gpu.peak(k) * eff.matmul(k)), nbytes / bw)
    return out


def _kind(dtype, float8: bool) -> str:
    return "fp8" if (float8 and dtype and "float8" in dtype) else ("fp32" if dtype == "float32" else "bf16")


ASYNC_TP = ("tp/all_gather", "tp/reduce_scatter")


def async_tp_exposed(t_comm: float, t_matmul: float, tp: int) -> float:
    """Async TP (torch's micro-pipelined collective matmuls) splits each all-gather + matmul and
    matmul + reduce-scatter into tp steps: every step's transfer runs under the previous step's
    matmul, so what shows is the traffic beyond the matmuls that hide it, and at least one step of
    it (the first chunk arrives before any matmul can start): max(t_comm - t_matmul, t_comm / tp)."""
    return max(t_comm - t_matmul, t_comm / tp) if t_comm else 0.0


def _step(t_compute: float, comm: dict, bubble: float, async_tp: tuple | None = None, overlap: float = 1.0
          ) -> tuple[float, float, float, dict]:
    """(step, exposed, overlapped, exposed seconds per collective): TP / EP / PP traffic on the
    critical path (under async TP, `async_tp` = (matmul seconds, tp[, {key: fraction of its traffic
    the pass fuses}], all of it where not given), the fused part of the TP gathers and reduce-scatters
    as async_tp_exposed says, the rest as without it), FSDP's and the CP ring's hidden under compute
    up to its length, times `overlap` (the fraction a calibrated device was measured to hide: the rest
    and the excess show); the pipeline bubble stretches the busy time."""
    shown = {k: t for k, t in comm.items() if k.split("/")[0] not in OVERLAPPED}
    if async_tp is not None:
        t_matmul, tp, fused = (*async_tp, {})[:3]
        part = {k: shown[k] * fused.get(k, 1.0) for k in ASYNC_TP if k in shown}
        t_fused = sum(part.values())
        if t_fused:
            scale = async_tp_exposed(t_fused, t_matmul, tp) / t_fused
            for k, t in part.items():
                shown[k] -= t * (1 - scale)
    overlapped = sum(t for k, t in comm.items() if k.split("/")[0] in OVERLAPPED)
    excess = overlapped - overlap * min(overlapped, t_compute)
    for k, t in comm.items():
        if k.split("/")[0] in OVERLAPPED:
            shown[k] = excess * t / overlapped
    exposed = sum(t for k, t in shown.items() if k.split("/")[0] not in OVERLAPPED)
    outside = outside_schedule(shown)
    return (t_compute + exposed + excess - outside) * (1 + bubble) + outside, exposed, overlapped, shown


def outside_schedule(shown: dict) -> float:
    """Seconds of a rank's step a pipeline's bubble does not stretch: its reductions of the step's scalars (the
    loss over the stages and the data-parallel ranks, the gradient norm over the stages), run once after its
    schedule, and FSDP's traffic beyond the compute that hides it."""
    return sum(t for k, t in shown.items() if k.split("/")[0] in OVERLAPPED
               or (k.split("/")[0] in AFTER_SCHEDULE and k.split("/")[-1] not in ("send", "recv")))


def stage_times(rows: list[dict], pp: int) -> None:
    """A pipeline's step from its stages' own times (in place): the schedule's order played out with each
    rank's busy seconds (pipeline_order.makespan) instead of every rank at the slowest one's with the
    schedule's bubble. A 2-stage 1F1B of 2 microbatches whose last stage works T1 and first T0 < T1 takes
    T1 + T0 / 2, not 1.5 T1. Each rank's `bubble` becomes its own idle share of the schedule."""
    by_pp = sorted(rows, key=lambda r: r["pp_rank"])
    pipe = by_pp[0].get("pipeline") if by_pp else None
    if not pipe or pp < 2 or [r["pp_rank"] for r in by_pp] != list(range(pp)):
        return
    from torchmeg.parallel.pipeline_order import makespan, torch_actions  # lazy: pipelines only
    actions = torch_actions(pipe["schedule"], pp, pipe["microbatches"], pipe.get("stages_per_rank"))
    for step, busy, mfu in (("step_s", "busy_s", "mfu"), ("predicted_step_s", "predicted_busy_s", "predicted_mfu")):
        span = makespan(actions, [r[busy] for r in by_pp])
        for r in by_pp:
            new = span + r[step] - r[busy] * (1 + r["bubble"])  # (what runs outside the schedule: as it was)
            r[mfu] = r[mfu] * r[step] / new if new > 0 else r[mfu]
            r[step] = new
            if step == "predicted_step_s" and r[busy] > 0:
                r["bubble"] = span / r[busy] - 1


def fused_fractions(comm: dict) -> dict[str, float]:
    """The fraction of each TP gather's and reduce-scatter's traffic that torch's async-TP pass fuses
    with a matmul (step_cost.StepCost._trace_origin): all gathers that feed a matmul's left operand and
    reduce-scatters of one matmul's output, not the backward's sum of several matmuls' input
    gradients (q, k, v; w1, w3) nor the embedding's."""
    return {k: c.get("fusable_wire_bytes", 0.0) / c["wire_bytes"] for k, c in comm.items()
            if k in ASYNC_TP and c["wire_bytes"]}


def _intra(key: str, c: dict, dims, gpu: GPU) -> bool:
    """Whether a collective's group sits inside one node (a pipeline's p2p: a pair of neighbouring stages)."""
    dim = key.split("/")[0]
    return dims.group_within_node(2 if dim == "pp" else c["ranks"], dims.strides().get(dim, 1), gpu.gpus_per_node)


def comm_seconds(comm: dict, dims, gpu: GPU, efficiency: float = 1.0) -> dict[str, float]:
    """'mesh dim/collective' -> seconds on the wire (fast links inside a node, the network across:
    ParallelDims.group_within_node, the rule a run's header uses too)."""
    # (pipeline p2p: a pair of neighbouring stages, world / pp ranks apart)
    return {key: c["wire_bytes"] / ((gpu.nvlink_bw if _intra(key, c, dims, gpu) else gpu.network_bw) * efficiency)
            for key, c in comm.items()}


def predict(rank: dict, cfg, dims, gpu: GPU, model_flops_per_rank: float) -> dict:
    """Step time, MFU and memory fit for one planned rank."""
    float8 = cfg.float8.enable
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    t_compute, t_flop, t_mem = compute_seconds(rank["ops"], gpu, float8, compiled)
    comm = comm_seconds(rank["comm"], dims, gpu)
    bubble = (rank.get("pipeline") or {}).get("bubble", 0.0)
    async_tp = cfg.parallelism.enable_async_tensor_parallel and dims.tp > 1
    fused = fused_fractions(rank["comm"])
    step, exposed, overlapped, roof_shown = _step(t_compute, comm, bubble, (t_flop, dims.tp, fused) if async_tp else None)
    cal = gpu.calibration
    if cal is not None:  # what the device measured, op by op (torchmeg.plan.calibrated): no fitted factor
        by_class = cal.compute_seconds(rank["ops"], compiled)
        pred_compute = cal.step_compute(by_class)
        # collectives inside a node from the calibration's tables where it measured them (under torchrun), the
        # others (across nodes, or a one-rank calibration) at the links' data-sheet rate as without one
        pred_comm = comm_seconds(rank["comm"], dims, gpu, gpu.efficiency.links)
        if cal.collectives:
            pred_comm.update(cal.comm_seconds({k: c for k, c in rank["comm"].items() if _intra(k, c, dims, gpu)}))
    else:
        by_class = predicted_compute_seconds(rank["ops"], gpu, float8, compiled)
        pred_comm = comm_seconds(rank["comm"], dims, gpu, gpu.efficiency.links)
        by_class = {k: t / END_TO_END for k, t in by_class.items()}
        pred_compute = sum(by_class.values())
    pred_step, pred_exposed, _, shown = _step(pred_compute, pred_comm, bubble,
                                              (by_class["matmul"], dims.tp, fused) if async_tp else None,
                                              cal.overlap if cal is not None else 1.0)
    dtype = "bf16" if cfg.training.mixed_precision == "bf16" else "fp32"
    peak = gpu.peak(dtype)
    mem = rank["memory"]["Total"]
    need = mem * (1 + ALLOCATOR_SLACK) + RUNTIME_BYTES
    # (the part of each step inside a pipeline's schedule, before the bubble: stage_times replays it)
    return {"step_s": step, "busy_s": (step - outside_schedule(roof_shown)) / (1 + bubble),
            "predicted_busy_s": (pred_step - outside_schedule(shown)) / (1 + bubble),
            "compute_s": t_compute, "compute_flop_bound_s": t_flop, "compute_memory_bound_s": t_mem,
            "comm_exposed_s": exposed, "comm_overlapped_s": overlapped, "bubble": bubble,
            "comm_s": comm, "mfu": model_flops_per_rank / (step * peak) if step else 0.0,
            "predicted_step_s": pred_step, "predicted_compute_s": by_class, "predicted_comm_exposed_s": pred_exposed,
            "predicted_mfu": model_flops_per_rank / (pred_step * peak) if pred_step else 0.0, "compiled": compiled,
            "predicted_comm_exposed_by": shown, "async_tp": async_tp,
            "peak_tensor_bytes": mem, "need_bytes": need, "fits": need <= gpu.hbm_bytes}
