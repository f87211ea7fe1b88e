"""A trained model, ready to use: built in the layout asked for and given the weights of the
recipe's newest committed checkpoint (checkpoint.load_step to pick another), whatever layout saved
them, or Hugging Face weights for `hf` models. Shared by torchmeg.generate and torchmeg.eval.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from torchmeg.runtime import process as runtime
from torchmeg.train.build import BuiltModel, build_parallel_model
from torchmeg.checkpoint.manager import load_model_weights, resolve_folder
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.config.errors import ConfigError
from torchmeg.checkpoint.hf_files import load_hf_native
from torchmeg.config.layout import Layout
from torchmeg.inference.kv_replicas import ReplicatedKVState


@dataclass
class Loaded:
    built: BuiltModel
    device: torch.device
    mesh: object
    tokenizer: object
    source: str              # where the weights came from, one line
    step: int | None         # the checkpoint's step (None: HF weights)


def load_trained(cfg, layout: Layout, logits: bool = False, kv_copies: int = 1) -> Loaded:
    """Start the process group, build this rank's model, load the trained weights into it.
    `logits`: the model ends at its LM head even where the recipe fuses the head into the loss
    (generation samples from logits). `kv_copies` > 1: the model was built with each checkpoint KV
    head replicated that many times (inference.kv_replicas: TP beyond the KV heads)."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    device, mesh, ep_mesh = runtime.start(cfg, layout.dims)
    built = build_parallel_model(cfg, layout, mesh, ep_mesh, device, cfg.job.seed, fused_head=False if logits else None)
    state = ReplicatedKVState(built.model, kv_copies) if kv_copies > 1 else None
    found = load_model_weights(cfg, built.model, tokenizer.fingerprint(), state)
    if found is not None:
        step, path = found
        source = f"checkpoint {path} (step {step})"
    else:
        folder = _hf_weights(cfg, layout)
        if folder is not None and kv_copies > 1:
            raise ConfigError("Hugging Face weights under tensor parallel beyond the model's KV heads: not supported; "
                              "launch at most n_kv_heads processes")
        if folder is None:
            raise ConfigError(f"checkpoint.folder = {cfg.checkpoint.folder!r}: no committed checkpoint in "
                              f"{resolve_folder(cfg)}; train the recipe with checkpoint.enable = true first, or "
                              f"point --checkpoint.folder at a run's checkpoint folder")
        n = load_hf_native(built.model, folder)
        step, source = None, f"Hugging Face weights in {folder} ({n} tensors)"
    built.model.eval()
    return Loaded(built, device, mesh, tokenizer, source, step)


def _hf_weights(cfg, layout: Layout) -> str | None:
    """For `hf` models without a checkpoint: checkpoint.initial_load_hf, or the model.hf_config
    folder when it holds safetensors (a downloaded model)."""
    if not layout.spec.hf_native:
        return None
    if cfg.checkpoint.initial_load_hf:
        return cfg.checkpoint.initial_load_hf
    folder = cfg.model.hf_config
    if folder and os.path.isdir(folder) and any(f.endswith(".safetensors") for f in os.listdir(folder)):
        return folder
    return None
