"""The optimizer's update in a plan's trace, run on the local shards of DTensor parameters (fast to trace),
with the host cost of the DTensor ops it stands for still counted (torchmeg.plan.trace_step.track_step)."""
from __future__ import annotations

import collections
import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


def _one_placement(p: DTensor, state: dict | None) -> bool:
    """Whether p's gradient and optimizer state exist and have p's mesh and placements."""
    def same(t) -> bool:
        return isinstance(t, DTensor) and t.device_mesh == p.device_mesh and t.placements == p.placements
    return bool(state) and (p.grad is None or same(p.grad)) and all(
        same(v) for v in state.values() if isinstance(v, torch.Tensor) and v.ndim)


class _WouldBeDTensor(TorchDispatchMode):
    """Each op that reads a tensor standing for a DTensor (a local shard, or what such an op made) is one
    DTensor op of the real update: `cost` counts its host work (StepCost.dtensor_op). Its outputs stand
    for DTensors in turn (the update's temporaries: a square root, a denominator)."""

    def __init__(self, shards: list, cost):
        super().__init__()
        # (held weakly, by identity: marking a temporary must not keep it alive past its last use, or the
        # update's traced peak would hold every parameter's temporaries at once)
        self.marked, self.cost = WeakIdKeyDictionary({t: True for t in shards}), cost

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (an aten op, as DTensor's dispatch sees it: not a query of a tensor's device or size)
        stands = func.namespace == "aten" and any(
            isinstance(t, torch.Tensor) and t in self.marked for t in pytree.tree_leaves((args, kwargs)))
        if stands:  # (counted before its local op, in the order a real step dispatches them)
            self.cost.dtensor_op(func)
        out = func(*args, **(kwargs or {}))
        if stands:
            self.marked.update((t, True) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def on_local_shards(opt, cost=None):
    """torch's Adam / AdamW update run on the local shards of DTensor parameters, gradients and state:
    the same local ops DTensor would run, without its sharding propagation. An elementwise update whose
    parameter, gradient and state tensors all have one mesh and one placement is decided by DTensor as
    that placement, with no redistribution, and then runs each op on the local tensors; deciding it is
    the cost (the foreach ops over every parameter, decided afresh in each trace's own fake world: 0.8 s
    of a 70B trace, more for gpt-oss's experts). That decision is also the host's work in a real step,
    so with `cost` (a StepCost) each op on the shards counts one DTensor op's host cost, as it would
    have run: a CPU's per-parameter AdamW over a TP 2 debug Llama dispatches ~340 DTensor ops a step,
    ~25 us each on this CPU (profiled 2026-12-07), a third of the step's DTensor ops, which the plan had
    not counted. Any other case (another optimizer, a placement that differs, state not yet created)
    runs as the trainer runs it, and so does a real run's update (`--measure`: the reality a plan is
    checked against runs the trainer's own code, on real tensors)."""
    pairs = [(g, i, p) for g in opt.param_groups for i, p in enumerate(g["params"]) if isinstance(p, DTensor)]
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or not pairs or not all(
            isinstance(p._local_tensor, FakeTensor) and _one_placement(p, opt.state.get(p)) for _, _, p in pairs):
        yield
        return
    state = opt.state
    local = collections.defaultdict(dict, {k: v for k, v in state.items() if not isinstance(k, DTensor)})
    kept = [p._local_tensor.grad for _, _, p in pairs]
    shards = []
    for g, i, p in pairs:
        loc = p._local_tensor
        loc.grad = p.grad._local_tensor if p.grad is not None else None
        local[loc] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state[p].items()}
        shards += [loc, *([loc.grad] if loc.grad is not None else []),
                   *(v._local_tensor for v in state[p].values() if isinstance(v, DTensor))]
        g["params"][i] = loc
    opt.state = local
    try:
        with _WouldBeDTensor(shards, cost) if cost is not None else contextlib.nullcontext():
            yield
    finally:
        opt.state = state
        for (g, i, p), grad in zip(pairs, kept):
            g["params"][i].grad = grad
            g["params"][i] = p
