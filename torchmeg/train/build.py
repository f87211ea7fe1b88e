"""The model on this rank and how one step runs it: shared by the trainer and the planner.

`build_parallel_model` makes this rank's model from a Layout: built whole on meta, split into its
pipeline stages, each stage put through `parallelize()` and materialised on the device with every
parameter initialised from (seed, FQN) on its own shard only. The planner's fake-tensor dry run
passes seed None (storage only), schedule=False (no peers to run one with) and storage=a
FakeTensorMode (what storage is made under; parallelize() itself runs outside it, as it builds
meshes).

`forward_backward` / `eval_step` run one step's microbatches through that model (`ModelStep`): the
trainer calls them for real, the planner under its trackers on fake tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx
from torch.profiler import record_function

from torchmeg.checkpoint import peft_targets
from torchmeg.kernels.fused_ce import IGNORE, linear_cross_entropy
from torchmeg.config.errors import ConfigError
from torchmeg.config.layout import Layout
from torchmeg.models import lora
from torchmeg.models.blocks import find_blocks
from torchmeg.models.tying import retie, tied_pairs
from torchmeg.models.args import instantiate
from torchmeg.models.deepseek_v3 import mtp_ahead, mtp_weights
from torchmeg.models.init import materialize
from torchmeg.models.spec import spec_tp_plan
from torchmeg.parallel import pipeline as pl
from torchmeg.parallel.context import shard_sequence
from torchmeg.parallel.parallelize import describe_report, parallelize, reshard_after_forward
from torchmeg.parallel.shards import local_block
from torchmeg.train.dpo import DPOLoss, loss_terms
from torchmeg.train.grpo_loss import GRPOLoss


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def cross_entropy_masked(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """data.mask_eod_loss: the sum over the positions that are targets, divided by all positions.
    Dividing by every position (not only the targets) keeps each microbatch's weight the same
    under every layout, with no token count to exchange; the masked share (one position per
    document) shrinks the loss by that fraction."""
    return cross_entropy_sum(logits, labels) / labels.numel()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


class GlobalTargetMean:
    """training.objective = "sft": a microbatch's loss is its cross-entropy SUMMED over its targets,
    times `scale` = (ranks its gradients are averaged over x loss calls the step divides by) / (targets
    in the whole global batch), set before each step by `count_targets`. So every target token of the
    global batch weighs the same, whatever rank and microbatch it lands in: a per-microbatch mean would
    weigh a token of a microbatch with few targets more, and differently in every layout and
    accumulation. `sum_fn` (the eager or compiled sum) is kept apart so the compiled part never sees
    the per-step scale."""

    def __init__(self, sum_fn: Callable):
        self.sum_fn, self.scale = sum_fn, None

    def __call__(self, out, labels):
        if self.scale is None:
            raise RuntimeError("GlobalTargetMean: count_targets() sets the scale before the first loss")
        return self.sum_fn(out, labels) * self.scale


def loss_function(cfg, built: "BuiltModel | None" = None) -> Callable:
    """The recipe's loss over the model's output. With training.fused_linear_cross_entropy the
    model ends at its final norm and the loss applies the LM head (built.head, its weight read at
    every call: FSDP's unsharded one after the forward) chunk by chunk: torchmeg.kernels.fused_ce."""
    sft = cfg.training.objective == "sft"
    if cfg.training.objective == "dpo":  # (the fused head is refused with dpo: it needs per-row log-probs)
        return DPOLoss(cfg.training.dpo_beta, loss_terms(cfg), cfg.dpo.label_smoothing)
    if cfg.training.objective == "grpo":
        g = cfg.grpo
        return GRPOLoss(g.loss_type, g.beta, g.epsilon, g.epsilon_high, g.temperature, g.max_completion_length,
                        g.importance_sampling, g.importance_sampling_cap, g.use_bias_correction_kl,
                        g.importance_sampling_level, g.delta, (g.sapo_temperature_pos, g.sapo_temperature_neg),
                        (g.vespo_k_pos, g.vespo_lambda_pos, g.vespo_k_neg, g.vespo_lambda_neg))
    if built is not None and built.head is not None:
        module, sp, keep = built.head, built.head_sequence_sharded, built.split_backward
        mean_over = "sum" if sft else "positions" if cfg.data.mask_eod_loss else "targets"
        fused = lambda h, labels: linear_cross_entropy(h, module.weight, labels, mean_over, sp, keep)  # noqa: E731
        return GlobalTargetMean(fused) if sft else fused
    if sft:
        return GlobalTargetMean(cross_entropy_sum)
    return cross_entropy_masked if cfg.data.mask_eod_loss else cross_entropy


@dataclass
class BuiltModel:
    model: nn.Module            # this rank's model (a StageUnion of its pipeline stages under PP)
    whole: nn.Module            # the meta model before any split: counts and FLOPs
    parts: list[nn.Module]      # the stages this rank runs, or [model]
    stage_ids: list[int]
    schedule: pl.Pipeline | None
    has_first: bool             # holds the first stage (takes token ids) / the last (makes the loss)
    has_last: bool
    report: str                 # what parallelize() did, one line
    stage_desc: str             # the pipeline split, one line ("" without PP)
    head: nn.Module | None = None  # the LM head the loss applies (fused linear + CE; on the last stage)
    head_sequence_sharded: bool = False  # the model's output is this rank's sequence shard (TP + SP)
    split_backward: bool = False  # a pipeline schedule that backpropagates twice (inputs, then weights)
    loss_fn: Callable | None = None  # the loss the pipeline schedule calls (under PP)


def add_adapters(model: nn.Module, cfg) -> list[str]:
    """[lora]: adapters beside the target Linears, everything else frozen -> the targets' FQNs."""
    patterns = list(cfg.lora.target_modules)
    if patterns:
        names = lora.targets(model, patterns, find_blocks(model, cfg.model.blocks)[0])
    else:  # [] = PEFT's target_modules=None: its default for the model's architecture
        names = peft_targets.default_targets(model, cfg.model.name, model.args, skip=lora.is_adapter_module)
    if not names:
        raise ConfigError(f"lora.target_modules = {patterns}: matches no nn.Linear of the model "
                          f"('*' matches one name, e.g. 'layers.*.attention.wq'; or 'all-linear')")
    lo = cfg.lora
    lora.attach(model, names, lo.rank, lo.alpha, lo.dropout, lo.use_rslora, lo.init_lora_weights)
    if cfg.training.mixed_precision == "bf16":
        # The frozen weights are only ever read in bf16 (the policy casts them for every forward) and
        # never updated: stored in bf16 they give the same compute and need no fp32 master copy.
        tied = tied_pairs(model)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if not p.requires_grad and p.is_floating_point():
                    module.register_parameter(name, nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
        retie(model, tied)
    return names


def build_parallel_model(cfg, layout: Layout, mesh, ep_mesh, device, seed: int | None,
                         loss_fn: Callable | None = None, schedule: bool = True,
                         storage=contextlib.nullcontext, fused_head: bool | None = None,
                         keep_layers: set[str] | None = None) -> BuiltModel:
    """`fused_head`: the loss applies the LM head (default: training.fused_linear_cross_entropy;
    generation passes False: it needs the logits). `keep_layers`: build only these of the model's
    layers (keys of its layer ModuleDict; the planner's sampled depth, torchmeg.plan.depth), with
    `layout.stages` splitting the kept ones."""
    spec, dims = layout.spec, layout.dims
    whole = instantiate(spec, layout.args, "meta")
    if cfg.lora.enable:  # before any split or sharding: the adapters are part of the model every layout takes
        add_adapters(whole, cfg)
    if keep_layers is not None:
        layers = getattr(whole, spec.layers_attr)
        for key in [k for k in layers.keys() if k not in keep_layers]:
            del layers[key]
    fused = cfg.training.fused_linear_cross_entropy if fused_head is None else fused_head
    head = {}

    def prepare(part: nn.Module) -> None:
        # The plan is read only under TP: a Hugging Face plan may name styles torchmeg cannot
        # honour (packed MoE experts), which must not stop a run that does not shard over tp.
        plan = spec_tp_plan(spec, part) if dims.tp > 1 else None
        parallelize(part, dims, cfg, mesh=mesh, ep_mesh=ep_mesh, tp_plan=plan,
                    plan_must_match=spec.hf_native)  # a plan read from this very model: all must match
        with storage():
            materialize(part, device, seed, block=local_block)
        if fused and getattr(part, spec.head, None) is not None:
            part.head_in_loss = True  # the model returns the final norm's output; loss_function applies the head
            head.update(head=getattr(part, spec.head),
                        head_sequence_sharded=dims.tp > 1 and part.torchmeg_report.get("sequence_parallel", False))

    st = layout.stages
    if st is None:
        prepare(whole)
        return BuiltModel(model=whole, whole=whole, parts=[whole], stage_ids=[0], schedule=None, has_first=True,
                          has_last=True, report=describe_report(whole.torchmeg_report), stage_desc="", **head)
    # Split into this rank's stages first; each stage then goes through the whole pass.
    ids = pl.stage_ids(mesh["pp"].get_local_rank(), dims.pp, st.per_rank, st.schedule)
    parts = pl.split_model(whole, spec, list(st.layers), ids)
    for part in parts:
        prepare(part)
    desc = f"stages {ids} of {st.n_stages} ({list(st.layers)} layers), {st.schedule}"
    if dims.fsdp > 1:
        desc += (" (FSDP gathers the stage's weights per microbatch)" if reshard_after_forward(cfg, dims) else
                 " (FSDP gathers the stage's weights once per step)")
    built = BuiltModel(model=pl.StageUnion(parts, spec.layers_attr), whole=whole, parts=parts, stage_ids=ids,
                       schedule=None, has_first=0 in ids, has_last=st.n_stages - 1 in ids,
                       report=" | ".join(describe_report(p.torchmeg_report) for p in parts), stage_desc=desc,
                       split_backward=pl.splits_backward(cfg, dims), **head)
    if schedule:
        built.loss_fn = loss_fn or loss_function(cfg, built)
        built.schedule = pl.build_schedule(parts, ids, st.n_stages, device, mesh["pp"].get_group(), st.microbatches,
                                           built.loss_fn, st.schedule)
    return built


# ---- one step's microbatches through the model ---------------------------------------------------

def takes_sharded_logits(layout: Layout, built: BuiltModel) -> bool:
    """The loss runs on vocab-sharded logits under loss_parallel(): loss parallel on, and no fused
    head (which computes its loss from the hidden state itself)."""
    return layout.loss_parallel and built.head is None


@dataclass
class ModelStep:
    """What running the model over one step's microbatches needs."""
    model: nn.Module
    schedule: pl.Pipeline | None
    device: torch.device
    loss_fn: Callable
    loss_parallel: bool
    accum: int
    cp_rank: int
    cp: int
    has_first: bool
    has_last: bool
    pp_group: object
    mtp_depth: int = 0  # DeepSeek-V3's MTP modules: the model takes the tokens ahead (`ahead`) too
    targets: GlobalTargetMean | None = None  # sft: the loss whose scale count_targets sets each step
    loss_group: object = None  # dp x cp: the ranks whose gradients are averaged (with `targets`)
    loss_calls: int = 1  # losses one step divides by: the schedule's microbatches under PP, else accum
    pairs: DPOLoss | GRPOLoss | None = None  # dpo / grpo: the loss, told each microbatch's batch[2] (pair numbers, rollout rows)

    @classmethod
    def of(cls, built: BuiltModel, layout: Layout, mesh, device, loss_fn: Callable = cross_entropy,
           loss_group=None) -> "ModelStep":
        """`loss_fn`: build.loss_function(cfg, built), or a compiled one (the schedule has its own).
        A fused head takes no vocabulary-sharded logits: loss_parallel's context stays off. A
        GlobalTargetMean (sft) gets its scale each step from the target count over `loss_group`."""
        sft = isinstance(loss_fn, GlobalTargetMean)
        return cls(built.model, built.schedule, device, loss_fn, takes_sharded_logits(layout, built),
                   layout.accum, mesh["cp"].get_local_rank(), layout.dims.cp, built.has_first, built.has_last,
                   mesh["pp"].get_group(), getattr(layout.args, "mtp_depth", 0),
                   targets=loss_fn if sft else None, loss_group=loss_group,
                   pairs=loss_fn if isinstance(loss_fn, (DPOLoss, GRPOLoss)) else None,
                   loss_calls=layout.microbatches)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch: on the device, and its sequence shard under context parallel."""
        t = t.to(self.device)
        return shard_sequence(t, self.cp_rank, self.cp) if self.cp > 1 else t

    def extra(self, batch) -> dict:
        """The model's keyword inputs of a batch: document numbers under document masking, whole
        (context parallel picks its chunks' own; positions come from them); the tokens ahead and their
        targets for a model that predicts further (MTP), built from whole sequences, then sharded."""
        kw = {"documents": batch[2].to(self.device)} if len(batch) > 2 and self.pairs is None else {}
        if self.mtp_depth:
            ahead = mtp_ahead(batch[0], batch[1], self.mtp_depth)
            kw["ahead"] = self.local(ahead)
            kw["ahead_weight"] = self.local(mtp_weights(ahead, self.mtp_depth, shards=self.cp))
        return kw

    def loss_context(self):
        return loss_parallel_ctx() if self.loss_parallel else contextlib.nullcontext()


def count_targets(ms: ModelStep, batches) -> None:
    """sft: the global batch's target count (this rank's from its host-side labels, summed over the
    dp x cp group, each cp rank having counted the same whole sequences) sets the loss scale; dpo with
    an "sft" term: that of the chosen rows (every other row). One small all-reduce and one host read
    per step, before the forward."""
    dpo = ms.pairs is not None and ms.pairs.counts_chosen
    if ms.targets is None and not dpo:
        return
    rows = slice(0, None, 2) if dpo else slice(None)
    n = torch.tensor([float(sum(int((b[1][rows] != IGNORE).sum()) for b in batches))], device=ms.device)
    world = 1
    if ms.loss_group is not None:
        dist.all_reduce(n, group=ms.loss_group)
        world = dist.get_world_size(ms.loss_group)
    total = n.item() / ms.cp
    if dpo:
        ms.pairs.sft_scale = world * ms.loss_calls / max(total, 1.0)
    else:
        ms.targets.scale = world * ms.loss_calls / max(total, 1.0)


def _scalar(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def forward_backward(ms: ModelStep, batches, loss_hook: Callable | None = None) -> torch.Tensor:
    """Forward and backward over the step's microbatches (gradients accumulate in the parameters)
    -> the sum of this rank's microbatch losses, each divided by accum. `loss_hook(loss) -> loss`
    is applied to each microbatch's loss before its backward (the trainer's test hooks)."""
    count_targets(ms, batches)
    if ms.schedule is not None:  # the schedule runs every microbatch itself
        with record_function("torchmeg: forward+backward (pipeline schedule)"):
            return pipeline_step(ms, batches, train=True)
    loss_sum = torch.zeros((), device=ms.device)
    for m, batch in enumerate(batches):
        inputs, labels = ms.local(batch[0]), ms.local(batch[1])
        if ms.pairs is not None:
            ms.pairs.see(batch)
        if hasattr(ms.model, "set_requires_gradient_sync"):
            # Reduce gradients once, after the last microbatch.
            ms.model.set_requires_gradient_sync(m == ms.accum - 1)
        # Named ranges for tools/step_profile.py's phases (free when no profiler runs).
        with ms.loss_context():
            with record_function("torchmeg: forward"):
                loss = ms.loss_fn(ms.model(inputs, **ms.extra(batch)), labels) / ms.accum
                if loss_hook is not None:
                    loss = loss_hook(loss)
            with record_function("torchmeg: backward"):
                loss.backward()
        loss_sum += _scalar(loss.detach()).float()
    return loss_sum


def pipeline_step(ms: ModelStep, batches, train: bool) -> torch.Tensor:
    """One schedule run over the step's sequences; the loss (mean over microbatches) is known
    on the last stage's rank and summed over the pipeline group so every rank holds it."""
    inputs = ms.local(torch.cat([b[0] for b in batches]))
    labels = ms.local(torch.cat([b[1] for b in batches]))
    losses = []
    args = (inputs,) if ms.has_first else ()
    kw = {"target": labels, "losses": losses} if ms.has_last else {}
    if len(batches[0]) > 2:  # every stage takes the document numbers (split into microbatches by torch)
        kw["documents"] = torch.cat([b[2] for b in batches]).to(ms.device)
    if ms.mtp_depth:  # and the tokens ahead (the first stage embeds them, the last predicts them)
        ahead = torch.cat([mtp_ahead(b[0], b[1], ms.mtp_depth) for b in batches])
        kw["ahead"] = ms.local(ahead)
        kw["ahead_weight"] = ms.local(mtp_weights(ahead, ms.mtp_depth, chunks=ms.loss_calls, shards=ms.cp))
    with ms.loss_context():  # the last stage's loss on vocab-sharded logits (loss_parallel)
        (ms.schedule.step if train else ms.schedule.eval)(*args, **kw)
    loss = torch.stack([_scalar(x.detach()).float() for x in losses]).mean() if ms.has_last else torch.zeros((), device=ms.device)
    dist.all_reduce(loss, group=ms.pp_group)
    return loss


@torch.no_grad()
def eval_step(ms: ModelStep, batches, total: torch.Tensor) -> None:
    """Add this step's loss (the mean over its microbatches) on this rank into `total`."""
    count_targets(ms, batches)
    if ms.schedule is not None:
        total += pipeline_step(ms, batches, train=False)
        return
    for batch in batches:
        if ms.pairs is not None:
            ms.pairs.see(batch)
        with ms.loss_context():
            loss = ms.loss_fn(ms.model(ms.local(batch[0]), **ms.extra(batch)), ms.local(batch[1]))
        total += _scalar(loss).float() / ms.accum



@torch.no_grad()
def mean_eval_loss(ms: ModelStep, loader, steps: int, device, group, on_step: Callable | None = None) -> float:
    """The mean loss per global batch over `steps` of them from `loader` (this rank's slices),
    all-reduced over the loss group (dp x cp): the trainer's val_loss and torchmeg.eval's loss are
    this one computation. `on_step(done)` after each (progress)."""
    total, it = torch.zeros((), device=device), iter(loader)
    for s in range(steps):
        eval_step(ms, [next(it) for _ in range(ms.accum)], total)
        if on_step is not None:
            on_step(s + 1)
    dist.all_reduce(total, group=group)
    return total.item() / (steps * dist.get_world_size(group))