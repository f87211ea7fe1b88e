"""compile.verify_cache: the run's first step computed eagerly beside the compiled one.

A compiled program read from a compile cache can compute something other than the code it was
compiled from (torch 2.13's AOTAutograd cache handed a tensor-parallel rank another rank's program:
docs/limits.md). Nothing in a run shows it but a wrong loss. With `compile.verify_cache = true` the
first step's forward and backward run once with every compiled function in eager mode
(`torch.compiler.set_stance("force_eager")`), on the same batches and weights, before the compiled
step; the gradients it made are dropped, and so is what it counted on the side (MoE routing loads,
MTP and DPO/GRPO step sums), so the run trains as it would without the check. The compiled step's
loss and grad norm must then agree with the eager ones within compile's rounding, else the run stops
with one line naming the cache. Cost: one more step, eager.
"""
from __future__ import annotations

import math
import os

import torch

from torchmeg.config.errors import ConfigError
from torchmeg.train.build import forward_backward
from torchmeg.train.router_stats import discard_router_stats

# Compiled kernels fuse and reorder floating-point work: over one step, fp32 stays within ~1e-6
# relative (the suite bounds 10 steps at 1e-4, tests/test_compiler.py); bf16 keeps 8 mantissa bits
# (2^-8 = 3.9e-3 per rounding), float8 3; a wrong program is off by far more (the cached TP
# program of docs/limits.md: loss 12.47 for 6.08, or 0.0).
FP32_BOUND, LOW_PRECISION_BOUND = 1e-4, 5e-2


def eager_reference(tr, batches) -> tuple[float, float]:
    """The step's (loss, grad norm) with every compiled function run eagerly; leaves no gradient
    and no side statistic behind."""
    with torch.compiler.set_stance("force_eager"):
        got = tr.loss_and_norm(forward_backward(tr.step_fn, batches))
    tr.optimizer.zero_grad(set_to_none=True)
    discard_router_stats(tr.moe_layers, tr.mtp_models)
    if tr.step_fn.pairs is not None:
        tr.step_fn.pairs.discard_step()
    return got


def check_against_eager(tr, eager: tuple[float, float], compiled: tuple[float, float]) -> None:
    low = tr.cfg.training.mixed_precision == "bf16" or tr.cfg.float8.enable
    bound = LOW_PRECISION_BOUND if low else FP32_BOUND
    for name, e, c in zip(("loss", "grad norm"), eager, compiled):
        if not (math.isfinite(e) or math.isfinite(c)):
            continue  # (both non-finite: nothing to compare; the trainer's on_nonfinite decides)
        rel = abs(c - e) / max(abs(e), 1e-12)
        if not rel <= bound:
            raise ConfigError(
                f"compile.verify_cache: step {tr.state.step + 1}'s {name} is {c:.6g} compiled, {e:.6g} eager "
                f"(relative {rel:.2g} > {bound:g}): a compiled program computes something else; move the cache "
                f"aside (compile.cache_dir, now {_cache()}) and run again, or set compile.enable = false")
    if tr.rank == 0:
        print(f"[compile] verify_cache: step {tr.state.step + 1} compiled = eager (loss {compiled[0]:.6g} vs "
              f"{eager[0]:.6g}, grad norm {compiled[1]:.6g} vs {eager[1]:.6g}; bound {bound:g})", flush=True)


def _cache() -> str:
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
