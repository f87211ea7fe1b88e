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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchmeg.config.errors import ConfigError

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
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


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
    """transformers' config.json for a native llama-family model: LlamaForCausalLM, or
    Qwen3ForCausalLM where the heads are QK-normed; the rope scaling as transformers names it."""
    qwen3 = getattr(args, "qk_norm", False)
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


_BACK = [(re.escape(dst).replace(r"\{\}", r"(\d+)"), src.replace(r"(\d+)", "{}").replace("\\.", "."))
         for src, dst in _NAMES]


def hf_name(fqn: str) -> str:
    return _rename(fqn, _NAMES)


def torchmeg_name(hf: str) -> str:
    return _rename(hf, _BACK)


def tensor_to_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    """One tensor in transformers' layout (RoPE rows within each head permuted, see the docstring)."""
    if fqn.endswith("attention.wq.weight"):
        return _to_hf_rows(t, args.n_heads)
    if fqn.endswith("attention.wk.weight"):
        return _to_hf_rows(t, args.kv_heads)
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):  # a head's dims, permuted alike
        return _to_hf_rows(t[:, None], 1)[:, 0]
    return t


def tensor_from_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    if fqn.endswith("attention.wq.weight"):
        return _from_hf_rows(t, args.n_heads)
    if fqn.endswith("attention.wk.weight"):
        return _from_hf_rows(t, args.kv_heads)
    if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return _from_hf_rows(t[:, None], 1)[:, 0]
    return t


def to_hf_state_dict(sd: dict, args) -> dict:
    return {hf_name(n): tensor_to_hf(n, t, args).contiguous() for n, t in sd.items()
            if not (args.tie_embeddings and n == "output.weight")}


def from_hf_state_dict(sd: dict, args) -> dict:
    out = {}
    for name, t in sd.items():
        if "rotary_emb" in name:
            continue
        ours = torchmeg_name(name)
        out[ours] = tensor_from_hf(ours, t, args)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def save_hf(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    hf = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(sd, args).items()}
    _write_safetensors(hf, folder)
    cfg = hf_config(args)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)


def _write_safetensors(tensors: dict, folder: str) -> None:
    """folder/model.safetensors, written whole or not at all (a temporary file, then a rename)."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "model.safetensors"))


def load_hf(folder: str, args) -> dict:
    """torchmeg state dict from an HF folder (model.safetensors or sharded model-*.safetensors)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    sd = {}
    for f in files:
        sd.update(load_file(os.path.join(folder, f)))
    return from_hf_state_dict(sd, args)


def export_hf(model, args, cfg, folder: str) -> None:
    """Gather the full model on rank 0 and write it as an HF folder (LlamaForCausalLM for `llama`,
    the model's own class for `hf`)."""
    name = cfg.model.name
    if name not in ("llama", "hf"):
        raise ValueError("checkpoint.export_hf supports model.name = 'llama' and 'hf'")
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        dtype = getattr(torch, cfg.checkpoint.export_dtype)
        (save_hf if name == "llama" else save_hf_native)(sd, args, folder, dtype)
        print(f"[checkpoint] HF safetensors written to {folder}", flush=True)
    dist.barrier()


def save_hf_native(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    """A model.name = 'hf' state dict (already in HF names) + its config, as transformers saves them:
    loads with AutoModelForCausalLM.from_pretrained(folder). A tied LM head is stored once."""
    _write_safetensors({k: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()
                        if not (args.tie_embeddings and k == "lm_head.weight")}, folder)
    config = args.config
    config.dtype = str(dtype).replace("torch.", "")  # (transformers 5 name; was torch_dtype)
    config.to_json_file(os.path.join(folder, "config.json"))


def load_hf_native(model, folder: str) -> int:
    """Load an HF safetensors folder into a (parallelized, materialised) model.name = 'hf' model.
    DCP's HuggingFaceStorageReader plans the reads: each rank reads only the slices of its own
    shards (FSDP / TP DTensors). Returns the number of tensors loaded."""
    sd = get_model_state_dict(model)
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
