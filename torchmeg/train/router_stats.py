"""The step's collectives behind MoE load balancing and the router log (tokens per expert, the
imbalance, DeepSeek-V3's MTP loss): one function, run by the trainer and by the planner's dry run,
so the plan counts the same collectives the step issues."""
from __future__ import annotations

import torch
import torch.distributed as dist


def router_modules(parts) -> tuple[list, list]:
    """(MoE layers, models with an MTP loss) of this rank's model parts."""
    modules = [m for part in parts for m in part.modules()]
    return [m for m in modules if hasattr(m, "update_bias")], [m for m in modules if hasattr(m, "mtp_loss")]


def reduce_router_stats(moe_layers: list, mtp_models: list, args, dims, mesh, device):
    """-> (loads [this rank's MoE layers, experts] summed over the loss group (dp x cp), the log's
    summary [tokens per expert over every layer..., (token, expert) rows dropped by a capacity-bound
    expert dispatch, sum of per-layer max/mean, layers] or None, the
    MTP loss summed over the loss group or None). Under PP each stage holds its own layers: the
    summary and the MTP loss (last stage only) are summed over the pipeline too, every rank
    joining whether it holds MoE layers or not, so whichever rank prints logs the whole model. With
    the experts over tp each TP rank routes its own sequence shard: the loads are summed over tp
    too, so every TP rank updates its routing bias alike."""
    pp, loss_group, pp_group = dims.pp, mesh["dp_cp"].get_group(), mesh["pp"].get_group()
    n_experts = getattr(args, "n_experts", 0) if pp > 1 else 0
    loads = summary = mtp = None
    if moe_layers or n_experts:
        loads = torch.stack([m.tokens_per_expert for m in moe_layers]) if moe_layers else \
            torch.zeros(0, n_experts, device=device)
        dropped = [d for m in moe_layers if (d := getattr(m.experts.dispatch, "dropped", None)) is not None]
        # one collective for both: the loads and the dropped rows
        flat = torch.cat([loads.flatten(), sum(dropped, loads.new_zeros(())).view(1)])
        dist.all_reduce(flat, group=loss_group)
        if dims.experts_over_tp:
            dist.all_reduce(flat, group=mesh["tp"].get_group())
        loads = flat[:-1].view_as(loads)
        for m in moe_layers:
            if getattr(m.experts.dispatch, "dropped", None) is not None:
                m.experts.dispatch.dropped = None
        ratio = loads.max(1).values / loads.mean(1).clamp_min(1e-9) if moe_layers else loads.new_zeros(0)
        summary = torch.cat([loads.sum(0), flat[-1:], ratio.sum().view(1), loads.new_full((1,), float(len(loads)))])
        if n_experts:
            dist.all_reduce(summary, group=pp_group)
    if getattr(args, "mtp_depth", 0):
        mtp = sum((m.mtp_loss for m in mtp_models), torch.zeros((), device=device)).detach().clone()
        dist.all_reduce(mtp, group=loss_group)
        if pp > 1:
            dist.all_reduce(mtp, group=pp_group)
    return loads, summary, mtp


def step_router_stats(moe_layers: list, mtp_models: list, args, dims, mesh, device, capacity_factor: float,
                      loss_group) -> dict:
    """After a step: the global tokens per expert -> each MoE layer's load-balancing bias update,
    counts cleared for the next step; -> the log's router stats (imbalance, tokens per expert, rows
    dropped under a capacity factor) and DeepSeek-V3's MTP loss (mean over the loss group)."""
    loads, summary, mtp = reduce_router_stats(moe_layers, mtp_models, args, dims, mesh, device)
    stats = {}
    for m, load in zip(moe_layers, loads if loads is not None else []):
        m.update_bias(load)
        m.tokens_per_expert.zero_()
    if summary is not None:
        s = summary.tolist()
        stats = {"moe_imbalance": s[-2] / s[-1], "tokens_per_expert": s[:-3]}
        if capacity_factor > 0:  # the share of routed rows dropped
            stats["moe_dropped"] = s[-3] / max(sum(s[:-3]), 1.0)
    if mtp is not None:  # this step's MTP cross-entropy (mean over microbatches), averaged
        stats["mtp_loss"] = mtp.item() / dist.get_world_size(loss_group)
        for m in mtp_models:
            m.mtp_loss.zero_()
    return stats


def discard_router_stats(moe_layers: list, mtp_models: list) -> None:
    """Forget what the forwards so far counted (routing loads, dropped rows, MTP losses)."""
    for m in moe_layers:
        m.tokens_per_expert.zero_()
        if getattr(m.experts.dispatch, "dropped", None) is not None:
            m.experts.dispatch.dropped = None
    for m in mtp_models:
        m.mtp_loss.zero_()
