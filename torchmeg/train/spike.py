"""Loss-spike guard: a step whose loss exceeds `factor` x the median of the recent steps' losses.

Large runs diverge through spikes long before anything turns NaN (Chowdhery et al. 2022, PaLM §5.1:
restart from before the spike and skip the batches around it; Megatron-LM checks for spiky loss).
The guard names the step and the global sample indices of its batch (the tokens of sample i depend
only on (data seed, i), so the batch can be read back and inspected), and by
`training.on_loss_spike` logs only, skips the update, or stops the run.

Every rank sees the same all-reduced loss, so every rank decides alike without a collective. The
history (losses of applied, non-spike steps) travels in the checkpoint, so a resumed run decides as
an uninterrupted one would.
"""
from __future__ import annotations

import statistics
from collections import deque

from torchmeg.config.errors import LossSpikeError

__all__ = ["LossSpikeError", "MIN_HISTORY", "SpikeGuard", "batch_samples"]

MIN_HISTORY = 10  # a median of fewer losses is noise; the first steps are never judged


class SpikeGuard:
    def __init__(self, factor: float, window: int, action: str):
        self.factor, self.window, self.action = factor, window, action
        self.history: deque[float] = deque(maxlen=max(window, 1))

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def check(self, loss: float) -> str | None:
        """A one-line description if `loss` is a spike against the history, else None."""
        if not self.enabled or len(self.history) < min(MIN_HISTORY, self.window):
            return None
        median = statistics.median(self.history)
        if loss > self.factor * median:
            return f"loss {loss:.4f} > {self.factor:g} x median {median:.4f} of the last {len(self.history)} steps"
        return None

    def record(self, loss: float) -> None:
        """An applied step's loss joins the history (spikes and skipped steps never do)."""
        if self.enabled:
            self.history.append(float(loss))

    def observe(self, loss: float) -> str | None:
        """A finite step's loss: judged against the history (-> the spike's description), and
        recorded in it when it is not a spike."""
        note = self.check(loss)
        if note is None:
            self.record(loss)
        return note

    def state(self) -> list[float]:
        return list(self.history)

    def load(self, losses) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in (losses or [])[-self.history.maxlen:])


def batch_samples(step: int, global_batch: int, offset: int = 0) -> tuple[int, int]:
    """The global sample indices [first, last + 1) step `step` (1-based) trains on (StepSampler)."""
    first = offset + (step - 1) * global_batch
    return first, first + global_batch
