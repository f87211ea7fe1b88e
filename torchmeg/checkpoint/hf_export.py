"""config.json for a native model, as transformers writes it: LlamaForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, DeepseekV3ForCausalLM or GptOssForCausalLM (its rope scaling as transformers
names it). A torchmeg model no transformers class computes is refused in one line naming the key.
"""
from __future__ import annotations

from torchmeg.checkpoint import hf_gpt_oss
from torchmeg.config.errors import ConfigError


def hf_config(args) -> dict:
    """transformers' config.json for a native model: LlamaForCausalLM, Qwen3ForCausalLM where the
    heads are QK-normed, Qwen3MoeForCausalLM for a moe of Qwen3-MoE's shape, DeepseekV3ForCausalLM,
    GptOssForCausalLM."""
    qwen3 = getattr(args, "qk_norm", False)
    if hasattr(args, "sliding_window"):
        return hf_gpt_oss.config(args, rope_scaling_config(args))
    if hasattr(args, "kv_lora_rank"):
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
