"""The LM head and cross-entropy in one pass over chunks of tokens: the [tokens, vocab] logits never
exist (Liger-Kernel's fused linear cross-entropy; Hsu et al. 2024).

For each chunk of tokens: logits = h_chunk @ W^T (in the inputs' dtype, softmax in fp32), the loss
of the chunk, and at once its gradient dlogits = softmax(logits) - onehot(label) (zero for ignored
labels), from which the gradients of h_chunk (dlogits @ W) and W (dlogits^T @ h_chunk, summed over
chunks) are computed in the forward; backward only scales them by the incoming gradient. Peak
memory: one chunk's logits instead of [tokens, vocab] logits, their fp32 copy and their gradient;
kept for backward: d loss/d h [tokens, dim] (fp32) and d loss/d W [vocab, dim].

Tensor parallel (the LM head's weight sharded by vocabulary, as the TP plan's `output` role does):
each rank holds logits of its own vocabulary slice; the chunk's max, sum of exponentials and target
logit are all-reduced over the TP group (the log-sum-exp of the whole vocabulary). Each slice's
gradient of the hidden states is a partial sum, handed to DTensor as Partial: a reduce-scatter back
to the sequence shard under sequence parallel, an all-reduce otherwise.

On CUDA (one vocabulary slice), a Triton kernel computes each chunk's loss and writes its gradient
over the logits in place (`_ce_rows_kernel`); tests run it on the CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE = -100
_CHUNK_BYTES = 1 << 28  # one chunk's fp32 logits: 256 MiB (vocab 128k: ~520 tokens per chunk)


def chunk_rows(vocab: int, n: int) -> int:
    return max(1, min(n, _CHUNK_BYTES // (4 * max(vocab, 1))))


def _ce_rows_torch(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Rows' losses [n] (0 where ignored); `logits` [n, V_local] fp32 becomes d loss_row / d logits."""
    n, V = logits.shape
    valid = labels != IGNORE
    local = valid & (labels >= vocab_start) & (labels < vocab_start + V)
    idx = torch.where(local, labels - vocab_start, torch.zeros_like(labels))
    target = torch.where(local, logits.gather(1, idx[:, None])[:, 0], logits.new_zeros(n))
    m = logits.max(dim=1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(m[:, None]).exp_()  # exp(x - max), in place
    s = logits.sum(dim=1)
    if group is not None:  # (one collective for both sums)
        both = torch.stack((s, target))
        dist.all_reduce(both, group=group)
        s, target = both[0], both[1]
    lse = m + s.log()
    logits.div_(s[:, None])  # softmax
    # minus one at the target (on the slice holding it), all zero on ignored rows; no shape depends
    # on the data (the planner runs this on fake tensors)
    logits.scatter_add_(1, idx[:, None], -local.to(logits.dtype)[:, None])
    logits.mul_(valid.to(logits.dtype)[:, None])
    return torch.where(valid, lse - target, torch.zeros_like(lse))


def _ce_rows(logits, labels, vocab_start, group, use_triton: bool):
    if use_triton:
        return _ce_rows_triton(logits, labels)
    return _ce_rows_torch(logits, labels, vocab_start, group)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, denominator, vocab_start, group, chunk, use_triton, need_grad, keep):
        N = h_ND.shape[0]
        acc = torch.promote_types(h_ND.dtype, torch.float32)  # softmax and loss: fp32 (fp64 for fp64 inputs)
        w = w_VD.to(h_ND.dtype)
        # d loss/d h: fp32 rows, written once each. d loss/d W: summed over chunks by addmm in the
        # compute dtype (bf16 under mixed precision, like Liger-Kernel and like the weight gradient
        # the unfused head hands FSDP); an fp32 sum would cost an fp32 [vocab, dim] buffer plus a
        # converted copy per chunk, more than the logits this saves.
        grad_h = torch.empty(N, h_ND.shape[1], dtype=acc, device=h_ND.device) if need_grad else None
        grad_w = torch.zeros_like(w) if need_grad else None
        loss = torch.zeros((), dtype=acc, device=h_ND.device)
        for a in range(0, N, chunk):
            h = h_ND[a:a + chunk]
            logits = (h @ w.t()).to(acc)  # [n, V_local]: the only vocab-sized tensor, one chunk at a time
            loss += _ce_rows(logits, labels_N[a:a + chunk], vocab_start, group, use_triton).sum()
            if need_grad:
                d = logits.to(h.dtype)
                grad_h[a:a + chunk] = d @ w
                grad_w.addmm_(d.t(), h)
                del d
            del logits  # (before the next chunk's are made: one chunk alive at a time)
        # Held on ctx, not saved: backward hands them on and drops them, so autograd's
        # AccumulateGrad takes the weight gradient as it is instead of copying [vocab, dim].
        ctx.grads, ctx.keep = (grad_h, grad_w), keep
        ctx.dtypes = (h_ND.dtype, w_VD.dtype)
        ctx.save_for_backward(denominator)
        return loss / denominator

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("fused linear cross-entropy: a second backward through the same loss; build it "
                               "with keep=True (linear_cross_entropy) to backpropagate more than once")
        (grad_h, grad_w), (denominator,) = ctx.grads, ctx.saved_tensors
        s = g / denominator
        if ctx.keep:  # split-backward pipeline schedules ask for d/dh and d/dW in two calls
            gh, gw = grad_h * s, grad_w * s.to(grad_w.dtype)
        else:
            ctx.grads = None
            gh, gw = grad_h.mul_(s), grad_w.mul_(s.to(grad_w.dtype))
        gh = gh.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = gw.to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gh, gw, *([None] * 8)


def linear_cross_entropy(h, weight, labels, mean_over: str = "targets", sequence_sharded: bool = False,
                         keep: bool = False, chunk: int = 0, use_triton: bool | None = None) -> torch.Tensor:
    """cross_entropy(h @ weight^T, labels) without the logits. `h` [..., D]; `weight` [V, D], or a
    vocabulary-sharded (Shard(0)) DTensor under tensor parallel, where `h` is a DTensor on its
    mesh or a plain tensor: this rank's sequence shard (`sequence_sharded`, dim 1) or the whole
    batch. `labels` [...] (IGNORE skipped), as `h` would be gathered. mean_over: "targets"
    (F.cross_entropy's mean), "positions" (the sum over targets / all positions:
    data.mask_eod_loss) or "sum" (training.objective = "sft" scales it). `keep`: the gradients survive backward (for more than one backward
    through this loss, as split-backward pipeline schedules run), at the cost of a copy."""
    group, vocab_start = None, 0
    if hasattr(weight, "device_mesh"):
        h, group, vocab_start, weight = _vocab_sharded(h, weight, sequence_sharded)
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if use_triton is None:
        use_triton = h2.is_cuda and group is None and _triton_available()
    if mean_over == "targets":
        denom = (y != IGNORE).sum().clamp_min(1).float()
    else:  # "positions": / every position (data.mask_eod_loss); "sum": the plain sum (sft scales it itself)
        denom = torch.tensor(float(y.numel()) if mean_over == "positions" else 1.0, device=y.device)
    need_grad = torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h2, weight, y, denom, vocab_start, group,
                                     chunk or chunk_rows(weight.shape[0], h2.shape[0]), use_triton, need_grad, keep)


def _vocab_sharded(h, weight, sequence_sharded: bool):
    """Under TP: the whole `h` on every rank (gathered if sharded), this rank's vocabulary rows and
    their offset. Each slice's d loss / d h is a partial sum: handed back to DTensor as Partial, so
    autograd sums it across the group (a reduce-scatter for a sequence shard, else an all-reduce)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # lazy: plain runs skip DTensor

    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] not in (Shard(0), Replicate()):
        raise ValueError(f"fused linear cross-entropy: the LM head weight is a DTensor {weight.placements} on "
                         f"{mesh}; expected vocabulary rows sharded (Shard(0)) over one tensor-parallel mesh")
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Shard(1) if sequence_sharded else Replicate()], run_check=False)
    sliced = weight.placements[0] == Shard(0) and mesh.size() > 1
    h = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial() if sliced else Replicate()])
    if not sliced:
        return h, None, 0, weight.to_local()
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's split: ceil(V / n) rows per rank
    return h, mesh.get_group(), mesh.get_local_rank() * rows, weight.to_local()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (lazy: an optional dependency, GPUs only)
    except ImportError:
        return False
    return True


_KERNEL = None


def _ce_rows_triton(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One program per row: log-sum-exp in one online pass, then the row's gradient written over it."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build_kernel()
    n, V = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    _KERNEL[(n,)](logits, labels, loss, V, logits.stride(0), IGNORE, BLOCK=1024)
    return loss


def _build_kernel():
    import triton  # lazy: see _triton_available
    import triton.language as tl  # lazy: as above

    @triton.jit
    def _ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, V, stride, ignore, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row)
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK):  # online softmax: max and sum of exponentials in one pass
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        valid = label != ignore
        safe = tl.where(valid, label, 0)
        target = tl.load(base + safe)
        tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
        for start in range(0, V, BLOCK):  # d loss / d logits = softmax - onehot (0 for an ignored row)
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=0.0)
            g = tl.exp(x - lse) - tl.where(offs == safe, 1.0, 0.0)
            tl.store(base + offs, tl.where(valid, g, 0.0), mask=offs < V)

    return _ce_rows_kernel
