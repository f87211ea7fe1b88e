"""The bytes of a step as torch's MemTracker sees them (on fake or real tensors): live bytes by
category and their peak, shared by the dry run, the stage measurement and `--measure`."""
from __future__ import annotations

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker


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
    mt = StepMemory()
    mt.segments = {}
    return mt


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
