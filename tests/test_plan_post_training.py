"""Post-training in the plan (torchmeg.plan.post_training): what GRPO holds beside the training step —
the reference's weights (beta > 0) for the whole run, and the rollout (every FSDP module unsharded, the
engine's KV cache for the rank's rows, their packed prefill) — planned as the trainer holds them; DPO
holds only a table of reference log-probs, SFT nothing.

Each plan here is one dry run in this process (the debug model's 4 layers are traced whole).
"""
import os

from conftest import ROOT
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
    """Rollouts of 4096 tokens: the KV cache of 16 rows outgrows the training step, and the plan's
    peak (what `fits` is decided on) is the rollout's."""
    r = _plan(GRPO, "--grpo.max_completion_length=4096", "--data.seq_len=384", "--model.max_seq_len=8192")
    assert r["rollout_peak_bytes"] == r["peak_bytes"]
    assert r["rollout_peak_bytes"] >= 16 * (320 + 4096) * _kv_bytes_per_position(GRPO)


def test_the_reference_weights_are_held_beside_the_step():
    """grpo.beta > 0: the trainer keeps a copy of every local parameter shard for the whole run: the
    rollout's peak grows by the parameters' bytes exactly; the step's by those and the KL term's own
    tensors (the reference's log-probs the batch carries, exp(d) - d - 1 per token: a few [rows, seq]
    fp32 tensors)."""
    free = _plan(GRPO, "--grpo.beta=0.0")
    kl = _plan(GRPO, "--grpo.beta=0.04")
    assert kl["rollout_peak_bytes"] - free["rollout_peak_bytes"] == free["param_bytes"] > 0
    rows, seq = load_config(GRPO, []).training.local_batch_size, 384
    assert 0 < kl["peak_bytes"] - free["peak_bytes"] - free["param_bytes"] <= 8 * rows * seq * 4


def test_sft_and_dpo_plan_no_rollout():
    for recipe in ("sft_debug.toml", "dpo_debug.toml"):
        assert _plan(os.path.join(ROOT, "recipes", recipe))["rollout_peak_bytes"] is None
