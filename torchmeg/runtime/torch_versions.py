"""What the torch at hand runs correctly, checked before anything launches.

torchmeg declares torch 2.11 through 2.14 (pyproject). The whole suite passes on torch 2.13 (on
2.14.1 all but four planner tests, a test-worker-only case: docs/getting-started.md "torch versions").
On torch 2.11 (the full suite run there, 2026-11-27: 33 of 870 failed) these layouts fail inside
torch or, worse, train to other numbers than one process, so a recipe that asks for one of them on a
torch older than 2.13 is refused here with one line (torch 2.12 was not run: refused alike, conservatively):

- the V-shaped pipeline schedules (ZBVZeroBubble, DualPipeV): torch 2.11's stage-shape exchange
  sends a non-contiguous tensor over gloo and fails;
- pipeline parallel with a MoE or multi-token-prediction model: step losses differ from one process
  (DeepSeek-V3's mtp_loss by 19%, the MoE debug model by 2e-4, gpt-oss likewise);
- context parallel: the backward of its sequence all-gather meets a non-contiguous gradient;
- DeepSeek-V3's attention (MLA) under tensor parallel: DTensor cannot flatten the sequence-sharded
  activations there.

These are behaviours of torch releases, not features a program can probe, so this one module
compares version numbers; everything else asks torch for a feature (torchmeg.parallel.mxfp8's
`torch_has_mx_training`, the functional collectives' names where they are called).
"""
from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from torchmeg.config.errors import ConfigError

VERIFIED = (2, 13)  # the oldest torch on which the whole suite passes
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def check_torch_version(cfg, args, dims, version: str | None = None) -> None:
    """Refuse a layout the torch at hand (or `version`) is known to get wrong: one line naming the key,
    the torch and the fix."""
    v = TorchVersion(version or torch.__version__)
    if v >= VERIFIED:
        return
    p = cfg.parallelism
    moe = bool(getattr(args, "n_experts", 0)) or bool(getattr(args, "mtp_depth", 0))
    problem = None
    if dims.pp > 1 and p.pipeline_parallel_schedule in V_SCHEDULES:
        problem = (f"parallelism.pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r}: torch {v}'s pipeline "
                   f"stages fail to exchange shapes for the V-shaped schedules")
    elif dims.pp > 1 and moe:
        problem = (f"parallelism.pipeline_parallel_degree = {dims.pp} with {cfg.model.name}'s experts or MTP: on torch "
                   f"{v} the pipelined losses differ from one process")
    elif dims.cp > 1:
        problem = (f"parallelism.context_parallel_degree = {dims.cp}: on torch {v} the backward of context parallel's "
                   f"all-gather fails")
    elif dims.tp > 1 and getattr(args, "kv_lora_rank", 0):
        problem = (f"parallelism.tensor_parallel_degree = {dims.tp} with {cfg.model.name}'s MLA attention: torch {v}'s "
                   f"DTensor cannot flatten its sequence-sharded activations")
    if problem:
        raise ConfigError(f"{problem}; install torch>=2.13 (pip install 'torch>=2.13'), or choose another layout "
                          f"(docs/getting-started.md, torch versions)")
