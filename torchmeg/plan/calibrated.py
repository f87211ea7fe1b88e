"""A step's time from what the device was measured to do (a calibration file: torchmeg.plan.calibrate).

Per op, the rate of the measured points nearest to it, weighted by inverse squared distance (Calculon's
size-dependent efficiency, measured instead of tabulated: a 64 x 64 x 64 matmul runs at a few percent
of the best rate, a 4096-square one near it): a matmul by its shape, the three nearest in log (M, N, K);
attention (and a matmul of unknown shape) by (FLOPs, bytes) in log space, the two nearest; beyond the
largest shape measured, the nearest's rate (they have settled). A memory-bound op by its bytes, from
its own op's table (cache-resident sizes run faster than DRAM / HBM; an exp slower than a copy). Every op the step
dispatches adds the host's measured cost of one eager op: on a CPU the host does the op's work itself
(host_serial: the two add), on a GPU the host runs ahead and the step takes the longer of the two
sums. Under torch.compile a memory-bound op moves its fused bytes (torchmeg.plan.op_fusion) at a copy's
rate and keeps what its arithmetic costs beyond a copy (fusion saves traffic, not an exp's work); one
that moves nothing of its own (fused into its group's kernel) adds no dispatch. Collectives by buffer size per kind; FSDP's and
the CP ring's hide under compute as far as the measured overlap says. No fitted factor: every number
is this device's, and tools/plan_vs_run.py holds the result to the runs it plans.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
import os
from collections import Counter

from torchmeg.config.errors import ConfigError

# mesh dimensions whose collectives are functional collectives (DTensor's redistribute under tensor parallel,
# torchmeg.parallel.context and .expert): priced from the calibration's tables of them where it has one
# (tensor parallel's gathers and reduce-scatters `dtensor/<kind>`, through DTensor's redistribute; the
# all-to-all `functional/all_to_all`), else from c10d's
FUNCTIONAL_DIMS = ("tp", "cp", "ep", "ep_tp")
SHAPE_NEIGHBOURS = 3  # a shaped matmul's rate from this many measured shapes nearest in log (M, N, K)


def _rates(points: list) -> list:
    """[flops, bytes, seconds] -> ((log flops, log bytes), log FLOP/s); the layouts of one shape (same FLOPs and
    bytes: forward, input and weight gradient) as one point at their mean time, as a step runs each once."""
    by: dict = {}
    for f, b, t, *_ in points:
        if f and t:
            by.setdefault((f, b), []).append(t)
    return [((math.log(f), math.log(b)), math.log(f * len(ts) / sum(ts))) for (f, b), ts in by.items()]


def _shape_rates(points: list) -> list:
    """[flops, bytes, seconds, M, N, K] -> ((log M, log N, log K), log FLOP/s), one per shape (mean time)."""
    by: dict = {}
    for f, _, t, *mnk in points:
        if f and t and len(mnk) == 3:
            by.setdefault(tuple(mnk), []).append((f, t))
    return [(tuple(math.log(d) for d in mnk), math.log(ft[0][0] * len(ft) / sum(t for _, t in ft)))
            for mnk, ft in by.items()]


def _idw(points: list, x: tuple, k: int = 4) -> float:
    """log-rate at x from the k nearest points (each (coords, log rate)), inverse squared distance."""
    near = sorted(((sum((a - b) ** 2 for a, b in zip(c, x)), v) for c, v in points))[:k]
    if near[0][0] < 1e-12:
        return near[0][1]
    w = [1.0 / d for d, _ in near]
    return sum(wi * v for wi, (_, v) in zip(w, near)) / sum(w)


class Calibration:
    """One device's measured tables, read from `path` (what `python -m torchmeg.plan --calibrate` wrote)."""

    def __init__(self, data: dict, path: str = ""):
        self.path = path
        self.device, self.name = data["device"], data["name"]
        self.ranks, self.threads = data["ranks"], data["threads"]
        self.dispatch_s = data["dispatch_s"]
        self.subclass_s = data.get("subclass_s", 0.0)
        self.host_serial = data["host_serial"]
        # (log flops, log bytes) -> log FLOP/s, per dtype and attention kind
        self.matmul = {dt: _rates(pts) for dt, pts in data["matmul"].items()}
        # (log M, log N, log K) -> log FLOP/s: a matmul of known shape is priced by its shape's neighbours
        self.matmul_shapes = {dt: _shape_rates(pts) for dt, pts in data["matmul"].items()}
        self.attention = {dt: {kind: _rates(pts) for kind, pts in kinds.items()} for dt, kinds in data["attention"].items()}
        # op name -> (log bytes,) -> log bytes/s
        self.memory = {name: [((math.log(b),), math.log(b / t)) for b, t in sorted(pts) if b and t]
                       for name, pts in data["memory"].items()}
        # (as measured, not smoothed: gloo's all-reduce of 4-16 KiB takes ~3 ms where 64 KiB takes 0.6, and a
        # TP step's 90 small all-reduces pay it)
        self.collectives = {k: sorted(v) for k, v in data.get("collectives", {}).items()
                            if k not in ("overlap", "after_work_s")}
        self.overlap = data.get("collectives", {}).get("overlap", 1.0)
        # the last-level cache one rank has (torchmeg.plan.reuse): 0 in a calibration from before it was recorded
        self.cache_bytes = data.get("cache_bytes", 0)

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """The file at `path`, read once per version of it (a --search plans every layout from it)."""
        try:
            st = os.stat(path)
            return _read(path, (st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            raise ConfigError(f"calibration {path!r}: no such file; measure this device with `python -m torchmeg.plan "
                              f"--calibrate --out {path}` (under torchrun with as many ranks as the plan puts on "
                              f"one machine, to measure its collectives too)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"calibration {path!r}: not a calibration file ({type(e).__name__}: {e}); write it "
                              f"again with `python -m torchmeg.plan --calibrate --out {path}`") from None

    def best_rate(self, dtype: str = "float32") -> float:
        return math.exp(max(v for _, v in self.matmul[_dtype(dtype, self.matmul)]))

    def best_bandwidth(self) -> float:
        return math.exp(max(v for _, v in self.memory["add"]))

    def op_seconds(self, flops: float, nbytes: float, dtype: str | None, kind: str) -> float:
        """The device's time for one op's work (no dispatch)."""
        if kind == "memory" or not flops:
            if nbytes <= 0:
                return nbytes / self.best_bandwidth()  # (a sampled plan's byte correction: depth.combine_ops)
            table = self.memory.get(_family(dtype), self.memory["add"])
            return nbytes / math.exp(_idw(table, (math.log(nbytes),), k=2))
        if kind.startswith("matmul/"):  # a grouped matmul: G matmuls of an even share each (the plan's routing)
            groups = int(kind.split("/")[1])
            return groups * self.op_seconds(flops / groups, nbytes / groups, dtype, "matmul")
        dt = _dtype(dtype, self.matmul)
        if kind.startswith("matmul@") and self.matmul_shapes.get(dt):
            mnk = tuple(math.log(int(d)) for d in kind.split("@")[1].split("x"))
            return flops / math.exp(_idw(self.matmul_shapes[dt], mnk, k=SHAPE_NEIGHBOURS))
        x = (math.log(flops), math.log(max(nbytes, 1)))
        if kind.startswith("attention"):
            kinds = self.attention[_dtype(dtype, self.attention)]
            sibling = kind.replace("attention_causal", "attention") if "causal" in kind else \
                kind.replace("attention", "attention_causal")
            # (a kind not measured: its causal / non-causal sibling, then the forward's, then any)
            pts = next(kinds[k] for k in (kind, sibling, kind.replace("_backward", ""), sibling.replace("_backward", ""),
                                          *kinds) if kinds.get(k))
        else:
            pts = self.matmul[_dtype(dtype, self.matmul)]
        return flops / math.exp(_idw(pts, x, k=2))  # (the two nearest: leave-one-shape-out error least)

    def cold_seconds(self, cold: float, nbytes: float, dtype: str | None) -> float:
        """What `cold` bytes of a memory-bound op add when they come from beyond the cache
        (torchmeg.plan.reuse): priced at the op's table's rate for its largest size measured (streaming)
        instead of at the rate for the op's own size (the cache's, below its size)."""
        if not cold or not self.cache_bytes:
            return 0.0
        table = self.memory.get(_family(dtype), self.memory["add"])
        far = math.exp(max(table)[1])
        near = self.best_bandwidth() if nbytes <= 0 else nbytes / self.op_seconds(0, nbytes, dtype, "memory")
        return cold * max(0.0, 1.0 / far - 1.0 / near)

    def compute_seconds(self, ops, compiled: bool) -> dict[str, float]:
        """Seconds per op class (matmul, attention, memory) and the host's (dispatch) for a rank's ops."""
        out = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "dispatch": 0.0}
        for (flops, nbytes, dtype, kind, fused, cold), n in Counter(ops).items():  # (each distinct op priced once)
            if kind == "subclass":  # a tensor subclass's own host work (DTensor's sharding propagation)
                out["dispatch"] += n * self.subclass_s
                continue
            cls = "memory" if kind == "memory" or not flops else ("attention" if kind.startswith("attention") else "matmul")
            if compiled and kind == "memory" and nbytes > 0:
                # fusion saves the traffic, not the arithmetic: the fused bytes at a copy's rate, plus what
                # the op's own kind costs beyond a copy of its bytes (an exp's, a silu's)
                own = self.op_seconds(0, nbytes, dtype, kind) - self.op_seconds(0, nbytes, "add", kind)
                out[cls] += n * (self.op_seconds(0, fused, "add", kind) + max(0.0, own)
                                 + self.cold_seconds(min(cold, fused), nbytes, dtype))  # (the kernel reads them)
            else:
                out[cls] += n * (self.op_seconds(flops, nbytes, dtype, kind) + self.cold_seconds(cold, nbytes, dtype))
            if not (compiled and kind == "memory" and fused == 0) and nbytes > 0:
                out["dispatch"] += n * self.dispatch_s
        return out

    def step_compute(self, by_class: dict[str, float]) -> float:
        work = by_class["matmul"] + by_class["attention"] + by_class["memory"]
        return work + by_class["dispatch"] if self.host_serial else max(work, by_class["dispatch"])

    def comm_seconds(self, comm: dict) -> dict[str, float]:
        """'mesh dim/collective' -> seconds: each call's buffer looked up in the measured kind's table (a
        dimension whose collectives are functional ones, its kind's functional table where measured)."""
        out = {}
        for key, c in comm.items():
            dim, kind = key.split("/")[0], key.split("/")[-1]
            # (a kind not measured: an all-gather's time for its buffer, never free)
            table = ((self.collectives.get(f"dtensor/{kind}") if dim == "tp" else None)
                     or (self.collectives.get(f"functional/{kind}") if dim in FUNCTIONAL_DIMS else None)
                     or self.collectives.get("send" if kind in ("send", "recv") else kind)
                     or self.collectives.get("all_gather"))
            if not c["count"] or not table or c.get("ranks", 2) < 2:  # (a group of one rank: nothing to wait for)
                out[key] = 0.0
                continue
            if kind == "recv":  # (a pair's time is counted once, at the sender)
                out[key] = 0.0
                continue
            out[key] = c["count"] * _interp(table, c["bytes"] / c["count"])
        return out


# aten op name -> the measured op whose rate it runs at (calibrate._memory_ops); any other: "add"'s
# (a copy's bandwidth). In-place forms drop their "_".
FAMILY = {"mul": "mul", "clone": "clone", "copy": "clone", "_to_copy": "clone", "sum": "sum", "mean": "sum",
          "linalg_vector_norm": "sum", "amax": "sum", "div": "div", "reciprocal": "div", "pow": "pow",
          "sqrt": "sqrt", "rsqrt": "sqrt", "exp": "exp", "log": "exp", "sigmoid": "exp", "tanh": "exp",
          "silu": "silu", "gelu": "silu", "silu_backward": "silu_backward", "gelu_backward": "silu_backward",
          "sigmoid_backward": "silu_backward", "tanh_backward": "silu_backward", "_softmax": "_softmax",
          "_log_softmax": "_softmax", "_softmax_backward_data": "_softmax", "_log_softmax_backward_data": "_softmax",
          "_fused_rms_norm": "_softmax", "_fused_rms_norm_backward": "_softmax"}


def _family(name: str | None) -> str:
    name = (name or "add").rsplit(".", 1)[-1]
    return FAMILY.get(name, FAMILY.get(name.rstrip("_"), "add"))


def _dtype(dtype: str | None, tables: dict) -> str:
    dtype = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8", "float8_e5m2": "float8"}.get(dtype or "", dtype or "")
    if dtype.startswith("float8") and "float8" not in tables:
        dtype = "bfloat16"
    return dtype if dtype in tables else "float32"


def _interp(table: list, x: float) -> float:
    """Seconds at buffer size x, linear between the measured sizes; beyond the largest, at its rate."""
    sizes = [b for b, _ in table]
    i = bisect.bisect_left(sizes, x)
    if i == 0:
        return table[0][1]
    if i == len(table):
        b, t = table[-1]
        return t * x / b
    (b0, t0), (b1, t1) = table[i - 1], table[i]
    return t0 + (t1 - t0) * (x - b0) / (b1 - b0)


@functools.lru_cache(maxsize=8)
def _read(path: str, stamp: tuple) -> Calibration:
    """(`stamp`: the file's mtime and size, so a file written again is read again.)"""
    with open(path) as fh:
        return Calibration(json.load(fh), path)
