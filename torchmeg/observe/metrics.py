"""Honest training metrics: throughput, TFLOP/s, MFU against a named peak, real peak memory.

Peak FLOP/s (the MFU denominator) comes from torchmeg.observe.peak: datasheets for known GPUs, a probe
on an idle machine for CPUs, and the header says which.
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource

import torch


def allocated_peak_gib(device: torch.device) -> float | None:
    """On a GPU, the peak of the bytes its tensors held; None elsewhere. `memory_gib` is what the caching
    allocator reserved: that, plus the blocks it cached and split. The two apart say how much of a
    rank's peak is the allocator's own; a plan's peak (tensors' bytes) compares with this one."""
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def memory_fields(device: torch.device) -> dict:
    """A logged step's memory: `memory_gib`, and on a GPU `memory_allocated_gib` beside it."""
    allocated = allocated_peak_gib(device)
    return {"memory_gib": peak_memory_gib(device), **({} if allocated is None else {"memory_allocated_gib": allocated})}


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


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of `t` (its local shard for a DTensor)."""
    loc = _local(t)
    return loc.numel() * loc.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters + gradients + optimizer state (local shards only)."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        for t in (p, p.grad):
            if t is not None:
                n += local_bytes(t)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                n += local_bytes(v)
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
            from torch.utils.tensorboard import SummaryWriter  # (lazy: a run without tensorboard skips its import)
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
    if "moe_dropped" in r:
        s += f" | dropped {100 * r['moe_dropped']:.1f}%"
    if "mtp_loss" in r:
        s += f" | mtp_loss {r['mtp_loss']:.4f}"
    if "reward" in r:
        s += f" | reward {r['reward']:.3f} | len {r['completions/mean_length']:.0f} | rollout {r['rollout_s']:.1f} s"
    if "dpo_margin" in r:
        s += f" | margin {r['dpo_margin']:.3f} | acc {r['dpo_accuracy']:.2f}"
    if "replicas" in r:  # fault tolerance: the groups this step, discarded steps so far, a heal
        s += f" | replicas {r['replicas']}" + (f" | discarded {r['steps_discarded']}" if r["steps_discarded"] else "")
        if "sync_s" in r:  # semi-synchronous: the round's sync (pseudo-gradient all-reduce, outer step)
            s += f" | synced ({r['sync_s']:.2f} s)"
        if "heal_from" in r:
            s += f" | healed from group {r['heal_from']} ({r['heal_mib']:.1f} MiB, {r['heal_s']:.2f} s)"
    if "val_loss" in r:
        s += f" | val_loss {r['val_loss']:.4f}"
    if r.get("loss_spike"):
        s += " | LOSS SPIKE" + (" (update skipped)" if r.get("skipped") else "")
    elif r.get("skipped"):
        s += " | SKIPPED (non-finite)"
    return s
