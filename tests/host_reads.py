"""Host reads of tensor values, refused or counted: the dispatcher's _local_scalar_dense (.item(),
int(t), bool(t), ...); the ATen ops whose output shape depends on the values, which a CUDA kernel
can only size by reading them back (bincount, nonzero, unique, masked_select, repeat_interleave
without output_size, ...) — on a CPU they read nothing, so only a check at this level sees what
the GPU will do; and .tolist() / .numpy(), which do not dispatch, so they are patched for the
duration. Used by tests/test_moe.py and its EP worker."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


DATA_DEPENDENT = frozenset({"bincount", "nonzero", "nonzero_static_unbounded", "unique", "_unique", "_unique2",
                            "unique_dim", "unique_consecutive", "masked_select", "histc"})


class HostReads(TorchDispatchMode):
    """`refuse`: raise AssertionError("host sync: ...") at the first read; else count them in `n`."""

    def __init__(self, refuse: bool = True):
        super().__init__()
        self.refuse, self.n = refuse, 0

    def _read(self, what: str) -> None:
        if self.refuse:
            raise AssertionError(f"host sync: {what}")
        self.n += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func is torch.ops.aten._local_scalar_dense.default:
            self._read("a tensor's value was read on the host")
        elif name in DATA_DEPENDENT or (name == "repeat_interleave" and (kwargs or {}).get("output_size") is None):
            self._read(f"aten.{name}: its output's size depends on the values (read back to the host on CUDA)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, f in self._saved.items():
            def read(*a, _f=f, **k):
                self._read(".tolist() / .numpy()")
                return _f(*a, **k)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, f in self._saved.items():
            setattr(torch.Tensor, name, f)
        return super().__exit__(*exc)
