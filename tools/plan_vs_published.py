#!/usr/bin/env python
"""The planner's predicted and upper-bound tokens/s beside published runs of the same job (markdown).

    python tools/plan_vs_published.py [--rows N] [--match TEXT] [--trace-cache DIR]

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
- torchtitan's Dec 2024 benchmark (the same file as Tables 1 and 3): Table 4, 70B on 256 H100 as
  FSDP 32 x TP 8, compile + float8, local batch 16, full recompute, with and without async TP; Table 5,
  405B on 512 H100 as FSDP 8 x TP 8 x PP 8, compile + float8 + async TP, local batch 32, full recompute,
  1F1B and Interleaved 1F1B. Where the source is silent the planner takes torchtitan's defaults of
  that date: seq 8192, float8 tensorwise, as many microbatches as pipeline ranks (8, of 4 sequences:
  `pipeline_parallel_microbatches or pp`), the layers split as its generate_split_points did (15, 16 x
  6, 15; interleaved 7, 8 x 14, 7), loss parallel on the last stage.
- torchtitan's 64-A100 (80 GB) runs (docs/performance.md, Llama 3; eager, bf16, FSDP 64, local batch 1,
  seq 8192): 8B with selective layer (every 2nd block) and per-op recompute, 70B with full recompute.
- Its Table 2: 8B on 8 H100 as FSDP x CP (8 x 1 at seq 32k ... 1 x 8 at 256k), compile + float8, local
  batch 1, full recompute; CP as torchmeg's default (all-gathered K/V, load-balanced chunks).
- Its Table 6: 405B on 512 H100 as TP 8 x PP 8 x FSDP x CP (8 x 1 at seq 32k ... 1 x 8 at 256k), compile +
  float8 + async TP, 1F1B, local batch 8 (8 microbatches of one sequence), full recompute. Each of its plans
  takes ~2 min here: printed by this tool, not run by the test suite.
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
L8, L70, L405 = "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"
T4 = TP8_70B + F8TW
A100 = ["--training.local_batch_size=1", "--parallelism.data_parallel_shard_degree=64", "--data.seq_len=8192"]
T2 = ["--training.local_batch_size=1", "--activation_checkpoint.mode=full", "--model.max_seq_len=262144"] + FLOAT8


def cp_layout(cp: int) -> list[str]:
    """Tables 2 and 6: CP over cp of the node's 8 GPUs, FSDP over the rest, 32k tokens a CP rank."""
    return [f"--parallelism.context_parallel_degree={cp}", f"--parallelism.data_parallel_shard_degree={8 // cp}",
            f"--data.seq_len={32768 * cp}"]


# Tables 5 and 6: TP 8 with SP, PP 8 of 8 microbatches (torchtitan's default then), full recompute
PP3D = ["--parallelism.tensor_parallel_degree=8", "--parallelism.sequence_parallel=true",
        "--parallelism.pipeline_parallel_degree=8", "--parallelism.pipeline_parallel_microbatches=8",
        "--activation_checkpoint.mode=full"] + COMPILE + F8TW + ASYNC
SPLIT_1F1B = ["--parallelism.pipeline_parallel_schedule=1F1B",
              "--parallelism.pipeline_parallel_layers_per_stage=[15, 16, 16, 16, 16, 16, 16, 15]"]
T5 = PP3D + ["--data.seq_len=8192", "--parallelism.data_parallel_shard_degree=8", "--training.local_batch_size=32"]
T5_1F1B = T5 + SPLIT_1F1B
T5_INTERLEAVED = T5 + ["--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                       "--parallelism.pipeline_parallel_layers_per_stage=[7" + ", 8" * 14 + ", 7]"]
T6 = PP3D + SPLIT_1F1B + ["--training.local_batch_size=8", "--model.max_seq_len=262144"]
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
    ("torchtitan 8B FSDP 64, A100, selective layer", L8, "a100", 64, A100 + ["--activation_checkpoint.mode=selective",
                                                                          "--activation_checkpoint.selective_option=2"], 2904),
    ("torchtitan 8B FSDP 64, A100, selective op", L8, "a100", 64, A100 + BASE[1:], 2973),
    ("torchtitan 70B FSDP 64, A100, full recompute", L70, "a100", 64, A100 + [
        "--activation_checkpoint.mode=full", "--parallelism.tensor_parallel_degree=1",
        "--parallelism.sequence_parallel=false"], 331),
    ("torchtitan 70B 2D, float8 (Table 4)", L70, "h100-500w", 256, T4, 829),
    ("torchtitan 70B 2D, float8, async TP (Table 4)", L70, "h100-500w", 256, T4 + ASYNC, 876),
    ("torchtitan 405B 3D, 1F1B (Table 5)", L405, "h100-500w", 512, T5_1F1B, 100),
    ("torchtitan 405B 3D, Interleaved 1F1B (Table 5)", L405, "h100-500w", 512, T5_INTERLEAVED, 128),
    ("torchtitan 405B 4D, FSDP 8 x CP 1, seq 32k (Table 6)", L405, "h100-500w", 512, T6 + cp_layout(1), 76),
    ("torchtitan 405B 4D, FSDP 4 x CP 2, seq 64k (Table 6)", L405, "h100-500w", 512, T6 + cp_layout(2), 47),
    ("torchtitan 405B 4D, FSDP 2 x CP 4, seq 128k (Table 6)", L405, "h100-500w", 512, T6 + cp_layout(4), 31),
    ("torchtitan 405B 4D, FSDP 1 x CP 8, seq 256k (Table 6)", L405, "h100-500w", 512, T6 + cp_layout(8), 16),
    ("torchtitan 8B FSDP 8 x CP 1, seq 32k (Table 2)", L8, "h100-500w", 8, T2 + cp_layout(1), 3890),
    ("torchtitan 8B FSDP 4 x CP 2, seq 64k (Table 2)", L8, "h100-500w", 8, T2 + cp_layout(2), 2540),
    ("torchtitan 8B FSDP 2 x CP 4, seq 128k (Table 2)", L8, "h100-500w", 8, T2 + cp_layout(4), 1071),
    ("torchtitan 8B FSDP 1 x CP 8, seq 256k (Table 2)", L8, "h100-500w", 8, T2 + cp_layout(8), 548),
]
# Peak memory per GPU (GiB) where the source publishes it (torchtitan's Tables 1 to 6: the maximum
# over ranks), against the planner's need: peak tensor bytes x 1.1 + 2 GiB of runtime.
MEMORY = {
    "torchtitan 8B FSDP 8, eager": 82.4, "torchtitan 8B FSDP 8, compile": 77.0,
    "torchtitan 8B FSDP 8, compile + float8": 76.8, "torchtitan 8B FSDP 128, eager": 67.0,
    "torchtitan 8B FSDP 128, compile": 62.0, "torchtitan 8B FSDP 128, compile + float8": 61.8,
    "torchtitan 70B 2D, float8 (Table 4)": 71.9, "torchtitan 70B 2D, float8, async TP (Table 4)": 67.6,
    "torchtitan 8B FSDP 8 x CP 1, seq 32k (Table 2)": 83.9, "torchtitan 8B FSDP 4 x CP 2, seq 64k (Table 2)": 84.2,
    "torchtitan 8B FSDP 2 x CP 4, seq 128k (Table 2)": 84.0, "torchtitan 8B FSDP 1 x CP 8, seq 256k (Table 2)": 84.5,
    "torchtitan 405B 4D, FSDP 8 x CP 1, seq 32k (Table 6)": 75.3, "torchtitan 405B 4D, FSDP 4 x CP 2, seq 64k (Table 6)": 75.9,
    "torchtitan 405B 4D, FSDP 2 x CP 4, seq 128k (Table 6)": 77.1, "torchtitan 405B 4D, FSDP 1 x CP 8, seq 256k (Table 6)": 84.9,
    "torchtitan 405B 3D, 1F1B (Table 5)": 82.5, "torchtitan 405B 3D, Interleaved 1F1B (Table 5)": 72.7,
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
    ap.add_argument("--trace-cache", default="", help="plan.trace_cache: rows that trace one program (eager and "
                    "compiled, async TP on and off) trace it once, and a second run reads every trace")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from torchmeg.config.schema import load_config
    from torchmeg.plan.planner import plan
    print("| run | GPU | published tok/s/GPU | predicted | predicted / published | upper bound | "
          "predicted time: matmul / attention / memory-bound / exposed comm (s) | memory GiB: published / planned |")
    print("|---|---|---|---|---|---|---|---|")
    for name, recipe, gpu, world, args, published in [r for r in RUNS[:a.rows] if a.match in r[0]]:
        cache = [f"--plan.trace_cache={a.trace_cache}"] if a.trace_cache else []
        cfg = load_config(os.path.join(ROOT, "recipes", recipe), args + cache)
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
