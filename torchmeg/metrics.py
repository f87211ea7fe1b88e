"""Honest training metrics: throughput, TFLOP/s, MFU against a named peak, real peak memory.

Peak FLOP/s: a table of dense tensor-core peaks for known GPUs; anything else (every CPU) is
measured once by a short matmul probe and cached, so MFU is never against a made-up number.
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import time

import torch

# Dense (no sparsity) bf16 peak FLOP/s from the vendors' data sheets; fp32 training uses TF32,
# half of these on Ampere/Hopper/Blackwell.
GPU_PEAK_BF16 = [
    ("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("H800", 989.4e12),
    ("B200", 2250e12), ("GB200", 2500e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362.1e12),
    ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12),
    ("MI300X", 1307.4e12), ("MI250X", 383e12),
]


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
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        sync()
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: str) -> tuple[float, str]:
    """(peak FLOP/s per rank, where the number came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bf16 in GPU_PEAK_BF16:
            if key in name:
                peak = bf16 if dtype == torch.bfloat16 else bf16 / 2
                return peak, f"{name} datasheet {'bf16' if dtype == torch.bfloat16 else 'tf32'} dense"
        peak = measure_matmul_flops(dtype, "cuda", n=8192, seconds=1.0)
        return peak, f"{name} measured matmul probe"
    threads = torch.get_num_threads()
    key, path = _cache_key(dtype), os.path.join(cache_dir, "peak_flops.json")
    table = _read_table(path)
    if key not in table:
        table[key] = _probe(dtype)
        _write_table(path, table)
    dt = str(dtype).replace("torch.", "")
    return table[key], f"measured {dt} matmul probe, {threads} thread{'s' * (threads > 1)}, cached in {path}"


def _cache_key(dtype: torch.dtype) -> str:
    return f"{_cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def _probe(dtype: torch.dtype) -> float:
    # bf16 matmuls on a CPU without bf16 units run ~100x slower than fp32: a smaller probe
    # keeps the first bf16 run from spending ~10 s per rank here.
    return measure_matmul_flops(dtype, "cpu", n=1024 if dtype == torch.float32 else 512)


def _read_table(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _write_table(path: str, table: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(table, fh, indent=1)
    os.replace(tmp, path)


def repair_peak(achieved: float, dtype: torch.dtype, cache_dir: str) -> float:
    """A run beat the cached CPU peak: the probe was taken on a busy machine. Probe again and keep
    the larger of that and what the run achieved, so MFU never reads above 100% for long."""
    key, path = _cache_key(dtype), os.path.join(cache_dir, "peak_flops.json")
    peak = max(achieved, _probe(dtype))
    table = _read_table(path)
    table[key] = max(peak, table.get(key, 0.0))
    _write_table(path, table)
    return table[key]


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, the process high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2 ** 30
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 2 ** 30
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2 ** 30 if platform.system() == "Darwin" else 2 ** 20)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters + gradients + optimizer state (local shards only)."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        for t in (p, p.grad):
            if t is not None:
                loc = _local(t)
                n += loc.numel() * loc.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                loc = _local(v)
                n += loc.numel() * loc.element_size()
    return n


class MetricsLogger:
    """One line per logged step to the console, metrics.jsonl and TensorBoard (rank 0 writes)."""

    FIELDS = ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib", "elapsed_ms")

    def __init__(self, cfg, rank: int, resume_step: int = 0):
        """resume_step > 0: a resumed run. Rows after that step (logged by the run that died
        before its next checkpoint) are dropped, so every step appears once in metrics.jsonl and
        TensorBoard (purge_step)."""
        self.rank, self.cfg = rank, cfg
        self.jsonl = self.tb = None
        if rank != 0:
            return
        os.makedirs(cfg.run_dir, exist_ok=True)
        if cfg.metrics.jsonl:
            path = os.path.join(cfg.run_dir, "metrics.jsonl")
            if resume_step > 0:
                _keep_rows_upto(path, resume_step)
            self.jsonl = open(path, "a" if resume_step > 0 else "w")
        if cfg.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(cfg.run_dir, "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, row: dict, line: str | None = None) -> None:
        if self.rank != 0:
            return
        if line:
            print(line, flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def json_safe(row: dict) -> dict:
    """NaN / inf are not JSON: they are written as null (the step is marked "skipped" anyway)."""
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v
    return {k: fix(v) for k, v in row.items()}


def _keep_rows_upto(path: str, step: int) -> None:
    """Rewrite metrics.jsonl (atomically) without rows past `step`; damaged lines are dropped too."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as fh:
        for line in fh:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)


def format_line(r: dict) -> str:
    s = (f"step {r['step']:>5} | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
         f"tok/s {r['tokens_per_sec']:,.0f} | tflops {r['tflops']:.3f} | mfu {100 * r['mfu']:.1f}% | "
         f"mem {r['memory_gib']:.2f} GiB | {r['elapsed_ms']:.0f} ms")
    if "moe_imbalance" in r:
        s += f" | experts max/mean {r['moe_imbalance']:.2f}"
    if "val_loss" in r:
        s += f" | val_loss {r['val_loss']:.4f}"
    if r.get("skipped"):
        s += " | SKIPPED (non-finite)"
    return s
