"""plan(): one recipe at a world size -> per-rank memory, communication, FLOPs, predicted step time.

Validates the recipe without its data (torchmeg.train.validate, data=False), dry-runs one training step
per representative rank on fake tensors (torchmeg.plan.dry_run) and predicts its time on a GPU
(torchmeg.plan.predict). The CLI is torchmeg.plan.__main__; --search calls plan() per layout.
"""
from __future__ import annotations

import copy
import dataclasses
import time

from torchmeg.config.errors import ConfigError
from torchmeg.models.args import instantiate
from torchmeg.models.count import active_params, count_params, flops_per_token
from torchmeg.plan.dry_run import dry_run
from torchmeg.plan.memory import activation_bytes
from torchmeg.plan.gpus import GPUS
from torchmeg.plan.predict import predict
from torchmeg.train.validate import validate


def recipe_world(cfg) -> int:
    """The world a recipe's layout implies: its fixed degrees times data_parallel_shard_degree
    (which must then be given), or plan.world_size."""
    p = cfg.parallelism
    if cfg.plan.world_size > 0:
        return cfg.plan.world_size
    if p.data_parallel_shard_degree == -1:
        raise ConfigError("parallelism.data_parallel_shard_degree = -1: the world comes from the launcher; give "
                          "--world N to plan (or plan.world_size in the recipe)")
    return (p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.context_parallel_degree
            * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def plan(cfg, world: int, gpu_name: str, isolate: bool = False, gpus_per_node: int | None = None) -> dict:
    """Validate (model, layout, batch; no data needed), dry-run, predict. -> the plan as a dict."""
    layout = validate(cfg, world, data=False)
    dims, args = layout.dims, layout.args
    whole = instantiate(layout.spec, args, "meta")
    global_tokens = layout.tokens_per_step
    model_flops = flops_per_token(whole, args, cfg.data.seq_len) * global_tokens / world
    gpu = GPUS[gpu_name]
    if gpus_per_node:  # ranks per node: what decides which groups use the fast links
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node)
    t0 = time.perf_counter()
    try:
        ranks = dry_run(copy.deepcopy(cfg), layout, isolate)
    except Exception as e:  # noqa: BLE001 - fake tensors cannot follow data-dependent shapes
        if type(e).__name__ not in ("DynamicOutputShapeException", "DataDependentOutputException"):
            raise
        op = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.name = {cfg.model.name!r}: its forward has shapes that depend on the data ({op}), "
                          f"which a fake-tensor dry run cannot follow; this model cannot be planned yet") from None
    wall = time.perf_counter() - t0
    rows = []
    for r in ranks:
        pred = predict(r, cfg, dims, gpu, model_flops)
        mem = r["memory"]
        rows.append({
            "rank": r["rank"], "pp_rank": r["pp_rank"], "stages": r["stages"], "parallel": r["report"],
            "model_state_bytes": r["model_state_bytes"],
            "param_bytes": mem.get("Parameter", 0), "grad_bytes": mem.get("Gradient", 0),
            "optimizer_bytes": mem.get("Optstate", 0), "buffer_bytes": mem.get("Buffer", 0),
            "activation_bytes": activation_bytes(mem), "peak_bytes": mem.get("Total", 0),
            "flops": r["flops"], "comm": r["comm"], "pipeline": r.get("pipeline"), **pred})
    step = max(x["step_s"] for x in rows)
    pred = max(x["predicted_step_s"] for x in rows)
    return {"recipe": cfg.job.name, "model": f"{cfg.model.name}/{cfg.model.flavor}", "params": count_params(whole),
            "active_params": active_params(whole), "world": world, "layout": dims.describe(), "gpu": gpu.name,
            "gpu_memory_bytes": gpu.hbm_bytes, "precision": cfg.training.mixed_precision,
            "recompute": cfg.activation_checkpoint.mode, "seq_len": cfg.data.seq_len,
            "global_batch_tokens": global_tokens, "model_flops_per_rank": model_flops,
            "step_s": step, "tokens_per_s_per_gpu": global_tokens / world / step,
            "mfu": min(x["mfu"] for x in rows), "fits": all(x["fits"] for x in rows),
            "predicted_step_s": pred, "predicted_tokens_per_s_per_gpu": global_tokens / world / pred,
            "predicted_mfu": min(x["predicted_mfu"] for x in rows), "compiled": rows[0]["compiled"],
            "float8": cfg.float8.enable,
            "dry_run_s": wall, "ranks": rows}
