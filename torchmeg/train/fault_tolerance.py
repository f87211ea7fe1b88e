"""Training as one replica group of several, on torchft: a dead group costs the others a step, not the job.

torchft's model (torchtitan's experiments/torchft for shape), on the trainer as it is:

* Each replica group is a torchrun job of its own with the recipe's layout inside it (FSDP2, TP, PP, ...);
  the groups are data parallel to each other through torchft's managed process group. After the
  backward, rank r of every live group all-reduces its gradient shards (and its loss) with rank r of
  the others (`average_across_groups`): the same layout in every group gives every rank the same shards.
* Every step starts with a quorum from the lighthouse (`Manager.start_quorum`, synchronous here: a group
  behind the others is healed before its forward) and ends with `should_commit`: the optimizer, the LR
  schedule, the step counter, the data cursor and the metrics advance only on a committed step. A step
  whose cross-group all-reduce failed (a peer died mid-step) is discarded and retried with the groups
  that are left.
* A group that starts late or restarts is healed from a live peer by torchft's checkpoint transport
  (HTTP, rank r from rank r): torchmeg.train.heal's `heal_state` / `load_heal_state` give it the local weight
  shards, the optimizer state, and the TrainState (step, data position, loss-spike history, RNG); the LR
  schedule is rebuilt from the step. No checkpoint is read.
* Data: a committed step with P groups taking part trains P group batches from the data cursor, the
  group with participating rank p taking the p-th (`step_batches`); the cursor advances by P group
  batches on commit and is part of the healed and checkpointed state. A discarded step's batches are
  retaken by the next step, so the committed history trains every batch once, in order, whatever the
  membership. (torchft.data.DistributedSampler instead fixes each group's shard by its replica id: a dead
  group's shard is skipped while it is down, and the membership does not enter the position at all.)
* semi_sync_method = diloco | local_sgd: the same groups in rounds of sync_steps inner steps with one
  quorum and one commit per round, the groups syncing their weights at its end (torchmeg.train.semi_sync).
* Checkpoints: each group writes under its own <run>/replica_<id>/, and only the group with participating
  rank 0 saves (the atomic commit as without fault tolerance). A restart of every group loads each its
  newest; the quorum then heals any group that is behind from the one with the highest step.

Test hooks (a test kills nothing else): TORCHMEG_TEST_FT_KILL="replica:rank:step" SIGKILLs that rank as
its backward starts, on the group's first attempt only; TORCHMEG_TEST_FT_STOP="replica:rank:step" SIGSTOPs
it there instead (a hung peer; the test sends SIGCONT); TORCHMEG_TEST_FT_ERROR_AT_STEP=N reports an
all-reduce error at step N's first attempt (every group that has the variable discards it);
TORCHMEG_TEST_FT_PACE_S=S makes every step that not every group takes part in last at least S seconds
(the survivor of a kill then trains at a step a few seconds long, as at scale, while the dead group
restarts: its restart spans a bounded number of steps however loaded the machine is).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import time

import torch
from torch.profiler import record_function

from torchmeg.config.errors import ConfigError
from torchmeg.config.extras import need
from torchmeg.observe.metrics import MetricsLogger
from torchmeg.runtime.process import CollectiveTimeouts, StopFlag, inject_kill
from torchmeg.observe.profiling import StepProfiler
from torchmeg.observe.run_header import start_lines
from torchmeg.train.heal import heal_state, load_heal_state
from torchmeg.train.replica_groups import (average_across_groups, job_id, local, process_started_at,
                                           step_batches, weights_digest)
from torchmeg.train.semi_sync import OUTER, RoundState, outer_hparams, train_round
from torchmeg.train.trainer import Trainer

class FaultTolerantTrainer(Trainer):
    """The Trainer as one replica group ([fault_tolerance]); without that section torchmeg.train runs the
    plain Trainer, unchanged."""

    def __init__(self, cfg, layout=None):
        need("torchft", "ft", "fault_tolerance.enable")
        if "RANK" not in os.environ:
            raise ConfigError("fault_tolerance.enable: each replica group runs under torchrun; start the job with "
                              "python -m torchmeg.replicas (docs/fault-tolerance.md)")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchft's manager finds its server through keys in the group's store; in the agent's store,
            # which outlives a restart, a restarted rank would read the dead attempt's address.
            raise ConfigError("fault_tolerance.enable under torchrun's shared agent store: launch the group with "
                              "python -m torchmeg.launch (or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
        self.discarded, self.heal, self._signal_in_backward, self._injected = 0, None, None, False
        self._errored = False
        self._started = False
        self.rounds = None  # semi_sync_method != none: the outer state (RoundState), made before the checkpoint load
        self._times = {"init": time.time(), "process": process_started_at()}  # (a rejoin's split, in the heal line)
        super().__init__(cfg, layout)
        self._times["built"] = time.time()

    # ---- set-up: the manager replaces the data loader -------------------------------------------
    def checkpoint_extras(self) -> dict:  # DiLoCo's outer momentum travels with the checkpoint
        return {"outer": self.rounds} if self.rounds is not None and self.rounds.momentum else {}

    def _resume(self) -> None:
        ft = self.cfg.fault_tolerance
        if ft.semi_sync_method != "none":
            self.rounds = RoundState(self.model, self.optimizer, *outer_hparams(ft))
        super()._resume()
        if self.rounds is not None:  # the first round starts from the weights loaded (or initialised)
            self.rounds.reset_from_model()

    def _build_loader(self) -> None:
        import torchft  # lazy: the ft extra (checked in __init__)

        cfg, ft = self.cfg, self.cfg.fault_tolerance
        self.logger = None  # opened after the first quorum, when this group's step is known (healed or loaded)
        timeout = datetime.timedelta(milliseconds=ft.process_group_timeout_ms)
        pg = (torchft.ProcessGroupNCCL(timeout=timeout) if ft.process_group == "nccl"
              else torchft.ProcessGroupGloo(timeout=timeout))
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replica_size,
            use_async_quorum=False,  # heal before the forward: a healed group takes part in the same step
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout_s),
            rank=self.rank, world_size=self.world, replica_id=f"replica_{ft.replica_id}",
            lighthouse_addr=ft.lighthouse or None,
            init_sync=False)  # every group initialises alike from (seed, FQN); a late one is healed anyway
        self.manager.register_state_dict_fn("torchmeg", lambda sd: load_heal_state(self, sd), lambda: heal_state(self))
        if ft.process_group == "gloo":  # torchft warns at every reconfiguration that NCCL's flight recorder
            logging.getLogger("torchft.manager").addFilter(  # was not reset: true and beside the point on gloo
                lambda record: "flight recorder" not in record.getMessage())
        self.manager.load_state_dict({"step": self.state.step // (ft.sync_steps if self.rounds else 1),
                                      "batches_committed": self.state.next_sample() // self.layout.global_batch})
        self.loader = None
        inner = self.step_fn.loss_fn

        def loss_fn(*args, **kw):  # the kill / hang test hooks: a signal to itself as this step's backward starts
            loss = inner(*args, **kw)
            sig = self._signal_in_backward
            if sig is not None and loss.requires_grad:
                self._signal_in_backward = None
                loss.register_hook(lambda grad: self._signal_self(sig))
            return loss
        self.step_fn.loss_fn = loss_fn

    def _signal_self(self, sig) -> None:
        print(f"[test] replica group {self.cfg.fault_tolerance.replica_id} rank {self.rank} (pid {os.getpid()}): "
              f"{signal.Signals(sig).name} to itself in step {self.state.step + 1}'s backward", flush=True)
        os.kill(os.getpid(), sig)

    # ---- one step ----------------------------------------------------------------------------------
    def _forward_backward(self, batches) -> torch.Tensor:
        for var, sig in (("TORCHMEG_TEST_FT_KILL", signal.SIGKILL), ("TORCHMEG_TEST_FT_STOP", signal.SIGSTOP)):
            where = os.environ.get(var, "").split(":")
            if (where == [str(self.cfg.fault_tolerance.replica_id), str(self.rank), str(self.state.step + 1)]
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not self._injected):
                self._injected, self._signal_in_backward = True, sig
        loss_sum = super()._forward_backward(batches)
        if self.rounds:  # an inner step: nothing crosses groups
            return loss_sum
        with record_function("torchmeg: all-reduce across replica groups"):
            if os.environ.get("TORCHMEG_TEST_FT_ERROR_AT_STEP") == str(self.state.step + 1) and not self._errored:
                self._errored = True  # (the first attempt only: the retry goes through)
                self.manager.report_error(RuntimeError("injected all-reduce error (TORCHMEG_TEST_FT_ERROR_AT_STEP)"))
            grads = [local(p.grad) for p in self.params if p.grad is not None]
            loss = loss_sum.reshape(1).to(grads[0].dtype if grads else loss_sum.dtype)
            average_across_groups(self.manager, grads + [loss])
        return loss.reshape(()).to(loss_sum.dtype)

    def train_step(self, batches):
        """The plain step, but its update happens only if the quorum commits it: -> (loss, grad_norm,
        stepped), stepped None when the step was discarded (nothing changed; the same step is retried).
        (compile.verify_cache's eager first step is the plain trainer's: not run here.) A round's inner
        step is the plain trainer's."""
        if self.rounds:
            return super().train_step(batches)
        loss_val, gn = self.loss_and_norm(self._forward_backward(batches))
        with record_function("torchmeg: should_commit"):
            commit = self.manager.should_commit()
        if not commit:
            self.optimizer.zero_grad(set_to_none=True)
            return loss_val, gn, None
        return self.apply_step(loss_val, gn)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        cfg, ft = self.cfg, self.cfg.fault_tolerance
        if self.rank == 0:
            how = ("gradients all-reduced every step" if not self.rounds else
                   f"{OUTER[ft.semi_sync_method]}, a sync every {ft.sync_steps} steps")
            print("\n".join(start_lines(self, (
                f"replicas   group {ft.replica_id} of {ft.group_size} (torchft {ft.process_group}, {how}; a step commits "
                f"with at least {ft.min_replica_size}; cross-group timeout {ft.process_group_timeout_ms} ms, quorum "
                f"{ft.quorum_timeout_s:g} s); outputs in {cfg.run_dir}",))), flush=True)
        stop = StopFlag()
        self.timeouts = CollectiveTimeouts(cfg, keep_long=[self.ckpt.async_group] if self.ckpt else [])
        self._window, self._skipped = [0.0, 0], 0
        profiler = StepProfiler(cfg, self.rank, self.device)
        while self.state.step < cfg.training.steps:
            if self._finished_without_us():
                break
            preempted = train_round(self, stop, profiler) if self.rounds else self._one_step(stop, profiler)
            if preempted:
                if self.rank == 0:
                    print(f"SIGTERM: stopped after step {self.state.step}", flush=True)
                break
        profiler.close()
        if self.logger is not None:  # (None: the job finished while this group was down; it trained nothing)
            self._finish()
        if self.rank == 0 and self.state.step >= cfg.training.steps and job_id():
            with open(self._marker_path(), "w") as fh:  # what a group that restarts after the end reads
                json.dump({"job": job_id(), "step": self.state.step, "replica": ft.replica_id}, fh)
        self.manager.shutdown(wait=False)
        return 0

    def _one_step(self, stop, profiler) -> bool:
        """A synchronous step: quorum, the step, commit or discard. -> preempted."""
        members, member = self.quorum()
        step, loss, gn, lr, stepped = self.timed_replica_step(members, member)
        if stepped is None:  # discarded: nothing advanced; the same step is tried again
            self.report_discard(step, step, members, 1)
            return False
        self.after_step(step, loss, gn, lr, stepped, members, profiler)
        return self.end_unit(step, stop)

    def after_step(self, step, loss, gn, lr, stepped, members, profiler, inner=False, force_log=False) -> None:
        """What follows a step the group keeps: validation, the log line, the step counter, the data cursor
        (this step trained `members` group batches). A round's inner step validates nothing (the round
        does, after its sync) and the round's last step is always logged."""
        cfg = self.cfg
        profiler.step(step)
        with record_function("torchmeg: validate, log"):
            val = None if inner else self._maybe_validate(step)
            self.objective_stats = self._replica_stats(members)
            if (step % cfg.metrics.log_freq == 0 or step in (1, cfg.training.steps) or val is not None or force_log
                    or not stepped or self.spike_note or self.heal is not None):
                self._log(step, loss, gn, lr, val, stepped)
            self._check_skips(step, stepped)
            self.state.step = step
            self.state.sample_offset += (members - 1) * self.layout.global_batch

    def end_unit(self, step: int, stop, save_due: bool = False) -> bool:
        """After a committed step (or round: `save_due` when a multiple of checkpoint.interval fell in it): the
        save (one group writes), the preemption check. -> preempted."""
        with record_function("torchmeg: save"):
            self._poll_save(step)
            preempted = stop.agreed()
            if self.manager.participating_rank() == 0:
                self._maybe_save(step, step == self.cfg.training.steps or preempted, preempted or save_due)
        inject_kill(step, self.rank)
        return preempted

    def report_discard(self, first: int, last: int, members: int, n: int) -> None:
        self.discarded += n
        why = self.manager.errored()
        digest = weights_digest(self.model) if self.cfg.fault_tolerance.log_weights_hash else None
        if self.rank == 0:
            where = f"step {first:>5}" if first == last else f"steps {first}-{last}"
            print(f"{where} | discarded ({why.original_exception if why else 'not enough replicas'}"
                  f") | replicas {members} | {self.discarded} discarded so far | lr {self.optimizer.param_groups[0]['lr']:.6e}"
                  + (f" | weights_hash {digest}" if digest else ""), flush=True)

    def _marker_path(self) -> str:
        return os.path.join(os.path.dirname(self.cfg.run_dir), "finished.json")

    def _finished_without_us(self) -> bool:
        """A group restarted (by its agent) after the job's other groups finished must not train the run
        again alone: the finished group's marker (same job id) says so, and this group ends, exit 0.
        (Without a job id: TORCHMEG_FT_JOB_ID, set by torchmeg.replicas, or SLURM_JOB_ID, no marker.)"""
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or not job_id():
            return False
        try:
            with open(self._marker_path()) as fh:
                done = json.load(fh)
        except (OSError, ValueError):
            return False
        if done.get("job") != job_id() or done.get("step", 0) < self.cfg.training.steps:
            return False
        if self.rank == 0:
            print(f"replicas   the job finished at step {done['step']} (group {done['replica']}) while this group "
                  f"was down; nothing left to train ({self._marker_path()})", flush=True)
        return True

    def quorum(self) -> tuple[int, int]:
        """The lighthouse's quorum (healing this group if it is behind). -> (groups taking part, this
        group's participating rank)."""
        self.heal = None
        self.watchdog.begin(f"quorum before step {self.state.step + 1}")  # (the long limit: a peer may be restarting)
        t0 = time.perf_counter()
        with record_function("torchmeg: quorum"):
            self.manager.start_quorum()
            ft = self.cfg.fault_tolerance
            # A group's first step waits (up to the quorum timeout) for every group, which the lighthouse
            # counts only once each has started: a job (re)started as a whole goes on as one. Later,
            # whoever is live goes on. (A group restarting alone finds the others there at once.)
            while (not self._started and self.manager.num_participants() < ft.group_size
                   and time.perf_counter() - t0 < ft.quorum_timeout_s):
                time.sleep(0.2)
                self.manager.start_quorum()
            self._started = True
        self.quorum_s = time.perf_counter() - t0
        self.watchdog.end()
        if self.logger is None:  # rows past the step this group goes on from were rolled back: dropped
            self.logger = MetricsLogger(self.cfg, self.rank, resume_step=self.state.step)
        if self.heal is not None and self.rank == 0:
            h = self.heal
            print(f"healed     from replica group {h['source']} at step {h['step']}: {h['bytes'] / 2**20:,.1f} MiB on "
                  f"rank 0, quorum + transfer {self.quorum_s:.2f} s (applied in {h['apply_s']:.2f} s); no checkpoint "
                  f"read" + self._rejoin_split(), flush=True)
        return self.manager.num_participants(), self.manager.participating_rank()

    def timed_replica_step(self, members: int, member: int):
        """This rank's batches for the membership, the step. -> (step, loss, grad_norm, lr, stepped or None
        when discarded)."""
        step = self.state.step + 1
        self.timeouts.steady(self.watchdog.limit_for("step"))
        self.watchdog.begin(f"step {step}")
        t1 = time.perf_counter()
        with record_function("torchmeg: data"):
            lay = self.layout
            batches = step_batches(self.train_set, lay.local_batch, self.dims.dp, self.dp_rank, lay.accum,
                                   self.state.next_sample(), members, member)
        lr = self.optimizer.param_groups[0]["lr"]
        loss, gn, stepped = self.train_step(batches)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        pace = float(os.environ.get("TORCHMEG_TEST_FT_PACE_S", "0"))  # tests: steps without every group last at
        if pace > 0 and members < self.cfg.fault_tolerance.group_size:  # least this long (a restart spans steps)
            time.sleep(max(0.0, pace - (time.perf_counter() - t1)))
        self._window[0] += time.perf_counter() - t1 + self.quorum_s  # discarded attempts count: goodput
        self._window[1] += stepped is not None
        self.watchdog.end()
        if stepped is not None:
            self._skipped = 0 if stepped else self._skipped + 1
        return step, loss, gn, lr, stepped

    def _rejoin_split(self) -> str:
        """On this process's first step: where its time went since the interpreter started."""
        t = self._times
        if t.pop("reported", False) or t["process"] is None:
            return ""
        t["reported"] = True
        return (f"; this process: imports {t['init'] - t['process']:.1f} s, build {t['built'] - t['init']:.1f} s, "
                f"quorum + transfer {self.quorum_s:.2f} s")

    def _replica_stats(self, members: int) -> dict:
        """The metrics row's fault-tolerance fields (metrics.jsonl and the log line)."""
        row = {"replicas": members, "replica_rank": self.manager.participating_rank(),
               "steps_discarded": self.discarded, "quorum_s": self.quorum_s}
        if self.heal is not None:
            row.update(heal_from=self.heal["source"], heal_mib=self.heal["bytes"] / 2 ** 20, heal_s=self.quorum_s)
        if self.cfg.fault_tolerance.log_weights_hash:
            row["weights_hash"] = weights_digest(self.model)
        return row
