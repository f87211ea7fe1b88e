"""The bytes of a step as torch's MemTracker sees them (on fake or real tensors): live bytes by
category and their peak, shared by the dry run, the stage measurement and `--measure`."""
from __future__ import annotations

import functools

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily


def peak_bytes(mt) -> dict[str, int]:
    """MemTracker's peak snapshot summed over devices: {category: bytes}."""
    out: dict[str, int] = {}
    for dev, cats in mt.get_tracker_snapshot("peak").items():
        for k, v in cats.items():
            out[str(getattr(k, "value", k))] = out.get(str(getattr(k, "value", k)), 0) + int(v)
    return out


def step_memory(marks: dict | None = None):
    """torch's MemTracker (live bytes by category and their peak, from every op's outputs plus the
    parameters, gradients and optimizer state it is told about) without its per-module statistics:
    those refuse a module called twice in one step (gradient accumulation, pipeline microbatches).

    `marks` (module -> name): when each of those modules' backward ends, the peak since the previous
    mark is kept in `segments` under "backward <name> #<n>" (its n-th backward in the step) and the
    peak restarts. In backward a rank holds the activations of the blocks still to come and the
    gradients of those done: the step's peak may fall at the first block's backward or at the last
    one's, and which one changes with the depth (torchmeg.plan.depth scales each segment apart)."""
    class StepMemory(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            name = (marks or {}).get(module)
            if name is not None:
                n = sum(k.startswith(f"backward {name} #") for k in self.segments)
                self.segments[f"backward {name} #{n}"] = take_peak(self)

        def past(self, func, args, kwargs) -> tuple | None:
            """(func's result,) run with this tracker left out of its dispatch, where its dispatch would
            count nothing (see `allocates_nothing`), or None: the caller runs func through it. A mode
            above (StepCost) asks it for each op, and this tracker must be the next mode down. What its
            dispatch does is still done: its peak brought up to date (a storage resized since the last
            op, as FSDP's unsharded parameters are, counts from the next op on), and a view of a storage
            it does not hold yet is left to it (MemTracker starts holding a storage made before it was
            entered, e.g. a batch, at the first op whose output views it). ~45% of the ops that reach a
            tracker in a gpt-oss trace (views, profiler ranges, .item()); ~4% of the trace's time
            (docs/planning.md)."""
            if not allocates_nothing(func) or _get_current_dispatch_mode() is not self:
                return None
            with _pop_mode_temporarily():
                out = func(*args, **kwargs)
            if active_fake_mode() is not self._fake_mode_on_entry:  # (DTensor's sharding propagation: never counted)
                return (out,)
            if any(st not in self._WINFO for t in tensors(out) for st in get_untyped_storages(t)):
                return None  # (a view runs again, through the tracker: it has no effect of its own)
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            return (out,)
    mt = StepMemory()
    mt.segments = {}
    return mt


@functools.lru_cache(maxsize=None)
def allocates_nothing(func) -> bool:
    """An op that makes no storage: each of its outputs is a view of an input (an alias that writes
    nothing) or it returns no tensor at all (a profiler range, a scalar read). Only a view is ever run a
    second time (StepMemory.past hands it back): an op that returns no tensor may do something of its own
    (enter a profiler range) and has no output the tracker could need to hold."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    returns = func._schema.returns
    views = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return views or all("Tensor" not in str(r.type) for r in returns)


def tensors(x):
    """The tensors in an op's arguments or outputs (nested lists and tuples)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)


def current_bytes(mt, category: str = "Total") -> int:
    return sum(int(v) for cats in mt.get_tracker_snapshot("current").values()
               for k, v in cats.items() if str(getattr(k, "value", k)) == category)


def activation_bytes(memory: dict[str, int]) -> int:
    """Peak memory that is not parameters, buffers, gradients or optimizer state: activations,
    temporaries and gathered (unsharded) weights, at the step's peak."""
    static = sum(memory.get(k, 0) for k in ("Parameter", "Buffer", "Gradient", "Optstate"))
    return memory.get("Total", 0) - static


def take_peak(mt) -> dict[str, int]:
    """The peak snapshot so far (as peak_bytes), and the tracker's peak reset to what is live now: the
    next take_peak / peak_bytes reads the peak of what runs after (MemTracker restarts its peak the
    same way on entry; torch 2.13 has no public call for it)."""
    out = peak_bytes(mt)
    mt._peak_mem_snap = mt.get_tracker_snapshot()
    mt._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in mt._peak_mem_snap.items()}
    return out
