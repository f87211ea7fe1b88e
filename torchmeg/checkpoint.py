"""Checkpoints that never lose work: torch.distributed.checkpoint (DCP), committed atomically.

Layout of `checkpoint.folder`:
  step-00000010/           a COMMITTED checkpoint (DCP files + torchmeg.json), only ever renamed in
  .tmp-step-00000015/      a save in progress; never loaded, removed at the next start
A save writes into `.tmp-…`, every rank finishes (barrier), then rank 0 writes torchmeg.json and
renames the folder: a reader sees a whole checkpoint or none. Older ones are pruned only after a
newer one is committed.

Checkpoints that refuse to lie: torchmeg.json also records every file's size and CRC32 (the ranks
hash their share in parallel), the recipe's optimizer / schedule keys and the data position. At
load the files are checked against it, DCP's errors are caught, and the loaded weights and
optimizer state must be finite; a checkpoint failing any of that is named in one line, renamed
`step-N.damaged` (kept for inspection, never loaded again) and the previous complete one is used
(`checkpoint.on_damaged = "fallback"`), or the run stops (`"stop"`). A resume applies the recipe's
optimizer and schedule values (and says which changed); another global batch or seq_len than the
checkpoint's is refused unless `checkpoint.remap_data_position = true`, which continues from the
same number of consumed tokens.

What is saved: model and optimizer state through `get_state_dict` (FQN-keyed, unsharded names, so
any layout can load any other: DCP reshards on load), the LR scheduler, the step, and the RNG
state. The data position needs no state of its own: sample order is a function of (seed, step),
so the loader is rebuilt at the resumed step under whatever layout resumes.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from torchmeg.config import ConfigError

MARKER = "torchmeg.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve_folder(cfg) -> str:
    f = cfg.checkpoint.folder
    return f if os.path.isabs(f) else os.path.join(cfg.run_dir, f)


def check_folder(cfg) -> None:
    """Before any training: the checkpoint folder exists or can be made, and is writable."""
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


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message is one line naming it (exit 2, like a bad recipe)."""


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(names: list[str]) -> list[str]:
    """The files this rank hashes: every world-size-th one, so the ranks share the reading."""
    r, w = dist.get_rank(), dist.get_world_size()
    return [n for i, n in enumerate(sorted(names)) if i % w == r]


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problem: str | None) -> str | None:
    """Every rank's finding -> the same verdict on every rank (the first problem any rank saw)."""
    return next((p for p in _gather(problem) if p), None)


def _first_line(e: BaseException) -> str:
    inner = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: the real exception}
    if isinstance(inner, dict) and inner:
        e = next(iter(inner.values()))
        e = getattr(e, "exc", e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def all_finite(tensors) -> bool:
    ok = torch.ones((), dtype=torch.float32)
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not torch.isfinite(t).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


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
    return all_finite(model.parameters())


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                yield v


# Recipe keys a resume takes from the recipe, not the checkpoint (compared and reported).
_RESUME_KEYS = {"optimizer": ("name", "lr", "weight_decay", "betas", "eps"),
                "lr_scheduler": ("warmup_steps", "decay_type", "min_lr_ratio"),
                "training": ("steps", "max_norm")}


class CheckpointManager:
    def __init__(self, cfg, trainer):
        self.cfg, self.t = cfg, trainer
        self.c = cfg.checkpoint
        self.folder = resolve_folder(cfg)
        self.rank = dist.get_rank()
        self.loaded_from = None
        self.notes: list[str] = []  # what the resume changed, printed (rank 0) under the run header
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
        """Load checkpoint.load_step (or the newest intact committed one); returns its step or None."""
        steps = committed_steps(self.folder)
        want = self.c.load_step
        if want != -1 and want not in steps:
            raise ConfigError(f"checkpoint.load_step = {want}: no committed checkpoint for that step in "
                              f"{self.folder} (have: {steps or 'none'}); use -1 for the latest")
        candidates = [want] if want != -1 else steps[::-1]
        for step in candidates:
            path = step_dir(self.folder, step)
            problem = self._try_load(path, step)
            if problem is None:
                self.loaded_from = path
                return step
            if self.c.on_damaged == "stop" or want != -1:
                raise CheckpointError(f"checkpoint {path} is damaged ({problem}); set checkpoint.on_damaged = "
                                      f"\"fallback\" (with load_step = -1) to use the previous complete one, or move it away")
            if self.rank == 0:
                moved = _set_aside(path, ".damaged")
                print(f"[checkpoint] {path} is damaged ({problem}); renamed to {os.path.basename(moved)}, "
                      f"trying the previous complete checkpoint", flush=True)
            dist.barrier()
        if candidates:
            raise CheckpointError(f"checkpoint.folder {self.folder}: no intact checkpoint left (damaged ones are "
                                  f"renamed *.damaged); move them away to start from scratch")
        return None

    def _try_load(self, path: str, step: int) -> str | None:
        """Load `path` into the trainer; None if it is whole and finite, else the problem (one line,
        the same on every rank)."""
        problem, meta = None, {}
        try:
            with open(os.path.join(path, MARKER)) as fh:
                meta = json.load(fh)
            problem = self._verify_files(path, meta.get("files"))
        except (OSError, ValueError) as e:
            problem = f"{MARKER}: {_first_line(e)}"
        problem = _agree(problem)
        if problem:
            return problem
        self._check_data_position(path, meta)  # a refusal is the user's call, not damage: raises
        keep = [{k: v for k, v in g.items() if k != "params"} for g in self.t.optimizer.param_groups]
        try:
            dcp.load(self._states(model_only=meta.get("model_only", False)), checkpoint_id=path)
        except Exception as e:  # noqa: BLE001 - DCP raises the same CheckpointException on every rank
            problem = _first_line(e)
        problem = _agree(problem)
        if problem:
            return problem
        if not all_finite(list(self.t.model.parameters()) + list(_optimizer_tensors(self.t.optimizer))):
            return "non-finite values in the loaded weights or optimizer state"
        if meta.get("model_only"):
            self.t.step = step
        self.t.spike.load(meta.get("loss_history"))
        self._apply_recipe(keep, meta.get("recipe") or {}, step)
        return None

    def _verify_files(self, path: str, files: dict | None) -> str | None:
        if not os.path.isfile(os.path.join(path, ".metadata")):
            return "no .metadata file"
        if not files:
            return None  # written without checksums (checkpoint.verify = false or an older torchmeg)
        for name in _my_share(list(files)):
            size, crc = files[name]
            f = os.path.join(path, name)
            if not os.path.isfile(f):
                return f"{name} is missing"
            if os.path.getsize(f) != size:
                return f"{name} has {os.path.getsize(f)} bytes, {size} were written"
            if _crc32(f) != crc:
                return f"{name} fails its CRC32 check (bytes changed since the save)"
        return None

    def _check_data_position(self, path: str, meta: dict) -> None:
        """Sets the trainer's sample offset; refuses another global batch / seq_len unless allowed."""
        d = meta.get("data")
        step = meta.get("step", 0)
        G, L = self.t.global_batch, self.cfg.data.seq_len
        if not d:
            return
        if (d["global_batch"], d["seq_len"]) == (G, L):
            self.t.sample_offset = d["next_sample"] - step * G
            return
        if not self.c.remap_data_position:
            raise ConfigError(f"checkpoint {path} was trained with global batch {d['global_batch']} x seq_len "
                              f"{d['seq_len']}; the recipe has {G} x {L}: resuming would skip or repeat samples. "
                              f"Restore those values, or set checkpoint.remap_data_position = true to continue "
                              f"from the same number of tokens")
        next_sample = math.ceil(d["next_sample"] * d["seq_len"] / L)
        self.t.sample_offset = next_sample - step * G
        self.notes.append(f"resume     data position remapped by tokens: {d['next_sample']:,} samples x {d['seq_len']} "
                  f"-> sample {next_sample:,} x {L} (global batch {d['global_batch']} -> {G})")

    def _apply_recipe(self, groups_before: list[dict], saved: dict, step: int) -> None:
        """Optimizer hyper-parameters and the LR schedule come from the recipe, not the checkpoint."""
        opt, sched = self.t.optimizer, self.t.scheduler
        for g, before in zip(opt.param_groups, groups_before):
            for k, v in before.items():
                if k not in ("lr", "initial_lr"):
                    g[k] = v
        sched.base_lrs = [b["lr"] if "initial_lr" not in b else b["initial_lr"] for b in groups_before]
        for g, base in zip(opt.param_groups, sched.base_lrs):
            g["initial_lr"] = base
        for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        changed = []
        for sec, keys in _RESUME_KEYS.items():
            for k in keys:
                new = getattr(getattr(self.cfg, sec), k)
                if sec in saved and k in saved[sec] and saved[sec][k] != new:
                    changed.append(f"{sec}.{k} {saved[sec][k]} -> {new}")
        if changed:
            self.notes.append(f"resume     recipe changed since the checkpoint: {', '.join(changed)}; the recipe's values "
                  f"apply from step {step + 1}")

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
        tmp = os.path.join(self.folder, f".tmp-step-{step:08d}")
        model_only = last and self.c.last_save_model_only
        states = self._states(model_only)
        if model_only and self.c.export_dtype != "float32":
            dtype = getattr(torch, self.c.export_dtype)
            states = {"model": {k: v.to(dtype) for k, v in get_model_state_dict(self.t.model).items()}}
        t0 = time.perf_counter()
        extra = {"loss_history": self.t.spike.state()}  # as of this step, whenever the commit happens
        if self.c.async_mode == "async" and not last:
            fut = dcp.async_save(states, checkpoint_id=tmp, process_group=self.async_group)
            self.pending = (fut, tmp, final, step, t0, model_only, extra)
            return
        dcp.save(states, checkpoint_id=tmp)
        self._commit(tmp, final, step, t0, model_only, extra)

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, step, t0, model_only, extra = self.pending
        self.pending = None
        fut.result()
        self._commit(tmp, final, step, t0, model_only, extra)

    def _commit(self, tmp, final, step, t0, model_only, extra: dict) -> None:
        _test_hook_kill_before_commit(step)
        dist.barrier()  # every rank's shards are on disk
        files = None
        if self.c.verify:  # each rank hashes its share of the files; rank 0 records them all
            mine = {n: [os.path.getsize(os.path.join(tmp, n)), _crc32(os.path.join(tmp, n))]
                    for n in _my_share(os.listdir(tmp))}
            files = {k: v for part in _gather(mine) for k, v in part.items()}
        if self.rank == 0:
            c = self.cfg
            meta = {"step": step, "time": time.time(), "layout": self.t.dims.describe(), "model_only": model_only,
                    "model": f"{c.model.name}/{c.model.flavor}",
                    "recipe": {sec: {k: getattr(getattr(c, sec), k) for k in keys} for sec, keys in _RESUME_KEYS.items()},
                    "data": {"global_batch": self.t.global_batch, "seq_len": c.data.seq_len,
                             "next_sample": self.t.sample_offset + step * self.t.global_batch},
                    "files": files, **extra}
            with open(os.path.join(tmp, MARKER), "w") as fh:
                json.dump(meta, fh)
                fh.flush()
                os.fsync(fh.fileno())
            # A folder already at this step (an incomplete one, or one this resume re-trains over)
            # must never block the new save: set it aside, commit, then delete it.
            old = _set_aside(final, ".replaced") if os.path.exists(final) else None
            os.replace(tmp, final)
            if old:
                shutil.rmtree(old, ignore_errors=True)
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


def _set_aside(path: str, suffix: str) -> str:
    """Rename `path` to path + suffix (+ a counter if taken); returns the new name."""
    new, n = path + suffix, 1
    while os.path.exists(new):
        new, n = f"{path}{suffix}.{n}", n + 1
    os.replace(path, new)
    return new


def _test_hook_kill_before_commit(step: int) -> None:
    """Tests: TORCHMEG_TEST_KILL_IN_SAVE=N dies after writing step N's shards, before the commit."""
    if os.environ.get("TORCHMEG_TEST_KILL_IN_SAVE") == str(step):
        os._exit(17)
