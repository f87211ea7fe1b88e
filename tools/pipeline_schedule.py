#!/usr/bin/env python
"""Draw the pipeline schedule torch will execute, and measure its bubble.

    python tools/pipeline_schedule.py --schedule Interleaved1F1B --pp 4 --microbatches 8

The per-rank action lists come from torch itself (torch.distributed.pipelining builds them for a
schedule class; `get_schedule_ops` instantiates it with mock stages). They are then played out on
a clock: an action starts when its rank is free and its inputs exist (F(s,i) after F(s-1,i);
backward of (s,i) after its own forward and the backward of (s+1,i); W after I), with a forward of
one stage chunk = 1 unit, a full backward B = 2, its split halves I (input grad) and W (weight
grad) = 1 each. Bubble = idle time / busy time per rank, compared with the formula of Narayanan
et al. 2021 (eq. 2 and sec. 2.2): (p - 1) / (v * m) for 1F1B-style schedules with v stages per
rank (v = 1: GPipe and 1F1B, (p - 1) / m). Zero-bubble schedules fill that idle time with W.
Writes a PNG timeline (and prints the text timeline).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchmeg.parallel.pipeline_order import bubble, simulate, torch_actions  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def draw(timeline, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    end = max(e for row in timeline for _, e, *_ in row)
    fig, ax = plt.subplots(figsize=(max(8, end * 0.32), 0.7 * len(timeline) + 1.6))
    for r, row in enumerate(timeline):
        for s, e, kind, stage, mb in row:
            ax.barh(r, e - s, left=s, color=COLORS[kind], edgecolor="white", height=0.8)
            ax.text((s + e) / 2, r, f"{kind}{mb}\ns{stage}", ha="center", va="center", fontsize=6.5, color="white")
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("time (units: forward of one stage chunk = 1)")
    ax.set_title(title, fontsize=10)
    names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
    used = sorted({k for row in timeline for *_, k, _, _ in [(0, 0, x[2], 0, 0) for x in row]})
    ax.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 if len(timeline) > 2 else -0.3), ncol=len(used), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="Interleaved1F1B")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--stages-per-rank", type=int, default=None, help="default: 1 for GPipe/1F1B, else 2")
    ap.add_argument("--out", default=None, help="PNG path (default outputs/schedule_<name>_pp<P>_m<M>.png)")
    a = ap.parse_args(argv)
    single = a.schedule in ("GPipe", "1F1B")
    v = a.stages_per_rank or (1 if single else 2)
    actions = torch_actions(a.schedule, a.pp, a.microbatches, v)
    timeline = simulate(actions)
    for r, row in enumerate(timeline):
        cells, t = [], 0
        for s, e, kind, stage, mb in row:
            cells += ["  .  "] * (s - t) + [f"{kind}{mb}s{stage}".ljust(5)] * (e - s)
            t = e
        print(f"rank {r}: " + "".join(c[:5] for c in cells))
    measured = bubble(timeline)
    formula = (a.pp - 1) / (v * a.microbatches)
    print(f"\n{a.schedule}: pp={a.pp}, microbatches m={a.microbatches}, stages per rank v={v}")
    print(f"bubble (idle / busy per rank), measured on torch's action lists: {measured:.4f}")
    print(f"Narayanan et al. 2021: (p - 1) / (v * m) = ({a.pp} - 1) / ({v} * {a.microbatches}) = {formula:.4f}"
          + ("   (zero-bubble schedules use W to go below it)" if "Zero" in a.schedule or "DualPipe" in a.schedule else ""))
    out = a.out or os.path.join("outputs", f"schedule_{a.schedule}_pp{a.pp}_m{a.microbatches}.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    draw(timeline, f"{a.schedule}  pp={a.pp}  m={a.microbatches}  v={v}  bubble {measured:.3f} "
                   f"(formula (p-1)/(vm) = {formula:.3f})", out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
