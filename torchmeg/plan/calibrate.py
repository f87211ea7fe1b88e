"""`python -m torchmeg.plan --calibrate`: measure the device this process runs on, for the planner.

What a datasheet cannot say and the planner needs (torchmeg.plan.calibrated reads it):
  matmul      seconds of torch.mm over a grid of shapes, in the three layouts a training step runs
              (x @ W.t() forward, g @ W input gradient, g.t() @ x weight gradient), per dtype
              (float32, bfloat16; float8 through torch._scaled_mm where the GPU has it); sizes grow
              until one call takes `LONGEST` (the rate has settled by then)
  attention   torch's SDPA forward and backward by sequence length, heads and head dim, causal or not
  memory      elementwise ops and reductions by size (from cache-resident to DRAM / HBM), each by name:
              on a CPU exp / silu / a softmax run at their arithmetic's rate, far below a copy's
  dispatch    the host's cost of one eager op of a training step (forward and backward of one-element
              ops: dispatch, autograd's record and visit, a launch; no work); with
              ranks, what a DTensor op adds to it under autograd (its sharding propagation, in Python)
  collectives with more than one rank (under torchrun): all-reduce, all-gather, reduce-scatter,
              all-to-all and a pipeline's send / recv by size over the default process group, the mean
              of a call (a step pays their long tail: torchmeg.plan.timing.seconds), each call made
              after a few ms of the rank's own work, as a step makes it (step_work); through c10d
              (FSDP's, the pipeline's), the all-gather and reduce-scatter through DTensor's redistribute
              too (`dtensor/<kind>`: tensor parallel's), the all-to-all through the functional
              collective only (`functional/all_to_all`: expert / context parallel's); and how much
              of a collective hides under a matmul run beside it (FSDP's prefetch, measured, not assumed)
Each point is recorded with the FLOPs and bytes the planner's own op counter (step_cost.StepCost)
gives the op, so a plan's op is looked up by the same numbers it was measured by. Every rank measures
at once (barriers between points), as the ranks of a run share the machine; rank 0 writes the file.
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torchmeg.plan.reuse import device_cache_bytes
from torchmeg.plan.step_cost import StepCost
from torchmeg.plan.timing import BUDGET, Table, seconds
from torchmeg.runtime.process import keep_freed_memory

LONGEST = 0.05          # s: the first matmul / attention / elementwise shape this slow ends its table
ROWS = (128, 512, 2048, 8192, 32768)
# (n, k) of a weight: square, wide, tall, up to a 405B's
WEIGHTS = ((64, 64), (256, 256), (1024, 256), (256, 1024), (1024, 1024), (4096, 1024), (1024, 4096),
           (4096, 4096), (16384, 4096), (4096, 16384), (16384, 16384))
HEADS = ((8, 32), (8, 64), (16, 128))  # (heads, head dim)
SEQS = (128, 256, 512, 1024, 2048, 4096, 8192)
SIZES = tuple(4 ** i for i in range(5, 14))  # elements: 1 Ki .. 64 Mi
COMM_BYTES = tuple(4 ** i for i in range(6, 14))  # 4 KiB .. 64 MiB
GRID = sorted(((m, n, k) for m in ROWS for n, k in WEIGHTS), key=lambda s: s[0] * s[1] * s[2])  # (m, n, k), cheapest first


def counted(fn, kind_prefix: str) -> tuple[int, int]:
    """(FLOPs, bytes) of the ops of `kind_prefix` fn runs, as the planner counts them (StepCost)."""
    cost = StepCost()
    with cost:
        fn()
    ops = [op for op in cost.ops if op[3].startswith(kind_prefix)]
    return sum(op[0] for op in ops), sum(op[1] for op in ops)


def shaped(fn) -> list:
    """[FLOPs, bytes, M, N, K] of the one matmul fn runs, as StepCost counts it ("matmul@MxNxK")."""
    cost = StepCost()
    with cost:
        fn()
    (op,) = [op for op in cost.ops if op[3].startswith("matmul")]
    return [op[0], op[1], *(int(d) for d in op[3].split("@")[1].split("x"))]


def matmuls(device, dtype, longest: float, budget: float = BUDGET) -> list[list]:
    """[flops, bytes, seconds, M, N, K] per shape and layout (forward, input gradient, weight gradient: each its
    own M x N x K, K contracted), smallest first."""
    table = Table(longest, budget)
    for m, n, k in GRID:
        if table.full():
            break
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        g = torch.randn(m, n, device=device).to(dtype)
        for fn in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
            f, b, *mnk = shaped(fn)
            t = seconds(fn, device)
            table.add([f, b, t, *mnk], t)
        del x, w, g
    return table.points


def scaled_matmuls(device, longest: float, budget: float = BUDGET) -> list[list]:
    """float8 (e4m3) matmuls as torchao's training runs them (torch._scaled_mm, row-major x col-major)."""
    table = Table(longest, budget)
    one = torch.ones((), device=device)
    for m, n, k in GRID:
        if table.full():
            break
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        fn = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
        f, b, *mnk = shaped(fn)
        t = seconds(fn, device)
        table.add([f, b, t, *mnk], t)
    return table.points


def attention(device, dtype, longest: float, budget: float = BUDGET) -> dict[str, list]:
    """kind -> [flops, bytes, seconds]: SDPA forward and backward (kinds as StepCost names them), over
    sequence lengths, head shapes and batches (a kernel's rate follows the sequence length and how much
    work there is to spread over its threads or SMs, not its FLOPs alone)."""
    out: dict[str, list] = {}
    shapes = sorted(((b, s, hd) for b in (1, 8) for s in SEQS for hd in HEADS),
                    key=lambda c: c[0] * c[1] ** 2 * c[2][0] * c[2][1])
    for causal in (True, False):
        kind = "attention_causal" if causal else "attention"
        for batch in (1, 8):
            table = Table(longest, budget / 4)
            for b, s, (heads, d) in (c for c in shapes if c[0] == batch):
                if table.full():
                    break
                q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                o = fwd()
                go = torch.randn_like(o)
                bwd = lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True)  # noqa: E731
                out.setdefault(kind, []).append([*counted(fwd, kind), seconds(fwd, device)])
                out.setdefault(kind + "_backward", []).append([*counted(bwd, kind + "_backward"), seconds(bwd, device)])
                t = out[kind][-1][-1] + out[kind + "_backward"][-1][-1]
                table.add([t], t)
                del q, k, v, o, go
    return out


def _memory_ops(x, y):
    """name -> fn: the memory-bound ops measured, each named as StepCost names it. On a CPU the
    transcendental ones (exp, silu, the softmax) run at their arithmetic's rate, not memory's."""
    rows = x.view(-1, 256) if x.numel() % 256 == 0 else x.view(1, -1)
    return {"add": lambda: x + y, "mul": lambda: x * y, "clone": lambda: x.clone(), "sum": lambda: rows.sum(-1),
            "div": lambda: x / y, "pow": lambda: x.pow(2), "sqrt": lambda: y.sqrt(), "exp": lambda: x.exp(),
            "silu": lambda: F.silu(x), "silu_backward": lambda: torch.ops.aten.silu_backward(y, x),
            "_softmax": lambda: torch.softmax(rows, -1)}


COLD_BYTES = 64 * 2 ** 20  # inputs rotated over at least this much: a step's operands come from DRAM, not cache


def memory_ops(device, dtype, longest: float, budget: float = BUDGET) -> dict[str, list]:
    """name -> [bytes, seconds] per size (bytes as StepCost counts them), each op from 1 Ki elements up. Each
    call reads inputs the previous calls did not touch (rotated over COLD_BYTES, on a CPU: its caches would
    otherwise hold them), as a training step's elementwise ops read activations written long before."""
    names = _memory_ops(torch.ones(256), torch.ones(256))
    out: dict[str, list] = {}
    for name in names:
        table = Table(longest, budget / len(names))
        for n in SIZES:
            if table.full():
                break
            copies = 1 if device.type == "cuda" else max(1, min(64, COLD_BYTES // (8 * n)))
            fns = [_memory_ops(torch.randn(n, device=device, dtype=dtype),
                               torch.rand(n, device=device, dtype=dtype) + 0.5)[name] for _ in range(copies)]
            turn = itertools.cycle(fns)
            t = seconds(lambda: next(turn)(), device)
            table.add([counted(fns[0], "memory")[1], t], t)
            del fns, turn
        out[name] = table.points
    return out


def dispatch(device) -> float:
    """Host seconds per op of a training step's eager ops, where the work is nothing: a chain of 100
    one-element multiplies, forward and backward, over the ops StepCost counts in it (dispatch, the
    autograd graph's record and its engine's visit, and a launch on a GPU)."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()
    cost = StepCost()
    with cost:
        chain()
    return seconds(chain, device, 0.05) / len(cost.ops)


def subclass_op(device) -> float:
    """Host seconds a DTensor op adds to its local op in a training step (sharding propagation, the
    unwrap and rewrap, in Python, forward and backward: autograd sees the DTensor, so its backward ops
    are DTensor ops too): chains of one-element multiplies of a row-sharded DTensor, forward and
    backward, against the same chains of plain tensors, per DTensor op the planner counts in them. Two
    lengths, differenced: the chains' common tail (the sum, the backward's start) cancels. An add
    without autograd, what this measured before, costs a third of it (7 against 25 us on this CPU,
    2026-12-07), and a TP step's ops are mostly under autograd."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plain = torch.ones(2 * dist.get_world_size(), 4, device=device)
    sharded = distribute_tensor(plain, mesh, [Shard(0)])

    def timed(x, length):
        x = x.detach().requires_grad_(True)

        def chain():
            y = x
            for _ in range(length):
                y = y * 1.0001
            y.sum().backward()
        cost = StepCost()
        with cost:
            chain()
        return seconds(chain, device), sum(op[3] == "subclass" for op in cost.ops)
    (p1, _), (p2, _) = timed(plain, 25), timed(plain, 75)
    (d1, n1), (d2, n2) = timed(sharded, 25), timed(sharded, 75)
    return max(0.0, ((d2 - d1) - (p2 - p1)) / max(1, n2 - n1))


WORK_S = 0.002      # s: the work each rank does before every timed collective (a step's, between its calls)
FUNCTIONAL_MAX_BYTES = 16 * 2 ** 20  # (CPU: the functional collectives' tables end here; see collectives)
COMM_MIN_TIME = 0.05  # s: each collective's point timed over this long, its work included (>= 5 calls)


def step_work(device, seconds_: float = WORK_S):
    """A matmul chain of about `seconds_` (the same length on every rank): what a rank does between two
    of a step's collectives. A call made after it costs more than one made back to back: on this
    2-core CPU a 2 MiB gloo all-gather took 2.2 ms back to back and 2.8-3.3 ms after 1.5-22 ms of
    matmuls (the same from 1.5 ms on), a 64 KiB one 0.9 ms either way (2026-12-07, 2 ranks)."""
    x = torch.randn(256, 256, device=device)
    one = seconds(lambda: x @ x, device)
    n = torch.tensor([max(1, int(seconds_ / max(one, 1e-9)))])
    if dist.is_initialized():
        dist.all_reduce(n, op=dist.ReduceOp.MAX)

    def work():
        y = x
        for _ in range(int(n.item())):
            y = y @ x
    return work


def collectives(device, longest: float, budget: float = BUDGET) -> dict:
    """kind -> [buffer bytes, seconds] over the default group, each call timed after `step_work` (as a
    step makes it: after work, not back to back); and the fraction of a collective that hides under a
    matmul run at the same time (the overlap FSDP's prefetch counts on)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    # (all-to-all only through the functional collectives: every dimension that runs one, expert, context
    # and tensor parallel, issues it that way: calibrated.FUNCTIONAL_DIMS)
    out: dict = {"all_reduce": [], "all_gather": [], "reduce_scatter": [], "send": []}
    out.update({"dtensor/all_gather": [], "dtensor/reduce_scatter": [], "functional/all_to_all": []})
    table = Table(longest, budget)
    work = step_work(device)
    group = dist.group.WORLD
    mesh = init_device_mesh(device.type, (world,))
    for nbytes in COMM_BYTES:
        if table.full():
            break
        n = nbytes // 4
        big = torch.ones(n - n % world, device=device)
        part = torch.ones(big.numel() // world, device=device)

        def per_call(fn):  # [buffer bytes, the mean of a call: a step pays the collectives' long tail]
            return [big.numel() * 4, seconds(fn, device, COMM_MIN_TIME, mean=True, before=work)]
        out["all_reduce"].append(per_call(lambda: dist.all_reduce(big)))
        out["all_gather"].append(per_call(lambda: dist.all_gather_into_tensor(big, part)))
        out["reduce_scatter"].append(per_call(lambda: _reduce_scatter(part, big)))

        def pair():  # rank 2i sends to 2i + 1 (a pipeline's neighbours); an odd last rank waits
            if rank % 2 == 0 and rank + 1 < world:
                dist.send(big, rank + 1)
            elif rank % 2 == 1:
                dist.recv(big, rank - 1)
        out["send"].append(per_call(pair))
        t = max(p[-1][1] for p in out.values() if p)
        table.add([t], t)
        if nbytes > FUNCTIONAL_MAX_BYTES and device.type != "cuda":
            continue
        # as tensor parallel issues them: DTensor's redistribute under autograd (Shard -> Replicate gathers,
        # Partial -> Shard reduce-scatters: its Python, the functional collective's output allocated, the call
        # then its wait); a 2 MiB all-gather took 4.1-4.2 ms this way, 2.0-3.6 through the functional
        # collective alone and 1.9-2.5 through c10d on this CPU (2026-12-07, 2 ranks, after work). Expert and
        # context parallel's all-to-all through the functional collective itself. On a CPU up to
        # FUNCTIONAL_MAX_BYTES (beyond it a table's last rate holds: the calls' own cost is what differs, and
        # the 64 MiB point of these took 2 s of a calibration that must stay under a minute). Not the
        # all-reduce: tensor parallel's are the norms' and routers' small gradients, priced from c10d's table
        local, whole = part.detach().requires_grad_(True), big.detach().requires_grad_(True)
        out["dtensor/all_gather"].append(per_call(lambda: _redistributed(local, mesh, Shard(0), Replicate())))
        out["dtensor/reduce_scatter"].append(per_call(lambda: _redistributed(whole, mesh, Partial(), Shard(0))))
        out["functional/all_to_all"].append(
            per_call(lambda: funcol.wait_tensor(funcol.all_to_all_single(big, None, None, group))))
    out["overlap"] = overlap(device)
    out["after_work_s"] = WORK_S
    return out


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


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(device: torch.device, longest: float = LONGEST, budget: float = BUDGET) -> dict:
    """Every table above for `device`, measured in this process (and its peers, if any)."""
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    if not cuda:
        keep_freed_memory()  # as a CPU run does (runtime.process.start): freed activations reused
    dtypes = [torch.float32, torch.bfloat16]
    name = torch.cuda.get_device_name(device) if cuda else cpu_name()
    cal = {"device": device.type, "name": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "ranks": dist.get_world_size() if dist.is_initialized() else 1,
           "taken": datetime.datetime.now().isoformat(timespec="seconds"),
           "host_serial": not cuda,  # CPU: the host runs each op's work itself; a GPU's host runs ahead
           "dispatch_s": dispatch(device),
           "cache_bytes": device_cache_bytes(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1))),  # (plan.reuse)
           "matmul": {str(d).replace("torch.", ""): matmuls(device, d, longest, budget) for d in dtypes},
           "attention": {str(d).replace("torch.", ""): attention(device, d, longest, budget) for d in dtypes},
           "memory": memory_ops(device, torch.float32, longest, budget)}
    if cuda and torch.cuda.get_device_capability(device) >= (8, 9):
        cal["matmul"]["float8"] = scaled_matmuls(device, longest, budget)
    if cal["ranks"] > 1:
        cal["subclass_s"] = subclass_op(device)
        cal["collectives"] = collectives(device, longest * 4, budget)
    cal["seconds"] = time.perf_counter() - t0
    return cal


def calibrate_main(out: str | None, budget: float = BUDGET) -> int:
    """The CLI: measure, write (rank 0), print where and what it took."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cal = calibrate(device, budget=budget)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = out or default_path(cal["device"], cal["ranks"])
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(cal, fh)
        os.replace(tmp, path)
        best = max(p[0] / p[2] for p in cal["matmul"]["float32"])
        print(f"calibrated {cal['name']} ({cal['device']}, {cal['ranks']} rank(s) x {cal['threads']} threads) in "
              f"{cal['seconds']:.0f} s: float32 matmul up to {best / 1e12:.3f} TFLOP/s, one eager op "
              f"{cal['dispatch_s'] * 1e6:.1f} us" + (f", a DTensor op {cal['subclass_s'] * 1e6:.0f} us more"
                                                     if "subclass_s" in cal else "") + (f", a collective's overlap with compute "
                                                     f"{cal['collectives']['overlap']:.2f}" if "collectives" in cal else "")
              + f" -> {path}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def default_path(device: str, ranks: int) -> str:
    """Where a calibration is kept by default: one per device kind and ranks sharing it."""
    root = os.environ.get("TORCHMEG_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "torchmeg"))
    return os.path.join(root, f"calibration-{device}-{ranks}rank.json")
