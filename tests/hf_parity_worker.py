"""Worker for tests/test_hf_models.py: transformers causal LMs through torchmeg.parallelize().

    WORLD_SIZE=N ... python tests/hf_parity_worker.py --families llama,qwen3 --layouts tp2,fsdp2

Per family, one tiny config built offline; the same model is trained whole on every rank
(the reference) and parallelized for each layout; 3 AdamW steps on the same global batches, each
data-parallel rank its slice. Rank 0 prints one JSON line per (family, layout): per-step loss and
grad-norm differences from the reference, and what parallelize() reported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
            "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config"}
# MoE families: 4 routed experts, top 2 (DeepSeek-V3: one shared expert, the first layer dense, MLA)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
       "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)}
LAYOUTS = {  # name: recipe overrides
    "tp2": dict(tensor_parallel_degree=2, data_parallel_shard_degree=1),
    "fsdp2": dict(data_parallel_shard_degree=-1),
    "tp2_fsdp2": dict(tensor_parallel_degree=2, data_parallel_shard_degree=-1),
    "fsdp2_compile_recompute": dict(data_parallel_shard_degree=-1),
    "ep2_fsdp2": dict(data_parallel_shard_degree=-1, expert_parallel_degree=2),
    "tp2_ep2_fsdp2": dict(tensor_parallel_degree=2, data_parallel_shard_degree=-1, expert_parallel_degree=2),
    "ep2_capacity": dict(data_parallel_shard_degree=-1, expert_parallel_degree=2, expert_capacity_factor=2.0),
}
STEPS, BATCH, SEQ = 3, 4, 32


def _loss(model, tokens):
    from torch.distributed.tensor import DTensor
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):  # loss_parallel: vocab-sharded logits, as the trainer computes it
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        return loss.full_tensor().detach()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _train(model, dp: int, dp_rank: int, group=None, ep: int = 1):
    from torchmeg.parallel.expert import expert_modules
    from torchmeg.train.optim import grad_norm
    expert_params = [p for m in expert_modules(model) for p in m.parameters()] if ep > 1 else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        loss = _loss(model, tokens.chunk(dp)[dp_rank])
        if group is not None:
            dist.all_reduce(loss, group=group)
        for p in expert_params:  # as the trainer: expert grads sum the ep group's tokens
            p.grad.div_(ep)
        out.append((loss.item() / dp, grad_norm(list(model.parameters()), []).item()))
        opt.step()
        opt.zero_grad()
    return out


def main():
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layouts", default="tp2,fsdp2,fsdp2_compile_recompute")
    a = ap.parse_args()
    import transformers

    from torchmeg.config.schema import Config
    from torchmeg.models import materialize
    from torchmeg.models.hf_causal import HFCausalLM, args_from_config
    from torchmeg.parallel import ParallelDims
    from torchmeg.parallel.expert import AllToAllDispatch, expert_modules
    from torchmeg.parallel.parallelize import parallelize
    from torchmeg.parallel.shards import local_block
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for fam in a.families.split(","):
        args = args_from_config(getattr(transformers, FAMILIES[fam])(**dict(TINY, **MOE.get(fam, {}))))
        with torch.device("meta"):
            ref = HFCausalLM(args)
        materialize(ref, "cpu", seed=0)
        reference = _train(ref, 1, 0)
        for layout in a.layouts.split(","):
            cfg = Config()
            for k, v in LAYOUTS[layout].items():
                setattr(cfg.parallelism, k, v)
            if "compile" in layout:
                cfg.compile.enable, cfg.compile.components = True, ["model"]
                cfg.activation_checkpoint.mode = "full"
            cfg.model.name = "hf"
            dims = ParallelDims.from_config(cfg, world)
            mesh = dims.build_mesh("cpu")
            with torch.device("meta"):
                model = HFCausalLM(args)
            parallelize(model, dims, cfg, mesh=mesh)
            materialize(model, "cpu", seed=0, block=local_block)
            got = _train(model, dims.dp, mesh["dp"].get_local_rank(), mesh["dp_cp"].get_group(), dims.ep)
            if dist.get_rank() == 0:
                rep = model.torchmeg_report
                print(json.dumps({
                    "family": fam, "layout": layout, "layers": args.n_layers,
                    "loss_rel_diff": max(abs(g[0] - r[0]) / abs(r[0]) for g, r in zip(got, reference)),
                    "grad_norm_rel_diff": max(abs(g[1] - r[1]) / r[1] for g, r in zip(got, reference)),
                    "loss": [g[0] for g in got], "ref_loss": [r[0] for r in reference],
                    "fsdp_units": rep.get("fsdp_units"), "compiled_blocks": rep.get("compiled_blocks"),
                    "recompute_blocks": rep.get("recompute_blocks"), "blocks": rep.get("blocks"),
                    "tp_entries": len(rep.get("tp_plan", {})), "sp_off": rep.get("sp_off"),
                    # MoE: experts modules, and those whose tokens travel to their owners (EP)
                    "experts": len(expert_modules(model)),
                    "experts_dispatched": sum(isinstance(getattr(m, "dispatch", None), AllToAllDispatch)
                                              for m in expert_modules(model)),
                    "hf_plan_entries": len(args.config.base_model_tp_plan)}), flush=True)


if __name__ == "__main__":
    from torchmeg.runtime.process import finish_script  # lazy: importing the worker for its tables stays cheap
    main()
    finish_script()  # collect, barrier, destroy, leave without teardown (runtime.process)
