"""torch.compile per transformer block, and on the loss.

Per block, not whole-model: one compiled graph is reused by every identical block (one compile,
not n_layers), graph breaks cannot spread across blocks, and FSDP's per-block hooks stay outside
the graphs.
"""
from __future__ import annotations

import torch
from torch import nn

from torchmeg.models.moe import is_grouped_experts
from torchmeg.models.blocks import blocks


def setup(cache_dir: str = "") -> None:
    """Where inductor keeps compiled kernels (a warm cache turns a ~17 s cold compile of a small
    block into ~3 s), and recompiles reported with their reason (each is a silent slowdown)."""
    import os
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    torch._logging.set_logs(recompiles=True)


def compile_blocks(model: nn.Module, tp: bool = False, cp: bool = False, blocks_path: str = "") -> int:
    """Compile every block in place; returns how many. No blocks is an error: compiling nothing
    while compile.enable = true would be a silent no-op."""
    found = blocks(model, blocks_path)
    if not found:
        raise ValueError("compile.enable = true: no blocks found to compile (no ModuleList / ModuleDict / "
                         "Sequential of layers in the model); name them with model.blocks / parallelize(blocks=...)")
    for block in found:
        # In place (nn.Module.compile): parameter names stay as the model wrote them. Dropless MoE
        # routing sizes each expert's slice from the data, and context-parallel attention talks to
        # its peers (both graph breaks), so those blocks compile in pieces; every other block must
        # compile whole.
        moe = any(is_grouped_experts(m) for m in block.modules())
        block.compile(fullgraph=not (moe or cp))
    if tp and getattr(model, "tok_embeddings", None) is not None:
        # A compiled TP block fed straight from the TP embedding fails in backward
        # ('Tensor' object has no attribute '_local_tensor'); a clone of the embedding output
        # gives the graph an ordinary input (measured, torch 2.13).
        model.tok_embeddings.register_forward_hook(lambda m, i, out: out.clone())
    return len(found)


def compile_loss(fn):
    return torch.compile(fn)
