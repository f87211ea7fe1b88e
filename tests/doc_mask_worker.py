"""Worker for tests/test_documents.py: a window packing documents A|B|C through the real build
(validate -> build_parallel_model -> the trainer's microbatch loop / pipeline schedule) under one
layout, its per-token losses compared with each document run alone on one process.

    python tests/doc_mask_worker.py LAYOUT      (launched as WORLD ranks; prints one JSON line)
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

LAYOUTS = {  # name: (world, parallelism overrides)
    "single": (1, {}),
    "tp2": (2, {"tensor_parallel_degree": 2}),
    "cp2_allgather": (2, {"context_parallel_degree": 2, "context_parallel_mode": "allgather"}),
    "cp2_alltoall": (2, {"context_parallel_degree": 2, "context_parallel_mode": "alltoall"}),
    "pp2": (2, {"pipeline_parallel_degree": 2}),
    "tp2_cp2": (4, {"tensor_parallel_degree": 2, "context_parallel_degree": 2}),
}
LENGTHS = (13, 30, 21)  # A, B, C: boundaries inside the chunks of every layout above (L = 64)
L = 64


def main():
    name = sys.argv[1]
    from torchmeg.runtime import process as runtime
    from torchmeg.train.build import ModelStep, build_parallel_model, forward_backward
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model, materialize
    from torchmeg.parallel.context import shard_sequence
    from torchmeg.train.validate import validate
    world, par = LAYOUTS[name]
    over = [f"--parallelism.{k}={v}" for k, v in par.items()]
    cfg = load_config(None, ["--model.dim=128", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                             "--model.multiple_of=64", f"--data.seq_len={L}", "--training.local_batch_size=2",
                             "--data.document_masking=true", "--parallelism.loss_parallel=false"] + over)
    layout = validate(cfg, world, data=False)
    device, mesh, ep_mesh = runtime.start(cfg, layout.dims)
    recorded = []

    def loss_fn(logits, labels):  # per-token losses kept, their mean returned (as the trainer's)
        per = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none")
        recorded.append(per.detach().view(labels.shape))
        return per.mean()
    built = build_parallel_model(cfg, layout, mesh, ep_mesh, device, seed=0, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]
    stream = torch.cat(docs + [torch.randint(0, 256, (1,), generator=g)])
    row2 = torch.randint(0, 256, (L + 1,), generator=g)  # a second row: one document
    tokens = torch.stack([stream, row2])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]), torch.zeros(L, dtype=torch.long)])
    batch = (tokens[:, :-1], tokens[:, 1:], documents)
    ms = ModelStep.of(built, layout, mesh, device, loss_fn)
    forward_backward(ms, [batch])
    got = _global_losses(recorded, layout, mesh, shard_sequence)
    out = {"layout": name, "world": world}
    if dist.get_rank() == 0:
        ref = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0)
        want, s = [], 0
        for n in LENGTHS:  # each document alone; its last target is the next document's first token
            inp, tgt = tokens[0, s:s + n], tokens[0, s + 1:s + n + 1]
            want.append(F.cross_entropy(ref(inp[None])[0], tgt, reduction="none"))
            s += n
        want = torch.stack([torch.cat(want), F.cross_entropy(ref(tokens[1:, :-1])[0], tokens[1, 1:], reduction="none")])
        # relative to the losses' scale (conftest's rule: fp32 rounds relative to size)
        out["max_rel_diff"] = (got - want.detach()).abs().max().item() / want.abs().max().item()
        out["dense_diff"] = (got[0] - F.cross_entropy(ref(tokens[:1, :-1])[0], tokens[0, 1:], reduction="none")
                             ).abs().max().item()  # without masking the packed row is another computation
        print(json.dumps(out), flush=True)


def _global_losses(recorded, layout, mesh, shard_sequence) -> torch.Tensor:
    """This layout's per-token losses of the batch, [2, L] in sequence order, on every rank."""
    dims = layout.dims
    # (the schedule's first step also calls the loss once to set itself up: the last calls are the step's)
    have = torch.cat(recorded[-layout.microbatches:]) if recorded else None
    if dims.pp > 1:  # recorded on the last stage's rank only
        box = [have]
        dist.broadcast_object_list(box, src=dist.get_global_rank(mesh["pp"].get_group(), dims.pp - 1),
                                   group=mesh["pp"].get_group())
        have = box[0]
    if dims.cp > 1:  # each cp rank holds its chunks: gather and put them in order
        parts = [None] * dims.cp
        dist.all_gather_object(parts, have, group=mesh["cp"].get_group())
        full = torch.empty(2, L)
        for r, part in enumerate(parts):
            idx = shard_sequence(torch.arange(L)[None], r, dims.cp)[0]
            full[:, idx] = part
        have = full
    return have


if __name__ == "__main__":
    from torchmeg.runtime.process import finish_script  # lazy: importing the worker for its tables stays cheap
    main()
    finish_script()  # collect, barrier, destroy, leave without teardown (runtime.process)
