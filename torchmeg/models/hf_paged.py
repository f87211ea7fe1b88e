"""transformers' models over the serving engine's paged KV cache, batched, as vLLM's Transformers
backend runs them: an attention function registered in transformers' `AttentionInterface`.

A transformers model computes its queries, keys and values its own way (its projections, norms,
rotary embeddings from the positions it is given) and hands them to the attention function its
config names. Under the name `torchmeg_paged` that function writes the new keys and values into the
engine's pool (batching.paged, through the block tables of the step) and attends over what each
sequence's table holds: every sequence of a step in one forward, where a model keeping its own cache
(transformers' `DynamicCache`) runs one forward per sequence. The model is called without a cache of
its own (`use_cache=False`) and the cache of the step is this module's context (`paged`); the mask
transformers would build is not used (its mask function here builds none): the pool's own (each
sequence's keys, causally; packed prompts block-diagonal), with the layer's sliding window when it
passes one.

What the function does not compute — logit soft-capping (Gemma 2), attention sinks (gpt-oss) —
`supports(config)` rules out before a server starts (those models keep their own cache and run one
sequence a forward), and an unexpected argument raises rather than being ignored.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

NAME = "torchmeg_paged"
_CACHE: contextvars.ContextVar = contextvars.ContextVar("torchmeg_paged_cache", default=None)
# the arguments transformers' attention modules pass that this function handles or may ignore
_HANDLED = {"sliding_window", "position_ids", "cache_position", "use_cache", "output_attentions",
            "is_causal", "layer_idx", "past_key_values", "cache"}


def supports(config, layers) -> bool:
    """Whether a transformers model's attention is what `attention` computes: every decoder layer
    (`layers`) attends through `self_attn` (no recurrent or linear-attention layer, whose state a cache
    of keys and values does not hold), full or sliding, without soft-capping, sinks or chunks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None) or getattr(text, "attention_chunk_size", None):
        return False  # (Gemma 2's soft-capping; Llama 4's chunked attention)
    if getattr(text, "model_type", "") == "gpt_oss" or set(getattr(text, "layer_types", None) or ()) - {
            "full_attention", "sliding_attention"}:
        return False  # (gpt-oss's sinks; hybrid models' linear-attention or recurrent layers)
    if not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx") for layer in layers):
        return False
    return getattr(text, "is_causal", True) and not getattr(text, "is_encoder_decoder", False)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling=None,
              dropout: float = 0.0, sliding_window=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, L, D], the new key / value [B, K, L, D] ->
    (output [B, L, H, D], no weights)."""
    cache = _CACHE.get()
    if cache is None:
        raise RuntimeError(f"attention {NAME!r} runs inside torchmeg's serving engine only")
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _HANDLED)
    if extra or dropout:
        raise NotImplementedError(f"{type(module).__name__} passes {extra or 'dropout'} to its attention, which "
                                  f"the paged KV cache does not compute (torchmeg.models.hf_paged.supports)")
    n = query.shape[2]
    k, v = cache.layer(f"hf.{module.layer_idx}").update(key, value)
    mask = cache.mask(n, k.shape[2])
    if sliding_window:  # transformers' rule: key j visible from query i when i - j < window
        q_at = cache.query_slots(n)[:, None, :, None]
        mask = mask & (q_at - torch.arange(k.shape[2], device=q_at.device) < sliding_window)
    out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype), attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


_registered = False


@contextlib.contextmanager
def paged(model_config, cache):
    """A forward of a transformers model whose attention reads and writes `cache` (batching.paged)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # lazy: the hf extra
        from transformers.masking_utils import AttentionMaskInterface
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, _no_mask)
        _registered = True
    before = model_config._attn_implementation
    token = _CACHE.set(cache)
    model_config._attn_implementation = NAME
    try:
        yield
    finally:
        model_config._attn_implementation = before
        _CACHE.reset(token)
