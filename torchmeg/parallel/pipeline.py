"""Pipeline parallelism with torch.distributed.pipelining: stage split + schedule, no scheduler of our own.

Split: a registry model is copied (on the meta device, so copies are free) once per local stage
and each copy drops what other stages own — layers outside its range, the embedding unless it is
the first stage, the final norm and output unless it is the last (which modules those are is data
in the registry entry: `pp_first`, `pp_last`). Names are untouched, so a stage's parameters carry
the same FQNs as in the whole model: initialisation and checkpoints do not depend on the split.

Stage placement: looped schedules give rank r stages r, r+pp, ...; V schedules give it stages r and
2*pp-1-r, so the first and last stage share rank 0 (Qi et al. 2024, ZB-V; DeepSeek-V3's DualPipe).
"""
from __future__ import annotations

import copy
import types
import time

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from torchmeg.config.errors import ConfigError

SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input-gradient (I) and weight-gradient (W) passes.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def splits_backward(cfg, dims) -> bool:
    """Whether this layout's pipeline schedule backpropagates twice (inputs, then weights)."""
    return dims.pp > 1 and cfg.parallelism.pipeline_parallel_schedule in SPLIT_BACKWARD


def plan_stages(cfg, n_layers: int, pp: int) -> tuple[int, list[int]]:
    """(stages per rank, layers of each stage) from the recipe; one-line errors for bad splits."""
    p = cfg.parallelism
    sched, lps = p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage
    key = "parallelism.pipeline_parallel_layers_per_stage"
    if isinstance(lps, list):
        if not lps or not all(isinstance(n, int) and n >= 0 for n in lps) or sum(lps) != n_layers:
            raise ConfigError(f"{key} = {lps!r}: needs non-negative layer counts summing to model.n_layers = {n_layers}")
        if len(lps) % pp:
            raise ConfigError(f"{key} = {lps!r}: {len(lps)} stages do not divide over pipeline_parallel_degree = {pp}; "
                              f"give a multiple of {pp} entries")
        if any(n == 0 for n in lps[1:-1]):
            raise ConfigError(f"{key} = {lps!r}: only the first and last stage may hold no layers")
        counts = list(lps)
    elif lps > 0:
        if n_layers % lps or (n_layers // lps) % pp:
            raise ConfigError(f"{key} = {lps}: model.n_layers = {n_layers} does not split into a multiple of "
                              f"pipeline_parallel_degree = {pp} stages of {lps} layers")
        counts = [lps] * (n_layers // lps)
    elif lps == -1:
        stages = pp * (1 if sched in SINGLE else 2)
        if n_layers % stages:
            raise ConfigError(f"parallelism.pipeline_parallel_degree = {pp}: model.n_layers = {n_layers} does not split "
                              f"evenly into {stages} stages for {sched}; set {key} to a list, e.g. "
                              f"{_uneven_example(n_layers, stages)}")
        counts = [n_layers // stages] * stages
    else:
        raise ConfigError(f"{key} = {lps}: use -1 (even split), a positive layer count, or a list per stage")
    v = len(counts) // pp
    if sched in SINGLE and v != 1:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {sched!r}: runs one stage per rank but the split "
                          f"gives {v}; use Interleaved1F1B / InterleavedZeroBubble / ZBVZeroBubble / DualPipeV, or "
                          f"{pp} stages")
    if sched in V_SHAPED and v != 2:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {sched!r}: needs exactly 2 stages per rank "
                          f"(2 x pipeline_parallel_degree = {2 * pp} stages); the split gives {len(counts)}")
    if sched in LOOPED and v < 2:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {sched!r}: needs virtual stages (>= 2 per rank, "
                          f"{2 * pp} stages here); the split gives {len(counts)}")
    if p.fsdp_reshard_per_microbatch and sched in SPLIT_BACKWARD:
        raise ConfigError(f"parallelism.fsdp_reshard_per_microbatch = true: {sched} splits the backward, whose "
                          f"weight-gradient pass needs the weights still gathered; set it false")
    return v, counts


def _uneven_example(n_layers: int, stages: int) -> list[int]:
    base, extra = divmod(n_layers, stages)
    return [base + (1 if i >= stages - extra else 0) for i in range(stages)]


def microbatches(cfg, pp: int, v: int, accum: int) -> int:
    """Microbatches per schedule step (the step covers local_batch x accum sequences)."""
    p, t = cfg.parallelism, cfg.training
    n = p.pipeline_parallel_microbatches
    n = pp * v if n == -1 else n
    if n < pp:
        raise ConfigError(f"parallelism.pipeline_parallel_microbatches = {n}: too few to fill {pp} pipeline ranks; "
                          f"use at least {pp}")
    if t.local_batch_size % n:
        raise ConfigError(f"parallelism.pipeline_parallel_microbatches = {n}: must divide training.local_batch_size = "
                          f"{t.local_batch_size}")
    return n * accum


def check_splittable(model_name: str, splittable: bool, pp: int) -> None:
    """A model whose registry entry says its module tree cannot be cut into stages."""
    if not splittable and pp > 1:
        raise ConfigError(f"parallelism.pipeline_parallel_degree = {pp}: model.name = {model_name!r} cannot be "
                          f"split into pipeline stages (its base model runs embedding, layers and norm in one "
                          f"forward); use TP / FSDP / HSDP instead")


def check(cfg, args, pp: int) -> None:
    if getattr(args, "tie_embeddings", False):
        raise ConfigError("model.tie_embeddings = true: the embedding (first stage) and output (last stage) cannot "
                          "share a weight under pipeline parallelism; set it to false")
    v, _ = plan_stages(cfg, args.n_layers, pp)
    microbatches(cfg, pp, v, 1)


def stage_ids(pp_rank: int, pp: int, v: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def split_model(model: nn.Module, spec, counts: list[int], ids: list[int]) -> list[nn.Module]:
    whole_layers = getattr(model, spec.layers_attr)
    keys = list(whole_layers.keys())
    starts = [sum(counts[:i]) for i in range(len(counts))]
    parts = []
    for s in ids:
        # Copy the model without its layers (the copy's layer container starts empty), then only the
        # stage's own layers, through the same memo (weights shared with the rest stay shared): a
        # copy of every layer per stage cost 0.6 s of a 405B plan's 6.
        memo = {id(whole_layers): type(whole_layers)()}
        part = copy.deepcopy(model, memo)
        layers = getattr(part, spec.layers_attr)
        for k in keys[starts[s]:starts[s] + counts[s]]:
            layers[k] = copy.deepcopy(whole_layers[k], memo)
        if s != 0:
            for name in spec.pp_first:
                setattr(part, name, None)
        if s != len(counts) - 1:
            for name in spec.pp_last:
                setattr(part, name, None)
        if getattr(getattr(part, "args", None), "mtp_depth", 0) and hasattr(part, "head_and_mtp"):
            part.forward = types.MethodType(mtp_stage_forward, part)
        parts.append(part)
    return parts


def mtp_stage_forward(self, tokens_BL, positions=None, cache=None, documents=None, labels=None, ahead=None,
                      ahead_weight=None, last_only=False):
    """A pipeline stage of a model with multi-token prediction (DeepSeek-V3; models.deepseek_v3): the
    first stage embeds the tokens ahead with the one embedding table and every stage but the last
    passes those embeddings on beside the hidden state, one tensor [B, L, (1 + depth) E]. The MTP
    modules on the last stage thus read the first stage's embedding and its gradient flows back
    through the pipeline, with no second copy of the table to keep in sync (Megatron instead keeps a
    copy on the last stage and all-reduces the two tables' gradients). Cost: (1 + depth) x the p2p
    bytes. Every stage is given `ahead` (the training loop builds it from whole sequences)."""
    D = self.args.mtp_depth
    first, last = self.tok_embeddings is not None, self.norm is not None
    if ahead is None or cache is not None:
        return type(self).forward(self, tokens_BL, positions=positions, cache=cache, documents=documents,
                                  labels=labels, last_only=last_only)
    rope = self.rope_inputs(positions, documents)
    if first:
        h, e = self.tok_embeddings(tokens_BL), self.embed_ahead(ahead)
    else:
        h, *e = tokens_BL.chunk(D + 1, -1)
    h = self.run_layers(h, rope)
    if not last:
        return torch.cat([h, *e], -1)
    return self.head_and_mtp(h, e, rope, ahead, ahead_weight)


class StageUnion(nn.Module):
    """This rank's stages seen as one model with the original FQNs (layers merged, first/last
    modules where they live): for the optimizer, grad norms, state size and checkpoints."""

    def __init__(self, parts: list[nn.Module], layers_attr: str = "layers"):
        super().__init__()
        merged = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == layers_attr:
                    merged.update(child)
                elif child is not None:
                    self.add_module(name, child)
        self.add_module(layers_attr, merged)


def build_schedule(parts, ids, n_stages: int, device: torch.device, pp_group, n_micro: int, loss_fn, schedule: str):
    stages = [PipelineStage(part, sid, n_stages, device, group=pp_group) for part, sid in zip(parts, ids)]
    for stage in stages:
        _track(stage)
        _no_stats_in_inference(stage)
    cls = S.get_schedule_class(schedule)
    # scale_grads: gradients are divided by the microbatch count, matching a per-microbatch mean loss.
    if schedule in SINGLE:
        return Pipeline(cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True))
    return Pipeline(cls(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True))


class Pipeline:
    """A torch schedule plus a forward-only plan for evaluation.

    `schedule.eval()` on the runtime (multi-stage) schedules replays the training action list with
    backward switched off; ZBVZeroBubble and DualPipeV then fail ("can't steal_bwd_input if this
    stage doesn't have backward", torch 2.13). Evaluation therefore swaps in an action list of
    forwards only — each rank's stages in order, every microbatch — lowered with torch's own
    passes (FSDP unshard/reshard, then send/recv), and swaps the training list back afterwards.
    """

    def __init__(self, schedule):
        self.schedule = schedule
        self._eval_order = _forward_only_order(schedule)

    # Both run with return_outputs=False: the trainer reads the losses, never the merged outputs, and
    # torch's default (True) keeps every microbatch's last-stage output (the logits) in the stage's
    # output_chunks from its forward to the start of the next step, through the update
    # (pytorch/pytorch#159251): n_micro x the logits of a microbatch on the last pipeline rank.
    def step(self, *args, **kw):
        return self.schedule.step(*args, return_outputs=False, **kw)

    def recv_buffers(self) -> list[torch.Tensor]:
        """The receive buffers this rank's stages hold for the whole run (torch 2.13 allocates them at the
        first step and keeps them: one per microbatch for each input of a non-first stage, one per
        microbatch for each output gradient of a non-last stage; pytorch/pytorch#193872 and #196463 change
        that after 2.13). Read from torch's own `_RecvInfo`s; none before the first step."""
        sched = self.schedule
        stages = sched._stages if hasattr(sched, "_stages") else [sched._stage]
        out = []
        for stage in stages:
            for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
                out += [info.buffer for infos in table.values() for info in infos
                        if isinstance(getattr(info, "buffer", None), torch.Tensor)]
        return out

    def eval(self, *args, **kw):
        if self._eval_order is None:
            return self.schedule.eval(*args, return_outputs=False, **kw)
        train_order = self.schedule.pipeline_order_with_comms
        self.schedule.pipeline_order_with_comms = self._eval_order
        try:
            return self.schedule.eval(*args, return_outputs=False, **kw)
        finally:
            self.schedule.pipeline_order_with_comms = train_order


def _forward_only_order(schedule):
    if not isinstance(schedule, S._PipelineScheduleRuntime):
        return None  # single-stage schedules evaluate correctly on their own
    to_rank = schedule.stage_index_to_group_rank
    order = {}
    for rank in range(schedule.pp_group_size):
        mine = sorted(s for s, r in to_rank.items() if r == rank)
        order[rank] = S._add_unshard_reshard([S._Action(s, S._ComputationType.FORWARD, mb)
                                              for s in mine for mb in range(schedule._n_microbatches)])
    return S._add_send_recv(order, stage_to_rank=lambda s: to_rank[s], num_stages=schedule._num_stages)


# The pipeline action this process is running (or ran last), for the hang watchdog's report.
_INFLIGHT = {"action": None, "t0": 0.0, "done": True}


def _track(stage) -> None:
    """Record every compute action of `stage` (forward, backward, weight-grad) as it starts/ends."""
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        fn = getattr(stage, method)

        def wrapped(mb, *a, _fn=fn, _kind=kind, **kw):
            if _kind == "B" and kw.get("full_backward") is False:
                _kind = "I"
            _INFLIGHT.update(action=f"{_kind} stage {stage.stage_index} microbatch {mb}", t0=time.monotonic(), done=False)
            out = _fn(mb, *a, **kw)
            _INFLIGHT["done"] = True
            return out
        setattr(stage, method, wrapped)


def _no_stats_in_inference(stage) -> None:
    """torch infers each stage's shapes with one real forward at the first step (torch 2.13
    `_forward_metadata_inference`; later stages on uninitialised tensors): modules that count what
    they see (MoE routing loads, which steer the balancing bias) must not count that forward."""
    fn = getattr(stage, "_forward_metadata_inference", None)
    if fn is None:
        return

    def wrapped(*a, **kw):
        counters = [m for m in stage.submod.modules() if hasattr(m, "record_stats")]
        before = [m.record_stats for m in counters]
        for m in counters:
            m.record_stats = False
        try:
            return fn(*a, **kw)
        finally:
            for m, b in zip(counters, before):
                m.record_stats = b
    stage._forward_metadata_inference = wrapped


def describe_inflight() -> str:
    a = _INFLIGHT
    if a["action"] is None:
        return "pipeline: no action started yet"
    if a["done"]:
        return f"pipeline: last action {a['action']} finished; now waiting on communication (p2p or collective)"
    return f"pipeline: in action {a['action']} for {time.monotonic() - a['t0']:.1f} s"
