"""Parallelism from PyTorch's own parts, applied to a plain model by `parallelize()` (parallelize.py):
dims.py (the mesh), tensor.py (TP/SP plans), context.py (CP attention), expert.py (EP dispatch),
data.py (FSDP2 / HSDP / DDP), pipeline.py (stages and schedules).

Public names resolve on first use (PEP 562), so importing one submodule loads only what it needs.
"""
from __future__ import annotations


def __getattr__(name: str):
    # Each import below is lazy by design (see the docstring).
    if name == "ParallelDims":
        from torchmeg.parallel.dims import ParallelDims
        return ParallelDims
    if name == "parallelize":
        from torchmeg.parallel.parallelize import parallelize
        return parallelize
    raise AttributeError(f"module 'torchmeg.parallel' has no attribute {name!r}")
