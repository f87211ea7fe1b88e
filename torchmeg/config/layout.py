"""Layout: what a validated recipe means at a world size, derived once (torchmeg.train.validate) and handed
to the trainer, the planner and the layout search, so none of them re-derives any of it.

Batch arithmetic, per step: every one of the `dp` data-parallel ranks runs `accum` microbatches of
`local_batch` sequences, so the step trains on global_batch = local_batch x dp x accum sequences
(training.global_batch_size, or local_batch x dp when it is -1). With pipeline parallel the
schedule runs the rank's local_batch x accum sequences as `stages.microbatches` microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StagePlan:
    """The pipeline split: `layers[s]` layers in stage s, `per_rank` stages on each rank (virtual
    stages), run by `schedule` over `microbatches` microbatches per step."""
    schedule: str
    per_rank: int
    layers: tuple[int, ...]
    microbatches: int

    @property
    def n_stages(self) -> int:
        return len(self.layers)


@dataclass(frozen=True, eq=False)
class Layout:
    world_size: int
    dims: Any                 # torchmeg.parallel.dims.ParallelDims (named only: this module is a leaf)
    spec: Any                 # torchmeg.models.spec.ModelSpec
    args: Any                 # the model's argument dataclass, vocabulary resolved
    seq_len: int
    local_batch: int          # sequences per microbatch per data-parallel rank
    accum: int                # microbatches per step (gradient accumulation)
    global_batch: int         # sequences per step, all ranks: local_batch x dp x accum
    loss_parallel: bool       # cross entropy on vocab-sharded logits
    stages: StagePlan | None  # None without pipeline parallel
    rows_per_sample: int = 1  # sequences the model runs per sample: 2 for a dpo pair (chosen, rejected)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len * self.rows_per_sample

    @property
    def microbatches(self) -> int:
        """Microbatches one step runs on this rank: the schedule's under PP, else `accum`."""
        return self.stages.microbatches if self.stages is not None else self.accum
