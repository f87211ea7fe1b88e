"""gpt-oss tensors in transformers' names (GptOssForCausalLM) <-> torchmeg's gpt_oss.

Differences in layout, each undone here: transformers rotates the two halves of each head (q / k
rows and biases permuted into torchmeg's interleaved pairs, as for Llama); the experts' gate and up
projections are one [E, D, 2H] tensor with gate and up interleaved along its last dim (columns
0, 2, 4, ... gate; 1, 3, 5, ... up) and their biases [E, 2H] alike; down_proj [E, H, D] is torchmeg's
w2 as it is.
"""
from __future__ import annotations

import re

import torch

_LAYER = r"layers\.(\d+)\."
_HF = "model.layers.{}."
_NAMES = [  # torchmeg pattern -> HF name
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    *[(_LAYER + rf"attention\.w{a}\.(weight|bias)", _HF + f"self_attn.{a}_proj.{{}}") for a in "qkvo"],
    (_LAYER + r"attention\.sinks\.weight", _HF + "self_attn.sinks"),
    (_LAYER + r"attention_norm\.weight", _HF + "input_layernorm.weight"),
    (_LAYER + r"ffn_norm\.weight", _HF + "post_attention_layernorm.weight"),
    (_LAYER + r"moe\.router\.(weight|bias)", _HF + "mlp.router.{}"),
    (_LAYER + r"moe\.experts\.w2", _HF + "mlp.experts.down_proj"),
    (_LAYER + r"moe\.experts\.b2", _HF + "mlp.experts.down_proj_bias"),
    (_LAYER + r"moe\.experts\.(w1|w3)", _HF + "mlp.experts.gate_up_proj"),
    (_LAYER + r"moe\.experts\.(b1|b3)", _HF + "mlp.experts.gate_up_proj_bias"),
]
_HALF = {"w1": 0, "b1": 0, "w3": 1, "b3": 1}  # gate: even columns, up: odd


def hf_name(fqn: str) -> str:
    for src, dst in _NAMES:
        m = re.fullmatch(src, fqn)
        if m:
            groups = [g for g in m.groups() if g not in _HALF]
            return dst.format(*groups)
    raise KeyError(f"no Hugging Face name for gpt_oss parameter {fqn!r}")


def torchmeg_fqns(hf: str) -> list[str]:
    """The torchmeg tensors an HF tensor makes (gate_up_proj: w1 and w3; its bias: b1 and b3)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj(_bias)?", hf)
    if m:
        kind = "b" if m[2] else "w"
        return [f"layers.{m[1]}.moe.experts.{kind}1", f"layers.{m[1]}.moe.experts.{kind}3"]
    for src, dst in _NAMES:
        pattern = re.escape(dst).replace(r"\{\}", r"(\w+)")
        h = re.fullmatch(pattern, hf)
        if h:
            out = src
            for g in h.groups():
                out = re.sub(r"\([^)]*\)", g, out, count=1)
            return [out.replace("\\.", ".")]
    raise KeyError(f"no gpt_oss parameter for Hugging Face tensor {hf!r}")


def _rows(t: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Each head's rows (or bias entries) between transformers' halves and torchmeg's pairs."""
    w = t if t.dim() == 2 else t[:, None]
    out, dim = w.shape
    if to_hf:
        w = w.view(heads, out // heads // 2, 2, dim).transpose(1, 2).reshape(out, dim)
    else:
        w = w.view(heads, 2, out // heads // 2, dim).transpose(1, 2).reshape(out, dim)
    return w if t.dim() == 2 else w[:, 0]


def from_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    """The HF tensor t (hf_name(fqn)) as torchmeg's `fqn`."""
    last = fqn.rsplit(".", 1)[-1]
    if last in _HALF and ".experts." in fqn:
        return t[..., _HALF[last]::2]
    if re.search(r"attention\.w[qk]\.", fqn):
        return _rows(t, args.n_heads if ".wq." in fqn else args.kv_heads, to_hf=False)
    return t


def from_hf_state_dict(sd: dict, args) -> dict:
    """transformers tensors -> torchmeg's (gate_up_proj split into w1 and w3)."""
    return {f: from_hf(f, t, args) for name, t in sd.items() for f in torchmeg_fqns(name)}


def to_hf(fqn: str, t: torch.Tensor, args) -> torch.Tensor:
    """One torchmeg tensor in transformers' layout, but an expert's gate or up (to_hf_state_dict
    interleaves those two into one)."""
    if re.search(r"attention\.w[qk]\.", fqn):
        return _rows(t, args.n_heads if ".wq." in fqn else args.kv_heads, to_hf=True)
    return t


def to_hf_state_dict(sd: dict, args) -> dict:
    """torchmeg tensors -> transformers' (gate and up interleaved back into one tensor)."""
    out = {}
    for fqn, t in sd.items():
        if args.tie_embeddings and fqn == "output.weight":
            continue
        last = fqn.rsplit(".", 1)[-1]
        if last in ("w3", "b3") and ".experts." in fqn:
            continue
        if last in ("w1", "b1") and ".experts." in fqn:
            t = torch.stack([t, sd[fqn[:-2] + last[0] + "3"]], -1).flatten(-2)
        out[hf_name(fqn)] = to_hf(fqn, t, args).contiguous()
    return out


def config(args, rope_scaling: dict | None) -> dict:
    """GptOssForCausalLM's config.json for a torchmeg gpt_oss (rope_scaling: hf_export's, None for plain RoPE)."""
    layer_types = ["sliding_attention" if args.windowed(i) else "full_attention" for i in range(args.n_layers)]
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": args.vocab_size,
           "hidden_size": args.dim, "intermediate_size": args.moe_hidden, "num_hidden_layers": args.n_layers,
           "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
           "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k, "sliding_window": args.sliding_window,
           "layer_types": layer_types, "swiglu_limit": args.swiglu_limit, "rms_norm_eps": args.norm_eps,
           "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
           "attention_bias": args.attention_bias, "router_aux_loss_coef": args.aux_loss_coef,
           "hidden_act": "silu", "torch_dtype": "float32"}
    params = {"rope_theta": args.rope_theta, **(rope_scaling or {"rope_type": "default"})}
    cfg["rope_parameters"] = params
    return cfg
