"""`python -m torchmeg.train --config recipes/X.toml [--section.key=value ...]` (or under torchrun).

Builds everything from the recipe and runs the loop. Bad recipes exit 2 with one line, before
any process group exists.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmeg import __version__, guard
from torchmeg.config import Config, ConfigError, load_config, validate
from torchmeg.runtime import StopFlag, init_distributed, inject_kill, inject_nan, inject_spike, pick_device
from torchmeg.spike import LossSpikeError, SpikeGuard, batch_samples


# Known, harmless deprecation notices from torch/torchdata internals; they would bury the log.
warnings.filterwarnings("ignore", message=".*Slicing a flattened dim.*")
warnings.filterwarnings("ignore", message=".*set_vital.*")


def parse_args(argv: list[str]) -> Config:
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        if a == "--config" or a.startswith("--config="):
            if "=" in a:
                path = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                path, i = argv[i + 1], i + 1
            else:
                raise ConfigError("--config needs a path to a .toml recipe")
        else:
            rest.append(a)
        i += 1
    return load_config(path, rest)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _scalar(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Trainer:
    def __init__(self, cfg: Config):
        from torchmeg.data import build_dataset, build_loader, build_tokenizer, open_stores
        from torchmeg.metrics import MetricsLogger
        from torchmeg.peak import peak_flops
        from torchmeg.models import active_params, count_params, flops_per_token, get_spec
        from torchmeg.optim import build_lr_scheduler, build_optimizer
        from torchmeg.parallel import ParallelDims
        from torchmeg.parallel.pipeline import describe_inflight
        self.cfg = cfg
        self.device = pick_device(cfg)
        init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.watchdog = guard.Watchdog(cfg, self.rank, describe_inflight if cfg.parallelism.pipeline_parallel_degree > 1 else None)
        if cfg.training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.job.seed)

        self.dims = dims = ParallelDims.from_config(cfg, self.world)
        self.mesh = mesh = dims.build_mesh(self.device.type)
        self.dp_rank = mesh["dp"].get_local_rank()
        self.loss_group = mesh["dp_cp"].get_group()
        t = cfg.training
        self.accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dims.dp)
        self.global_batch = t.local_batch_size * dims.dp * self.accum

        # Data: one builder per node prepares caches; the rest wait, then every rank opens them.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            open_stores(cfg, self.tokenizer)
        dist.barrier()
        stores = open_stores(cfg, self.tokenizer)
        self.train_set = build_dataset(cfg, stores, "train")
        self.val_set = build_dataset(cfg, stores, "val") if cfg.validation.enable else None

        # Model: built on meta, parallelized, then materialised and initialised from (seed, FQN).
        self.spec = get_spec(cfg.model.name)
        built = build_parallel_model(cfg, dims, mesh, self.device, self.tokenizer.vocab_size, cfg.job.seed, self.accum)
        model, self.args = built.model, built.args
        self.model_class = getattr(built.whole, "hf_class", type(built.whole).__name__)
        self.n_params = count_params(built.whole)
        self.n_params_dense = count_params(built.whole, exclude_embeddings=True)
        self.n_params_active = active_params(built.whole)
        self.flops_per_token = flops_per_token(built.whole, self.args, cfg.data.seq_len)
        self.schedule, self.pp_group = built.schedule, mesh["pp"].get_group()
        self.parallel_report = built.report
        self.has_first, self.has_last, self.stage_desc = built.has_first, built.has_last, built.stage_desc
        self.model = model
        self.params = list(model.parameters())
        self.moe_layers = [m for m in model.modules() if hasattr(m, "update_bias")]
        # The aux loss rides with the LM loss, which is divided by the microbatch count here;
        # under PP the schedule divides every gradient by its microbatch count itself (scale_grads).
        for m in self.moe_layers:
            if hasattr(m, "aux_loss_scale"):
                m.aux_loss_scale = 1.0 if built.schedule is not None else 1.0 / self.accum
        from torchmeg.parallel.expert import expert_modules
        self.expert_params = [p for m in expert_modules(model) for p in m.parameters()] if dims.ep > 1 else []
        self.router_stats = {}
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)

        self.loss_parallel = dims.tp > 1 and cfg.parallelism.loss_parallel and dims.pp == 1
        self.loss_fn = cross_entropy
        if cfg.compile.enable and "loss" in cfg.compile.components:
            from torchmeg.compile import compile_loss
            self.loss_fn = compile_loss(cross_entropy, cfg.compile.cache_dir)
        from torchmeg.data.sources import cache_dir
        dtype = torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32
        self.peak, self.peak_source = peak_flops(self.device, dtype, cache_dir(cfg))
        self._dtype, self._peak_repaired = dtype, False
        # Resume: the newest intact checkpoint (if any) sets the weights, optimizer, schedule and step;
        # the data position follows from the step (sample_offset is non-zero only after a resume
        # that remapped it by tokens, see checkpoint.remap_data_position).
        self.step, self.ckpt, self.sample_offset = 0, None, 0
        self.spike = SpikeGuard(t.loss_spike_factor, t.loss_spike_window, t.on_loss_spike)
        self.spike_note = None
        if cfg.checkpoint.enable:
            from torchmeg.checkpoint import CheckpointManager
            self.ckpt = CheckpointManager(cfg, self)
            self.watchdog.begin("checkpoint load")
            self.ckpt.load_latest()
            self.watchdog.end()
        self.init_note = f"from (seed {cfg.job.seed}, parameter name)"
        if self.step == 0 and cfg.checkpoint.initial_load_hf:
            self._load_hf_weights(cfg.checkpoint.initial_load_hf)
        self.start_step = self.step
        self.loader = build_loader(self.train_set, t.local_batch_size, dims.dp, self.dp_rank, self.accum,
                                   self.start_step, t.steps, cfg.data.num_workers, self.sample_offset)
        self.logger = MetricsLogger(cfg, self.rank, resume_step=self.start_step)
        self.state_bytes = None
        # float8 weights all-gathered by FSDP: one fused amax/scale computation per step.
        self.float8_precompute = (cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather
                                  and cfg.float8.recipe == "tensorwise" and (dims.fsdp > 1 or t.mixed_precision == "bf16"))

    def _load_hf_weights(self, folder: str) -> None:
        """checkpoint.initial_load_hf: a fresh run starts from Hugging Face safetensors (each rank
        reads its shards only); the weights must be finite, like a resumed checkpoint's."""
        from torchmeg.hf import load_hf_native
        try:
            n = load_hf_native(self.model, folder)
        except Exception as e:  # noqa: BLE001 - DCP wraps per-rank errors; one line names the folder
            msg = str(e).strip().splitlines()
            raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: cannot load it into "
                              f"{self.model_class} ({msg[-1] if msg else type(e).__name__})") from None
        from torchmeg.checkpoint import all_finite
        if not all_finite(self.model.parameters()):  # all-reduced: every rank stops alike
            raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: non-finite values in the weights")
        self.init_note = f"from Hugging Face weights in {folder} ({n} tensors)"

    # ---- one step ---------------------------------------------------------------------------
    def _ctx(self):
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        return stack

    def forward_backward(self, batches) -> torch.Tensor:
        """Forward and backward over the step's microbatches (gradients accumulate in the
        parameters) -> the sum of this rank's microbatch losses, each divided by accum."""
        if self.schedule is not None:  # the schedule runs every microbatch itself
            return self._pipeline_step(batches, train=True)
        loss_sum = torch.zeros((), device=self.device)
        for m, (inputs, labels) in enumerate(batches):
            inputs, labels = self._local(inputs), self._local(labels)
            if hasattr(self.model, "set_requires_gradient_sync"):
                # Reduce gradients once, after the last microbatch.
                self.model.set_requires_gradient_sync(m == self.accum - 1)
            with self._ctx():
                guard.inject_fault(self.step + 1, self.rank)
                loss = self.loss_fn(self.model(inputs), labels) / self.accum
                if inject_nan(self.step + 1):
                    loss = loss * float("nan")
                loss = loss * inject_spike(self.step + 1)
                loss.backward()
            loss_sum += _scalar(loss.detach()).float()
        return loss_sum

    def train_step(self, batches) -> tuple[float, float, bool]:
        """Forward/backward over the step's microbatches, clip, update. -> (loss, grad_norm, stepped):
        not stepped when the loss or norm is non-finite, or a loss spike is skipped."""
        from torchmeg.optim import clip_grads, grad_norm
        record = os.environ.get("TORCHMEG_RECORD_OPS") if self.step == 0 else None
        if record:  # what really ran in step 1 (torchmeg.op_record): dtypes at the matmuls, float8 modules
            from torchmeg.op_record import OpRecorder
        with OpRecorder() if record else contextlib.nullcontext() as rec:
            loss_sum = self.forward_backward(batches)
        if record:
            from torchmeg.op_record import write
            write(record, self.rank, rec.report(self.model))
        dist.all_reduce(loss_sum, group=self.loss_group)
        loss_val = loss_sum.item() / dist.get_world_size(self.loss_group)
        if self.expert_params:
            # Expert grads already sum the tokens of the whole ep group: divide by ep to match
            # the data-parallel mean that FSDP applies to every other gradient.
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(self.dims.ep)
        gn = grad_norm(self.params, [self.pp_group] if self.schedule is not None else []).item()
        finite = math.isfinite(loss_val) and math.isfinite(gn)
        self.spike_note = self.spike.observe(loss_val) if finite else None
        if self.spike_note is not None:
            self._report_spike(loss_val)
        stepped = finite and not (self.spike_note and self.spike.action == "skip")
        if stepped:
            clip_grads(self.params, self.cfg.training.max_norm, gn)
            self.optimizer.step()
            if self.float8_precompute:
                from torchmeg.float8 import precompute_scales
                precompute_scales(self.model)
            if self.state_bytes is None:  # measured once, when grads and optimizer state all exist
                from torchmeg.metrics import model_state_bytes
                self.state_bytes = model_state_bytes(self.model, self.optimizer)
        elif self.cfg.training.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss {loss_val} or grad norm {gn}; stopping "
                                     f"(training.on_nonfinite = \"stop\")")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._route_stats_and_balance()
        return loss_val, gn, stepped

    def _report_spike(self, loss: float) -> None:
        """One line on rank 0 naming the step and its batch; stops the run under on_loss_spike = stop."""
        step = self.step + 1
        first, end = batch_samples(step, self.global_batch, self.sample_offset)
        what = {"log": "applied", "skip": "update skipped", "stop": "stopping"}[self.spike.action]
        line = (f"loss spike at step {step}: {self.spike_note}; batch = global samples [{first}, {end}) "
                f"(data seed {self.cfg.job.seed}); {what} (training.on_loss_spike = \"{self.spike.action}\")")
        if self.spike.action == "stop":
            raise LossSpikeError(line)
        if self.rank == 0:
            print(line, flush=True)

    def _route_stats_and_balance(self) -> None:
        """MoE: global tokens per expert this step -> load-balancing bias update and router stats."""
        if not self.moe_layers:
            return
        loads = torch.stack([m.tokens_per_expert for m in self.moe_layers])  # [moe layers, experts]
        dist.all_reduce(loads, group=self.loss_group)
        for m, load in zip(self.moe_layers, loads):
            m.update_bias(load)
            m.tokens_per_expert.zero_()
        imbalance = (loads.max(1).values / loads.mean(1).clamp_min(1e-9)).mean().item()
        self.router_stats = {"moe_imbalance": imbalance, "tokens_per_expert": loads.sum(0).tolist()}

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch: on the device, and its sequence shard under context parallel."""
        t = t.to(self.device)
        if self.dims.cp > 1:
            from torchmeg.parallel.context import shard_sequence
            t = shard_sequence(t, self.mesh["cp"].get_local_rank(), self.dims.cp)
        return t

    def _pipeline_step(self, batches, train: bool) -> torch.Tensor:
        """One schedule run over the step's sequences; the loss (mean over microbatches) is known
        on the last stage's rank and summed over the pipeline group so every rank holds it."""
        if train:
            guard.inject_fault(self.step + 1, self.rank)
        inputs = self._local(torch.cat([b[0] for b in batches]))
        labels = self._local(torch.cat([b[1] for b in batches]))
        losses = []
        args = (inputs,) if self.has_first else ()
        kw = {"target": labels, "losses": losses} if self.has_last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kw)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.has_last else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.pp_group)
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over validation.steps global batches of the held-out split: the same samples
        under every layout with the same global batch (microbatches included), so val_loss is
        comparable across layouts."""
        from torchmeg.data import build_loader
        v, t = self.cfg.validation, self.cfg.training
        accum = self.accum
        loader = build_loader(self.val_set, t.local_batch_size, self.dims.dp, self.dp_rank, accum, 0, v.steps)
        self.model.eval()
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            it = iter(loader)
            for _ in range(v.steps):
                total += self._pipeline_step([next(it) for _ in range(accum)], train=False)
        else:
            for inputs, labels in loader:
                with self._ctx():
                    loss = self.loss_fn(self.model(self._local(inputs)), self._local(labels))
                total += _scalar(loss).float() / accum  # a step's loss: the mean of its microbatches
        self.model.train()
        for m in self.moe_layers:  # evaluation traffic is not training load
            m.tokens_per_expert.zero_()
        dist.all_reduce(total, group=self.loss_group)
        return total.item() / (v.steps * dist.get_world_size(self.loss_group))

    # ---- the loop ---------------------------------------------------------------------------
    def header(self) -> None:
        if self.rank != 0:
            return
        a, c, d = self.args, self.cfg, self.dims
        n_tok = sum(len(p.w) for p in _parts(self.train_set)) * c.data.seq_len
        backend = dist.get_backend()
        lines = [
            f"torchmeg {__version__} | torch {torch.__version__} | run '{c.job.name}' -> {c.run_dir}",
            f"model      {self._model_name()}: {self.n_params / 1e6:.2f}M params "
            f"({self.n_params_dense / 1e6:.2f}M non-embedding"
            + (f", {self.n_params_active / 1e6:.2f}M active per token" if self.n_params_active != self.n_params else "")
            + f"), {a.n_layers} layers, dim {a.dim}, "
            f"heads {a.n_heads}/{a.kv_heads}, vocab {a.vocab_size}; {self.flops_per_token / 1e6:.1f} MFLOP/token "
            f"at seq {c.data.seq_len}",
            f"data       {c.data.dataset} ({self.tokenizer.name} tokenizer): {n_tok / 1e6:.1f}M train tokens, "
            f"{self.train_set.n_unique:,} windows; validation {'on' if c.validation.enable else 'off'}",
            f"layout     {d.describe()} | {self.device.type} ({backend}) | {c.training.mixed_precision}"
            + (f" | {self.stage_desc}" if self.schedule is not None else ""),
            f"parallel   {self.parallel_report}",
            f"init       {self.init_note}",
            f"batch      {c.training.local_batch_size} seq x dp {d.dp} x accum {self.accum} = {self.global_batch} "
            f"seq = {self.global_batch * c.data.seq_len:,} tokens/step, {c.training.steps} steps",
            f"optimizer  {c.optimizer.name} lr {c.optimizer.lr:g} wd {c.optimizer.weight_decay:g}; "
            f"warmup {c.lr_scheduler.warmup_steps}, {c.lr_scheduler.decay_type} to {c.lr_scheduler.min_lr_ratio:g}x; "
            f"clip {c.training.max_norm:g}",
            f"peak       {self.peak / 1e12:.3f} TFLOP/s per rank ({self.peak_source})",
        ]
        print("\n".join(lines), flush=True)

    def _model_name(self) -> str:
        if self.spec.make_args is not None:  # e.g. hf/llama (LlamaForCausalLM from recipes/hf/x.json)
            return f"{self.cfg.model.name}/{self.args.model_type} ({self.model_class} from {self.cfg.model.hf_config})"
        return f"{self.cfg.model.name}/{self.cfg.model.flavor}"

    def run(self) -> int:
        from torchmeg.data.sources import cache_dir
        from torchmeg.metrics import format_line, peak_memory_gib
        from torchmeg.profiling import StepProfiler
        cfg = self.cfg
        self.header()
        if self.start_step and self.rank == 0:
            print("\n".join([f"resumed   from step {self.start_step} ({self.ckpt.loaded_from})"] + self.ckpt.notes), flush=True)
        stop = StopFlag()
        it = iter(self.loader)
        tokens_per_step = self.global_batch * cfg.data.seq_len
        window_t, window_steps, skipped_in_a_row = 0.0, 0, 0
        profiler = StepProfiler(cfg, self.rank, self.device)
        wd = self.watchdog
        for step in range(self.start_step + 1, cfg.training.steps + 1):
            wd.begin(f"step {step}")
            t0 = time.perf_counter()
            batches = [next(it) for _ in range(self.accum)]
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
            loss, gn, stepped = self.train_step(batches)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            wd.end()
            profiler.step(step)
            window_t += dt
            window_steps += 1
            skipped_in_a_row = 0 if stepped else skipped_in_a_row + 1
            val = None
            if cfg.validation.enable and (step % cfg.validation.freq == 0 or step == cfg.training.steps):
                wd.begin(f"evaluation after step {step}")
                val = self.evaluate()
                wd.end()
            if step % cfg.metrics.log_freq == 0 or step == 1 or step == cfg.training.steps or val is not None or not stepped or self.spike_note:
                tps = tokens_per_step * window_steps / window_t / self.world
                tflops = self.flops_per_token * tps / 1e12
                if (tflops * 1e12 > self.peak and self.device.type == "cpu" and self.rank == 0 and step > 1
                        and not self._peak_repaired):  # once per run: a probe costs seconds (bf16 on CPU)
                    from torchmeg.peak import repair_peak
                    self.peak = repair_peak(tflops * 1e12, self._dtype, cache_dir(self.cfg))
                    self._peak_repaired = True
                row = {"step": step, "loss": loss, "grad_norm": gn, "lr": lr,
                       "tokens_per_sec": tps, "tflops": tflops, "mfu": tflops * 1e12 / self.peak,
                       "memory_gib": peak_memory_gib(self.device), "elapsed_ms": 1000 * window_t / window_steps}
                mem = torch.tensor([row["memory_gib"]], dtype=torch.float64)
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the worst rank is the one that OOMs
                row["memory_gib_max"] = mem.item()
                if self.state_bytes is not None:
                    row["model_state_mib"] = self.state_bytes / 2 ** 20
                row.update(self.router_stats)
                if val is not None:
                    row["val_loss"] = val
                if not stepped:
                    row["skipped"] = True
                if self.spike_note is not None:
                    row["loss_spike"] = True
                self.logger.log(row, format_line(row))
                window_t, window_steps = 0.0, 0
            cap = cfg.training.max_consecutive_skips
            if cap and skipped_in_a_row >= cap:
                # Every rank sees the same all-reduced loss and norm, so all stop here together.
                raise FloatingPointError(f"{skipped_in_a_row} steps in a row were skipped (non-finite loss or grad norm, "
                                         f"or a loss spike; last at step {step}); stopping "
                                         f"(training.max_consecutive_skips = {cap})")
            self.step = step
            preempted = stop.agreed()
            last = step == cfg.training.steps or preempted
            if self.ckpt is not None and (self.ckpt.should_save(step, last) or preempted):
                wd.begin(f"checkpoint save at step {step}")
                self.ckpt.save(step, last=last)
                wd.end()
            inject_kill(step, self.rank)
            if preempted:
                if self.rank == 0:
                    print(f"SIGTERM: stopped after step {step}" + (", checkpoint saved" if self.ckpt else ""), flush=True)
                break
        profiler.close()
        if self.ckpt is not None:
            wd.begin("final checkpoint commit")
            self.ckpt.close()
            wd.end()
            if cfg.checkpoint.export_hf:
                from torchmeg.hf import export_hf
                export_hf(self, os.path.join(self.ckpt.folder, "hf"))
        self.logger.close()
        return 0

    def close(self) -> None:
        """The clean end of a successful run. Whatever may still hold communication work (the
        model's FSDP state, the optimizer, pipelining stages with their p2p works, the loader's
        workers) is released and collected while the interpreter is whole; one barrier, so no rank
        tears down its sockets while a peer still talks to it; then the groups go."""
        import gc
        for name in ("loader", "schedule", "model", "optimizer", "scheduler", "params", "expert_params", "ckpt"):
            setattr(self, name, None)
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class Built:
    """What build_parallel_model() made: `model` (this rank's, a StageUnion of its pipeline stages
    under PP), `whole` (the meta model before any split: counts and FLOPs), `parts` (the stages,
    or [model]), their stage `ids`, the pipeline `schedule` (None without PP), the header texts."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def build_parallel_model(cfg, dims, mesh, device, vocab: int, seed: int | None, accum: int, schedule: bool = True,
                         storage=contextlib.nullcontext) -> Built:
    """The model on this rank: built on meta, split into its pipeline stages, each parallelized
    (torchmeg.parallel.parallelize) and materialised on `device`, every parameter initialised from
    (seed, FQN) on its own shard only. The planner's fake-tensor dry run passes seed None (storage
    only), schedule=False (no peers to run one with) and storage=FakeTensorMode (what storage is
    made under; parallelize() itself runs outside it, as it builds meshes)."""
    from torchmeg.models import build_model, get_spec, materialize
    from torchmeg.parallel.parallelize import describe_report, parallelize
    from torchmeg.parallel.shards import local_block
    spec = get_spec(cfg.model.name)
    whole = build_model(cfg, vocab, "meta")
    if dims.pp == 1:
        model = parallelize(whole, dims, cfg, mesh=mesh)
        with storage():
            materialize(model, device, seed, block=local_block)
        return Built(model=model, whole=whole, parts=[model], ids=[0], counts=[whole.args.n_layers], schedule=None,
                     args=whole.args, report=describe_report(model.torchmeg_report), has_first=True, has_last=True,
                     stage_desc="")
    # Split into this rank's stages first; each stage then goes through the whole pass.
    from torchmeg.parallel import pipeline as pl
    sched = cfg.parallelism.pipeline_parallel_schedule
    v, counts = pl.plan_stages(cfg, whole.args.n_layers, dims.pp)
    ids = pl.stage_ids(mesh["pp"].get_local_rank(), dims.pp, v, sched)
    parts = pl.split_model(whole, spec, counts, ids)
    for part in parts:
        parallelize(part, dims, cfg, mesh=mesh)
        with storage():
            materialize(part, device, seed, block=local_block)
    pipe = None
    if schedule:
        pipe = pl.build_schedule(parts, ids, len(counts), device, mesh["pp"].get_group(),
                                 pl.microbatches(cfg, dims.pp, v, accum), cross_entropy, sched)
    desc = f"stages {ids} of {len(counts)} ({counts} layers), {sched}"
    if dims.fsdp > 1 and sched in pl.SPLIT_BACKWARD and cfg.parallelism.fsdp_reshard_after_forward:
        desc += " (FSDP keeps weights gathered from forward to the weight-gradient pass)"
    return Built(model=pl.StageUnion(parts, spec.layers_attr), whole=whole, parts=parts, ids=ids, counts=counts,
                 schedule=pipe, args=whole.args, report=" | ".join(describe_report(p.torchmeg_report) for p in parts),
                 has_first=0 in ids, has_last=len(counts) - 1 in ids, stage_desc=desc)


def _parts(ds):
    src = ds.src
    return src.sources if hasattr(src, "sources") else [src]


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 failed (on any rank), 2 bad recipe, 3 hang (watchdog)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
        validate(cfg)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike; one of them says why
            print(f"torchmeg: error: {e}", file=sys.stderr, flush=True)
        else:
            # ...and the others leave a moment later: a launcher (torchrun) stops every worker as
            # soon as one exits, which could kill rank 0 before its line is out (seen 1 in ~200).
            time.sleep(3)
        return guard.EXIT_CONFIG
    rank = int(os.environ.get("RANK", "0"))
    try:
        trainer = Trainer(cfg)
        trainer.run()
        trainer.close()
        return 0
    except ConfigError as e:  # a check that needs the data, device or checkpoint, after start-up
        if rank == 0:
            print(f"torchmeg: error: {e}", file=sys.stderr, flush=True)
        code = guard.EXIT_CONFIG
    except (FloatingPointError, LossSpikeError) as e:  # on_nonfinite / on_loss_spike = "stop", max_consecutive_skips: all ranks alike
        if rank == 0:
            print(f"torchmeg: stopped: {e}", file=sys.stderr, flush=True)
        code = guard.EXIT_FAILED
    except BaseException as e:  # noqa: BLE001 - any failure on any rank ends the job now
        guard.report_failure(e, rank)
        code = guard.EXIT_FAILED
    guard.hard_exit(code)  # no barrier, no teardown: peers may be gone or stuck
    return code


if __name__ == "__main__":
    # Leave without interpreter teardown: a gloo work object that outlives destroy_process_group()
    # and is destroyed while the interpreter shuts down needs the GIL and aborts the process
    # ("terminate called without an active exception", SIGABRT; measured on 2/100 FSDP2 runs
    # before this). Everything that must reach disk was closed and flushed above.
    code = main()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
