"""--search: other layouts of the same world and the same global batch, each planned by a dry run,
the ones that fit ranked by predicted step time.

Enumerated: tp in 1, 2, 4, 8 (inside a node), pp in 1, 2, 4, 8 (1F1B, one sequence per microbatch,
layers divisible by pp), cp in 1, 2, 4, 8 when seq_len >= 32k, dp_shard = the rest, recompute none /
selective / full, local batch 1, 2, 4, 8, 16 (gradient accumulation makes up the global batch).
Layouts the model or batch cannot take are dropped by the recipe checks; every other one is
planned (`limit`: the first that many, the simplest first: no pp, no cp, least recompute, most TP
inside the node, largest local batch). All their traces run in one pool (_trace_in_order): layouts
whose traced programs are identical share them (trace_cache.traced_program; with plan.trace_cache,
traces of earlier plans are read back), and one that holds at least as much
as a layout found not to fit is reported as not fitting without a trace (_dominated_by).
"""
from __future__ import annotations

import copy
import itertools
import time

from torchmeg.config.errors import ConfigError
from torchmeg.plan.dry_run import cached_piece, forget, job_lane, trace_job
from torchmeg.plan.gpus import target
from torchmeg.plan.planner import finish_plan, prepare_plan
from torchmeg.plan.trace_cache import traced_program
from torchmeg.plan.trace_lanes import run_lanes
from torchmeg.runtime.cpus import usable_cores
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


MODE_MEMORY = {"full": 0, "selective": 1, "none": 2}  # least to most activation memory


def _memory_order(c) -> tuple:
    """Within one sharding (tp, pp, cp), the layouts that hold least first: more recompute, smaller
    local batch (a layout that does not fit rules out the ones after it: _dominated_by)."""
    p = c.parallelism
    return (p.pipeline_parallel_degree, p.context_parallel_degree, -p.tensor_parallel_degree,
            MODE_MEMORY[c.activation_checkpoint.mode], c.training.local_batch_size)


def _dominated_by(c, accum: int, over, over_accum: int) -> bool:
    """`over` (a layout that does not fit) holds no more than `c` per rank: the same sharding, at
    least as much recompute, a local batch no larger, and both or neither accumulating gradients.
    (Accumulation is not monotone with the rest: FSDP holds a microbatch's gradients unsharded until
    the step's last one, so the 70B at TP 4 x FSDP 64 needs 96 GiB at local batch 2 x 2 microbatches
    and 39 GiB at 4 x 1.)"""
    p, q = c.parallelism, over.parallelism
    return ((p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree)
            == (q.tensor_parallel_degree, q.pipeline_parallel_degree, q.context_parallel_degree)
            and MODE_MEMORY[c.activation_checkpoint.mode] >= MODE_MEMORY[over.activation_checkpoint.mode]
            and c.training.local_batch_size >= over.training.local_batch_size
            and (accum > 1) == (over_accum > 1))


def _trace_in_order(prepared, alias, finished, rows) -> int:
    """Trace the layouts' jobs on every core, the least memory first within each sharding; a layout
    left when one it dominates (_dominated_by) has been found not to fit is not traced: it is reported
    as not fitting, naming that one. The children keep to a lane each (torchmeg.plan.trace_lanes: one
    fake world and meshes), so a child finishes its layout's jobs of its lane and then takes the next
    layout of its own sharding; a sharding's next layout waits for the one before it to be complete,
    so that one can rule it out. -> jobs traced."""
    # The shardings round-robin: a free core starts on a sharding no other core is on.
    chains: dict[tuple, list] = {}
    for cp in sorted(prepared, key=lambda cp: _memory_order(cp[0])):
        chains.setdefault(_memory_order(cp[0])[:3], []).append(cp)
    order = [cp for rnd in itertools.zip_longest(*chains.values()) for cp in rnd if cp is not None]
    traced, submitted, taken, no_fit = {}, set(), [], []
    waiting = {p.run.key: {alias[j] for j in p.run.jobs} for _, p in prepared}

    def arrived(job, piece):
        traced[job] = piece
        for c, p in prepared:
            _complete(c, p, waiting, traced, finished, no_fit, alias)

    def wanted(p, want) -> list:
        return sorted(j for j in waiting[p.run.key] - submitted if want(job_lane(j)))

    def next_job(want):
        """A wanted lane's job: of a layout taken and not complete, else of the next layout in order
        whose sharding has none in progress (taken here, or ruled out by one that did not fit)."""
        for c, p in taken:
            if p.run.key in waiting and (jobs := wanted(p, want)):
                return jobs[0]
        busy = {_memory_order(c)[:3] for c, p in taken if p.run.key in waiting}
        for c, p in list(order):
            if p.run.key not in waiting:  # (every trace it needs came in for a layout of the same program)
                order.remove((c, p))
                continue
            if _memory_order(c)[:3] in busy or not (jobs := wanted(p, want)):
                continue
            order.remove((c, p))
            over = next((o for o in no_fit if _dominated_by(c, p.layout.accum, o[0], o[2])), None)
            if over is not None:
                rows[p.run.key] = {"layout": describe(c), "fits": False, "traced": False, "need_gib": None,
                                   "why": f"does not fit: {describe(over[0])} already needs {over[1]:.1f} GiB"}
                continue
            taken.append((c, p))
            return jobs[0]
        return None

    def pick(want):
        while (job := next_job(want)) is not None:
            submitted.add(job)
            piece = cached_piece(job)
            if piece is None:
                return job
            arrived(job, piece)  # (plan.trace_cache: traced by an earlier plan)
        return None
    run_lanes(usable_cores(), job_lane, pick, arrived, trace_job)
    return len(traced)


def _complete(c, p, waiting, traced, finished, no_fit, alias) -> None:
    key = p.run.key
    if key in waiting and waiting[key] <= traced.keys():
        del waiting[key]
        row = finished(key, {j: traced[alias[j]] for j in p.run.jobs})
        if not row["fits"]:
            no_fit.append((c, row["need_gib"], p.layout.accum))


def _parts(rank: dict) -> dict:
    """A rank's predicted step in parts: compute by op class, the pipeline bubble, and the rest
    (communication exposed, FSDP's beyond the compute that hides it included)."""
    compute = sum(rank["predicted_compute_s"].values())
    bubble = (compute + rank["predicted_comm_exposed_s"]) * rank["bubble"]
    return {"by": rank["predicted_compute_s"], "bubble_s": bubble,
            "comm_s": rank["predicted_step_s"] - compute - bubble}


def _why(r: dict, best: dict, gpu_bytes: float) -> str:
    """Why a layout lost to the best: it does not fit, or what of its step takes longer."""
    if not r["fits"]:
        return f"does not fit: needs {r['need_gib']:.1f} GiB of {gpu_bytes / 2 ** 30:.0f}"
    if r is best:
        return "best"
    parts = {f"{k} compute": r["by"][k] - best["by"][k] for k in r["by"]}
    parts["exposed comm"] = r["comm_s"] - best["comm_s"]
    parts["pipeline bubble"] = r["bubble_s"] - best["bubble_s"]
    what, more = max(parts.items(), key=lambda kv: kv[1])
    return f"{r['predicted_step_s'] / best['predicted_step_s']:.2f}x the best's step: {what} +{more:.3f} s"


def search(cfg, world: int, gpu_name: str, top: int, limit: int = 0, gpus_per_node: int | None = None) -> dict:
    """Plan every candidate layout (the first `limit`; 0 = all), ranked by predicted step time. All
    their traces run as one pool of jobs (torchmeg.plan.dry_run.run_jobs), as many at a time as
    this machine has cores."""
    t_start = time.perf_counter()
    gpu = target(gpu_name, cfg.plan.calibration, world)
    cands = candidates(cfg, world, gpus_per_node or gpu.gpus_per_node)
    chosen = cands[:limit] if limit else cands
    print(f"search: {len(cands)} layouts of world {world} take this model and batch; planning {len(chosen)} of them "
          f"({usable_cores()} at a time)", flush=True)
    prepared = []
    for c in chosen:
        try:
            prepared.append((c, prepare_plan(c, world, gpu_name, gpus_per_node)))
        except ConfigError as e:
            print(f"  {describe(c):<70} skipped: {e}", flush=True)
    # Layouts whose traced programs are identical (pipeline layouts that differ only in how the same
    # microbatches are counted as local batch x accumulation) share their traces.
    same: dict[tuple, tuple] = {}
    alias = {}
    for _, p in prepared:
        sig = traced_program(p.run)
        for job in p.run.jobs:
            alias[job] = same.setdefault((sig, *job[1:]), job)
    rows = {}

    def finished(key: int, pieces: dict) -> dict:
        c, p = by_key[key]
        plan = finish_plan(p, pieces, 0.0, isolate=True)
        worst = max(plan["ranks"], key=lambda r: r["predicted_step_s"])
        rows[key] = {"layout": describe(c), "fits": plan["fits"], "traced": True,
                     "need_gib": max(r["need_bytes"] for r in plan["ranks"]) / 2 ** 30,
                     "step_s": plan["step_s"], "mfu": plan["mfu"], "tokens_per_s_per_gpu": plan["tokens_per_s_per_gpu"],
                     "predicted_step_s": plan["predicted_step_s"], "predicted_mfu": plan["predicted_mfu"],
                     "predicted_tokens_per_s_per_gpu": plan["predicted_tokens_per_s_per_gpu"], **_parts(worst)}
        print(f"  {rows[key]['layout']:<70} need {rows[key]['need_gib']:7.1f} GiB  step {plan['predicted_step_s']:8.3f} s  "
              f"{'fits' if plan['fits'] else 'does not fit'}  ({time.perf_counter() - t_start:.0f} s)", flush=True)
        return rows[key]
    by_key = {p.run.key: (c, p) for c, p in prepared}
    try:
        n_traced = _trace_in_order(prepared, alias, finished, rows)
    finally:
        for _, p in prepared:
            forget(p.run)
    rows = list(rows.values())
    cached = sum(p.run.cached for _, p in prepared)
    print(f"  {n_traced} traces for {sum(r['traced'] for r in rows)} layouts traced"
          f"{f' ({cached} of them read from plan.trace_cache)' if cached else ''}; "
          f"{sum(not r['traced'] for r in rows)} others cannot fit where a smaller one of theirs does not", flush=True)
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["predicted_step_s"])
    best = fitting[0] if fitting else None
    for r in rows:
        if r["traced"]:
            r["why"] = _why(r, best, gpu.hbm_bytes) if best is not None or not r["fits"] else "nothing fits"
    wall = time.perf_counter() - t_start
    print(f"\nbest {min(top, len(fitting))} of {len(fitting)} that fit {gpu.name} ({len(rows)} planned in {wall:.0f} s), "
          f"by predicted step:", flush=True)
    for i, r in enumerate(fitting[:top], 1):
        print(f"{i:>3}. {r['layout']:<70} step {r['predicted_step_s']:.3f} s  "
              f"{r['predicted_tokens_per_s_per_gpu']:,.0f} tok/s/GPU  MFU {100 * r['predicted_mfu']:.1f}%  "
              f"need {r['need_gib']:.1f} GiB  {'' if i == 1 else '(' + r['why'] + ')'}", flush=True)
    lost = [r for r in rows if not r["fits"]]
    if lost:
        print(f"\n{len(lost)} do not fit, e.g. {lost[0]['layout']}: {lost[0]['why']}", flush=True)
    return {"world": world, "gpu": gpu.name, "planned": rows, "ranked": fitting[:top], "search_s": wall}
