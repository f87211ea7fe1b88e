"""Expert parallelism: each rank of the `ep` group owns n_experts / ep whole experts; tokens travel
to their experts and back with two all-to-alls (GShard, Lepikhin et al. 2020).

The ep group is carved out of dp_shard x cp (torchtitan's scheme: EP borrows data-parallel ranks
and adds none): those F ranks are viewed as (efsdp, ep) with ep innermost. Expert weights are
DTensors sharded on dim 0 over `ep` and FSDP-sharded over `efsdp`; everything else is sharded
over all F ranks as usual. With TP and sequence parallel, each TP rank routes its own sequence
shard and the experts spread over ep x tp (`ep_tp`; over tp alone without EP): the tokens of a
TP group's shards meet at their experts as the ep group's do, each expert on one rank of the
ep x tp group, none computed twice (Megatron's expert parallel over the TP ranks). Without
sequence parallel every TP rank holds the whole sequence: experts run whole on every TP rank.

Dispatch, per MoE layer: (1) exchange per-expert token counts (all_to_all_single on a small int
tensor), (2) send every (token, expert) pair to the expert's owner — all_to_all_single with
uneven splits, autograd-aware, the only variant gloo accepts — (3) group received tokens by local
expert and run them (grouped matmuls where the dtype and device take them, as the local path),
(4) the reverse all-to-all. One host read per layer: the split sizes, which the collective takes
as lists. The backward of (2)/(4) are the same collectives
with the splits swapped, so expert gradients sum every rank's tokens; the trainer divides them by
ep so they match the data-parallel mean (see `expert_grad_scale`).
"""
from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import Shard, distribute_tensor

from torchmeg.config.errors import ConfigError
from torchmeg.models.hf_causal import is_hf_experts
from torchmeg.models import moe as moe_model  # (moe_model.expert_counts: the planner answers it on fake tensors)
from torchmeg.models.experts import EXPERT_WEIGHTS, expert_ffn, expert_weights, grouped_ffn, grouped_mm_takes
from torchmeg.models.moe import is_grouped_experts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local()


class AllToAllDispatch:
    def __init__(self, ep_mesh, n_experts: int):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.local = n_experts // self.ep

    def exchange_counts(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """What each ep peer sends this rank (its token counts for this rank's experts, [source
        rank x local expert]) on the device, and both count vectors on the host: the layer's one
        host read, since all_to_all_single takes its split sizes as lists."""
        recv = torch.empty_like(counts_E)
        dist.all_to_all_single(recv, counts_E, group=self.group)
        host = torch.cat([counts_E, recv]).tolist()
        return recv, host[:counts_E.numel()], host[counts_E.numel():]

    # The split sizes are read on the host: traced by torch.compile they would be guarded on and
    # recompile at every new routing (measured: 36 recompiles in 4 steps), so the exchange runs
    # eagerly between the compiled pieces of the block.
    @torch._dynamo.disable
    def __call__(self, experts: nn.Module, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ep, El = self.ep, self.local
        recv_counts, sent, got = self.exchange_counts(counts_E.to(torch.int64))
        send = [sum(sent[r * El:(r + 1) * El]) for r in range(ep)]
        recv = [sum(got[r * El:(r + 1) * El]) for r in range(ep)]
        x_recv = all_to_all_single_autograd(x_TD.contiguous(), recv, send, self.group)
        # Arrivals are ordered (source rank, local expert); regroup by local expert.
        local_ids = torch.arange(El, device=x_TD.device).repeat(ep).repeat_interleave(recv_counts, output_size=sum(recv))
        order = local_ids.argsort(stable=True)
        x_sorted = x_recv[order]
        per_expert = [sum(got[r * El + e] for r in range(ep)) for e in range(El)]
        if is_hf_experts(experts):
            y = _hf_local_ffn(experts, x_sorted, per_expert)
        else:
            w = expert_weights(experts, _local)
            if grouped_mm_takes(x_sorted, w.w1) and grouped_mm_takes(x_sorted, w.w2):
                y = grouped_ffn(w, x_sorted, recv_counts.view(ep, El).sum(0))
            else:
                y = expert_ffn(w, x_sorted, per_expert)
        y = y[order.argsort()]
        return all_to_all_single_autograd(y.contiguous(), send, recv, self.group)


class CapacityDispatch(AllToAllDispatch):
    """Expert parallel without a host read (parallelism.expert_capacity_factor > 0): every rank
    sends every peer a buffer of the same size, C = ceil(factor x its routed rows / ep) rows, so
    the all-to-alls take equal splits and nothing waits for the counts on the host (what CUDA
    graphs and a stream that never stalls need; Megatron's capacity factor with padding). Rows
    beyond a peer's C are dropped (their expert output is zero; `dropped` counts them); with
    factor = ep nothing can be dropped and the result is the dropless one. The padding rows are
    zeros given to the last local expert, so no row is left outside the groups; their outputs are
    never read back and carry no gradient. Needs grouped matmuls (bf16 on CUDA sm90+, fp32 / bf16
    on CPU)."""

    def __init__(self, ep_mesh, n_experts: int, factor: float):
        super().__init__(ep_mesh, n_experts)
        self.factor = factor
        self.dropped = None  # rows dropped since the router log last read it (a device scalar)

    @torch._dynamo.disable
    def __call__(self, experts: nn.Module, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ep, El, dev = self.ep, self.local, x_TD.device
        N, D = x_TD.shape
        C = max(1, math.ceil(self.factor * N / ep))
        counts = counts_E.to(torch.int64).view(ep, El)
        # Rows arrive sorted by expert, hence by owner: each row's owner and place in its buffer.
        per_peer = counts.sum(1)
        owner = torch.repeat_interleave(torch.arange(ep, device=dev), per_peer, output_size=N)
        place = torch.arange(N, device=dev) - (per_peer.cumsum(0) - per_peer)[owner]
        keep = place < C
        slot = torch.where(keep, owner * C + place, ep * C)  # dropped rows -> one scratch row
        send = x_TD.new_zeros(ep * C + 1, D).index_copy(0, slot, x_TD)[:-1]
        # what survives of each (peer, local expert) count: the buffer takes experts in order
        ends = counts.cumsum(1)
        kept = (ends.clamp(max=C) - (ends - counts).clamp(max=C)).flatten()
        dropped = (N - kept.sum()).to(torch.float32)
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        recv_counts = torch.empty_like(kept)
        dist.all_to_all_single(recv_counts, kept, group=self.group)
        x_recv = all_to_all_single_autograd(send.contiguous(), None, None, self.group)
        # each received row's local expert (padding rows: the last one), then grouped by it
        row = torch.arange(C, device=dev).expand(ep, C)
        ids = torch.searchsorted(recv_counts.view(ep, El).cumsum(1), row.contiguous(), right=True).clamp(max=El - 1)
        ids = ids.flatten()
        order = ids.argsort(stable=True)
        sizes = moe_model.expert_counts(ids, El)
        x_sorted = x_recv[order]
        if is_hf_experts(experts):
            w = (experts.gate_up_proj.to_local(), experts.down_proj.to_local())
            offs = sizes.cumsum(0).to(torch.int32)
            h = experts._apply_gate(torch._grouped_mm(x_sorted, w[0].transpose(-2, -1), offs=offs))
            y = torch._grouped_mm(h, w[1].transpose(-2, -1), offs=offs)
        else:
            w = expert_weights(experts, _local)
            if not (grouped_mm_takes(x_sorted, w.w1) and grouped_mm_takes(x_sorted, w.w2)):
                raise ConfigError(f"parallelism.expert_capacity_factor = {self.factor}: needs grouped matmuls, not "
                                  f"there for {x_sorted.dtype} here (bf16 on CUDA sm90+, which the planner assumes; "
                                  f"fp32 / bf16 on CPU); use mixed_precision = \"bf16\" or expert_capacity_factor = 0")
            y = grouped_ffn(w, x_sorted, sizes)
        y = all_to_all_single_autograd(y[order.argsort()].contiguous(), None, None, self.group)
        return torch.cat([y, y.new_zeros(1, D)])[slot]  # dropped rows: zeros


def apply_ep(model: nn.Module, ep_mesh, capacity_factor: float = 0.0) -> list[nn.Parameter]:
    """Shard every experts module (torchmeg's grouped experts, transformers' MoE experts) over
    `ep_mesh`; returns the expert parameters. capacity_factor > 0: CapacityDispatch."""
    params = []
    for m in model.modules():
        if is_grouped_experts(m):
            names, n = [k for k in EXPERT_WEIGHTS if getattr(m, k, None) is not None], m.n_experts
        elif is_hf_experts(m):
            _check_hf_layout(m)
            names, n = ("gate_up_proj", "down_proj"), m.num_experts
            # transformers' forward loops over the experts it holds; under EP tokens must travel first
            m.forward = types.MethodType(_hf_experts_forward, m)
        else:
            continue
        for name in names:
            p = nn.Parameter(distribute_tensor(getattr(m, name).data, ep_mesh, [Shard(0)], src_data_rank=None))
            setattr(m, name, p)
            params.append(p)
        m.dispatch = CapacityDispatch(ep_mesh, n, capacity_factor) if capacity_factor > 0 else \
            AllToAllDispatch(ep_mesh, n)
    return params


def is_expert_module(m: nn.Module) -> bool:
    return is_grouped_experts(m) or is_hf_experts(m)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_expert_module(m)]


def _check_hf_layout(m: nn.Module) -> None:
    """The layout most of transformers' MoE experts share: [gate; up] concatenated, weights [out, in],
    no biases (Qwen2/3-MoE, DeepSeek-V3, Mixtral). Others (gpt-oss: transposed, with biases) are refused."""
    if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False) or not getattr(m, "is_concatenated", True) \
            or not getattr(m, "has_gate", True):
        raise ConfigError(f"parallelism.expert_parallel_degree > 1: {type(m).__name__} stores its experts "
                          f"transposed, interleaved or with biases, which torchmeg's expert parallel does not read; "
                          f"use expert_parallel_degree = 1 (FSDP shards them as any weight)")


def _hf_experts_forward(self, hidden_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts interface (hidden [T, D], the top-k expert ids and weights [T, k]) over
    torchmeg's dispatch: (token, expert) pairs sorted by expert travel to the experts' owners."""
    T, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    counts = moe_model.expert_counts(flat, self.num_experts)
    token = order // k
    y = self.dispatch(self, hidden_TD[token], counts)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(hidden_TD).index_add_(0, token, y.to(hidden_TD.dtype))


def _hf_local_ffn(experts: nn.Module, x_TD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts this rank holds over their contiguous slices of expert-sorted tokens, as
    transformers computes one: [gate; up] projection, the module's gate, down projection."""
    gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
    outs = [F.linear(experts._apply_gate(F.linear(x, gate_up[e])), down[e])
            for e, x in enumerate(torch.split(x_TD, counts)) if x.shape[0]]
    return torch.cat(outs) if outs else x_TD.new_zeros(0, down.shape[1])


def check(cfg, args, dims) -> None:
    ep = dims.ep
    key = f"parallelism.expert_parallel_degree = {ep}"
    if not getattr(args, "n_experts", 0):
        raise ConfigError(f"{key}: model.name = {cfg.model.name!r} has no experts; use model.name = \"moe\" or 1")
    if args.n_experts % ep:
        raise ConfigError(f"{key}: does not divide model.n_experts = {args.n_experts}")
    if dims.fsdp % ep:
        raise ConfigError(f"{key}: EP borrows ranks from data_parallel_shard_degree x context_parallel_degree = "
                          f"{dims.fsdp}; pick a divisor of it")
    if dims.experts_over_tp and args.n_experts % (ep * dims.tp):
        raise ConfigError(f"parallelism.tensor_parallel_degree = {dims.tp}: the routed experts are spread over "
                          f"expert_parallel_degree x tensor_parallel_degree = {ep * dims.tp} ranks, which does not "
                          f"divide model.n_experts = {args.n_experts}; pick degrees whose product divides it "
                          f"(or set parallelism.sequence_parallel = false to run every expert on every TP rank)")


class _SumStatistics(torch.autograd.Function):
    """Sums `t` over `group`. Backward: the ranks' upstream gradients summed (`sum_grads`), or this
    rank's passed through."""

    @staticmethod
    def forward(ctx, t, group, sum_grads: bool):
        ctx.group, ctx.sum_grads = group, sum_grads
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.sum_grads:
            g = g.clone()
            dist.all_reduce(g, group=ctx.group)
        return g, None, None


def sum_over_shards(module: nn.Module, group, sum_grads: bool) -> None:
    """A MoE's balance losses read token statistics (per sequence or per batch); when other ranks
    hold other parts of the same sequences (context parallel's shards; sequence parallel's when the
    experts spread over tp) those statistics are summed over `group` first, so every rank computes
    the whole sequences' loss. Its gradient reaches each rank's own tokens' scores; the weights'
    gradients over those ranks then need the sum of every rank's: under CP, whose gradients are
    averaged over dp x cp, the backward sums the ranks' (equal) upstream gradients (`sum_grads`, cp x,
    undone by the mean); under TP the router's gradient is summed over tp by its own reduction, so
    the backward passes through. Composes with a sum set earlier (CP, then TP)."""
    prev = module.shard_sum

    def reduce(t):
        return _SumStatistics.apply(t if prev is None else prev(t), group, sum_grads)
    module.shard_sum = reduce
