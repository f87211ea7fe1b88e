"""Llama-3 style decoder: GQA, RoPE (theta, with Llama-3.1 or YaRN scaling), RMSNorm, SwiGLU,
optional tied output; Qwen3's per-head QK norm and a head dim apart from dim / heads.

Architecture only: no parallelism here. Shape legend for names: B batch, L sequence length,
H query heads, K kv heads, D head dim, E model dim, V vocab.
Module names follow Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...) so that TP
plans, pipeline splits and checkpoints address them by FQN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchmeg.models.attention import DocumentBatch, document_attention, document_positions, repeat_kv
from torchmeg.models.init import Constant, Normal
from torchmeg.models.kv_cache import head_positions
from torchmeg.models.rope import ROPE_TYPES, apply_rope, rope_tables


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1            # -1: taken from the tokenizer
    multiple_of: int = 256          # SwiGLU hidden size rounding
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    init_std: float = 0.02
    ffn_dim: int = 0                # SwiGLU hidden size as given (a checkpoint's intermediate_size); 0 = from
                                    # multiple_of and ffn_dim_multiplier (Meta's rule)
    head_dim: int = 0               # 0 = dim // n_heads; Qwen3 sets it apart (e.g. 128 at dim 1024, 16 heads)
    qk_norm: bool = False           # Qwen3: RMSNorm over each head's q and k before RoPE
    # RoPE scaling (transformers' rope_parameters): "default", "llama3" (Llama 3.1/3.2), "yarn"
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0       # llama3
    rope_high_freq_factor: float = 4.0      # llama3
    rope_original_max_seq_len: int = 8192   # llama3, yarn: the context the model was pretrained at
    rope_beta_fast: float = 32.0            # yarn
    rope_beta_slow: float = 1.0             # yarn
    rope_mscale: float = 0.0                # yarn (DeepSeek): 0 = not set
    rope_mscale_all_dim: float = 0.0        # yarn (DeepSeek): 0 = not set
    rope_attention_factor: float = 0.0      # yarn: 0 = derived from factor (and mscale)
    rope_truncate: bool = True              # yarn: round the correction range to whole dimensions

    def __post_init__(self):
        # Whether head_dim was given (then dim need not be n_heads x head_dim), before resolving it.
        self.explicit_head_dim = self.head_dim > 0
        if not self.head_dim:
            self.head_dim = self.dim // max(self.n_heads, 1)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def causal_attention(q_BHLD, k_BKLD, v_BKLD, documents=None):
    """The attention kernel contract: q with H heads, k/v with K heads (K divides H; GQA); with
    `documents` [B, L] (document masking) attention stays within each document.
    A kernel repeats K/V as late as it can: a context-parallel one only after its exchange."""
    if documents is not None:
        return document_attention(q_BHLD, k_BKLD, v_BKLD, documents)
    rep = q_BHLD.shape[1] // k_BKLD.shape[1]
    return F.scaled_dot_product_attention(q_BHLD, repeat_kv(k_BKLD, rep), repeat_kv(v_BKLD, rep), is_causal=True)


class Attention(nn.Module):
    stacks_qkv = True  # forward's q, k, v through `project`, which reads a cache's stacked weight

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.head_dim = a.head_dim
        # The attention kernel is an attribute so a parallelism (context parallel) can swap in
        # its own without the model knowing about devices.
        self.sdpa = causal_attention
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        # Qwen3: one [head_dim] norm shared by every head (under TP each rank holds some heads, so
        # the weights' gradients are summed over tp: the "head_norm" TP style).
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None

    def forward(self, x_BLE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | None = None, cache=None, documents=None) -> torch.Tensor:
        B, L, _ = x_BLE.shape
        # -1 head counts: under tensor parallelism each rank holds a slice of the heads.
        q_, k_, v_ = self.project(x_BLE, cache)
        q_BLHD = apply_rope(self._norm(self.q_norm, q_.view(B, L, -1, self.head_dim)), cos, sin, positions)
        k_BLKD = apply_rope(self._norm(self.k_norm, k_.view(B, L, -1, self.head_dim)), cos, sin, positions)
        v_BLKD = v_.view(B, L, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q_BLHD, k_BLKD, v_BLKD))
        # Generation: attend over this layer's KV cache (torchmeg.models.kv_cache) instead.
        if cache is not None:
            o_BHLD = cache.attend(q, k, v)
        else:
            o_BHLD = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents=documents)
        return self.wo(o_BHLD.transpose(1, 2).reshape(B, L, -1))

    def project(self, x_BLE: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: three matmuls, or one where a cache holds their weights stacked (`cache.qkv`:
        inference's static decode step keeps such a copy, batching.static_decode)."""
        qkv = getattr(cache, "qkv", None) if cache is not None else None
        if qkv is None:
            return self.wq(x_BLE), self.wk(x_BLE), self.wv(x_BLE)
        return F.linear(x_BLE, qkv).split([self.wq.out_features, self.wk.out_features, self.wv.out_features], -1)

    @staticmethod
    def _norm(norm, x):
        return x if norm is None else norm(x)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020, eq. 6): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)

    def forward(self, x, cos, sin, positions=None, cache=None, documents=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, positions=positions, cache=cache, documents=documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer number keeps FQNs stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by the trainer for training.fused_linear_cross_entropy: the forward ends at the final
        # norm and the loss applies `output` itself (torchmeg.kernels.fused_ce), chunk by chunk.
        self.head_in_loss = False
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        a = self.args
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device=self.rope_cos.device, a=a)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def init_rule(self, fqn: str):
        """How parameter `fqn` is initialised (torchmeg.models.init; each rank fills its own shard)."""
        a = self.args
        if fqn.endswith("norm.weight"):
            return Constant(1.0)
        if fqn.endswith(("wo.weight", "w2.weight")):
            # GPT-2/Megatron scaled init of residual projections: std / sqrt(2 * n_layers).
            return Normal(a.init_std / math.sqrt(2 * a.n_layers))
        if fqn == "output.weight":
            return Normal(a.dim ** -0.5)
        return Normal(a.init_std)

    def forward(self, tokens_BL: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                documents: torch.Tensor | None = None, last_only: bool | torch.Tensor = False) -> torch.Tensor:
        """Logits [B, L, V]. Generation passes `positions` [B, L] and a KVCache (models.kv_cache),
        and `last_only` at prefill (logits [B, 1, V]: the head runs on the last position only; or a
        LongTensor of positions: a packed prefill's prompt ends, models.kv_cache.head_positions);
        document masking passes `documents` [B, L] (models.attention), positions restarting at each
        document unless given (context parallel gives its shard's)."""
        h = self.tok_embeddings(tokens_BL) if self.tok_embeddings is not None else tokens_BL
        h = self.run_layers(h, self.rope_inputs(positions, documents), cache)
        h = head_positions(h, last_only)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and not self.head_in_loss else h

    def rope_inputs(self, positions: torch.Tensor | None, documents: torch.Tensor | None) -> tuple:
        """(cos, sin, positions, documents) as every layer takes them: positions restarting at each
        document under document masking; per-row positions gathered from the tables once."""
        if documents is not None:
            if positions is None:
                positions = document_positions(documents)
            documents = DocumentBatch(documents)  # (spans read once for every layer)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None and positions.dim() == 2:  # every row its own positions: gathered once
            cos, sin, positions = cos[positions], sin[positions], None
        return cos, sin, positions, documents

    def run_layers(self, h: torch.Tensor, rope: tuple, cache=None) -> torch.Tensor:
        cos, sin, positions, documents = rope
        for name, layer in self.layers.items():
            if cache is not None:
                h = layer(h, cos, sin, positions=positions, cache=cache.layer(name))
            elif documents is not None:
                h = layer(h, cos, sin, positions=positions, documents=documents)
            else:
                h = layer(h, cos, sin, positions=positions)
        return h


# ---- flavors and tensor-parallel plan (data; applied by torchmeg.parallel) -----------------------

_LLAMA3_VOCAB = 128256
# Llama 3.1 (8B, 70B, 405B) and 3.2 (1B) extend an 8k pretraining context to 128k with "llama3" RoPE
# scaling (their config.json's rope_scaling).
_LLAMA31_ROPE = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)
FLAVORS = {
    "debug": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64, rope_theta=10000.0,
                  max_seq_len=2048),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               vocab_size=_LLAMA3_VOCAB, tie_embeddings=True, max_seq_len=131072,
               **dict(_LLAMA31_ROPE, rope_factor=32.0)),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
               vocab_size=_LLAMA3_VOCAB, max_seq_len=131072, **_LLAMA31_ROPE),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                vocab_size=_LLAMA3_VOCAB, max_seq_len=131072, **_LLAMA31_ROPE),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                 vocab_size=_LLAMA3_VOCAB, max_seq_len=131072, **_LLAMA31_ROPE),
}

# Shared shape of the decoder plans (GPT-2 and MoE reuse it): vocab-sharded embedding,
# column-parallel q/k/v and up projections, row-parallel out/down projections (Megatron-LM,
# Shoeybi et al. 2019, sec. 3), sequence-parallel norms (Korthikanti et al. 2022) and a
# vocab-parallel output.
DECODER_TP = [
    ("layers.*.attention_norm", "sp_norm"),
    ("layers.*.attention", "sp_input"),
    ("layers.*.attention.wq", "colwise"),
    ("layers.*.attention.wk", "colwise"),
    ("layers.*.attention.wv", "colwise"),
    ("layers.*.attention.wo", "rowwise"),
    ("layers.*.ffn_norm", "sp_norm"),
    ("layers.*.feed_forward", "sp_input"),
    ("layers.*.feed_forward.w1", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    ("layers.*.feed_forward.w3", "colwise"),
    ("norm", "sp_norm"),
    ("output", "output"),
]
TP_PLAN = [("tok_embeddings", "embedding")] + DECODER_TP
# Qwen3's per-head norms: replicated over tp, each rank normalises its own heads, and the weights'
# gradients (partial sums over those heads) are summed over tp.
QK_NORM_TP = [("layers.*.attention.q_norm", "replicate_grad_allreduce"),
              ("layers.*.attention.k_norm", "replicate_grad_allreduce")]


def plan_with_qk_norm(plan: list):
    """The family's plan as a callable(model): plus the QK-norm entries where the model has them."""
    return lambda model: plan + (QK_NORM_TP if getattr(model.args, "qk_norm", False) else [])
