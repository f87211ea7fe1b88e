"""The host's cost of a DTensor op in a tensor-parallel training step, measured on a real TP model.

A TP step's DTensor ops cost their local op's dispatch plus DTensor's own host work: sharding
propagation (a cache lookup whose key hashes every argument's spec), the unwrap and rewrap, and
the parallel styles' hooks around each module (from_local, redistribute, to_local), all in Python.
Chains of one-element DTensor multiplies, what this measured before, cover the first two only and
priced a TP step's DTensor op at 22-28 us where the same CPU, the same minute, spent 38 us on the
ops of a real TP model (2026-12-07, this 2-core CPU: a tiny Llama and a tiny MoE alike); the TP 2 rows
of tools/plan_vs_run.py were the planner's furthest from their runs (0.72-0.84x; priced as below,
0.96-0.97: docs/planning.md).

So the planner's per-op price comes from a real step: the trainer's own Llama, tiny (work is
nothing: every microsecond is host), sharded by its registry TP plan with sequence and loss parallel
as a TP recipe runs it, forward, loss and backward, over a *fake* process group (its collectives
return at once: the calibration's collective tables price those, with their own host work). The
step's time less its plain ops' dispatch (the calibrated eager op), over the DTensor ops the
planner's counter (step_cost.StepCost) counts in it, is what each DTensor op of a plan adds.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchmeg.config.schema import Config
from torchmeg.models.args import build_model
from torchmeg.models.init import init_weights
from torchmeg.models.spec import get_spec, spec_tp_plan
from torchmeg.parallel.tensor import apply_tp
from torchmeg.plan.step_cost import StepCost
from torchmeg.plan.timing import seconds
from torchmeg.train.build import cross_entropy

TP = 2             # the fake group's ranks: a TP 2 step's ops (a wider group runs the same ops)
TINY = {"dim": 16, "n_heads": 2, "n_kv_heads": 2, "n_layers": 2}  # work is nothing: the host is all
SEQ, VOCAB = 8, 64
MIN_TIME = 0.3     # seconds of steps timed (a step is ~5-15 ms here)


@contextlib.contextmanager
def _fake_group():
    """A process group of TP ranks that communicates nothing: beside the real one if there is one (each
    rank in a group of TP of its own; every rank creates them all: new_subgroups is collective over the
    default group), else as the default."""
    clear = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear
    clear()  # (a mesh of the same shape compares equal whatever its group: no decision reused across)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
        group = dist.group.WORLD
    else:
        group, _ = dist.new_subgroups(TP, backend="fake")
    try:
        yield group
    finally:
        clear()
        dist.destroy_process_group(None if own else group)  # (the default group only if it was ours)


def _tp_model(device, mesh):
    """The trainer's Llama at TINY, initialised and sharded by the registry's TP plan (sequence and loss
    parallel on, as a TP recipe's defaults)."""
    cfg = Config()
    cfg.model.name, cfg.model.flavor, cfg.model.overrides = "llama", "debug", dict(TINY)
    cfg.training.seq_len = SEQ
    model = build_model(cfg, VOCAB, device)
    init_weights(model, seed=0)
    apply_tp(model, mesh, spec_tp_plan(get_spec("llama"), model), sp=True, loss_parallel=True)
    return model


def dtensor_op(device, dispatch_s: float) -> float:
    """Host seconds one DTensor op of a TP training step adds beyond its local op's `dispatch_s` (see
    the module's docstring); 0 where the ranks do not split into groups of TP (a world of 3)."""
    if dist.is_initialized() and dist.get_world_size() % TP:
        return 0.0
    with _fake_group() as group:
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))
        model = _tp_model(device, mesh)
        tokens = torch.randint(0, VOCAB, (1, SEQ), device=device)

        def step():
            with loss_parallel():
                cross_entropy(model(tokens), tokens).backward()
        step()  # (the sharding decisions cached, as in a step after the first)
        cost = StepCost()
        with cost:
            step()
        n_dtensor = sum(op[3] == "subclass" for op in cost.ops)
        n_plain = len(cost.ops) - n_dtensor
        t = seconds(step, device, MIN_TIME)
    return max(0.0, (t - n_plain * dispatch_s) / max(1, n_dtensor))
