"""The size ladder: real widths and depths train on a CPU (short sequences, small batches, the byte
vocabulary). A bug that strikes once in 2^24 draws, or a scale that only overflows at width 4096,
never shows on the 3M-parameter debug model; these runs are where it would.

Each runs a shipped recipe with its own defaults (precision, recompute, FSDP policy), cut to a few
steps of one short sequence, and asserts every loss and grad norm finite and the loss falling."""
import math

import pytest

from conftest import read_metrics
from launch import run_cli

SMALL = ["--data.dataset=python_stdlib", "--data.tokenizer=byte", "--model.vocab_size=-1",
         "--validation.enable=false", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
         "--metrics.log_freq=1", "--training.local_batch_size=1", "--training.global_batch_size=1"]


def _finite_and_falling(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert not any(r.get("skipped") for r in rows), rows
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    losses = [r["loss"] for r in rows]
    # One 32-128-token sequence per step is a noisy loss: the mean of the last three steps
    # against the first (a model that does not learn stays at ~ln(257) = 5.5).
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.parametrize("name, args, steps", [
    # GPT-2 124M: 12 layers x 768, bf16 (the recipe's), at seq 32. (At seq 64 it was the suite's slowest
    # test on an AVX2-only CPU, which has no bf16 units: 182 s of its 300 in .ci/run on a 2-core AMD
    # EPYC, 2026-11-29; alone there, one thread, 160 s at seq 64 and 87 s at 32, ~15 and ~8 s a step.
    # 6 steps, not 10: its losses there 5.28 5.66 4.48 3.96 4.70 3.80 | 3.62 4.05 3.69 3.38, so the last
    # three of 6 average 4.15, 0.63 under the bar of 4.78 (of 10: 3.71); a step is ~7 s of the test.)
    ("gpt2_124m", ["--config", "recipes/gpt2_124m.toml", "--data.seq_len=32"], 6),
    # One block of Llama-3 8B (dim 4096, 32 heads / 8 KV heads, FFN 14336: 218M parameters) with the
    # recipe's selective recompute and 200-step warmup (at full lr, 32 tokens a step make one 218M
    # block spike), in fp32: bf16 matmuls on a CPU without bf16 units (AVX2) run ~50x slower, a
    # minute a step at this width; bf16 at real depth is the GPT-2 case.
    ("llama3_8b_one_block", ["--config", "recipes/llama3_8b.toml", "--model.n_layers=1", "--data.seq_len=32",
                             "--training.mixed_precision=fp32"], 8),
    # MoE at a realistic expert count: 64 routed experts, top-8 (OLMoE / Qwen-MoE), + 1 shared.
    ("moe_64_experts", ["--config", "recipes/moe_debug.toml", "--model.n_experts=64", "--model.top_k=8",
                        "--data.seq_len=64", "--lr_scheduler.warmup_steps=2"], 10),
    # One DeepSeek-V3 MoE block at its real width: dim 7168, MLA with 128 heads (q rank 1536, kv rank
    # 512, 128 + 64 query/key and 128 value dims per head, YaRN mscale), the shared expert and routed
    # experts of 2048, sigmoid routing x 2.5; 2 routed experts of its 256, top-1 (324M parameters:
    # 6.3 GB with Adam state in fp32, as llama's block above; group-limited routing is the debug
    # flavor's, tests/test_deepseek_v3.py).
    ("deepseek_v3_671b_one_block", ["--config", "recipes/deepseek_v3_671b.toml", "--model.n_layers=1",
                                    "--model.n_dense_layers=0", "--model.n_experts=2", "--model.top_k=1",
                                    "--model.n_expert_groups=1", "--model.topk_groups=1", "--model.mtp_depth=0",
                                    "--data.seq_len=32", "--training.mixed_precision=fp32",
                                    "--lr_scheduler.warmup_steps=200", "--parallelism.expert_parallel_degree=1"], 6),
])
@pytest.mark.timeout(600)  # last .ci/run: the DeepSeek-V3 block 110 s (fp32, 324M), GPT-2 94 s (bf16 on a CPU without bf16 units)
def test_real_size_trains(name, args, steps, tmp_path):
    p = run_cli(args + SMALL + [f"--training.steps={steps}"], tmp_path, timeout=240)
    _finite_and_falling(read_metrics(tmp_path), steps)
    assert "non-finite" not in p.stdout
