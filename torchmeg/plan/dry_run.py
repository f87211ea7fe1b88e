"""One training step of a recipe, measured per rank: on fake tensors at any world size, or on the
real tensors of a running trainer.

Fake (`dry_run`): torch's fake process group at the recipe's world size, this process playing one
representative rank of each pipeline stage (coordinate 0 on every other mesh dim: under uneven
sharding the first shard is the largest). Meshes are real DeviceMeshes over the fake group; the
model is built on meta and goes through the trainer's own build (split, the real parallelize(),
storage under FakeTensorMode), so every DTensor plan, FSDP unit and collective is the one a real
run would have. Step 1 runs untracked (the optimizer creates its state); step 2 runs under torch's
MemTracker (memory by category, peak) and StepCost (ops, FLOPs, bytes, collectives by mesh dim).

Pipeline stages cannot run torch's schedule without peers, so a PP rank's step is accounted for
from its parts: each stage measured as torch's stage runs it (plan.pipeline_stage: FSDP's
gathers, one microbatch, the gradient reduce), and the schedule's own action order
(pipeline_order) says how many microbatches' activations are held at once and how often FSDP
gathers each stage. compile is off in a dry run (inductor does not trace fake-mode parameters); it changes no
parameter, gradient or optimizer byte and lowers activation memory a little, so the plan errs high.
Document masking (data.document_masking) is planned as one document per window: where documents
end depends on the data, and shorter ones attend to fewer keys, so attention FLOPs err high too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.parallel import loss_parallel

from torchmeg.models.deepseek_v3 import mtp_ahead, mtp_weights
from torchmeg.train.router_stats import reduce_router_stats, router_modules
from torchmeg.train.build import (GlobalTargetMean, ModelStep, build_parallel_model, forward_backward, loss_function,
                                  takes_sharded_logits)
from torchmeg.train.dpo import DPOLoss
from torchmeg.train.grpo_loss import GRPOLoss, RolloutRows
from torchmeg.config.errors import ConfigError
from torchmeg.config.layout import Layout
from torchmeg.parallel.mxfp8 import MX_RECIPES
from torchmeg.observe.metrics import local_bytes, model_state_bytes
from torchmeg.train.optim import build_optimizer, grad_norm
from torchmeg.parallel import pipeline as pl
from torchmeg.parallel.parallelize import program_for, reshard_after_forward
from torchmeg.parallel.pipeline_order import bubble, fsdp_gathers, held_peak, simulate, torch_actions
from torchmeg.plan.memory import current_bytes, peak_bytes, step_memory
from torchmeg.plan.pipeline_stage import measure_stage
from torchmeg.plan.fake_world import balanced_routing, fake_world, sharding_propagation_as_in_eager
from torchmeg.plan.step_cost import StepCost, add_comm, mesh_group_labels

MIB = 2 ** 20


class Measurement(dict):
    """Per-rank numbers of one step: memory (bytes), flops, ops (flops, bytes, dtype), comm."""


class MicrobatchMarks:
    """A step's microbatches, run as at most three: the first, one middle one and the last are
    the only kinds a step has (the first creates the accumulated gradients, every middle one
    starts from them with no gradient sync, the last syncs), so the memory peak of three is the
    step's, and its ops and collectives are those of three plus `more` copies of the middle one's.
    Iterating notes, where each microbatch begins, the bytes held and the StepCost tables (`memory`
    and `cost`, set by track_step)."""

    def __init__(self, make_batch, accum: int):
        self.batches = [make_batch() for _ in range(min(accum, 3))]
        self.more = accum - len(self.batches)
        self.cost, self.memory, self.marks = None, None, []

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            self.marks.append((current_bytes(self.memory), self.cost.mark()))
            yield b
        self.marks.append((current_bytes(self.memory), self.cost.mark()))


def track_step(run, model_parts, optimizer, labels, microbatches=None) -> Measurement:
    """Run `run()` (one training step) under MemTracker + StepCost. With `microbatches` (a
    MicrobatchMarks the step iterates), its middle microbatch's ops and collectives count
    `microbatches.more` extra times."""
    mt = step_memory()
    mt.track_external(*model_parts, optimizer)
    cost = StepCost(labels)
    if microbatches is not None:
        microbatches.cost, microbatches.memory = cost, mt
    own = vars(optimizer).get("step")
    update = optimizer.step

    def eager_update(*a, **k):  # the trainer compiles model and loss, never the update
        with cost.eager():
            return update(*a, **k)
    optimizer.step = eager_update
    try:
        with mt, cost:
            run()
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own
    mem = peak_bytes(mt)
    if microbatches is not None and microbatches.more:
        (held1, c1), (held2, c2) = microbatches.marks[1:3]
        cost.repeat(c1, c2, microbatches.more)
        # Whatever a middle microbatch leaves held (a few KiB of batch-sized bytes here) is held
        # once more per extra microbatch at the peak, which comes in the last one.
        mem["Total"] = mem.get("Total", 0) + max(0, held2 - held1) * microbatches.more
    return Measurement(memory=mem, flops=cost.flops, ops=cost.ops, comm=cost.comm_table(),
                       flops_by_op=cost.flops_by_op())


# What a planning child works on, set before the Pool forks it: inherited by the fork, never
# pickled (a user's ModelSpec may hold lambdas).
_JOB: dict = {}


def dry_run(cfg, layout: Layout, isolate: bool = False) -> list[dict]:
    """One entry per pipeline rank: {rank, stages, model_state_bytes, memory, flops, ops, comm, ...}.

    Pipeline ranks whose stages have the same shape (layer counts; first / last) measure the same:
    one of each kind is built and measured, and every rank's schedule row is played over those
    measurements (405B at PP 8: 3 builds for 8 ranks). Each kind is planned in a forked child
    (two at a time): DeviceMesh keeps process groups of an earlier fake world alive in its caches
    (torch 2.13), so one process cannot be two ranks in a row."""
    dims = layout.dims
    cfg.compile.enable = False
    # A plan is for a GPU with float8 matmuls: count torch._scaled_mm, not the CPU's emulation of it.
    cfg.float8.emulate = False
    if cfg.float8.enable and cfg.float8.recipe in MX_RECIPES:
        raise ConfigError(f"float8.recipe = {cfg.float8.recipe!r}: the planner cannot trace torchao's MXFP8 kernels "
                          f"(Triton / CUDA, sm_100) on fake tensors; plan with float8.recipe = \"rowwise\" (the nearest "
                          f"one it traces) or float8.enable = false")
    _JOB.update(cfg=cfg, layout=layout)
    if dims.pp == 1:
        if not isolate:
            return _plan_in_fake_world([0])
        with mp.get_context("fork").Pool(1) as pool:  # (--search: many plans from one process)
            return pool.apply(_plan_in_fake_world, ([0],))
    st = layout.stages
    kinds: dict[tuple, list[int]] = {}
    for pp_rank in range(dims.pp):
        ids = pl.stage_ids(pp_rank, dims.pp, st.per_rank, st.schedule)
        kinds.setdefault(tuple((st.layers[s], s == 0, s == st.n_stages - 1) for s in ids), []).append(pp_rank)
    with mp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        groups = pool.map(_plan_in_fake_world, list(kinds.values()))
    return sorted((r for g in groups for r in g), key=lambda r: r["rank"])


def _plan_in_fake_world(pp_ranks: list[int]) -> list[dict]:
    """Plan pipeline rank pp_ranks[0] (the global rank with that pp coordinate and 0 elsewhere;
    pp is the outermost mesh dim); the others share its stage shapes."""
    cfg, layout = _JOB["cfg"], _JOB["layout"]
    dims = layout.dims
    fake_world(dims.world_size, pp_ranks[0] * (dims.world_size // dims.pp))
    try:
        with sharding_propagation_as_in_eager(), balanced_routing():
            return _plan_rank(cfg, layout, pp_ranks)
    finally:
        dist.destroy_process_group()


def _plan_rank(cfg, layout: Layout, pp_ranks: list[int]) -> list[dict]:
    device = torch.device("cpu")
    dims = layout.dims
    mesh, ep_mesh = dims.build_mesh("cpu"), dims.build_ep_mesh("cpu")
    labels = mesh_group_labels(mesh, *([ep_mesh] if ep_mesh is not None else []))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with program_for("cuda"):  # the GPU's program (float8 TP styles), built on CPU
        built = build_parallel_model(cfg, layout, mesh, ep_mesh, device, None, schedule=False, storage=lambda: fake)
    with fake:
        model = built.model
        opt = build_optimizer(model, cfg)
        if dims.pp > 1:
            return _plan_pipeline_ranks(cfg, layout, mesh, built, opt, labels, pp_ranks)
        L, B, vocab = layout.seq_len, layout.local_batch, layout.args.vocab_size
        R = B * layout.rows_per_sample  # dpo: a pair is two rows (and its pair number rides along)
        extra = (torch.zeros(B, dtype=torch.int64),) if layout.rows_per_sample == 2 else ()
        if cfg.training.objective == "grpo":  # the training step over rollout rows (the rollouts' KV cache: not planned)
            extra = (RolloutRows(torch.zeros(R), torch.zeros(R, L)),)
        batches = MicrobatchMarks(lambda: (torch.randint(0, vocab, (R, L)), torch.randint(0, vocab, (R, L)), *extra),
                                  layout.accum)
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
        step = _step(lambda: (dist.all_reduce(forward_backward(ms, batches), group=loss_group),
                              _router_stats(built, layout, mesh)), model, opt, [])
        state = _create_optimizer_state(model, opt)
        m = track_step(lambda: (step(), opt.zero_grad(set_to_none=True)), [model], opt, labels, batches)
        m.update(rank=dist.get_rank(), pp_rank=0, stages=built.stage_ids, model_state_bytes=state,
                 report=built.report)
        return [m]


def _create_optimizer_state(model, opt) -> int:
    """Step 1's lasting effect without running step 1: zero gradients and one update create the
    optimizer's state. -> parameter + gradient + optimizer bytes, counted when all three exist
    (where the trainer measures model_state_mib)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    state = model_state_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    return state


def _step(forward_backward, model, opt, extra_groups):
    """The trainer's step after forward/backward: the grad norm (one reduction per placement
    group) and the optimizer update. Clipping (one multiply per gradient) is left out: fake
    tensors hold no norm to compare with max_norm."""

    def run():
        forward_backward()
        grad_norm(list(model.parameters()), extra_groups)
        opt.step()
    return run


def _router_stats(built, layout: Layout, mesh) -> None:
    """The step's MoE balancing / router log collectives, as the trainer issues them."""
    reduce_router_stats(*router_modules(built.parts), layout.args, layout.dims, mesh, "cpu")


def _plan_pipeline_ranks(cfg, layout: Layout, mesh, built, opt, labels, pp_ranks):
    """Pipeline ranks' steps from this rank's parts: each stage's microbatch measured once, then
    every rank in pp_ranks (same stage shapes) played through its row of the schedule's action
    order for the activations it holds at once."""
    dims, st = layout.dims, layout.stages
    sched, n_stages, v, n_micro = st.schedule, st.n_stages, st.per_rank, st.microbatches
    mb = layout.local_batch * layout.accum // n_micro
    sp = dims.tp > 1 and cfg.parallelism.sequence_parallel
    L = cfg.data.seq_len // dims.cp
    dim = layout.args.dim
    act_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    vocab = layout.args.vocab_size
    per_stage, p2p = {}, []
    per_microbatch = reshard_after_forward(cfg, dims)  # FSDP regathers each stage per microbatch
    # DeepSeek-V3's MTP: every stage takes the tokens ahead; the embeddings of them travel with
    # the hidden state (models/deepseek_v3.py), (1 + depth) x its width between stages
    depth = getattr(layout.args, "mtp_depth", 0)
    kw = {}
    if depth:
        ahead = mtp_ahead(torch.randint(0, vocab, (mb, L)), torch.randint(0, vocab, (mb, L)), depth)
        kw = {"ahead": ahead, "ahead_weight": mtp_weights(ahead, depth, shards=dims.cp)}
    for part, sid in zip(built.parts, built.stage_ids):
        if sid == 0:
            x = torch.randint(0, vocab, (mb, L))
        else:
            x = torch.randn(mb, L // (dims.tp if sp else 1), dim * (1 + depth), dtype=act_dtype, requires_grad=True)
        y = torch.randint(0, vocab, (mb, L))
        last = loss_function(cfg, built) if sid == n_stages - 1 else None
        if isinstance(last, GlobalTargetMean):
            last.scale = 1.0  # sft: as above
        # the schedule's loss on the last stage's vocab-sharded logits, as pipeline_step runs it
        with loss_parallel() if takes_sharded_logits(layout, built) else contextlib.nullcontext():
            fm = measure_stage(part, opt, labels, x, last, y, n_micro, kw, per_microbatch)
        per_stage[sid] = fm
        # Activations go forward to the next stage, their gradients come back (same size).
        if sid != n_stages - 1:
            p2p += [("send", fm["out_bytes"]), ("recv", fm["out_bytes"])]
        if sid != 0:
            p2p += [("recv", x.numel() * x.element_size()), ("send", x.numel() * x.element_size())]
    state = _create_optimizer_state(built.model, opt)
    # The step's tail, as the trainer runs it: the loss summed over the pipeline and averaged over
    # data parallel, the grad norm (per placement group, then over the pipeline), the update.
    for p in built.model.parameters():
        p.grad = torch.zeros_like(p)
    pp_group = mesh["pp"].get_group()

    def tail():
        loss = torch.zeros(())
        dist.all_reduce(loss, group=pp_group)
        dist.all_reduce(loss, group=mesh["dp_cp"].get_group())
        _router_stats(built, layout, mesh)
        grad_norm(list(built.model.parameters()), [pp_group])
        opt.step()
    tail_m = track_step(tail, built.parts, opt, labels)
    opt.zero_grad(set_to_none=True)
    v_multi = v if sched not in pl.SINGLE else None
    actions = torch_actions(sched, dims.pp, n_micro, v_multi)
    flops, ops, stage_comm = 0, [], {}
    for s, st in per_stage.items():
        # TP / CP / EP collectives run for every microbatch; FSDP's reduce once a step.
        stage_comm[s] = {}
        for key, c in st["comm"].items():
            add_comm(stage_comm[s], key, c, n_micro)
        for key, c in st["reduce"].items():
            add_comm(stage_comm[s], key, c, 1)
        flops += st["flops"] * n_micro
        ops += [(f * n_micro, b * n_micro, dt, k, fb * n_micro) for f, b, dt, k, fb in st["ops"]] + st["reduce_ops"]
    gathers = fsdp_gathers(sched, dims.pp, n_micro, v_multi, per_microbatch)
    comm = {}
    for kind, nbytes in p2p:
        add_comm(comm, f"pp/{kind}", {"count": 1, "bytes": nbytes, "wire_bytes": nbytes if kind == "send" else 0.0,
                                       "ranks": 2}, n_micro)
    for key, c in tail_m["comm"].items():
        add_comm(comm, key, c, 1)
    flops += tail_m["flops"]
    ops += tail_m["ops"]
    buffers = sum(b.numel() * b.element_size() for part in built.parts for b in part.buffers())
    params = sum(local_bytes(p) for part in built.parts for p in part.parameters())
    bub = bubble(simulate(actions))
    out = []
    for pp_rank in pp_ranks:
        ids = pl.stage_ids(pp_rank, dims.pp, v, sched)
        mine = dict(zip(ids, (per_stage[s] for s in built.stage_ids)))  # same shapes, position by position
        rank_comm = {k: dict(c) for k, c in comm.items()}
        for s_rank, s_built in zip(ids, built.stage_ids):
            st = per_stage[s_built]
            n_root, n_blocks = gathers[pp_rank].get(s_rank, (0, 0))
            for table, times in ((stage_comm[s_built], 1), (st["gather_root"], n_root),
                                 (st["gather_blocks"], n_blocks)):
                for key, c in table.items() if times else ():
                    add_comm(rank_comm, key, c, times)
        peak = held_peak(actions[pp_rank], mine)
        # The peak: microbatches in flight over the static bytes, or the update (state + its temporaries).
        # FSDP's gathered weights and unsharded accumulated gradients are held from a stage's first
        # microbatch to the step's reduce (an upper bound for the few actions before they exist).
        kept = sum(st["kept"] for st in mine.values())
        memory = {"Total": max(state + buffers + kept + peak, tail_m["memory"].get("Total", 0)), "Parameter": params,
                  "Gradient": params,  # fp32 gradients of every local parameter, held to the update
                  "Optstate": state - 2 * params, "Buffer": buffers}
        m = Measurement(memory=memory, flops=flops, ops=ops, comm=rank_comm)
        m.update(rank=pp_rank * (dims.world_size // dims.pp), pp_rank=pp_rank, stages=ids, model_state_bytes=state,
                 report=built.report,
                 pipeline={"schedule": sched, "microbatches": n_micro, "microbatch_seqs": mb, "bubble": bub,
                           "stage_activation_bytes": {s: st["act"] for s, st in mine.items()},
                           "stage_kept_bytes": {s: st["kept"] for s, st in mine.items()},
                           "fsdp_gathers": gathers[pp_rank]})
        out.append(m)
    return out
