"""Run by test_init.py in its own process: a fake process group at world size N (no peers needed),
the real parallelize(), then init of this rank's shards only. Prints one JSON line per layout:
whether every local block equals the same block of the one-process init, and which large sharded
parameters had a full-size tensor created while this rank initialised them."""
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from torchmeg.config.schema import Config
from torchmeg.models import build_model, init_weights, materialize
from torchmeg.parallel import ParallelDims
from torchmeg.parallel.parallelize import parallelize
from torchmeg.parallel.shards import local_block


class Created(TorchDispatchMode):
    """Shapes of the large plain tensors ops create (a DTensor is a view of shards, not storage)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not hasattr(t, "device_mesh") and t.numel() >= BIG:
                self.shapes.add(tuple(t.shape))
        return out


BIG = 4 * 65536  # elements: far more than init's chunk temporaries (64 Ki)


def main():
    world, rank = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    from torchmeg.models import canonical_fqn, get_spec, spec_tp_plan
    from torchmeg.parallel import pipeline as pl
    for model_name, tp, pp, legacy in (("llama", 1, 1, False), ("llama", 2, 1, False), ("llama", 2, 2, False),
                                       ("gpt2", 2, 1, False), ("moe", 2, 1, False), ("llama", 2, 1, True)):
        cfg = Config()
        cfg.model.name, cfg.model.flavor = model_name, "debug"
        cfg.model.overrides = {"dim": 512, "n_heads": 8} if model_name != "moe" else {"dim": 512, "moe_hidden": 512}
        cfg.parallelism.tensor_parallel_degree, cfg.parallelism.pipeline_parallel_degree = tp, pp
        cfg.parallelism.data_parallel_shard_degree = -1
        ref = build_model(cfg, 256, "cpu")
        init_weights(ref, seed=7)
        full = {k: v.detach() for k, v in ref.named_parameters()}
        dims = ParallelDims.from_config(cfg, world)
        mesh = dims.build_mesh("cpu")
        model = build_model(cfg, 256, "meta")
        if legacy:  # the old way, as a control: a rule torch's generator runs on the full tensor
            rule = {fqn: model.init_rule(fqn) for fqn, _ in model.named_parameters()}
            model.init_rule = lambda fqn: None
            model.param_init = lambda fqn, t, gen: t.normal_(0.0, getattr(rule[fqn], "std", 1.0), generator=gen)
        parts = [model]
        if pp > 1:  # this rank's stage, as the trainer cuts it
            v, counts = pl.plan_stages(cfg, model.args.n_layers, pp)
            ids = pl.stage_ids(mesh["pp"].get_local_rank(), pp, v, cfg.parallelism.pipeline_parallel_schedule)
            parts = pl.split_model(model, get_spec(model_name), counts, ids)
        same, big, made = True, set(), set()
        for part in parts:
            parallelize(part, dims, cfg, mesh=mesh, tp_plan=spec_tp_plan(get_spec(model_name), part),
                        plan_must_match=False)
            with Created() as created:
                materialize(part, "cpu", seed=7, block=local_block)
            made |= created.shapes
            for fqn, p in part.named_parameters():
                local, offset = local_block(p)
                want = full[canonical_fqn(fqn)][tuple(slice(o, o + n) for o, n in zip(offset, local.shape))]
                same &= legacy or torch.equal(local, want.to(local.dtype))
                if local.numel() < p.numel() and p.numel() >= BIG:
                    big.add(tuple(p.shape))
        print(json.dumps({"layout": f"{model_name} tp{tp} pp{pp} x fsdp{world // tp // pp} rank {rank}",
                          "legacy": legacy,
                          "same": bool(same), "big_sharded": len(big),
                          "full_tensors_made": sorted(big & made)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
