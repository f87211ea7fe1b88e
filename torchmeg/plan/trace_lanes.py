"""Planning children that trace job after job of one fake world ("lanes"), for runs of many traces
(--search, a pipeline plan's ranks).

A process's first trace of a program pays for what later traces of the same shapes find ready:
torch's fake-tensor dispatch cache filled for those shapes, DTensor's and torch's first-call setup.
Measured on the 2-core AVX2 EPYC (docs/planning.md): a Llama 3 70B TP 4 x FSDP 64 trace takes 3.1-3.9 s
as a process's first and ~2.0 s after another layout of the same meshes (another local batch or
recompute), with every number of the piece equal. So a child is kept to one lane — the world size,
its rank and the parallel dims, i.e. the same fake world and meshes — and handed that lane's next
job as it finishes one; a child whose lane has no job left ends and a new one is forked for another
lane. One process is never two ranks or two worlds: DeviceMesh keeps process groups of an earlier fake
world alive in its caches (torch 2.13), and a mesh of other dims there hands out group names of a
world that is gone (seen: "Could not resolve the process group registered under the name 33").
Each trace still builds its own fake world (torchmeg.plan.fake_world), as in a child of its own.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import traceback
from multiprocessing.connection import wait
from typing import Callable

# A child's traces before it is replaced (what a long-lived child keeps between traces is caches of
# metadata, but a bound keeps a long search's children from growing without one).
MAX_TRACES_PER_CHILD = 32


def lane(run, job: tuple[int, int, int]) -> tuple:
    """The fake world job's trace runs in: world size, the traced rank (pipeline rank's first global
    rank), the parallel dims its meshes are built from."""
    dims = run.layout.dims
    return dims.world_size, job[1] * (dims.world_size // dims.pp), dims


def _serve(conn, trace: Callable) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send((job, trace(job), None))
        except Exception as e:  # noqa: BLE001 - the parent raises it (or says what it was)
            where = "raised in a planning child, at:\n" + traceback.format_exc().rstrip()
            e.add_note(where)  # (notes pickle with the exception)
            try:
                conn.send((job, None, e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send((job, None, RuntimeError(f"{type(e).__name__}: {e}\n{where}")))


class _Child:
    def __init__(self, key: tuple, trace: Callable):
        ctx = mp.get_context("fork")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs, trace), daemon=True)
        # The child inherits the parent's objects (torch's and the model's, ~300,000) frozen: its
        # collections, which a trace's allocations trigger, skip them and leave their pages shared
        # (CPython's advice for fork without exec). The parent unfreezes at once, so what it drops
        # later (a search plans many layouts) is still collected.
        gc.freeze()
        try:
            self.proc.start()
        finally:
            gc.unfreeze()
        theirs.close()
        self.key, self.job, self.traced = key, None, 0

    def give(self, job) -> None:
        self.job, self.traced = job, self.traced + 1
        self.conn.send(job)

    def close(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                kill = True
        self.proc.join(None if not kill else 0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def run_lanes(slots: int, lane_of: Callable, pick: Callable, done: Callable, trace: Callable) -> None:
    """Trace jobs on `slots` children until `pick` has none left. pick(want) -> the next job whose lane
    `want(lane)` accepts, or None; it is asked for an idle child's own lane first, then for a free slot
    a lane no child is on (so the cores work on different lanes), then any. done(job, piece) as each
    finishes. A trace's error is raised here after every child is stopped."""
    children: list[_Child] = []
    try:
        while True:
            for c in [c for c in children if c.job is None]:
                job = pick(lambda k, key=c.key: k == key) if c.traced < MAX_TRACES_PER_CHILD else None
                if job is None:
                    c.close()
                    children.remove(c)
                else:
                    c.give(job)
            while len(children) < slots:
                busy = {c.key for c in children}
                job = pick(lambda k: k not in busy)
                if job is None:
                    job = pick(lambda k: True)
                if job is None:
                    break
                c = _Child(lane_of(job), trace)
                children.append(c)
                c.give(job)
            if not children:
                return
            ready = wait([c.conn for c in children])
            for c in [c for c in children if c.conn in ready]:
                try:
                    job, piece, err = c.conn.recv()
                except EOFError:
                    c.proc.join()
                    raise RuntimeError(f"a planning child died (exit code {c.proc.exitcode}) tracing job {c.job}") from None
                if err is not None:
                    raise err
                c.job = None
                done(job, piece)
    finally:
        for c in children:
            c.close(kill=True)
