"""Trace once, scale by structure: a dry run traces a few of a model's layers and scales the step by
how many of each kind it has.

A transformer repeats its blocks. Two blocks of the same kind (the same modules, parameter shapes and
settings: dense or MoE, windowed or full attention, recomputed or not) cost the same in every number
the planner measures: FLOPs, each op's bytes, each collective's bytes, the activations held to the
backward, the parameters, gradients and optimizer state. So a step's numbers are

    R(all layers) = R(B) + sum over kinds k of (m_k - 2) * (R(B + one more layer of kind k) - R(B))

where B keeps, in each pipeline stage, the first and the last layer (what differs by position: the
last block's backward starts the pass and is not re-gathered) and the first and the last middle
layer of each kind, and m_k counts the stage's middle layers of kind k (m_k - 2 of them not in B). Memory is
scaled segment by segment (the backward split at every traced block, memory.step_memory): in backward
a rank holds the activations of the blocks still to come and the gradients of those done, so over a
run of blocks of one kind the bytes change linearly and peak at the run's first or last block, both
traced (the 70B plan at FSDP 64 peaks in the second-to-last block's backward, 0.8 GiB above the last
one's). Layers of kinds with the same m_k go into one trace together, so a DeepSeek-V3 stage (dense then
MoE: its 3 dense layers all in the base) traces 6 + 7 layers. Without a pipeline a smaller base does
where each traced layer's neighbours are of the kinds its full-depth counterpart's are
(`one_middle_per_kind`): one middle layer of each kind, standing for both its first and its last,
then the last added: llama3_70b (80 layers, one kind) 3 + 4 layers, gpt-oss (windowed and full
alternating) 4 + 6.

What is traced is still the real program: the trainer's build with the layers not kept removed from
the model before the pipeline split and parallelize(), then one step on fake tensors. Every number
is then a linear combination of the traces (`combine`), ops as a multiset. `plan.trace_layers = "all"`
traces every layer instead: the reference `tests/test_plan_depth.py` holds the sampled plan to.
Models whose layers are not a ModuleDict of numbered blocks (the `hf` family's ModuleList) are traced
whole.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch.nn as nn

from torchmeg.parallel.recompute import recomputed

_SCALARS = (int, float, bool, str, type(None))


@dataclasses.dataclass
class Trace:
    """One dry run: the layer keys it keeps (None: all), the pipeline split of those, and its
    coefficient in the step's linear combination."""
    keep: set[str] | None
    stage_layers: tuple[int, ...] | None
    coeff: int
    stages: set[int] | None = None  # the stages this trace adds a layer to (None: the base, every stage)
    work: int = 0  # layers its jobs build: of the stages it adds to
    # layer key -> the memory segments its backward stands for, where not its own (one_middle_per_kind)
    roles: dict[str, tuple[str, ...]] | None = None


def signature(block: nn.Module) -> tuple:
    """What makes two blocks cost the same: every submodule's name and class, its parameters' shapes,
    dtypes and trainability, and its plain settings (a window, an expert count, a flag)."""
    out = []
    for name, mod in block.named_modules():
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in mod.named_parameters(recurse=False))
        settings = tuple(sorted((k, v) for k, v in vars(mod).items()
                                if not k.startswith("_") and k != "training"
                                and (isinstance(v, _SCALARS)
                                     or (isinstance(v, tuple) and all(isinstance(x, _SCALARS) for x in v)))))
        out.append((name, type(mod).__name__, params, settings))
    return tuple(out)


def layer_kinds(whole: nn.Module, spec, cfg) -> dict[str, int] | None:
    """Layer key -> kind number, in the model's layer order; None when the model's layers are not a
    ModuleDict keyed by layer number (then it is traced whole)."""
    layers = getattr(whole, spec.layers_attr, None)
    if not isinstance(layers, nn.ModuleDict) or not all(k.isdigit() for k in layers.keys()):
        return None
    sigs: dict = {}
    kinds = {}
    for i, (key, block) in enumerate(layers.items()):
        sig = (signature(block), recomputed(key, i, cfg.activation_checkpoint))
        kinds[key] = sigs.setdefault(sig, len(sigs))
    return kinds


def sample(kinds: dict[str, int] | None, stage_layers: tuple[int, ...] | None) -> list[Trace]:
    """The traces whose combination is the whole step (see the module doc). `stage_layers`: the
    pipeline's layers per stage (None without PP: one stage of every layer). Without a pipeline, the
    traces of one middle layer per kind where they hold (one_middle_per_kind): fewer layers."""
    if kinds is None:
        return [Trace(None, stage_layers, 1)]
    ends = _first_and_last_middle(kinds, stage_layers)
    if stage_layers is None:
        fewer = one_middle_per_kind(kinds)
        # (a trace of every layer has no work figure: it builds them all)
        if fewer is not None and sum(t.work for t in fewer) < sum(t.work or len(kinds) for t in ends):
            return fewer
    return ends


def _middle_by_kind(keys: list[str], kinds: dict[str, int]) -> dict[int, list[str]]:
    """Kind -> the layers between the first and the last of `keys`, in order."""
    middle: dict[int, list[str]] = {}
    for k in keys[1:-1]:
        middle.setdefault(kinds[k], []).append(k)
    return middle


def _first_and_last_middle(kinds: dict[str, int], stage_layers: tuple[int, ...] | None) -> list[Trace]:
    keys = list(kinds)
    counts = list(stage_layers) if stage_layers is not None else [len(keys)]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = [keys[a:a + n] for a, n in zip(starts, counts)]
    base: list[set[str]] = []
    extra: dict[int, list[tuple[int, str]]] = {}  # weight -> (stage, layer key) added in that trace
    for s, ks in enumerate(stages):
        keep = {ks[0], ks[-1]} if ks else set()
        for kind, ms in _middle_by_kind(ks, kinds).items():
            keep.update((ms[0], ms[-1]))
            if len(ms) > 2:
                extra.setdefault(len(ms) - 2, []).append((s, ms[1]))
        base.append(keep)
    if not extra:
        return [Trace(None, stage_layers, 1)]  # every layer is in the base: nothing to scale

    def trace(added: list[tuple[int, str]], coeff: int) -> Trace:
        keep = [set(b) for b in base]
        for s, k in added:
            keep[s].add(k)
        split = tuple(len(k) for k in keep) if stage_layers is not None else None
        touched = {s for s, _ in added} if added else None
        # (a trace is built only for the ranks whose stages it adds to: dry_run.DryRun.jobs)
        work = sum(len(k) for s, k in enumerate(keep) if touched is None or s in touched)
        return Trace(set().union(*keep), split, coeff, touched, work)
    traces = [trace([], 1 - sum(extra))]
    traces += [trace(added, w) for w, added in sorted(extra.items())]
    if sum(t.work for t in traces) >= len(keys):  # stages of a few layers: tracing them all is less
        return [Trace(None, stage_layers, 1)]
    return traces


def one_middle_per_kind(kinds: dict[str, int]) -> list[Trace] | None:
    """The step without a pipeline from a base of the first and the last layer and *one* middle layer of
    each kind with three or more (every middle layer of a kind with fewer), and the base plus the last
    middle layer of each such kind (one trace per distinct count, as above): R(all) = R(base) +
    sum_k (n_k - 1) (R(base + one of kind k) - R(base)). Memory is scaled segment by segment as before,
    a segment named by what it stands for: the base's one middle layer of a kind stands for both the
    first and the last middle layer of that kind (`roles`), the larger trace's two for one each; over a
    run of a kind's blocks the held bytes change by one block's activations or gradients per block, so
    both ends scale on their lines from one block to two as from two to three. That holds where each
    traced layer's neighbours (the blocks whose backward comes just before and after its own: FSDP's
    prefetch, the gradients just made) are of the kinds its full-depth counterpart's are; else None (the
    first and last middle layers are traced, above). gpt-oss (windowed and full attention alternating):
    4 + 6 layers for 6 + 8; a Llama 3 + 4 for 4 + 5; DeepSeek-V3 (its one-kind middle of MoE blocks follows
    the dense ones) as above."""
    keys = list(kinds)
    if len(keys) < 3:
        return None
    middle = _middle_by_kind(keys, kinds)
    base = {keys[0], keys[-1]}
    extra: dict[int, list[int]] = {}  # weight -> the kinds whose last middle layer that trace adds
    for kind, ms in middle.items():
        if len(ms) > 2:
            base.add(ms[0])
            extra.setdefault(len(ms) - 1, []).append(kind)
        else:
            base.update(ms)
    if not extra:
        return None
    at = {k: i for i, k in enumerate(keys)}

    def neighbours(order: list[str], i: int) -> tuple:
        return (kinds[order[i - 1]] if i > 0 else None, kinds[order[i + 1]] if i + 1 < len(order) else None)
    traces = []
    for w, added in [(1 - sum(extra), [])] + sorted(extra.items()):
        keep = base | {middle[kind][-1] for kind in added}
        roles: dict[str, tuple[str, ...]] = {}
        stands_for = {k: [k] for k in keep}  # traced layer -> the full-depth layers its segment stands for
        for kind, ms in middle.items():
            if len(ms) > 2:
                first, last = f"first middle of kind {kind}", f"last middle of kind {kind}"
                if ms[-1] in keep:
                    roles[ms[0]], roles[ms[-1]] = (first,), (last,)
                else:
                    roles[ms[0]] = (first, last)
                    stands_for[ms[0]] = [ms[0], ms[-1]]
        order = [k for k in keys if k in keep]
        for i, k in enumerate(order):
            if any(neighbours(order, i) != neighbours(keys, at[f]) for f in stands_for[k]):
                return None
        traces.append(Trace(keep, None, w, {0} if added else None, len(keep), roles))
    return traces


def by_role(piece: dict, roles: dict[str, tuple[str, ...]] | None) -> dict:
    """A non-pipeline trace's piece with its backward segments named by what they stand for
    (one_middle_per_kind): "backward <layer> #<n>" under each of its layer's roles."""
    if not roles:
        return piece
    step = piece["step"]
    phases = {}
    for name, snap in step["memory_phases"].items():
        layer, sep, n = name.removeprefix("backward ").rpartition(" #")
        if not (name.startswith("backward ") and sep and layer in roles):
            phases[name] = snap  # (the update, the first and the last layer, a kind's unscaled layers)
            continue
        for role in roles[layer]:
            phases[f"backward {role} #{n}"] = snap
    return dict(piece, step=dict(step, memory_phases=phases))


class NotLinear(Exception):
    """A traced number that does not scale with the layers as the combination assumes."""


def combine(results: list, coeffs: list[int]):
    """sum_i coeffs[i] * results[i], field by field: numbers summed, dicts key by key (a key missing
    from a trace counts 0), `ops` / `reduce_ops` lists as multisets of op tuples, `ranks` (a
    group's size) and anything not a number taken as it is."""
    if len(results) == 1:
        return results[0]
    return _comb(results, coeffs, None)


def _comb(vals: list, coeffs: list[int], key):
    present = [v for v in vals if v is not None]
    first = present[0]
    if isinstance(first, (bool, str)):
        return first
    if isinstance(first, (int, float)):
        if key == "ranks":
            return max(present)
        return sum(c * (v or 0) for c, v in zip(coeffs, vals))
    if isinstance(first, dict):
        out = type(first)()
        keys = dict.fromkeys(k for v in present for k in v)
        if key == "memory_phases":  # a segment of a layer only some traces keep says nothing of the whole
            keys = [k for k in keys if all(v is not None and k in v for v in vals)]
        for k in keys:
            out[k] = _comb([v.get(k) if v is not None else None for v in vals], coeffs, k)
        return out
    if key in ("ops", "reduce_ops"):
        return combine_ops([v or [] for v in vals], coeffs)
    return first


def combine_ops(lists: list[list[tuple]], coeffs: list[int]) -> list[tuple]:
    """Op multisets combined: each op tuple (flops, bytes, dtype, kind, fused bytes, cold bytes) counted
    sum_i coeffs[i] x its count in trace i. An op whose count comes out negative is one whose size
    grows with the layers (a foreach update, a norm over every gradient): with no FLOPs its time is
    its bytes over the bandwidth, linear, so those are folded into one correction op of (possibly
    negative) bytes; one with FLOPs would not be linear in its bytes, and is refused (NotLinear)."""
    total: Counter = Counter()
    for c, ops in zip(coeffs, lists):
        for op, n in Counter(ops).items():
            total[op] += c * n
    out, nbytes, fused, cold = [], 0, 0, 0
    for op, n in total.items():
        if n > 0:
            out += [op] * n
        elif n < 0:
            if op[3] == "subclass":  # (a count of host work only, none in the base's surplus)
                continue
            if op[0] or op[3] != "memory":
                raise NotLinear(f"an op with FLOPs changes with the depth: {op}")
            nbytes += n * op[1]
            fused += n * op[4]
            cold += n * op[5]
    if nbytes or fused or cold:
        out.append((0, nbytes, None, "memory", fused, cold))
    return out
