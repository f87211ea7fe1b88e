"""python -m torchmeg.eval --config RECIPE [--section.key=value ...] [--split val|all] [--steps N] [--json]

Measures the recipe's trained model (the newest committed checkpoint of its run, or
--checkpoint.load_step=N) on a token store: mean loss per token, perplexity, and bits per byte
where the tokenizer maps tokens to bytes (the byte tokenizer, byte-level BPE). --split val (the
default) is the held-out split the trainer validates on, --split all every window of the store
(e.g. another corpus: --data.dataset=PREFIX). Runs under any layout the trainer supports (the
recipe's, or --parallelism.* overrides; under torchrun for more than one process).

The samples are the trainer's: global batches of the split in order, each rank its slice, so
--steps N equal to the recipe's validation.steps reproduces the run's logged val_loss. Without
--steps, every full global batch of the split (the remainder, less than one global batch, is left
out: --training.local_batch_size=1 shrinks it).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.distributed as dist

from torchmeg.runtime import guard
from torchmeg.runtime import process as runtime
from torchmeg.train.build import ModelStep, loss_function, mean_eval_loss
from torchmeg.config.schema import load_config
from torchmeg.data.loader import build_dataset, build_loader, open_stores
from torchmeg.config.errors import ConfigError
from torchmeg.kernels.fused_ce import IGNORE
from torchmeg.inference.trained import load_trained
from torchmeg.train.validate import validate

PROG = "torchmeg.eval"


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe the model was trained with")
    ap.add_argument("--split", default="val", choices=["val", "all"], help="held-out split, or the whole store")
    ap.add_argument("--steps", type=int, default=0, help="global batches to evaluate (0 = every full one)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return ap.parse_known_args(argv)


def prepare(argv: list[str]):
    a, rest = parse(argv)
    cfg = load_config(a.config, rest)
    if a.steps < 0:
        raise ConfigError(f"--steps {a.steps}: must be >= 0 (0 = the whole split)")
    return a, cfg, validate(cfg)


def run(prepared) -> None:
    a, cfg, layout = prepared
    loaded = load_trained(cfg, layout)
    rank, mesh = dist.get_rank(), loaded.mesh
    dataset = build_dataset(cfg, open_stores(cfg, loaded.tokenizer), a.split)  # (chat windows under sft)
    full = dataset.n_unique // layout.global_batch
    steps = a.steps or full
    if steps < 1 or steps > full:
        raise ConfigError(f"--steps {a.steps}: the {a.split} split has {dataset.n_unique:,} windows = {full} full "
                          f"global batches of {layout.global_batch}; ask for 1..{full}" if full else
                          f"--split {a.split}: {dataset.n_unique} windows, fewer than one global batch of "
                          f"{layout.global_batch}; lower training.local_batch_size")
    loader = build_loader(dataset, layout.local_batch, layout.dims.dp, mesh["dp"].get_local_rank(), layout.accum,
                          0, steps)
    ms = ModelStep.of(loaded.built, layout, mesh, loaded.device, loss_function(cfg, loaded.built),
                      mesh["dp_cp"].get_group())
    t0 = time.perf_counter()
    progress = (lambda done: _progress(done, steps, time.perf_counter() - t0)) if rank == 0 else None
    loss = mean_eval_loss(ms, loader, steps, loaded.device, mesh["dp_cp"].get_group(), progress)
    if rank == 0:
        _report(a, cfg, layout, loaded, dataset, steps, loss, time.perf_counter() - t0)
    loaded = ms = None
    runtime.end()


def _progress(done: int, steps: int, seconds: float) -> None:
    """A progress bar on a terminal; a line per quarter otherwise (logs)."""
    if sys.stderr.isatty():
        bar = "#" * (30 * done // steps)
        print(f"\r{PROG}: [{bar:<30}] {done}/{steps} global batches, {seconds:.1f} s", end="", file=sys.stderr,
              flush=True)
        if done == steps:
            print(file=sys.stderr)
    elif done == steps or done * 4 // steps != (done - 1) * 4 // steps:
        print(f"{PROG}: {done}/{steps} global batches, {seconds:.1f} s", file=sys.stderr, flush=True)


def _report(a, cfg, layout, loaded, dataset, steps: int, loss: float, seconds: float) -> None:
    n_windows = steps * layout.global_batch
    tokens = n_windows * layout.seq_len
    per_token = loaded.tokenizer.token_bytes()
    bpb = None
    if per_token is not None:  # the labels' bytes: sample i's tokens depend only on (seed, i)
        table = torch.tensor(per_token + [0] * max(0, layout.args.vocab_size - len(per_token)))
        labels = [dataset[i][1] for i in range(n_windows)]
        labels = [y[y != IGNORE] for y in labels]  # masked positions carry no bytes (and are no index)
        n_bytes = sum(int(table[y].sum()) for y in labels)
        # the loss is a sum over targets divided by every position, or (sft) by the targets
        summed = tokens if cfg.training.objective != "sft" else sum(len(y) for y in labels)
        bpb = loss * summed / math.log(2) / n_bytes if n_bytes else None
    out = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "bits_per_byte": bpb, "split": a.split,
           "dataset": cfg.data.dataset, "windows": n_windows, "of_windows": dataset.n_unique, "tokens": tokens,
           "weights": loaded.source, "step": loaded.step, "layout": layout.dims.describe(), "seconds": seconds}
    if a.json:
        print(json.dumps(out), flush=True)
        return
    print(f"{PROG}: {cfg.model.name}/{cfg.model.flavor} from {loaded.source} | {layout.dims.describe()}")
    print(f"{a.split} split of {cfg.data.dataset}: {n_windows:,} of {dataset.n_unique:,} windows, {tokens:,} tokens "
          f"in {seconds:.1f} s")
    print(f"loss {loss:.4f} | perplexity {out['perplexity']:.3f}"
          + (f" | bits per byte {bpb:.4f}" if bpb is not None else " | bits per byte: n/a for this tokenizer"),
          flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return guard.cli_main(PROG, lambda: prepare(argv), run)
