"""What a checkpoint holds, as DCP Statefuls: the model's weights (all, or the base without LoRA
adapters) and the optimizer's state, each in whatever layout the run holds them (DCP reshards)."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from torchmeg.models.lora import is_adapter


def _plain(t):
    """A training wrapper (torchao's MXFP8 weight: a subclass whose `_data` holds the values) as the
    plain tensor it wraps, also as a DTensor's local shard: a checkpoint stores tensors, not subclasses
    (the plain tensor shares the wrapper's storage, so a load into it loads the parameter)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None and hasattr(local, "_data") and type(local) is not torch.Tensor:
        from torch.distributed.tensor import DTensor  # lazy: only wrapped weights get here
        return DTensor.from_local(local._data, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    if isinstance(t, torch.Tensor) and hasattr(t, "_data") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        return t._data
    if isinstance(t, dict):
        return {k: _plain(v) for k, v in t.items()}
    return t


class ModelState(Stateful):
    """The model's weights; `base_only`: without LoRA adapters (weights another run saved, which has none)."""

    def __init__(self, model, options=None, base_only: bool = False):
        self.model, self.options, self.base_only = model, options or StateDictOptions(), base_only

    def state_dict(self):
        sd = _plain(get_model_state_dict(self.model, options=self.options))
        return {k: v for k, v in sd.items() if not is_adapter(k)} if self.base_only else sd

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=not self.base_only))


class OptimizerState(Stateful):
    """The optimizer's per-parameter state (moments, momentum, step counts), keyed by parameter FQN.
    Param groups are saved for reading but never loaded: their hyper-parameters are the recipe's
    (checkpoint/resume.py) and their division follows the recipe (weight_decay_exempt, muon), so a
    resume under another grouping or another optimizer class of the same state (AdamW with float32 or
    bfloat16 states) takes the state by FQN into the groups it has now."""

    def __init__(self, model, optimizer, loading: bool = False):
        self.model, self.optimizer, self.loading = model, optimizer, loading

    def state_dict(self):
        sd = get_optimizer_state_dict(self.model, self.optimizer)
        sd["state"] = _plain(sd["state"])
        return {"state": sd["state"]} if self.loading else sd

    def load_state_dict(self, sd):
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": sd["state"], "param_groups": groups})


def optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                yield v
