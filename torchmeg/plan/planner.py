"""plan(): one recipe at a world size -> per-rank memory, communication, FLOPs, predicted step time.

Validates the recipe without its data (torchmeg.train.validate, data=False), dry-runs one training step
per representative rank on fake tensors (torchmeg.plan.dry_run) and predicts its time on a GPU
(torchmeg.plan.predict). The CLI is torchmeg.plan.__main__; --search prepares every layout first and
traces all their jobs in one pool (prepare_plan, run_jobs, finish_plan).
"""
from __future__ import annotations

import copy
import dataclasses
import time

from torchmeg.config.errors import ConfigError
from torchmeg.models.args import instantiate
from torchmeg.models.count import active_params, count_params, flops_per_token
from torchmeg.plan.dry_run import forget, prepare, run_jobs
from torchmeg.plan.memory import activation_bytes
from torchmeg.plan.post_training import rollout_peak_bytes
from torchmeg.plan.gpus import target
from torchmeg.plan.predict import predict, stage_times
from torchmeg.train.validate import validate


def recipe_world(cfg) -> tuple[int, str]:
    """The world a recipe's layout implies, and how it was found: plan.world_size; else its degrees'
    product, where data_parallel_shard_degree = -1 (the launcher's world) counts 1 -- what
    `python -m torchmeg.train` runs without a launcher (one process, or one per fixed degree)."""
    p = cfg.parallelism
    if cfg.plan.world_size > 0:
        return cfg.plan.world_size, "plan.world_size"
    fixed = (p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
             * p.pipeline_parallel_degree)
    if p.data_parallel_shard_degree == -1:
        return fixed, (f"parallelism.data_parallel_shard_degree = -1 takes the launcher's world: planned at world "
                       f"{fixed}, as `python -m torchmeg.train` runs it without one (--world N plans another)")
    return fixed * p.data_parallel_shard_degree, "the recipe's degrees"


@dataclasses.dataclass
class Prepared:
    """A plan ready to trace: its layout, model FLOPs, GPU and dry run (whose jobs any pool may run)."""
    cfg: object
    world: int
    layout: object
    gpu: object
    whole: object
    model_flops: float
    run: object


# The whole model on meta by (class, arguments): a search's layouts are one model, built once where
# each layout built it twice (0.4 s a layout for the 70B's 80 layers; 108 layouts). Read, never changed.
_META: dict = {}


def meta_model(spec, args):
    key = (spec.cls, repr(args))
    if key not in _META:
        if len(_META) >= 4:
            _META.pop(next(iter(_META)))
        _META[key] = instantiate(spec, args, "meta")
    return _META[key]


def prepare_plan(cfg, world: int, gpu_name: str, gpus_per_node: int | None = None) -> Prepared:
    """Validate (model, layout, batch; no data needed) and decide what the dry run traces."""
    layout = validate(cfg, world, data=False)
    args = layout.args
    whole = meta_model(layout.spec, args)
    model_flops = flops_per_token(whole, args, cfg.data.seq_len) * layout.tokens_per_step / world
    gpu = target(gpu_name, cfg.plan.calibration, world)
    if gpus_per_node:  # ranks per node: what decides which groups use the fast links
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node)
    traced = copy.deepcopy(cfg)
    if not traced.plan.cache_bytes and gpu.calibration is not None:  # (the traces' reuse distances: plan.reuse)
        traced.plan.cache_bytes = gpu.calibration.cache_bytes
    return Prepared(cfg, world, layout, gpu, whole, model_flops, prepare(traced, layout, whole))


def plan(cfg, world: int, gpu_name: str, isolate: bool = False, gpus_per_node: int | None = None) -> dict:
    """Validate, dry-run, predict. -> the plan as a dict."""
    p = prepare_plan(cfg, world, gpu_name, gpus_per_node)
    t0 = time.perf_counter()
    try:
        jobs = p.run.jobs
        pieces = dict(zip(jobs, _fake_shapes(lambda: run_jobs(jobs, isolate), cfg)))
        return finish_plan(p, pieces, time.perf_counter() - t0, isolate)
    finally:
        forget(p.run)


def _fake_shapes(fn, cfg):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - fake tensors cannot follow data-dependent shapes
        if type(e).__name__ not in ("DynamicOutputShapeException", "DataDependentOutputException"):
            raise
        op = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.name = {cfg.model.name!r}: its forward has shapes that depend on the data ({op}), "
                          f"which a fake-tensor dry run cannot follow; this model cannot be planned yet") from None


def finish_plan(p: Prepared, pieces: dict, wall: float, isolate: bool = False) -> dict:
    """The traced pieces combined (torchmeg.plan.depth) and predicted on the GPU."""
    cfg, world, layout, gpu = p.cfg, p.world, p.layout, p.gpu
    dims = layout.dims
    global_tokens = layout.tokens_per_step
    ranks = _fake_shapes(lambda: p.run.finish(pieces, isolate), cfg)
    rows = []
    for r in ranks:
        pred = predict(r, cfg, dims, gpu, p.model_flops)
        mem = r["memory"]
        rows.append({
            "rank": r["rank"], "pp_rank": r["pp_rank"], "stages": r["stages"], "parallel": r["report"],
            "model_state_bytes": r["model_state_bytes"],
            "param_bytes": mem.get("Parameter", 0), "grad_bytes": mem.get("Gradient", 0),
            "optimizer_bytes": mem.get("Optstate", 0), "buffer_bytes": mem.get("Buffer", 0),
            "activation_bytes": activation_bytes(mem), "peak_bytes": mem.get("Total", 0),
            "flops": r["flops"], "comm": r["comm"], "pipeline": r.get("pipeline"),
            "traced_layers": r.get("traced_layers"),
            "stages_traced": r.get("stages_traced"),  # (PP: a stage equal to one traced reads its numbers)
            # GRPO: the rollout's own peak (torchmeg.plan.post_training); the peak above is the larger phase's
            "rollout_peak_bytes": rollout_peak_bytes(r.get("memory_phases") or {}), **pred})
    stage_times(rows, dims.pp)
    step = max(x["step_s"] for x in rows)
    pred = max(x["predicted_step_s"] for x in rows)
    whole = p.whole
    return {"recipe": cfg.job.name, "model": f"{cfg.model.name}/{cfg.model.flavor}", "params": count_params(whole),
            "active_params": active_params(whole), "world": world, "layout": dims.describe(), "gpu": gpu.name,
            "gpu_memory_bytes": gpu.hbm_bytes, "precision": cfg.training.mixed_precision,
            "recompute": cfg.activation_checkpoint.mode, "seq_len": cfg.data.seq_len,
            "global_batch_tokens": global_tokens, "model_flops_per_rank": p.model_flops,
            "step_s": step, "tokens_per_s_per_gpu": global_tokens / world / step,
            "mfu": min(x["mfu"] for x in rows), "fits": all(x["fits"] for x in rows),
            "predicted_step_s": pred, "predicted_tokens_per_s_per_gpu": global_tokens / world / pred,
            "predicted_mfu": min(x["predicted_mfu"] for x in rows), "compiled": rows[0]["compiled"],
            "float8": cfg.float8.enable, "calibration": gpu.calibration.path if gpu.calibration is not None else None,
            "dry_run_s": wall, "traces": len(p.run.jobs), "traces_cached": p.run.cached, "ranks": rows}
