"""Mixture-of-Experts decoder: Llama attention + routed SwiGLU experts (Mixtral / DeepSeek-V3 style).

Architecture only. Per MoE block: a router scores every token against E experts (softmax or
sigmoid), picks the top k, and the token's output is the score-weighted sum of those experts'
SwiGLU outputs (Shazeer et al. 2017; Fedus et al. 2021), plus optional always-on shared experts
(DeepSeekMoE, Dai et al. 2024). Routing is dropless: every chosen (token, expert) pair is computed.
Load balancing, chosen by `balance`:
  aux_loss  Switch's auxiliary loss  coef * E * sum_e f_e * P_e  (f = share of routed tokens,
            P = mean router probability), added to the gradient without changing the output
  bias      DeepSeek-V3's aux-loss-free balancing: a per-expert bias shifts which experts are
            selected (not their weights) and is nudged after each step toward under-used experts
DeepSeek-V3's group-limited routing (n_expert_groups, topk_groups), routed scaling (route_scale) and
sequence-wise balance loss (seq_aux_loss_coef) are options of the same block.
Experts are grouped 3-D weights [E, ...]; tokens are sorted by expert and all experts run in three
grouped matmuls over their contiguous slices (`torch._grouped_mm`, offsets from the token counts on
the device: no host sync), where the kernel takes the dtype and layout; else a loop over experts
(never over tokens) that reads the counts on the host. `experts.dispatch` is the swappable part:
expert parallelism replaces it with an all-to-all version.
Legend: T tokens, D model dim, H expert hidden, E experts, K top-k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from torchmeg.models.experts import (ClampedSwiGLU, expert_loop, expert_weights, grouped_ffn, grouped_mm_takes,
                                     swiglu)
from torchmeg.models.init import Constant, Normal
from torchmeg.models.llama import DECODER_TP, Attention, FeedForward, Llama, LlamaArgs, RMSNorm


@dataclass
class MoEArgs(LlamaArgs):
    n_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 14336
    n_shared_experts: int = 0
    score_func: str = "softmax"         # softmax | sigmoid
    route_norm: bool = True             # renormalise the k selected scores to sum to 1
    balance: str = "aux_loss"           # aux_loss | bias | none
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    n_dense_layers: int = 0             # the first layers keep a dense FFN (DeepSeek-V3: 3)
    n_expert_groups: int = 1            # DeepSeek-V3 group-limited routing: experts in this many groups ...
    topk_groups: int = 1                # ... and a token's k experts come from its best this-many groups
    route_scale: float = 1.0            # routed outputs' weights x this (DeepSeek-V3's routed_scaling_factor)
    seq_aux_loss_coef: float = 0.0      # DeepSeek-V3's complementary sequence-wise balance loss (alpha); 0 = off
    router_bias: bool = False           # a bias on the router's logits (gpt-oss)
    experts_bias: bool = False          # biases in every routed expert's projections (gpt-oss)
    swiglu_limit: float = 0.0           # > 0: gpt-oss's clamped SwiGLU (gate <= limit, |up| <= limit, (up + 1))
    swiglu_alpha: float = 1.702         # ... and its gate's sigmoid slope

    def problems(self) -> list[tuple[str, str]]:
        """(model key, what is wrong) for every routing setting that cannot work."""
        out = []
        if not 1 <= self.top_k <= self.n_experts:
            out.append(("top_k", f"must be within 1..model.n_experts = {self.n_experts}"))
        if self.n_experts % self.n_expert_groups:
            out.append(("n_expert_groups", f"must divide model.n_experts = {self.n_experts}"))
        elif not 1 <= self.topk_groups <= self.n_expert_groups:
            out.append(("topk_groups", f"must be within 1..model.n_expert_groups = {self.n_expert_groups}"))
        elif self.topk_groups * (self.n_experts // self.n_expert_groups) < self.top_k:
            out.append(("topk_groups", f"its groups hold fewer than model.top_k = {self.top_k} experts"))
        return out


def expert_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: how many entries of `idx` name each of n experts. A scatter-add into a fixed-size
    buffer, not torch.bincount, whose CUDA kernel reads the ids' min and max back to the host to size
    its output (a device sync per call): the count's shape is known, so nothing is read."""
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, idx.flatten(), torch.ones_like(idx.flatten()))


def local_dispatch(experts: "GroupedExperts", x_TD: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    w = expert_weights(experts)
    if grouped_mm_takes(x_TD, w.w1) and grouped_mm_takes(x_TD, w.w2):
        return grouped_ffn(w, x_TD, counts)
    return expert_loop(w, x_TD, counts)


class GroupedExperts(nn.Module):
    """E gated FFNs as grouped weights; `bias` adds per-expert biases b1 / b2 / b3 (gpt-oss), `act` the
    gated activation (default SwiGLU)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, bias: bool = False,
                 act: Callable = swiglu):
        super().__init__()
        self.n_experts, self.top_k, self.act = n_experts, top_k, act  # top_k: for counting active FLOPs
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        if bias:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        else:
            self.b1 = self.b2 = self.b3 = None
        self.dispatch = local_dispatch

    bias_names = ("b1", "b2", "b3")  # per-expert biases, 2-D: biases to the optimizer, not matrices

    def forward(self, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.dispatch(self, x_TD, counts_E)


def is_grouped_experts(m: nn.Module) -> bool:
    """Duck-typed, so a user's own expert module with the same attributes is treated alike."""
    return hasattr(m, "n_experts") and hasattr(m, "dispatch") and hasattr(m, "w1")


class _AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward, also sends gradient 1 into `aux` (so the auxiliary
    loss trains the router without changing the logits or the reported loss)."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def limit_to_groups(select_TE: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3, sec. 2.1.2; node-limited on the cluster): the experts
    split into `groups` equal groups, each scored by the sum of its two best selection scores; a
    token may pick experts only from its `keep` best groups (the others masked to -inf)."""
    T, E = select_TE.shape
    g_TGe = select_TE.view(T, groups, E // groups)
    best = g_TGe.topk(min(2, E // groups), dim=-1).values.sum(-1).topk(keep, dim=-1).indices
    allowed = torch.zeros(T, groups, dtype=torch.bool, device=select_TE.device).scatter_(1, best, True)
    return select_TE.masked_fill(~allowed[:, :, None].expand_as(g_TGe).reshape(T, E), float("-inf"))


def sequence_balance_loss(scores_BLE: torch.Tensor, idx_BLK: torch.Tensor, sigmoid: bool,
                          shard_sum=None) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 without alpha: per sequence, sum_i f_i P_i with f_i = E / (K L) x the
    tokens routed to expert i and P_i the mean of the token-normalised scores; the mean over sequences.
    `shard_sum` (context / sequence parallel's): sums per-sequence [B, n] statistics over the ranks
    holding the sequence's other parts, so each rank's counts and score sums become the whole's."""
    B, L, E = scores_BLE.shape
    K = idx_BLK.shape[-1]
    counts_BE = torch.zeros(B, E, device=scores_BLE.device).scatter_add_(
        1, idx_BLK.reshape(B, L * K), torch.ones(B, L * K, device=scores_BLE.device))
    p = scores_BLE / scores_BLE.sum(-1, keepdim=True) if sigmoid else scores_BLE
    sums = torch.cat([counts_BE, p.sum(1), counts_BE.new_full((B, 1), float(L))], 1)
    if shard_sum is not None:
        sums = shard_sum(sums)
    counts_BE, p_BE, n = sums.split([E, E, 1], 1)
    return (counts_BE * (E / K) * p_BE / (n * n)).sum(1).mean()


def batch_balance_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, softmax: bool,
                       shard_sum=None) -> torch.Tensor:
    """Switch / GShard's balance loss without its coefficient: E x sum_i f_i P_i over the batch, f_i
    the fraction of routed (token, expert) pairs going to expert i, P_i the mean normalised score;
    `shard_sum` as above, over the batch's whole sequences."""
    T, E = scores_TE.shape
    p = scores_TE if softmax else scores_TE / scores_TE.sum(-1, keepdim=True)
    sums = torch.cat([counts_E.float(), p.sum(0), counts_E.new_full((1,), T, dtype=torch.float32)])
    if shard_sum is not None:
        sums = shard_sum(sums)
    counts, p_sum, n = sums.split([E, E, 1])
    return E * (counts / (n * top_k) * p_sum / n).sum()


class MoE(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.a = a
        self.router = nn.Linear(a.dim, a.n_experts, bias=a.router_bias)
        act = ClampedSwiGLU(a.swiglu_alpha, a.swiglu_limit) if a.swiglu_limit > 0 else swiglu
        self.experts = GroupedExperts(a.dim, a.moe_hidden, a.n_experts, a.top_k, bias=a.experts_bias, act=act)
        self.shared = FeedForward(a.dim, a.moe_hidden * a.n_shared_experts) if a.n_shared_experts else None
        # Selection bias (aux-loss-free balancing) and this step's routed-token counts: buffers,
        # so they are checkpointed and follow the module's device.
        self.register_buffer("expert_bias", torch.zeros(a.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(a.n_experts), persistent=False)
        # Set by the training loop, not the model: the aux loss's gradient is divided by the
        # number of microbatches a step accumulates, like the LM loss it rides along with
        # (Megatron's MoEAuxLossAutoScaler.set_loss_scale does the same).
        self.aux_loss_scale = 1.0
        # False while activation recompute replays this forward in backward: the routed tokens
        # were counted once already (recompute.py turns it off for that replay).
        self.record_stats = True
        # Set by context / sequence parallel: sums token statistics over the ranks that hold other
        # parts of the same sequences (torchmeg.parallel.expert.sum_over_shards).
        self.shard_sum = None

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        x = x_BLD.reshape(-1, D)
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.a.score_func == "softmax" else logits.sigmoid()
        select = scores + self.expert_bias if self.a.balance == "bias" else scores
        if self.a.n_expert_groups > 1:
            select = limit_to_groups(select, self.a.n_expert_groups, self.a.topk_groups)
        _, idx_TK = select.topk(self.a.top_k, dim=-1)
        if self.a.score_func == "softmax" and self.a.route_norm:
            # the renormalised top-k of a softmax is the softmax of the top-k logits: computed so, the
            # experts not chosen get no gradient (through the full softmax they get rounding residues,
            # which summed over a batch's tokens make the router bias's gradient ~1% noise)
            w_TK = logits.gather(-1, idx_TK).softmax(-1)
        else:
            w_TK = scores.gather(-1, idx_TK)
            if self.a.route_norm:
                w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        if self.a.route_scale != 1.0:
            w_TK = w_TK * self.a.route_scale
        counts = expert_counts(idx_TK, self.a.n_experts)
        if self.record_stats:
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
        # Sort the T*K (token, expert) pairs by expert; run the experts; scatter back, weighted.
        order = idx_TK.flatten().argsort(stable=True)
        token_of = order // self.a.top_k
        y_sorted = self.experts(x[token_of], counts)
        y = torch.zeros_like(x).index_add_(0, token_of, (y_sorted.float() * w_TK.flatten()[order, None]).type_as(x))
        if self.shared is not None:
            y = y + self.shared(x)
        aux = None
        if self.training and self.a.balance == "aux_loss" and self.a.aux_loss_coef > 0:
            aux = self.a.aux_loss_coef * batch_balance_loss(scores, counts, self.a.top_k,
                                                            self.a.score_func == "softmax", self.shard_sum)
        if self.training and self.a.seq_aux_loss_coef > 0:
            seq = self.a.seq_aux_loss_coef * sequence_balance_loss(
                scores.view(B, L, -1), idx_TK.view(B, L, -1), self.a.score_func == "sigmoid", self.shard_sum)
            aux = seq if aux is None else aux + seq
        if aux is not None:
            y = _AuxLoss.apply(y, aux * self.aux_loss_scale)
        return y.view(B, L, D)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """DeepSeek-V3 eq. (16)-ish: raise the bias of under-loaded experts, lower the over-loaded."""
        if self.a.balance == "bias":
            self.expert_bias += self.a.bias_update_rate * torch.sign(load_E.mean() - load_E)


class MoEBlock(nn.Module):
    def __init__(self, a: MoEArgs, layer: int, attention: type = Attention):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        dense = layer < a.n_dense_layers
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden) if dense else None
        self.moe = None if dense else MoE(a)

    def forward(self, x, cos, sin, positions=None, cache=None, documents=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, positions=positions, cache=cache, documents=documents)
        h = self.ffn_norm(x)
        return x + (self.feed_forward(h) if self.moe is None else self.moe(h))


class MoETransformer(Llama):
    """Llama with MoE blocks; embeddings, RoPE, final norm and output are Llama's."""

    def __init__(self, args: MoEArgs):
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): MoEBlock(args, i) for i in range(args.n_layers)})

    def init_rule(self, fqn: str):
        a = self.args
        if fqn.endswith(("experts.w1", "experts.w3")):
            return Normal(a.init_std)
        if fqn.endswith("experts.w2"):
            return Normal(a.init_std / math.sqrt(2 * a.n_layers))
        if fqn.endswith(("experts.b1", "experts.b2", "experts.b3", "router.bias")):
            return Constant(0.0)
        return super().init_rule(fqn)

    def init_buffers(self) -> None:
        super().init_buffers()
        for m in self.moe_layers():
            m.expert_bias.zero_()
            m.tokens_per_expert.zero_()

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


# ---- flavors and tensor-parallel plan (data; applied by torchmeg.parallel) -----------------------

FLAVORS = {
    # CPU-sized: 8 experts, top-2, one shared expert, aux-loss-free balancing (DeepSeek-V3 style;
    # its bias step is 10x DeepSeek's 1e-3 so balance shows within a 150-step run).
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, rope_theta=10000.0,
                  max_seq_len=2048, n_experts=8, top_k=2, moe_hidden=128, n_shared_experts=1,
                  score_func="sigmoid", balance="bias", bias_update_rate=0.01, n_dense_layers=1),
    "mixtral-8x7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, rope_theta=1e6,
                         max_seq_len=32768, n_experts=8, top_k=2, moe_hidden=14336, score_func="softmax",
                         balance="aux_loss", aux_loss_coef=0.02, multiple_of=1024, ffn_dim_multiplier=1.3),
    # DeepSeek-V3's MoE shape (256 routed + 1 shared expert, top-8, sigmoid scores, aux-loss-free,
    # 3 dense layers) on GQA attention, hence "-like"; model.name = "deepseek_v3" is the real thing (MLA, MTP).
    "deepseek-v3-like": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                             rope_theta=10000.0, max_seq_len=163840, n_experts=256, top_k=8, moe_hidden=2048,
                             n_shared_experts=1, score_func="sigmoid", balance="bias", n_dense_layers=3,
                             multiple_of=256, ffn_dim_multiplier=3.86),
}

# Attention and dense FFNs as in Llama; the routed block's input is gathered and its output
# re-sharded, so experts stay whole on every TP rank (their parallelism is EP).
TP_PLAN = [("tok_embeddings", "embedding")] + DECODER_TP + [("layers.*.moe", "experts_over_tp")]
