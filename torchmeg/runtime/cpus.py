"""The CPU cores this process may run on: its affinity mask (as `taskset` or a container's cpuset sets
it), or the machine's count where the OS keeps no mask (macOS). Imports nothing from torch, so the CLI
can ask before torch loads (runtime/omp_spin.py); the planner's pool and the peak-FLOP/s probe ask too."""
from __future__ import annotations

import os


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
