"""Native models' tensors in transformers' names and layouts, both ways: `llama` as LlamaForCausalLM /
Qwen3ForCausalLM, `moe` as Qwen3MoeForCausalLM, `deepseek_v3` as DeepseekV3ForCausalLM, `gpt_oss`
(hf_gpt_oss.py) as GptOssForCausalLM. The files themselves: hf_files.py; config.json: hf_export.py.

RoPE layout: torchmeg (like Meta's checkpoints) rotates interleaved pairs (x0,x1),(x2,x3)...;
transformers rotates the two halves of each head. The same rotation is expressed by permuting the
rows of wq/wk within each head, which is what `_to_hf_rows` / `_from_hf_rows` do (the permutation
of transformers' own convert_llama_weights_to_hf.py).
"""
from __future__ import annotations

import re

import torch

from torchmeg.checkpoint import hf_gpt_oss

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


def _is_gpt_oss(args) -> bool:
    return hasattr(args, "sliding_window")


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
    if _is_gpt_oss(args):
        return [hf_gpt_oss.hf_name(fqn)]
    b = _MTP_BLOCK.fullmatch(fqn)
    if b:
        fqn = f"layers.{b[1]}.{b[2]}"
    m = _EXPERTS.fullmatch(fqn)
    if m:
        return [f"model.layers.{m[1]}.mlp.experts.{e}.{_PROJ[m[2]]}.weight" for e in range(args.n_experts)]
    return [_rename(fqn, _table(args))]


def torchmeg_fqns(hf: str, args) -> list[str]:
    """Every torchmeg tensor an HF tensor is part of ([] for a copy torchmeg keeps once)."""
    if _is_gpt_oss(args):
        return hf_gpt_oss.torchmeg_fqns(hf)
    fqn = torchmeg_fqn(hf, args)
    return [] if fqn is None else [fqn]


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
    if _is_gpt_oss(args):
        return hf_gpt_oss.to_hf(fqn, t, args)
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
    if _is_gpt_oss(args):
        return hf_gpt_oss.to_hf_state_dict(sd, args)
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
    out = hf_gpt_oss.from_hf_state_dict(sd, args) if _is_gpt_oss(args) else _from_tables(sd, args)
    if tie and args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _from_tables(sd: dict, args) -> dict:
    """from_hf_state_dict for the families mapped by _NAMES / _DEEPSEEK (grouped experts stacked)."""
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
    return out
