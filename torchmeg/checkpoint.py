"""Checkpoints that never lose work: torch.distributed.checkpoint (DCP), committed atomically.

Layout of `checkpoint.folder`:
  step-00000010/           a COMMITTED checkpoint (DCP files + torchmeg.json), only ever renamed in
  .tmp-step-00000015/      a save in progress; never loaded, removed at the next start
A save writes into `.tmp-…`, every rank finishes (barrier), then rank 0 writes torchmeg.json and
renames the folder: a reader sees a whole checkpoint or none. Older ones are pruned only after a
newer one is committed.

What is saved: model and optimizer state through `get_state_dict` (FQN-keyed, unsharded names, so
any layout can load any other: DCP reshards on load), the LR scheduler, the step, and the RNG
state. The data position needs no state of its own: sample order is a function of (seed, step),
so the loader is rebuilt at the resumed step under whatever layout resumes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

MARKER = "torchmeg.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve_folder(cfg) -> str:
    f = cfg.checkpoint.folder
    return f if os.path.isabs(f) else os.path.join(cfg.run_dir, f)


def check_folder(cfg) -> None:
    """Before any training: the checkpoint folder exists or can be made, and is writable."""
    from torchmeg.config import ConfigError
    folder = resolve_folder(cfg)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".probe-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint.folder = {cfg.checkpoint.folder!r}: cannot write to {folder} "
                          f"({e.strerror}); pick a writable folder or set checkpoint.enable = false") from None


def committed_steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:08d}")


class ModelState(Stateful):
    def __init__(self, model, options=None):
        self.model, self.options = model, options or StateDictOptions()

    def state_dict(self):
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optimizer, sd)


class TrainState(Stateful):
    """Step, LR scheduler and RNG (identical on every rank: all ranks seed alike)."""

    def __init__(self, trainer):
        self.t = trainer

    def state_dict(self):
        sd = {"step": torch.tensor(self.t.step), "scheduler": self.t.scheduler.state_dict(),
              "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd):
        self.t.step = int(sd["step"])
        self.t.scheduler.load_state_dict(sd["scheduler"])
        torch.set_rng_state(sd["rng_cpu"])
        if "rng_cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng_cuda"])


def _is_finite_state(model) -> bool:
    ok = torch.ones((), dtype=torch.float32)
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(t).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


class CheckpointManager:
    def __init__(self, cfg, trainer):
        self.cfg, self.t = cfg, trainer
        self.c = cfg.checkpoint
        self.folder = resolve_folder(cfg)
        self.rank = dist.get_rank()
        self.pending = None  # (future, tmp, final, step) of an async save not yet committed
        # Async saves run collectives in a background thread: give them their own gloo group so
        # they never interleave with training's collectives on the default group.
        self.async_group = dist.new_group(backend="gloo") if self.c.async_mode == "async" else None
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            for name in os.listdir(self.folder):
                if name.startswith(".tmp-step-"):  # an interrupted save: never valid, never loaded
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        dist.barrier()

    def _states(self, model_only: bool = False):
        if model_only:
            return {"model": ModelState(self.t.model)}
        return {"model": ModelState(self.t.model), "optimizer": OptimizerState(self.t.model, self.t.optimizer),
                "train": TrainState(self.t)}

    # ---- load --------------------------------------------------------------------------------
    def load_latest(self) -> int | None:
        """Load checkpoint.load_step (or the newest committed one); returns its step or None."""
        from torchmeg.config import ConfigError
        steps = committed_steps(self.folder)
        want = self.c.load_step
        if want == -1:
            if not steps:
                return None
            want = steps[-1]
        elif want not in steps:
            raise ConfigError(f"checkpoint.load_step = {want}: no committed checkpoint for that step in "
                              f"{self.folder} (have: {steps or 'none'}); use -1 for the latest")
        path = step_dir(self.folder, want)
        with open(os.path.join(path, MARKER)) as fh:
            meta = json.load(fh)
        states = self._states(model_only=meta.get("model_only", False))
        dcp.load(states, checkpoint_id=path)
        if meta.get("model_only"):
            self.t.step = want
        return want

    # ---- save --------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        return step % self.c.interval == 0 or last

    def save(self, step: int, last: bool = False) -> None:
        self.wait()  # one save in flight at most; commit the previous one first
        if not _is_finite_state(self.t.model):
            if self.rank == 0:
                print(f"[checkpoint] step {step}: model holds non-finite values; not saved", flush=True)
            return
        final = step_dir(self.folder, step)
        if os.path.isdir(final):
            return
        tmp = os.path.join(self.folder, f".tmp-step-{step:08d}")
        model_only = last and self.c.last_save_model_only
        states = self._states(model_only)
        if model_only and self.c.export_dtype != "float32":
            dtype = getattr(torch, self.c.export_dtype)
            states = {"model": {k: v.to(dtype) for k, v in get_model_state_dict(self.t.model).items()}}
        t0 = time.perf_counter()
        if self.c.async_mode == "async" and not last:
            fut = dcp.async_save(states, checkpoint_id=tmp, process_group=self.async_group)
            self.pending = (fut, tmp, final, step, t0, model_only)
            return
        dcp.save(states, checkpoint_id=tmp)
        self._commit(tmp, final, step, t0, model_only)

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, step, t0, model_only = self.pending
        self.pending = None
        fut.result()
        self._commit(tmp, final, step, t0, model_only)

    def _commit(self, tmp, final, step, t0, model_only) -> None:
        _test_hook_kill_before_commit(step)
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            meta = {"step": step, "time": time.time(), "layout": self.t.dims.describe(), "model_only": model_only,
                    "model": f"{self.cfg.model.name}/{self.cfg.model.flavor}"}
            with open(os.path.join(tmp, MARKER), "w") as fh:
                json.dump(meta, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            self._prune()
            print(f"[checkpoint] step {step} committed to {final} in {time.perf_counter() - t0:.2f} s", flush=True)
        dist.barrier()

    def _prune(self) -> None:
        k = self.c.keep_latest_k
        if k <= 0:
            return
        for s in committed_steps(self.folder)[:-k]:
            shutil.rmtree(step_dir(self.folder, s), ignore_errors=True)

    def close(self) -> None:
        self.wait()


def _test_hook_kill_before_commit(step: int) -> None:
    """Tests: TORCHMEG_TEST_KILL_IN_SAVE=N dies after writing step N's shards, before the commit."""
    if os.environ.get("TORCHMEG_TEST_KILL_IN_SAVE") == str(step):
        os._exit(17)
