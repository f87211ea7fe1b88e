"""A Hugging Face config.json read as a torchmeg model: which native family implements it, and that
family's [model] keys. A field the native family does not implement is refused in one line naming
it (never dropped silently); a model type no native family covers is trained through `hf`
(transformers' own modules, torchmeg.models.hf_causal).
"""
from __future__ import annotations

from torchmeg.config.errors import ConfigError
from torchmeg.models.rope import ROPE_TYPES

# model_type -> (torchmeg model name, QK norm)
NATIVE = {"llama": ("llama", False), "qwen3": ("llama", True), "qwen3_moe": ("moe", True),
          "deepseek_v3": ("deepseek_v3", False), "gpt_oss": ("gpt_oss", False)}


def rope_parameters(config: dict) -> dict:
    """theta and scaling from either spelling transformers has used (rope_scaling + rope_theta, or
    transformers 5's rope_parameters)."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    params.update({k: v for k, v in legacy.items() if k not in params})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def _refuse(field: str, value, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field} = {value!r}: {why}; torchmeg's native model would compute "
                       f"something else, so it refuses (use --family hf to train transformers' own module)")


def _qwen3_moe_keys(config: dict) -> dict:
    """Qwen3-MoE's sparse block as torchmeg's moe: softmax router over num_experts, top-k, optionally
    renormalised; no shared experts; every layer routed (other layouts are refused by name)."""
    if config.get("mlp_only_layers"):
        raise _refuse("mlp_only_layers", config["mlp_only_layers"], "dense layers among routed ones are not implemented")
    if config.get("decoder_sparse_step", 1) != 1:
        raise _refuse("decoder_sparse_step", config["decoder_sparse_step"], "only every layer routed (1) is implemented")
    return {"n_experts": config.get("num_experts") or config["num_local_experts"], "top_k": config["num_experts_per_tok"],
            "moe_hidden": config["moe_intermediate_size"], "n_shared_experts": 0, "score_func": "softmax",
            "route_norm": bool(config.get("norm_topk_prob", False)), "balance": "aux_loss",
            "aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)), "n_dense_layers": 0}


def _deepseek_v3_keys(config: dict) -> dict:
    """DeepSeek-V3's MLA, DeepSeekMoE routing (sigmoid, aux-loss-free bias, group-limited top-k)
    and MTP depth; a routing it does not describe is refused by key."""
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise _refuse("scoring_func", config["scoring_func"], "DeepSeek-V3 scores with sigmoid only")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _refuse("topk_method", config["topk_method"], "DeepSeek-V3 selects with noaux_tc only")
    return {"q_lora_rank": config.get("q_lora_rank") or 0, "kv_lora_rank": config["kv_lora_rank"],
            "qk_nope_head_dim": config["qk_nope_head_dim"], "qk_rope_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"], "n_experts": config["n_routed_experts"],
            "top_k": config["num_experts_per_tok"], "moe_hidden": config["moe_intermediate_size"],
            "n_shared_experts": config.get("n_shared_experts") or 0, "score_func": "sigmoid", "balance": "bias",
            "route_norm": bool(config.get("norm_topk_prob", True)),
            "route_scale": float(config.get("routed_scaling_factor", 1.0)),
            "n_expert_groups": config.get("n_group") or 1, "topk_groups": config.get("topk_group") or 1,
            "n_dense_layers": config.get("first_k_dense_replace") or 0,
            # training settings config.json does not carry: DeepSeek-V3's published ones (sec. 4.2)
            "bias_update_rate": 0.001, "seq_aux_loss_coef": 0.0001,
            "mtp_depth": config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0}


def _gpt_oss_keys(config: dict) -> dict:
    """gpt-oss: sinks, windowed layers every `full_every` - 1 of each full one (layer_types), biased
    router and experts with the clamped SwiGLU; another layer pattern is refused by key."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else 0
    if not every or types != ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]:
        raise _refuse("layer_types", types, "only windowed layers with a full one every k-th (k >= 1) are implemented")
    if not config.get("attention_bias", True):
        raise _refuse("attention_bias", False, "gpt-oss's attention has biases")
    return {"n_experts": config["num_local_experts"], "top_k": config["num_experts_per_tok"],
            "moe_hidden": config["intermediate_size"], "n_shared_experts": 0, "score_func": "softmax",
            "route_norm": True, "balance": "aux_loss", "aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
            "n_dense_layers": 0, "router_bias": True, "experts_bias": True,
            "swiglu_limit": float(config.get("swiglu_limit", 7.0)), "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
            "sliding_window": int(config.get("sliding_window") or 128), "full_every": every, "attention_bias": True}


def native_model_keys(config: dict) -> tuple[str, dict] | None:
    """(torchmeg model name, [model] keys) for a config a native family implements, else None."""
    kind = config.get("model_type")
    if kind not in NATIVE:
        return None
    name, qk_norm = NATIVE[kind]
    oss = name == "gpt_oss"
    for field, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(field, ok) != ok and not (oss and field == "attention_bias"):
            raise _refuse(field, config[field], f"the native {name} has {field} = {ok!r} only")
    if config.get("pretraining_tp", 1) != 1:
        raise _refuse("pretraining_tp", config["pretraining_tp"], "only 1 is implemented")
    if not oss and (config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or [])):
        raise _refuse("use_sliding_window / layer_types", config.get("layer_types"), "sliding-window layers are not implemented")
    rope = rope_parameters(config)
    kind = rope.get("rope_type", "default") or "default"
    if kind not in ROPE_TYPES:
        raise _refuse("rope_parameters.rope_type", kind, f"implemented: {', '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", rope["partial_rotary_factor"], "only whole-head RoPE is implemented")
    heads = config["num_attention_heads"]
    keys = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": config.get("num_key_value_heads") or heads, "vocab_size": config["vocab_size"],
            "ffn_dim": config["intermediate_size"], "norm_eps": config.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope["rope_theta"]), "max_seq_len": config.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "qk_norm": qk_norm,
            "rope_type": kind}
    if kind != "default":
        keys.update(rope_factor=float(rope.get("factor") or 1.0),
                    rope_original_max_seq_len=int(rope.get("original_max_position_embeddings") or keys["max_seq_len"]))
    if kind == "llama3":
        keys.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]))
    if name == "moe":
        keys.update(_qwen3_moe_keys(config))
    if oss:
        keys.update(_gpt_oss_keys(config))
    if name == "deepseek_v3":  # (head_dim is the rotary part's, set by the model; no kv heads in MLA)
        for k in ("head_dim", "n_kv_heads", "qk_norm"):
            keys.pop(k)
        keys.update(_deepseek_v3_keys(config))
    if kind == "yarn":
        keys.update(rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                    rope_mscale=float(rope.get("mscale") or 0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                    rope_attention_factor=float(rope.get("attention_factor") or 0),
                    rope_truncate=bool(rope.get("truncate", True)))
    return name, keys
