#!/usr/bin/env python
"""Where a MoE layer's time goes: the expert matmuls vs everything around them (routing, sorting,
gathering, the weighted scatter back, the shared expert, the balance loss).

    python tools/moe_time_split.py [--config recipes/moe_debug.toml] [--repeats 20] [--section.key=value ...]

One process, the recipe's model and one microbatch (local_batch_size x seq_len tokens), training
mode: the first MoE layer's forward + backward, timed whole, then its experts alone (forward +
backward of `experts(x_sorted, counts)` on the same routed tokens), interleaved over --repeats
rounds (medians). Prints both and the fraction of the layer's time outside the expert matmuls.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmeg.config.schema import load_config  # noqa: E402
from torchmeg.data.tokenizer import build_tokenizer  # noqa: E402
from torchmeg.models import build_model, materialize  # noqa: E402
from torchmeg.models.args import model_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="recipes/moe_debug.toml")
    ap.add_argument("--repeats", type=int, default=20)
    a, rest = ap.parse_known_args()
    cfg = load_config(a.config, rest)
    vocab = build_tokenizer(cfg.data.tokenizer).vocab_size
    model = materialize(build_model(cfg, vocab, "meta"), "cpu", seed=0).train()
    moe = next(m for m in model.modules() if type(m).__name__ == "MoE")
    args = model_args(cfg, vocab)
    T = cfg.training.local_batch_size * cfg.data.seq_len
    x = torch.randn(cfg.training.local_batch_size, cfg.data.seq_len, args.dim, requires_grad=True)

    # the routed tokens the experts see in this layer, as MoE.forward sorts them
    with torch.no_grad():
        idx = (moe.router(x.reshape(-1, args.dim)).float().softmax(-1)).topk(args.top_k, -1).indices
    counts = torch.bincount(idx.flatten(), minlength=args.n_experts)
    x_sorted = x.detach().reshape(-1, args.dim)[idx.flatten().argsort(stable=True) // args.top_k].requires_grad_()

    # (backward from a materialised gradient: grouped_mm's backward refuses sum()'s stride-0 one)
    def layer():
        y = moe(x)
        y.backward(torch.ones_like(y))

    def experts():
        y = moe.experts(x_sorted, counts)
        y.backward(torch.ones_like(y))

    timings = {"layer": [], "experts": []}
    for fn in (layer, experts):  # warm-up
        fn()
    for _ in range(a.repeats):
        for name, fn in (("layer", layer), ("experts", experts)):
            t0 = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t0)
    lay, exp = (statistics.median(timings[k]) * 1000 for k in ("layer", "experts"))
    print(f"moe_time_split: {cfg.model.name}/{cfg.model.flavor}, {T} tokens x top {args.top_k} of {args.n_experts} "
          f"experts, {torch.get_num_threads()} threads, median of {a.repeats}, forward + backward of one MoE layer")
    print(f"| MoE layer | expert matmuls | outside the expert matmuls |\n|---:|---:|---:|\n"
          f"| {lay:.2f} ms | {exp:.2f} ms | {lay - exp:.2f} ms ({(lay - exp) / lay:.0%}) |")


if __name__ == "__main__":
    main()
