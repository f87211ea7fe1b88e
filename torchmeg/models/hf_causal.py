"""Hugging Face causal LMs as torchmeg models (`model.name = "hf"`).

The model is transformers' own (`AutoModelForCausalLM.from_config`, built on meta, SDPA
attention); torchmeg adds only what its trainer needs around it:

* `HFCausalLM` adopts the HF model's base model and LM head as its own children, so every
  parameter keeps its Hugging Face name (`model.layers.0.self_attn.q_proj.weight`): checkpoints,
  safetensors import and export need no renaming. `forward(tokens) -> logits` like every torchmeg
  model, through the HF base model's own forward (its masks, scalings and rotary embeddings).
* Initialisation from (seed, FQN), with the HF model's own `_init_weights` rules (std from the
  config, norm weights as the model defines them, rotary buffers), so every layout gets the same
  weights as one process.
* `tp_plan()`: the model's `base_model_tp_plan` translated to torchmeg roles.

Nothing here imports torch.distributed: parallelism is applied by `torchmeg.parallelize()`.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import json
import os
import types
from dataclasses import dataclass

import torch
from torch import nn

from torchmeg.config.schema import coerce
from torchmeg.config.errors import ConfigError
from torchmeg.config.extras import need
from torchmeg.models import hf_paged
from torchmeg.models.blocks import find_blocks, fqn_matches
from torchmeg.models.kv_cache import head_positions


@dataclass
class HFArgs:
    """What the trainer, FLOP count and layout checks read from any model, taken from the HF config."""
    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    model_type: str
    attn_implementation: str = "sdpa"
    config: object = dataclasses.field(repr=False, default=None)  # the transformers config
    n_experts: int = 0  # routed experts per MoE layer (0: a dense model)


def config_path(path: str) -> str:
    """`model.hf_config` -> the config.json it names (a file, or a directory holding one)."""
    if not path:
        raise ConfigError("model.name = 'hf' needs model.hf_config: a Hugging Face config.json or a directory "
                          "holding one (e.g. a downloaded model folder)")
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        raise ConfigError(f"model.hf_config = {path!r}: no such file" + (" (no config.json in that directory)"
                                                                       if os.path.isdir(path) else ""))
    return p


def load_config(path: str, overrides: dict, padded_vocab: int | None = None):
    """The transformers config of `path` with [model] overrides applied (any config field; vocab_size
    -1 = `padded_vocab`, the tokenizer's vocabulary padded as for torchmeg's own models)."""
    AutoConfig = need("transformers", "hf", 'model.name = "hf"').AutoConfig  # lazy: heavy, only `hf` needs it
    p = config_path(path)
    try:
        with open(p) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.hf_config = {path!r}: not a readable JSON config ({e})") from None
    if "model_type" not in raw:
        raise ConfigError(f"model.hf_config = {path!r}: no 'model_type' in {p}; a transformers config.json names "
                          f"its architecture there")
    try:
        config = AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"model.hf_config = {path!r}: transformers cannot build model_type "
                          f"{raw['model_type']!r} ({str(e).splitlines()[0]})") from None
    known = set(config.to_dict()) | set(raw)
    for key, value in overrides.items():
        if key not in known:
            m = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConfigError(f"unknown key 'model.{key}' for model.name = 'hf' ({config.model_type}); "
                              + (f"did you mean '{m[0]}'?" if m else "[model] overrides fields of the HF config"))
        ref = getattr(config, key, None)
        if key == "vocab_size" and str(value) == "-1":
            value = -1
        elif isinstance(ref, bool):
            value = coerce(f"model.{key}", value, bool)
        elif isinstance(ref, int):
            value = coerce(f"model.{key}", value, int)
        elif isinstance(ref, float):
            value = coerce(f"model.{key}", value, float)
        setattr(config, key, value)
    if getattr(config, "vocab_size", None) == -1:
        if padded_vocab is None:
            raise ConfigError("model.vocab_size = -1 needs a tokenizer to size the vocabulary")
        config.vocab_size = padded_vocab
    config.use_cache = False
    return config


def is_hf_experts(m: nn.Module) -> bool:
    """transformers' MoE experts (Qwen3-MoE, DeepSeek-V3, Mixtral, ... in transformers 5): every
    expert's weights in two 3-D parameters, gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    w = getattr(m, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and hasattr(m, "down_proj") and hasattr(m, "num_experts")


def args_from_config(config) -> HFArgs:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        n_heads = text.num_attention_heads
        dim = text.hidden_size
        args = HFArgs(
            n_layers=text.num_hidden_layers, dim=dim, n_heads=n_heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(text, "head_dim", None) or dim // n_heads,
            ffn_hidden=getattr(text, "intermediate_size", None) or 4 * dim,
            vocab_size=text.vocab_size,
            max_seq_len=getattr(text, "max_position_embeddings", None) or 2 ** 31,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            model_type=config.model_type, config=config,
            n_experts=next((getattr(text, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                            if getattr(text, k, None)), 0))
    except AttributeError as e:
        raise ConfigError(f"model.hf_config: {config.model_type} is not a decoder-only causal LM config torchmeg "
                          f"can read ({e})") from None
    return args


class HFCausalLM(nn.Module):
    """A transformers causal LM with torchmeg's model interface (see the module docstring)."""

    def __init__(self, args: HFArgs):
        super().__init__()
        from transformers import AutoModelForCausalLM  # lazy: see load_config
        self.args = args
        self.config = args.config
        try:
            hf = AutoModelForCausalLM.from_config(args.config, attn_implementation=args.attn_implementation)
        except ValueError as e:
            if "attention implementation" not in str(e):
                raise
            raise ConfigError(f"model.hf_attn_implementation = {args.attn_implementation!r}: {args.model_type} does "
                              f"not support it in transformers; set model.hf_attn_implementation = \"eager\"") from None
        unroute_hub_kernels(hf)
        prefix = hf.base_model_prefix
        lm_head = hf.get_output_embeddings()
        if not prefix or not hasattr(hf, prefix) or lm_head is None:
            raise ValueError(f"{type(hf).__name__}: not a base model + LM head causal LM torchmeg can train")
        # The HF model's children become ours under the same names, so parameter FQNs are HF's.
        self.base_prefix = prefix
        self.add_module(prefix, getattr(hf, prefix))
        self.add_module("lm_head", lm_head)
        self.hf_class = type(hf).__name__
        # serving: batched over the engine's paged KV cache where transformers' attention function can
        # be ours (models.hf_paged); else transformers keeps its own cache, one sequence a forward
        # generation's cache argument: transformers 5.25 renamed `past_key_values` to `cache` (the old
        # name goes in 5.40); the installed version's, read once
        params = inspect.signature(getattr(self, prefix).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        _, blocks = find_blocks(self)
        self.keeps_own_cache = not hf_paged.supports(args.config, list(blocks.children()) if blocks is not None else [None])
        emb = hf.get_input_embeddings()
        self.embed_fqn = next(n for n, m in self.named_modules() if m is emb)
        self._hf_init = hf._init_weights  # bound: applies the config's init rules to one module
        self.softcap = getattr(args.config, "final_logit_softcapping", None)
        self.head_in_loss = False  # see llama.Llama
        # Under SP the base model sees a sequence shard: fine for SDPA without a mask (causal by
        # flag), wrong for an explicit mask built from that local length (eager attention).
        self.supports_sequence_parallel = args.attn_implementation == "sdpa"
        self.sequence_parallel_note = f"{args.attn_implementation} attention builds its mask from the local length"
        if any(is_hf_experts(m) for m in self.modules()):
            # transformers' experts run whole on every TP rank (tp_plan_from_hf): their output is
            # the whole sequence, which a sequence-sharded residual stream cannot add
            self.supports_sequence_parallel = False
            self.sequence_parallel_note = "MoE experts run whole on every TP rank (expert parallel spreads them)"

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, L, V]. Generation passes `positions` [B, L] and a torchmeg KVCache, which here
        carries transformers' own cache and the padding mask (models.kv_cache), and `last_only` at
        prefill (logits [B, 1, V], or at the positions a tensor names: models.kv_cache.head_positions);
        the serving engine its paged cache (batching.paged), which transformers' attention reads and
        writes through models.hf_paged."""
        base = getattr(self, self.base_prefix)
        if getattr(cache, "paged", False):  # the engine's (batching.paged.PagedCache)
            with hf_paged.paged(self.config, cache):
                h = base(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state
        elif cache is None:
            # Positions given explicitly: under sequence parallel the embedding output is a sequence
            # shard, and the base model would count positions from its local length.
            pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            h = base(input_ids=tokens, position_ids=pos, use_cache=False).last_hidden_state
        else:
            if "hf" not in cache.model_state:
                from transformers import DynamicCache  # lazy: see load_config
                cache.model_state["hf"] = DynamicCache(config=self.config)
            n = tokens.shape[1]
            h = base(input_ids=tokens, position_ids=positions, attention_mask=cache.key_mask(n), use_cache=True,
                     **{self._cache_arg: cache.model_state["hf"]}).last_hidden_state
        h = head_positions(h, last_only)
        if self.head_in_loss:
            return h
        logits = self.lm_head(h)
        if self.softcap:  # Gemma 2/3: tanh soft-capping of the logits, as the HF LM head applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ---- initialisation from (seed, FQN), by the HF model's own rules ---------------------------
    def param_init(self, fqn: str, full: torch.Tensor, gen: torch.Generator) -> None:
        """Fill `full` (the whole parameter, on the CPU) as the HF model would, from `gen`'s seed.

        HF's `_init_weights(module)` draws from the global generator and writes a module's
        parameters in place: it runs on a CPU stand-in of the owning module whose parameter `fqn`
        is `full` (siblings are scratch), under a forked RNG seeded from (seed, FQN).
        """
        owner_name, _, pname = fqn.rpartition(".")
        owner = self.get_submodule(owner_name)
        stand_in = _cpu_stand_in(owner, {pname: full})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(gen.initial_seed())
            self._hf_init(stand_in)
        if not torch.isfinite(full).all():
            raise ValueError(f"{fqn}: the HF init rule produced non-finite values")

    def init_buffers(self) -> None:
        """Non-persistent buffers (rotary inverse frequencies, embedding scales) after to_empty:
        the HF init rule writes them in place; parameters of their modules are left alone."""
        for mod in self.modules():
            bufs = {n: b for n, b in mod.named_buffers(recurse=False) if b is not None}
            if not bufs:
                continue
            stand_in = _cpu_stand_in(mod, {}, keep_buffers=True)
            with torch.no_grad():
                self._hf_init(stand_in)

    def tp_plan(self) -> list[tuple[str, str]]:
        """The HF plan plus sequence-parallel roles found in the module tree: the norms that are
        direct children of a block or of the base model run on sequence shards, and a block child
        holding column-parallel projections (attention, MLP) gathers its input first."""
        plan = tp_plan_from_hf(self.config, self.base_prefix, self.embed_fqn)
        # entries for modules this model lacks (a MoE model's dense-MLP entries) are dropped
        names = [n for n, _ in self.named_modules()]
        plan = [(pat, role) for pat, role in plan if any(fqn_matches(pat, n) for n in names)]
        path, container = find_blocks(self)
        if container is None:
            return plan
        first_name, first = next(iter(container.named_children()))
        col = [pat for pat, role in plan if role == "colwise"]
        sp = []
        for name, child in first.named_children():
            here = f"{path}.*.{name}"
            if "norm" in type(child).__name__.lower():
                sp.append((here, "sp_norm_local"))
            elif any(_under(pat, here) for pat in col):
                sp.append((here, "sp_input"))
        base = getattr(self, self.base_prefix)
        for name, child in base.named_children():
            if "norm" in type(child).__name__.lower():
                sp.append((f"{self.base_prefix}.{name}", "sp_norm_local"))
        return sp + plan


def unroute_hub_kernels(model: nn.Module) -> int:
    """Give each module whose class the `kernels` package's `use_kernelized_func` wrapped its
    class's own forward back; returns how many.

    With `kernels` installed (transformers >= 5.25 pulls it in), transformers decorates attention
    classes so that every forward first sets a ContextVar naming the module's private kernel
    wrappers (kernels/_internals/layer/layer.py, `_ACTIVE_KERNEL_FUNCS.set`), then calls the
    class's forward. torchmeg never calls `kernelize()`, so those wrappers run transformers' torch
    functions (a function module with no active wrapper calls the plain function): the routing
    computes nothing different, but a ContextVar set inside a compiled, recomputed block is a side
    effect dynamo refuses ("HOP: Unsafe side effect ... checkpoint"), a hard error in a block
    compiled fullgraph. The wrapper marks its instances with `_kernel_funcs`; functools.wraps
    keeps the class's forward as `__wrapped__`."""
    n = 0
    for m in model.modules():
        wrapped = getattr(type(m).forward, "__wrapped__", None)
        if "_kernel_funcs" in m.__dict__ and wrapped is not None:
            m.forward = types.MethodType(wrapped, m)
            n += 1
    return n


def _under(pattern: str, prefix: str) -> bool:
    """Whether plan pattern `pattern` names a module inside `prefix` (both may hold '*')."""
    p, q = pattern.split("."), prefix.split(".")
    return len(p) > len(q) and all(a == b or "*" in (a, b) for a, b in zip(p, q))


def _cpu_stand_in(mod: nn.Module, params: dict, keep_buffers: bool = False) -> nn.Module:
    """A shallow copy of `mod` without children: parameters named in `params` are those tensors,
    other parameters scratch CPU tensors; buffers the real ones (keep_buffers) or scratch."""
    # (object.__new__: copy.copy would call the class's __new__, which an FSDP-sharded module's
    # class overrides to re-run __init__)
    stand_in = object.__new__(type(mod))
    stand_in.__dict__.update(mod.__dict__)
    stand_in._modules = {}
    stand_in._parameters = {}
    for n, p in mod._parameters.items():  # (None entries too: HF reads `module.bias is not None`)
        if p is None:
            stand_in._parameters[n] = None
            continue
        t = params.get(n)
        if t is None:
            t = torch.empty(p.shape, dtype=torch.float32)
        stand_in._parameters[n] = nn.Parameter(t, requires_grad=False)  # shares t's storage
    stand_in._buffers = {}
    for n, b in mod._buffers.items():
        if b is None:
            stand_in._buffers[n] = None
            continue
        stand_in._buffers[n] = b if keep_buffers else torch.empty(b.shape, dtype=b.dtype)
    return stand_in


# HF tensor-parallel plan styles -> torchmeg roles (torchmeg.parallel.tensor); `mla_kv_a_proj` (MLA's
# joint KV down-projection, transformers >= 5.25) -> head_shared_tail:<qk_rope_head_dim>. Other styles
# (packed, local_*, gather, expert styles) have no torchmeg equivalent yet: refused by name.
_HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "replicated_with_grad_allreduce": "replicate_grad_allreduce",
}


def tp_plan_from_hf(config, base_prefix: str = "model", embed_fqn: str = "model.embed_tokens") -> list[tuple[str, str]]:
    """The config's `base_model_tp_plan` as torchmeg (pattern, role) pairs, plus the vocab-sharded
    embedding and LM head (HF keeps those in the model class's plan, torchmeg in its roles)."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{config.model_type}: the config has no base_model_tp_plan; tensor parallel needs one "
                         f"(pass tp_plan= to parallelize() or use tensor_parallel_degree = 1)")
    out = [(embed_fqn, "embedding")]
    for pattern, style in plan.items():
        if "experts" in pattern.split("."):
            # transformers' expert styles (packed_colwise, moe_tp_experts): torchmeg runs the
            # experts whole on each TP rank and spreads them with expert parallel instead
            continue
        role = _HF_STYLES.get(style)
        if style == "mla_kv_a_proj" and getattr(config, "qk_rope_head_dim", 0):
            # MLA's [compressed KV | rotary key] down-projection, replicated: the rotary key's
            # gradient summed over tp (transformers' MlaKvAProjParallel: _AllReduceBackward on it)
            role = f"head_shared_tail:{config.qk_rope_head_dim}"
        if role is None:
            raise ValueError(f"{config.model_type}: TP plan style {style!r} (for {pattern!r}) has no torchmeg "
                             f"equivalent; supported: {', '.join(_HF_STYLES)}; use tensor_parallel_degree = 1 or "
                             f"give parallelize() a tp_plan")
        out.append((f"{base_prefix}.{pattern}", role))
    out.append(("lm_head", "output"))
    return out
