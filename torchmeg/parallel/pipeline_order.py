"""The order in which a pipeline schedule runs its actions, and that order played out on a clock.

The per-rank action lists come from torch itself (torch.distributed.pipelining builds them for a
schedule class; `get_schedule_ops` instantiates it with mock stages). `simulate` plays them out:
an action starts when its rank is free and its inputs exist (F(s,i) after F(s-1,i); backward of
(s,i) after its own forward and the backward of (s+1,i); W after I), with a forward of one stage
chunk = 1 unit, a full backward B = 2, its split halves I (input grad) and W (weight grad) = 1
each. Used by tools/pipeline_schedule.py (timelines) and the planner (bubble, activations in flight,
FSDP all-gathers per step: `fsdp_gathers`).
"""
from __future__ import annotations

import functools

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _add_unshard_reshard

DUR = {"F": 1, "B": 2, "I": 1, "W": 1}


def one_f_one_b(pp: int, m: int):
    """Schedule1F1B's order as its _step_microbatches runs it: rank r does p-1-r warm-up forwards,
    then alternates one forward / one backward, then drains the backwards. (torch 2.13's
    `pipeline_order` for 1F1B, used only for visualisation, is shifted by one microbatch on the
    last rank — F1..F8 for m = 8 — so it is not used here.)"""
    out = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        row = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                row.append(("F", r, f))
                f += 1
            row.append(("B", r, b))
            b += 1
        out.append(row)
    return out


@functools.lru_cache(maxsize=64)
def torch_actions(schedule: str, pp: int, m: int, v: int | None) -> tuple[tuple[tuple, ...], ...]:
    """Per rank, its actions in order as (kind, stage, microbatch). Kept per schedule and size (read-only
    tuples): a pipeline plan asks for them twice, its trace (activations in flight) and its stage times
    (plan.predict.stage_times), and torch builds an interleaved order of PP 8 x 32 microbatches in ~0.1 s."""
    return tuple(tuple(row) for row in _actions(schedule, pp, m, v))


def _actions(schedule: str, pp: int, m: int, v: int | None) -> list[list[tuple]]:
    if schedule == "1F1B":
        return one_f_one_b(pp, m)
    ops = get_schedule_ops(schedule, pp, m, num_stages_per_rank=v)
    names = {"FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FORWARD": "F"}
    out = []
    for rank_ops in ops:
        row = []
        for a in rank_ops:
            if a is None:
                continue
            # DualPipeV pairs a forward of one stage with a backward of another (OVERLAP_F_B);
            # on one device they still take the sum of their times, so play them in order.
            for sub in (a.sub_actions or ()) if a.computation_type.name == "OVERLAP_F_B" else (a,):
                kind = names.get(sub.computation_type.name)
                if kind:
                    row.append((kind, sub.stage_index, sub.microbatch_index))
        out.append(row)
    return out


def simulate(actions, scale=None):
    """-> per rank list of (start, end, kind, stage, mb); raises if the order deadlocks. `scale`: per rank,
    the seconds of one unit of its actions (its stages' own speed), else every rank's unit is 1."""
    n_stages = 1 + max(s for row in actions for _, s, _ in row)
    done: dict = {}
    free = [0] * len(actions)
    pos = [0] * len(actions)
    timeline = [[] for _ in actions]
    remaining = sum(len(r) for r in actions)
    while remaining:
        progressed = False
        for r, row in enumerate(actions):
            if pos[r] >= len(row):
                continue
            kind, s, i = row[pos[r]]
            if kind == "F":
                deps = [("F", s - 1, i)] if s > 0 else []
            elif kind in ("B", "I"):
                deps = [("F", s, i)] + ([("bwd", s + 1, i)] if s < n_stages - 1 else [])
            else:
                deps = [("bwd", s, i)]
            if all(d in done for d in deps):
                start = max([free[r]] + [done[d] for d in deps])
                end = start + DUR[kind] * (scale[r] if scale else 1)
                timeline[r].append((start, end, kind, s, i))
                done[(kind, s, i)] = end
                if kind in ("B", "I"):
                    done[("bwd", s, i)] = end
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks under the dependency model")
    return timeline


def held_peak(row, stages: dict) -> int:
    """The most bytes a rank holds as it plays its row of actions (torch_actions): each forward
    adds its stage's activations (`act`), held to that microbatch's backward (B, or W where the
    schedule splits it); every action peaks at what is held plus its own transient
    (`fwd_transient` / `bwd_transient`). `stages`: {stage: {act, fwd_transient, bwd_transient[,
    grads]}}; `grads`: what a stage's first backward makes and the rank holds to the step's end (the
    gradients, or FSDP's unsharded accumulated ones): made block by block as that backward frees the
    microbatch's activations block by block, so held from its end, and that backward peaks at its
    start or its end (before, it had been counted from the step's start: the first pipeline rank,
    whose peak comes before its first backward, planned 1.09x the run's in bf16)."""
    return held_peak_and_grads(row, stages)[0]


def held_peak_and_grads(row, stages: dict) -> tuple[int, int]:
    """held_peak, and the stages' `grads` held at that peak."""
    live, peak, made, held = 0, (0, 0), set(), 0
    for kind, s, _ in row:
        st = stages[s]
        if kind == "F":
            live += st["act"]
            peak = max(peak, (live + st["fwd_transient"], held))
        else:
            frees = kind in ("B", "W")
            grads = st.get("grads", 0) if frees and s not in made else 0
            peak = max(peak, (live + st["bwd_transient"], held),
                       (live - (st["act"] if frees else 0) + grads + st["bwd_transient"], held + grads))
            if frees:
                live += grads - st["act"]
                held += grads
                made.add(s)
    return peak


def makespan(actions, busy) -> float:
    """The schedule's length when rank r's actions take busy[r] in all (each action its share by its
    units: a backward twice a forward): stages of unequal work, as a pipeline's first and last are (the
    embedding; the output layer and the loss), wait on the slowest only where the order makes them."""
    units = [sum(DUR[k] for k, _, _ in row) or 1 for row in actions]
    timeline = simulate(actions, [b / u for b, u in zip(busy, units)])
    return max((e for row in timeline for _, e, *_ in row), default=0.0)


def bubble(timeline) -> float:
    end = max(e for row in timeline for _, e, *_ in row)
    busy = [sum(e - s for s, e, *_ in row) for row in timeline]
    return sum(end - b for b in busy) / sum(busy)


def fsdp_gathers(schedule: str, pp: int, m: int, v: int | None, per_microbatch: bool) -> list[dict[int, tuple]]:
    """Per rank, per stage: (all-gathers of the stage's root parameters, all-gathers of its blocks)
    in one step, as torch 2.13 runs FSDP stages. Every microbatch's backward leaves the weights
    gathered (FSDP's post-backward reshard is off until the step's one gradient reduce), so a
    stage gathers once per step; with `per_microbatch` each block reshards after every forward
    and the next forward or backward of the stage gathers it again (the root never reshards
    after forward). The multi-stage schedules also unshard up to three stages ahead and reshard
    the ones they leave: torch's own lowering (`_add_unshard_reshard`) is replayed for them.
    `v`: stages per rank, None for the single-stage schedules (as torch_actions)."""
    if v is None:
        rows = [[(k, s) for k, s, _ in row] for row in torch_actions(schedule, pp, m, None)]
    else:
        names = {"UNSHARD": "U", "RESHARD": "R", "FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
                 "BACKWARD_WEIGHT": "W"}
        rows = []
        for ops in get_schedule_ops(schedule, pp, m, num_stages_per_rank=v):
            row = []
            for b in _add_unshard_reshard(list(ops)):
                for a in (b.sub_actions or ()) if b.computation_type.name == "OVERLAP_F_B" else (b,):
                    if a.computation_type.name in names:
                        row.append((names[a.computation_type.name], a.stage_index))
            rows.append(row)
    out = []
    for row in rows:
        held, count = {}, {}
        for kind, s in row:
            h, c = held.setdefault(s, [False, False]), count.setdefault(s, [0, 0])
            if kind == "R":
                h[:] = [False, False]
            elif kind in ("U", "F", "B", "I"):
                for i in (0, 1):
                    c[i] += not h[i]
                    h[i] = True
                if kind == "F" and per_microbatch:
                    h[1] = False
        out.append({s: tuple(c) for s, c in count.items()})
    return out
