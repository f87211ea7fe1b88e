#!/usr/bin/env python
"""Init time per rank at real scale, on a CPU, through the trainer's own build.

    python tools/init_bench.py --flavor 8B --world 8            # Llama-3 8B, FSDP 8, rank 0
    python tools/init_bench.py --flavor 70B --world 64 --tp 8   # needs ~18 GB of RAM

This process plays one rank of a fake process group of `--world` ranks: the model is built on meta,
parallelized by the real parallelize() and materialised with real storage for this rank's shards,
each initialised from (seed, FQN, element index) — what every rank of a real run does, with no
peers needed. Side by side, on the first block's parameters only (their full tensors fit), it times
the previous way: every rank draws each full parameter with torch's generator and slices its
block. Prints elements, seconds and the ratio; one thread (--threads to change).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchmeg.config.schema import Config
    from torchmeg.models import build_model, canonical_fqn, get_spec, materialize, param_seed, spec_tp_plan
    from torchmeg.models.init import fill_block_
    from torchmeg.parallel import ParallelDims
    from torchmeg.parallel.parallelize import parallelize
    from torchmeg.parallel.shards import local_block
    torch.set_num_threads(a.threads)
    dist.init_process_group("fake", store=FakeStore(), rank=a.rank, world_size=a.world)
    cfg = Config()
    cfg.model.name, cfg.model.flavor = "llama", a.flavor
    cfg.parallelism.tensor_parallel_degree, cfg.parallelism.data_parallel_shard_degree = a.tp, -1
    cfg.training.mixed_precision = "bf16"
    dims = ParallelDims.from_config(cfg, a.world)
    model = build_model(cfg, 128256, "meta")
    model = parallelize(model, dims, cfg, mesh=dims.build_mesh("cpu"),
                        tp_plan=spec_tp_plan(get_spec("llama"), model), plan_must_match=False)
    full = sum(p.numel() for p in model.parameters())
    t0, c0 = time.perf_counter(), time.process_time()
    materialize(model, "cpu", seed=0, block=local_block)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    local = sum(local_block(p)[0].numel() for p in model.parameters())
    print(f"llama {a.flavor}, {dims.describe()}, rank {a.rank}, {a.threads} thread(s): this rank initialises "
          f"{local / 1e9:.3f} G of the model's {full / 1e9:.2f} G elements in {wall:.1f} s "
          f"({cpu:.1f} s CPU, {1e9 * cpu / local:.1f} ns per element)")

    # Side by side on the first block: shard-only (what ran above) vs full draws then slicing.
    torch.set_grad_enabled(False)
    block = [(canonical_fqn(n), p) for n, p in model.named_parameters() if ".0." in n]
    el_full = sum(p.numel() for _, p in block)
    c0 = time.process_time()
    for fqn, p in block:
        loc, off = local_block(p)
        fill_block_(loc, model.init_rule(fqn), param_seed(0, fqn), p.shape, off)
    new = time.process_time() - c0
    c0 = time.process_time()
    for fqn, p in block:
        t = torch.empty(p.shape)
        t.normal_(0.0, getattr(model.init_rule(fqn), "std", 1.0), generator=torch.Generator().manual_seed(param_seed(0, fqn)))
        loc, off = local_block(p)
        loc.copy_(t[tuple(slice(o, o + k) for o, k in zip(off, loc.shape))])
    old = time.process_time() - c0
    print(f"first block ({el_full / 1e6:.0f} M elements): shard-only {new:.2f} s CPU, full draw + slice {old:.2f} s "
          f"CPU -> {old / new:.1f}x; over the whole model the full draws would cost each rank about "
          f"{old * full / el_full:.0f} s CPU")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
