"""What a checkpoint holds, as DCP Statefuls: the model's weights (all, or the base without LoRA
adapters) and the optimizer's state, each in whatever layout the run holds them (DCP reshards)."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from torchmeg.models.lora import is_adapter


class ModelState(Stateful):
    """The model's weights; `base_only`: without LoRA adapters (weights another run saved, which has none)."""

    def __init__(self, model, options=None, base_only: bool = False):
        self.model, self.options, self.base_only = model, options or StateDictOptions(), base_only

    def state_dict(self):
        sd = get_model_state_dict(self.model, options=self.options)
        return {k: v for k, v in sd.items() if not is_adapter(k)} if self.base_only else sd

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=not self.base_only))


class OptimizerState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optimizer, sd)


def optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                yield v
