"""Run by test_moe.py on 2 gloo ranks: the moe_debug model under expert parallel 2 x FSDP 2, one
forward and backward with every host read of a tensor counted (the dispatcher's
_local_scalar_dense: .item(), int(t), ...; and .tolist() / .numpy(), which do not dispatch). Rank 0
prints {"forward": n, "backward": n, "moe_layers": n} as one JSON line."""
import datetime
import json

import torch
import torch.distributed as dist

from host_reads import HostReads
from torchmeg.config.schema import load_config
from torchmeg.models import build_model, init_weights
from torchmeg.parallel import ParallelDims
from torchmeg.parallel.parallelize import parallelize


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    cfg = load_config("recipes/moe_debug.toml", ["--parallelism.expert_parallel_degree=2"])
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    model = build_model(cfg, 257, "cpu")
    init_weights(model, seed=0)
    layers = sum(1 for m in model.modules() if hasattr(m, "update_bias"))
    parallelize(model, dims, cfg, mesh=dims.build_mesh("cpu"), ep_mesh=dims.build_ep_mesh("cpu"))
    x = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    with HostReads(refuse=False) as fwd:
        loss = model(x).float().pow(2).mean()
    with HostReads(refuse=False) as bwd:
        loss.backward()
    if dist.get_rank() == 0:
        print(json.dumps({"forward": fwd.n, "backward": bwd.n, "moe_layers": layers}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
