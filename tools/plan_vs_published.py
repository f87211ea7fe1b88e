#!/usr/bin/env python
"""The planner's predicted and upper-bound tokens/s beside published runs of the same job (markdown).

    python tools/plan_vs_published.py [--rows N] [--match TEXT]

Rows (torchtitan's H100s are the 96 GB, 500 W parts of Grand Teton: `h100-500w`):
- torchtitan's Llama 3.1 8B, FSDP 8, seq 8192, local batch 2, selective (per-op) recompute, bf16, on 8
  H100 (benchmarks/llama3_h100_202412_torchtitan.md, Table 1; arXiv 2410.06511): eager / compile /
  compile + float8; and the same on 128 H100 (Table 3), with their peak memory.
- Trainy's same model with compile + float8 on 32 H200 (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md):
  the row the end-to-end factor was measured on (torchmeg.plan.efficiency.END_TO_END); the others are
  held out.
- torchtitan's async TP benchmark (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md), compile, TP
  with sequence parallel, vanilla and async TP, bf16 and float8 tensorwise: Llama 3.1 8B on 64 H100
  (FSDP 8 x TP 8, per-op recompute, local batch 12) and 70B on 256 H100 (FSDP 32 x TP 8, full
  recompute, local batch 16). The source gives no sequence length: planned at torchtitan's llama3
  configs' 8192.
Each row is planned from the named recipe with the run's settings.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# torchtitan's selective recompute is per op, every other matmul recomputed: op_half
BASE = ["--training.local_batch_size=2", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_option=op_half"]
COMPILE = ["--compile.enable=true"]
FLOAT8 = COMPILE + ["--float8.enable=true"]
TP8 = ["--parallelism.tensor_parallel_degree=8", "--parallelism.sequence_parallel=true", "--data.seq_len=8192"]
ASYNC = ["--parallelism.enable_async_tensor_parallel=true"]
F8TW = ["--float8.enable=true", "--float8.recipe=tensorwise"]
TP8_8B = TP8 + COMPILE + ["--parallelism.data_parallel_shard_degree=8", "--training.local_batch_size=12",
                          "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op_half"]
TP8_70B = TP8 + COMPILE + ["--parallelism.data_parallel_shard_degree=32", "--training.local_batch_size=16",
                           "--activation_checkpoint.mode=full"]
L8, L70 = "llama3_8b.toml", "llama3_70b.toml"
# (row, recipe, GPU, world, overrides, published tokens/s per GPU)
RUNS = [
    ("torchtitan 8B FSDP 8, eager", L8, "h100-500w", 8, BASE, 5762),
    ("torchtitan 8B FSDP 8, compile", L8, "h100-500w", 8, BASE + COMPILE, 6667),
    ("torchtitan 8B FSDP 8, compile + float8", L8, "h100-500w", 8, BASE + FLOAT8, 8532),
    ("Trainy 8B FSDP 32, compile + float8", L8, "h200", 32, BASE + FLOAT8 + ["--float8.enable_fsdp_float8_all_gather=true"],
     10938),
    ("torchtitan 8B FSDP 8 x TP 8, bf16", L8, "h100-500w", 64, TP8_8B, 4378),
    ("torchtitan 8B FSDP 8 x TP 8, bf16, async TP", L8, "h100-500w", 64, TP8_8B + ASYNC, 4809),
    ("torchtitan 8B FSDP 8 x TP 8, float8", L8, "h100-500w", 64, TP8_8B + F8TW, 5078),
    ("torchtitan 8B FSDP 8 x TP 8, float8, async TP", L8, "h100-500w", 64, TP8_8B + F8TW + ASYNC, 5570),
    ("torchtitan 70B FSDP 32 x TP 8, bf16", L70, "h100-500w", 256, TP8_70B, 597),
    ("torchtitan 70B FSDP 32 x TP 8, bf16, async TP", L70, "h100-500w", 256, TP8_70B + ASYNC, 652),
    ("torchtitan 70B FSDP 32 x TP 8, float8", L70, "h100-500w", 256, TP8_70B + F8TW, 810),
    ("torchtitan 70B FSDP 32 x TP 8, float8, async TP", L70, "h100-500w", 256, TP8_70B + F8TW + ASYNC, 942),
    ("torchtitan 8B FSDP 128, eager", L8, "h100-500w", 128, BASE, 5605),
    ("torchtitan 8B FSDP 128, compile", L8, "h100-500w", 128, BASE + COMPILE, 6514),
    ("torchtitan 8B FSDP 128, compile + float8", L8, "h100-500w", 128, BASE + FLOAT8, 8380),
]
# Peak memory per GPU (GiB) where the source publishes it (torchtitan's Tables 1 and 3: the maximum over
# ranks), against the planner's need: peak tensor bytes x 1.1 + 2 GiB of runtime.
MEMORY = {
    "torchtitan 8B FSDP 8, eager": 82.4, "torchtitan 8B FSDP 8, compile": 77.0,
    "torchtitan 8B FSDP 8, compile + float8": 76.8, "torchtitan 8B FSDP 128, eager": 67.0,
    "torchtitan 8B FSDP 128, compile": 62.0, "torchtitan 8B FSDP 128, compile + float8": 61.8,
}


def planned_gib(p) -> float:
    """The plan's memory need of its fullest rank (GiB): what is compared with a published peak."""
    return max(r["need_bytes"] for r in p["ranks"]) / 2 ** 30


def memory_cell(name: str, p) -> str:
    if name not in MEMORY:
        return "—"
    return f"{MEMORY[name]} / {planned_gib(p):.1f} ({planned_gib(p) / MEMORY[name]:.2f}x)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=len(RUNS), help="the first N rows only")
    ap.add_argument("--match", default="", help="only the rows whose name contains this")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from torchmeg.config.schema import load_config
    from torchmeg.plan.planner import plan
    print("| run | GPU | published tok/s/GPU | predicted | predicted / published | upper bound | "
          "predicted time: matmul / attention / memory-bound / exposed comm (s) | memory GiB: published / planned |")
    print("|---|---|---|---|---|---|---|---|")
    for name, recipe, gpu, world, args, published in [r for r in RUNS[:a.rows] if a.match in r[0]]:
        cfg = load_config(os.path.join(ROOT, "recipes", recipe), args)
        p = plan(cfg, world, gpu, isolate=True)
        r = max(p["ranks"], key=lambda r: r["predicted_step_s"])
        by = r["predicted_compute_s"]
        print(f"| {name} | {p['gpu']} | {published:,} | {p['predicted_tokens_per_s_per_gpu']:,.0f} | "
              f"{p['predicted_tokens_per_s_per_gpu'] / published:.2f}x | {p['tokens_per_s_per_gpu']:,.0f} | "
              f"{by['matmul']:.2f} / {by['attention']:.2f} / {by['memory']:.2f} / "
              f"{r['predicted_comm_exposed_s']:.2f} | {memory_cell(name, p)} |", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown of fake process-group state
