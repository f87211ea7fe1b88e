"""torch.compile per transformer block, and on the loss.

Per block, not whole-model: one compiled graph is reused by every identical block (one compile,
not n_layers), graph breaks cannot spread across blocks, and FSDP's per-block hooks stay outside
the graphs.
"""
from __future__ import annotations

import torch
from torch import nn

from torchmeg.parallel.data import blocks


def compile_blocks(model: nn.Module, tp: bool = False) -> None:
    layers = model.layers
    for name, block in list(layers.named_children()):
        layers.register_module(name, torch.compile(block, fullgraph=True))
    if tp and getattr(model, "tok_embeddings", None) is not None:
        # A compiled TP block fed straight from the TP embedding fails in backward
        # ('Tensor' object has no attribute '_local_tensor'); a clone of the embedding output
        # gives the graph an ordinary input (measured, torch 2.13).
        model.tok_embeddings.register_forward_hook(lambda m, i, out: out.clone())
    assert blocks(model)


def compile_loss(fn):
    return torch.compile(fn)
