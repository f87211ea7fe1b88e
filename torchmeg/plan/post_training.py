"""What post-training holds beside the training step, planned as the trainer holds it.

GRPO (torchmeg.train.grpo, torchmeg.train.rollout):
- with grpo.beta > 0 and no LoRA a copy of the reference's parameters, each rank its shards, held for
  the whole run (`grpo.reference_weights`): cloned here from the traced model and told to the tracker,
  so every phase of the step counts it (under LoRA the reference is the base with the adapters off,
  `models.lora.adapters_off`: nothing held);
- the rollout before each step: every FSDP module unsharded (`rollout.gathered_weights`), the
  engine's paged KV pool for the rank's rows (global batch / data-parallel shares) at the longest
  prompt plus the longest completion, and the packed prefill of each of the rank's prompts (one row
  per group: the others map its cached blocks, the engine's prefix caching) at its longest
  (`train.rollout.longest_prefill`: the engine's runner, one forward, the head on each prompt's last
  token), then the old policy's and the reference's no-grad log-prob forwards the trainer runs before
  the step (`grpo.extra_logps`): traced on fake tensors as memory phases of their own (`rollout_gather`,
  `rollout`, `rollout_logps`: `rollout_phases`). Decode steps hold less than that prefill and are not
  traced; the rollout's time is not in the plan's step time (its length depends on what the model
  writes).
DPO holds its reference as a table of log-probs, 16 bytes a pair (torchmeg.train.dpo): nothing beside
the step. SFT holds nothing beside it.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchmeg.plan.memory import step_memory, take_peak
from torchmeg.models.lora import adapters_off
from torchmeg.train.grpo import extra_logps, swapped
from torchmeg.train.rollout import gathered_weights, groups_on_a_rank, longest_prefill


def reference_copy(cfg, model) -> list[torch.Tensor]:
    """GRPO with beta > 0: the trainer's copy of every local parameter shard (else nothing)."""
    if cfg.training.objective != "grpo" or cfg.grpo.beta == 0.0 or cfg.lora.enable:
        return []  # (under LoRA the reference is the base with the adapters off: no copy)
    with torch.no_grad():
        return [p.detach().clone() for p in model.parameters()]


def rollout_phases(cfg, layout, mesh, model, opt, reference: list[torch.Tensor], ms, batch) -> dict[str, dict[str, int]]:
    """GRPO's memory phases before the step on this rank (MemTracker's categories at each one's peak):
    `rollout_gather`, every FSDP module unsharded (the last all-gather's buffers on top of the others'
    weights); `rollout`, the engine's prefill on them (every layer's KV cache besides); then, once the
    cache is freed, `rollout_logps` (only where the loss reads them): the old policy's and the
    reference's no-grad log-prob forwards of one microbatch `batch` (each microbatch's are alike),
    through the trainer's own code (grpo.extra_logps: the reference swapped in over a copy of the
    trained values, or the adapters off under LoRA). Three phases, not one: each scales with the depth
    on its own line (weights; weights and cache; one block's weights at a time beside the copy), and
    the largest is taken once scaled (torchmeg.plan.depth). As one phase the 8B GRPO + LoRA plan
    scaled whichever led at its few traced layers: the gather's (an 8B's embedding and head are
    2.1 GB to gather) or the reference's forward, not the prefill that leads past 10 layers."""
    g = cfg.grpo
    shares = mesh["dp_cp"].size()
    rows, prompts = layout.global_batch // shares, groups_on_a_rank(layout.global_batch, shares, g.num_generations)
    mt = step_memory()
    mt.track_external(model, opt, *reference)
    was_training = model.training
    model.eval()
    out = {}
    try:
        with mt:  # (one tracker entry: entering again would restart its peak; take_peak restarts it here)
            with torch.no_grad(), gathered_weights(model):
                out["rollout_gather"] = take_peak(mt)
                longest_prefill(model, "cpu", rows, prompts, g.max_prompt_length,
                                g.max_prompt_length + g.max_completion_length, unset_fake_temporarily)
            out["rollout"] = take_peak(mt)
            if g.num_iterations > 1 or g.beta != 0.0:
                extra_logps(ms, [batch], g, (lambda: adapters_off(model)) if cfg.lora.enable else
                            (lambda: swapped(model, reference)))
                out["rollout_logps"] = take_peak(mt)
    finally:
        model.train(was_training)
    return out


def rollout_peak_bytes(phases: dict) -> int | None:
    """The largest of the rollout's phases, in bytes (None: not GRPO)."""
    totals = [phases[k].get("Total", 0) for k in ("rollout_gather", "rollout", "rollout_logps") if k in phases]
    return max(totals) if totals else None
