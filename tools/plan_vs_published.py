#!/usr/bin/env python
"""The planner's predicted and upper-bound tokens/s beside published runs of the same job (markdown).

    python tools/plan_vs_published.py

Rows: torchtitan's Llama 3.1 8B, FSDP 8, seq 8192, local batch 2, selective (per-op) recompute, bf16,
on 8 H100 96GB at 500 W (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1; arXiv
2410.06511), eager / torch.compile / compile + float8; and Trainy's same model with compile + float8
on 32 H200 (torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md). Each row is planned
from recipes/llama3_8b.toml with the run's settings. The Trainy row is the one the end-to-end factor
was measured on (torchmeg.plan.efficiency.END_TO_END); the torchtitan rows are held out.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# torchtitan's selective recompute is per op, every other matmul recomputed: op_half
BASE = ["--training.local_batch_size=2", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_option=op_half"]
COMPILE = ["--compile.enable=true"]
FLOAT8 = COMPILE + ["--float8.enable=true"]
# (row, GPU, world, overrides, published tokens/s per GPU)
RUNS = [
    ("torchtitan 8B FSDP 8, eager", "h100-500w", 8, [], 5762),
    ("torchtitan 8B FSDP 8, compile", "h100-500w", 8, COMPILE, 6667),
    ("torchtitan 8B FSDP 8, compile + float8", "h100-500w", 8, FLOAT8, 8532),
    ("Trainy 8B FSDP 32, compile + float8", "h200", 32, FLOAT8 + ["--float8.enable_fsdp_float8_all_gather=true"],
     10938),
]


def main() -> int:
    sys.path.insert(0, ROOT)
    from torchmeg.config.schema import load_config
    from torchmeg.plan.planner import plan
    print("| run | GPU | published tok/s/GPU | predicted | predicted / published | upper bound | "
          "predicted time: matmul / attention / memory-bound (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, gpu, world, extra, published in RUNS:
        cfg = load_config(os.path.join(ROOT, "recipes", "llama3_8b.toml"), BASE + extra)
        p = plan(cfg, world, gpu, isolate=True)
        by = max(p["ranks"], key=lambda r: r["predicted_step_s"])["predicted_compute_s"]
        print(f"| {name} | {p['gpu']} | {published:,} | {p['predicted_tokens_per_s_per_gpu']:,.0f} | "
              f"{p['predicted_tokens_per_s_per_gpu'] / published:.2f}x | {p['tokens_per_s_per_gpu']:,.0f} | "
              f"{by['matmul']:.2f} / {by['attention']:.2f} / {by['memory']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown of fake process-group state
