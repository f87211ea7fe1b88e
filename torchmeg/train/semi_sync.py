"""Semi-synchronous replica groups (fault_tolerance.semi_sync_method = diloco | local_sgd): the outer step.

Between syncs each group trains `sync_steps` inner steps alone (its own AdamW, no cross-group traffic);
then the groups average their pseudo-gradients, the global weights at the round's start minus the
group's weights now, and an outer optimizer steps the global weights with that average (DiLoCo, Douillard
et al. 2023, arXiv:2311.08105: SGD with Nesterov momentum, lr 0.7, momentum 0.9). LocalSGD (Lin et al.
2018) is the same round with an outer SGD of lr 1 and no momentum: the new global weights are the groups'
average, global - 1 x (global - mean(local)), equal to mean(local) up to one rounding.

`RoundState` keeps what a round needs and what a discarded round gives back, all local shards of the
group's layout (rank r of every group holds the same shards, as for the gradients of synchronous steps):

* the global weights (the weights every group started the round from) and the outer momentum, as
  DTensors shaped like the parameters (checkpointed through DCP, so they reshard like the weights);
* a snapshot of the inner optimizer's state taken when the round starts, so a discarded round (a peer
  died, the pseudo-gradient all-reduce failed) restores the weights, the inner optimizer, and, in the
  trainer, the step, the data position, the loss-spike history and the RNG: the retried round starts
  exactly where the discarded one did. (torchft's DiLoCo restores the weights only and keeps the inner
  optimizer's moments of the discarded steps.)

The outer optimizer is torch.optim.SGD over the global weights with its momentum buffers made up front
(zeros: SGD's first step sets the buffer to the gradient, 0 x momentum + g, the same), so they exist to
be loaded before the first sync. Memory: global weights + momentum + the inner state's snapshot, each the
size of the group's parameter shards (4 extra copies with AdamW under DiLoCo, 3 under LocalSGD).

A round in the trainer (`train_round`): the quorum (a group that is behind is healed here, when every
group's weights are the global ones), `sync_steps` inner steps over the round's membership (inner step k
of the group with participating rank p reads the p-th group batch of the k-th step after the round's
start, so the round reads what P synchronous steps would), then the sync and should_commit. The log rows
of a round are written when it commits (metrics.jsonl holds the committed history only); the round's last
row carries `sync_s` and, with log_weights_hash, the digest of the new global weights.
"""
from __future__ import annotations

import os
import time

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.profiler import record_function

from torchmeg.observe.metrics import format_line
from torchmeg.parallel.float8 import precompute_scales
from torchmeg.train.optim import build_lr_scheduler
from torchmeg.train.replica_groups import assign_local, average_across_groups, local, weights_digest

OUTER = {"diloco": "DiLoCo: outer SGD, Nesterov", "local_sgd": "LocalSGD: the groups' weights averaged"}


def outer_hparams(ft) -> tuple[float, float]:
    """(outer lr, outer momentum) of the recipe's method; LocalSGD's are fixed (1, 0): plain averaging."""
    return (ft.outer_lr, ft.outer_momentum) if ft.semi_sync_method == "diloco" else (1.0, 0.0)


class RoundState(Stateful):
    def __init__(self, model, inner_optimizer, lr: float, momentum: float):
        self.named = list(model.named_parameters())
        self.inner = inner_optimizer
        with torch.no_grad():
            self.global_ = [p.detach().clone() for _, p in self.named]
        self.outer = torch.optim.SGD(self.global_, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.momentum = []
        if momentum > 0:
            for g in self.global_:
                buf = torch.zeros_like(g)
                self.outer.state[g]["momentum_buffer"] = buf
                self.momentum.append(buf)
        self._snapshot = None

    # ---- a round ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """The round starts from the global weights: keep the inner optimizer's state to give back."""
        self._snapshot = {p: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
                          for p, st in self.inner.state.items()}

    @torch.no_grad()
    def sync(self, manager) -> list[torch.Tensor]:
        """The pseudo-gradients (global - local), averaged across the live groups in place (an error
        leaves garbage and makes should_commit False). -> the global weights' grads."""
        grads = []
        for g, (_, p) in zip(self.global_, self.named):
            g.grad = g.detach() - p.detach()
            grads.append(g.grad)
        average_across_groups(manager, [local(t) for t in grads])
        return grads

    @torch.no_grad()
    def commit(self) -> None:
        """The outer step on the averaged pseudo-gradients; every group's weights become the new global."""
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for g, (_, p) in zip(self.global_, self.named):
            assign_local(p, local(g))
        self._snapshot = None

    @torch.no_grad()
    def rollback(self) -> None:
        """A discarded round: the weights back to the global ones, the inner optimizer to its snapshot."""
        self.outer.zero_grad(set_to_none=True)
        for g, (_, p) in zip(self.global_, self.named):
            assign_local(p, local(g))
        if self._snapshot is not None:
            for p in list(self.inner.state):
                if p not in self._snapshot:
                    del self.inner.state[p]
            for p, st in self._snapshot.items():
                cur = self.inner.state[p]
                for k, v in st.items():
                    if torch.is_tensor(v) and torch.is_tensor(cur.get(k)):
                        cur[k].copy_(v)
                    else:
                        cur[k] = v.clone() if torch.is_tensor(v) else v

    @torch.no_grad()
    def reset_from_model(self) -> None:
        """The model's weights are the global ones (after a checkpoint load or a heal)."""
        for g, (_, p) in zip(self.global_, self.named):
            local(g).copy_(local(p.detach()))

    # ---- healing and checkpoints -----------------------------------------------------------------
    def heal_state(self) -> dict:
        return {str(i): local(m).clone() for i, m in enumerate(self.momentum)}

    def load_heal_state(self, sd: dict) -> int:
        """A peer's outer momentum (its weights are the global ones: copied with the model). -> bytes."""
        nbytes = 0
        for i, m in enumerate(self.momentum):
            v = sd[str(i)]
            local(m).copy_(v)
            nbytes += v.numel() * v.element_size()
        return nbytes

    def state_dict(self) -> dict:
        return {"momentum": {name: m for (name, _), m in zip(self.named, self.momentum)}}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for (name, _), m in zip(self.named, self.momentum):
                if sd["momentum"][name] is not m:
                    m.copy_(sd["momentum"][name])


class _RoundLog:
    """Holds a round's log rows until the round commits (then written in order) or is discarded."""

    def __init__(self):
        self.rows = []

    def log(self, row: dict, line: str | None = None) -> None:
        self.rows.append(row)


def train_round(tr, stop, profiler) -> bool:
    """One round of the FaultTolerantTrainer `tr` under a semi-synchronous method. -> preempted."""
    cfg, st = tr.cfg, tr.state
    members, member = tr.quorum()
    n = min(cfg.fault_tolerance.sync_steps, cfg.training.steps - st.step)
    first, last = st.step + 1, st.step + n
    kept = (st.step, st.sample_offset, st.spike.state(), torch.get_rng_state(), tr._skipped, list(tr._window))
    t0 = time.perf_counter()
    tr.rounds.begin()
    log, tr.logger = tr.logger, _RoundLog()
    for _ in range(n):
        step, loss, gn, lr, stepped = tr.timed_replica_step(members, member)
        tr.after_step(step, loss, gn, lr, stepped, members, profiler, inner=True, force_log=step == last)
        tr.heal, tr.quorum_s = None, 0.0  # (the round's first row carries them)
    t1 = time.perf_counter()
    tr.watchdog.begin(f"sync after step {last}")
    with record_function("torchmeg: outer sync"):
        if str(os.environ.get("TORCHMEG_TEST_FT_ERROR_AT_STEP")) == str(last) and not tr._errored:
            tr._errored = True  # (the first attempt only: the retry goes through)
            tr.manager.report_error(RuntimeError("injected all-reduce error (TORCHMEG_TEST_FT_ERROR_AT_STEP)"))
        tr.rounds.sync(tr.manager)
        commit = tr.manager.should_commit()
    tr.watchdog.end()
    rows, tr.logger = tr.logger.rows, log
    if not commit:  # the round never happened: weights, inner optimizer, step, data, spike history, RNG
        tr.rounds.rollback()
        st.step, st.sample_offset = kept[0], kept[1]
        st.spike.load(kept[2])
        torch.set_rng_state(kept[3])
        tr._skipped = kept[4]
        tr._window = [kept[5][0] + time.perf_counter() - t0, kept[5][1]]  # (its time counts: goodput)
        tr.scheduler = build_lr_scheduler(tr.optimizer, cfg, st.step)
        if tr.float8_precompute:
            precompute_scales(tr.model)
        tr.report_discard(first, last, members, n)
        return False
    tr.rounds.commit()
    if tr.float8_precompute:
        precompute_scales(tr.model)
    sync_s = time.perf_counter() - t1
    tr._window[0] += sync_s  # (in the next logged step's rate)
    rows[-1]["sync_s"] = sync_s  # (the round's last row: always logged)
    if cfg.fault_tolerance.log_weights_hash:
        rows[-1]["weights_hash"] = weights_digest(tr.model)
    # Validation and checkpoints see the global weights: each happens at the sync that ends a round in which
    # a multiple of its frequency fell (and after the last step).
    due = {f: next((k for k in range(first, last + 1) if k % f == 0), None)
           for f in (cfg.validation.freq, cfg.checkpoint.interval)}
    val = tr._maybe_validate(due[cfg.validation.freq] or last)
    if val is not None:
        rows[-1]["val_loss"] = val
    for row in rows:
        tr.logger.log(row, format_line(row))
    return tr.end_unit(last, stop, save_due=due[cfg.checkpoint.interval] is not None)
