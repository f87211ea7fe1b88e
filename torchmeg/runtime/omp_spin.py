"""GNU OpenMP's waiting threads on a CPU already busy when a run starts: decided before torch loads.

torch's CPU wheel links GNU OpenMP (libgomp), whose threads wait for the next parallel region by
spinning 300,000 times before they sleep. libgomp reads GOMP_SPINCOUNT once, when it loads (at
`import torch`). On a quiet CPU the spin is what starts the next region at once. On a CPU doing
other work, a thread whose partner was descheduled spends its time slices spinning. Measured on a
2-core AMD EPYC (AVX2), the default recipe's step 20, interleaved runs (docs/getting-started.md):
beside two busy processes 1,594 / 1,552 ms as is and 857 / 792 ms at 1,000 spins (1.9x faster);
quiet 452 / 457 ms as is and 492 / 483 ms at 1,000 spins (7% slower).

So `python -m torchmeg.train` sets GOMP_SPINCOUNT=1000 when the CPU is already busy as it starts:
the 1-minute load average at or above the cores this process may use (two busy processes on two
cores, where it was measured to help). It says so in one line, on each node's first rank. A user's
own GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept, and nothing is set once torch is imported, since
libgomp has read its setting by then. Where no load average exists (not Linux or macOS) nothing
changes. The load average lags by about a minute: a run started right after a busy one may be
treated as busy (7% slower at worst; set GOMP_SPINCOUNT to decide yourself).

This module imports nothing from torch; torchmeg/train/__main__.py calls it first.
"""
from __future__ import annotations

import os
import sys

from torchmeg.runtime.cpus import usable_cores

SPINS = "1000"


def spin_less_when_busy(environ=os.environ, load=None, cores: int | None = None, modules=sys.modules) -> str | None:
    """Set GOMP_SPINCOUNT in `environ` on a busy CPU -> the line to print, or None (nothing set).
    `load` and `cores` are read from the machine when not given; `modules`: what is imported."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ or "torch" in modules:
        return None
    try:
        load = os.getloadavg()[0] if load is None else load
    except (AttributeError, OSError):  # (no load average on this OS)
        return None
    if cores is None:
        cores = usable_cores()
    if load < cores:
        return None
    environ["GOMP_SPINCOUNT"] = SPINS
    return (f"torchmeg: the CPU is busy (load {load:.1f} on {cores} core{'s' if cores > 1 else ''}): "
            f"GOMP_SPINCOUNT={SPINS}, so OpenMP threads waiting for work sleep sooner (set GOMP_SPINCOUNT "
            f"yourself to choose)")


def apply(environ=os.environ, **machine) -> None:
    """For the CLI, before torch is imported: decide, and print the line on each node's first rank.
    `machine`: spin_less_when_busy's load, cores and modules (read from this process when not given)."""
    line = spin_less_when_busy(environ, **machine)
    if line and environ.get("LOCAL_RANK", "0") == "0":
        print(line, flush=True)
