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
              ranks, what a DTensor op of a TP step adds to it (sharding propagation, the parallel
              styles' hooks, in Python), measured on a real TP model (torchmeg.plan.calibrate_host)
  collectives with more than one rank (under torchrun): all-reduce, all-gather, reduce-scatter,
              all-to-all and a pipeline's send / recv by size over the default process group, the mean
              of a call (a step pays their long tail: torchmeg.plan.timing.seconds), each call made
              after a few ms of the rank's own work, through the API each layout issues it by; and how
              much of a collective hides under a matmul run beside it (torchmeg.plan.calibrate_comm)
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
import torch.nn.functional as F

from torchmeg.plan.calibrate_comm import collectives
from torchmeg.plan.calibrate_host import dtensor_op
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
    # the rotated inputs: slices of one pair of buffers made once (a pair of fresh tensors per copy, size
    # and op took 9 of this table's 22 s on this CPU, drawing 64 MiB of random numbers 99 times)
    pool = COLD_BYTES // 8 if device.type != "cuda" else 0
    xs, ys = torch.randn(pool, device=device, dtype=dtype), torch.rand(pool, device=device, dtype=dtype) + 0.5
    for name in names:
        table = Table(longest, budget / len(names))
        for n in SIZES:
            if table.full() or (device.type != "cuda" and 4 * n > COLD_BYTES):
                break  # (a CPU's last point: an operand of COLD_BYTES, DRAM's settled rate, which holds beyond)
            copies = 1 if device.type == "cuda" else max(1, min(64, COLD_BYTES // (8 * n)))
            if copies > 1:  # (copies x n <= pool)
                fns = [_memory_ops(xs[i * n:(i + 1) * n], ys[i * n:(i + 1) * n])[name] for i in range(copies)]
            else:
                fns = [_memory_ops(torch.randn(n, device=device, dtype=dtype),
                                   torch.rand(n, device=device, dtype=dtype) + 0.5)[name]]
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
        cal["subclass_s"] = dtensor_op(device, cal["dispatch_s"])
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
