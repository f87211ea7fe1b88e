#!/usr/bin/env python
"""How fast the trainer's data loader makes batches, against how fast training eats them.

    python tools/loader_bench.py --config recipes/debug_llama.toml [--section.key=value ...]
                                 [--steps 200] [--workers 0,2] [--consume TOKENS_PER_S]

Builds the recipe's training set and StatefulDataLoader exactly as the trainer does (one
data-parallel rank, its local batch, the recipe's shuffle, document masking) and times --steps
steps of batches after a warm-up. --consume: the tokens/s one rank trains at (measured, or the
planner's prediction), printed next to what the loader supplies.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/debug_llama.toml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", default="0,2", help="comma list of data.num_workers")
    ap.add_argument("--consume", type=float, default=0.0, help="tokens/s a rank trains at")
    a, rest = ap.parse_known_args(argv)
    from torchmeg.config.schema import load_config
    from torchmeg.data.loader import build_dataset, build_loader, open_stores
    from torchmeg.data.tokenizer import build_tokenizer
    cfg = load_config(a.config, rest)
    tok = build_tokenizer(cfg.data.tokenizer)
    ds = build_dataset(cfg, open_stores(cfg, tok), "train")
    B, L = cfg.training.local_batch_size, cfg.data.seq_len
    print(f"{cfg.data.dataset} ({tok.name}): {ds.n_unique:,} windows of {L} tokens, local batch {B}, "
          f"document masking {'on' if cfg.data.document_masking else 'off'}")
    print("| loader workers | batches/s | samples/s | tokens/s |" + (" vs training |" if a.consume else ""))
    print("|---:|---:|---:|---:|" + ("---:|" if a.consume else ""))
    for w in (int(x) for x in a.workers.split(",")):
        loader = build_loader(ds, B, 1, 0, 1, 0, a.steps + 10, num_workers=w)
        it = iter(loader)
        for _ in range(10):  # warm-up: workers started, first pages read
            next(it)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            next(it)
        dt = time.perf_counter() - t0
        tps = a.steps * B * L / dt
        print(f"| {w} | {a.steps / dt:,.1f} | {a.steps * B / dt:,.1f} | {tps:,.0f} |"
              + (f" {tps / a.consume:,.0f}x |" if a.consume else ""), flush=True)
        del it, loader
    return 0


if __name__ == "__main__":
    sys.exit(main())
