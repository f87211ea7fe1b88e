#!/usr/bin/env python
"""Decode speed of torchmeg.batching.generation, side by side in one process: recompute (the whole sequence
per new token), KV cache (eager), KV cache with the decode step compiled (static cache).

    python tools/generate_bench.py [--config recipes/debug_llama.toml] [--new-tokens 256]
                                   [--prompt-tokens 32] [--batch 1] [--rounds 3] [--section.key=value ...]

The model is the recipe's, initialised from its seed (speed does not depend on the weights); every
row runs the full --new-tokens (no end-of-document stop). Modes run in interleaved rounds; the table
gives the median decode tokens/s (tokens after each row's first / time after prefill), the median
prefill time and the speed-up over recompute.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/debug_llama.toml")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="recompute,cache,cache+compile")
    a, rest = ap.parse_known_args(argv)
    import torch

    from torchmeg.parallel.compile import setup
    from torchmeg.config.schema import load_config
    from torchmeg.batching.generation import Sampling, decode_one, generate
    from torchmeg.models import build_model, materialize
    cfg = load_config(a.config, rest)
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=cfg.job.seed).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.batch)]
    setup(cfg.compile.cache_dir)
    compiled = torch.compile(decode_one, dynamic=False)
    modes = a.modes.split(",")
    step_of = {"recompute": None, "cache": None, "cache+compile": compiled}
    rates, prefill = {m: [] for m in modes}, {m: [] for m in modes}
    generate(model, prompts, 8, -1, Sampling(), "cpu", decode_step=compiled)  # compile outside the timing
    for r in range(a.rounds):
        for m in modes:
            out = generate(model, prompts, a.new_tokens, -1, Sampling(), "cpu", use_cache=m != "recompute",
                           decode_step=step_of[m])
            if m == "recompute":  # one row at a time: the batch's rate is its rows' tokens over their total time
                rate = sum(len(o.tokens) - 1 for o in out) / sum((len(o.tokens) - 1) / o.decode_tokens_per_sec
                                                                 for o in out)
            else:
                rate = out[0].decode_tokens_per_sec
            rates[m].append(rate)
            prefill[m].append(out[0].prefill_ms)
            print(f"round {r + 1} {m:<14} {rate:10,.0f} tokens/s", file=sys.stderr, flush=True)
    base = statistics.median(rates[modes[0]])
    print(f"\n{cfg.model.name}/{cfg.model.flavor}, batch {a.batch}, prompt {a.prompt_tokens} tokens, "
          f"{a.new_tokens} new tokens, {torch.get_num_threads()} threads, median of {a.rounds} rounds\n")
    print(f"| mode | decode tokens/s | prefill (ms) | vs {modes[0]} |")
    print("|---|---:|---:|---:|")
    for m in modes:
        med = statistics.median(rates[m])
        print(f"| {m} | {med:,.0f} | {statistics.median(prefill[m]):.1f} | {med / base:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
