#!/usr/bin/env python
"""Plan every shipped recipe at the world it names and print the README's table (markdown).

    python tools/plan_recipes.py [--out outputs/plans]

Runs `python -m torchmeg.plan --config recipes/X.toml --json OUT/X.json` per recipe (two at a time)
and summarises: layout, GPU, per-rank peak and what it needs with the allocator's slack, whether
it fits, the predicted step time, tokens/s per GPU and MFU, and the roofline upper bound's.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("outputs", "plans"))
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from torchmeg.config.schema import load_config
    os.makedirs(a.out, exist_ok=True)

    def one(path):
        name = os.path.basename(path)[:-5]
        world = load_config(path).plan.world_size or 1
        out = os.path.join(a.out, f"{name}.json")
        p = subprocess.run([sys.executable, "-m", "torchmeg.plan", "--config", path, "--world", str(world),
                            "--json", out], cwd=ROOT, capture_output=True, text=True)
        return name, p, out
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml")))))
    print("| recipe | world | layout | recompute | GPU | peak / need per rank (GiB) | fits | predicted step (s) | "
          "predicted tokens/s/GPU | predicted MFU | upper bound: tokens/s/GPU, MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, p, out in results:
        if p.returncode:
            print(f"| {name} | planning failed: {p.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.load(open(out))
        worst = max(r["ranks"], key=lambda x: x["need_bytes"])
        print(f"| {name} | {r['world']} | {r['layout'].split(': ', 1)[-1]} | {r['recompute']} | {r['gpu'].split()[0]} | "
              f"{worst['peak_bytes'] / 2 ** 30:.1f} / {worst['need_bytes'] / 2 ** 30:.1f} | "
              f"{'yes' if r['fits'] else 'NO'} | {r['predicted_step_s']:.3g} | "
              f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {100 * r['predicted_mfu']:.1f}% | "
              f"{r['tokens_per_s_per_gpu']:,.0f}, {100 * r['mfu']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
