"""The planner's fake world: this process as one rank of a fake process group at any world size,
with the few answers fake tensors cannot give themselves (DTensor's sharding propagation as in a
real run; MoE routing planned as balanced)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.tensor._sharding_prop as sharding_prop
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchmeg.models import moe as moe_model
from torchmeg.parallel.expert import AllToAllDispatch


def fake_world(world: int, rank: int):
    """This process as `rank` of a fake world. DTensor caches each op's sharding decision under a
    key in which a mesh of the same shape and names compares equal, whatever process groups it
    holds: a cache kept from the previous fake world hands out meshes whose groups are gone."""
    if dist.is_initialized():
        dist.destroy_process_group()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@contextlib.contextmanager
def sharding_propagation_as_in_eager():
    """DTensor derives each op's output shape by running it on global-shaped fake tensors, under
    the active fake mode if there is one (torch 2.13, ShardingPropagator). In a real run there is
    none, so it makes a private FakeTensorMode that the trackers ignore; in the dry run it would
    reuse ours and the trackers would count those global-shaped shadow ops (+40% TP matmul FLOPs,
    +5% activation peak, measured). Make the dry run do what a real run does."""
    saved = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = saved


@contextlib.contextmanager
def balanced_routing():
    """MoE routing counts tokens per expert (torchmeg.models.moe.expert_counts), and the splits taken
    from those counts depend on the data, which fake tensors do not have. The plan assumes balanced
    routing — the state aux-loss-free balancing drives towards — by answering a count on fake
    tensors with real, equal counts (T*K / E each; the remainder to the first experts). Expert
    parallel's exchange of those counts then has a known answer too: every peer routed alike, so
    each sends this rank its own counts for this rank's experts (the collective still runs, and is
    counted, on a scratch buffer)."""
    saved, exchange = moe_model.expert_counts, AllToAllDispatch.exchange_counts

    def expert_counts(idx, n):
        if not isinstance(idx, FakeTensor):
            return saved(idx, n)
        m = idx.numel()
        with unset_fake_temporarily():
            return torch.tensor([m // n + (1 if e < m % n else 0) for e in range(n)], dtype=torch.int64)

    def balanced_exchange(self, counts_E):
        dist.all_to_all_single(torch.empty_like(counts_E), counts_E, group=self.group)
        with unset_fake_temporarily():
            recv = counts_E.view(self.ep, self.local)[dist.get_rank(self.group)].repeat(self.ep)
        return recv, counts_E.tolist(), recv.tolist()
    moe_model.expert_counts, AllToAllDispatch.exchange_counts = expert_counts, balanced_exchange
    try:
        yield
    finally:
        moe_model.expert_counts, AllToAllDispatch.exchange_counts = saved, exchange
