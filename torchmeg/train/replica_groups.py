"""What replica groups share (torchmeg.train.fault_tolerance): the batches a step's membership reads,
the gradient average across groups, a digest of the weights to compare groups by, and the job's id."""
from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchmeg.data.dataset import StepSampler

BUCKET_ELEMENTS = 1 << 26  # cross-group all-reduce buffers of at most 64M elements (256 MiB in fp32)


def job_id() -> str:
    """The job these groups belong to: torchmeg.replicas sets TORCHMEG_FT_JOB_ID; a Slurm job has its id."""
    return os.environ.get("TORCHMEG_FT_JOB_ID") or os.environ.get("SLURM_JOB_ID", "")


def process_started_at() -> float | None:
    """When this process started (epoch seconds, to 10 ms), from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assign_local(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a local shard received from a peer into this rank's tensor (a DTensor: its local shard)."""
    with torch.no_grad():
        local(target).copy_(value)


def step_batches(dataset, local_batch: int, dp: int, dp_rank: int, accum: int, cursor: int, participants: int,
                 participant: int) -> list:
    """This rank's microbatches of a step that `participants` groups take part in, from global sample
    `cursor` on: StepSampler's layout of one global batch with the groups as a data-parallel dimension
    outside the group's own, the group with participating rank p reading the p-th group batch (so with
    every group taking part, every step reads what a plain HSDP run of groups x dp reads)."""
    collate = getattr(dataset, "collate", None) or torch.utils.data.default_collate
    idx = list(StepSampler(local_batch, participants * dp, participant * dp + dp_rank, accum, 0, 1, cursor))
    return [collate([dataset[i] for i in idx[m * local_batch:(m + 1) * local_batch]]) for m in range(accum)]


def average_across_groups(manager, tensors: list[torch.Tensor]) -> None:
    """All-reduce (mean over the groups taking part) `tensors` in place through the manager, a flat
    buffer per dtype (at most BUCKET_ELEMENTS each). After an error the manager's works are no-ops and
    the values are garbage: should_commit is then False and the step is discarded."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    pending = []
    for group in by_dtype.values():
        bucket, n = [], 0
        for t in group + [None]:
            if t is None or (bucket and n + t.numel() > BUCKET_ELEMENTS):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                pending.append((manager.allreduce(flat), flat, bucket))
                bucket, n = [], 0
            if t is not None:
                bucket.append(t)
                n += t.numel()
    for work, flat, bucket in pending:
        work.wait()
        for t, piece in zip(bucket, flat.split([b.numel() for b in bucket])):
            t.copy_(piece.view_as(t))


def weights_digest(model, group=None) -> str:
    """sha256 over every rank's local parameter shards (the group's ranks' digests gathered in rank
    order): equal in two groups iff their weights are bit-for-bit equal. 12 hex digits."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(local(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, h.hexdigest(), group=group)
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:12]
