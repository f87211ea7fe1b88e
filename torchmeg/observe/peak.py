"""The peak FLOP/s that MFU is measured against, and how it was obtained.

GPUs: the vendors' datasheet peaks. CPUs have no such table, so the peak is a matmul probe, and a
probe is only as good as the machine was idle while it ran: one taken while other work shared the
cores once cached a third of the real peak and every later run printed an MFU twice too high.
So a probe here is several short rounds (the best is kept), each watching how much of the time its
threads were runnable they actually spent on a CPU (Linux schedstat: run time vs runqueue wait).
A probe whose threads got less than `CLEAN_SHARE` of it was contended: it is used for this run only
(and the header says so), never cached. A cached entry records when and how it was taken and is
probed again when older than `STALE_DAYS`.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from torchmeg.runtime.cpus import usable_cores

# Dense (no sparsity) bf16 peak FLOP/s from the vendors' data sheets; fp32 training uses TF32,
# half of these on Ampere/Hopper/Blackwell.
GPU_PEAK_BF16 = [
    ("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("H800", 989.4e12),
    ("B200", 2250e12), ("GB200", 2500e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362.1e12),
    ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12),
    ("MI300X", 1307.4e12), ("MI250X", 383e12),
]

SLOWER_THAN_FP32 = 4  # a low-precision run whose matmuls are this many times slower than float32's: said
CLEAN_SHARE = 0.85   # share of runnable time spent on a CPU; idle machine: 0.97-1.0 (measured here)
STALE_DAYS = 30      # a new BIOS, kernel or neighbour changes the machine; probing costs ~1 s
ROUNDS, ROUND_S = 5, 0.12


@dataclass
class Probe:
    flops: float          # best FLOP/s over the rounds
    cpu_share: float      # of the time the probe's threads were runnable, the share on a CPU; worst round
    threads: int
    n: int                # matmul size
    rounds: int
    taken: float          # unix time

    @property
    def clean(self) -> bool:
        return self.cpu_share >= CLEAN_SHARE

    def describe(self, dtype: torch.dtype) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.taken))
        return (f"{_dt(dtype)} {self.n}x{self.n} matmul, best of {self.rounds} rounds, {self.threads} "
                f"thread{'s' * (self.threads > 1)}, cpu share {100 * self.cpu_share:.0f}%, taken {when}")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(dtype: torch.dtype, device: str = "cpu", n: int = 1024, seconds: float = 0.5) -> float:
    """Best-of achieved FLOP/s of an n x n matmul in `dtype` with the current thread count."""
    return _round(device, n, seconds, *_operands(dtype, device, n))[0]


def _operands(dtype, device, n):
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernel selection, page faults
    return a, b


def _round(device, n, seconds, a, b) -> tuple[float, float]:
    """(best FLOP/s, wall time) of back-to-back matmuls for `seconds`."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        sync()
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best, time.perf_counter() - start


def probe_cpu(dtype: torch.dtype, rounds: int = ROUNDS, seconds: float = ROUND_S) -> Probe:
    # bf16 matmuls on a CPU without bf16 units run ~100x slower than fp32: a smaller probe
    # keeps the first bf16 run from spending ~10 s per rank there.
    n = 1024 if dtype == torch.float32 else 512
    threads = min(torch.get_num_threads(), usable_cores())
    a, b = _operands(dtype, "cpu", n)
    best, share = 0.0, 1.0
    for _ in range(rounds):
        c0, s0 = time.process_time(), _sched()
        flops, wall = _round("cpu", n, seconds, a, b)
        best = max(best, flops)
        s1 = _sched()
        ran, waited = (s1[0] - s0[0], s1[1] - s0[1]) if s0 is not None and s1 is not None else (0, -1)
        if ran > 0 and waited >= 0:  # (a thread that exited mid-round takes its counts along: fall back)
            got = ran / (ran + waited)
        else:  # no schedstat: CPU time against wall x threads (low too if a kernel uses fewer threads)
            got = (time.process_time() - c0) / (wall * threads)
        share = min(share, got)
    return Probe(best, min(share, 1.0), torch.get_num_threads(), n, rounds, time.time())


def _sched() -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one), summed over this process's threads
    (Linux schedstat). Waiting is the direct sign of other work on the cores; CPU time alone is
    not, since a small matmul may run on fewer threads than torch has (bf16 512 x 512 uses one)."""
    base = "/proc/self/task"
    try:
        ran = waited = 0
        for tid in os.listdir(base):
            with open(f"{base}/{tid}/schedstat") as fh:
                r, w, _ = fh.read().split()
            ran, waited = ran + int(r), waited + int(w)
        return ran, waited
    except (OSError, ValueError):
        return None


def _cache_key(dtype: torch.dtype) -> str:
    return f"{_cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def _read_table(path: str) -> dict:
    try:
        with open(path) as fh:
            table = json.load(fh)
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_peak(dtype: torch.dtype, cache_dir: str) -> float | None:
    """The peak a run already measured and cached for this CPU, thread count, dtype and torch
    (None if there is none, or it is stale): tools read it without probing."""
    p = _cached(os.path.join(cache_dir, "peak_flops.json"), dtype)
    return p.flops if p is not None else None


def _cached(path: str, dtype: torch.dtype) -> Probe | None:
    """The cached probe for this CPU, thread count, dtype and torch, if clean and fresh. Entries of
    the old format (a bare number, no record of how it was taken) are not trusted."""
    entry = _read_table(path).get(_cache_key(dtype))
    if not isinstance(entry, dict):
        return None
    try:
        p = Probe(**entry)
    except TypeError:
        return None
    if not p.clean or time.time() - p.taken > STALE_DAYS * 86400 or p.flops <= 0:
        return None
    return p


def _store(path: str, dtype: torch.dtype, p: Probe) -> None:
    """Atomically, and only a clean probe: a contended one must never become the machine's peak."""
    if not p.clean:
        return
    table = _read_table(path)
    table[_cache_key(dtype)] = asdict(p)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(table, fh, indent=1)
    os.replace(tmp, path)


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: str) -> tuple[float, str]:
    """(peak FLOP/s per rank, how that number was obtained)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bf16 in GPU_PEAK_BF16:
            if key in name:
                peak = bf16 if dtype == torch.bfloat16 else bf16 / 2
                return peak, f"{name} datasheet {'bf16' if dtype == torch.bfloat16 else 'tf32'} dense"
        peak = measure_matmul_flops(dtype, "cuda", n=8192, seconds=1.0)
        return peak, f"{name} measured matmul probe"
    path = os.path.join(cache_dir, "peak_flops.json")
    p = _cached(path, dtype)
    if p is not None:
        return p.flops, f"measured: {p.describe(dtype)}; cached in {path}" + _against_fp32(dtype, p.flops, path, False)
    p = probe_cpu(dtype)
    _store(path, dtype, p)
    if p.clean:
        return p.flops, f"measured now: {p.describe(dtype)}; cached in {path}" + _against_fp32(dtype, p.flops, path, True)
    return p.flops, (f"measured now on a BUSY machine: {p.describe(dtype)}; not cached, MFU reads high "
                     f"until a probe on an idle machine")


def _against_fp32(dtype: torch.dtype, flops: float, path: str, probing: bool) -> str:
    """For a low-precision run on a CPU: a clause when its matmuls are far slower than float32's. A CPU
    without bf16 units runs bf16 matmuls in ATen's fallback (1.1 GFLOP/s against float32's 118 on the
    2-core AVX2 EPYC: a GPT-2 124M step of 32 tokens ~7 s), which a user sees only as a slow run. The
    float32 peak is the cached one, or probed (~1 s) and cached like any other, only where this run's
    own probe just ran clean (`probing`): a machine idle enough to cache one, so neither is paid again
    (a bf16 peak cached before float32's was gets the clause once a float32 run has cached its peak)."""
    if dtype == torch.float32:
        return ""
    f32 = _cached(path, torch.float32)
    if f32 is None and probing:
        f32 = probe_cpu(torch.float32)
        _store(path, torch.float32, f32)
    if f32 is None or f32.flops < SLOWER_THAN_FP32 * flops:
        return ""
    return (f"; {_dt(dtype)} matmuls run {f32.flops / flops:.0f}x slower than float32's "
            f"({f32.flops / 1e12:.3f} TFLOP/s) on this CPU: training.mixed_precision = \"fp32\" trains faster here")


def repair_peak(achieved: float, dtype: torch.dtype, cache_dir: str) -> float:
    """A run beat the CPU peak it was given: probe again. A clean probe replaces the cached peak
    (with what the run achieved as a floor); a contended one serves this run only."""
    path = os.path.join(cache_dir, "peak_flops.json")
    p = probe_cpu(dtype)
    p.flops = max(p.flops, achieved)
    _store(path, dtype, p)
    return p.flops
