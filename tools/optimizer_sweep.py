#!/usr/bin/env python
"""AdamW vs Muon (or any optimizer settings) on one recipe: a learning-rate sweep each, side by side.

    python tools/optimizer_sweep.py --config recipes/debug_llama.toml \
        --adamw-lr 1e-3,3e-3,1e-2 --muon-lr 3e-3,1e-2,3e-2
    python tools/optimizer_sweep.py --config recipes/gpt2_124m.toml --steps 40 \
        --adamw-lr 6e-4,2e-3 --muon-lr 6e-4,2e-3 -- --data.seq_len=128 --training.local_batch_size=4 \
        --training.global_batch_size=4 --training.mixed_precision=fp32 --lr_scheduler.warmup_steps=4

Each setting is one `python -m torchmeg.train` run of the recipe (the same seed, data and schedule;
overrides after `--` apply to all), one at a time. Printed per run: optimizer, lr, the mean training
loss of the last 10% of steps, the final validation loss, tokens/s; then each optimizer's best lr
(by validation loss, else the tail loss) and the ratio of the best losses, measured in this one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _run(config: str, name: str, lr: float, steps: int, extra: list[str], dump: str) -> dict:
    job = f"{name}_lr{lr:g}"
    cmd = [sys.executable, "-m", "torchmeg.train", "--config", config, f"--optimizer.name={name}",
           f"--optimizer.lr={lr}", f"--training.steps={steps}", f"--job.dump_folder={dump}", f"--job.name={job}",
           "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", f"--validation.freq={steps}",
           "--metrics.log_freq=1"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(dump, job, "metrics.jsonl"))]
    tail = rows[-max(1, len(rows) // 10):]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {"optimizer": name, "lr": lr, "tail_loss": sum(r["loss"] for r in tail) / len(tail),
            "val_loss": val[-1] if val else None, "tok_s": sum(r["tokens_per_sec"] for r in tail) / len(tail)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=0, help="0 = the recipe's training.steps")
    ap.add_argument("--adamw-lr", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lr", default="1e-3,3e-3,1e-2")
    ap.add_argument("--out", default="")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not args.steps:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from torchmeg.config.schema import load_config
        args.steps = load_config(args.config, extra).training.steps
    dump = args.out or tempfile.mkdtemp(prefix="optimizer_sweep_")
    results = []
    print(f"{args.config}, {args.steps} steps {' '.join(extra)}")
    print(f"{'optimizer':<10}{'lr':>9}{'loss (last 10%)':>17}{'val_loss':>10}{'tok/s':>9}")
    for name, lrs in (("adamw", args.adamw_lr), ("muon", args.muon_lr)):
        for lr in (float(x) for x in lrs.split(",") if x):
            r = _run(args.config, name, lr, args.steps, extra, dump)
            results.append(r)
            val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
            print(f"{name:<10}{lr:>9.2g}{r['tail_loss']:>17.4f}{val:>10}{r['tok_s']:>9,.0f}", flush=True)
    key = "val_loss" if all(r["val_loss"] is not None for r in results) else "tail_loss"
    best = {n: min((r for r in results if r["optimizer"] == n), key=lambda r: r[key]) for n in ("adamw", "muon")}
    for n, r in best.items():
        print(f"best {n}: lr {r['lr']:g}, {key} {r[key]:.4f}")
    print(f"muon / adamw {key} at their best lr: {best['muon'][key] / best['adamw'][key]:.3f}")
    with open(os.path.join(dump, "sweep.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
