"""Tensor parallel beyond a model's KV heads, for using a trained model: replicate the KV heads.

Under TP each rank holds n_heads / tp query heads and n_kv_heads / tp key/value heads, so tp cannot
exceed n_kv_heads (Llama-3-8B: 8; Qwen3's small models: 4 or 8). For generation and serving a rank
can instead hold a copy of the one KV head its query heads read: the model is built with tp KV
heads, head i a copy of the checkpoint's head i // (tp / n_kv_heads), which is the same model (GQA
maps query head h to KV head h // (n_heads / kv): each group of the n_kv_heads splits into tp /
n_kv_heads groups that read the same copy). Megatron does the same for inference and training;
here only inference: in training the copies' gradients would have to be summed.

The checkpoint keeps n_kv_heads: `ReplicatedKVState` loads its wk / wv whole (small: n_kv_heads x
head_dim rows) and copies into each rank's shard the rows of the head it serves.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from torchmeg.checkpoint.states import ModelState
from torchmeg.config.errors import ConfigError
from torchmeg.models.args import model_args
from torchmeg.models.deepseek_v3 import DeepSeekV3Args
from torchmeg.models.llama import Attention, LlamaArgs
from torchmeg.models.spec import get_spec


def replicate_kv_heads(cfg, tp: int) -> int:
    """With tp beyond the model's KV heads (and a multiple of them, dividing its query heads), build
    it with tp KV heads (a [model] override). -> the copies of each checkpoint head (1: none)."""
    if tp <= 1 or get_spec(cfg.model.name).hf_native:
        return 1
    args = model_args(cfg)
    # llama's attention (llama, moe, Qwen3); MLA (deepseek_v3) has no KV heads to run out of
    if not isinstance(args, LlamaArgs) or isinstance(args, DeepSeekV3Args) or tp <= args.kv_heads:
        return 1
    kv, heads = args.kv_heads, args.n_heads
    if tp % kv or heads % tp:
        raise ConfigError(f"{tp} processes (tensor parallel): beyond the model's {kv} KV heads TP replicates them, "
                          f"which needs a multiple of {kv} that divides n_heads = {heads}; launch such a number")
    cfg.model.overrides["n_kv_heads"] = tp
    return tp // kv


class ReplicatedKVState(ModelState):
    """The checkpoint's model state, for a model built by replicate_kv_heads."""

    def __init__(self, model, copies: int):
        super().__init__(model)
        self.copies = copies
        self.targets = {f"{m_name}.{w}.weight": getattr(m, w).weight for m_name, m in model.named_modules()
                        if isinstance(m, Attention) for w in ("wk", "wv")}

    def state_dict(self):
        sd = super().state_dict()
        for name in self.targets:  # what the checkpoint holds: n_kv_heads heads, read whole
            g = sd[name]
            sd[name] = torch.empty(g.shape[0] // self.copies, *g.shape[1:], dtype=g.dtype)
        return sd

    def load_state_dict(self, sd):
        whole = {name: sd.pop(name) for name in self.targets}
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=False))
        for name, p in self.targets.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            rank = p.device_mesh.get_local_rank() if isinstance(p, DTensor) else 0
            heads = whole[name].view(-1, local.shape[0], *local.shape[1:])  # [kv, head_dim, dim]: one head per rank
            with torch.no_grad():
                local.copy_(heads[rank // self.copies])
