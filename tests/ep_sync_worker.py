"""Run by test_moe.py on 2 gloo ranks: the moe_debug model under expert parallel 2 x FSDP 2, one
forward and backward with every host read of a tensor counted (the dispatcher's
_local_scalar_dense: .item(), int(t), ...; and .tolist() / .numpy(), which do not dispatch):
dropless (parallelism.expert_capacity_factor = 0), then under a mode that refuses host reads:
dropless (expected to fail there), capacity factor 2 (= ep: nothing dropped) and 0.5 (some rows
dropped). Rank 0 prints one JSON line."""
import datetime
import json

import torch
import torch.distributed as dist

from host_reads import HostReads
from torchmeg.config.schema import load_config
from torchmeg.models import build_model, init_weights
from torchmeg.parallel import ParallelDims
from torchmeg.parallel.expert import expert_modules
from torchmeg.parallel.parallelize import parallelize
from torchmeg.runtime.process import finish_script


def build(factor: float):
    cfg = load_config("recipes/moe_debug.toml", ["--parallelism.expert_parallel_degree=2",
                                                 f"--parallelism.expert_capacity_factor={factor}"])
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    model = build_model(cfg, 257, "cpu")
    init_weights(model, seed=0)
    layers = sum(1 for m in model.modules() if hasattr(m, "update_bias"))
    parallelize(model, dims, cfg, mesh=dims.build_mesh("cpu"), ep_mesh=dims.build_ep_mesh("cpu"))
    return model, layers


def step(model, refuse: bool):
    """-> (forward reads, backward reads, loss, grad norm of the expert weights) or the refusal."""
    x = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        with HostReads(refuse=refuse) as fwd:
            loss = model(x).float().pow(2).mean()
        with HostReads(refuse=refuse) as bwd:
            loss.backward()
    except AssertionError as e:
        return {"refused": str(e)}
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    grads = torch.stack([p.grad.full_tensor().norm() for m in expert_modules(model) for p in m.parameters()])
    dropped = sum(float(getattr(m.dispatch, "dropped", None) or 0.0) for m in expert_modules(model))
    return {"forward": fwd.n, "backward": bwd.n, "loss": loss.item(), "expert_grads": grads.tolist(),
            "dropped": dropped}


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model, layers = build(0.0)
    out = {"moe_layers": layers, "dropless": step(model, refuse=False)}
    model, _ = build(0.0)
    # (a refused read in one rank's forward leaves its peer waiting in the next collective: both
    # ranks make the same read at the same point, the count exchange, so both stop there)
    out["dropless_refusing"] = step(model, refuse=True)
    for factor in (2.0, 0.5):
        model, _ = build(factor)
        out[f"capacity_{factor}"] = step(model, refuse=True)
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    finish_script()  # collect, barrier, destroy, leave without teardown (runtime.process)
