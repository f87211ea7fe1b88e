"""The bytes of a step as torch's MemTracker sees them (on fake or real tensors): live bytes by
category and their peak, shared by the dry run, the stage measurement and `--measure`."""
from __future__ import annotations

from torch.distributed._tools.mem_tracker import MemTracker


def peak_bytes(mt) -> dict[str, int]:
    """MemTracker's peak snapshot summed over devices: {category: bytes}."""
    out: dict[str, int] = {}
    for dev, cats in mt.get_tracker_snapshot("peak").items():
        for k, v in cats.items():
            out[str(getattr(k, "value", k))] = out.get(str(getattr(k, "value", k)), 0) + int(v)
    return out


def step_memory():
    """torch's MemTracker (live bytes by category and their peak, from every op's outputs plus the
    parameters, gradients and optimizer state it is told about) without its per-module statistics:
    those refuse a module called twice in one step (gradient accumulation, pipeline microbatches)."""
    class StepMemory(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass
    return StepMemory()


def current_bytes(mt, category: str = "Total") -> int:
    return sum(int(v) for cats in mt.get_tracker_snapshot("current").values()
               for k, v in cats.items() if str(getattr(k, "value", k)) == category)


def activation_bytes(memory: dict[str, int]) -> int:
    """Peak memory that is not parameters, buffers, gradients or optimizer state: activations,
    temporaries and gathered (unsharded) weights, at the step's peak."""
    static = sum(memory.get(k, 0) for k in ("Parameter", "Buffer", "Gradient", "Optstate"))
    return memory.get("Total", 0) - static
