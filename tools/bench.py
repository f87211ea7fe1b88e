#!/usr/bin/env python
"""Compile vs eager (and recompute / float8 / precision / batch) on one recipe, side by side.

    python tools/bench.py --config recipes/debug_llama.toml
    python tools/bench.py --config recipes/debug_llama.toml --compile off,on --ac none,full,selective \
        --float8 off,on --precision fp32 --batch 8,16 --steps 10 --repeats 3

One worker process per setting builds its trainer (and compiles, timed) once; the parent then runs
the settings in interleaved rounds (A B C, A B C, ...) one at a time, so drift in the machine's
speed hits every setting alike. `--one-at-a-time`: each setting's worker runs all its rounds and
exits before the next starts (models too large to hold several at once, as a 1B on one GPU).
Reported per setting: median step time, tokens/s, MFU, peak memory (the worker's VmHWM on CPU,
allocator peak on GPU), compile time (first step minus a median step), inductor kernels generated,
the loss of its last step (every setting runs the same number of steps on the same data from the
same seed, so the losses compare: float8 against bf16), and tokens/s relative to the first setting.
`--float8` takes off / on (the recipe's float8.recipe) / tensorwise / rowwise / rowwise_with_gw_hp.
Writes <out>/bench.md, bench.json and bench.png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (mp.util: the forkserver's folder, _forkserver)
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


WORKER_IMPORTS = ("torch", "torchmeg.observe.metrics", "torchmeg.train.cli", "torchmeg.train.trainer",
                  "torchmeg.train.validate")  # (what _worker imports: the fork server loads them once)


def _worker(conn, config: str, overrides: list[str], dump: str) -> None:
    import torch
    from torchmeg.observe.metrics import memory_fields
    from torchmeg.train.cli import parse_args
    from torchmeg.train.trainer import Trainer
    from torchmeg.train.validate import validate
    cfg = parse_args(["--config", config, *overrides, f"--job.dump_folder={dump}", "--metrics.jsonl=false",
                      "--metrics.enable_tensorboard=false", "--validation.enable=false",
                      "--training.steps=1000000"])
    tr = Trainer(cfg, validate(cfg))
    it = iter(tr.loader)

    last = {}

    def step() -> float:
        batches = [next(it) for _ in range(tr.layout.accum)]
        t0 = time.perf_counter()
        last["loss"] = tr.train_step(batches)[0]
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = step()
    conn.send(("ready", first))
    while True:
        cmd, arg = conn.recv()
        if cmd == "run":
            conn.send([step() for _ in range(arg)])
        elif cmd == "report":
            kernels = 0
            try:
                from torch._inductor import metrics as ind_metrics
                kernels = ind_metrics.generated_kernel_count
            except Exception:  # inductor absent or not used
                pass
            conn.send({"tokens_per_step": tr.layout.tokens_per_step, "flops_per_token": tr.flops_per_token,
                       "peak_flops": tr.peak, "peak_source": tr.peak_source,
                       **memory_fields(tr.device), "kernels": kernels, "last_loss": last["loss"]})
        else:
            tr.close()
            conn.send("bye")
            return


def settings_from(a) -> list[tuple[str, list[str]]]:
    out = []
    for comp, ac, f8, prec, batch in itertools.product(a.compile.split(","), a.ac.split(","), a.float8.split(","),
                                                       a.precision.split(","), a.batch.split(",")):
        ov = [f"--compile.enable={'true' if comp == 'on' else 'false'}", f"--activation_checkpoint.mode={ac}",
              f"--float8.enable={'false' if f8 == 'off' else 'true'}", f"--training.mixed_precision={prec}"]
        if f8 not in ("off", "on"):
            ov.append(f"--float8.recipe={f8}")
        if batch:
            ov.append(f"--training.local_batch_size={batch}")
        parts = [("compiled" if comp == "on" else "eager")]
        parts += [f"ac={ac}"] if ac != "none" else []
        parts += [] if f8 == "off" else ["float8" if f8 == "on" else f"float8 {f8}"]
        parts += [prec] if prec != "fp32" else []
        parts += [f"bs={batch}"] if batch else []
        out.append((" ".join(parts), ov))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="recipes/debug_llama.toml")
    ap.add_argument("--compile", default="off,on", help="comma list of off/on")
    ap.add_argument("--ac", default="none", help="comma list of none/full/selective")
    ap.add_argument("--float8", default="off", help="comma list of off/on/tensorwise/rowwise/rowwise_with_gw_hp")
    ap.add_argument("--precision", default="fp32", help="comma list of fp32/bf16")
    ap.add_argument("--batch", default="", help="comma list of local batch sizes ('' = the recipe's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="each setting built, timed and ended before the next (no interleaving; less memory)")
    ap.add_argument("--out", default="outputs/bench")
    ap.add_argument("overrides", nargs="*", help="extra --section.key=value for every setting")
    a, extra = ap.parse_known_args(argv)
    os.makedirs(a.out, exist_ok=True)
    dump = tempfile.mkdtemp(prefix="torchmeg-bench-")  # (the runs' own files: removed at the end)
    try:
        settings = settings_from(a)
        # Each setting's worker is forked from one server that imported torch and the trainer once, not
        # started fresh (~4 s of imports per setting on a 2-core CPU under "spawn"); the server touches no
        # device, so each worker still starts CUDA, its allocator and its compiles on its own.
        ctx = _forkserver(WORKER_IMPORTS)
        rows = []
        if a.one_at_a_time:
            for name, ov in settings:
                w = _start(ctx, name, a, ov + a.overrides + extra, dump)
                _run(w, a.warmup)
                times = [t for _ in range(a.repeats) for t in _run(w, a.steps)]
                rows.append(_finish(w, times))
                _write_json(rows, a)  # (the settings so far: a caller that stops this run keeps them)
        else:
            workers = [_start(ctx, name, a, ov + a.overrides + extra, dump) for name, ov in settings]
            for w in workers:
                _run(w, a.warmup)
            times = {w[0]: [] for w in workers}
            for r in range(a.repeats):
                for w in workers:
                    times[w[0]] += _run(w, a.steps)
                print(f"[bench] round {r + 1}/{a.repeats} done", file=sys.stderr, flush=True)
            rows = [_finish(w, times[w[0]]) for w in workers]
        write_reports(rows, a, settings[0][0])
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return 0


def _forkserver(preload):
    """multiprocessing's forkserver context, its server to import `preload`. The server listens on an
    AF_UNIX socket in a folder multiprocessing makes under TMPDIR (`multiprocessing.util.get_temp_dir`,
    made once per process), and Linux holds such a path to 107 bytes: under a deep TMPDIR (a test's own
    folder, pytest-of-<user>/pytest-<N>/popen-gw<k>/<test>/tmp: once N had three digits) the server did
    not start ("OSError: AF_UNIX path too long"). That folder is then made under the system's temporary
    root instead, before the server starts; the workers' TMPDIR is unchanged."""
    probe = os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8, "listener-" + "x" * 8)
    if len(probe.encode()) > 100 and os.path.isdir("/tmp"):
        saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
        try:
            mp.util.get_temp_dir()  # (made now, under /tmp, and kept for this process: the server's socket goes there)
        finally:
            tempfile.tempdir = saved
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def _write_json(rows, a) -> None:
    for r in rows:
        r["speedup"] = r["tokens_per_sec"] / rows[0]["tokens_per_sec"]
    with open(os.path.join(a.out, "bench.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


def _start(ctx, name, a, overrides, dump):
    """A setting's worker, built and compiled (one at a time, so compile times are not inflated by
    each other) -> (name, connection, process, first step's seconds)."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(child, a.config, overrides, dump), daemon=True)
    p.start()
    msg, first = parent.recv()
    print(f"[bench] {name}: ready, first step {first:.2f} s", file=sys.stderr, flush=True)
    return name, parent, p, first


def _run(w, steps: int) -> list[float]:
    w[1].send(("run", steps))
    return w[1].recv()


def _finish(w, times: list[float]) -> dict:
    name, conn, p, first = w
    conn.send(("report", None))
    rep = conn.recv()
    conn.send(("exit", None))
    conn.recv()
    p.join(timeout=60)
    med = statistics.median(times)
    tps = rep["tokens_per_step"] / med
    return {"setting": name, "median_step_ms": 1000 * med, "tokens_per_sec": tps,
            "mfu": tps * rep["flops_per_token"] / rep["peak_flops"], "memory_gib": rep["memory_gib"],
            "memory_allocated_gib": rep.get("memory_allocated_gib"),  # (a GPU's only)
            "compile_s": max(0.0, first - med), "kernels": rep["kernels"], "last_loss": rep["last_loss"],
            "peak_source": rep["peak_source"], "step_ms_all": [1000 * t for t in times]}


def write_reports(rows, a, base_name) -> None:
    _write_json(rows, a)
    head = ("| setting | median step (ms) | tokens/s | MFU | peak mem (GiB) | compile (s) | kernels | last loss | "
            f"vs {base_name} |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(f"| {r['setting']} | {r['median_step_ms']:.1f} | {r['tokens_per_sec']:,.0f} | {100 * r['mfu']:.1f}% | "
                   f"{r['memory_gib']:.2f} | {r['compile_s']:.1f} | {r['kernels']} | {r['last_loss']:.4f} | "
                   f"{r['speedup']:.2f}x |\n" for r in rows)
    md = (f"`python tools/bench.py --config {a.config} --compile {a.compile} --ac {a.ac} --float8 {a.float8} "
          f"--precision {a.precision}{' --batch ' + a.batch if a.batch else ''} --steps {a.steps} "
          f"--repeats {a.repeats}`\n\n{head}{body}\nMFU against {rows[0]['peak_source']}.\n")
    with open(os.path.join(a.out, "bench.md"), "w") as fh:
        fh.write(md)
    print(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: pip install -e '.[tools]' for bench.png)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(rows) + 2))
    names = [r["setting"] for r in rows]
    axes[0].barh(names, [r["tokens_per_sec"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        axes[0].text(r["tokens_per_sec"], i, f" {r['speedup']:.2f}x", va="center")
    axes[0].set_xlabel("tokens/s (median)")
    axes[1].barh(names, [r["memory_gib"] for r in rows], color="tab:orange")
    axes[1].set_xlabel("peak memory (GiB)")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(f"torchmeg bench: {os.path.basename(a.config)}")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench.png"), dpi=110)
    print(f"wrote {a.out}/bench.md, bench.json, bench.png", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
