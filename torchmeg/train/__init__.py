"""Training: the CLI (cli.py; `python -m torchmeg.train` runs __main__.py), the recipe validated into
a Layout (validate.py), the model built and parallelized and one step's forward/backward (build.py,
shared with the planner and inference), the loop (trainer.py), its checkpointed state (state.py),
the optimizer and LR schedule (optim.py), and the loss-spike guard (spike.py).
"""
from __future__ import annotations

from torchmeg import _facade

# Each public name and the module it lives in, imported on first use (PEP 562; see torchmeg._facade).
_PUBLIC = {'main': 'torchmeg.train.cli'}
__all__ = sorted(_PUBLIC)

__getattr__ = _facade(__name__, _PUBLIC)
