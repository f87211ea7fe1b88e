"""LoRA's input dropout under tensor parallel: the masks one process draws.

A row-parallel base Linear (wo, w2) takes its input sharded by features, so an adapter beside it sees
this rank's columns only; drawn there, its dropout noise would be a [..., d / tp] tensor from the start
of the generator's stream, not the part of the [..., d] noise one process draws, and every mask after
it would follow suit. Here each rank draws the whole noise from the default generator (every rank
seeded alike, as one process: torchmeg.runtime.process) and keeps its part, so TP's masks are one
process's exactly; a column-parallel base's input is replicated, whose noise is the whole already.
The draw costs the whole input's elements on every rank of the group: dropout's noise is an
elementwise pass beside the base's matmul over the same input. Data-parallel ranks and pipeline
microbatches draw for their own rows (docs/limits.md says what that changes).
"""
from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchmeg.models import lora


class WholeNoiseDropout(lora.InputDropout):
    """InputDropout whose noise for a DTensor input is drawn at the input's global shape and sliced
    to this rank's part (any Shard placement; Replicate keeps the whole)."""

    def forward(self, x):
        if not self.training or not isinstance(x, DTensor):
            return super().forward(x)
        local = x.to_local()
        shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        part = self.noise(x.shape, local)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return DTensor.from_local(local * part, x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())


def draw_whole(adapter: lora.LoRA) -> None:
    """The adapter's dropout (if any) draws the whole input's noise (after its weights are sharded)."""
    if isinstance(adapter.dropout, lora.InputDropout) and not isinstance(adapter.dropout, WholeNoiseDropout):
        adapter.dropout = WholeNoiseDropout(adapter.dropout.p).train(adapter.dropout.training)
