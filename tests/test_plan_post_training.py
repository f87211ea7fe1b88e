"""Post-training in the plan (torchmeg.plan.post_training): what GRPO holds beside the training step —
the reference's weights (beta > 0) for the whole run, and the rollout (every FSDP module unsharded, the
engine's KV cache for the rank's rows, their packed prefill) — planned as the trainer holds them; DPO
holds only a table of reference log-probs, SFT nothing.

Each plan here is one dry run in this process (the debug model's 4 layers are traced whole).
"""
import json
import os

import pytest

from launch import ROOT, plan_and_measure
from torchmeg.config.schema import load_config
from torchmeg.plan.planner import plan
from torchmeg.train.validate import validate

GRPO = os.path.join(ROOT, "recipes", "grpo_debug.toml")


def _plan(recipe: str, *args: str) -> dict:
    return plan(load_config(recipe, list(args)), 1, "h100")["ranks"][0]


def _kv_bytes_per_position(recipe: str) -> int:
    """Keys and values of every layer for one position of one sequence, fp32, from the config alone."""
    a = validate(load_config(recipe, []), 1, data=False).args
    head_dim = a.dim // a.n_heads
    return a.n_layers * 2 * (a.n_kv_heads or a.n_heads) * head_dim * 4


def test_the_rollout_holds_the_engines_kv_cache_for_the_ranks_rows():
    """64 more completion tokens: the rollout's peak grows by rows x 64 positions of KV, exactly (the
    engine's slot cache, allocated by its own code on fake tensors); the training step is the same."""
    short = _plan(GRPO, "--grpo.max_completion_length=64", "--data.seq_len=384")
    long = _plan(GRPO, "--grpo.max_completion_length=128", "--data.seq_len=384")
    rows = load_config(GRPO, []).training.global_batch_size  # one data-parallel share: every row
    assert long["rollout_peak_bytes"] - short["rollout_peak_bytes"] == rows * 64 * _kv_bytes_per_position(GRPO)
    assert long["peak_bytes"] == short["peak_bytes"] > short["rollout_peak_bytes"]  # (the step's the larger here)


def test_a_long_rollout_is_the_plans_peak():
    """Rollouts of 8192 tokens: the KV cache of 16 rows outgrows the training step, and the plan's
    peak (what `fits` is decided on) is the rollout's."""
    r = _plan(GRPO, "--grpo.max_completion_length=8192", "--data.seq_len=384", "--model.max_seq_len=16384")
    assert r["rollout_peak_bytes"] == r["peak_bytes"]
    assert r["rollout_peak_bytes"] >= 16 * (320 + 8192) * _kv_bytes_per_position(GRPO)


def test_the_reference_weights_are_held_beside_the_step():
    """grpo.beta > 0: the trainer keeps a copy of every local parameter shard for the whole run: the
    rollout's peak grows by at least the parameters' bytes (and by the reference's own forward before
    the step, the trained values set aside while it runs); the step's by those and the KL term's own
    tensors (the reference's log-probs the batch carries, exp(d) - d - 1 per token: a few [rows, seq]
    fp32 tensors)."""
    free = _plan(GRPO, "--grpo.beta=0.0")
    kl = _plan(GRPO, "--grpo.beta=0.04")
    assert kl["rollout_peak_bytes"] - free["rollout_peak_bytes"] >= free["param_bytes"] > 0
    rows, seq = load_config(GRPO, []).training.local_batch_size, 384
    assert 0 < kl["peak_bytes"] - free["peak_bytes"] - free["param_bytes"] <= 8 * rows * seq * 4


def test_sft_and_dpo_plan_no_rollout():
    for recipe in ("sft_debug.toml", "dpo_debug.toml"):
        assert _plan(os.path.join(ROOT, "recipes", recipe))["rollout_peak_bytes"] is None


@pytest.mark.slow
@pytest.mark.parametrize("beta,lora", [(0.0, False), (0.04, False), (0.04, True)], ids=["beta0", "beta", "beta_lora"])
def test_grpo_plan_equals_the_real_runs_trackers(beta, lora, tmp_path):
    """The GRPO debug recipe at FSDP 2 from random weights (what the rollouts write does not matter
    here) on prompts that are all grpo.max_prompt_length tokens long (the bound the plan plans at),
    planned and run for real (`plan --measure`: step 2's rollout and then its step, each under its own
    memory tracker on the real trainer). Per rank: the rollout's peak (every FSDP module unsharded,
    the engine's KV cache, the prefill of one row per group, then the reference's forward) and the
    step's within 1% of the real run's (the issue asked 10%; measured: the rollout 0.03% under at beta
    0, 0.08% at 0.04, 0.10% with LoRA; the step's peak exact, 0.12% over with LoRA);
    parameters, gradients and optimizer state exactly; with beta > 0 the reference's copy counted
    in both phases, and under LoRA none held (the base with the adapters off is the reference)."""
    from torchmeg.data.tokenizer import ByteTokenizer
    texts = [f"{k}: " + "the quick brown fox jumps over the lazy dog " * 6 for k in range(8)]
    lengths = {len(ByteTokenizer().encode_with_specials(t)) for t in texts}
    assert len(lengths) == 1
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ["--config", GRPO, f"--job.dump_folder={tmp_path}", "--metrics.enable_tensorboard=false",
              f"--data.dataset={tmp_path / 'prompts.jsonl'}", f"--grpo.max_prompt_length={lengths.pop()}",
              '--grpo.reward_funcs=["torchmeg.data.name_task:format_reward"]', "--grpo.reward_weights=[1.0]",
              "--checkpoint.initial_load_path=", "--grpo.log_completions=false", f"--grpo.beta={beta}",
              f"--lora.enable={str(lora).lower()}"]
    plan, measured = plan_and_measure(common, 2, tmp_path, ranks=(0, 1))
    plan = plan["ranks"][0]
    for m in measured:
        roll, step = m["rollout_memory"], m["memory"]
        assert plan["model_state_bytes"] == m["model_state_bytes"]
        # (the reference's copy: tensors told to the trackers, MemTracker's "Other")
        copy = plan["param_bytes"] if beta and not lora else 0
        assert roll.get("Other", 0) == step.get("Other", 0) == copy, (roll, step)
        assert abs(plan["rollout_peak_bytes"] - roll["Total"]) <= 0.01 * roll["Total"], (plan["rollout_peak_bytes"], roll)
        want = max(roll["Total"], step["Total"])
        assert abs(plan["peak_bytes"] - want) <= 0.01 * want, (plan["peak_bytes"], roll["Total"], step["Total"])
