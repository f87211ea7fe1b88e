"""One rank of the context-parallel kernel check (launched by tests/test_context.py).

Every rank builds the same full q/k/v (GQA: fewer kv heads), takes its load-balanced shard, runs
the CP attention of `mode`, and compares output and q/k/v gradients with one-device causal
attention on the full sequence. Also reports the attention work done (PairCounter) and the bytes
each collective moved (CommDebugMode). Prints one JSON line.
"""
import json
import sys

import torch
import torch.distributed as dist

from torchmeg.models.llama import causal_attention
from torchmeg.parallel import context as C
from torchmeg.runtime.process import finish_script


def planned_at_scale(mode: str, cp: int, L: int, H: int, K: int, D: int) -> None:
    """The kernel at the 128k recipe's real shapes under FakeTensorMode and a fake process group
    (no memory, no peers): the largest tensor any op produces, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    largest = [0, ""]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.numel() > largest[0]:
                    largest[:] = [t.numel(), f"{func} {tuple(t.shape)}"]
            return out
    with FakeTensorMode():
        attn = C.UlyssesAttention(mesh) if mode == "alltoall" else C.BlockAttention(mesh, mode)
        q = torch.randn(1, H, L // cp, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, K, L // cp, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        with Largest():
            attn(q, k, v).sum().backward()
    print(json.dumps({"mode": mode, "largest": largest[0], "op": largest[1], "local_x_seq": (L // cp) * L}))


def main():
    if sys.argv[1] == "planned":
        return planned_at_scale(*[sys.argv[2]] + [int(x) for x in sys.argv[3:8]])
    mode, cp, L, H, K, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    r = mesh.get_local_rank()
    g = torch.Generator().manual_seed(0)
    B = 2
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64) for h in (H, K, K))
    do = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = causal_attention(*ref)
    out_ref.backward(do)

    def shard(t):
        return C.shard_sequence(t.float(), r, cp, dim=2).contiguous().requires_grad_()
    qs, ks, vs = shard(q), shard(k), shard(v)
    attn = C.UlyssesAttention(mesh) if mode == "alltoall" else C.BlockAttention(mesh, mode)
    from torchmeg.parallel.comm_bytes import CommBytes
    C.PairCounter.pairs = 0.0
    with CommBytes() as comm:
        out = attn(qs, ks, vs)
        out.backward(C.shard_sequence(do.float(), r, cp, dim=2))
    counts = comm.get_comm_bytes()

    def err(a, b_full):  # relative to the reference's scale (conftest's rule)
        want = C.shard_sequence(b_full, r, cp, dim=2)
        return (a.double() - want).abs().max().item() / want.abs().max().item()
    res = {"rank": r, "out": err(out, out_ref.detach()), "dq": err(qs.grad, ref[0].grad),
           "dk": err(ks.grad, ref[1].grad), "dv": err(vs.grad, ref[2].grad),
           "pairs": C.PairCounter.pairs, "comm": counts}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, res)  # one printer: ranks writing at once would interleave lines
    if r == 0:
        print("\n".join(json.dumps(x) for x in every), flush=True)


if __name__ == "__main__":
    main()
    finish_script()  # collect, barrier, destroy, leave without teardown (runtime.process)
