"""Resuming under today's recipe: what a checkpoint says versus what the recipe asks.

* Optimizer hyper-parameters come from the recipe, not the checkpoint: loading an optimizer state
  dict overwrites its param groups, so the recipe's values are taken before the load
  (`recipe_groups`) and put back after it (`restore_groups`). The LR schedule is rebuilt from the
  recipe at the resumed step (torchmeg.train.optim.build_lr_scheduler), through the scheduler's own API.
* Recipe keys that changed since the checkpoint are reported (`changed_keys`).
* The data position: another global batch or seq_len than the checkpoint's would skip or repeat
  samples; refused unless checkpoint.remap_data_position, which continues from the same number of
  consumed tokens (`data_position`).
* LoRA adapters: the checkpoint's are the recipe's model's (`check_adapters`): DCP loads what the
  model asks for, so an adapter the recipe does not target would be dropped without a word.
"""
from __future__ import annotations

import math

import torch.distributed.checkpoint as dcp
from torch import nn

from torchmeg.config.errors import ConfigError
from torchmeg.models.blocks import canonical_fqn
from torchmeg.models.lora import adapted_module, adapters, is_adapter

# Recipe keys a resume takes from the recipe, not the checkpoint (recorded at save, compared at load).
RESUME_KEYS = {"optimizer": ("name", "lr", "weight_decay", "weight_decay_exempt", "betas", "eps", "state_dtype",
                             "muon_lr", "muon_momentum", "muon_adjust_lr"),
               "lr_scheduler": ("warmup_steps", "decay_type", "decay_steps", "decay_ratio", "min_lr_ratio"),
               "training": ("steps", "max_norm")}


# Optimizers whose states have the same entries (a checkpoint of one resumes the other).
_STATE_FAMILY = {"adamw": "adam", "adam": "adam", "sgd": "sgd", "muon": "muon"}


def check_optimizer(cfg, saved: dict, path: str) -> None:
    """Refuse, in one line, an optimizer whose state the checkpoint does not hold (e.g. adamw -> muon)."""
    was, now = (saved.get("optimizer") or {}).get("name"), cfg.optimizer.name
    if was is not None and _STATE_FAMILY.get(was) != _STATE_FAMILY.get(now):
        raise ConfigError(f"optimizer.name = {now!r}: checkpoint {path} holds the state of {was!r}, which "
                          f"{now!r} cannot resume from; resume with optimizer.name = {was!r}, or start from its "
                          f"weights with a fresh optimizer (checkpoint.initial_load_path = \"{path}\" in a new run)")


def recipe_record(cfg) -> dict:
    return {sec: {k: getattr(getattr(cfg, sec), k) for k in keys} for sec, keys in RESUME_KEYS.items()}


def recipe_groups(optimizer) -> list[dict]:
    """The optimizer's hyper-parameters per param group, as the recipe set them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_groups(optimizer, groups: list[dict]) -> None:
    """Put the recipe's hyper-parameters back after a load (the learning rate is the schedule's)."""
    for g, before in zip(optimizer.param_groups, groups):
        for k, v in before.items():
            if k not in ("lr", "initial_lr"):
                g[k] = v


def changed_keys(cfg, saved: dict, step: int) -> str | None:
    """A note naming the recipe keys that differ from the checkpoint's record, or None."""
    changed = []
    for sec, keys in RESUME_KEYS.items():
        for k in keys:
            new = getattr(getattr(cfg, sec), k)
            if sec in saved and k in saved[sec] and saved[sec][k] != new:
                changed.append(f"{sec}.{k} {saved[sec][k]} -> {new}")
    if not changed:
        return None
    return (f"resume     recipe changed since the checkpoint: {', '.join(changed)}; the recipe's values "
            f"apply from step {step + 1}")


def data_position(path: str, meta: dict, global_batch: int, seq_len: int, remap: bool) -> tuple[int, str | None]:
    """(sample offset to resume with, a note if it was remapped). Refuses another global batch /
    seq_len than the checkpoint's unless `remap`."""
    d = meta.get("data")
    step = meta.get("step", 0)
    G, L = global_batch, seq_len
    if not d:
        return 0, None
    if (d["global_batch"], d["seq_len"]) == (G, L):
        return d["next_sample"] - step * G, None
    if not remap:
        raise ConfigError(f"checkpoint {path} was trained with global batch {d['global_batch']} x seq_len "
                          f"{d['seq_len']}; the recipe has {G} x {L}: resuming would skip or repeat samples. "
                          f"Restore those values, or set checkpoint.remap_data_position = true to continue "
                          f"from the same number of tokens")
    next_sample = math.ceil(d["next_sample"] * d["seq_len"] / L)
    note = (f"resume     data position remapped by tokens: {d['next_sample']:,} samples x {d['seq_len']} "
            f"-> sample {next_sample:,} x {L} (global batch {d['global_batch']} -> {G})")
    return next_sample - step * G, note


def check_adapters(cfg, model, path: str) -> None:
    """Refuse, in one line, a checkpoint holding LoRA adapters the recipe's model lacks: [lora] off
    (the base alone would run), or other target_modules than the run that saved it (those adapters
    would be left out of the load)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {adapted_module(k[len("model."):]) for k in keys if k.startswith("model.") and is_adapter(k)}
    if saved and not cfg.lora.enable:
        raise ConfigError(f"checkpoint {path} holds LoRA adapters: set lora.enable = true with the lora.* keys it was "
                          f"trained with (else the base model alone would run)")
    # (a pipeline stage holds its own layers: only the modules this rank's model has are compared)
    held = {canonical_fqn(fqn) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    left = sorted((saved & held) - set(adapters(model)))
    if left:
        raise ConfigError(f"checkpoint {path} holds LoRA adapters on {len(left)} modules the recipe's "
                          f"lora.target_modules = {list(cfg.lora.target_modules)} does not target ({left[0]}, ...); "
                          f"set it as the run that saved them did (until 2026-11-30 the default was [\"all-linear\"])")
