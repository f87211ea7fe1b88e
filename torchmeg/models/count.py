"""What a model costs: parameters (total, non-embedding, active per token) and training FLOPs."""
from __future__ import annotations

from torch import nn

from torchmeg.models.hf_causal import is_hf_experts
from torchmeg.models.moe import is_grouped_experts


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Global parameter count (DTensor numel is global); tied weights counted once."""
    seen, n = set(), 0
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    for p in model.parameters():
        if id(p) not in seen and id(p) not in emb:
            seen.add(id(p))
            n += p.numel()
    return n


def flops_per_token(model: nn.Module, args, seq_len: int) -> int:
    """Training FLOPs per token: 6 x matmul weights + 6 x layers x heads x (qk + v head dims) x seq_len.

    The first term is forward (2N) + backward (4N) over every nn.Linear weight (embedding lookups
    are not matmuls; a tied output counts as a matmul); a frozen weight (LoRA's base) costs 4, its
    own gradient never computed. The second is QK^T and AV over the full (non-causal) score matrix,
    the PaLM convention (Chowdhery et al. 2022, appendix B).
    """
    seen, n = set(), 0
    for m in model.modules():
        w, count = None, 0
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            w, count = m.weight, m.weight.numel()
        elif _experts(m):  # only top_k of the experts run
            total, top_k, n_experts = _experts(m)
            w, count = next(m.parameters()), total * top_k // n_experts
        if w is not None:
            n += count * (6 if w.requires_grad else 4)
    qk, v = getattr(args, "attention_head_dims", (args.head_dim, args.head_dim))
    layers = args.n_layers + getattr(args, "mtp_depth", 0)
    return n + 6 * layers * args.n_heads * (qk + v) * seq_len


def active_params(model: nn.Module) -> int:
    """Parameters a token actually uses (MoE: top_k of the routed experts)."""
    n = count_params(model)
    for m in model.modules():
        if _experts(m):
            total, top_k, n_experts = _experts(m)
            n -= total - total * top_k // n_experts
    return n


def _experts(m: nn.Module) -> tuple[int, int, int] | None:
    """(expert weights, experts per token, experts) of an experts module: torchmeg's grouped
    experts, or transformers' (top_k from its config: the router that picks lives elsewhere)."""
    if is_grouped_experts(m):
        return sum(p.numel() for p in m.parameters(recurse=False)), m.top_k, m.n_experts
    if is_hf_experts(m):
        top_k = getattr(getattr(m, "config", None), "num_experts_per_tok", None) or m.num_experts
        return m.gate_up_proj.numel() + m.down_proj.numel(), top_k, m.num_experts
    return None
