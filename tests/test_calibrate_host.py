"""What a DTensor op of a TP step costs the host, measured on a real TP model (torchmeg.plan.calibrate_host):
the step it times is the trainer's Llama sharded by its TP plan over a fake group, and the price is that
step's time less its plain ops' dispatch, over the DTensor ops the planner's counter counts in it."""
import json
import math
import os
import sys

import pytest

from launch import launch_ranks


def test_a_dtensor_ops_price_comes_from_a_real_tp_step(monkeypatch):
    """The timed step runs the parallel styles (sequence parallel's all-gathers and reduce-scatters,
    counted on the fake TP group, and DTensor ops in every layer), the price is (its time - plain ops x
    dispatch) / DTensor ops with the counts of that very step, and the fake world is gone afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchmeg.plan import calibrate_host
    from torchmeg.plan.step_cost import StepCost
    seen = {}

    def timed(step, device, min_time):  # (no timing asserted: a known time, and what the step ran)
        cost = StepCost()
        with cost:
            step()
        seen["plain"] = sum(op[3] != "subclass" for op in cost.ops)
        seen["dtensor"] = sum(op[3] == "subclass" for op in cost.ops)
        seen["collectives"] = {kind: c["count"] for (_, kind), c in cost.collectives.items()}
        return 0.05
    made = []
    tp_model = calibrate_host._tp_model
    monkeypatch.setattr(calibrate_host, "seconds", timed)
    monkeypatch.setattr(calibrate_host, "_tp_model", lambda *a: made.append(tp_model(*a)) or made[-1])
    price = calibrate_host.dtensor_op(torch.device("cpu"), 1e-5)
    assert not dist.is_initialized()  # (its own fake world, destroyed)
    (model,) = made
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert sharded and all(p.device_mesh.size() == calibrate_host.TP for p in sharded)
    # every layer's attention and feed-forward sharded; sequence parallel's gathers and scatters ran
    assert len(sharded) >= 7 * calibrate_host.TINY["n_layers"], [type(p) for p in model.parameters()]
    assert seen["collectives"].get("all_gather", 0) >= 2 * calibrate_host.TINY["n_layers"], seen
    assert seen["collectives"].get("reduce_scatter", 0) >= 2 * calibrate_host.TINY["n_layers"], seen
    assert seen["dtensor"] > seen["plain"] / 4, seen
    assert price == pytest.approx((0.05 - seen["plain"] * 1e-5) / seen["dtensor"]), (price, seen)


WORKER = """
import json, math, torch, torch.distributed as dist
from torchmeg.plan import calibrate_host
dist.init_process_group("gloo")
calibrate_host.MIN_TIME = 0.02
price = calibrate_host.dtensor_op(torch.device("cpu"), 1e-6)
ones = torch.ones(1)
dist.all_reduce(ones)  # (the real group still whole beside the fake ones, and still the default)
print(json.dumps({"rank": dist.get_rank(), "price": price, "sum": ones.item(),
                  "groups": dist.get_world_size()}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun_each_rank_measures_beside_the_real_group(tmp_path):
    """Under torchrun (two gloo ranks) each rank shards the model over a fake group of its own, made beside
    the real one (new_subgroups), measures a price, and leaves the real group working and the default."""
    p = launch_ranks([sys.executable, "-c", WORKER], 2, dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:] + getattr(p, "rank_tails", "")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["sum"] == 2.0 and row["groups"] == 2, row
    assert math.isfinite(row["price"]) and row["price"] > 0, row
