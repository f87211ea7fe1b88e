#!/usr/bin/env python
"""Two kernel measurements of tools/gpu_check.py, each one process, one JSON file:

    python tools/gpu_check_kernels.py fused_ce --device cuda --json OUT.json
    python tools/gpu_check_kernels.py sink_attention --device cuda --json OUT.json
    (--toy: CPU-sized shapes, what `gpu_check.py --cpu` runs)

fused_ce: the LM head + cross-entropy at Llama 3's vocabulary (128,256) and a 1B's width (2,048),
8,192 tokens, bf16, forward + backward, three ways: unfused (logits = h @ W^T, then the trainer's
cross_entropy on their fp32 copy), torchmeg's chunked fused loss in torch ops, and the same with its
Triton kernel (CUDA only). Per way: median time, the allocator's peak above the inputs (CUDA; on the
CPU no allocator reports one), the loss and the gradients' agreement with the unfused way, and the
peak that tools/fused_ce_memory.py predicts on fake tensors for the same shapes (the prediction
checked).

sink_attention: gpt-oss-20b's attention shape (64 query heads, 8 KV heads, head dim 64, sliding
window 128 on every other layer), 4,096 tokens, bf16, forward + backward: torchmeg's sink attention
(the sink as one more key through SDPA's fused kernels) full-causal and windowed, against plain
causal SDPA (no sink) on the same q, k, v. Median time of each, and which SDPA backend ran.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchmeg.kernels.fused_ce import linear_cross_entropy  # noqa: E402  (the repository root, put on the path above)
from torchmeg.train.build import cross_entropy  # noqa: E402

GIB = 1 << 30


def timed(fn, device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` (the device synchronized around each)."""
    out = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def fused_ce(device: torch.device, toy: bool) -> dict:
    from fused_ce_memory import loss_path_peak  # lazy: the sibling tool (tools/ is on sys.path as this file's folder)
    tokens, vocab, dim, dtype = (512, 2048, 128, torch.float32) if toy else (8192, 128256, 2048, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    h0 = (torch.randn(tokens, dim, generator=g) * 0.5).to(device, dtype)
    w0 = (torch.randn(vocab, dim, generator=g) * dim ** -0.5).to(device, dtype)
    y = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    ways = {"unfused": lambda h, w: cross_entropy((h @ w.t())[None], y[None]),
            "fused (torch ops)": lambda h, w: linear_cross_entropy(h, w, y, use_triton=False)}
    if device.type == "cuda":
        ways["fused (Triton kernel)"] = lambda h, w: linear_cross_entropy(h, w, y, use_triton=True)
    rows, ref = [], None
    for name, fn in ways.items():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step():
            h.grad = w.grad = None
            loss = fn(h, w)
            loss.backward()
            return loss
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss = step()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB if device.type == "cuda" else None
        got = (loss.float().item(), h.grad.float(), w.grad.float())
        ref = ref or got
        rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
        predicted = loss_path_peak(name != "unfused", tokens, vocab, dim, dtype) / GIB
        rows.append({"way": name, "ms": round(1000 * timed(step, device), 3),
                     "peak_gib": None if peak is None else round(peak, 3), "predicted_peak_gib": round(predicted, 3),
                     "loss": got[0], "loss_rel_diff": abs(got[0] - ref[0]) / abs(ref[0]),
                     "grad_h_rel_diff": rel(got[1], ref[1]), "grad_w_rel_diff": rel(got[2], ref[2])})
    return {"shape": f"{tokens} tokens x vocab {vocab:,} x dim {dim}, {str(dtype).removeprefix('torch.')}",
            "rows": rows}


def sink_attention(device: torch.device, toy: bool) -> dict:
    import torch.nn.functional as F
    from torchmeg.models.gpt_oss import sink_attention as sink_attn
    B, H, K, L, D, W = (1, 8, 2, 256, 64, 32) if toy else (1, 64, 8, 4096, 64, 128)
    dtype = torch.float32 if toy else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    q0, k0, v0 = (torch.randn(B, n, L, D, generator=g).to(device, dtype) for n in (H, K, K))
    sinks0 = torch.randn(H, generator=g).to(device, torch.float32)
    ways = {"plain causal SDPA (no sink)": lambda q, k, v, s: F.scaled_dot_product_attention(
                q, k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1), is_causal=True),
            "sink attention, full causal": lambda q, k, v, s: sink_attn(q, k, v, s),
            f"sink attention, window {W}": lambda q, k, v, s: sink_attn(q, k, v, s, window=W)}
    rows = []
    for name, fn in ways.items():
        q, k, v, s = (t.clone().requires_grad_() for t in (q0, k0, v0, sinks0))

        def fwd():
            return fn(q, k, v, s)

        def fwd_bwd():
            q.grad = k.grad = v.grad = s.grad = None
            fn(q, k, v, s).float().sum().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fwd()
        kernels = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
                          or "flash_attention" in e.name or "efficient_attention" in e.name})
        with torch.no_grad():
            fwd_ms = 1000 * timed(fwd, device)
        rows.append({"way": name, "forward_ms": round(fwd_ms, 3), "forward_backward_ms": round(1000 * timed(fwd_bwd, device), 3),
                     "sdpa_kernels": kernels})
    base = rows[0]["forward_backward_ms"]
    for r in rows:
        r["vs_plain"] = round(r["forward_backward_ms"] / base, 3)
    return {"shape": f"batch {B}, {L} tokens, {H} query / {K} KV heads, head dim {D}, {str(dtype).removeprefix('torch.')}",
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["fused_ce", "sink_attention"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--toy", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    out = {"fused_ce": fused_ce, "sink_attention": sink_attention}[a.what](torch.device(a.device), a.toy)
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
