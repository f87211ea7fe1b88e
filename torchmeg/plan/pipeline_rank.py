"""A pipeline rank's step on fake tensors. Pipeline stages cannot run torch's schedule without peers,
so the step is accounted for from its parts: each stage measured as torch's stage runs it
(plan.pipeline_stage: FSDP's gathers, one microbatch, the gradient reduce), the step's tail (loss
reductions, grad norm, update) traced once, and the schedule's own action order
(parallel.pipeline_order) saying how many microbatches' activations are held at once and how often
FSDP gathers each stage.
"""
from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchmeg.config.layout import Layout
from torchmeg.models.deepseek_v3 import mtp_ahead, mtp_weights
from torchmeg.observe.metrics import local_bytes
from torchmeg.parallel import pipeline as pl
from torchmeg.parallel.parallelize import reshard_after_forward
from torchmeg.parallel.pipeline_order import bubble, fsdp_gathers, held_peak_and_grads, simulate, torch_actions
from torchmeg.plan.pipeline_stage import measure_stage
from torchmeg.plan.step_cost import add_comm
from torchmeg.plan.trace_step import (Measurement, build, create_optimizer_state, float8_scales, gpu_optimizer,
                                      router_stats, track_step)
from torchmeg.train.build import GlobalTargetMean, loss_function, takes_sharded_logits
from torchmeg.train.optim import grad_norm, reduce_partial_grads


def measure_pipeline(cfg, layout: Layout, mesh, ep_mesh, labels, keep, read=frozenset()) -> dict:
    """This rank's pipeline stages (the layers in `keep`, or all), each stage's microbatch measured
    once, and the step's tail (loss reductions, grad norm, update). `read`: stages another rank's trace
    measures (dry_run.DryRun.reads): built, not measured here (None in per_stage)."""
    built, fake = build(cfg, layout, mesh, ep_mesh, keep)
    with fake:
        opt = gpu_optimizer(built.model, cfg)
        return measure_stages(cfg, layout, mesh, built, opt, labels, read)


def measure_stages(cfg, layout: Layout, mesh, built, opt, labels, read=frozenset()) -> dict:
    dims, st = layout.dims, layout.stages
    n_stages, n_micro = st.n_stages, st.microbatches
    scales = float8_scales(cfg, layout, built.model)
    mb = layout.local_batch * layout.accum // n_micro
    sp = dims.tp > 1 and cfg.parallelism.sequence_parallel
    L = cfg.data.seq_len // dims.cp
    dim = layout.args.dim
    act_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    vocab = layout.args.vocab_size
    per_stage, traced = {}, []
    per_microbatch = reshard_after_forward(cfg, dims)  # FSDP regathers each stage per microbatch
    # DeepSeek-V3's MTP: every stage takes the tokens ahead; the embeddings of them travel with
    # the hidden state (models/deepseek_v3.py), (1 + depth) x its width between stages
    depth_ = getattr(layout.args, "mtp_depth", 0)
    kw = {}
    if depth_:
        ahead = mtp_ahead(torch.randint(0, vocab, (mb, L)), torch.randint(0, vocab, (mb, L)), depth_)
        kw = {"ahead": ahead, "ahead_weight": mtp_weights(ahead, depth_, shards=dims.cp)}
    for part, sid in zip(built.parts, built.stage_ids):
        if sid == 0:
            x = torch.randint(0, vocab, (mb, L))
        else:
            x = torch.randn(mb, L // (dims.tp if sp else 1), dim * (1 + depth_), dtype=act_dtype, requires_grad=True)
        y = torch.randint(0, vocab, (mb, L))
        last = loss_function(cfg, built) if sid == n_stages - 1 else None
        if isinstance(last, GlobalTargetMean):
            last.scale = 1.0  # sft: as above
        # the schedule's loss on the last stage's vocab-sharded logits, as pipeline_step runs it
        if sid in read:  # (measured by another trace: dry_run.DryRun.reads)
            per_stage[sid] = None
            continue
        with loss_parallel() if takes_sharded_logits(layout, built) else contextlib.nullcontext():
            fm = measure_stage(part, opt, labels, x, last, y, n_micro, kw, per_microbatch, received=sid != 0)
        fm["in_bytes"] = x.numel() * x.element_size() if sid != 0 else 0
        per_stage[sid] = fm
        traced.append(sid)
    made = made_placements(built.model)
    state = create_optimizer_state(built.model, opt)
    # The step's tail, as the trainer runs it: the loss summed over the pipeline and averaged over
    # data parallel, the grad norm (per placement group, then over the pipeline), the update.
    for name, p in built.model.named_parameters():
        p.grad = torch.zeros_like(p)
        placements = made.get(_layer_free(name))  # (the ones autograd gives it: Partial under sequence parallel)
        if placements is not None:
            p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, placements, run_check=False)
    pp_group = mesh["pp"].get_group()

    def tail():
        loss = torch.zeros(())
        dist.all_reduce(loss, group=pp_group)
        dist.all_reduce(loss, group=mesh["dp_cp"].get_group())
        router_stats(built, layout, mesh)
        grad_norm(reduce_partial_grads(list(built.model.parameters())), [pp_group])
        opt.step()
        scales()
    tail_m = track_step(tail, built.parts, opt, labels)
    opt.zero_grad(set_to_none=True)
    return {"per_stage": per_stage, "state": state, "tail": tail_m, "stage_ids": list(built.stage_ids),
            "stages_traced": traced,
            "buffers": sum(b.numel() * b.element_size() for part in built.parts for b in part.buffers()),
            "params": sum(local_bytes(p) for part in built.parts for p in part.parameters()),
            "grads": sum(local_bytes(p) for p in built.model.parameters() if p.requires_grad),  # (of the state)
            "reports": {i: dict(p.torchmeg_report) for i, p in enumerate(built.parts)}}


def made_placements(model) -> dict[str, tuple]:
    """The placements of the gradients the traced microbatches made (pipeline_stage.give_gradients
    gives none to a weight replicated beside FSDP: tensor parallel's norms) where they are not the
    weight's, by name with layer numbers left out (a stage measured by another rank's trace has the
    same weights): without FSDP the update takes those gradients as they are, and DTensor's grad norm
    and update all-reduce a Partial one (a PP 2 x TP 2 plan with sequence parallel counted 2 and 8 TP
    all-reduces on its two ranks where the run issues 18 and 28, given Replicate ones)."""
    return {_layer_free(n): p.grad.placements for n, p in model.named_parameters()
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements}


def _layer_free(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


def pipeline_ranks(cfg, layout: Layout, meas: dict, pp_ranks: list[int]) -> list[dict]:
    """Pipeline ranks' steps from this rank's measured stages: every rank in pp_ranks (same stage
    shapes) played through its row of the schedule's action order for the activations it holds at once."""
    dims, stages = layout.dims, layout.stages
    sched, v, n_micro = stages.schedule, stages.per_rank, stages.microbatches
    per_stage, state, tail_m = meas["per_stage"], meas["state"], meas["tail"]
    buffers, params, stage_ids = meas["buffers"], meas["params"], meas["stage_ids"]
    per_microbatch = reshard_after_forward(cfg, dims)
    mb = layout.local_batch * layout.accum // n_micro
    v_multi = v if sched not in pl.SINGLE else None
    actions = torch_actions(sched, dims.pp, n_micro, v_multi)
    flops, ops, stage_comm = 0, [], {}
    for s, measured in per_stage.items():
        # TP / CP / EP collectives run for every microbatch; FSDP's reduce once a step.
        stage_comm[s] = {}
        for key, c in measured["comm"].items():
            add_comm(stage_comm[s], key, c, n_micro)
        for key, c in measured["reduce"].items():
            add_comm(stage_comm[s], key, c, 1)
        flops += measured["flops"] * n_micro
        ops += measured["ops"] * n_micro  # (each microbatch's ops, not one op n_micro times larger: a calibrated
        # device prices an op by its size, and each op is dispatched once per microbatch)
        ops += measured["reduce_ops"]
    # Activations go forward to the next stage, their gradients come back (same size).
    p2p = []
    for sid in stage_ids:
        if sid != stages.n_stages - 1:
            p2p += [("send", per_stage[sid]["out_bytes"]), ("recv", per_stage[sid]["out_bytes"])]
        if sid != 0:
            p2p += [("recv", per_stage[sid]["in_bytes"]), ("send", per_stage[sid]["in_bytes"])]
    gathers = fsdp_gathers(sched, dims.pp, n_micro, v_multi, per_microbatch)
    comm = {}
    for kind, nbytes in p2p:
        add_comm(comm, f"pp/{kind}", {"count": 1, "bytes": nbytes, "wire_bytes": nbytes if kind == "send" else 0.0,
                                       "ranks": 2}, n_micro)
    for key, c in tail_m["comm"].items():
        add_comm(comm, key, c, 1)
    flops += tail_m["flops"]
    ops += tail_m["ops"]
    bub = bubble(simulate(actions))
    out = []
    for pp_rank in pp_ranks:
        ids = pl.stage_ids(pp_rank, dims.pp, v, sched)
        mine = dict(zip(ids, (per_stage[s] for s in stage_ids)))  # same shapes, position by position
        rank_comm = {k: dict(c) for k, c in comm.items()}
        for s_rank, s_built in zip(ids, stage_ids):
            measured = per_stage[s_built]
            n_root, n_blocks = gathers[pp_rank].get(s_rank, (0, 0))
            for table, times in ((stage_comm[s_built], 1), (measured["gather_root"], n_root),
                                 (measured["gather_blocks"], n_blocks)):
                for key, c in table.items() if times else ():
                    add_comm(rank_comm, key, c, times)
        # The gradients a stage's first backward makes (the parameters' own without FSDP, FSDP's unsharded
        # accumulated ones) are held from that backward on (held_peak); FSDP's gathered weights from the
        # stage's first microbatch to the step's reduce (an upper bound for the few actions before they exist).
        peak, grads_at_peak = held_peak_and_grads(actions[pp_rank], {
            s: {**st, "grads": st["own_grads"] + st["kept_grads"]} for s, st in mine.items()})
        # The peak: microbatches in flight over the static bytes, or the update (state + its temporaries).
        kept = sum(stage["kept"] for stage in mine.values())
        kept_grads = sum(stage["kept_grads"] for stage in mine.values())
        # torch's receive buffers, one per microbatch each way, allocated at the first step and kept (so the
        # update's peak has them too): plan.pipeline_stage.measure_stage
        recv = sum(stage["recv_bytes"] for stage in mine.values())
        # The parameters' own gradients while the microbatches run: a stage without FSDP accumulates into
        # them from its first backward; under FSDP they are made by the step's reduce (the trainer sets them
        # to None after each update), so `kept` holds the stage's gradients until then, and the reduce,
        # making them while `kept` is still held, peaks at the state and `kept` at most.
        # The categories are those of the peak's moment, as a traced step's snapshot gives them.
        grads = meas["grads"]
        own_grads = sum(stage["own_grads"] for stage in mine.values())
        during = state - grads + kept - kept_grads + peak
        after = max(state + kept, tail_m["memory"].get("Total", 0) - buffers)
        memory = {"Total": recv + buffers + max(during, after), "Parameter": params,
                  "Gradient": min(own_grads, grads_at_peak) if during > after else grads,
                  "Optstate": state - params - grads, "Buffer": buffers}
        m = Measurement(memory=memory, flops=flops, ops=ops, comm=rank_comm)
        m.update(rank=pp_rank * (dims.world_size // dims.pp), pp_rank=pp_rank, stages=ids, model_state_bytes=state,
                 report=meas["report"], traced_layers=meas["traced_layers"],
                 stages_traced=[s_rank for s_rank, s_built in zip(ids, stage_ids) if s_built in meas["stages_traced"]],
                 pipeline={"schedule": sched, "microbatches": n_micro, "microbatch_seqs": mb, "bubble": bub,
                           "stages_per_rank": v_multi,
                           "stage_activation_bytes": {s: st["act"] for s, st in mine.items()},
                           "stage_kept_bytes": {s: st["kept"] for s, st in mine.items()},
                           "stage_recv_buffer_bytes": {s: st["recv_bytes"] for s, st in mine.items()},
                           "fsdp_gathers": gathers[pp_rank]})
        out.append(m)
    return out
