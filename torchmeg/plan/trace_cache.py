"""A plan's traces kept in a folder (plan.trace_cache = DIR; off by default), so a plan that traces
the same program again reads them instead of tracing: the same recipe for another GPU, with async TP
or compile on or off, a search after a plan, the same plan later in the day.

The key is what a trace depends on: the code that traces (a hash of every torchmeg source file, the
source file of a model class from outside torchmeg, the versions of torch, torchao and transformers),
the traced program (traced_program: the recipe as the dry run traces it and the layout), the pipeline
rank and the trace itself (the layers it keeps, their split, the stages it leaves to another trace).
Left out, because no trace reads them: the GPU and the rest of [plan] but the cache size the ops'
reuse distances are judged by (the GPU enters only the time model; trace_layers decides the traces and
the stages left, which are in the key), async TP (an inductor pass: the build on a fake world runs the
same eager ops, and the time model reads the flag from the recipe) and compile and float8 emulation (the
dry run traces eager, the GPU's float8 kernels: torchmeg.plan.dry_run.prepare sets both before anything
is keyed).
A file that cannot be read is a miss, never an error; a piece is written to a temporary file and
renamed, so plans running side by side (CI's workers) never read half of one.

Why our own: torch's caches (inductor's, FakeTensor's dispatch cache) key compiled code or one op;
nothing in torch keeps the result of a whole traced step.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import os
import pickle
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the torchmeg package


@functools.lru_cache(maxsize=None)
def code_version(model_file: str | None) -> str:
    """A hash of the code a trace runs: torchmeg's sources, a model file of the user's, the libraries."""
    h = hashlib.sha256()
    for folder, subfolders, files in os.walk(_ROOT):
        subfolders.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, _ROOT).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    if model_file is not None and not os.path.abspath(model_file).startswith(_ROOT + os.sep):
        with open(model_file, "rb") as f:
            h.update(f.read())
    for dist in ("torch", "torchao", "transformers"):
        try:
            h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist} absent".encode())
    return h.hexdigest()


def traced_program(run) -> str:
    """What a dry run's traces depend on: the recipe and the layout, with a pipeline's batch as the
    microbatches its stages run (their count and size), not how local batch and accumulation make them."""
    cfg, lay = copy.deepcopy(run.cfg), run.layout
    if lay.stages is not None:
        cfg.training.local_batch_size = cfg.training.global_batch_size = 0
        cfg.parallelism.pipeline_parallel_microbatches = 0
        batch = (lay.local_batch * lay.accum // lay.stages.microbatches, lay.stages)
    else:
        batch = (lay.local_batch, lay.accum)
    return repr((cfg, lay.world_size, lay.dims, lay.seq_len, batch, lay.rows_per_sample, lay.loss_parallel,
                 [(t.keep and sorted(t.keep), t.coeff) for t in run.traces]))


def job_key(run, job: tuple[int, int, int]) -> str:
    """The key of one job (plan key, pipeline rank, trace) of a prepared dry run."""
    cfg = copy.deepcopy(run.cfg)
    cfg.plan = type(cfg.plan)(gpu="cpu" if run.cfg.plan.gpu == "cpu" else "h100",  # (the program: a CPU's or a GPU's)
                              cache_bytes=run.cfg.plan.cache_bytes)  # (which bytes the ops read cold: plan.reuse)
    cfg.parallelism.enable_async_tensor_parallel = False
    try:
        model_file = inspect.getsourcefile(run.layout.spec.cls)
    except TypeError:  # (a class without a source file: its name and module are in the recipe already)
        model_file = None
    _, pp_rank, i = job
    t = run.traces[i]  # (its sets in order: a set of strings prints in another order in every process)
    trace = (t.keep and sorted(t.keep), t.stage_layers, t.coeff, t.stages and sorted(t.stages), t.work)
    # (the stages this rank reads from another trace are left out of its piece: dry_run.DryRun.reads)
    what = repr((code_version(model_file), traced_program(dataclasses.replace(run, cfg=cfg)), pp_rank, trace,
                 run.read_stages(job)))
    return hashlib.sha256(what.encode()).hexdigest()


def _path(folder: str, key: str) -> str:
    return os.path.join(folder, key[:2], key + ".pickle")


def load(folder: str, key: str):
    """The piece kept under `key`, or None."""
    try:
        with open(_path(folder, key), "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - absent, half-written by a killed plan, an older format: trace again
        return None


def store(folder: str, key: str, piece) -> None:
    path = _path(folder, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(piece, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
