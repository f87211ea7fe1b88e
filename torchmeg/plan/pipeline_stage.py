"""One pipeline stage measured as torch's pipeline stage runs it under FSDP.

torch.distributed.pipelining (stage.py, torch 2.13) runs every microbatch's backward with FSDP's
gradient sync and post-backward reshard off, and reduces once per step (`perform_reduce_grad`):
once gathered, a stage's weights stay gathered to that reduce, and its gradients accumulate
unsharded, in the reduce dtype, until then. So a stage is measured in four parts, on fake or real
tensors alike:

1. the root's own parameters gathered (embeddings, final norm, output head): one all-gather set;
2. what the first microbatch leaves held to the reduce (`kept`: the gathered weights, and the
   unsharded accumulated gradients its backward makes, `kept_grads`), and the blocks' all-gather
   set: FSDP's own unshard of each block, then each trainable weight (but TP's replicated ones)
   given its gradient and FSDP's own end-of-backward callback (_first_backward_state), not a traced
   forward and backward;
3. a microbatch over gathered weights: its activations, transient peaks, ops and the
   collectives every microbatch issues (TP, CP, EP);
4. the reduce itself (reduce-scatter, HSDP all-reduce, the 1/microbatches scaling): once a step.

How many times a step gathers a stage (per microbatch when `fsdp_reshard_per_microbatch`, and
after the multi-stage schedules' evictions) is the schedule's: parallel.pipeline_order.fsdp_gathers.
"""
from __future__ import annotations

import types

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate

from torchmeg.observe.metrics import local_bytes
from torchmeg.plan.memory import current_bytes, peak_bytes, step_memory
from torchmeg.plan.step_cost import StepCost

# Mesh dims whose collectives only FSDP issues inside a microbatch (efsdp: the experts' FSDP).
FSDP_DIMS = ("dp_shard", "dp_shard_cp", "dp_replicate", "dp", "efsdp")


def measure_stage(part, opt, labels, x, loss_fn, y, n_micro: int, kw: dict, reshard_per_microbatch: bool,
                  received: bool = False) -> dict:
    """-> {act, fwd_transient, bwd_transient, out_bytes, flops, ops, comm (per microbatch), kept,
    kept_grads (the part of kept the first backward makes), recv_bytes, own_grads, gather_root,
    gather_blocks, reduce (comm tables), reduce_ops}. `loss_fn`: the last stage's loss (None on the
    others); `kw`: the model's keyword inputs; `received`: x comes from the previous stage (into a
    receive buffer, counted in recv_bytes, not as an activation)."""
    blocks = [m for m in part.modules() if isinstance(m, FSDPModule) and m is not part]
    if isinstance(part, FSDPModule):
        part.set_requires_gradient_sync(False)  # as torch's stage, for every microbatch's backward
        part.set_reshard_after_backward(False)
    for m in blocks:
        m.set_reshard_after_forward(False)  # measured with weights held: its bytes are activations only
    root_cost, cold_cost, cost, reduce_cost = (StepCost(labels) for _ in range(4))
    mt = step_memory()
    mt.track_external(part, opt)
    with mt:
        base0 = current_bytes(mt) - current_bytes(mt, "Gradient")
        with root_cost:
            if isinstance(part, FSDPModule):
                part.unshard()
        # (FSDP blocks always have an FSDP root: parallel.data.apply_fsdp shards the root after them)
        with cold_cost:
            for m in blocks:
                m.unshard()  # each block's all-gather, as the first microbatch's forward issues it
        gathered = current_bytes(mt) - current_bytes(mt, "Gradient") - base0
        _first_backward_state(part)
        # The parameters' own gradients are counted with the model state: only what FSDP holds besides.
        # Without FSDP the gradients given are those very ones (autograd accumulates into them), which
        # the tracker, seeing them made rather than accumulated, files under no gradient category.
        own_grads = 0 if isinstance(part, FSDPModule) else sum(
            local_bytes(p.grad) for p in part.parameters() if p.grad is not None)
        kept = current_bytes(mt) - current_bytes(mt, "Gradient") - base0 - own_grads
        # what of `kept` the first backward makes (FSDP's unsharded accumulated gradients), not the first forward
        kept_grads = kept - gathered
    mt = step_memory()
    # The gradients FSDP accumulates unsharded are counted in `kept`: told to this tracker, the second
    # microbatch's in-place accumulation into them is not counted again as new bytes (it was, as a
    # transient the size of the stage's reduce-dtype gradients: 23 GiB a rank in the 405B PP 8 plan).
    # torch's stage receives a microbatch's input into a buffer of its own and its output gradient into
    # another, kept for the whole run (one per microbatch each way: parallel.pipeline.Pipeline.recv_buffers),
    # so neither is the microbatch's: the input is told to the tracker before `base` (it would be counted as
    # an activation when the forward reads it) and the output gradient's bytes come off the backward's
    # transient; both are `recv_bytes`, n_micro of each.
    mt.track_external(part, opt, *accumulated_grads(part), *([x] if received else []))
    cost.memory = mt
    with mt, cost:
        base = current_bytes(mt)
        out_bytes, after_fwd, fwd_peak, grad_bytes = _microbatch(part, x, kw, loss_fn, y, mt)
        # the peak of both passes (>= forward's), the output gradient's buffer not in it
        bwd_peak = max(fwd_peak, peak_bytes(mt).get("Total", 0) - grad_bytes)
    for m in blocks:
        m.set_reshard_after_forward(reshard_per_microbatch)
    with reduce_cost:
        _reduce_grads(part, n_micro)
    fsdp = lambda table: {k: c for k, c in table.items() if k.split("/")[0] in FSDP_DIMS}  # noqa: E731
    return {"act": after_fwd - base, "fwd_transient": max(0, fwd_peak - after_fwd),
            "bwd_transient": max(0, bwd_peak - after_fwd), "out_bytes": out_bytes, "flops": cost.flops,
            "recv_bytes": n_micro * ((local_bytes(x) if received else 0) + grad_bytes), "own_grads": own_grads, "kept_grads": kept_grads,
            "ops": cost.ops, "comm": cost.comm_table(), "kept": kept, "gather_root": fsdp(root_cost.comm_table()),
            "gather_blocks": fsdp(cold_cost.comm_table()), "reduce": reduce_cost.comm_table(),
            "reduce_ops": reduce_cost.ops}


def _first_backward_state(part) -> None:
    """What a stage's first microbatch leaves held, without tracing its forward and backward (half of
    a pipeline trace's time): every trainable weight, gathered, given the gradient autograd's first
    backward gives it (the weight's shape, dtype and placements; the values matter neither on fake
    tensors nor to a byte count), then, under FSDP, FSDP's own end-of-backward callback, which runs
    each parameter group's post-backward as for a backward that reached none of them: with gradient
    sync off the gradient stays unsharded, or moves into FSDP's accumulated gradient of the reduce
    dtype. The bytes held and the all-gathers are a traced first microbatch's, but for the stage's
    input, which a traced one had left tracked here as well as in the next microbatch's activations
    (every number of ten PP plans compared, the 70B, the 405B, MoE, float8 and LoRA among them:
    docs/planning.md)."""
    give_gradients(part)
    end_first_backward(part)


def give_gradients(part) -> None:
    """Every trainable weight given a gradient of its shape, dtype and placements (FSDP's gathered
    weights: registered on the modules while unsharded), but one replicated along a mesh dim that is
    not FSDP's (tensor parallel's norms): autograd may leave its gradient Partial there (sequence
    parallel), which a given one would not be, and adding the next microbatch's Partial gradient to a
    Replicate one all-reduces it, where the real run all-reduces once, at the reduce or the update
    (a PP 2 x TP 2 plan counted 10 and 18 TP all-reduces on its two ranks where the run issues 18
    and 28). Such a weight's gradient is made by the microbatch traced next: its few bytes counted
    there, and no add of the accumulation for it."""
    for p in part.parameters():
        if p.requires_grad and not replicated_beside_fsdp(p):
            p.grad = gradient_like(p)


def gradient_like(p: torch.Tensor) -> torch.Tensor:
    """The gradient autograd gives weight p: zeros of its shape, dtype and placements, a plain tensor
    (or a DTensor of one) where p's data is a subclass's. Under FSDP's float8 all-gather a gathered
    weight is torchao's Float8TrainingTensor, whose dispatch runs no zeros_like (the planner stopped on
    it: 'attempting to run aten.zeros_like.default'); its gradient in the run is of the weight's high
    precision dtype, which the subclass reports as its dtype."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if type(local) in (torch.Tensor, torch.nn.Parameter) or isinstance(local, FakeTensor):
        return torch.zeros_like(p)
    zeros = torch.zeros(local.shape, dtype=local.dtype, device=local.device)
    if not isinstance(p, DTensor):
        return zeros
    return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def replicated_beside_fsdp(p) -> bool:
    """Whether p is a DTensor replicated along a mesh dim other than FSDP's."""
    return isinstance(p, DTensor) and any(
        dim not in FSDP_DIMS and isinstance(pl, Replicate) for dim, pl in zip(p.device_mesh.mesh_dim_names, p.placements))


def end_first_backward(part) -> None:
    """Under FSDP, FSDP's own end-of-backward callback, as after a first backward (gradient sync as set)."""
    if isinstance(part, FSDPModule):
        state = part._get_fsdp_state()
        state._lazy_init()  # (as the first forward begins: this module the root)
        state._root_post_backward_final_callback()


def accumulated_grads(part, resharded: bool = False) -> list[torch.Tensor]:
    """FSDP's unsharded gradients held in the reduce dtype between a stage's microbatches; `resharded`:
    also those kept on the weights' unsharded parameters (the reduce dtype being the weights'), which
    the modules no longer hold once FSDP has resharded them (no pipeline)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in part.modules() if isinstance(m, FSDPModule)]
    grads = [fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None or not resharded
             else getattr(getattr(fp, "_unsharded_param", None), "grad", None)
             for g in groups if g is not None for fp in g.fsdp_params]
    return [t for t in grads if t is not None]


def _microbatch(part, x, kw, loss_fn, y, mt=None):
    """One forward + backward of the stage (the last one's loss, the others' output gradient of
    ones) -> (output bytes, bytes held after forward, the forward's peak, the output gradient's bytes:
    0 on the last stage); the output and the input's gradient are dropped after, as the schedule
    sends and frees them."""
    out = part(x, **kw)
    after_fwd = current_bytes(mt) if mt is not None else 0
    fwd_peak = peak_bytes(mt).get("Total", 0) if mt is not None else 0
    grad_bytes = 0
    if loss_fn is not None:
        loss_fn(out, y).backward()
    else:
        grad = torch.ones_like(out)
        grad_bytes = local_bytes(grad)
        out.backward(grad)
    out_bytes = out.numel() * out.element_size()
    if isinstance(x, torch.Tensor) and x.requires_grad:
        x.grad = None
    return out_bytes, after_fwd, fwd_peak, grad_bytes


def _reduce_grads(part, n_micro: int) -> None:
    """torch's own `perform_reduce_grad`, the action a schedule runs after a stage's last backward
    (FSDP's post-backward with gradient sync and reshard on, then gradients / microbatches), on
    the stage module alone: it reads nothing of the stage object but `submod`."""
    stage = types.SimpleNamespace(submod=part)
    stage.scale_grads = lambda factor: _PipelineStageBase.scale_grads(stage, factor)
    _PipelineStageBase.perform_reduce_grad(stage, n_micro)
