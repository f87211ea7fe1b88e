"""--search: other layouts of the same world and the same global batch, each planned by a dry run,
the ones that fit ranked by predicted step time.

Enumerated: tp in 1, 2, 4, 8 (inside a node), pp in 1, 2, 4, 8 (1F1B, one sequence per microbatch,
layers divisible by pp), cp in 1, 2, 4, 8 when seq_len >= 32k, dp_shard = the rest, recompute none /
selective / full, local batch 1, 2, 4, 8, 16 (gradient accumulation makes up the global batch).
Layouts the model or batch cannot take are dropped by the recipe checks; at most `limit` are
planned, the simplest first (no pp, no cp, least recompute, most TP inside the node, largest local batch).
"""
from __future__ import annotations

import copy
import time

from torchmeg.config.errors import ConfigError
from torchmeg.plan.gpus import GPUS
from torchmeg.plan.planner import plan
from torchmeg.train.validate import validate

MODES = ("none", "selective", "full")


def candidates(cfg, world: int, gpus_per_node: int):
    layout = validate(cfg, world, data=False)
    args, global_seqs = layout.args, layout.global_batch
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            for cp in ((1, 2, 4, 8) if cfg.data.seq_len >= 32768 else (1,)):
                fixed = tp * pp * cp
                if tp > gpus_per_node or world % fixed or args.n_layers % pp:
                    continue
                dp = world // fixed
                for mode in MODES:
                    for lb in (1, 2, 4, 8, 16):
                        if global_seqs % (lb * dp) or (pp > 1 and lb < pp):
                            continue
                        c = copy.deepcopy(cfg)
                        p = c.parallelism
                        p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree = tp, pp, cp
                        p.data_parallel_shard_degree, p.data_parallel_replicate_degree = dp, 1
                        p.expert_parallel_degree = 1 if p.expert_parallel_degree > dp * cp else p.expert_parallel_degree
                        if pp > 1:
                            p.pipeline_parallel_schedule, p.pipeline_parallel_microbatches = "1F1B", lb
                            p.pipeline_parallel_layers_per_stage = -1
                        c.activation_checkpoint.mode = mode
                        c.training.local_batch_size = lb
                        c.training.global_batch_size = global_seqs if global_seqs != lb * dp else -1
                        try:
                            validate(c, world, data=False)
                        except ConfigError:
                            continue
                        out.append(((pp, cp, MODES.index(mode), -tp, -lb), c))
    out.sort(key=lambda x: x[0])
    return [c for _, c in out]


def describe(c) -> str:
    p = c.parallelism
    return (f"tp {p.tensor_parallel_degree} pp {p.pipeline_parallel_degree} cp {p.context_parallel_degree} "
            f"dp_shard {p.data_parallel_shard_degree} recompute {c.activation_checkpoint.mode} "
            f"local batch {c.training.local_batch_size}")


def search(cfg, world: int, gpu_name: str, top: int, limit: int = 24, gpus_per_node: int | None = None) -> dict:
    cands = candidates(cfg, world, gpus_per_node or GPUS[gpu_name].gpus_per_node)
    print(f"search: {len(cands)} layouts of world {world} take this model and batch; planning "
          f"{min(limit, len(cands))} of them", flush=True)
    rows = []
    for c in cands[:limit]:
        t0 = time.perf_counter()
        try:
            p = plan(c, world, gpu_name, isolate=True, gpus_per_node=gpus_per_node)
        except ConfigError as e:
            print(f"  {describe(c):<70} skipped: {e}", flush=True)
            continue
        peak = max(r["need_bytes"] for r in p["ranks"]) / 2 ** 30
        print(f"  {describe(c):<70} need {peak:7.1f} GiB  step {p['step_s']:8.3f} s  MFU {100 * p['mfu']:5.1f}%  "
              f"{'fits' if p['fits'] else 'does not fit'}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append({"layout": describe(c), "fits": p["fits"], "need_gib": peak, "step_s": p["step_s"],
                     "mfu": p["mfu"], "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"]})
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_s"])
    print(f"\nbest {min(top, len(fitting))} of {len(fitting)} that fit {GPUS[gpu_name].name}:", flush=True)
    for i, r in enumerate(fitting[:top], 1):
        print(f"{i:>3}. {r['layout']:<70} step {r['step_s']:.3f} s  {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU  "
              f"MFU {100 * r['mfu']:.1f}%  need {r['need_gib']:.1f} GiB", flush=True)
    return {"world": world, "gpu": GPUS[gpu_name].name, "planned": rows, "ranked": fitting[:top]}
