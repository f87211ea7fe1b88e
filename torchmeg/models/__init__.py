"""Model registry: name -> (args dataclass, class, flavors, TP plan, pipeline split).

Everything a parallelism needs to know about a model is *data* here; the model files stay plain
single-device PyTorch. A user model plugs in with `register(ModelSpec(...))`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from torchmeg.models.gpt2 import GPT2, GPT2Args
from torchmeg.models.llama import Llama, LlamaArgs
from torchmeg.models.moe import MoEArgs, MoETransformer, is_grouped_experts


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
    # (cfg, tokenizer vocab or None) -> args. Their `tp_plan` may be a callable(model) -> plan.
    make_args: Callable | None = None
    pipeline: bool = True  # whether the pipeline split applies to this model's module tree


# Shared shape of the decoder plans: vocab-sharded embedding, column-parallel q/k/v and up
# projections, row-parallel out/down projections (Megatron-LM, Shoeybi et al. 2019, sec. 3),
# sequence-parallel norms (Korthikanti et al. 2022) and a vocab-parallel output.
_DECODER_TP = [
    ("layers.*.attention_norm", "sp_norm"),
    ("layers.*.attention", "sp_input"),
    ("layers.*.attention.wq", "colwise"),
    ("layers.*.attention.wk", "colwise"),
    ("layers.*.attention.wv", "colwise"),
    ("layers.*.attention.wo", "rowwise"),
    ("layers.*.ffn_norm", "sp_norm"),
    ("layers.*.feed_forward", "sp_input"),
    ("layers.*.feed_forward.w1", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    ("layers.*.feed_forward.w3", "colwise"),
    ("norm", "sp_norm"),
    ("output", "output"),
]

_LLAMA3_VOCAB = 128256
LLAMA_FLAVORS = {
    "debug": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64, rope_theta=10000.0,
                  max_seq_len=2048),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               vocab_size=_LLAMA3_VOCAB, tie_embeddings=True, max_seq_len=131072),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
               vocab_size=_LLAMA3_VOCAB, max_seq_len=131072),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                vocab_size=_LLAMA3_VOCAB, max_seq_len=131072),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                 vocab_size=_LLAMA3_VOCAB, max_seq_len=131072),
}

_GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
GPT2_FLAVORS = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, max_seq_len=1024),
    "124M": dict(dim=768, n_layers=12, n_heads=12, vocab_size=_GPT2_VOCAB),
    "350M": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=_GPT2_VOCAB),
    "774M": dict(dim=1280, n_layers=36, n_heads=20, vocab_size=_GPT2_VOCAB),
    "1.5B": dict(dim=1600, n_layers=48, n_heads=25, vocab_size=_GPT2_VOCAB),
}

MOE_FLAVORS = {
    # CPU-sized: 8 experts, top-2, one shared expert, aux-loss-free balancing (DeepSeek-V3 style;
    # its bias step is 10x DeepSeek's 1e-3 so balance shows within a 150-step run).
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, rope_theta=10000.0,
                  max_seq_len=2048, n_experts=8, top_k=2, moe_hidden=128, n_shared_experts=1,
                  score_func="sigmoid", balance="bias", bias_update_rate=0.01, n_dense_layers=1),
    "mixtral-8x7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, rope_theta=1e6,
                         max_seq_len=32768, n_experts=8, top_k=2, moe_hidden=14336, score_func="softmax",
                         balance="aux_loss", aux_loss_coef=0.02, multiple_of=1024, ffn_dim_multiplier=1.3),
    # DeepSeek-V3's MoE shape (256 routed + 1 shared expert, top-8, sigmoid scores, aux-loss-free,
    # 3 dense layers) on GQA attention — torchmeg has no MLA, hence "-like".
    "deepseek-v3-like": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                             rope_theta=10000.0, max_seq_len=163840, n_experts=256, top_k=8, moe_hidden=2048,
                             n_shared_experts=1, score_func="sigmoid", balance="bias", n_dense_layers=3,
                             multiple_of=256, ffn_dim_multiplier=3.86),
}

REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    REGISTRY[spec.name] = spec
    return spec


register(ModelSpec("llama", Llama, LlamaArgs, LLAMA_FLAVORS,
                   tp_plan=[("tok_embeddings", "embedding")] + _DECODER_TP))
# GPT-2 adds learned positions to the embedding output outside any module, so its embedding
# stays replicated and the first block re-shards the sequence.
register(ModelSpec("gpt2", GPT2, GPT2Args, GPT2_FLAVORS,  # (its MLP has no gate projection w3)
                   tp_plan=[("tok_embeddings", "embedding_replicate"), ("layers.0", "sp_enter")]
                   + [e for e in _DECODER_TP if not e[0].endswith(".w3")],
                   pp_first=("tok_embeddings", "pos_embeddings")))


# MoE: attention and dense FFNs as in Llama; the routed block's input is gathered and its output
# re-sharded, so experts stay whole on every TP rank (their parallelism is EP).
register(ModelSpec("moe", MoETransformer, MoEArgs, MOE_FLAVORS,
                   tp_plan=[("tok_embeddings", "embedding")] + _DECODER_TP + [("layers.*.moe", "sp_replicated")]))


def _hf_args(cfg, tokenizer_vocab):
    from torchmeg.models.hf_causal import args_from_config, load_config
    args = args_from_config(load_config(cfg.model.hf_config, cfg.model.overrides, tokenizer_vocab))
    args.attn_implementation = cfg.model.hf_attn_implementation
    return args


def _hf_model(args):
    from torchmeg.models.hf_causal import HFCausalLM
    return HFCausalLM(args)


# Any transformers causal LM from its config.json (torchmeg.models.hf_causal); the TP plan is the
# model's own base_model_tp_plan, translated when the model is parallelized.
register(ModelSpec("hf", _hf_model, object, {}, tp_plan=lambda model: model.tp_plan(), make_args=_hf_args,
                   pipeline=False))


def get_spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        from torchmeg.config import ConfigError
        m = difflib.get_close_matches(name, list(REGISTRY), n=1)
        hint = f"did you mean '{m[0]}'?" if m else f"allowed: {', '.join(sorted(REGISTRY))}"
        raise ConfigError(f"model.name = {name!r}: unknown model; {hint}")
    return REGISTRY[name]


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Tokenizer vocab rounded up so the embedding splits evenly under TP and tiles well on GPUs."""
    return (n + multiple - 1) // multiple * multiple


def model_args(cfg, tokenizer_vocab: int | None = None):
    """The flavor's args with [model] overrides applied and checked; vocab from the tokenizer if -1."""
    from torchmeg.config import ConfigError, coerce
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


def check_model_config(cfg, tokenizer: bool = True):
    """Validate the model section; returns args (vocab resolved from the tokenizer). tokenizer=False
    (the planner): the vocabulary must come from the flavor or model.vocab_size, or from a
    tokenizer file if the recipe's exists."""
    from torchmeg.config import ConfigError
    from torchmeg.data.tokenizer import build_tokenizer
    if not tokenizer and cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer):
        args = model_args(cfg, None)
        if args.vocab_size < 1:
            raise ConfigError(f"model.vocab_size = {args.vocab_size}: the vocabulary comes from data.tokenizer = "
                              f"{cfg.data.tokenizer!r}, which is not here; set model.vocab_size to plan without it")
        tok = None
    else:
        tok = build_tokenizer(cfg.data.tokenizer)
        args = model_args(cfg, tok.vocab_size)
    spec = get_spec(cfg.model.name)
    p = cfg.parallelism
    if not spec.pipeline and p.pipeline_parallel_degree > 1:
        raise ConfigError(f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}: model.name = "
                          f"{spec.name!r} cannot be split into pipeline stages (its base model runs embedding, "
                          f"layers and norm in one forward); use TP / FSDP / HSDP instead")
    if spec.make_args is not None and p.context_parallel_degree > 1:
        raise ConfigError(f"parallelism.context_parallel_degree = {p.context_parallel_degree}: context parallel "
                          f"swaps torchmeg's own attention module; model.name = {spec.name!r} has none")
    if cfg.checkpoint.initial_load_hf:
        if spec.make_args is None:
            raise ConfigError(f"checkpoint.initial_load_hf: for model.name = 'hf'; convert weights for "
                              f"{spec.name!r} with tools/convert_hf.py")
        if not os.path.isdir(cfg.checkpoint.initial_load_hf) or not any(
                f.endswith(".safetensors") for f in os.listdir(cfg.checkpoint.initial_load_hf)):
            raise ConfigError(f"checkpoint.initial_load_hf = {cfg.checkpoint.initial_load_hf!r}: not a directory "
                              f"holding .safetensors files")
    for key in ("dim", "n_layers", "n_heads"):
        if getattr(args, key) < 1:
            raise ConfigError(f"model.{key} = {getattr(args, key)}: must be >= 1")
    if spec.make_args is None and args.dim % args.n_heads:
        raise ConfigError(f"model.dim = {args.dim}: not divisible by model.n_heads = {args.n_heads}")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"model.n_kv_heads = {args.kv_heads}: must divide model.n_heads = {args.n_heads}")
    if hasattr(args, "rope_theta") and args.head_dim % 2:
        raise ConfigError(f"model.dim / model.n_heads = {args.head_dim}: RoPE needs an even head dim")
    if tok is not None and args.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size = {args.vocab_size}: smaller than the tokenizer's "
                          f"{tok.vocab_size} tokens; raise it or use -1 (= tokenizer size)")
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: exceeds model.max_seq_len = {args.max_seq_len}")
    return args


def build_model(cfg, tokenizer_vocab: int, device: str | torch.device = "meta") -> nn.Module:
    spec = get_spec(cfg.model.name)
    args = model_args(cfg, tokenizer_vocab)
    with torch.device(device):
        return spec.cls(args)


def spec_tp_plan(spec: ModelSpec, model: nn.Module) -> list[tuple[str, str]]:
    """The registry's TP plan for this model (a list, or computed from the model itself)."""
    return spec.tp_plan(model) if callable(spec.tp_plan) else spec.tp_plan


def param_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2 ** 63)


_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_fqn(fqn: str) -> str:
    """The model's own name for a parameter, without compile/recompute/FSDP wrapper components."""
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS)


def init_weights(model: nn.Module, seed: int, block: Callable | None = None) -> None:
    """Initialise every parameter from (seed, FQN) alone, so any layout gets identical weights.

    `block(param) -> (local tensor, offset)` (given by the parallel code) names the block of the
    full parameter this rank holds; default: all of it. A model with `init_rule(fqn)` (Normal /
    Constant, torchmeg.models.init) gets only that block computed, element by element from its
    index in the full tensor: no rank ever draws a whole sharded parameter. A model with only
    `param_init(fqn, full, generator)` (a rule torch's generators run, e.g. a Hugging Face model's
    `_init_weights`) gets the full tensor drawn on the CPU and its block copied. Tied parameters are
    initialised once, under their first name.
    """
    from torchmeg.models.init import fill_block_
    seen = set()
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            fqn = canonical_fqn(fqn)
            local, offset = block(p) if block is not None else (p, (0,) * p.dim())
            rule = model.init_rule(fqn) if hasattr(model, "init_rule") else None
            if rule is not None:
                fill_block_(local, rule, param_seed(seed, fqn), p.shape, offset)
                continue
            full = torch.empty(p.shape, dtype=torch.float32)
            model.param_init(fqn, full, torch.Generator().manual_seed(param_seed(seed, fqn)))
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
        if hasattr(model, "init_buffers"):
            model.init_buffers()


def tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(first FQN, other FQN) for every parameter reachable under two names."""
    first, pairs = {}, []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            if id(p) in first:
                pairs.append((first[id(p)], fqn))
            else:
                first[id(p)] = fqn
    return pairs


def get_param_owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    mod, _, name = fqn.rpartition(".")
    return model.get_submodule(mod), name


def retie(model: nn.Module, pairs) -> None:
    for src, dst in pairs:
        sm, sn = get_param_owner(model, src)
        dm, dn = get_param_owner(model, dst)
        setattr(dm, dn, getattr(sm, sn))


def materialize(model: nn.Module, device, seed: int | None, block: Callable | None = None) -> nn.Module:
    """Meta model -> real storage on `device`, initialised from (seed, FQN); ties survive.
    seed None: storage only (the planner's fake tensors hold no values to initialise).

    (`to_empty` off the meta device makes a new Parameter per module, silently untying weights.)
    """
    pairs = tied_pairs(model)
    model.to_empty(device=device)
    retie(model, pairs)
    if seed is not None:
        init_weights(model, seed, block=block)
    elif hasattr(model, "init_buffers"):
        model.init_buffers()
    return model


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Global parameter count (DTensor numel is global); tied weights counted once."""
    seen, n = set(), 0
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    for p in model.parameters():
        if id(p) not in seen and id(p) not in emb:
            seen.add(id(p))
            n += p.numel()
    return n


def flops_per_token(model: nn.Module, args, seq_len: int) -> int:
    """Training FLOPs per token: 6 x matmul weights + 12 x layers x heads x head_dim x seq_len.

    The first term is forward (2N) + backward (4N) over every nn.Linear weight (embedding lookups
    are not matmuls; a tied output counts as a matmul); the second is QK^T and AV over the full
    (non-causal) score matrix, the PaLM convention (Chowdhery et al. 2022, appendix B).
    """
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel()
        elif is_grouped_experts(m):  # only top_k of the experts run
            n += _expert_weights(m) * m.top_k // m.n_experts
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def active_params(model: nn.Module) -> int:
    """Parameters a token actually uses (MoE: top_k of the routed experts)."""
    n = count_params(model)
    for m in model.modules():
        if is_grouped_experts(m):
            total = _expert_weights(m)
            n -= total - total * m.top_k // m.n_experts
    return n


def _expert_weights(m: nn.Module) -> int:
    return m.w1.numel() + m.w2.numel() + m.w3.numel()
