"""`--calibrate`'s collectives (torchmeg.plan.calibrate runs this with more than one rank, under torchrun):
each kind's seconds by buffer size over the default process group, every call timed after a few ms of the
rank's own work as a step makes it (`step_work`), each point the mean of PASSES passes over the table
(a slow spell of the machine shared by every point); through c10d (FSDP's, the pipeline's), tensor parallel's
all-gathers and reduce-scatters through DTensor's redistribute (`dtensor/<kind>`), the all-to-all through
the functional collective (`functional/all_to_all`: expert and context parallel's); and how much of a
collective hides under a matmul run beside it (`overlap`: FSDP's prefetch, measured, not assumed).
torchmeg.plan.calibrated prices a plan's collectives from these tables (FUNCTIONAL_DIMS: which mesh
dimension reads which).
"""
from __future__ import annotations

import random
import statistics

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchmeg.plan.timing import BUDGET, Table, seconds

COMM_BYTES = tuple(4 ** i for i in range(6, 14))  # 4 KiB .. 64 MiB
WORK_S = 0.002      # s: the work each rank does before every timed collective (a step's, between its calls)
FUNCTIONAL_MAX_BYTES = 16 * 2 ** 20  # (CPU: the functional collectives' tables end here; see collectives)
COMM_MIN_TIME = 0.03  # s: each collective's point timed over this long a pass, its work included (>= 5 calls)
PASSES = 3          # each point timed in this many passes over the table, spread over the whole measurement
REPEAT_BELOW = 0.05  # s: a point whose call takes less is timed again in every pass (the 64 MiB ones once)


def step_work(device, seconds_: float = WORK_S):
    """A matmul chain of about `seconds_` (the same length on every rank): what a rank does between two
    of a step's collectives. A call made after it costs more than one made back to back: on this
    2-core CPU a 2 MiB gloo all-gather took 2.2 ms back to back and 2.8-3.3 ms after 1.5-22 ms of
    matmuls (the same from 1.5 ms on), a 64 KiB one 0.9 ms either way (2026-12-07, 2 ranks)."""
    x = torch.randn(256, 256, device=device)
    one = seconds(lambda: x @ x, device)
    agreed = torch.tensor([max(1, int(seconds_ / max(one, 1e-9)))])
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    n = int(agreed.item())

    def work():
        y = x
        for _ in range(n):
            y = y @ x
    return work


def collectives(device, longest: float, budget: float = BUDGET) -> dict:
    """kind -> [buffer bytes, seconds] over the default group, each call timed after `step_work` (as a
    step makes it: after work, not back to back); and the fraction of a collective that hides under a
    matmul run at the same time (the overlap FSDP's prefetch counts on)."""
    world = dist.get_world_size()
    timed: dict = {}  # (kind, buffer bytes) -> [fn, each pass's mean seconds]
    # (all-to-all only through the functional collective: expert, context and tensor parallel's token and
    # head exchanges run that way; calibrated.FUNCTIONAL_DIMS prices theirs from it, expert parallel's
    # per-expert counts too, a small c10d all-to-all)
    c10d = ("all_reduce", "all_gather", "reduce_scatter", "send")
    out: dict = {k: [] for k in c10d + ("dtensor/all_gather", "dtensor/reduce_scatter", "functional/all_to_all")}
    table = Table(longest, budget)
    work = step_work(device)
    mesh = init_device_mesh(device.type, (world,))
    for nbytes in COMM_BYTES:
        if table.full():
            break
        size, c10d_calls, functional_calls = _calls(nbytes, device, mesh)
        for kind, fn in c10d_calls.items():  # the first pass: a call's mean (a step pays the long tail)
            timed[kind, size] = [fn, seconds(fn, device, COMM_MIN_TIME, mean=True, before=work)]
        t = max(timed[k, size][1] for k in c10d)  # (the table's stopping rule: this size's c10d calls)
        table.add([t], t)
        if nbytes > FUNCTIONAL_MAX_BYTES and device.type != "cuda":
            continue
        # (on a CPU up to FUNCTIONAL_MAX_BYTES: beyond it a table's last rate holds: the calls' own cost is
        # what differs, and the 64 MiB point of these took 2 s of a calibration that must stay under a minute)
        for kind, fn in functional_calls.items():
            timed[kind, size] = [fn, seconds(fn, device, COMM_MIN_TIME, mean=True, before=work)]
    # Later passes time each point again, in an order of their own (the same on every rank): a point is the
    # mean of its passes, so a slow spell of the machine is shared by every point instead of doubling a few
    # (one 1 MiB reduce-scatter's mean of 15 calls ranged 2.3-5.1 ms over 150 calls in one process, in runs
    # of slow and fast calls, not single outliers; 2026-12-07, 2 ranks on this CPU)
    again = [key for key, (_, t) in timed.items() if t < REPEAT_BELOW]
    for n in range(1, PASSES):
        random.Random(n).shuffle(again)
        for key in again:
            timed[key].append(seconds(timed[key][0], device, COMM_MIN_TIME, mean=True, before=work))
    for (kind, nbytes), (_, *passes) in sorted(timed.items()):
        out[kind].append([nbytes, statistics.mean(passes)])
    out["overlap"] = overlap(device)
    out["after_work_s"] = WORK_S
    return out


def _calls(nbytes: int, device, mesh) -> tuple[int, dict, dict]:
    """(the buffer's bytes: about `nbytes`, a multiple of the ranks; kind -> a call of it over that buffer,
    every rank's the same, bound to this size's own tensors: the later passes call them again): through
    c10d, and as tensor and expert parallel issue theirs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = nbytes // 4
    big = torch.ones(n - n % world, device=device)
    part = torch.ones(big.numel() // world, device=device)

    def pair():  # rank 2i sends to 2i + 1 (a pipeline's neighbours); an odd last rank waits
        if rank % 2 == 0 and rank + 1 < world:
            dist.send(big, rank + 1)
        elif rank % 2 == 1:
            dist.recv(big, rank - 1)
    c10d = {"all_reduce": lambda: dist.all_reduce(big),
            "all_gather": lambda: dist.all_gather_into_tensor(big, part),
            "reduce_scatter": lambda: _reduce_scatter(part, big), "send": pair}
    # As tensor parallel issues them: DTensor's redistribute under autograd (Shard -> Replicate gathers,
    # Partial -> Shard reduce-scatters: its Python, the functional collective's output allocated, the call
    # then its wait); a 2 MiB all-gather took 4.1-4.2 ms this way, 2.0-3.6 through the functional
    # collective alone and 1.9-2.5 through c10d on this CPU (2026-12-07, 2 ranks, after work). Expert and
    # context parallel's all-to-all through the functional collective itself. Not the all-reduce: tensor
    # parallel's are the norms' and routers' small gradients, priced from c10d's table
    local, whole = part.detach().requires_grad_(True), big.detach().requires_grad_(True)
    group = dist.group.WORLD
    functional = {"dtensor/all_gather": lambda: _redistributed(local, mesh, Shard(0), Replicate()),
                  "dtensor/reduce_scatter": lambda: _redistributed(whole, mesh, Partial(), Shard(0)),
                  "functional/all_to_all": lambda: funcol.wait_tensor(funcol.all_to_all_single(big, None, None, group))}
    return big.numel() * big.element_size(), c10d, functional


def _redistributed(local, mesh, src, dst):
    """A rank's `local` as a DTensor placed `src`, redistributed to `dst` and waited on (its local result read)."""
    out = DTensor.from_local(local, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _reduce_scatter(out, big):
    """torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor, deprecated, before)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, big)


def overlap(device) -> float:
    """1 when an all-gather of about a matmul's time runs entirely under it, 0 when they take turns."""
    x = torch.randn(1024, 1024, device=device)
    t_mm = seconds(lambda: x @ x, device)
    world = dist.get_world_size()
    n = 1024 * world
    part, big = torch.ones(n, device=device), torch.ones(n * world, device=device)
    t_ag = seconds(lambda: dist.all_gather_into_tensor(big, part), device)
    while t_ag < t_mm and n < 2 ** 26:  # an all-gather about as long as the matmul
        n *= 2
        part, big = torch.ones(n, device=device), torch.ones(n * world, device=device)
        t_ag = seconds(lambda: dist.all_gather_into_tensor(big, part), device)

    def both():
        work = dist.all_gather_into_tensor(big, part, async_op=True)
        x @ x
        work.wait()
    t_both = seconds(both, device)
    hidden = t_mm + t_ag - t_both
    return max(0.0, min(1.0, hidden / min(t_mm, t_ag)))
