"""HuggingFace safetensors in/out: `llama` with transformers' LlamaForCausalLM names, and `hf` models as they are.

RoPE layout: torchmeg (like Meta's checkpoints) rotates interleaved pairs (x0,x1),(x2,x3)...;
transformers rotates the two halves of each head. The same rotation is expressed by permuting the
rows of wq/wk within each head, which is what `_to_hf_rows` / `_from_hf_rows` do (the permutation
of transformers' own convert_llama_weights_to_hf.py).
"""
from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from torchmeg.checkpoint.manager import all_finite
from torchmeg.config.errors import ConfigError
from torchmeg.models.lora import is_adapter

_NAMES = [  # torchmeg pattern -> HF pattern
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", "model.layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", "model.layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", "model.layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", "model.layers.{}.self_attn.q_norm.weight"),
    (r"layers\.(\d+)\.attention\.k_norm\.weight", "model.layers.{}.self_attn.k_norm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.moe\.router\.weight", "model.layers.{}.mlp.gate.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


# DeepSeek-V3 (DeepseekV3ForCausalLM): MLA's projections, shared experts, the router's selection
# bias; tried before _NAMES (its attention.q_norm is the latent's norm, not Qwen3's per-head one).
_DEEPSEEK = [
    (r"layers\.(\d+)\.attention\.wq\.weight", "model.layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wq_a\.weight", "model.layers.{}.self_attn.q_a_proj.weight"),
    (r"layers\.(\d+)\.attention\.q_norm\.weight", "model.layers.{}.self_attn.q_a_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.wq_b\.weight", "model.layers.{}.self_attn.q_b_proj.weight"),
    (r"layers\.(\d+)\.attention\.wkv_a\.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"),
    (r"layers\.(\d+)\.attention\.kv_norm\.weight", "model.layers.{}.self_attn.kv_a_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.wkv_b\.weight", "model.layers.{}.self_attn.kv_b_proj.weight"),
    (r"layers\.(\d+)\.moe\.shared\.w1\.weight", "model.layers.{}.mlp.shared_experts.gate_proj.weight"),
    (r"layers\.(\d+)\.moe\.shared\.w2\.weight", "model.layers.{}.mlp.shared_experts.down_proj.weight"),
    (r"layers\.(\d+)\.moe\.shared\.w3\.weight", "model.layers.{}.mlp.shared_experts.up_proj.weight"),
    (r"layers\.(\d+)\.moe\.expert_bias", "model.layers.{}.mlp.gate.e_score_correction_bias"),
    # MTP module j (numbered after the main layers, as DeepSeek's checkpoints store it: layers.61 in V3)
    (r"mtp\.(\d+)\.enorm\.weight", "model.layers.{}.enorm.weight"),
    (r"mtp\.(\d+)\.hnorm\.weight", "model.layers.{}.hnorm.weight"),
    (r"mtp\.(\d+)\.eh_proj\.weight", "model.layers.{}.eh_proj.weight"),
    (r"mtp\.(\d+)\.norm\.weight", "model.layers.{}.shared_head.norm.weight"),
]
# Tensors DeepSeek's checkpoints repeat inside each MTP layer: copies of the shared embedding and head.
_MTP_COPIES = re.compile(r"model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight")


def _is_deepseek(args) -> bool:
    return hasattr(args, "kv_lora_rank")


def _table(args):
    return _DEEPSEEK + _NAMES if _is_deepseek(args) else _NAMES


def _rename(name: str, table) -> str:
    for src, dst in table:
        m = re.fullmatch(src, name)
        if m:
            return dst.format(*m.groups())
    raise KeyError(f"no HF name for parameter {name!r}")


def _to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, dim = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def _from_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, dim = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, dim).transpose(1, 2).reshape(out, dim)


def hf_config(args) -> dict:
    """transformers' config.json for a native model: LlamaForCausalLM, Qwen3ForCausalLM where the
    heads are QK-normed, Qwen3MoeForCausalLM for a moe of Qwen3-MoE's shape; the rope scaling as
    transformers names it."""
    qwen3 = getattr(args, "qk_norm", False)
    if _is_deepseek(args):
        return _deepseek_v3_config(args)
    if hasattr(args, "n_experts"):
        return _qwen3_moe_config(args)
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False,
        "hidden_act": "silu", "torch_dtype": "float32", "head_dim": args.head_dim,
    }
    if not qwen3:
        cfg["mlp_bias"] = False
    scaling = rope_scaling_config(args)
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg


def _qwen3_moe_config(args) -> dict:
    """A torchmeg moe in Qwen3-MoE's shape (softmax router, no shared experts, every layer routed,
    QK norm); any other routing has no transformers class to load it: refused naming the key."""
    for key, ok in (("qk_norm", True), ("score_func", "softmax"), ("n_shared_experts", 0), ("n_dense_layers", 0)):
        if getattr(args, key) != ok:
            raise ConfigError(f"model.{key} = {getattr(args, key)!r}: Hugging Face export of a moe model writes "
                              f"Qwen3MoeForCausalLM, which needs {key} = {ok!r}")
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": args.vocab_size,
           "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "moe_intermediate_size": args.moe_hidden,
           "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
           "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.norm_eps,
           "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
           "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "hidden_act": "silu",
           "num_experts": args.n_experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": args.route_norm,
           "decoder_sparse_step": 1, "mlp_only_layers": [],
           "router_aux_loss_coef": args.aux_loss_coef if args.balance == "aux_loss" else 0.0, "torch_dtype": "float32"}
    scaling = rope_scaling_config(args)
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg


def _deepseek_v3_config(args) -> dict:
    """DeepseekV3ForCausalLM's config for a native deepseek_v3 (the MTP modules as
    num_nextn_predict_layers; transformers builds no MTP module and skips their tensors)."""
    for key, ok in (("score_func", "sigmoid"), ("balance", "bias")):
        if getattr(args, key) != ok:
            raise ConfigError(f"model.{key} = {getattr(args, key)!r}: DeepseekV3ForCausalLM routes with "
                              f"{key} = {ok!r} only")
    if args.n_shared_experts < 1:
        raise ConfigError("model.n_shared_experts = 0: DeepseekV3ForCausalLM has shared experts (>= 1)")
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": args.vocab_size,
           "hidden_size": args.dim, "intermediate_size": args.ffn_hidden, "moe_intermediate_size": args.moe_hidden,
           "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
           "num_key_value_heads": args.n_heads, "n_shared_experts": args.n_shared_experts,
           "n_routed_experts": args.n_experts, "routed_scaling_factor": args.route_scale,
           "kv_lora_rank": args.kv_lora_rank, "q_lora_rank": args.q_lora_rank or None,
           "qk_rope_head_dim": args.qk_rope_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim,
           "v_head_dim": args.v_head_dim, "n_group": args.n_expert_groups, "topk_group": args.topk_groups,
           "num_experts_per_tok": args.top_k, "first_k_dense_replace": args.n_dense_layers,
           "norm_topk_prob": args.route_norm, "hidden_act": "silu", "max_position_embeddings": args.max_seq_len,
           "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings, "rope_theta": args.rope_theta,
           "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": args.mtp_depth,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "float32"}
    scaling = rope_scaling_config(args)
    if scaling:
        cfg["rope_scaling"] = scaling
    return cfg


def rope_scaling_config(args) -> dict | None:
    """The args' RoPE scaling as transformers' rope_scaling dict (None for plain RoPE)."""
    kind = getattr(args, "rope_type", "default")
    if kind == "default":
        return None
    out = {"rope_type": kind, "factor": args.rope_factor,
           "original_max_position_embeddings": args.rope_original_max_seq_len}
    if kind == "llama3":
        out.update(low_freq_factor=args.rope_low_freq_factor, high_freq_factor=args.rope_high_freq_factor)
    else:  # yarn
        out.update(beta_fast=args.rope_beta_fast, beta_slow=args.rope_beta_slow, truncate=args.rope_truncate)
        for key, value in (("mscale", args.rope_mscale), ("mscale_all_dim", args.rope_mscale_all_dim),
                           ("attention_factor", args.rope_attention_factor)):
            if value:
                out[key] = value
    return out


def _backward(table):
    return [(re.escape(dst).replace(r"\{\}", r"(\d+)"), src.replace(r"(\d+)", "{}").replace("\\.", "."))
            for src, dst in table]


_BACK, _BACK_DEEPSEEK = _backward(_NAMES), _backward(_DEEPSEEK + _NAMES)
_MTP_BLOCK = re.compile(r"mtp\.(\d+)\.block\.(.*)")


# Routed experts: torchmeg's grouped [E, D, H] w1 / w3 and [E, H, D] w2 are, in a checkpoint of
# transformers (Qwen3-MoE; the Hub's own files), E tensors each: experts.{e}.gate_proj / up_proj
# [H, D] and down_proj [D, H].
_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_names(fqn: str, args) -> list[str]:
    """The transformers tensors torchmeg tensor `fqn` is made of (E for grouped experts, else 1).
    An MTP module's block is stored like a decoder layer under its own number."""
    b = _MTP_BLOCK.fullmatch(fqn)
    if b:
        fqn = f"layers.{b[1]}.{b[2]}"
    m = _EXPERTS.fullmatch(fqn)
    if m:
        return [f"model.layers.{m[1]}.mlp.experts.{e}.{_PROJ[m[2]]}.weight" for e in range(args.n_experts)]
    return [_rename(fqn, _table(args))]


def torchmeg_fqn(hf: str, args=None) -> str | None:
    """The torchmeg tensor an HF tensor belongs to (None: a copy torchmeg keeps once, e.g. an MTP
    layer's embedding)."""
    if _MTP_COPIES.fullmatch(hf):
        return None
    m = _HF_EXPERT.fullmatch(hf)
    fqn = f"layers.{m[1]}.moe.experts.{ {v: k for k, v in _PROJ.items()}[m[3]]}" if m else \
        _rename(hf, _BACK_DEEPSEEK if args is not None and _is_deepseek(args) else _BACK)
    layer = re.match(r"layers\.(\d+)\.(.*)", fqn)
    if layer and args is not None and int(layer[1]) >= args.n_layers:  # an MTP module's block
        return f"mtp.{layer[1]}.block.{layer[2]}"
    return fqn


def tensor_to_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    """One tensor in transformers' layout (RoPE rows within each head permuted, see the docstring;
    DeepSeek-V3's rope_interleave layout is torchmeg's own)."""
    if _is_deepseek(args):
        return t
    if fqn.endswith("attention.wq.weight"):
        return _to_hf_rows(t, args.n_heads)
    if fqn.endswith("attention.wk.weight"):
        return _to_hf_rows(t, args.kv_heads)
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):  # a head's dims, permuted alike
        return _to_hf_rows(t[:, None], 1)[:, 0]
    return t


def tensor_from_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    if _is_deepseek(args):
        return _deepseek_rope_from_halves(fqn, t, args) if getattr(args, "rope_halves", False) else t
    if fqn.endswith("attention.wq.weight"):
        return _from_hf_rows(t, args.n_heads)
    if fqn.endswith("attention.wk.weight"):
        return _from_hf_rows(t, args.kv_heads)
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return _from_hf_rows(t[:, None], 1)[:, 0]
    return t


def _deepseek_rope_from_halves(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    """A DeepSeek checkpoint with rope_interleave = false rotates each rotary part's two halves
    (transformers' rotate_half): the rows producing the rotary dims are permuted into torchmeg's
    interleaved pairs (the same rotation, as for Llama)."""
    r = args.qk_rope_head_dim
    pairs = torch.stack([torch.arange(r // 2), torch.arange(r // 2) + r // 2], -1).flatten()
    if fqn.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        w = t.view(args.n_heads, args.qk_nope_head_dim + r, -1)
        return torch.cat([w[:, :args.qk_nope_head_dim], w[:, args.qk_nope_head_dim:][:, pairs]], 1).reshape(t.shape)
    if fqn.endswith("attention.wkv_a.weight"):
        return torch.cat([t[:args.kv_lora_rank], t[args.kv_lora_rank:][pairs]])
    return t


def to_hf_state_dict(sd: dict, args) -> dict:
    """torchmeg tensors -> transformers' (grouped experts: one tensor per expert)."""
    out = {}
    for n, t in sd.items():
        if args.tie_embeddings and n == "output.weight":
            continue
        names = hf_names(n, args)
        if len(names) > 1:
            out.update({h: t[e].t().contiguous() for e, h in enumerate(names)})
        else:
            out[names[0]] = tensor_to_hf(n, t, args).contiguous()
    return out


def from_hf_state_dict(sd: dict, args, tie: bool = True) -> dict:
    """transformers tensors -> torchmeg's; a grouped expert tensor needs all E of its sources in `sd`."""
    out, experts = {}, {}
    for name, t in sd.items():
        if "rotary_emb" in name:
            continue
        fqn = torchmeg_fqn(name, args)
        if fqn is None:
            continue
        if _EXPERTS.fullmatch(fqn) or _EXPERTS.fullmatch(re.sub(r"^mtp\.(\d+)\.block\.", r"layers.\1.", fqn)):
            experts.setdefault(fqn, {})[name] = t
        else:
            out[fqn] = tensor_from_hf(fqn, t, args)
    for fqn, parts in experts.items():
        out[fqn] = torch.stack([parts[h].t() for h in hf_names(fqn, args)]).contiguous()

    if tie and args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def save_hf(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    hf = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(sd, args).items()}
    write_safetensors(hf, folder)
    cfg = hf_config(args)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)


def write_safetensors(tensors: dict, folder: str, name: str = "model.safetensors") -> None:
    """folder/name, written whole or not at all (a temporary file, then a rename)."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, name))


def load_hf(folder: str, args) -> dict:
    """torchmeg state dict from an HF folder (model.safetensors or sharded model-*.safetensors)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    sd = {}
    for f in files:
        sd.update(load_file(os.path.join(folder, f)))
    return from_hf_state_dict(sd, args)


def save_hf_native(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    """A model.name = 'hf' state dict (already in HF names) + its config, as transformers saves them:
    loads with AutoModelForCausalLM.from_pretrained(folder). A tied LM head is stored once."""
    write_safetensors({k: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()
                        if not (args.tie_embeddings and k == "lm_head.weight")}, folder)
    config = args.config
    config.dtype = str(dtype).replace("torch.", "")  # (transformers 5 name; was torch_dtype)
    config.to_json_file(os.path.join(folder, "config.json"))


def load_hf_native(model, folder: str) -> int:
    """Load an HF safetensors folder into a (parallelized, materialised) model.name = 'hf' model.
    DCP's HuggingFaceStorageReader plans the reads: each rank reads only the slices of its own
    shards (FSDP / TP DTensors). Returns the number of tensors loaded."""
    sd = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}  # (LoRA: the base's only)
    if getattr(model, "args", None) is not None and model.args.tie_embeddings:
        sd.pop("lm_head.weight", None)  # stored once, under the embedding's name
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(folder))
    set_model_state_dict(model, sd)
    return len(sd)


def check_initial_load(cfg, hf_native: bool) -> None:
    """checkpoint.initial_load_hf: a model whose parameters carry HF names, and a folder of safetensors."""
    folder = cfg.checkpoint.initial_load_hf
    if not folder:
        return
    if not hf_native:
        raise ConfigError(f"checkpoint.initial_load_hf: for model.name = 'hf'; convert weights for "
                          f"{cfg.model.name!r} with tools/convert_hf.py")
    if not os.path.isdir(folder) or not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: not a directory holding .safetensors files")


def load_initial_hf(model, whole, folder: str) -> str:
    """checkpoint.initial_load_hf: a fresh run starts from Hugging Face safetensors (each rank reads its
    shards only); the weights must be finite, like a resumed checkpoint's. -> the header's init note."""
    model_class = getattr(whole, "hf_class", type(whole).__name__)
    try:
        n = load_hf_native(model, folder)
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank errors; one line names the folder
        msg = str(e).strip().splitlines()
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: cannot load it into "
                          f"{model_class} ({msg[-1] if msg else type(e).__name__})") from None
    if not all_finite(model.parameters()):  # all-reduced: every rank stops alike
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: non-finite values in the weights")
    return f"from Hugging Face weights in {folder} ({n} tensors)"
