"""The planner's numbers taken from a real run: `torchrun ... -m torchmeg.plan --config R --measure
--json OUT` builds the real trainer, runs step 1, then step 2 under the same tracking the dry run
uses (MemTracker, StepCost). Each rank writes OUT.rank<R>. This is how the plan is checked against
reality (tests/test_plan.py), and how a user checks it on their own cluster.

GRPO: step 2's rollout (the engine generating the step's completions on the gathered weights, then the
rewards and the extra log-probs) is measured by its own memory tracker, told about the parameters, the
optimizer's state and the reference's copy the run holds (`rollout_memory`: the plan's rollout phase,
torchmeg.plan.post_training; tests/test_plan_post_training.py)."""
from __future__ import annotations

import json
import os

from torchmeg.plan.trace_step import track_step
from torchmeg.plan.memory import activation_bytes, peak_bytes, step_memory
from torchmeg.plan.step_cost import mesh_group_labels
from torchmeg.train.trainer import Trainer
from torchmeg.train.validate import validate


def measure_main(cfg, json_path: str | None) -> int:
    layout = validate(cfg)
    cfg.compile.enable = False  # as in the dry run
    trainer = Trainer(cfg, layout)
    it = iter(trainer.loader)
    trainer.train_step([next(it) for _ in range(layout.accum)])
    rollout, held = None, getattr(trainer.loader, "reference_held", [])
    if cfg.training.objective == "grpo":  # step 2's rollout runs when its first microbatch is asked for
        mt = step_memory()
        mt.track_external(trainer.model, trainer.optimizer, *held)
        with mt:
            first = next(it)
        rollout = peak_bytes(mt)
        batches = [first] + [next(it) for _ in range(layout.accum - 1)]
    else:
        batches = [next(it) for _ in range(layout.accum)]
    labels = mesh_group_labels(trainer.mesh, *([trainer.ep_mesh] if trainer.ep_mesh is not None else []))
    # A pipeline's receive buffers, held since step 1 (the plan counts them: plan.pipeline_rank); told to
    # the tracker, which would otherwise see an input buffer only once a forward reads it and a gradient
    # buffer never (it is written by a receive and read by the autograd engine).
    schedule = trainer.built.schedule
    held = list(held) + (schedule.recv_buffers() if schedule is not None else [])
    m = track_step(lambda: trainer.train_step(batches), [trainer.model], trainer.optimizer, labels, held=held)
    out = {"rank": trainer.rank, "model_state_bytes": trainer.state_bytes, "memory": m["memory"],
           "activation_bytes": activation_bytes(m["memory"]), "flops": m["flops"], "flops_by_op": m["flops_by_op"], "comm": m["comm"],
           "rollout_memory": rollout}
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(f"{json_path}.rank{trainer.rank}", "w") as fh:
            json.dump(out, fh, indent=1)
    if trainer.rank == 0:
        print(f"measured step 2 on rank 0: model state {out['model_state_bytes'] / 2 ** 20:.2f} MiB, activations "
              f"{out['activation_bytes'] / 2 ** 20:.2f} MiB, peak {m['memory'].get('Total', 0) / 2 ** 20:.2f} MiB"
              + (f"; the rollout before it peaked at {rollout['Total'] / 2 ** 20:.2f} MiB" if rollout else ""), flush=True)
    trainer.close()
    return 0
