"""The training loop. `Trainer(cfg, layout)` sets a run up in named steps (runtime, data, model,
optimizer, resume, loader), `run()` trains, logs, validates and checkpoints, `close()` ends cleanly.

The model and how a step runs it come from torchmeg.train.build (the planner uses the same two); the
checkpoint manager sees the model, the optimizer and the TrainState, never the Trainer.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from torchmeg.runtime import guard
from torchmeg.runtime import process as runtime
from torchmeg.train.build import GlobalTargetMean, ModelStep, build_parallel_model, forward_backward, loss_function, mean_eval_loss
from torchmeg.checkpoint.manager import CheckpointManager
from torchmeg.parallel.compile import compile_loss, compile_summary
from torchmeg.train.compile_check import check_against_eager, eager_reference
from torchmeg.data.loader import build_dataset, build_loader, open_stores, prepare_stores
from torchmeg.data.sources import cache_dir
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.config.errors import LossSpikeError
from torchmeg.parallel.float8 import precompute_scales, precomputes_scales
from torchmeg.checkpoint.export import export_hf
from torchmeg.checkpoint.hf_files import load_initial_hf
from torchmeg.config.layout import Layout
from torchmeg.observe.metrics import MetricsLogger, format_line, memory_fields, model_state_bytes
from torchmeg.models.count import flops_per_token
from torchmeg.observe.op_record import OpRecorder, write as write_op_record
from torchmeg.train.optim import build_lr_scheduler, build_optimizer, clip_grads, describe_groups, grad_norm, reduce_partial_grads
from torchmeg.parallel.expert import expert_modules
from torchmeg.parallel.pipeline import describe_inflight
from torchmeg.observe.peak import peak_flops, repair_peak
from torchmeg.observe.profiling import StepProfiler
from torchmeg.observe.run_header import start_lines
from torchmeg.runtime.process import CollectiveTimeouts, StopFlag, inject_kill, inject_nan, inject_node_loss, inject_spike
from torchmeg.train.router_stats import router_modules, step_router_stats
from torchmeg.train.spike import SpikeGuard, batch_samples
from torchmeg.train.state import TrainState
from torchmeg.train.dpo import prepare_reference
from torchmeg.train.grpo import GRPOBatches
from torchmeg.train.validate import validate


class Trainer:
    def __init__(self, cfg, layout: Layout | None = None):
        self.cfg = cfg
        self.objective_stats = {}  # dpo / grpo: the step's rewards, margins, rollout metrics
        self.layout = layout if layout is not None else validate(cfg)
        self._start_runtime()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._resume()
        self.dpo_note = prepare_reference(self) if cfg.training.objective == "dpo" else None  # step 0's log-probs
        self._build_loader()

    # ---- set-up, in order ---------------------------------------------------------------------
    def _start_runtime(self) -> None:
        """Device, process group, watchdog, determinism, seed, meshes."""
        cfg, dims = self.cfg, self.layout.dims
        if cfg.training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.device, self.mesh, self.ep_mesh = runtime.start(cfg, dims)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.watchdog = guard.Watchdog(cfg, self.rank, describe_inflight if dims.pp > 1 else None)
        self.dims = dims
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.loss_group = self.mesh["dp_cp"].get_group()
        self.pp_group = self.mesh["pp"].get_group()

    def _build_data(self) -> None:
        """One builder per node prepares caches (and says where); the rest wait, then every rank opens them."""
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        notes = runtime.on_each_node(lambda: prepare_stores(cfg, self.tokenizer), "data")  # bad data: exit 2 on every rank
        n_nodes, _, node = runtime.nodes()
        if notes and (n_nodes > 1 or any(" built " in x for x in notes)):
            print(f"[data] node {node} ({socket.gethostname()}), local rank 0: {'; '.join(notes)}", flush=True)
        stores = open_stores(cfg, self.tokenizer)
        self.template = stores[1] if cfg.training.objective == "grpo" else None
        self.train_set = build_dataset(cfg, stores, "train")
        self.val_set = build_dataset(cfg, stores, "val") if cfg.validation.enable else None

    def _build_model(self) -> None:
        """Built on meta, parallelized, then materialised and initialised from (seed, FQN)."""
        cfg, layout = self.cfg, self.layout
        self.built = built = build_parallel_model(cfg, layout, self.mesh, self.ep_mesh, self.device, cfg.job.seed)
        self.model = built.model
        self.params = list(self.model.parameters())
        self.flops_per_token = flops_per_token(built.whole, layout.args, cfg.data.seq_len)
        self.moe_layers, self.mtp_models = router_modules(built.parts)
        # The aux loss rides with the LM loss, which is divided by the microbatch count here;
        # under PP the schedule divides every gradient by its microbatch count itself (scale_grads).
        # (DeepSeek-V3's MTP loss rides the same way: the model keeps its own scale and last value.)
        for m in self.moe_layers + self.mtp_models:
            if hasattr(m, "aux_loss_scale"):
                m.aux_loss_scale = 1.0 if built.schedule is not None else 1.0 / layout.accum
        for m in self.mtp_models:
            m.mtp_log_scale = 1.0 / layout.microbatches
        self.expert_params = [p for m in expert_modules(self.model) for p in m.parameters()] if self.dims.ep > 1 else []
        self.router_stats = {}
        loss_fn = built.loss_fn or loss_function(cfg, built)  # (the schedule's own under PP)
        if cfg.compile.enable and "loss" in cfg.compile.components and built.head is None:  # (a fused head stays eager)
            if isinstance(loss_fn, GlobalTargetMean):  # sft: the per-step scale stays outside the graph
                loss_fn.sum_fn = compile_loss(loss_fn.sum_fn, cfg.compile.cache_dir)
            else:
                loss_fn = compile_loss(loss_fn, cfg.compile.cache_dir)
        self.step_fn = ModelStep.of(built, layout, self.mesh, self.device, loss_fn, self.loss_group)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.optimizer = build_optimizer(self.model, cfg)
        self.optimizer_groups = describe_groups(self.optimizer, cfg)  # (the run header's optimizer line)
        self._dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
        self.peak, self.peak_source = peak_flops(self.device, self._dtype, cache_dir(cfg))
        self._peak_repaired = False
        # float8 weights all-gathered by FSDP: one fused amax/scale computation per step.
        self.float8_precompute = precomputes_scales(cfg, self.dims)
        self.state_bytes = None

    def _resume(self) -> None:
        """The newest intact checkpoint (if any) sets the weights, optimizer state, step and data
        position; the LR schedule follows from the step. A fresh run may start from HF weights."""
        cfg, t = self.cfg, self.cfg.training
        self.state = TrainState(self.layout.global_batch, cfg.data.seq_len,
                                SpikeGuard(t.loss_spike_factor, t.loss_spike_window, t.on_loss_spike))
        self.spike_note = None
        self.ckpt = None
        if cfg.checkpoint.enable:
            self.ckpt = CheckpointManager(cfg, self.model, self.optimizer, self.state, self.dims.describe(),
                                          tokenizer=self.tokenizer.fingerprint(), extra=self.checkpoint_extras())
            self.watchdog.begin("checkpoint load")
            self.ckpt.load_latest()
            self.watchdog.end()
        self.scheduler = build_lr_scheduler(self.optimizer, cfg, self.state.step)
        self.init_note = f"from (seed {cfg.job.seed}, parameter name)"
        if self.ckpt is not None and self.ckpt.loaded_from and self.state.step == 0:  # torchmeg.convert's, initial_load_path
            self.init_note = (f"from the model weights of {self.ckpt.loaded_from} (checkpoint.initial_load_path)"
                              if self.ckpt.loaded_initial else
                              f"from the model-only checkpoint {self.ckpt.loaded_from} (step 0)")
        if self.state.step == 0 and cfg.checkpoint.initial_load_hf:
            self.init_note = load_initial_hf(self.model, self.built.whole, cfg.checkpoint.initial_load_hf)
        self.start_step = self.state.step

    def checkpoint_extras(self) -> dict:  # Statefuls a subclass checkpoints besides model, optimizer, TrainState
        return {}

    def _build_loader(self) -> None:
        cfg, layout = self.cfg, self.layout
        self.logger = MetricsLogger(cfg, self.rank, resume_step=self.start_step)
        if cfg.training.objective == "grpo":  # rollouts by the model itself, on the live weights
            self.loader = GRPOBatches(self, self.train_set, self.template)
            return
        self.loader = build_loader(self.train_set, layout.local_batch, self.dims.dp, self.dp_rank, layout.accum,
                                   self.start_step, cfg.training.steps, cfg.data.num_workers,
                                   self.state.sample_offset)

    # ---- one step -----------------------------------------------------------------------------
    def train_step(self, batches) -> tuple[float, float, bool]:
        """Forward/backward over the step's microbatches, clip, update. -> (loss, grad_norm, stepped):
        not stepped when the loss or norm is non-finite, or a loss spike is skipped."""
        eager = None
        if self.cfg.compile.enable and self.cfg.compile.verify_cache and self.state.step == self.start_step:
            eager = eager_reference(self, batches)  # (compile.verify_cache: the run's first step, eager)
        loss_val, gn = self.loss_and_norm(self._forward_backward(batches))
        if eager is not None:
            check_against_eager(self, eager, (loss_val, gn))
        return self.apply_step(loss_val, gn)

    def apply_step(self, loss_val: float, gn: float) -> tuple[float, float, bool]:
        """The update a step's loss and norm allow (none if non-finite or a skipped spike), the LR step, stats."""
        finite = math.isfinite(loss_val) and math.isfinite(gn)
        spike = self.state.spike
        self.spike_note = spike.observe(loss_val) if finite else None
        if self.spike_note is not None:
            self._report_spike(loss_val)
        stepped = finite and not (self.spike_note and spike.action == "skip")
        if stepped:
            with record_function("torchmeg: optimizer"):
                self._update(gn)
        elif self.cfg.training.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss {loss_val} or grad norm {gn}; stopping "
                                     f"(training.on_nonfinite = \"stop\")")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._route_stats_and_balance()
        if self.step_fn.pairs is not None:  # dpo: the step's rewards, margin, accuracy; grpo: clipping, KL, entropy
            self.objective_stats = self.step_fn.pairs.step_metrics(self.loss_group)
        return loss_val, gn, stepped

    def loss_and_norm(self, loss_sum: torch.Tensor) -> tuple[float, float]:
        """The step's loss (mean over the loss group) and gradient norm, from this rank's loss sum."""
        with record_function("torchmeg: loss and grad norm"):
            dist.all_reduce(loss_sum, group=self.loss_group)
            loss_val = loss_sum.item() / dist.get_world_size(self.loss_group)
            # Expert grads already sum the tokens of the whole ep group: divide by ep to match
            # the data-parallel mean that FSDP applies to every other gradient.
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(self.dims.ep)
            gn = grad_norm(reduce_partial_grads(self.params), [self.pp_group] if self.built.schedule is not None else []).item()
        return loss_val, gn

    def _forward_backward(self, batches) -> torch.Tensor:
        """torchmeg.train.build.forward_backward, with the tests' fault hooks; step 1 is recorded op by op
        when TORCHMEG_RECORD_OPS=PATH (torchmeg.observe.op_record: dtypes at the matmuls, float8 modules)."""
        step = self.state.step + 1
        record = os.environ.get("TORCHMEG_RECORD_OPS") if step == 1 else None
        nan, spike = inject_nan(step), inject_spike(step)
        hook = (lambda loss: (loss * float("nan") if nan else loss) * spike) if nan or spike != 1.0 else None
        with OpRecorder() if record else contextlib.nullcontext() as rec:
            guard.inject_fault(step, self.rank)
            loss_sum = forward_backward(self.step_fn, batches, loss_hook=hook)
        if record:
            write_op_record(record, self.rank, rec.report(self.model))
        return loss_sum

    def _update(self, gn: float) -> None:
        clip_grads(self.params, self.cfg.training.max_norm, gn)
        self.optimizer.step()
        if self.float8_precompute:
            precompute_scales(self.model)
        if self.state_bytes is None:  # measured once, when grads and optimizer state all exist
            self.state_bytes = model_state_bytes(self.model, self.optimizer)

    def _report_spike(self, loss: float) -> None:
        """One line on rank 0 naming the step and its batch; stops the run under on_loss_spike = stop."""
        step, action = self.state.step + 1, self.state.spike.action
        first, end = batch_samples(step, self.layout.global_batch, self.state.sample_offset)
        what = {"log": "applied", "skip": "update skipped", "stop": "stopping"}[action]
        line = (f"loss spike at step {step}: {self.spike_note}; batch = global samples [{first}, {end}) "
                f"(data seed {self.cfg.job.seed}); {what} (training.on_loss_spike = \"{action}\")")
        if action == "stop":
            raise LossSpikeError(line)
        if self.rank == 0:
            print(line, flush=True)

    def _route_stats_and_balance(self) -> None:
        stats = step_router_stats(self.moe_layers, self.mtp_models, self.layout.args, self.dims, self.mesh, self.device,
                                  self.cfg.parallelism.expert_capacity_factor, self.loss_group)
        if stats:  # (a step without MoE layers or MTP keeps the last stats, as before)
            self.router_stats = stats

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over validation.steps global batches of the held-out split: the same samples
        under every layout with the same global batch (microbatches included), so val_loss is
        comparable across layouts."""
        v, layout = self.cfg.validation, self.layout
        loader = build_loader(self.val_set, layout.local_batch, self.dims.dp, self.dp_rank, layout.accum, 0, v.steps)
        self.model.eval()
        loss = mean_eval_loss(self.step_fn, loader, v.steps, self.device, self.loss_group)
        self.model.train()
        for m in self.moe_layers:  # evaluation traffic is not training load
            m.tokens_per_expert.zero_()
        return loss

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        if self.rank == 0:
            print("\n".join(start_lines(self)), flush=True)
        stop, it = StopFlag(), iter(self.loader)
        self.timeouts = CollectiveTimeouts(cfg, keep_long=[self.ckpt.async_group] if self.ckpt else [])
        self._window, self._skipped = [0.0, 0], 0  # (seconds, steps) since the last logged step
        profiler = StepProfiler(cfg, self.rank, self.device)
        for step in range(self.start_step + 1, cfg.training.steps + 1):
            loss, gn, lr, stepped = self._timed_step(step, it)
            profiler.step(step)
            with record_function("torchmeg: validate, log, save"):
                val = self._maybe_validate(step)
                if (step % cfg.metrics.log_freq == 0 or step in (1, cfg.training.steps) or val is not None
                        or not stepped or self.spike_note):
                    self._log(step, loss, gn, lr, val, stepped)
                self._check_skips(step, stepped)
                self.state.step = step
                self._poll_save(step)
                preempted = stop.agreed()
                self._maybe_save(step, step == cfg.training.steps or preempted, preempted)
            inject_kill(step, self.rank)
            inject_node_loss(step, fresh=self.start_step == 0)
            if preempted:
                if self.rank == 0:
                    print(f"SIGTERM: stopped after step {step}" + (", checkpoint saved" if self.ckpt else ""), flush=True)
                break
        profiler.close()
        self._finish()
        return 0

    def _timed_step(self, step: int, it) -> tuple[float, float, float, bool]:
        self.timeouts.steady(self.watchdog.limit_for("step"))
        self.watchdog.begin(f"step {step}")
        t0 = time.perf_counter()
        with record_function("torchmeg: data"):
            batches = [next(it) for _ in range(self.layout.accum)]
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        loss, gn, stepped = self.train_step(batches)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._window[0] += time.perf_counter() - t0
        self._window[1] += 1
        self.watchdog.end()
        self._skipped = 0 if stepped else self._skipped + 1
        return loss, gn, lr, stepped

    def _maybe_validate(self, step: int) -> float | None:
        v = self.cfg.validation
        if not (v.enable and (step % v.freq == 0 or step == self.cfg.training.steps)):
            return None
        self.timeouts.long()
        self.watchdog.begin(f"evaluation after step {step}")
        val = self.evaluate()
        self.watchdog.end()
        return val

    def _log(self, step: int, loss: float, gn: float, lr: float, val: float | None, stepped: bool) -> None:
        window_t, window_steps = self._window
        tps = self.layout.tokens_per_step * window_steps / window_t / self.world
        tflops = self.flops_per_token * tps / 1e12
        if (tflops * 1e12 > self.peak and self.device.type == "cpu" and self.rank == 0 and step > 1
                and not self._peak_repaired):  # once per run: a probe costs seconds (bf16 on CPU)
            self.peak = repair_peak(tflops * 1e12, self._dtype, cache_dir(self.cfg))
            self._peak_repaired = True
        row = {"step": step, "loss": loss, "grad_norm": gn, "lr": lr, "tokens_per_sec": tps, "tflops": tflops,
               "mfu": tflops * 1e12 / self.peak, **memory_fields(self.device),
               "elapsed_ms": 1000 * window_t / window_steps}
        mem = torch.tensor([row["memory_gib"]], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the worst rank is the one that OOMs
        row["memory_gib_max"] = mem.item()
        if self.state_bytes is not None:
            row["model_state_mib"] = self.state_bytes / 2 ** 20
        row.update(self.router_stats)
        row.update(self.objective_stats)
        row.update(getattr(self.loader, "window_metrics", dict)())  # grpo: the rollouts since the last log
        if val is not None:
            row["val_loss"] = val
        if not stepped:
            row["skipped"] = True
        if self.spike_note is not None:
            row["loss_spike"] = True
        self.logger.log(row, format_line(row))
        self._window = [0.0, 0]

    def _check_skips(self, step: int, stepped: bool) -> None:
        cap = self.cfg.training.max_consecutive_skips
        if cap and self._skipped >= cap:
            # Every rank sees the same all-reduced loss and norm, so all stop here together.
            raise FloatingPointError(f"{self._skipped} steps in a row were skipped (non-finite loss or grad norm, "
                                     f"or a loss spike; last at step {step}); stopping "
                                     f"(training.max_consecutive_skips = {cap})")

    def _poll_save(self, step: int) -> None:
        """An async save is committed as soon as its background write is done, not at the next save."""
        if self.ckpt is None or self.ckpt.pending is None:
            return
        if os.environ.get("TORCHMEG_TEST_KILL_AT_STEP") == str(step):
            self.ckpt.wait_for_write()  # tests: the save in flight has finished writing when the kill comes
        self.timeouts.long()
        self.watchdog.begin(f"checkpoint commit after step {step}")
        self.ckpt.poll()
        self.watchdog.end()

    def _maybe_save(self, step: int, last: bool, preempted: bool) -> None:
        if self.ckpt is not None and (self.ckpt.should_save(step, last) or preempted):
            self.timeouts.long()
            self.watchdog.begin(f"checkpoint save at step {step}")
            self.ckpt.save(step, last=last)
            self.watchdog.end()

    def _finish(self) -> None:
        if self.cfg.compile.enable and self.rank == 0:
            print(compile_summary(self.built.parts, self.cfg.model.blocks), flush=True)
        if self.ckpt is not None:
            self.timeouts.long()
            self.watchdog.begin("final checkpoint commit")
            self.ckpt.close()
            self.watchdog.end()
            if self.cfg.checkpoint.export_hf:
                export_hf(self.model, self.layout.args, self.cfg, os.path.join(self.ckpt.folder, "hf"))
        self.logger.close()

    def close(self) -> None:
        """The clean end of a successful run. Whatever may still hold communication work (the
        model's FSDP state, the optimizer, pipelining stages with their p2p works, the loader's
        workers) is released and collected while the interpreter is whole; one barrier, so no rank
        tears down its sockets while a peer still talks to it; then the groups go."""
        for name in ("loader", "built", "step_fn", "model", "optimizer", "scheduler", "params", "expert_params",
                     "ckpt"):
            setattr(self, name, None)
        gc.collect()
        runtime.end()
