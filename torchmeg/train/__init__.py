"""Training: the CLI (cli.py; `python -m torchmeg.train` runs __main__.py), the recipe validated into
a Layout (validate.py), the model built and parallelized and one step's forward/backward (build.py,
shared with the planner and inference), the loop (trainer.py), its checkpointed state (state.py),
the optimizer and LR schedule (optim.py), and the loss-spike guard (spike.py).
"""
from __future__ import annotations


def __getattr__(name: str):
    # lazy by design: `from torchmeg.train import main` without importing the trainer at package import
    if name == "main":
        from torchmeg.train.cli import main
        return main
    raise AttributeError(f"module 'torchmeg.train' has no attribute {name!r}")
