"""CommDebugMode that also counts bytes: torch's mode counts collectives per op but not their size.

Bytes are each collective's input on this rank (for an all-gather: the shard it contributes; for a
reduce-scatter or all-to-all: the full buffer it sends), keyed like `get_comm_counts()`.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode


class CommBytes(CommDebugMode):
    def __init__(self):
        super().__init__()
        self.bytes = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.comm_counts)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for op, n in self.comm_counts.items():
            if n != before.get(op, 0):
                t = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if t is not None:
                    self.bytes[op] += t.numel() * t.element_size()
        return out

    def get_comm_bytes(self) -> dict:
        return {str(k): v for k, v in self.bytes.items()}
