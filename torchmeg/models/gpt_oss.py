"""gpt-oss (OpenAI 2025; gpt-oss-20b / 120b): the moe family's blocks with attention sinks, sliding-
window layers alternating with full ones, biased projections, biased experts with a clamped SwiGLU,
and YaRN RoPE (rope.py).

Architecture only. Shape legend: B batch, L queries, S keys, H query heads, K kv heads, D head dim.

Attention sinks: each head has a learned logit s_h that joins every query's softmax as one more
column with no value: p = softmax([q k^T / sqrt(D) + mask ; s_h]) and the sink's share is dropped
(transformers' eager_attention_forward). Here the sink is one more key, scored s_h through 8 extra
head dims (q gains a 1, the sink key s_h sqrt(D); its value zeros), so SDPA's fused kernels run it and
nothing of L x L is built: a full layer is one causal call, a windowed layer (keys j with
i - W < j <= i: transformers' sliding window W, the query included) runs in blocks of W queries over
2W keys with a [W, 2W] mask. Document masking and the KV cache pass a boolean mask.
Routing: softmax over the top-k router logits (= the top-k of the softmax, renormalised:
route_norm), router and experts biased (moe.py's router_bias, experts_bias, swiglu_limit).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchmeg.models.init import Constant, Normal
from torchmeg.models.llama import DECODER_TP, Attention
from torchmeg.models.moe import MoEArgs, MoEBlock, MoETransformer
from torchmeg.models.rope import apply_rope


@dataclass
class GptOssArgs(MoEArgs):
    sliding_window: int = 128       # W: a windowed layer's query i sees keys i - W < j <= i
    full_every: int = 2             # layer i attends in full where (i + 1) % full_every == 0 (gpt-oss: every
                                    # other layer, the first windowed); 1 = every layer full
    attention_bias: bool = True     # biases on q / k / v / o

    def windowed(self, layer: int) -> bool:
        return self.full_every != 1 and (layer + 1) % self.full_every != 0

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.sliding_window < 1:
            out.append(("sliding_window", "must be >= 1"))
        if self.full_every < 1:
            out.append(("full_every", "must be >= 1 (1: every layer attends in full)"))
        return out


class HeadSinks(nn.Module):
    """One learned logit per query head; a module so tensor parallel can hand each rank its heads'
    (the plan's "head_sharded" role) while the attention reads a plain tensor."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


PAD = 8  # extra head dims carrying the sink (kernels take head dims in multiples of 8)


def _with_sink(q_BHLD, k_BKSD, v_BKSD, sinks_H):
    """q, k, v widened so that a key placed first scores each head's sink: q gains a 1 (then zeros),
    key 0 is [0 .. 0, s_h sqrt(D), 0 ..] (its score s_h at the 1 / sqrt(D) scale), its value zeros; kv
    heads repeated to the query heads (the sink key differs by head)."""
    B, H, L, D = q_BHLD.shape
    rep = H // k_BKSD.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k_BKSD, v_BKSD))
    q = torch.cat([q_BHLD, q_BHLD.new_ones(B, H, L, 1), q_BHLD.new_zeros(B, H, L, PAD - 1)], -1)
    sink = (sinks_H.to(q.dtype) * D ** 0.5).view(1, H, 1, 1).expand(B, H, 1, 1)
    sink_key = torch.cat([q.new_zeros(B, H, 1, D), sink, q.new_zeros(B, H, 1, PAD - 1)], -1)
    k = torch.cat([sink_key, F.pad(k, (0, PAD))], 2)
    v = F.pad(v, (0, PAD, 1, 0))
    return q, k, v, D ** -0.5


def sink_attention(q_BHLD, k_BKSD, v_BKSD, sinks_H, allowed=None, window: int = 0) -> torch.Tensor:
    """Softmax attention with a sink per head. `allowed` [B or 1, 1, L, S] (bool) says which keys each
    query may read; None: causal over L = S tokens within `window` (0: none), which runs without a mask
    of L x S: a full layer as one causal call (a dummy query first, beside the sink key), a windowed
    one in blocks of `window` queries over their 2 x window keys."""
    D = q_BHLD.shape[-1]
    q, k, v, scale = _with_sink(q_BHLD, k_BKSD, v_BKSD, sinks_H)
    L = q.shape[2]
    if allowed is not None:
        ok = torch.cat([allowed.new_ones(*allowed.shape[:3], 1), allowed], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale)[..., :D]
    if not window or L <= window:
        q = torch.cat([q.new_zeros(q.shape[0], q.shape[1], 1, q.shape[3]), q], 2)  # (reads the sink only)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[:, :, 1:, :D]
    return _windowed(q, k, v, scale, window)[..., :D]


def _windowed(q, k, v, scale, W: int) -> torch.Tensor:
    """Queries in blocks of W, block c reading the sink and keys [(c - 1) W, (c + 1) W): query r of the
    block may read local key j (after the sink) where r < j <= W + r (causal, within W)."""
    B, H, L, E = q.shape
    n = -(-L // W)
    pad = n * W - L
    q = F.pad(q, (0, 0, 0, pad)).view(B, H, n, W, E)
    # W zero keys before, the tail padded; block c's keys: the window of 2W starting at c W
    kv = [F.pad(t[:, :, 1:], (0, 0, W, pad)).unfold(2, 2 * W, W).transpose(-1, -2) for t in (k, v)]
    k_, v_ = (torch.cat([s[:, :, None].expand(B, H, n, 1, E), t], 3) for s, t in zip((k[:, :, :1], v[:, :, :1]), kv))
    r = torch.arange(W, device=q.device)[:, None]
    j = torch.arange(2 * W, device=q.device)[None, :]
    ok = ((j > r) & (j <= W + r))[None].expand(n, W, 2 * W).clone()
    ok[0, :, :W] = False  # block 0's first W keys are padding
    ok = torch.cat([ok.new_ones(n, W, 1), ok], -1)  # the sink
    flat = [t.transpose(1, 2).reshape(B * n, H, -1, E) for t in (q, k_, v_)]
    o = F.scaled_dot_product_attention(*flat, attn_mask=ok.repeat(B, 1, 1)[:, None], scale=scale)
    return o.view(B, n, H, W, E).transpose(1, 2).reshape(B, H, n * W, E)[:, :, :L]


def allowed_keys(L: int, window: int, device, documents) -> torch.Tensor:
    """[B, 1, L, L] causal, within `window` (0: none) and within each document."""
    i = torch.arange(L, device=device)
    d = i[:, None] - i[None, :]
    ok = d >= 0
    if window:
        ok = ok & (d < window)
    ids = documents.ids if hasattr(documents, "ids") else documents
    return ok[None, None] & (ids[:, None, :, None] == ids[:, None, None, :])


class SinkAttention(Attention):
    """Llama's GQA attention with biases, sinks and this layer's window."""

    stacks_qkv = False  # (its own forward: q, k, v apart, with biases)

    def __init__(self, a: GptOssArgs, layer: int):
        super().__init__(a)
        D, bias = a.head_dim, a.attention_bias
        self.wq = nn.Linear(a.dim, a.n_heads * D, bias=bias)
        self.wk = nn.Linear(a.dim, a.kv_heads * D, bias=bias)
        self.wv = nn.Linear(a.dim, a.kv_heads * D, bias=bias)
        self.wo = nn.Linear(a.n_heads * D, a.dim, bias=bias)
        self.sinks = HeadSinks(a.n_heads)
        self.window = a.sliding_window if a.windowed(layer) else 0

    def forward(self, x_BLE, cos, sin, positions=None, cache=None, documents=None):
        B, L, _ = x_BLE.shape
        q = apply_rope(self.wq(x_BLE).view(B, L, -1, self.head_dim), cos, sin, positions).transpose(1, 2)
        k = apply_rope(self.wk(x_BLE).view(B, L, -1, self.head_dim), cos, sin, positions).transpose(1, 2)
        v = self.wv(x_BLE).view(B, L, -1, self.head_dim).transpose(1, 2)
        if cache is not None:  # generation: the cache's slots (left padding, see kv_cache.py)
            k, v = cache.update(k, v)
            allowed = cache.owner.mask(L, k.shape[2])
            if self.window:  # keys more than the window behind each query's slot masked too
                q_slot = cache.owner.query_slots(L)[:, None, :, None]
                allowed = allowed & (q_slot - torch.arange(k.shape[2], device=k.device) < self.window)
        elif documents is not None:
            allowed = allowed_keys(L, self.window, x_BLE.device, documents)
        else:
            allowed = None  # causal (within the window): no L x L mask
        o = sink_attention(q, k, v, self.sinks(), allowed, self.window)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class GptOss(MoETransformer):
    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): MoEBlock(args, i, attention=lambda a, i=i: SinkAttention(a, i))
                                     for i in range(args.n_layers)})

    def init_rule(self, fqn: str):
        if fqn.endswith("sinks.weight"):
            return Normal(self.args.init_std)
        if fqn.endswith(".bias"):
            return Constant(0.0)
        return super().init_rule(fqn)


# ---- flavors and tensor-parallel plan (data; applied by torchmeg.parallel) -----------------------

_GPT_OSS = dict(n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088, rope_theta=150000.0, max_seq_len=131072,
                rope_type="yarn", rope_factor=32.0, rope_original_max_seq_len=4096, rope_beta_fast=32.0,
                rope_beta_slow=1.0, rope_truncate=False, sliding_window=128, full_every=2, top_k=4,
                score_func="softmax", route_norm=True, balance="aux_loss", aux_loss_coef=0.001, n_shared_experts=0,
                router_bias=True, experts_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, norm_eps=1e-5)
FLAVORS = {
    # CPU-sized: every mechanism on (windowed and full layers, sinks, biased experts, YaRN)
    "debug": dict(_GPT_OSS, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=-1,
                  max_seq_len=2048, rope_original_max_seq_len=256, sliding_window=16, n_experts=8, top_k=2,
                  moe_hidden=128, ffn_dim=128),
    # openai/gpt-oss-20b and gpt-oss-120b as their config.json (20.9B / 116.8B parameters; 4.2B / 5.7B
    # active per token counting the embedding, 3.6B / 5.1B without it, as OpenAI counts)
    "20B": dict(_GPT_OSS, dim=2880, n_layers=24, n_experts=32, moe_hidden=2880, ffn_dim=2880),
    "120B": dict(_GPT_OSS, dim=2880, n_layers=36, n_experts=128, moe_hidden=2880, ffn_dim=2880),
}

# Llama's attention plan (biases follow their Linear: column-parallel sharded, row-parallel added
# once after the reduction), each rank's heads' sinks, the routed block as the moe family's.
TP_PLAN = ([("tok_embeddings", "embedding")] + [e for e in DECODER_TP if ".feed_forward" not in e[0]]
           + [("layers.*.attention.sinks", "head_sharded"), ("layers.*.moe", "experts_over_tp")])
