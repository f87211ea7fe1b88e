#!/usr/bin/env python
"""A plan whose step's first microbatch is given (torchmeg.plan.trace_step.give_first_microbatch, the
default with three microbatches or more) beside the same plan tracing that microbatch, on layouts
that accumulate: every number of each plan compared, printed per layout as the largest relative
difference of the numbers that are not memory and each rank's peak difference in bytes (markdown).

    python tools/plan_first_microbatch_check.py [--match TEXT]

Both plans run in this process, each trace in a forked child (planner.plan(isolate=True)), the first
microbatch traced by switching trace_step.first_microbatch_given off for the second plan.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

GBS, BF16 = "--training.global_batch_size=", "--training.mixed_precision=bf16"
# (name, recipe, world, overrides): every one with three microbatches or more
LAYOUTS = [
    ("FSDP 2, fp32", "debug_llama.toml", 2, [GBS + "48"]),
    ("FSDP 2, bf16", "debug_llama.toml", 2, [GBS + "48", BF16]),
    ("one device, bf16", "debug_llama.toml", 1, [GBS + "24", BF16]),
    ("HSDP 2 x 2, bf16", "debug_llama.toml", 4, ["--parallelism.data_parallel_replicate_degree=2",
                                                "--parallelism.data_parallel_shard_degree=2", GBS + "96", BF16]),
    ("CP 2 x FSDP 2", "debug_llama.toml", 4, ["--parallelism.context_parallel_degree=2", GBS + "48"]),
    ("FSDP 2, no reshard after forward, bf16", "debug_llama.toml", 2,
     ["--parallelism.fsdp_reshard_after_forward=false", GBS + "48", BF16]),
    ("FSDP 2, Muon", "debug_llama.toml", 2, ["--optimizer.name=muon", GBS + "48"]),
    ("FSDP 2, selective recompute, compile, bf16", "debug_llama.toml", 2,
     ["--activation_checkpoint.mode=selective", "--compile.enable=true", GBS + "48", BF16]),
    ("SFT + LoRA, FSDP 2, bf16", "sft_debug.toml", 2, ["--lora.enable=true", GBS + "24", BF16]),
    ("DPO, FSDP 2, bf16", "dpo_debug.toml", 2, [GBS + "24", BF16]),
    ("GRPO beta 0.04, FSDP 2", "grpo_debug.toml", 2, [GBS + "48", "--grpo.beta=0.04"]),
    ("DeepSeek-V3 debug, EP 2 x FSDP 2, bf16", "deepseek_v3_debug.toml", 4,
     ["--parallelism.expert_parallel_degree=2", GBS + "96", BF16]),
    ("gpt-oss debug, EP 2 x FSDP 2, bf16", "gpt_oss_debug.toml", 4,
     ["--parallelism.expert_parallel_degree=2", GBS + "96", BF16]),
]
MEMORY = ("peak_bytes", "peak_tensor_bytes", "need_bytes", "activation_bytes", "grad_bytes")


def numbers(x, path: str = "") -> dict[str, float]:
    """Every number of a plan, by its path."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in numbers(val, f"{path}.{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in numbers(val, f"{path}[{i}]").items()}
    return {path: x} if isinstance(x, (int, float)) and not isinstance(x, bool) else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", default="", help="only the layouts whose name contains this")
    a = ap.parse_args(argv)
    from torchmeg.config.schema import load_config
    from torchmeg.plan import trace_step
    from torchmeg.plan.planner import plan
    given_rule = trace_step.first_microbatch_given
    print("| layout | largest relative difference, not memory | peak difference per rank (bytes) |")
    print("|---|---:|---|")
    for name, recipe, world, overrides in LAYOUTS:
        if a.match not in name:
            continue
        plans = []
        for rule in (given_rule, lambda model, accum: False):
            trace_step.first_microbatch_given = rule
            cfg = load_config(os.path.join(ROOT, "recipes", recipe), overrides)
            plans.append(plan(cfg, world, "h100", isolate=True))
            plans[-1].pop("dry_run_s")
        trace_step.first_microbatch_given = given_rule
        given, traced = (numbers(p) for p in plans)
        worst = max((abs(given[k] - v) / max(abs(v), 1e-30) for k, v in traced.items()
                     if not k.endswith(MEMORY) and given.get(k) != v), default=0.0)
        peaks = [g["peak_bytes"] - t["peak_bytes"] for g, t in zip(plans[0]["ranks"], plans[1]["ranks"])]
        print(f"| {name} | {worst:.1e} | {', '.join(f'{d:+,}' for d in peaks)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
