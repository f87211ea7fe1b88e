"""What a replica group that is behind receives from a live peer (torchmeg.train.fault_tolerance): torchft's
checkpoint transport carries `heal_state()` of rank r of a live group to rank r of the group being healed,
whose manager applies it with `load_heal_state`: the local shards of the weights and the optimizer state
(the same layout in every group gives rank r the same shards), DiLoCo's outer momentum, and the TrainState
(step, data cursor, loss-spike history, RNG); the LR schedule is rebuilt from the step. No checkpoint is
read."""
from __future__ import annotations

import time

import torch

from torchmeg.parallel.float8 import precompute_scales
from torchmeg.train.optim import build_lr_scheduler
from torchmeg.train.replica_groups import assign_local, local


def _optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def heal_state(tr) -> dict:
    """`tr` (the FaultTolerantTrainer): this rank's local shards of the weights and optimizer state, and the TrainState: what rank r
    of a group that is behind needs from rank r here (the same layout gives it the same shards)."""
    # Synchronous steps serve the live tensors (the peer has read them before this group's next update:
    # that waits on the step's all-reduce with it); a round's inner steps update before the peer's next
    # collective, so it is served a copy taken now.
    snap = (lambda t: t.to("cpu", copy=True)) if tr.rounds else (lambda t: t)
    with torch.no_grad():
        model = {n: snap(local(p.detach())) for n, p in tr.model.named_parameters()}
        optim = {}
        for i, p in enumerate(_optimizer_params(tr.optimizer)):
            st = tr.optimizer.state.get(p, {})
            optim[str(i)] = {k: snap(local(v.detach())) if torch.is_tensor(v) else v for k, v in st.items()}
    s = tr.state
    return {"model": model, "optim": optim, "outer": tr.rounds.heal_state() if tr.rounds else {},
            "train": {"source": tr.cfg.fault_tolerance.replica_id, "step": s.step,
                      "sample_offset": s.sample_offset, "spike": s.spike.state(), "rng_cpu": torch.get_rng_state()}}


def load_heal_state(tr, sd: dict) -> None:
    """Apply a peer's heal_state(): weights, optimizer state, TrainState; the LR schedule follows the step."""
    t0 = time.perf_counter()
    nbytes = 0
    params = dict(tr.model.named_parameters())
    for n, v in sd["model"].items():
        assign_local(params[n], v)
        nbytes += v.numel() * v.element_size()
    if not tr.optimizer.state:  # a fresh group: make the state there is to copy into
        _init_optimizer_state(tr.optimizer)
    for i, p in enumerate(_optimizer_params(tr.optimizer)):
        for k, v in sd["optim"].get(str(i), {}).items():
            st = tr.optimizer.state[p]
            if torch.is_tensor(v):
                assign_local(st[k], v)
                nbytes += v.numel() * v.element_size()
            else:
                st[k] = v
    if tr.rounds is not None:  # the weights just received are the global ones, and the outer momentum
        tr.rounds.reset_from_model()
        nbytes += tr.rounds.load_heal_state(sd["outer"])
    got = sd["train"]
    tr.state.step, tr.state.sample_offset = got["step"], got["sample_offset"]
    tr.state.spike.load(got["spike"])
    torch.set_rng_state(got["rng_cpu"])
    tr.scheduler = build_lr_scheduler(tr.optimizer, tr.cfg, tr.state.step)
    if tr.float8_precompute:  # float8 all-gathered by FSDP: the scales of the weights just received
        precompute_scales(tr.model)
    tr.heal = {"source": got["source"], "step": got["step"], "bytes": nbytes, "apply_s": time.perf_counter() - t0}


def _init_optimizer_state(optimizer) -> None:
    """Every parameter's optimizer state made by one step at learning rate 0 on zero gradients (no
    update: AdamW's decoupled decay is lr x wd), so a healed group copies into it."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in _optimizer_params(optimizer):
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr
