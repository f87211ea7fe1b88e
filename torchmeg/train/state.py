"""TrainState: what a run has done besides its weights and optimizer state, as one Stateful.

  step            training steps completed
  sample_offset   the data position beyond step x global batch (non-zero only after a resume that
                  remapped it by tokens; sample order is a function of (seed, sample index), so the
                  loader is rebuilt from this under whatever layout resumes)
  spike           the loss-spike guard, whose history travels with the checkpoint
  RNG             identical on every rank (all ranks seed alike)

The LR schedule is not state: it is a function of (recipe, step), rebuilt from the step on resume
(torchmeg.train.optim.build_lr_scheduler). DCP saves `state_dict()` (step, RNG); `marker(step)` is what
goes into the checkpoint's torchmeg.json, readable before any tensor is loaded (the data position is
checked against the recipe first).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchmeg.train.spike import SpikeGuard


class TrainState(Stateful):
    def __init__(self, global_batch: int, seq_len: int, spike: SpikeGuard):
        self.step = 0
        self.sample_offset = 0
        self.global_batch, self.seq_len, self.spike = global_batch, seq_len, spike

    def next_sample(self, step: int | None = None) -> int:
        """The first global sample index after `step` (default: the current step)."""
        return self.sample_offset + (self.step if step is None else step) * self.global_batch

    def state_dict(self) -> dict:
        sd = {"step": torch.tensor(self.step), "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        torch.set_rng_state(sd["rng_cpu"])
        if "rng_cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng_cuda"])

    def marker(self, step: int) -> dict:
        """torchmeg.json's record of this state as of `step` (taken when the save starts)."""
        return {"data": {"global_batch": self.global_batch, "seq_len": self.seq_len,
                         "next_sample": self.next_sample(step)},
                "loss_history": self.spike.state()}
