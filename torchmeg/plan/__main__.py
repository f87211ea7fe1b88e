"""python -m torchmeg.plan --config RECIPE [--world N] [--gpu h100|h200|b200|a100] [--search]
                          [--json FILE] [--section.key=value ...]

Plans a recipe at its real world size on this machine: no GPU, no peers. One training step runs
on fake tensors over torch's fake process group for a representative rank of each pipeline stage
(torchmeg.plan.dry_run), through the trainer's own build and the real parallelize(); per rank it
reports parameter / gradient / optimizer / activation memory and the peak, bytes per collective and
mesh dim, FLOPs, and a predicted step time and MFU on the named GPU (torchmeg.plan.predict).
--search tries other layouts of the same world (tp, pp, cp, dp_shard, recompute, local batch at the
same global batch) and ranks those that fit by predicted step time.

Under torchrun, --measure runs the real trainer instead and measures its step 2 the same way:
the numbers the plan predicts, taken from a real run (tests compare the two).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

GIB = 2 ** 30


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m torchmeg.plan", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world", type=int, default=None, help="world size (default: what the recipe's layout implies)")
    ap.add_argument("--gpu", default=None, help="h100 | h200 | b200 | a100 (default: the recipe's plan.gpu, else h100)")
    ap.add_argument("--search", action="store_true", help="rank other layouts of the same world that fit")
    ap.add_argument("--top", type=int, default=8, help="layouts shown by --search")
    ap.add_argument("--limit", type=int, default=24, help="layouts --search plans at most (each is a dry run)")
    ap.add_argument("--json", default=None, help="write the plan as JSON here")
    ap.add_argument("--measure", action="store_true", help="(under torchrun) measure the real trainer's step 2")
    return ap.parse_known_args(argv)


def recipe_world(cfg) -> int:
    """The world a recipe's layout implies: its fixed degrees times data_parallel_shard_degree
    (which must then be given), or plan.world_size."""
    from torchmeg.config import ConfigError
    p = cfg.parallelism
    if cfg.plan.world_size > 0:
        return cfg.plan.world_size
    if p.data_parallel_shard_degree == -1:
        raise ConfigError("parallelism.data_parallel_shard_degree = -1: the world comes from the launcher; give "
                          "--world N to plan (or plan.world_size in the recipe)")
    return (p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.context_parallel_degree
            * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def plan(cfg, world: int, gpu_name: str, isolate: bool = False) -> dict:
    """Validate (model, layout, batch; no data needed), dry-run, predict. -> the plan as a dict."""
    from torchmeg.config import ConfigError, validate
    from torchmeg.models import active_params, build_model, check_model_config, count_params, flops_per_token
    from torchmeg.parallel import ParallelDims
    from torchmeg.plan.dry_run import activation_bytes, dry_run
    from torchmeg.plan.gpus import GPUS
    from torchmeg.plan.predict import predict
    validate(cfg, world, data=False)
    args = check_model_config(cfg, tokenizer=False)
    dims = ParallelDims.from_config(cfg, world)
    whole = build_model(cfg, args.vocab_size, "meta")
    t = cfg.training
    accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dims.dp)
    global_tokens = t.local_batch_size * dims.dp * accum * cfg.data.seq_len
    model_flops = flops_per_token(whole, args, cfg.data.seq_len) * global_tokens / world
    gpu = GPUS[gpu_name]
    t0 = time.perf_counter()
    try:
        ranks = dry_run(copy.deepcopy(cfg), world, args.vocab_size, isolate)
    except Exception as e:  # noqa: BLE001 - fake tensors cannot follow data-dependent shapes
        if type(e).__name__ not in ("DynamicOutputShapeException", "DataDependentOutputException"):
            raise
        op = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if dims.ep > 1:
            raise ConfigError(f"parallelism.expert_parallel_degree = {dims.ep}: expert parallel exchanges token "
                              f"counts whose values set the shapes ({op}), which a fake-tensor dry run cannot "
                              f"follow; plan with expert_parallel_degree = 1 (routing assumed balanced)") from None
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
    return {"recipe": cfg.job.name, "model": f"{cfg.model.name}/{cfg.model.flavor}", "params": count_params(whole),
            "active_params": active_params(whole), "world": world, "layout": dims.describe(), "gpu": gpu.name,
            "gpu_memory_bytes": gpu.hbm_bytes, "precision": t.mixed_precision,
            "recompute": cfg.activation_checkpoint.mode, "seq_len": cfg.data.seq_len,
            "global_batch_tokens": global_tokens, "model_flops_per_rank": model_flops,
            "step_s": step, "tokens_per_s_per_gpu": global_tokens / world / step,
            "mfu": min(x["mfu"] for x in rows), "fits": all(x["fits"] for x in rows),
            "dry_run_s": wall, "ranks": rows}


def _g(b: float) -> str:
    return f"{b / GIB:.2f}"


def render(p: dict) -> str:
    lines = [f"plan  {p['recipe']}: {p['model']}, {p['params'] / 1e9:.2f}B params, {p['layout']}, "
             f"{p['precision']}, recompute {p['recompute']}, seq {p['seq_len']}, "
             f"{p['global_batch_tokens']:,} tokens/step, on {p['gpu']} ({p['gpu_memory_bytes'] / 1e9:.0f} GB)",
             "",
             "rank  stages    params  grads   optim   activ.  peak    need    fits   (GiB per rank; activ. = "
             "activations, temporaries, gathered weights)"]
    for r in p["ranks"]:
        st = ",".join(map(str, r["stages"])) if r["pipeline"] else "-"
        lines.append(f"{r['rank']:<5} {st:<9} {_g(r['param_bytes']):<7} {_g(r['grad_bytes']):<7} "
                     f"{_g(r['optimizer_bytes']):<7} {_g(r['activation_bytes']):<7} {_g(r['peak_bytes']):<7} "
                     f"{_g(r['need_bytes']):<7} {'yes' if r['fits'] else 'NO'}")
    for r in p["ranks"]:
        lines += ["", f"rank {r['rank']}: bytes per step by mesh dim / collective"
                  f"   (count, buffer GiB, sent per rank GiB, seconds)"]
        for key, c in r["comm"].items():
            lines.append(f"  {key:<28} {c['count']:>6} {_g(c['bytes']):>9} {_g(c['wire_bytes']):>9} "
                         f"{r['comm_s'].get(key, 0.0):>8.4f}")
        pipe = r["pipeline"]
        lines.append(f"  compute {r['compute_s']:.3f} s ({r['flops'] / 1e12:.1f} TFLOP measured; flop-bound "
                     f"{r['compute_flop_bound_s']:.3f} s, memory-bound {r['compute_memory_bound_s']:.3f} s), "
                     f"comm exposed {r['comm_exposed_s']:.3f} s, overlapped {r['comm_overlapped_s']:.3f} s"
                     + (f", bubble {r['bubble']:.3f} ({pipe['schedule']}, {pipe['microbatches']} microbatches)"
                        if pipe else "")
                     + f" -> step {r['step_s']:.3f} s")
    lines += ["", f"predicted: step {p['step_s']:.3f} s, {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
              f"MFU {100 * p['mfu']:.1f}% (roofline: an upper bound), "
              f"{'fits' if p['fits'] else 'DOES NOT FIT'} in {p['gpu_memory_bytes'] / 1e9:.0f} GB "
              f"(peak x 1.1 + 2 GiB runtime)   [dry run {p['dry_run_s']:.0f} s]"]
    return "\n".join(lines)


def main(argv=None) -> int:
    from torchmeg.config import ConfigError, load_config
    a, rest = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(a.config, rest)
        if a.measure:
            from torchmeg.plan.measure import measure_main
            return measure_main(cfg, a.json)
        world = a.world or recipe_world(cfg)
        gpu = (a.gpu or cfg.plan.gpu).lower()
        from torchmeg.plan.gpus import GPUS
        if gpu not in GPUS:
            raise ConfigError(f"--gpu {gpu!r}: unknown; one of {', '.join(GPUS)}")
        if a.search:
            from torchmeg.plan.search import search
            result = search(cfg, world, gpu, a.top, a.limit)
        else:
            result = plan(cfg, world, gpu)
            print(render(result), flush=True)
    except ConfigError as e:
        print(f"torchmeg.plan: error: {e}", file=sys.stderr, flush=True)
        return 2
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown of fake process-group state
