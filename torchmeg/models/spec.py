"""Model registry: name -> ModelSpec (class, argument dataclass, flavors, TP plan, pipeline split).

Everything a parallelism needs to know about a model is *data* here; the model files stay plain
single-device PyTorch and hold their own flavors and TP plans. A user model plugs in with
`register(ModelSpec(...))`.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from torchmeg.config.errors import ConfigError
from torchmeg.models import deepseek_v3, gpt2, gpt_oss, hf_causal, llama, moe


@dataclass
class ModelSpec:
    name: str
    cls: type
    args_cls: type
    flavors: dict[str, dict]
    # Tensor-parallel plan as data: (module FQN pattern, role); roles are explained in
    # torchmeg.parallel.tensor. Patterns use '*' for one path component.
    tp_plan: list[tuple[str, str]] = field(default_factory=list)
    # Pipeline split: which top-level modules live on the first / last stage; `layers` is a
    # ModuleDict whose entries are divided between stages.
    pp_first: tuple[str, ...] = ("tok_embeddings",)
    pp_last: tuple[str, ...] = ("norm", "output")
    layers_attr: str = "layers"
    # Models whose shape comes from elsewhere than a flavor table (a Hugging Face config.json):
    # (cfg, padded tokenizer vocab or None) -> args. Their `tp_plan` may be a callable(model) -> plan.
    make_args: Callable | None = None
    pipeline: bool = True          # whether the pipeline split applies to this model's module tree
    context_parallel: bool = True  # whether its attention modules carry torchmeg's swappable `sdpa` kernel
    hf_native: bool = False        # parameters under Hugging Face names: HF safetensors load as they are
    head: str = "output"           # the LM head (the fused linear + cross-entropy takes its weight)


REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        m = difflib.get_close_matches(name, list(REGISTRY), n=1)
        hint = f"did you mean '{m[0]}'?" if m else f"allowed: {', '.join(sorted(REGISTRY))}"
        raise ConfigError(f"model.name = {name!r}: unknown model; {hint}")
    return REGISTRY[name]


def spec_tp_plan(spec: ModelSpec, model: nn.Module) -> list[tuple[str, str]]:
    """The registry's TP plan for this model (a list, or computed from the model itself)."""
    return spec.tp_plan(model) if callable(spec.tp_plan) else spec.tp_plan


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Tokenizer vocab rounded up so the embedding splits evenly under TP and tiles well on GPUs."""
    return (n + multiple - 1) // multiple * multiple


def _hf_args(cfg, tokenizer_vocab: int | None):
    padded = pad_vocab(tokenizer_vocab) if tokenizer_vocab is not None else None
    args = hf_causal.args_from_config(hf_causal.load_config(cfg.model.hf_config, cfg.model.overrides, padded))
    args.attn_implementation = cfg.model.hf_attn_implementation
    return args


register(ModelSpec("llama", llama.Llama, llama.LlamaArgs, llama.FLAVORS, tp_plan=llama.plan_with_qk_norm(llama.TP_PLAN)))
register(ModelSpec("gpt2", gpt2.GPT2, gpt2.GPT2Args, gpt2.FLAVORS, tp_plan=gpt2.TP_PLAN,
                   pp_first=("tok_embeddings", "pos_embeddings")))
register(ModelSpec("moe", moe.MoETransformer, moe.MoEArgs, moe.FLAVORS, tp_plan=llama.plan_with_qk_norm(moe.TP_PLAN)))
register(ModelSpec("deepseek_v3", deepseek_v3.DeepSeekV3, deepseek_v3.DeepSeekV3Args, deepseek_v3.FLAVORS,
                   tp_plan=deepseek_v3.tp_plan, pp_last=("norm", "output", "mtp")))
register(ModelSpec("gpt_oss", gpt_oss.GptOss, gpt_oss.GptOssArgs, gpt_oss.FLAVORS, tp_plan=gpt_oss.TP_PLAN))
# Any transformers causal LM from its config.json; the TP plan is the model's own
# base_model_tp_plan, translated when the model is parallelized.
register(ModelSpec("hf", hf_causal.HFCausalLM, hf_causal.HFArgs, {}, tp_plan=lambda model: model.tp_plan(),
                   make_args=_hf_args, pipeline=False, context_parallel=False, hf_native=True, head="lm_head"))
