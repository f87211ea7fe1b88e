"""Context parallelism: the sequence split over the `cp` mesh dim, attention over all of it.

Layout (load-balanced for causal attention): the sequence is cut into 2 x cp chunks and cp rank r
holds chunks r and 2cp-1-r, so every rank gets one early (cheap) and one late (expensive) chunk of
the causal triangle (Megatron-LM's CP layout; Liu et al. 2023 discuss the imbalance).

Attention: each rank all-gathers K and V from the cp group with an autograd-aware functional
collective (its backward is a reduce-scatter of the K/V gradients) — Megatron's `allgather` CP
mode — and runs one SDPA of its local queries against the whole sequence with a mask built from
absolute positions: key j is visible to query i iff pos(j) <= pos(i). RoPE takes the same absolute
positions. torch's own `context_parallel` has no CPU sharding rule for SDPA (torch 2.13), so this
path serves CPU and GPU alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def positions(local_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions of the tokens cp rank `rank` holds (local_len = seq_len / cp)."""
    c = local_len // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


class AllGatherAttention:
    """Drop-in for the model's causal SDPA on a sequence shard."""

    def __init__(self, cp_mesh):
        self.group = cp_mesh.get_group()
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()

    def _gather(self, x_BHLD: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd
        x_LBHD = x_BHLD.permute(2, 0, 1, 3).contiguous()  # the collective concatenates on dim 0
        return all_gather_single_autograd(x_LBHD, 0, self.group).permute(1, 2, 0, 3)

    def __call__(self, q_BHLD, k_BHLD, v_BHLD):
        L = q_BHLD.shape[2]
        k_all, v_all = self._gather(k_BHLD), self._gather(v_BHLD)
        q_pos = positions(L, self.rank, self.size, q_BHLD.device)
        k_pos = torch.cat([positions(L, r, self.size, q_BHLD.device) for r in range(self.size)])
        visible = k_pos[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q_BHLD, k_all, v_all, attn_mask=visible)


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Swap every attention kernel (modules with an `sdpa` attribute) for the all-gather one and
    feed the model the absolute positions of its shard."""
    attn = AllGatherAttention(cp_mesh)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "sdpa"):
            mod.sdpa = attn
            n += 1
    if not n:
        raise ValueError("context parallel needs attention modules with an `sdpa` attribute")
    rank, size = attn.rank, attn.size

    def add_positions(mod, args, kwargs):
        kwargs = dict(kwargs)
        kwargs["positions"] = positions(args[0].shape[1], rank, size, args[0].device)
        return args, kwargs
    model.register_forward_pre_hook(add_positions, with_kwargs=True)


def check(cfg, dims) -> None:
    from torchmeg.config import ConfigError
    cp, tp = dims.cp, dims.tp
    unit = 2 * cp * (tp if tp > 1 and cfg.parallelism.sequence_parallel else 1)
    if cfg.data.seq_len % unit:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: context parallel {cp} needs a multiple of {unit} "
                          f"(2 x context_parallel_degree{' x tensor_parallel_degree' if unit != 2 * cp else ''})")
    if dims.pp > 1:
        raise ConfigError("parallelism.context_parallel_degree > 1 with pipeline_parallel_degree > 1: not yet "
                          "supported (stages would need the shard positions); use one of them")
