"""How `--calibrate` times a call (torchmeg.plan.calibrate): every rank at once and the same number of
times, the median or the mean of one call, averaged over the ranks so every rank holds the same tables;
and a table's stopping rule (the first point slow enough, or its time budget spent)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

BUDGET = 10.0           # s: at most this long per table (its largest shapes left out: their rate has settled)
MIN_TIME = 0.02         # s: each point is timed over at least this long (or 5 calls)


class Table:
    """Points measured in order of cost until one takes `longest` or the table has taken `budget`, the
    budget only after `at_least` rounds (the loop's shapes begun): a loaded machine or a small budget
    still gives a table a few points to interpolate between (with `--budget 0.4` under the suite's
    load the matmul table once held only two shapes)."""

    def __init__(self, longest: float, budget: float = BUDGET, at_least: int = 3):
        self.longest, self.end, self.at_least = longest, time.perf_counter() + budget, at_least
        self.points: list = []
        self.last = 0.0  # seconds of the last point measured
        self.rounds = 0

    def add(self, point: list, seconds: float) -> None:
        self.points.append(point)
        self.last = seconds

    def full(self) -> bool:
        """Whether to stop (every rank agrees: the ranks measure together)."""
        done = (time.perf_counter() > self.end and self.rounds >= self.at_least) or self.last > self.longest
        if dist.is_initialized():
            flag = torch.tensor([float(done)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            done = bool(flag.item())
        self.rounds += not done
        return done


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def seconds(fn, device, min_time: float = MIN_TIME, mean: bool = False, before=None) -> float:
    """The median time of one call of fn (after one warm-up call), timed over >= min_time or 5 calls,
    or with `mean` the mean: what a step that makes many such calls pays where their times have a long
    tail (gloo's collectives on a CPU whose ranks fill its cores: a 4 KB all-reduce's median 0.47 ms,
    its mean 1.8 ms, a tenth of the calls over 4 ms, the scheduler's tick, measured 2026-12-07 on
    this 2-core machine; in a TP 2 step after compute the same: 1.4-1.5 ms a call on average).
    `before`, if given, runs ahead of every call, untimed (its time counts toward min_time): a call
    as a step makes it, after work of its own (calibrate_comm.collectives).
    Every rank times at once, the same number of calls; the mean over the ranks is returned."""
    _barrier()
    fn()
    _sync(device)
    t0 = time.perf_counter()
    if before is not None:
        before()
        _sync(device)
    t1 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t1, 1e-7)
    reps = max(5, min(200, int(min_time / (one + t1 - t0))))
    if dist.is_initialized():  # (every rank the same count: fn may be a collective)
        agreed = torch.tensor([reps])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        reps = int(agreed.item())
    times = []
    for _ in range(reps):
        if before is not None:
            before()
            _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.mean(times) if mean else statistics.median(times)
    if dist.is_initialized():  # the ranks' mean: every rank then holds the same tables and decisions
        across = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(across)
        t = across.item() / dist.get_world_size()
    return t
