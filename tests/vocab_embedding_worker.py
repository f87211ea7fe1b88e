"""2 ranks on gloo: the TP plan's embedding roles against one process's nn.Embedding. Prints, from
rank 0, one JSON line per case: the forward and the gathered weight gradient against the reference
(largest difference over the largest value), the placement and local shape the weight's gradient
arrives with, and the backward's collectives."""
from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from torchmeg.parallel.tensor import style_for
from torchmeg.runtime.process import finish_script


class ScaledEmbedding(nn.Embedding):
    """A subclass with its own forward (as Hugging Face's Gemma scales its embedding)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def case(cls, vocab: int, pad, role: str, sp: bool, mesh) -> dict:
    torch.manual_seed(0)
    ref = cls(vocab, 16, padding_idx=pad)
    emb = cls(vocab, 16, padding_idx=pad)
    emb.load_state_dict(ref.state_dict())
    style = style_for(role, emb, sp=sp, loss_parallel=False)
    parallelize_module(emb, mesh, style)
    seen = []
    emb.weight.register_hook(lambda g: seen.append([str(g.placements), list(g.to_local().shape)]) or g)
    ids = torch.randint(0, vocab, (2, 12))
    ids[0, :3] = pad if pad is not None else 0  # the padding row, and tokens of both ranks' rows
    ids[1, :2] = vocab - 1
    out = emb(ids)
    want = ref(ids)
    weight = torch.arange(12).view(1, 12, 1)  # per position, so a gradient in the wrong row shows
    (want.pow(2) * weight).sum().backward()
    if sp:  # this rank's sequence shard
        want, weight = want.chunk(2, 1)[dist.get_rank()], weight.chunk(2, 1)[dist.get_rank()]
    comm = CommDebugMode()
    with comm:
        (out.pow(2) * weight).sum().backward()
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return {"style": type(style).__name__, "forward_err": rel(out, want),
            "grad_err": rel(emb.weight.grad.full_tensor(), ref.weight.grad), "grad_arrives": seen,
            "backward_collectives": {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    out = {"sp_odd_vocab": case(nn.Embedding, 1001, None, "embedding", True, mesh),
           "sp_pad_rank1": case(nn.Embedding, 1000, 700, "embedding", True, mesh),
           "replicated_pad_rank0": case(nn.Embedding, 1000, 7, "embedding_replicate", False, mesh),
           "subclass": case(ScaledEmbedding, 1000, None, "embedding", True, mesh)}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    finish_script()  # collect, barrier, destroy, leave without teardown (runtime.process)
