"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437): Multi-head Latent Attention, DeepSeekMoE and
multi-token prediction, on the moe family's blocks.

Architecture only. Shape legend: B batch, L sequence, S cached positions, H heads, R kv_lora_rank
(the latent), r qk_rope_head_dim, n qk_nope_head_dim, v v_head_dim, E model dim, V vocab.

MLA (sec. 2.1.1): keys and values come from one compressed latent c = norm(W_a x) of R numbers per
token, expanded per head by W_b into a "no-position" key part and the value; the rotary part of
the key (r numbers) is computed once per token and shared by every head; the query may be
low-rank too (q_lora_rank). Generation caches only [c ; rotated key] (R + r numbers per token, not
2 H v) and attends in the latent space: W_b's key half is absorbed into the query and its value
half applied after the softmax, the same products regrouped.
DeepSeekMoE (sec. 2.1.2): the moe family's MoE with sigmoid scores, aux-loss-free bias balancing,
group-limited top-k, normalised top-k weights x route_scale, shared experts, dense first layers, and
the optional sequence-wise balance loss.
MTP (sec. 2.2): module k (1..D) combines the previous depth's hidden state at position i with the
embedding of token i+k, runs one more block and predicts token i+k+1 with the shared embedding and
output head; its cross-entropy x mtp_loss_weight / D is added to the gradient (not to the reported
loss) and kept in `mtp_loss` for the log. Generation does not run it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchmeg.models.blocks import fqn_matches
from torchmeg.models.llama import DECODER_TP, RMSNorm, causal_attention
from torchmeg.models.moe import MoEArgs, MoEBlock, MoETransformer, _AuxLoss
from torchmeg.models.rope import apply_rope, yarn_mscale


IGNORE = -100  # F.cross_entropy's default ignore_index: positions without a target (as torchmeg's data marks them)


@dataclass
class DeepSeekV3Args(MoEArgs):
    q_lora_rank: int = 0            # 0: queries projected directly (V2-Lite); DeepSeek-V3: 1536
    kv_lora_rank: int = 512         # R: the latent a token's keys and values are expanded from
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64      # r: the rotary part, shared by every head
    v_head_dim: int = 128
    mtp_depth: int = 0              # D multi-token-prediction modules (DeepSeek-V3: 1)
    mtp_loss_weight: float = 0.1    # lambda (DeepSeek-V3: 0.3 early, then 0.1)

    def __post_init__(self):
        self.head_dim = self.qk_rope_head_dim  # the RoPE tables' width
        super().__post_init__()

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """(query/key, value) widths per head: what attention's FLOPs scale with."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                out.append((key, "must be >= 1"))
        if self.mtp_depth < 0:
            out.append(("mtp_depth", "must be >= 0"))
        return out


def plain(t: torch.Tensor) -> torch.Tensor:
    """A module's `tp_local` view of a tensor: in a plain model the tensor itself. Tensor parallel sets
    `tp_local` to this rank's part as a plain tensor (torchmeg.parallel.tensor), where a weight's rows
    (the heads it holds) or a replicated loss value are read outside the modules' own forwards."""
    return t


class HeadShared(nn.Module):
    """Identity on a tensor every attention head reads (MLA's rotary key). Under tensor parallel each
    rank holds some heads, so its gradient is a partial sum: the plan's "head_shared" role sums it
    over tp (Qwen3's q/k norms have the same need for their weights)."""

    def forward(self, x):
        return x


class MLA(nn.Module):
    def __init__(self, a: DeepSeekV3Args):
        super().__init__()
        self.nope, self.rope, self.v_dim, self.rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        qk = self.nope + self.rope
        if a.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(a.q_lora_rank, 1e-6)  # (DeepSeek's latent norms keep eps 1e-6)
            self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(a.dim, a.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(a.dim, self.rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.rank, 1e-6)
        self.wkv_b = nn.Linear(self.rank, a.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * self.v_dim, a.dim, bias=False)
        self.rope_key = HeadShared()
        self.sdpa = causal_attention  # swappable kernel (context parallel), as Llama's attention
        self.tp_local = plain  # swappable view (tensor parallel: this rank's heads of wkv_b)
        # YaRN stretches the softmax temperature by mscale^2 (DeepSeek's softmax_scale); applied to
        # the query so every kernel keeps its default 1/sqrt(qk) scale.
        m = yarn_mscale(a.rope_factor, a.rope_mscale_all_dim) if a.rope_type == "yarn" and a.rope_mscale_all_dim else 1.0
        self.q_gain = m * m

    def forward(self, x_BLE, cos, sin, positions=None, cache=None, documents=None):
        B, L, _ = x_BLE.shape
        q = self.wq(x_BLE) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x_BLE)))
        q_nope, q_pe = q.view(B, L, -1, self.nope + self.rope).split([self.nope, self.rope], -1)
        q_pe = apply_rope(q_pe, cos, sin, positions)
        c_BLR, k_pe = self.wkv_a(x_BLE).split([self.rank, self.rope], -1)
        c_BLR = self.kv_norm(c_BLR)
        k_pe_BL1r = apply_rope(self.rope_key(k_pe).unsqueeze(2), cos, sin, positions)
        if cache is not None:
            return self._attend_latent(q_nope, q_pe, c_BLR, k_pe_BL1r, cache)
        kv = self.wkv_b(c_BLR).view(B, L, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe_BL1r.expand(-1, -1, k_nope.shape[2], -1)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        if self.q_gain != 1.0:
            q = q * self.q_gain
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        pad = self.nope + self.rope - self.v_dim
        if pad > 0:
            # Flash attention (CPU, CUDA, context parallel's kernels) takes one head size for q, k
            # and v; without it SDPA falls back to kernels that hold the [H, L, L] scores on CPU
            # (measured by the planner at 671B: ~30 GiB per layer at 4k tokens). v padded with
            # zeros, the padding's outputs (zeros) dropped: +pad/v of the P@V matmul's FLOPs.
            v = F.pad(v, (0, pad))
        o = self.sdpa(q, k, v) if documents is None else self.sdpa(q, k, v, documents=documents)
        return self.wo(o[..., :self.v_dim].transpose(1, 2).reshape(B, L, -1))

    def _attend_latent(self, q_nope, q_pe, c_BLR, k_pe_BL1r, cache):
        """Generation: the cache holds [c ; rotated key] per position; W_b's key half moves into the
        query (q_nope W_uk: scores against c directly) and its value half after the softmax."""
        B, L = q_nope.shape[:2]
        lat_B1SX = cache.append(torch.cat([c_BLR, k_pe_BL1r[:, :, 0]], -1).unsqueeze(1))
        w = self.tp_local(self.wkv_b.weight).view(-1, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_lat = torch.einsum("blhn,hnr->bhlr", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe.transpose(1, 2)], -1)
        mask = cache.owner.mask(L, lat_B1SX.shape[2])
        o_lat = F.scaled_dot_product_attention(q, lat_B1SX, lat_B1SX[..., :self.rank], attn_mask=mask,
                                               scale=self.q_gain / math.sqrt(self.nope + self.rope), enable_gqa=True)
        o = torch.einsum("bhlr,hvr->blhv", o_lat, w_uv)
        return self.wo(o.reshape(B, L, -1))


class MTPModule(nn.Module):
    """One multi-token-prediction depth: [enorm(embedding of token i+k) ; hnorm(h_i)] -> eh_proj ->
    a block -> norm (the output head is the model's). Concatenation order as DeepSeek's checkpoints."""

    def __init__(self, a: DeepSeekV3Args, layer: int):
        super().__init__()
        self.enorm = RMSNorm(a.dim, a.norm_eps)
        self.hnorm = RMSNorm(a.dim, a.norm_eps)
        self.eh_proj = nn.Linear(2 * a.dim, a.dim, bias=False)
        self.block = MoEBlock(a, layer, attention=MLA)
        self.norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, h, emb, cos, sin, positions=None, documents=None):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
        x = self.block(x, cos, sin, positions=positions) if documents is None else \
            self.block(x, cos, sin, positions=positions, documents=documents)
        return x, self.norm(x)


def shift_left(t_BL: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """t[:, i + k] at position i; the last k positions hold `fill`."""
    return torch.cat([t_BL[:, k:], t_BL.new_full((t_BL.shape[0], k), fill)], 1)


def mtp_ahead(tokens_BL: torch.Tensor, labels_BL: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, L, 2 depth]: column k-1 is token i+k (depth k's input; 0 past the end), column depth+k-1
    its target, token i+k+1 (labels[i+k]; ignored past the end). Built from whole sequences: under
    context parallel a shard's last positions read tokens of another shard, so the training loop
    builds this before sharding and passes it as `ahead`; under PP every stage gets it."""
    inputs = [shift_left(tokens_BL, k, 0) for k in range(1, depth + 1)]
    targets = [shift_left(labels_BL, k, IGNORE) for k in range(1, depth + 1)]
    return torch.stack(inputs + targets, -1)


def mtp_weights(ahead: torch.Tensor, depth: int, chunks: int = 1, shards: int = 1) -> torch.Tensor:
    """[B, L, depth] weights on the MTP cross-entropies making each microbatch's (rows split in
    `chunks`) loss its mean over its targets, as one process computes it. Under context parallel
    each of the `shards` sees part of a sequence: weighted by the whole sequences' target count
    (x shards, the shards' losses being averaged), as a per-shard mean would miscount the ignored
    tail that lies on one shard."""
    valid = (ahead[..., depth:] != IGNORE).float()
    per_chunk = valid.view(chunks, -1, valid.shape[1], depth)
    return (per_chunk * shards / per_chunk.sum((1, 2), keepdim=True).clamp_min(1)).view_as(valid)


def _ce(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, local=plain) -> torch.Tensor:
    x = logits.flatten(0, 1).float()
    if weight is None:
        return F.cross_entropy(x, target.flatten(), ignore_index=IGNORE)
    ce = local(F.cross_entropy(x, target.flatten(), ignore_index=IGNORE, reduction="none"))  # (vocab-parallel: replicated)
    return (ce * weight.flatten()).sum()


class DeepSeekV3(MoETransformer):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): MoEBlock(args, i, attention=MLA) for i in range(args.n_layers)})
        # MTP modules numbered after the main layers, as in DeepSeek's checkpoints (layers.61 in V3).
        self.mtp = nn.ModuleDict({str(args.n_layers + k): MTPModule(args, args.n_layers + k)
                                  for k in range(args.mtp_depth)}) if args.mtp_depth else None
        self.register_buffer("mtp_loss", torch.zeros(()), persistent=False)  # this step's, for the log

    record_stats = True  # off for torch's shape-inference forward under PP (parallel/pipeline.py)

    def init_buffers(self) -> None:
        super().init_buffers()
        if hasattr(self, "mtp_loss"):  # (Llama's constructor fills the tables before it exists)
            self.mtp_loss.zero_()

    def forward(self, tokens_BL, positions=None, cache=None, documents=None, labels=None, ahead=None,
                ahead_weight=None, last_only=False):
        """As Llama's; in training, `ahead` (mtp_ahead) or the `labels` [B, L] (the next tokens) it
        is built from feed the MTP modules, their losses weighted by `ahead_weight` (mtp_weights)
        when given, else each the mean over its targets. (A pipeline stage, holding part of the
        model, runs torchmeg.parallel.pipeline's stage forward over embed_ahead / head_and_mtp.)"""
        D = self.args.mtp_depth
        if ahead is None and labels is not None and D:
            ahead = mtp_ahead(tokens_BL, labels, D)
        if not D or ahead is None or cache is not None or not self.training:
            return super().forward(tokens_BL, positions=positions, cache=cache, documents=documents, last_only=last_only)
        rope = self.rope_inputs(positions, documents)
        h, e = self.tok_embeddings(tokens_BL), self.embed_ahead(ahead)
        return self.head_and_mtp(self.run_layers(h, rope), e, rope, ahead, ahead_weight)

    def embed_ahead(self, ahead: torch.Tensor) -> list[torch.Tensor]:
        """The embeddings of the tokens ahead, one [B, L, E] per MTP depth (the one embedding table)."""
        return [self.tok_embeddings(ahead[..., k]) for k in range(self.args.mtp_depth)]

    def head_and_mtp(self, h, e: list, rope: tuple, ahead, ahead_weight):
        """From the last block's output: the logits, and in training the MTP modules' loss riding on
        them into the gradient (the embeddings ahead `e` from embed_ahead)."""
        D = self.args.mtp_depth
        out = self.norm(h)
        logits = self.output(out) if not self.head_in_loss else out
        if not self.training:  # (a pipeline's evaluation: the main loss only)
            return logits
        cos, sin, pos, docs = rope
        kw = {"documents": docs} if docs is not None else {}
        total = 0.0
        for k, module in enumerate(self.mtp.values()):
            h, normed = module(h, e[k], cos, sin, positions=pos, **kw)
            total = total + _ce(self.output(normed), ahead[..., D + k],
                                None if ahead_weight is None else ahead_weight[..., k], self.tp_local)
        mtp = total / D
        if self.record_stats:
            # (under TP with loss_parallel the loss is replicated: `tp_local` reads its value)
            self.mtp_loss += self.tp_local(mtp.detach()) * self.mtp_log_scale
        return _AuxLoss.apply(logits, mtp * (self.args.mtp_loss_weight * self.aux_loss_scale))

    tp_local = staticmethod(plain)  # swappable view, as MLA's (tensor parallel with loss_parallel)
    # set by the training loop: like each MoE layer's, the gradient scale (1 / accumulated
    # microbatches; 1 under PP, whose schedule scales gradients itself) and the log's (1 / microbatches)
    aux_loss_scale = 1.0
    mtp_log_scale = 1.0
    extra_blocks = ("mtp",)  # each MTP module its own FSDP unit (torchmeg.models.blocks)


# ---- flavors and tensor-parallel plan (data; applied by torchmeg.parallel) -----------------------

_V3_ROUTING = dict(score_func="sigmoid", balance="bias", route_norm=True, n_shared_experts=1)
FLAVORS = {
    # CPU-sized: every mechanism on (low-rank q, 4 groups of 2 experts keeping 2, MTP 1, sequence-wise
    # balance); bias step 10x DeepSeek's so balance shows in a short run.
    "debug": dict(dim=128, n_layers=4, n_heads=4, vocab_size=-1, rope_theta=10000.0, max_seq_len=2048,
                  q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  n_experts=8, top_k=2, moe_hidden=64, ffn_dim=256, n_dense_layers=1, n_expert_groups=4,
                  topk_groups=2, route_scale=2.5, seq_aux_loss_coef=1e-4, bias_update_rate=0.01, mtp_depth=1,
                  norm_eps=1e-6, **_V3_ROUTING),
    # DeepSeek-V2-Lite's dimensions (15.7B total, 2.4B active; 16.3B with the MTP module) with V3's
    # routing and one MTP module.
    "16B": dict(dim=2048, n_layers=27, n_heads=16, vocab_size=102400, rope_theta=10000.0, max_seq_len=163840,
                q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_experts=64, top_k=6, moe_hidden=1408, ffn_dim=10944, n_dense_layers=1, route_scale=1.0,
                mtp_depth=1, norm_eps=1e-6, rope_type="yarn", rope_factor=40.0, rope_original_max_seq_len=4096,
                rope_mscale=0.707, rope_mscale_all_dim=0.707, **dict(_V3_ROUTING, n_shared_experts=2)),
    # DeepSeek-V3 as its config.json: 671B (37B active) + an 11.6B MTP module (DeepSeek's "685B" also
    # counts that module's copies of the embedding and head). Planned on paper only here.
    "671B": dict(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, rope_theta=10000.0, max_seq_len=163840,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 n_experts=256, top_k=8, moe_hidden=2048, ffn_dim=18432, n_dense_layers=3, n_expert_groups=8,
                 topk_groups=4, route_scale=2.5, mtp_depth=1, norm_eps=1e-6, rope_type="yarn", rope_factor=40.0,
                 rope_original_max_seq_len=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0, **_V3_ROUTING),
}

# MLA under TP (as Megatron places it): the low-rank down-projections and their norms replicated
# (small; every rank needs the whole latent), the per-head up-projections column-parallel (heads
# split), the output projection row-parallel; the attention's input gathered as a plain tensor
# (its replicated layers take no DTensor) and the shared rotary key's gradient summed over tp.
MLA_TP = [
    ("attention", "sp_input_local"),
    ("attention.wq", "colwise"),
    ("attention.wq_b", "colwise"),
    ("attention.wkv_b", "colwise"),
    ("attention.wo", "rowwise"),
    ("attention.rope_key", "head_shared"),
]
_FFN = [e for e in DECODER_TP if e[0].startswith(("layers.*.ffn_norm", "layers.*.feed_forward", "layers.*.attention_norm"))]


def tp_plan(model) -> list[tuple[str, str]]:
    """Embedding, every block (MLA as above; dense FFN as Llama; the MoE on each rank's sequence
    shard, its routed experts spread over tp and ep), the MTP modules' blocks alike, final norm and
    output."""
    plan = [("tok_embeddings", "embedding")] + _FFN + [("layers.*." + p, r) for p, r in MLA_TP]
    plan += [("layers.*.moe", "experts_over_tp")]
    if getattr(model, "mtp", None) is not None:
        # (eh_proj works on each position alone: on sequence shards, its weight's gradient summed over tp)
        plan += [("mtp.*.enorm", "sp_norm_local"), ("mtp.*.hnorm", "sp_norm_local"), ("mtp.*.eh_proj", "sp_norm_local"),
                 ("mtp.*.norm", "sp_norm"),
                 ("mtp.*.block.moe", "experts_over_tp")]
        plan += [(p.replace("layers.*.", "mtp.*.block."), r) for p, r in _FFN]
        plan += [("mtp.*.block." + p, r) for p, r in MLA_TP]
    plan += [("norm", "sp_norm"), ("output", "output")]
    # Patterns a model lacks (wq without q_lora_rank, wq_a/wq_b with it; dense FFNs when every layer
    # is routed) are dropped here, since a plan for this model is applied strictly.
    names = [n for n, _ in model.named_modules()]
    return [(p, r) for p, r in plan if any(fqn_matches(p, n) for n in names)]
