"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP, tied output.

Architecture only. Names mirror llama.py (wq/wk/wv/wo, w1/w2) so one TP plan shape serves both.
Legend: B batch, L sequence, E model dim, D head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchmeg.models.attention import DocumentBatch, document_positions
from torchmeg.models.init import Constant, Normal
from torchmeg.models.kv_cache import head_positions
from torchmeg.models.llama import DECODER_TP, causal_attention


@dataclass
class GPT2Args:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = -1            # -1: taken from the tokenizer
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    bias: bool = True
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.dim


class Attention(nn.Module):
    def __init__(self, a: GPT2Args):
        super().__init__()
        self.head_dim = a.head_dim
        self.sdpa = causal_attention  # swappable kernel, see llama.Attention
        self.wq = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wk = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wv = nn.Linear(a.dim, a.dim, bias=a.bias)
        self.wo = nn.Linear(a.dim, a.dim, bias=a.bias)

    def forward(self, x_BLE: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        B, L, _ = x_BLE.shape
        q, k, v = (w(x_BLE).view(B, L, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if cache is not None:  # generation: the KV cache
            o = cache.attend(q, k, v)
        else:
            o = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents=documents)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, a: GPT2Args):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=a.bias)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=a.bias)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, a: GPT2Args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(a.dim, eps=a.norm_eps, bias=a.bias)
        self.attention = Attention(a)
        self.ffn_norm = nn.LayerNorm(a.dim, eps=a.norm_eps, bias=a.bias)
        self.feed_forward = MLP(a)

    def forward(self, x, cache=None, documents=None):
        x = x + self.attention(self.attention_norm(x), cache=cache, documents=documents)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT2(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.head_in_loss = False  # see llama.Llama

    def init_buffers(self) -> None:
        pass

    def init_rule(self, fqn: str):
        a = self.args
        if fqn.endswith("bias"):
            return Constant(0.0)
        if "norm" in fqn:
            return Constant(1.0)
        if fqn.endswith(("wo.weight", "w2.weight")):
            return Normal(a.init_std / math.sqrt(2 * a.n_layers))
        return Normal(a.init_std)

    def forward(self, tokens_BL: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                documents: torch.Tensor | None = None, last_only: bool | torch.Tensor = False) -> torch.Tensor:
        """Logits [B, L, V]. Generation passes `positions` [B, L] and a KVCache (models.kv_cache),
        and `last_only` at prefill (logits [B, 1, V]);
        document masking passes `documents` [B, L] (models.attention): positions restart per document."""
        if documents is not None:
            if positions is None:
                positions = document_positions(documents)
            documents = DocumentBatch(documents)  # (spans read once for every layer)
        if self.tok_embeddings is not None:
            pos = positions if positions is not None else torch.arange(tokens_BL.shape[1], device=tokens_BL.device)
            h = self.tok_embeddings(tokens_BL) + self.pos_embeddings(pos)
        else:
            h = tokens_BL
        for name, layer in self.layers.items():
            if cache is not None:
                h = layer(h, cache=cache.layer(name))
            else:
                h = layer(h) if documents is None else layer(h, documents=documents)
        h = head_positions(h, last_only)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and not self.head_in_loss else h


# ---- flavors and tensor-parallel plan (data; applied by torchmeg.parallel) -----------------------

_GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
FLAVORS = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, max_seq_len=1024),
    "124M": dict(dim=768, n_layers=12, n_heads=12, vocab_size=_GPT2_VOCAB),
    "350M": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=_GPT2_VOCAB),
    "774M": dict(dim=1280, n_layers=36, n_heads=20, vocab_size=_GPT2_VOCAB),
    "1.5B": dict(dim=1600, n_layers=48, n_heads=25, vocab_size=_GPT2_VOCAB),
}

# Llama's decoder plan without the gate projection w3. Learned positions are added to the
# embedding output outside any module, so the embedding stays replicated and the first block
# re-shards the sequence.
TP_PLAN = ([("tok_embeddings", "embedding_replicate"), ("layers.0", "sp_enter")]
           + [e for e in DECODER_TP if not e[0].endswith(".w3")])
