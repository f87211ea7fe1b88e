"""What a step's memory-bound ops cost once torch.compile has fused them.

Inductor fuses chains of pointwise ops and reductions into one kernel between the ops it leaves to
libraries (matmuls, attention) and the collectives, so a fused chain reads from memory only what
comes from outside it and writes only what is read after it. StepCost records, for every op, the
storages it reads and writes; `fused_bytes` replays them: consecutive fusable ops form one group,
and each op's bytes become its share of the group's boundary traffic (reads of tensors produced
outside the group, each view once, plus writes that an op outside the group reads, or nobody does).

Not fused: matmuls and attention (library kernels), collectives, FSDP's own copy-in / copy-out ops
and the optimizer's update, which the trainer never compiles (StepCost.eager, set around it by
dry_run.track_step). The grad norm is left fusable: its per-gradient norms read each gradient once
either way.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class Traffic:
    """One op's memory traffic: (storage, view) keys with bytes, and whether Inductor could fuse it."""
    reads: list = field(default_factory=list)    # (storage key, view key, bytes)
    writes: list = field(default_factory=list)   # (storage key, bytes)
    fusable: bool = False
    starts_group: bool = False                   # a collective ran just before: fusion cannot cross it
    ghost: bool = False                          # no kernel (a tensor subclass's op, counted for its host cost)


# storage address -> (a weak reference to the storage, its number): a freed storage's address is
# reused by the next allocation, and keyed by address the two were one storage (which made the fused
# bytes, and so the predictions, vary by ~0.5% from run to run with where the allocator put things)
_NUMBERS: dict[int, tuple] = {}
_NEXT = itertools.count()


def storage_key(t: torch.Tensor):
    """A number for the storage under `t`, the same for every view of it while it lives, never reused."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own: count it by identity
        return ("id", id(t))
    hit = _NUMBERS.get(st._cdata)
    if hit is None or hit[0]() is not st:
        hit = _NUMBERS[st._cdata] = (weakref.ref(st), next(_NEXT))
    return hit[1]


def traffic(args, out, fusable: bool, tensors) -> Traffic:
    tr = Traffic(fusable=fusable)
    for t in tensors(list(args)):
        key = storage_key(t)
        tr.reads.append((key, (key, t.storage_offset(), tuple(t.shape), t.dtype), t.numel() * t.element_size()))
    for t in tensors(out):
        tr.writes.append((storage_key(t), t.numel() * t.element_size()))
    return tr


def fused_bytes(records: list[Traffic]) -> list[int]:
    """Per op, the bytes it moves once fused into its group (an unfusable op keeps all of its own)."""
    group, g, prev = [], -1, None  # prev: the last record that is a kernel
    for i, r in enumerate(records):
        if r.ghost:
            group.append(None)
            continue
        if r.fusable:
            if prev is None or not prev.fusable or r.starts_group:
                g += 1
            group.append(g)
        else:
            group.append(None)
        prev = r
    # Who produced each read, and who reads each write (storages are reused once freed: the
    # last writer before a read is its producer).
    writer: dict = {}
    produced_by: list[list] = []
    readers: dict = {}  # (op, storage key) -> groups (None: unfusable) of the ops that read it
    for i, r in enumerate(records):
        prods = []
        for key, view, nbytes in r.reads:
            p = writer.get(key)
            prods.append(p)
            if p is not None:
                readers.setdefault((p, key), []).append(group[i])
        produced_by.append(prods)
        for key, _ in r.writes:
            writer[key] = i
    out, seen = [], set()
    for i, r in enumerate(records):
        if group[i] is None:  # (a ghost has no reads or writes: 0)
            out.append(sum(n for _, _, n in r.reads) + sum(n for _, n in r.writes))
            continue
        g, total = group[i], 0
        for (key, view, nbytes), p in zip(r.reads, produced_by[i]):
            if (p is None or group[p] != g) and (g, view) not in seen:
                seen.add((g, view))
                total += nbytes
        for key, nbytes in r.writes:
            after = readers.get((i, key))
            if not after or any(x != g for x in after):
                total += nbytes
        out.append(total)
    return out
