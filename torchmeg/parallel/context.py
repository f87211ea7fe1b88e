"""Context parallelism: the sequence split over the `cp` mesh dim, attention over all of it.

Layout (load-balanced for causal attention): the sequence is cut into 2 x cp chunks of c tokens and
cp rank r holds chunks r and 2cp-1-r, so every rank gets one early (cheap) and one late (expensive)
chunk of the causal triangle (Megatron-LM's CP layout). RoPE / learned positions use the tokens'
absolute positions (`positions()`), fed to the model by a forward pre-hook.

Attention never builds a mask. `parallelism.context_parallel_mode` picks the exchange:

* "allgather": K and V (n_kv_heads of them, repeated to the query heads only after the exchange)
  are all-gathered once per call; backward reduce-scatters their gradients.
* "ring": K/V chunk pairs travel around the cp group with p2p, the next exchange posted before the
  current pair is computed (overlap); in backward the K/V gradients travel with them and arrive
  home after cp hops (Liu et al. 2023, Ring Attention).
* "alltoall" (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all trades the sequence split for
  a head split, each rank runs ordinary causal attention over the whole sequence for
  n_heads / cp heads, and a second all-to-all trades back. Needs n_heads and n_kv_heads
  divisible by cp (x tp).

The first two compute attention block by block over (query chunk i, key chunk j): full for j < i,
`is_causal` for j == i, skipped for j > i — exactly the causal half plus the diagonal chunks —
with the fused SDPA kernels that return the log-sum-exp (CPU flash; CUDA memory-efficient),
merged with the online-softmax rule (Milakov & Gimelshein 2018; FlashAttention eq. 3):
  lse = log(exp(lse_a) + exp(lse_b)),  o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.
Backward recomputes each pair with the kernel's own backward, given the merged output and
log-sum-exp (dS = P (dP - rowsum(dO o O)) needs only those), so no pair's probabilities are kept.
torch's own `context_parallel` has no CPU sharding rule for SDPA (torch 2.13), so this path serves
CPU and GPU alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import (all_gather_tensor, all_gather_tensor_autograd,
                                                       all_to_all_single_autograd, reduce_scatter_tensor)

from torchmeg.config.errors import ConfigError
from torchmeg.parallel.expert import sum_over_shards
from torchmeg.models.attention import document_attention, document_positions, repeat_kv

MODES = ("allgather", "ring", "alltoall")


def positions(local_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions of the tokens cp rank `rank` holds (local_len = seq_len / cp)."""
    c = local_len // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def sequence_order(cp: int) -> list[int]:
    """Chunks listed as the ranks hold them (rank 0's pair, rank 1's, ...) -> the indices that put
    them in sequence order."""
    held = [j for r in range(cp) for j in chunk_ids(r, cp)]
    return sorted(range(2 * cp), key=lambda i: held[i])


def _in_sequence_order(y, cp: int):
    """[cp (source rank), B, K, L/cp, D], each rank's chunk pair -> [B, K, L, D] in sequence order."""
    _, B, K, Ll, D = y.shape
    chunks = y.reshape(cp, B, K, 2, Ll // 2, D).permute(1, 2, 0, 3, 4, 5).reshape(B, K, 2 * cp, Ll // 2, D)
    return chunks[:, :, sequence_order(cp)].reshape(B, K, cp * Ll, D)


# ---- one (query chunk, key chunk) pair on this device ------------------------------------------

class PairCounter:
    """Attention work done, in query x key token pairs (a causal diagonal pair counts half), and
    bytes the ring sent by p2p: lets tests and the benchmark check that no block above the
    diagonal is ever computed, and what each mode moves."""
    pairs = 0.0
    p2p_bytes = 0

    @classmethod
    def add(cls, q, k, causal: bool) -> None:
        if torch.compiler.is_compiling():
            return  # (an eager-mode instrument: traced, its running total would be a guard, recompiling every call)
        n = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        cls.pairs += n / 2 if causal else n

    @classmethod
    def reset(cls) -> None:
        cls.pairs, cls.p2p_bytes = 0.0, 0


def _pair_fwd(q, k, v, causal: bool):
    """-> (out [B,H,c,D], lse [B,H,c] fp32, what the backward needs)."""
    PairCounter.add(q, k, causal)
    if q.device.type == "cuda":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal)
        return out, lse[..., :q.shape[2]].float(), (lse.shape[-1], seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse.float(), None


def _pair_bwd(do, q, k, v, out, lse, causal: bool, aux):
    if q.device.type == "cuda":
        padded, seed, offset = aux
        lse = F.pad(lse, (0, padded - lse.shape[-1]))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal)


def _merge(o, lse, o_new, lse_new):
    """Online softmax: combine two partial attentions over disjoint key sets."""
    if o is None:
        return o_new.float(), lse_new
    m = torch.logaddexp(lse, lse_new)
    return (o * (lse - m).exp().unsqueeze(-1) + o_new.float() * (lse_new - m).exp().unsqueeze(-1)), m


def _fold_kv(dx, rep: int):
    """Gradient of repeat_kv: sum the query heads that shared a kv head."""
    if rep == 1:
        return dx
    B, H, L, D = dx.shape
    return dx.view(B, H // rep, rep, L, D).sum(2)


# ---- exchanges -----------------------------------------------------------------------------

class _Peers:
    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def shift(self, tensors):
        """Send `tensors` to the next rank, receive the previous rank's; returns (works, received)."""
        tensors = [t.contiguous() for t in tensors]
        PairCounter.p2p_bytes += sum(t.numel() * t.element_size() for t in tensors)
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.group) for g in got]
        return dist.batch_isend_irecv(ops), got


def _all_gather(x, group, size):
    """[...] -> [size, ...] (functional collective: visible to CommDebugMode and the compiler)."""
    out = all_gather_tensor(x.contiguous(), 0, group)
    return out.wait() if hasattr(out, "wait") else out.view((size,) + tuple(x.shape))


def _reduce_scatter(x_all, group):
    size = x_all.shape[0]
    flat = x_all.contiguous().view((size * x_all.shape[1],) + tuple(x_all.shape[2:]))
    out = reduce_scatter_tensor(flat, "sum", 0, group)
    return out.wait() if hasattr(out, "wait") else out


class _BlockAttention(torch.autograd.Function):
    """Causal attention of this rank's two query chunks against the whole sequence's K/V, pair by
    pair; K/V arrive by all-gather or around a ring (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, peers: _Peers, ring: bool):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cp, r = peers.size, peers.rank
        c = q.shape[2] // 2
        rep = q.shape[1] // k.shape[1]
        qs = (q[:, :, :c], q[:, :, c:])
        mine = chunk_ids(r, cp)
        acc = [[None, None], [None, None]]  # per query chunk: (out, lse)
        aux = {}

        def visit(src, kv_src):
            ks, vs = repeat_kv(kv_src[0], rep), repeat_kv(kv_src[1], rep)
            for a, qi in enumerate(mine):
                for b, kj in enumerate(chunk_ids(src, cp)):
                    if kj > qi:
                        continue  # above the diagonal: nothing visible
                    sl = slice(b * c, (b + 1) * c)
                    o, lse, x = _pair_fwd(qs[a], ks[:, :, sl], vs[:, :, sl], kj == qi)
                    aux[(a, src, b)] = x
                    acc[a] = list(_merge(*acc[a], o, lse))

        if ring:
            kv = (k, v)
            for t in range(cp):
                works = None
                if t < cp - 1:  # post the next exchange, then compute on the current block
                    works, nxt = peers.shift(kv)
                visit((r - t) % cp, kv)
                if works is not None:
                    for w in works:
                        w.wait()
                    kv = tuple(nxt)
        else:
            k_all = _all_gather(k, peers.group, cp).view((cp,) + tuple(k.shape))
            v_all = _all_gather(v, peers.group, cp).view((cp,) + tuple(v.shape))
            for src in range(cp):
                visit(src, (k_all[src], v_all[src]))
        out = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
        # Gathered K/V (reused by backward) via save_for_backward, not ctx: recompute drops and rebuilds
        # saved tensors; a ctx attribute held every layer's whole-sequence K/V from forward to backward.
        ctx.save_for_backward(q, k, v, out, lse, *(() if ring else (k_all, v_all)))
        ctx.peers, ctx.ring, ctx.aux = peers, ring, aux  # (aux: CUDA's RNG seed/offset scalars, or None)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, *kv_all = ctx.saved_tensors
        peers, ring, aux = ctx.peers, ctx.ring, ctx.aux
        cp, r = peers.size, peers.rank
        c = q.shape[2] // 2
        rep = q.shape[1] // k.shape[1]
        d_out = d_out.contiguous()
        mine = chunk_ids(r, cp)
        dq = torch.zeros_like(q, dtype=torch.float32)

        def visit(src, kv_src, dkv_src):
            ks, vs = repeat_kv(kv_src[0], rep), repeat_kv(kv_src[1], rep)
            dk = torch.zeros_like(ks, dtype=torch.float32)
            dv = torch.zeros_like(vs, dtype=torch.float32)
            for a, qi in enumerate(mine):
                qsl = slice(a * c, (a + 1) * c)
                for b, kj in enumerate(chunk_ids(src, cp)):
                    if kj > qi:
                        continue
                    sl = slice(b * c, (b + 1) * c)
                    gq, gk, gv = _pair_bwd(d_out[:, :, qsl], q[:, :, qsl], ks[:, :, sl], vs[:, :, sl],
                                           out[:, :, qsl], lse[:, :, qsl].contiguous(), kj == qi, aux[(a, src, b)])
                    dq[:, :, qsl] += gq
                    dk[:, :, sl] += gk
                    dv[:, :, sl] += gv
            dkv_src[0] += _fold_kv(dk, rep)
            dkv_src[1] += _fold_kv(dv, rep)

        if ring:
            kv = (k, v)
            dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
            for t in range(cp):
                works = None
                if t < cp - 1:
                    works, nxt = peers.shift(kv)
                visit((r - t) % cp, kv, dkv)
                # The gradient of the block just used travels on with it; after cp hops in all,
                # each rank holds the complete gradient of its own K/V.
                w2, dkv = peers.shift(dkv)
                for w in (works or []) + w2:
                    w.wait()
                if works is not None:
                    kv = tuple(nxt)
            dk, dv = dkv
        else:
            k_all, v_all = kv_all
            dk_all = torch.zeros_like(k_all, dtype=torch.float32)
            dv_all = torch.zeros_like(v_all, dtype=torch.float32)
            for src in range(cp):
                pair = [dk_all[src], dv_all[src]]
                visit(src, (k_all[src], v_all[src]), pair)
            dk, dv = _reduce_scatter(dk_all, peers.group), _reduce_scatter(dv_all, peers.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class BlockAttention:
    """Drop-in for the model's causal SDPA on a sequence shard: allgather or ring exchange."""

    def __init__(self, cp_mesh, mode: str):
        self.peers = _Peers(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
        self.ring = mode == "ring"

    @torch._dynamo.disable  # communication inside: a graph break around it under torch.compile
    def __call__(self, q_BHLD, k_BKLD, v_BKLD, documents=None):
        if documents is not None:
            return self._documents(q_BHLD, k_BKLD, v_BKLD, documents)
        return _BlockAttention.apply(q_BHLD, k_BKLD, v_BKLD, self.peers, self.ring)

    def _documents(self, q_BHLD, k_BKLD, v_BKLD, documents_BS):
        """Document masking (allgather mode): K/V of the whole window gathered (autograd: their
        gradients reduce-scatter back), then each local chunk's queries attend within their
        documents over the window's keys (torchmeg.models.attention)."""
        p = self.peers
        k_all, v_all = (_whole_window(x, p.group, p.size) for x in (k_BKLD, v_BKLD))
        c = q_BHLD.shape[2] // 2
        outs = [document_attention(q_BHLD[:, :, i * c:(i + 1) * c], k_all, v_all, documents_BS, chunk * c)
                for i, chunk in enumerate(chunk_ids(p.rank, p.size))]
        return torch.cat(outs, dim=2)


def _whole_window(x_BKLD, group, cp: int):
    """[B, K, L/cp, D] chunk pairs of every cp rank -> [B, K, L, D] in sequence order."""
    y = all_gather_tensor_autograd(x_BKLD.unsqueeze(0).contiguous(), 0, group)  # [cp, B, K, Ll, D]
    return _in_sequence_order(y, cp)


class UlyssesAttention:
    """Sequence split -> head split (all-to-all), plain causal attention, and back."""

    def __init__(self, cp_mesh):
        self.group, self.rank, self.size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
        cp = self.size
        # After the exchange the chunks arrive grouped by source rank (r, 2cp-1-r): put back in
        # sequence order (_in_sequence_order); this inverse restores the shard layout.
        order = sequence_order(cp)
        self.inverse = [order.index(i) for i in range(2 * cp)]

    def _to_heads(self, x_BHLD):
        """[B, h, L/cp, D] sequence shard -> [B, h/cp, L, D] head shard, chunks in sequence order."""
        B, h, Ll, D = x_BHLD.shape
        cp = self.size
        x = x_BHLD.reshape(B, cp, h // cp, Ll, D).permute(1, 0, 2, 3, 4).contiguous()  # [cp(dest), B, h/cp, Ll, D]
        y = all_to_all_single_autograd(x, None, None, self.group)  # [cp(src), B, h/cp, Ll, D]
        return _in_sequence_order(y, cp)

    def _to_sequence(self, x_BhLD):
        B, hc, L, D = x_BhLD.shape
        cp = self.size
        chunks = x_BhLD.reshape(B, hc, 2 * cp, L // (2 * cp), D)[:, :, self.inverse]
        x = chunks.reshape(B, hc, cp, L // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dest), B, hc, Ll, D]
        y = all_to_all_single_autograd(x, None, None, self.group)  # [cp(src = head group), B, hc, Ll, D]
        return y.permute(1, 0, 2, 3, 4).reshape(B, cp * hc, L // cp, D)

    def __call__(self, q_BHLD, k_BKLD, v_BKLD, documents=None):
        q, k, v = self._to_heads(q_BHLD), self._to_heads(k_BKLD), self._to_heads(v_BKLD)
        rep = q.shape[1] // k.shape[1]
        PairCounter.add(q, k, True)
        if documents is not None:  # the whole window, in order, per head group: as on one device
            return self._to_sequence(document_attention(q, k, v, documents))
        o = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=True)
        return self._to_sequence(o)


def apply_cp(model: nn.Module, cp_mesh, mode: str = "allgather", hidden_seq_shards: int = 1) -> int:
    """Swap every attention kernel (modules with an `sdpa` attribute) for the context-parallel
    one and feed the model the absolute positions of its shard; returns how many were swapped.
    `hidden_seq_shards`: a later pipeline stage's hidden-state input is in that many sequence pieces."""
    attn = UlyssesAttention(cp_mesh) if mode == "alltoall" else BlockAttention(cp_mesh, mode)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "sdpa"):
            mod.sdpa = attn
            n += 1
    if not n:
        raise ValueError("context parallel needs attention modules with an `sdpa` attribute")
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    for mod in model.modules():
        if hasattr(mod, "shard_sum"):  # (MoE's balance losses: whole sequences' token statistics)
            sum_over_shards(mod, cp_mesh.get_group(), sum_grads=True)

    def add_positions(mod, args, kwargs):
        kwargs = dict(kwargs)
        docs = kwargs.get("documents")
        if docs is not None:  # document masking: positions restart per document; this rank's chunks of them
            kwargs["positions"] = shard_sequence(document_positions(docs), rank, size)
        else:  # tokens [B, L/cp], or a later stage's hidden state [B, L/cp/shards, D]
            x = args[0]
            local = x.shape[1] * (hidden_seq_shards if x.is_floating_point() else 1)
            kwargs["positions"] = positions(local, rank, size, x.device)
        return args, kwargs
    model.register_forward_pre_hook(add_positions, with_kwargs=True)
    return n


def check_model_has_attention(model_name: str, has_sdpa: bool, cp: int) -> None:
    """Context parallel swaps the `sdpa` kernel of torchmeg's attention modules; a model whose
    registry entry says it has none cannot take it."""
    if not has_sdpa and cp > 1:
        raise ConfigError(f"parallelism.context_parallel_degree = {cp}: context parallel swaps torchmeg's own "
                          f"attention module; model.name = {model_name!r} has none")


def check(cfg, args, dims) -> None:
    cp, tp = dims.cp, dims.tp
    if hasattr(args, "sliding_window"):
        raise ConfigError(f"parallelism.context_parallel_degree = {cp}: model.name = {cfg.model.name!r} attends "
                          f"with sinks and sliding windows, which torchmeg's context-parallel kernels do not "
                          f"compute; use TP, FSDP, EP or PP (its windowed layers need no long context split)")
    mode = cfg.parallelism.context_parallel_mode
    if mode == "ring" and cfg.data.document_masking:
        raise ConfigError("parallelism.context_parallel_mode = \"ring\" with data.document_masking = true: not "
                          "supported (the ring passes K/V blocks without their documents); use \"allgather\" or "
                          "\"alltoall\"")
    unit = 2 * cp * (tp if tp > 1 and cfg.parallelism.sequence_parallel else 1)
    if cfg.data.seq_len % unit:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: context parallel {cp} needs a multiple of {unit} "
                          f"(2 x context_parallel_degree{' x tensor_parallel_degree' if unit != 2 * cp else ''})")
    if mode == "alltoall":
        heads = {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads}
        for name, h in heads.items():
            if h % (cp * tp):
                raise ConfigError(f"parallelism.context_parallel_mode = \"alltoall\": model.{name} = {h} is not "
                                  f"divisible by context_parallel_degree x tensor_parallel_degree = {cp * tp}; "
                                  f"use \"allgather\" or \"ring\"")
