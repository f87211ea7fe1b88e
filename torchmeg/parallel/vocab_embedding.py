"""Vocab-parallel embedding (Megatron's VocabParallelEmbedding; Shoeybi et al. 2019) as a DTensor style.

torch's RowwiseParallel on an nn.Embedding shards its rows (the vocabulary) and looks tokens up with
DTensor's masked-partial rule, but DTensor has no vocab-sharded rule for the backward (its
embedding_dense_backward strategies shard columns, the batch or a partial sum): every TP rank
all-gathers the output gradient and builds the whole vocab x dim gradient, replicated (measured,
torch 2.13: the weight's gradient arrives Replicate and full size on each rank; FSDP slices it
after). Under pipeline parallel FSDP holds that gradient upcast to fp32 from the first microbatch
to the step's reduce: 7.8 GiB on the first stage's ranks of a 405B TP 8 run, where their rows need
1 GiB.

Here each rank looks its own rows up with the other ranks' tokens masked, as Megatron does. The
forward is the same partial sum, reduced by the style's output redistribution (reduce-scatter
under SP, all-reduce without); the backward is that redistribution's one all-gather of the output
gradient, then a lookup gradient into this rank's rows only: the weight's gradient is Shard(0),
its local part vocab / tp x dim. Plain embeddings only (nn.Embedding's own forward, no max_norm,
sparse or scale_grad_by_freq): a subclass's forward (a scaled embedding) keeps torch's rule.
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import RowwiseParallel


def takes_vocab_parallel(module: nn.Module) -> bool:
    """An embedding whose lookup this style can replace: nn.Embedding's forward, no options that
    read the whole table (max_norm renormalizes rows in place; sparse / scale_grad_by_freq)."""
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and module.max_norm is None and not module.sparse and not module.scale_grad_by_freq)


def _lookup(self: nn.Embedding, tokens):
    w = self.weight
    mesh = w.device_mesh
    ids = tokens.to_local() if isinstance(tokens, DTensor) else tokens
    rows = w.to_local()  # its gradient comes back as the weight's own placement, Shard(0)
    n, lo = Shard.local_shard_size_and_offset(w.shape[0], mesh.size(), mesh.get_local_rank())  # Shard(0)'s rows
    hi = lo + n
    mine = (ids >= lo) & (ids < hi)
    pad = self.padding_idx - lo if self.padding_idx is not None and lo <= self.padding_idx < hi else None
    if hi > lo:
        out = nn.functional.embedding(torch.where(mine, ids - lo, 0), rows, pad)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
    else:  # more TP ranks than rows: this rank holds none
        out = rows.new_zeros(*ids.shape, w.shape[1]) + rows.sum() * 0
    return DTensor.from_local(out, mesh, (Partial(),), run_check=False)


class VocabParallelEmbedding(RowwiseParallel):
    """RowwiseParallel for an embedding (rows sharded, input replicated, output `output_layouts`)
    whose lookup and its gradient touch this rank's rows only (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_lookup, module)
        return module
