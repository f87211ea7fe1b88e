"""Peak memory of the loss path (LM head + cross-entropy, forward and backward) with and without
training.fused_linear_cross_entropy, at a real vocabulary, on fake tensors: no memory is used, the
numbers are torch's MemTracker over what the ops would allocate.

    python tools/fused_ce_memory.py                       # Llama 3 8B's head: vocab 128,256, dim 4,096
    python tools/fused_ce_memory.py --tokens 8192 --dtype fp32

The path measured is the one the trainer runs: unfused, logits = h @ W^T then F.cross_entropy on
their fp32 copy (torchmeg.train.build.cross_entropy); fused, torchmeg.kernels.fused_ce.linear_cross_entropy.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchmeg.train.build import cross_entropy  # noqa: E402  (the repository root, put on the path above)
from torchmeg.kernels.fused_ce import linear_cross_entropy  # noqa: E402
from torchmeg.plan.memory import current_bytes, peak_bytes, step_memory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def loss_path_peak(fused: bool, tokens: int, vocab: int, dim: int, dtype: torch.dtype) -> int:
    """Peak bytes above the inputs (hidden states and head weight) during forward + backward."""
    with FakeTensorMode():
        mt = step_memory()
        with mt:  # (the inputs made under the tracker: it knows their storage, a view of them is not new)
            h = torch.randn(1, tokens, dim, dtype=dtype, requires_grad=True)
            w = torch.randn(vocab, dim, dtype=dtype, requires_grad=True)
            y = torch.randint(0, vocab, (1, tokens))
            base = current_bytes(mt)
            if fused:
                loss = linear_cross_entropy(h, w, y)
            else:
                loss = cross_entropy(h @ w.t(), y)
            loss.backward()
            peak = peak_bytes(mt)["Total"]
    return peak - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens in the microbatch (batch x seq_len)")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    a = ap.parse_args()
    dt = DTYPES[a.dtype]
    logits = a.tokens * a.vocab * dt.itemsize
    before = loss_path_peak(False, a.tokens, a.vocab, a.dim, dt)
    after = loss_path_peak(True, a.tokens, a.vocab, a.dim, dt)
    gib = 1 << 30
    print(f"loss path, {a.tokens} tokens x vocab {a.vocab:,} x dim {a.dim}, {a.dtype}: "
          f"logits {logits / gib:.2f} GiB")
    print(f"  unfused peak {before / gib:.2f} GiB   fused peak {after / gib:.2f} GiB   "
          f"saved {(before - after) / gib:.2f} GiB ({(before - after) / logits:.1f}x the logits)")


if __name__ == "__main__":
    main()
