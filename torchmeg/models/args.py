"""A recipe's [model] section -> the model's argument dataclass, checked; and the model built from it."""
from __future__ import annotations

import dataclasses
import difflib

import torch
from torch import nn

from torchmeg.config.schema import coerce
from torchmeg.config.errors import ConfigError
from torchmeg.models.spec import ModelSpec, get_spec, pad_vocab
from torchmeg.models.rope import ROPE_TYPES


def model_args(cfg, tokenizer_vocab: int | None = None):
    """The flavor's args with [model] overrides applied and checked; vocab from the tokenizer if -1."""
    spec = get_spec(cfg.model.name)
    if spec.make_args is not None:
        return spec.make_args(cfg, tokenizer_vocab)
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(f"model.flavor = {cfg.model.flavor!r}: unknown flavor of {spec.name}; "
                          f"allowed: {', '.join(spec.flavors)}")
    kw = dict(spec.flavors[cfg.model.flavor])
    hints = {f.name: f.type for f in dataclasses.fields(spec.args_cls)}
    defaults = spec.args_cls()
    for key, value in cfg.model.overrides.items():
        if key not in hints:
            m = difflib.get_close_matches(key, list(hints) + ["name", "flavor"], n=1)
            hint = f"did you mean '{m[0]}'?" if m else f"fields of {spec.name}: {', '.join(hints)}"
            raise ConfigError(f"unknown key 'model.{key}'; {hint}")
        ref = getattr(defaults, key)
        tp = type(ref) if ref is not None else (int if key == "n_kv_heads" else float)
        kw[key] = coerce(f"model.{key}", value, tp)
    args = spec.args_cls(**kw)
    if args.vocab_size == -1 and tokenizer_vocab is not None:
        args.vocab_size = pad_vocab(tokenizer_vocab)
    return args


def check_model_args(cfg, spec: ModelSpec, args, tokenizer_vocab: int | None) -> None:
    """The model's own shape rules, and the sequence length it can take."""
    for key in ("dim", "n_layers", "n_heads"):
        if getattr(args, key) < 1:
            raise ConfigError(f"model.{key} = {getattr(args, key)}: must be >= 1")
    if spec.make_args is None and args.dim % args.n_heads and not getattr(args, "explicit_head_dim", False):
        raise ConfigError(f"model.dim = {args.dim}: not divisible by model.n_heads = {args.n_heads}; or set "
                          f"model.head_dim")
    for key, why in (args.problems() if hasattr(args, "problems") else []):
        raise ConfigError(f"model.{key} = {getattr(args, key)!r}: {why}")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"model.n_kv_heads = {args.kv_heads}: must divide model.n_heads = {args.n_heads}")
    if hasattr(args, "rope_theta") and args.head_dim % 2:
        raise ConfigError(f"model.head_dim = {args.head_dim}: RoPE needs an even head dim")
    rope = getattr(args, "rope_type", "default")
    if rope not in ROPE_TYPES:
        raise ConfigError(f"model.rope_type = {rope!r}: unknown; allowed: {', '.join(ROPE_TYPES)}")
    if rope != "default" and args.rope_factor < 1:
        raise ConfigError(f"model.rope_factor = {args.rope_factor}: must be >= 1 with rope_type = {rope!r}")
    if rope == "llama3" and args.rope_high_freq_factor <= args.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor = {args.rope_high_freq_factor}: must exceed "
                          f"rope_low_freq_factor = {args.rope_low_freq_factor}")
    if tokenizer_vocab is not None and args.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size = {args.vocab_size}: smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens; raise it or use -1 (= tokenizer size)")
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: exceeds model.max_seq_len = {args.max_seq_len}")
    softcap = getattr(getattr(args, "config", None), "final_logit_softcapping", None)
    if cfg.training.fused_linear_cross_entropy and softcap:
        raise ConfigError(f"training.fused_linear_cross_entropy = true: this model soft-caps its logits "
                          f"(final_logit_softcapping = {softcap}), which the fused head + loss does not apply; "
                          f"set it to false")


def build_model(cfg, tokenizer_vocab: int | None, device: str | torch.device = "meta") -> nn.Module:
    """The recipe's model, whole, on `device` (meta: shapes only, no storage)."""
    return instantiate(get_spec(cfg.model.name), model_args(cfg, tokenizer_vocab), device)


def instantiate(spec: ModelSpec, args, device: str | torch.device = "meta") -> nn.Module:
    with torch.device(device):
        return spec.cls(args)
