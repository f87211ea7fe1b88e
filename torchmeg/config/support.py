"""Recipe keys that parse and validate but whose feature has not landed yet.

Each entry is (key, predicate on the config, what to do instead). Remove a line when its
feature lands; the error stays one clear line naming the key.
"""
from __future__ import annotations

import torch

from torchmeg.config.errors import ConfigError

_PENDING = [
    ("checkpoint.export_hf", lambda c: c.checkpoint.export_hf and c.model.name not in ("llama", "hf"),
     "HF export supports model.name = \"llama\" and \"hf\"; set it to false"),
]


def _value(cfg, key):
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


def check_supported(cfg, dims) -> None:
    for key, pending, instead in _PENDING:
        if pending(cfg):
            raise ConfigError(f"{key} = {_value(cfg, key)!r}: not yet supported in this version of torchmeg; {instead}")
    if cfg.checkpoint.export_hf and not cfg.checkpoint.enable:
        raise ConfigError("checkpoint.export_hf = true: needs checkpoint.enable = true")
    device = device_type(cfg)  # also refuses training.device = "cuda" where none is visible
    if cfg.parallelism.enable_async_tensor_parallel and device != "cuda":
        raise ConfigError("parallelism.enable_async_tensor_parallel = true: CUDA only (symmetric-memory "
                          "collectives); set it to false on CPU")


def device_type(cfg) -> str:
    """"cuda" or "cpu", from training.device; the one place that resolves "auto"."""
    if cfg.training.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda': no CUDA device is visible; use \"auto\" or \"cpu\"")
    return cfg.training.device
