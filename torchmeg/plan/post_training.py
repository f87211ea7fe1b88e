"""What post-training holds beside the training step, planned as the trainer holds it.

GRPO (torchmeg.train.grpo, torchmeg.train.rollout):
- with grpo.beta > 0 and no LoRA a copy of the reference's parameters, each rank its shards, held for
  the whole run (`grpo.reference_weights`): cloned here from the traced model and told to the tracker,
  so every phase of the step counts it (under LoRA the reference is the base with the adapters off,
  `models.lora.adapters_off`: nothing held);
- the rollout before each step: every FSDP module unsharded (`rollout.gathered_weights`), the
  engine's slot KV cache for the rank's rows (global batch / data-parallel shares) at the longest
  prompt plus the longest completion, and the packed prefill of every prompt at its longest
  (`train.rollout.longest_prefill`: the engine's runner, one forward, the head on each prompt's last token): traced
  on fake tensors as its own memory phase (`rollout`). Decode steps hold less than that prefill and
  are not traced; the rollout's time is not in the plan's step time (its length depends on what the
  model writes).
DPO holds its reference as a table of log-probs, 16 bytes a pair (torchmeg.train.dpo): nothing beside
the step. SFT holds nothing beside it.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchmeg.plan.memory import peak_bytes, step_memory
from torchmeg.train.rollout import gathered_weights, longest_prefill


def reference_copy(cfg, model) -> list[torch.Tensor]:
    """GRPO with beta > 0: the trainer's copy of every local parameter shard (else nothing)."""
    if cfg.training.objective != "grpo" or cfg.grpo.beta == 0.0 or cfg.lora.enable:
        return []  # (under LoRA the reference is the base with the adapters off: no copy)
    with torch.no_grad():
        return [p.detach().clone() for p in model.parameters()]


def rollout_peak(cfg, layout, mesh, model, opt, reference: list[torch.Tensor]) -> dict[str, int]:
    """The rollout phase's peak snapshot (MemTracker's categories) on this rank."""
    g = cfg.grpo
    rows = layout.global_batch // mesh["dp_cp"].size()
    mt = step_memory()
    mt.track_external(model, opt, *reference)
    was_training = model.training
    model.eval()
    try:
        with mt, torch.no_grad(), gathered_weights(model):
            longest_prefill(model, "cpu", rows, g.max_prompt_length, g.max_prompt_length + g.max_completion_length,
                            unset_fake_temporarily)
    finally:
        model.train(was_training)
    return peak_bytes(mt)
