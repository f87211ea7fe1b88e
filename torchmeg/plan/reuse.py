"""Which bytes a memory-bound op reads from DRAM rather than from the last-level cache: reuse distance.

A calibration prices a memory-bound op by its bytes from a table measured on buffers the op itself keeps
warm (torchmeg.plan.calibrate repeats it on the same tensors): the cache's rate up to the cache's size.
In a training step the backward reads what the forward saved long before, and those bytes come from
DRAM. Measured on this 2-core EPYC (32 MiB L3), debug_llama's SwiGLU multiply on [8, 256, 704] fp32:
0.33-0.41 ms in the forward (its operands were just written: ~45 GB/s), 1.4-1.7 ms in the backward of
every layer but the last (~11 GB/s, the table's rate at 800 MB), 0.35 ms in the last layer's backward
(its activations still cached); silu_backward alike (1.9 vs 0.5 ms). The calibration's memory tables
priced all of them warm, and the step's memory-bound ops came out at 28 ms planned against 67 measured.

So the dry run keeps a clock of the bytes the step has moved and, per storage, when it was last touched;
an op's input counts as cold when more than the cache's size of traffic has passed since (or it was never
touched in this trace: optimizer state, read once a step). The op carries its cold bytes, which a
calibration with the device's cache size (`cache_bytes`: a CPU's last level shared by the ranks on it, a
GPU's L2) prices at its table's rate for the largest size measured (DRAM / HBM streaming). The clock
runs per traced job, across the StepCosts of one trace (a pipeline stage's are several).

Why our own: torch's cost models (the inductor's estimator, RuntimeEstimator) price an op alone.
"""
from __future__ import annotations

import contextlib
import glob
import os

import torch

from torchmeg.plan.memory import tensors
from torchmeg.plan.op_fusion import storage_key

_ACTIVE: list = []


class ReuseDistance:
    def __init__(self, cache_bytes: int):
        self.cache = cache_bytes
        self.clock = 0
        self.last: dict = {}  # storage -> the clock when an op last read or wrote it

    def touch(self, inputs: list, outputs: list, nbytes: int) -> int:
        """An op reading `inputs` and writing `outputs` (`nbytes` in all) -> its inputs' cold bytes."""
        cold, seen = 0, set()
        for t in inputs:
            key = storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            at = self.last.get(key)
            if at is None or self.clock - at > self.cache:
                cold += t.numel() * t.element_size()
        self.clock += nbytes
        for t in (*inputs, *outputs):
            self.last[storage_key(t)] = self.clock
        return cold


@contextlib.contextmanager
def reuse_distances(cache_bytes: int):
    """Ops traced inside carry their cold bytes (none without a cache size: every op priced warm)."""
    if not cache_bytes:
        yield
        return
    _ACTIVE.append(ReuseDistance(cache_bytes))
    try:
        yield
    finally:
        _ACTIVE.pop()


def device_cache_bytes(device: torch.device, ranks: int) -> int:
    """The last-level cache one rank has: a GPU's L2; a CPU's largest cache level as Linux lists it for
    CPU 0, shared by the `ranks` on this machine (0 where neither says)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    best = (0, 0)
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as fh:
                level = int(fh.read())
            with open(os.path.join(index, "size")) as fh:
                size = fh.read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(size[-1:], 1)
        best = max(best, (level, int(size.rstrip("KMG")) * unit))
    return best[1] // max(1, ranks)


def cold_bytes(args, out, nbytes: int) -> int:
    """An op's (args, output) moving `nbytes`: its inputs' cold bytes (0, and nothing walked, when no
    reuse_distances is active)."""
    return _ACTIVE[-1].touch(list(tensors(list(args))), list(tensors(out)), nbytes) if _ACTIVE else 0
