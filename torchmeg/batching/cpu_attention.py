"""Paged decode attention on a CPU (vLLM's PagedAttention, its CPU kernel): `torchmeg::paged_decode_attention`,
a custom op whose kernel (cpu_attention.cpp beside this file) is built at its first use.

The static decode step (batching.static_decode) calls it on a CPU, inside its compiled graph: each
query row reads only its own positions, through its block table, straight from the pools; one pass
over its keys (a dot product a position, vectorized over the head dimension), a softmax, one pass
over its values. FlexAttention's CPU template, which the step ran before and falls back to, runs a
decode 16 positions at a time with two GEMM calls and a softmax update each; on the 2-core CPU of
docs/generation.md the kernel took the 16-layer step at 32 rows from 4.23 to 3.11 ms (same process,
alternating; 6.88 to 5.03 in a slow hour). No library offers this for torch's current releases (vLLM's
CPU kernels live in its own binary; Intel's extension pins old torch releases), so it is ours: ~140
lines of C++.

Built with torch.utils.cpp_extension (a C++ compiler, as inductor on a CPU needs, and ninja: the test and
serve extras install it) into its build folder (TORCH_EXTENSIONS_DIR, else the user's cache), once per
machine and instruction set (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2 or the compiler's
default; a name per set, so no build runs on a CPU without it): ~10-25 s on a 2-core CPU, a load after.
Where the build fails, `load()` says why in one warning and the step keeps FlexAttention.

The schema and the fake (shape) function are defined here at import, so a graph can be traced with
the op before its kernel is built; calling it on a CPU tensor without the kernel raises.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger("torchmeg.serve")

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
OP = "torchmeg::paged_decode_attention"

torch.library.define(
    OP, "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor starts, float scale, int block) -> Tensor")


@torch.library.register_fake(OP)
def _shape(q, k_pool, v_pool, tables, starts, scale, block):
    return torch.empty_like(q)


# the instruction set -> (the C++ macro at::vec picks its Vectorized by, the compiler's flags)
_ISA = {"AVX512": (["-DCPU_CAPABILITY_AVX512"], ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]),
        "AVX2": (["-DCPU_CAPABILITY_AVX2"], ["-mavx2", "-mfma", "-mf16c"])}

_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "why": the failure


def load() -> bool:
    """Build (once per machine and instruction set) and load the kernel -> whether it is there. A
    failure (no compiler, no ninja, a build error) is one warning naming it; the caller keeps its
    fallback. Tried once per process."""
    with _lock:
        if "ok" not in _state:
            try:
                _build()
                _state["ok"] = True
            except Exception as e:  # noqa: BLE001 - any build or load failure: the fallback runs
                lines = str(e).strip().splitlines()
                _state["ok"], _state["why"] = False, f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"
                log.warning("the CPU paged attention kernel was not built (%s): the static decode step uses "
                            "FlexAttention", _state["why"])
        return _state["ok"]


def why_not() -> str:
    """Why the kernel is not there ('' when it is, or was not tried)."""
    return _state.get("why", "")


def _build() -> None:
    from torch.utils import cpp_extension  # lazy: loads the build machinery only when a step needs the kernel
    isa = torch.backends.cpu.get_cpu_capability()
    macros, flags = _ISA.get(isa, ([], []))
    if shutil.which("ninja") is None:  # ninja from PyPI (the test and serve extras), its bin not on PATH
        try:
            import ninja  # lazy: optional
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    # (is_python_module=False: the library registers its kernel with the dispatcher as it loads)
    cpp_extension.load(name=f"torchmeg_paged_decode_{isa.lower()}", sources=[str(SOURCE)],
                       extra_cflags=["-O3", "-fopenmp", *macros, *flags], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           starts: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """q [R, H, D]; pools [K, P, D]; tables [R, W] and starts [R] int64 -> [R, H, D]: row r's attention
    over its positions 0 .. starts[r], read through its table of `block`-position blocks."""
    return torch.ops.torchmeg.paged_decode_attention(q, k_pool, v_pool, tables, starts, scale, block)
