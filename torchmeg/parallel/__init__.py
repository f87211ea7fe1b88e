"""Parallelism from PyTorch's own parts, applied to a plain model by `parallelize()` (parallelize.py):
dims.py (the mesh), tensor.py (TP/SP plans), context.py (CP attention), expert.py (EP dispatch),
data.py (FSDP2 / HSDP / DDP), pipeline.py (stages and schedules).

Public names resolve on first use (PEP 562), so importing one submodule loads only what it needs.
"""
from __future__ import annotations

from torchmeg import _facade

# Each public name and the module it lives in, imported on first use (PEP 562; see torchmeg._facade).
_PUBLIC = {'ParallelDims': 'torchmeg.parallel.dims', 'parallelize': 'torchmeg.parallel.parallelize'}
__all__ = sorted(_PUBLIC)

__getattr__ = _facade(__name__, _PUBLIC)
