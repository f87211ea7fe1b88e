"""GRPO's rollout engine vs generating the same group one sequence at a time, side by side in one run.

    python tools/rollout_bench.py [--config recipes/grpo_debug.toml] [--prompts 4] [--generations 8]
                                  [--tokens 64]

The model is the recipe's starting checkpoint (checkpoint.initial_load_path) when it exists, else a
fresh init. Both sides generate the same completions (asserted token for token: the engine's
per-sequence random streams), with no end-of-sequence stop so both produce every token; printed:
tokens/s of each and their ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmeg.config.schema import load_config  # noqa: E402
from torchmeg.data.loader import open_prompts  # noqa: E402
from torchmeg.data.tokenizer import build_tokenizer  # noqa: E402
from torchmeg.batching.generation import Sampling, generate as generate_alone  # noqa: E402
from torchmeg.train.rollout import generate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="recipes/grpo_debug.toml")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    cfg = load_config(a.config, [])
    from torchmeg.inference.trained import load_trained  # lazy: starts a one-process group
    from torchmeg.train.validate import validate
    start = cfg.checkpoint.initial_load_path
    if start and os.path.isdir(start):
        cfg.checkpoint.folder, cfg.job.dump_folder = os.path.abspath(start), "."
    else:
        cfg.checkpoint.enable = False
    cfg.checkpoint.initial_load_path = ""
    layout = validate(cfg)
    if cfg.checkpoint.enable:
        loaded = load_trained(cfg, layout, logits=True)
        model, source = loaded.built.model, loaded.source
    else:
        from torchmeg.models.args import instantiate
        torch.manual_seed(0)
        model, source = instantiate(layout.spec, layout.args, "cpu"), "a fresh init"
    model.eval()
    tok = build_tokenizer(cfg.data.tokenizer)
    prompts = open_prompts(cfg, tok)[0]
    rows = [prompts.at(i // a.generations).ids for i in range(a.prompts * a.generations)]
    s = Sampling(cfg.grpo.temperature, cfg.grpo.top_k, cfg.grpo.top_p, seed=1)
    device = torch.device("cpu")
    generate(model, tok, device, rows[:2], [0, 1], s, 4, frozenset())  # warm-up
    t0 = time.perf_counter()
    outs, _ = generate(model, tok, device, rows, list(range(len(rows))), s, a.tokens, frozenset())
    engine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [generate_alone(model, [r], a.tokens, -1, s, device, sample_index=i)[0] for i, r in enumerate(rows)]
    alone_s = time.perf_counter() - t0
    assert [o.completion for o in outs] == [g.tokens for g in alone], "the engine's tokens differ from generating alone"
    n = sum(len(o.completion) for o in outs)
    print(f"model: {cfg.model.name}/{cfg.model.flavor} from {source}; {a.prompts} prompts x {a.generations} "
          f"generations x {a.tokens} tokens ({n:,} tokens, the same on both sides)")
    print(f"rollout engine (one continuous batch): {engine_s:6.2f} s  {n / engine_s:8,.0f} tok/s")
    print(f"one sequence at a time (generate):     {alone_s:6.2f} s  {n / alone_s:8,.0f} tok/s")
    print(f"ratio: {alone_s / engine_s:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
