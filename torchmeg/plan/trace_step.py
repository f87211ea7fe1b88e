"""One traced training step of a model on a rank: the trainer's build (split, the real parallelize(),
storage under FakeTensorMode, or the real tensors of a running trainer for `--measure`), one step run
under torch's MemTracker (memory by category, peak; the backward split at every block,
memory.step_memory) and StepCost (ops, FLOPs, bytes, collectives by mesh dim). The optimizer's
state is created first by an untracked update, as step 1 of a real run does. torchmeg.plan.dry_run
decides what is traced (a few layers, torchmeg.plan.depth) and combines the traces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _foreach_supported_types

from torchmeg.config.layout import Layout
from torchmeg.observe.metrics import model_state_bytes
from torchmeg.parallel.float8 import precompute_scales, precomputes_scales
from torchmeg.parallel.parallelize import program_for
from torchmeg.plan.local_update import on_local_shards
from torchmeg.plan.post_training import reference_copy, rollout_phases
from torchmeg.plan.memory import current_bytes, peak_bytes, step_memory, take_peak
from torchmeg.plan.pipeline_stage import accumulated_grads, end_first_backward, give_gradients, replicated_beside_fsdp
from torchmeg.plan.step_cost import StepCost
from torchmeg.train.build import GlobalTargetMean, ModelStep, build_parallel_model, forward_backward, loss_function
from torchmeg.train.dpo import DPOLoss
from torchmeg.train.grpo_loss import GRPOLoss, RolloutRows
from torchmeg.train.optim import build_optimizer, grad_norm, reduce_partial_grads
from torchmeg.train.router_stats import reduce_router_stats, router_modules


class Measurement(dict):
    """Per-rank numbers of one step: memory (bytes), flops, ops (flops, bytes, dtype), comm."""


class MicrobatchMarks:
    """A step's microbatches, run as at most three: the first, one middle one and the last are
    the only kinds a step has (the first creates the accumulated gradients, every middle one
    starts from them with no gradient sync, the last syncs), so the memory peak of three is the
    step's, and its ops and collectives are those of three plus `more` copies of the middle one's.
    `first_given`: the first microbatch's lasting effect was given instead of traced
    (give_first_microbatch): the middle and the last are run, and the first counts as a middle
    one without the ops that accumulate a gradient (track_step). Iterating notes, where each
    microbatch begins, the bytes held and the StepCost tables (`memory` and `cost`, set by
    track_step)."""

    def __init__(self, make_batch, accum: int, first_given: bool = False):
        self.batches = [make_batch() for _ in range(2 if first_given else min(accum, 3))]
        self.more = accum - len(self.batches)
        self.middle = 0 if first_given else 1  # the index of the middle microbatch run
        self.cost, self.memory, self.marks = None, None, []

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            self.marks.append((current_bytes(self.memory), self.cost.mark()))
            yield b
        self.marks.append((current_bytes(self.memory), self.cost.mark()))


def first_microbatch_given(model, accum: int) -> bool:
    """Whether a step's first microbatch is given (give_first_microbatch) rather than traced: with three
    microbatches or more (with two, the first is the only one without the sync and the last the only
    one with it), on a model whose gradients are plain tensors or FSDP's, sharded along every mesh dim
    but FSDP's. A weight replicated along another dim (tensor parallel's norms) gets a gradient that
    autograd may leave Partial, which a given one would not be (its accumulation then all-reduces);
    replicate's DDP keeps buckets of its own."""
    if accum < 3:
        return False
    params = [p for p in model.parameters() if p.requires_grad]
    if not isinstance(model, FSDPModule):
        return not hasattr(model, "set_requires_gradient_sync") and not any(isinstance(p, DTensor) for p in params)
    return not any(replicated_beside_fsdp(p) for p in params)  # (a weight's placements: Shard or Replicate)


def give_first_microbatch(model, labels) -> tuple[list[torch.Tensor], StepCost]:
    """What a step's first microbatch leaves to the next, given without tracing its forward and
    backward (a third of a three-microbatch trace's time): every trainable weight given the gradient
    autograd's first backward gives it (its shape, dtype and placements; values matter neither on fake
    tensors nor to a byte count), and under FSDP each block gathered for it and FSDP's own
    end-of-backward callback run with gradient sync off, as after the first of several microbatches:
    the gradient stays unsharded, or moves into FSDP's accumulated gradient of the reduce dtype
    (torchmeg.plan.pipeline_stage gives a pipeline stage's first microbatch the same way). Run before
    the step is tracked -> (the tensors it leaves held that the tracker does not find through the
    model: FSDP's unsharded gradients; the ops of the callback, which the first microbatch runs where
    a later one accumulates: MicrobatchMarks). The first microbatch's other ops and its collectives are
    a middle one's (track_step)."""
    cost = StepCost(labels)
    if not isinstance(model, FSDPModule):
        give_gradients(model)
        return [], cost
    model.set_requires_gradient_sync(False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
    give_gradients(model)
    with cost:
        end_first_backward(model)
    return accumulated_grads(model, resharded=True), cost


def track_step(run, model_parts, optimizer, labels, microbatches=None, phased: bool = False,
               marks: dict | None = None, held: list | None = None, first=None) -> Measurement:
    """Run `run()` (one training step) under MemTracker + StepCost. With `microbatches` (a
    MicrobatchMarks the step iterates), its middle microbatch's ops and collectives count
    `microbatches.more` extra times. `phased`: run(between) calls between() once forward and backward
    are done, and memory_phases holds the peak of each side of it (forward_backward, update): each
    scales with the depth on its own line (activations; state + gradients), so a plan that traces a
    few layers takes the larger only once scaled (torchmeg.plan.depth); `marks` (block -> layer key)
    split the backward further, at each of those blocks (memory.step_memory); `held`: tensors the
    trainer keeps beside the model and optimizer (GRPO's reference weights); `first`: gives the step's
    first microbatch (give_first_microbatch, with `microbatches` made first_given): it counts as a
    middle one without the ops that accumulate a gradient, and with those `first` returns."""
    # (the tensors `first` leaves held are told to the tracker, not kept here: FSDP frees them at its reduce)
    first_held, first_cost = first() if first is not None else ([], None)
    mt = step_memory(marks)
    mt.track_external(*model_parts, optimizer, *(held or []), *first_held)
    del first_held
    cost = StepCost(labels, memory=mt)
    if microbatches is not None:
        microbatches.cost, microbatches.memory = cost, mt
    own = vars(optimizer).get("step")
    update = optimizer.step

    def eager_update(*a, **k):  # the trainer compiles model and loss, never the update
        with cost.eager(), on_local_shards(optimizer, cost):
            return update(*a, **k)
    optimizer.step = eager_update
    phases = {}
    try:
        with mt, cost, _fsdp_accumulation_marked(cost):
            if phased:
                run(lambda: phases.update(mt.segments, forward_backward=take_peak(mt)))
            else:
                run()
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own
    mem = peak_bytes(mt)
    if phased:
        phases["update"] = mem
    if microbatches is not None and microbatches.more:
        (held1, c1), (held2, c2) = microbatches.marks[microbatches.middle:microbatches.middle + 2]
        if first_cost is not None:  # the first microbatch: a middle one that accumulates nothing
            cost.repeat(c1, c2, 1, first=True)
            cost.extend(first_cost)
        cost.repeat(c1, c2, microbatches.more - (first_cost is not None))
        # Whatever a middle microbatch leaves held (a few KiB of batch-sized bytes here) is held
        # once more per extra microbatch at the peak, which comes in the last one (or after it).
        for snap in phases.values() if phased else [mem]:
            snap["Total"] = snap.get("Total", 0) + max(0, held2 - held1) * microbatches.more
    if phased:
        mem = peak_phase(phases)
    return Measurement(memory=mem, memory_phases=phases, flops=cost.flops, ops=cost.ops, comm=cost.comm_table(),
                       flops_by_op=cost.flops_by_op())


@contextlib.contextmanager
def _fsdp_accumulation_marked(cost: StepCost):
    """The ops of FSDP's accumulation of a microbatch's gradient into the one it holds in the reduce
    dtype marked as such (StepCost.accumulating; autograd's own accumulation is marked by its node)."""
    accumulate = FSDPParam.accumulate_unsharded_grad_if_needed

    def marked(self):
        cost.accumulating = True
        try:
            return accumulate(self)
        finally:
            cost.accumulating = False
    FSDPParam.accumulate_unsharded_grad_if_needed = marked
    try:
        yield
    finally:
        FSDPParam.accumulate_unsharded_grad_if_needed = accumulate


def peak_phase(phases: dict) -> dict:
    """The snapshot of the phase with the larger total: the step's peak."""
    return dict(max(phases.values(), key=lambda snap: snap.get("Total", 0)))


def build(cfg, layout: Layout, mesh, ep_mesh, keep):
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with program_for(target_device(cfg)):  # the planned device's program (a GPU's: float8 TP styles), built on CPU
        built = build_parallel_model(cfg, layout, mesh, ep_mesh, torch.device("cpu"), None, schedule=False,
                                     storage=lambda: fake, keep_layers=keep)
    return built, fake


def target_device(cfg) -> str:
    """The device type the plan is for: "cpu" (plan.gpu = cpu: this machine) or "cuda"."""
    return "cpu" if cfg.plan.gpu == "cpu" else "cuda"


def gpu_optimizer(model, cfg):
    """The trainer's optimizer (train.optim.build_optimizer) with the update a GPU runs. torch's Adam and
    AdamW leave `foreach` unset and pick at each step (torch.optim.optimizer._default_to_fused_or_foreach):
    the multi-tensor update (one `_foreach_*` kernel per step of the formula, over every parameter,
    with one temporary the size of all of them) when every parameter is a plain tensor, a Parameter or
    a DTensor on a GPU; the loop over parameters on a CPU. The plan's fake parameters are on the CPU,
    so the choice a GPU makes is set here: traced on the CPU's default, the plan timed the per-parameter
    loop a GPU never runs (3-4% of the 8B's and gpt-oss-20b's predicted step). torch's rule as its
    adam() applies it: only when neither foreach nor fused was set, never differentiable, and not for a
    tensor learning rate without capturable. A parameter outside a DTensor is a FakeTensor here: the
    plain tensor it stands for. A plan for a CPU keeps the CPU's own choice."""
    opt = build_optimizer(model, cfg)
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW) and target_device(cfg) == "cuda":
        for g in opt.param_groups:
            if g["foreach"] is None and g["fused"] is None:
                tensor_lr = isinstance(g["lr"], torch.Tensor) and not g["capturable"]
                on_gpu = all(type(p) in _foreach_supported_types or type(p) is FakeTensor for p in g["params"])
                g["foreach"] = not g["differentiable"] and not tensor_lr and on_gpu
    return opt


def measure_step(cfg, layout: Layout, mesh, ep_mesh, labels, keep) -> dict:
    """One step of a model without pipeline stages (the layers in `keep`, or all), tracked."""
    built, fake = build(cfg, layout, mesh, ep_mesh, keep)
    device = torch.device("cpu")
    with fake:
        model = built.model
        opt = gpu_optimizer(model, cfg)
        L, B, vocab = layout.seq_len, layout.local_batch, layout.args.vocab_size
        R = B * layout.rows_per_sample  # dpo: a pair is two rows (and its pair number rides along)
        extra = (torch.zeros(B, dtype=torch.int64),) if layout.rows_per_sample == 2 else ()
        if cfg.training.objective == "grpo":  # the training step over rollout rows (the rollout itself: a phase of its own)
            g = cfg.grpo  # (and the old policy's / the reference's log-probs where the loss reads them)
            extra = (RolloutRows(torch.zeros(R), torch.zeros(R, L), torch.zeros(R, L) if g.num_iterations > 1 else None,
                                 torch.zeros(R, L) if g.beta != 0.0 else None),)
        given = first_microbatch_given(model, layout.accum)
        batches = MicrobatchMarks(lambda: (torch.randint(0, vocab, (R, L)), torch.randint(0, vocab, (R, L)), *extra),
                                  layout.accum, first_given=given)
        loss = loss_function(cfg, built)
        if isinstance(loss, GRPOLoss):
            loss.token_scale = 1.0  # dapo: fake rollouts have no token count; one number either way
        if isinstance(loss, DPOLoss):
            loss.table = torch.zeros(1, 2, dtype=torch.float64)  # reference log-probs: values do not change the plan
        if isinstance(loss, GlobalTargetMean):
            loss.scale = 1.0  # sft: fake labels have no count to read; the scale is one number either way
        # The trainer's own microbatch loop, over the (at most three) microbatches planned.
        ms = dataclasses.replace(ModelStep.of(built, layout, mesh, device, loss), accum=len(batches), targets=None)
        loss_group = mesh["dp_cp"].get_group()
        scales = float8_scales(cfg, layout, model)
        step = update_step(lambda: (dist.all_reduce(forward_backward(ms, batches), group=loss_group),
                              router_stats(built, layout, mesh)), model, opt, [], after=scales)
        state = create_optimizer_state(model, opt)
        reference = reference_copy(cfg, model)  # (GRPO's, held for the whole run: torchmeg.plan.post_training)
        layers = getattr(model, layout.spec.layers_attr, None)
        marks = {block: key for key, block in layers.items()} if isinstance(layers, torch.nn.ModuleDict) else {}
        m = track_step(lambda between: (step(between), opt.zero_grad(set_to_none=True)), [model], opt, labels, batches,
                       phased=True, marks=marks, held=reference,
                       first=(lambda: give_first_microbatch(model, labels)) if given else None)
        if cfg.training.objective == "grpo":
            m["memory_phases"].update(rollout_phases(cfg, layout, mesh, model, opt, reference, ms, batches.batches[0]))
        return {"step": m, "state": state, "reports": {0: dict(model.torchmeg_report)}}


def create_optimizer_state(model, opt) -> int:
    """Step 1's lasting effect without running step 1: zero gradients and one update create the
    optimizer's state. -> parameter + gradient + optimizer bytes, counted when all three exist
    (where the trainer measures model_state_mib)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    # torch's Adam / AdamW create their state in step()'s _init_group, then do the update's arithmetic
    # in the module-level adam(): untracked, on fake tensors, that arithmetic is 14% of a trace's time
    # and leaves nothing behind, so it is skipped here (other optimizers, Muon's, step in full).
    adam = importlib.import_module("torch.optim.adam")  # (the submodule: torch.optim hides the name)
    saved = adam.adam
    adam.adam = lambda *a, **k: None
    try:
        opt.step()
    finally:
        adam.adam = saved
    state = model_state_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    return state


def update_step(forward_backward, model, opt, extra_groups, after=lambda: None):
    """The trainer's step after forward/backward: partial gradients settled (reduce_partial_grads: one
    all-reduce per bucket), the grad norm (one reduction per placement group), the optimizer update and
    `after` it (float8_scales'). Clipping (one multiply per gradient) is left out: fake tensors hold no
    norm to compare with max_norm."""

    def run(between=lambda: None):
        forward_backward()
        between()
        grad_norm(reduce_partial_grads(list(model.parameters())), extra_groups)
        opt.step()
        after()
    return run


def float8_scales(cfg, layout: Layout, model):
    """With FSDP's float8 all-gather the trainer computes every float8 weight's scale after each
    update (one all-reduce of their amaxes; parallel.float8.precomputes_scales), and the next step's
    gathers use them: computed here as step 1 left them (the traced step being a later one; without
    them each weight's gather reduces its own amax: 14 all-reduces where the run makes one), and ->
    the same computation for the traced update's end (a no-op without the all-gather)."""
    if not precomputes_scales(cfg, layout.dims):
        return lambda: None
    _scale_flattens_without_a_read()
    precompute_scales(model)
    return lambda: precompute_scales(model)


def _scale_flattens_without_a_read() -> None:
    """torchao 0.18's WeightWithDynamicFloat8CastTensor.__tensor_flatten__ asks `if
    self._precomputed_scale:`, the truth of a tensor: a read of its value, which a fake tensor has
    not (DataDependentOutputException when the memory tracker lists a weight's storages). Here, in the
    planner's process only, it asks whether there is one (`is not None`: a scale is never 0), as torchao
    means it."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W  # lazy: float8 plans only
    if getattr(W.__tensor_flatten__, "torchmeg_planner", False):
        return

    def flatten(self):
        tensors = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None else [])
        return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}
    flatten.torchmeg_planner = True
    W.__tensor_flatten__ = flatten


def router_stats(built, layout: Layout, mesh) -> None:
    """The step's MoE balancing / router log collectives, as the trainer issues them."""
    reduce_router_stats(*router_modules(built.parts), layout.args, layout.dims, mesh, "cpu")


