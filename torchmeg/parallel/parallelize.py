"""THE pass: a plain single-device model -> a distributed one, in a fixed order.

  0. float8 (torchao)             swaps nn.Linear for Float8Linear first, so that step 1 can
                                  choose torchao's Float8 TP styles for the converted layers; or
                                  MXFP8 (float8.recipe mxfp8*): the Linears' weights wrapped
  1. tensor / sequence parallel   DTensor plans need the un-wrapped modules
  2. context parallel, expert parallel (swap attention / expert dispatch; shard experts over ep)
  4. activation recompute         wraps blocks
  5. torch.compile per block      after recompute wrapping, before FSDP so its hooks stay outside
  6. data parallel                FSDP2 per block then root, HSDP or DDP; mixed precision
Each step is a no-op when its degree is 1 / its feature is off. Pipeline parallelism splits the
model into stages first; each stage then goes through this pass.
"""
from __future__ import annotations

import contextlib

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.distributed._symmetric_memory import enable_symm_mem_for_group

from torchmeg.parallel.compile import compile_blocks, setup
from torchmeg.config.support import device_type
from torchmeg.parallel.float8 import apply_float8, is_float8_linear, resolve_emulate
from torchmeg.parallel.mxfp8 import MX_RECIPES, apply_mxfp8, is_mx_experts, is_mx_linear, mx_tensor_parallel
from torchmeg.parallel.mxfp8 import resolve_emulate as resolve_mx_emulate
from torchmeg.models.blocks import find_blocks
from torchmeg.parallel.context import apply_cp
from torchmeg.parallel.data import apply_ddp, apply_fsdp
from torchmeg.parallel.dims import ParallelDims
from torchmeg.parallel.expert import apply_ep
from torchmeg.parallel.pipeline import splits_backward
from torchmeg.parallel.tensor import apply_tp, unmatched_patterns
from torchmeg.parallel.recompute import apply_recompute


_PROGRAM_FOR: str | None = None  # the device whose program parallelize() builds, where not the run's


@contextlib.contextmanager
def program_for(device: str):
    """Build the program `device` would run, where a choice depends on it (torchmeg.plan's dry run on
    CPU plans what a GPU runs: float8 TP casts the shard and all-gathers float8, which only NCCL
    moves)."""
    global _PROGRAM_FOR
    before, _PROGRAM_FOR = _PROGRAM_FOR, device
    try:
        yield
    finally:
        _PROGRAM_FOR = before


def parallelize(model: nn.Module, dims: ParallelDims, cfg, mesh=None, tp_plan=None, blocks: str | None = None,
                ep_mesh=None, plan_must_match: bool = True) -> nn.Module:
    """Apply every enabled parallelism to `model` in place and return it.

    `mesh` / `ep_mesh` default to `dims.build_mesh(...)` / `dims.build_ep_mesh(...)`; `tp_plan`
    is a list of (FQN pattern, role) (see torchmeg.parallel.tensor), needed when tensor parallel is
    on: the trainer passes its registry entry's (`torchmeg.models.spec_tp_plan`), a model with a
    `tp_plan()` method (Hugging Face models) gives its own. A pattern matching no module is an error unless
    `plan_must_match` is False (a registry plan serves every flavor of a model, e.g. MoE with and
    without dense layers) or the model is a pipeline stage (it lacks other stages' modules).
    `blocks` names the container of the model's repeated blocks (default: recipe key model.blocks,
    else found: torchmeg.models.blocks). What was done is in `model.torchmeg_report` (a dict) and
    `describe_report()`; nothing enabled is ever silently skipped.
    """
    device = device_type(cfg)
    if mesh is None:
        mesh = dims.build_mesh(device)
    if ep_mesh is None:
        ep_mesh = dims.build_ep_mesh(device)
    p = cfg.parallelism
    path, container = find_blocks(model, cfg.model.blocks if blocks is None else blocks)
    report = {"blocks": path, "n_blocks": len(container) if container is not None else 0}
    float8_tp = False
    if cfg.float8.enable and cfg.float8.recipe in MX_RECIPES:
        _apply_mxfp8(model, cfg, device, report)
    elif cfg.float8.enable:
        converted = apply_float8(model, cfg.float8, device)
        report["float8_linears"] = sum(1 for m in model.modules() if is_float8_linear(m))
        report["float8_emulated"] = resolve_emulate(cfg.float8.emulate, device)
        # torchao's Float8 TP styles all-gather float8 tensors, a dtype NCCL moves and gloo
        # rejects ("Invalid scalar type"); elsewhere the plain styles shard the Float8Linears.
        float8_tp = converted and cfg.float8.recipe == "tensorwise" and (_PROGRAM_FOR or device) == "cuda"
    if dims.tp > 1:
        if tp_plan is None and callable(getattr(model, "tp_plan", None)):
            tp_plan = model.tp_plan()
        if tp_plan is None:
            raise ValueError(f"parallelism.tensor_parallel_degree = {dims.tp}: parallelize() needs tp_plan=[(FQN "
                             f"pattern, role), ...] (roles: torchmeg.parallel.tensor); for a registered model: "
                             f"torchmeg.models.spec_tp_plan(torchmeg.models.get_spec(name), model)")
        # Under PP the last stage's logits feed the schedule's loss: keep them gathered.
        # A model may decline SP (e.g. a Hugging Face model with eager attention builds its mask
        # from the local sequence length): it then runs plain TP, and the report says so.
        sp = p.sequence_parallel and getattr(model, "supports_sequence_parallel", True)
        report["sequence_parallel"] = sp  # (a fused LM head + loss gathers a sequence-sharded output itself)
        if p.sequence_parallel and not sp:
            report["sp_off"] = getattr(model, "sequence_parallel_note", "not supported by the model")
        matched = apply_tp(model, mesh["tp"], tp_plan, sp, dims.uses_loss_parallel(p), float8_tp)
        unmatched_patterns(matched, strict=plan_must_match and dims.pp == 1)
        report["tp_plan"] = matched
        if "mxfp8_linears" in report:
            mx_tensor_parallel(model)
        if p.enable_async_tensor_parallel:
            _enable_async_tp(mesh["tp"])
    if dims.cp > 1:
        # (a pipeline stage past the first takes the hidden state sequence-sharded over TP under SP)
        shards = dims.tp if dims.tp > 1 and report.get("sequence_parallel") else 1
        report["cp_attention"] = apply_cp(model, mesh["cp"], p.context_parallel_mode, hidden_seq_shards=shards)
    expert_mesh = None
    if dims.ep > 1 or dims.experts_over_tp:
        apply_ep(model, ep_mesh[dims.expert_dispatch_dim], p.expert_capacity_factor)
        # (HSDP: the experts replicated over dp_replicate and sharded over efsdp, as the rest)
        expert_mesh = ep_mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else ep_mesh["efsdp"]
    if cfg.activation_checkpoint.mode != "none":
        report["recompute_blocks"] = apply_recompute(model, cfg.activation_checkpoint, path)
    if cfg.compile.enable and "model" in cfg.compile.components:
        setup(cfg.compile.cache_dir)
        if splits_backward(cfg, dims):
            # The split-backward schedules run the input-gradient pass with retain_graph=True (the
            # weight-gradient pass comes later), which AOTAutograd's donated buffers refuse
            # ("compiled with non-empty donated buffers", torch 2.13): compile without them.
            functorch_config.donated_buffer = False
        report["compiled_blocks"] = compile_blocks(model, tp=dims.tp > 1, cp=dims.cp > 1, blocks_path=path,
                                                   documents=cfg.data.document_masking)
    # bf16 always goes through FSDP2's MixedPrecisionPolicy (a 1-rank mesh if need be), so one
    # precision recipe (bf16 compute, fp32 master weights and reductions) holds in every layout.
    if dims.fsdp > 1 or (cfg.training.mixed_precision == "bf16" and dims.dp_replicate == 1):
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        report["fsdp_units"] = apply_fsdp(model, dp_mesh, cfg.training.mixed_precision, reshard_after_forward(cfg, dims),
                                          expert_mesh, path)
    elif dims.dp_replicate > 1:
        report["fsdp_units"] = apply_ddp(model, mesh["dp_replicate", "dp_shard_cp"], cfg.training.mixed_precision, path)
    model.torchmeg_report = report
    return model


def _apply_mxfp8(model: nn.Module, cfg, device: str, report: dict) -> None:
    out_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    apply_mxfp8(model, cfg.float8, device, out_dtype, tp=cfg.parallelism.tensor_parallel_degree)
    report["mxfp8_linears"] = sum(1 for m in model.modules() if is_mx_linear(m))
    report["mxfp8_experts"] = sum(1 for m in model.modules() if is_mx_experts(m))
    report["mxfp8_emulated"] = resolve_mx_emulate(cfg.float8.emulate, device)


def describe_report(report: dict) -> str:
    """One line: what parallelize() did to a model."""
    parts = [f"blocks {report['n_blocks']} at {report['blocks']!r}" if report.get("blocks") else "no blocks found"]
    if "tp_plan" in report:
        tp = report["tp_plan"]
        parts.append(f"TP {len(tp)} plan entries -> {sum(tp.values())} modules"
                     + (f" (sequence parallel off: {report['sp_off']})" if "sp_off" in report else ""))
    if "cp_attention" in report:
        parts.append(f"CP {report['cp_attention']} attention modules")
    if "float8_linears" in report:
        parts.append(f"float8 {report['float8_linears']} linears" + (
            " (EMULATED: float8 math in high precision, no float8 matmul units here)"
            if report.get("float8_emulated") else " (float8 matmuls)"))
    if "mxfp8_linears" in report:
        parts.append(f"mxfp8 {report['mxfp8_linears']} linears"
                     + (f" + {report['mxfp8_experts']} grouped experts" if report.get("mxfp8_experts") else "") + (
            " (EMULATED: MX blocks quantized and dequantized, matmuls in high precision; MXFP8 tensor cores are "
            "sm_100's)" if report.get("mxfp8_emulated") else " (MXFP8 matmuls)"))
    if "recompute_blocks" in report:
        parts.append(f"recompute {report['recompute_blocks']} blocks")
    if "compiled_blocks" in report:
        parts.append(f"compiled {report['compiled_blocks']} blocks")
    if "fsdp_units" in report:
        parts.append(f"FSDP {report['fsdp_units']} units")
    return "; ".join(parts)


def reshard_after_forward(cfg, dims: ParallelDims) -> bool:
    """fsdp_reshard_after_forward without PP. Under PP, fsdp_reshard_per_microbatch (default off,
    as torchtitan): torch's stages keep the gathered weights through every microbatch's backward
    and reduce once per step, so resharding after each forward only re-gathers the stage once per
    microbatch (16 all-gathers a step at 16 microbatches). Never under the split-backward
    schedules: their weight-gradient pass (W) runs after FSDP's post-backward hook has fired on the
    input-gradient pass (I), and with resharded weights the W gradients of sharded parameters come
    out wrong (grad norm 13.4 instead of 17.7 at PP2 x FSDP2 ZBVZeroBubble, torch 2.13; measured)."""
    p = cfg.parallelism
    if dims.pp == 1:
        return p.fsdp_reshard_after_forward
    return p.fsdp_reshard_after_forward and p.fsdp_reshard_per_microbatch and not splits_backward(cfg, dims)


def _enable_async_tp(tp_mesh) -> None:
    """Inductor's micro-pipelined TP: overlaps the TP all-gather/reduce-scatter with matmuls
    (CUDA only: needs symmetric memory). Validation refuses it elsewhere."""
    import torch._inductor.config as inductor_config  # lazy: only async TP needs it, and a job start is spared it
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
