"""One training step of a recipe per rank, on fake tensors at any world size: what is traced, as jobs,
and the traces combined.

Torch's fake process group at the recipe's world size, each job's process playing one
representative rank of each pipeline stage (coordinate 0 on every other mesh dim: under uneven
sharding the first shard is the largest). Meshes are real DeviceMeshes over the fake group; the
model is built on meta and goes through the trainer's own build (split, the real parallelize(),
storage under FakeTensorMode), so every DTensor plan, FSDP unit and collective is the one a real
run would have; one step runs under torch's MemTracker and StepCost (torchmeg.plan.trace_step).
A few layers of each kind are traced and the step scaled to the whole depth (torchmeg.plan.depth):
`prepare` decides the traces, each (pipeline rank kind, trace) is a job, `run_jobs` traces jobs of
any number of plans in one pool (--search), `DryRun.finish` combines them; with plan.trace_cache a
job traced before is read back (torchmeg.plan.trace_cache). Pipeline ranks are
accounted for from their stages (torchmeg.plan.pipeline_rank).

compile is off in a dry run (inductor does not trace fake-mode parameters); it changes no
parameter, gradient or optimizer byte and lowers activation memory a little, so the plan errs high.
Document masking (data.document_masking) is planned as one document per window: where documents
end depends on the data, and shorter ones attend to fewer keys, so attention FLOPs err high too.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import sys
import warnings

import torch.distributed as dist

from torchmeg.config.errors import ConfigError
from torchmeg.config.layout import Layout
from torchmeg.models.args import instantiate
from torchmeg.parallel import pipeline as pl
from torchmeg.parallel.mxfp8 import MX_RECIPES
from torchmeg.parallel.parallelize import describe_report
from torchmeg.plan import depth, trace_cache
from torchmeg.plan.fake_world import balanced_routing, fake_world, sharding_propagation_as_in_eager
from torchmeg.plan.pipeline_rank import measure_pipeline, pipeline_ranks
from torchmeg.plan.reuse import reuse_distances
from torchmeg.plan.step_cost import mesh_group_labels
from torchmeg.plan.trace_lanes import lane, run_lanes
from torchmeg.plan.trace_step import measure_step, peak_phase
from torchmeg.runtime.cpus import usable_cores
from torchmeg.train.build import add_adapters


# What planning children work on, set before the Pool forks them: inherited by the fork, never
# pickled (a user's ModelSpec may hold lambdas). id -> DryRun.
_PREPARED: dict = {}
_KEYS = itertools.count()


@dataclasses.dataclass
class DryRun:
    """A plan's traces as jobs: (id, pipeline rank, trace) each. `finish` combines their pieces."""
    cfg: object
    layout: Layout
    traces: list
    groups: list[list[int]]  # pipeline ranks with the same stage shapes; the first is traced
    key: int = 0
    cached: int = 0  # jobs read from plan.trace_cache instead of traced (torchmeg.plan.trace_cache)
    # A stage alike to one traced elsewhere is not traced again: traced rank -> {stage: (the rank that
    # traces it, its stage there)}, filled in by `finish` (the sampled traces only: not a fallback's)
    reads: dict = dataclasses.field(default_factory=dict)
    n_sampled: int = 0

    @property
    def jobs(self) -> list[tuple[int, int, int]]:
        """A trace that adds layers only to other ranks' stages builds this rank's as the base does:
        not traced again (finish takes the base's piece)."""
        return [(self.key, g[0], i) for g in self.groups for i, t in enumerate(self.traces)
                if t.stages is None or t.stages & set(self._stage_ids(g[0]))]

    def _stage_ids(self, pp_rank: int) -> list[int]:
        st = self.layout.stages
        return pl.stage_ids(pp_rank, self.layout.dims.pp, st.per_rank, st.schedule) if st is not None else [0]

    def read_stages(self, job: tuple[int, int, int]) -> list[int]:
        """The stages a job leaves to another's trace (none in a fallback trace of every layer)."""
        _, pp_rank, i = job
        return sorted(self.reads.get(pp_rank, {})) if i < self.n_sampled else []

    def _piece(self, pieces: dict, rank: int, i: int) -> dict:
        """Trace i of this rank's group (its base where i adds nothing to its stages), with the stages it
        did not trace taken from the trace that measured them (a stage is read only from where it was
        measured, so that trace has it)."""
        raw = lambda r: pieces.get((self.key, r, i), pieces[self.key, r, 0])  # noqa: E731
        piece = raw(rank)
        if not self.reads.get(rank):
            return piece
        piece = dict(piece, per_stage=dict(piece["per_stage"]))
        for sid, (owner, owner_sid) in self.reads[rank].items():
            piece["per_stage"][sid] = copy.deepcopy(raw(owner)["per_stage"][owner_sid])
        return piece

    def finish(self, pieces: dict, isolate: bool = False) -> list[dict]:
        """pieces: job -> what it traced. -> one entry per pipeline rank, sorted by rank."""
        layout, st = self.layout, self.layout.stages
        sampled = list(self.traces)
        traced = [len(t.keep) if t.keep is not None else layout.args.n_layers for t in sampled]
        out = []
        for g in self.groups:
            try:
                m = depth.combine([depth.by_role(self._piece(pieces, g[0], i), t.roles) for i, t in enumerate(sampled)],
                                  [t.coeff for t in sampled])
                m["traced_layers"] = traced
            except depth.NotLinear:  # (no recipe does this; such a model is still planned, tracing every layer)
                if len(self.traces) == len(sampled):  # (one more trace, of every layer, for the children to find)
                    self.traces.append(depth.Trace(None, st.layers if st is not None else None, 1))
                m, = run_jobs([(self.key, g[0], len(sampled))], isolate)
                m["traced_layers"] = [layout.args.n_layers]
            m["report"] = " | ".join(describe_report(r) for r in m["reports"].values())
            out += pipeline_ranks(self.cfg, layout, m, g) if layout.dims.pp > 1 else [_single_rank(m)]
        return sorted(out, key=lambda r: r["rank"])


def prepare(cfg, layout: Layout, whole=None) -> DryRun:
    """What to trace for this plan (torchmeg.plan.depth), registered for the children that trace it.
    `whole`: the model on meta if the caller has it (read only; LoRA adds its adapters to one of its own)."""
    dims, st = layout.dims, layout.stages
    cfg.compile.enable = False
    # A plan is for a GPU with float8 matmuls: count torch._scaled_mm, not the CPU's emulation of it.
    cfg.float8.emulate = False
    if cfg.float8.enable and cfg.float8.recipe in MX_RECIPES:
        raise ConfigError(f"float8.recipe = {cfg.float8.recipe!r}: the planner cannot trace torchao's MXFP8 kernels "
                          f"(Triton / CUDA, sm_100) on fake tensors; plan with float8.recipe = \"rowwise\" (the nearest "
                          f"one it traces) or float8.enable = false")
    kinds = None
    if cfg.plan.trace_layers == "sampled":
        if whole is None or cfg.lora.enable:
            whole = instantiate(layout.spec, layout.args, "meta")
        if cfg.lora.enable:
            add_adapters(whole, cfg)
        kinds = depth.layer_kinds(whole, layout.spec, cfg)
    groups: dict[tuple, list[int]] = {}
    for pp_rank in range(dims.pp):
        groups.setdefault(_stage_shapes(layout, kinds, pp_rank), []).append(pp_rank)
    traces = depth.sample(kinds, st.layers if st is not None else None)
    run = DryRun(cfg, layout, traces, list(groups.values()), key=next(_KEYS), n_sampled=len(traces),
                 reads=_stages_read(layout, groups))
    _PREPARED[run.key] = run
    return run


def _stage_shapes(layout: Layout, kinds: dict[str, int] | None, pp_rank: int) -> tuple:
    """What a pipeline rank's stages are, as far as a trace can tell: ranks with equal shapes trace as
    one. Each stage's layers by kind (depth.layer_kinds: the block's modules and settings and whether it
    is recomputed, so stages of 5 layers with every 2nd block recomputed or windowed / full attention
    alternating are two shapes, not one) and whether it is the first or the last. The reference plan
    (trace_layers = "all") traces every rank on its own, as does a model whose layers are not numbered."""
    st = layout.stages
    if st is None:
        return ()
    if kinds is None:  # (trace_layers = "all", or layers not numbered)
        return (pp_rank,)
    keys = list(kinds)
    starts = [sum(st.layers[:s]) for s in range(st.n_stages)]
    return tuple((tuple(kinds[k] for k in keys[starts[s]:starts[s] + st.layers[s]]), s == 0, s == st.n_stages - 1)
                 for s in pl.stage_ids(pp_rank, layout.dims.pp, st.per_rank, st.schedule))


def _stages_read(layout: Layout, groups: dict[tuple, list[int]]) -> dict[int, dict[int, tuple[int, int]]]:
    """Which traced rank reads which of its stages from another trace: each stage shape is measured once
    (under an interleaved schedule a middle rank holds two or more alike stages, and the first and the
    last rank each hold a middle stage like theirs). Ranks of fewer distinct stages are looked at first,
    so a middle rank measures the middle stage and the first and last ranks only their own."""
    st, owner, reads = layout.stages, {}, {}
    if st is None or not all(isinstance(s, tuple) for shape in groups for s in shape):  # (ranks traced alone)
        return reads
    for shape, g in sorted(groups.items(), key=lambda kv: (len(set(kv[0])), kv[1][0])):
        ids = pl.stage_ids(g[0], layout.dims.pp, st.per_rank, st.schedule)
        for sid, stage in zip(ids, shape):
            if stage not in owner:
                owner[stage] = (g[0], sid)
            else:
                reads.setdefault(g[0], {})[sid] = owner[stage]
    return reads


def forget(run: DryRun) -> None:
    _PREPARED.pop(run.key, None)


def run_jobs(jobs: list[tuple[int, int, int]], isolate: bool = False) -> list[dict]:
    """Trace each job, as many at a time as this machine has cores, in forked children that keep to one
    fake world each (torchmeg.plan.trace_lanes: a child traces the next job of its world and meshes as
    it finishes one, never another rank's). A job whose trace plan.trace_cache holds is read, not
    traced."""
    out = {}
    for job in jobs:
        piece = cached_piece(job)
        if piece is not None:
            out[job] = piece
    todo = [j for j in jobs if j not in out]
    if len(todo) == 1 and not isolate:
        out[todo[0]] = trace_job(todo[0])
    elif todo:
        def pick(want):
            job = next((j for j in todo if want(job_lane(j))), None)
            if job is not None:
                todo.remove(job)
            return job
        run_lanes(max(1, min(len(todo), usable_cores())), job_lane, pick, out.__setitem__, trace_job)
    return [out[j] for j in jobs]


def job_lane(job: tuple[int, int, int]) -> tuple:
    """The fake world a job is traced in (torchmeg.plan.trace_lanes.lane)."""
    return lane(_PREPARED[job[0]], job)


def cached_piece(job: tuple[int, int, int]) -> dict | None:
    """The job's trace from plan.trace_cache (counted on its DryRun), or None."""
    run = _PREPARED[job[0]]
    if not run.cfg.plan.trace_cache:
        return None
    piece = trace_cache.load(run.cfg.plan.trace_cache, trace_cache.job_key(run, job))
    run.cached += piece is not None
    return piece


def trace_job(job: tuple[int, int, int]) -> dict:
    """Trace one job (kept in plan.trace_cache when one is set)."""
    piece = _trace(job)
    run = _PREPARED[job[0]]
    folder = run.cfg.plan.trace_cache
    if folder:
        try:
            trace_cache.store(folder, trace_cache.job_key(run, job), piece)
        except OSError as e:  # (a plan is still a plan: the next one traces again)
            print(f"plan.trace_cache = {folder!r}: cannot keep a trace there ({e.strerror or e}); planning on "
                  f"without it", file=sys.stderr, flush=True)
    return piece


def _trace(job: tuple[int, int, int]) -> dict:
    """Trace one job: trace i of plan `key` for pipeline rank pp_rank (the global rank with that pp
    coordinate and 0 elsewhere; pp is the outermost mesh dim)."""
    key, pp_rank, i = job
    run = _PREPARED[key]
    cfg, layout, t = run.cfg, run.layout, run.traces[i]
    dims, st = layout.dims, layout.stages
    fake_world(dims.world_size, pp_rank * (dims.world_size // dims.pp))
    # (DTensor's advice to flatten mesh dims for a two-dim norm reduction, once per traced process: a
    # real run's advice, printed by the trainer; a plan printing it per trace buries its table)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        with sharding_propagation_as_in_eager(), balanced_routing(), reuse_distances(cfg.plan.cache_bytes), \
                warnings.catch_warnings():
            # (FSDP2's warning that a wrapped module returned a view: on fake tensors a functional
            # collective ends in wait_tensor, an alias of its input (torch's _maybe_wrap_tensor while
            # tracing), so the expert dispatch's all-to-all output reads as a view; an eager run gets a
            # tensor of its own and no warning. A plan printing it per trace buries its table.)
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                                    category=UserWarning)
            mesh, ep_mesh = dims.build_mesh("cpu"), dims.build_ep_mesh("cpu")
            labels = mesh_group_labels(mesh, *([ep_mesh] if ep_mesh is not None else []))
            if st is None:
                return measure_step(cfg, layout, mesh, ep_mesh, labels, t.keep)
            lay = dataclasses.replace(layout, stages=dataclasses.replace(st, layers=t.stage_layers))
            return measure_pipeline(cfg, lay, mesh, ep_mesh, labels, t.keep, set(run.read_stages(job)))
    finally:
        dist.destroy_process_group()


def _single_rank(m: dict) -> dict:
    out = m["step"]
    out["memory"] = peak_phase(out["memory_phases"])  # (scaled phase by phase: their peaks scale apart)
    out.update(rank=0, pp_rank=0, stages=[0], model_state_bytes=m["state"], report=m["report"],
               traced_layers=m["traced_layers"])
    return out
