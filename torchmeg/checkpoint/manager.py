"""Checkpoints that never lose work: torch.distributed.checkpoint (DCP), committed atomically.

A save writes into `.tmp-step-N/`, every rank finishes (barrier), then rank 0 writes torchmeg.json
and renames the folder to `step-N/`: a reader sees a whole checkpoint or none (folder layout:
torchmeg.checkpoint.folder). Older ones are pruned only after a newer one is committed.
An async save is committed at the first step at which every rank's background write has finished
(`poll`, once a step), not at the next save. A save whose process died between its last write and
its commit is not lost: the next start finds its files complete against DCP's own metadata and
commits it (`recover`); only a save cut off mid-write is discarded.

Checkpoints that refuse to lie: torchmeg.json also records every file's size and CRC32 (the ranks
hash their share in parallel), the recipe's optimizer / schedule keys and the data position. At
load the files are checked against it, DCP's errors are caught, and the loaded weights and
optimizer state must be finite; a checkpoint failing any of that is named in one line, renamed
`step-N.damaged` (kept for inspection, never loaded again) and the previous complete one is used
(`checkpoint.on_damaged = "fallback"`), or the run stops (`"stop"`). What a resume takes from the
recipe rather than the checkpoint is torchmeg.checkpoint.resume's.

What is saved: model and optimizer state through `get_state_dict` (FQN-keyed, unsharded names, so
any layout can load any other: DCP reshards on load) and the TrainState (step, RNG; its data
position and loss history go into torchmeg.json). The manager sees the model, the optimizer and the
TrainState, nothing else of the run.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchmeg.checkpoint import resume
from torchmeg.checkpoint.folder import (MARKER, PENDING, commit_folder, committed_steps, file_records,
                                        incomplete_write, resolve_folder, set_aside, step_dir, tmp_dir, verify_files,
                                        write_json)
from torchmeg.checkpoint.states import ModelState, OptimizerState, optimizer_tensors
from torchmeg.config.errors import CheckpointError, ConfigError
from torchmeg.runtime.process import collectives_in_one_thread

__all__ = ["MARKER", "CheckpointManager", "all_finite", "committed_steps", "resolve_folder", "step_dir"]


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
    """Whether every floating tensor on every rank is finite (all-reduced: all ranks agree)."""
    ok = torch.ones((), dtype=torch.float32)
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not torch.isfinite(t).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


class CheckpointManager:
    """Saves and loads (model, optimizer, the run's TrainState: a Stateful, torchmeg.train.state) under
    the recipe's checkpoint keys.
    `layout` describes the layout that saves and `tokenizer` names the tokenizer the model was
    trained with (its fingerprint); both are recorded in torchmeg.json."""

    def __init__(self, cfg, model, optimizer, state, layout: str, tokenizer: str = "", extra: dict | None = None):
        self.cfg, self.c = cfg, cfg.checkpoint
        self.extra = extra or {}  # more Statefuls saved and loaded with the rest (DiLoCo's outer momentum)
        self.model, self.optimizer, self.state, self.layout = model, optimizer, state, layout
        self.tokenizer = tokenizer
        self.folder = resolve_folder(cfg)
        self.rank = dist.get_rank()
        self.loaded_from = self.loaded_initial = None
        self.notes: list[str] = []  # what the resume changed, printed (rank 0) under the run header
        self.pending = None  # (future, tmp, final, step, t0) of an async save not yet committed
        # Async saves run collectives in a background thread: give them their own gloo group so
        # they never interleave with training's collectives on the default group.
        self.async_group = dist.new_group(backend="gloo") if self.c.async_mode == "async" else None
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            self._recover()
        dist.barrier()

    def _recover(self) -> None:
        """Rank 0 at start: a save whose every file was written (DCP's metadata is written last,
        after all ranks' data; each file it names present at its full size) but whose process died
        before the commit is committed now; a save cut off mid-write is removed, never loaded."""
        for name in sorted(os.listdir(self.folder)):
            if not name.startswith(".tmp-step-"):
                continue
            tmp = os.path.join(self.folder, name)
            problem = incomplete_write(tmp)
            step = int(name.rsplit("-", 1)[1])
            if problem is None and not os.path.exists(step_dir(self.folder, step)):
                with open(os.path.join(tmp, PENDING)) as fh:
                    meta = json.load(fh)
                files = file_records(tmp, [n for n in os.listdir(tmp) if n not in (PENDING, MARKER)]) \
                    if self.c.verify else None
                self._publish(tmp, step_dir(self.folder, step), meta, files)
                print(f"[checkpoint] step {step}: its save was written in full before the last run ended, but "
                      f"not committed; committed now", flush=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                print(f"[checkpoint] removed {name}: an interrupted save ({problem or 'step already committed'})",
                      flush=True)
        for name in sorted(os.listdir(self.folder)):  # what a commit killed midway leaves besides
            path = os.path.join(self.folder, name)
            base = name.split(".replaced")[0]
            if ".replaced" in name:  # set aside for a commit: gone if that commit happened, else put back
                final = os.path.join(self.folder, base)
                if os.path.exists(final):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.replace(path, final)
            elif os.path.isfile(os.path.join(path, MARKER)) and os.path.isfile(os.path.join(path, PENDING)):
                os.remove(os.path.join(path, PENDING))  # committed; only its marker-to-be was left

    def _states(self, model_only: bool = False, loading: bool = False) -> dict:
        if model_only:
            return {"model": ModelState(self.model)}
        return {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer, loading),
                "train": self.state, **self.extra}

    # ---- load --------------------------------------------------------------------------------
    def load_latest(self) -> int | None:
        """Load checkpoint.load_step (or the newest intact committed one); returns its step or None."""
        steps, want = committed_steps(self.folder), self.c.load_step
        _check_load_step(self.folder, steps, want)
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
                moved = set_aside(path, ".damaged")
                print(f"[checkpoint] {path} is damaged ({problem}); renamed to {os.path.basename(moved)}, "
                      f"trying the previous complete checkpoint", flush=True)
            dist.barrier()
        if candidates:
            raise CheckpointError(f"checkpoint.folder {self.folder}: no intact checkpoint left (damaged ones are "
                                  f"renamed *.damaged); move them away to start from scratch")
        if self.c.initial_load_path:  # another run's model weights, nothing else: step 0, a fresh optimizer and data
            self.loaded_from = self.loaded_initial = load_model_from(self.model, self.c.initial_load_path,
                                                                     "checkpoint.initial_load_path")
        return None

    def _try_load(self, path: str, step: int) -> str | None:
        """Load `path`; None if it is whole and finite, else the problem (one line, the same on
        every rank). A recipe that does not fit the checkpoint raises ConfigError instead: that
        is the user's call, not damage."""
        problem, meta = _read_marker(path)
        if problem:
            return problem
        offset, note = resume.data_position(path, meta, self.state.global_batch, self.state.seq_len,
                                            self.c.remap_data_position)
        if not meta.get("model_only"):
            resume.check_optimizer(self.cfg, meta.get("recipe") or {}, path)
        resume.check_adapters(self.cfg, self.model, path)
        recipe = resume.recipe_groups(self.optimizer)
        failed = _load_checked(path, self._states(model_only=meta.get("model_only", False), loading=True),
                               lambda: list(self.model.parameters()) + list(optimizer_tensors(self.optimizer)))
        if failed:
            return failed[1] if failed[0] == "load" else "non-finite values in the loaded weights or optimizer state"
        if meta.get("model_only"):
            self.state.step = step
        self.state.sample_offset = offset
        self.state.spike.load(meta.get("loss_history"))
        resume.restore_groups(self.optimizer, recipe)
        self.notes += [n for n in (note, resume.changed_keys(self.cfg, meta.get("recipe") or {}, step)) if n]
        return None

    # ---- save --------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        return step % self.c.interval == 0 or last

    def save(self, step: int, last: bool = False) -> None:
        self.wait()  # one save in flight at most; commit the previous one first
        if not all_finite(self.model.parameters()):
            if self.rank == 0:
                print(f"[checkpoint] step {step}: model holds non-finite values; not saved", flush=True)
            return
        final, tmp = step_dir(self.folder, step), tmp_dir(self.folder, step)
        model_only = last and self.c.last_save_model_only
        states = self._states(model_only)
        if model_only and self.c.export_dtype != "float32":
            dtype = getattr(torch, self.c.export_dtype)
            states = {"model": {k: v.to(dtype) for k, v in get_model_state_dict(self.model).items()}}
        t0 = time.perf_counter()
        if self.rank == 0:  # the marker-to-be first: what a restart needs to commit this save if we die
            os.makedirs(tmp, exist_ok=True)
            write_json(os.path.join(tmp, PENDING), self._meta(step, model_only))
        if self.c.async_mode == "async" and not last:
            with collectives_in_one_thread():
                fut = dcp.async_save(states, checkpoint_id=tmp, process_group=self.async_group)
            self.pending = (fut, tmp, final, step, t0)
            return
        with collectives_in_one_thread():
            dcp.save(states, checkpoint_id=tmp)
        self._commit(tmp, final, step, t0)

    def _meta(self, step: int, model_only: bool) -> dict:
        """torchmeg.json less the files' checksums, as of this step (whenever the commit happens)."""
        c, marker = self.cfg, self.state.marker(step)
        return {"step": step, "time": time.time(), "layout": self.layout, "model_only": model_only,
                "model": f"{c.model.name}/{c.model.flavor}", "tokenizer": self.tokenizer,
                "recipe": resume.recipe_record(c), "data": marker["data"], "loss_history": marker["loss_history"]}

    def poll(self) -> bool:
        """Once a step: commit the async save in flight if every rank's background write has
        finished (one scalar all-reduce while a save is in flight, nothing otherwise).
        -> whether a commit happened."""
        if self.pending is None:
            return False
        done = torch.tensor([1.0 if self.pending[0].done() else 0.0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() < 1.0:
            return False
        self.wait()
        return True

    def wait_for_write(self) -> None:
        """Block until the async save in flight has written its files, without committing it (tests)."""
        if self.pending is not None:
            self.pending[0].result()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, step, t0 = self.pending
        self.pending = None
        fut.result()
        self._commit(tmp, final, step, t0)

    def _commit(self, tmp, final, step, t0) -> None:
        _test_hook_kill_before_commit(step)
        dist.barrier()  # every rank's shards are on disk
        files = None
        if self.c.verify:  # each rank hashes its share of the files; rank 0 records them all
            mine = file_records(tmp, _my_share([n for n in os.listdir(tmp) if n != PENDING]))
            files = {k: v for part in _gather(mine) for k, v in part.items()}
        if self.rank == 0:
            with open(os.path.join(tmp, PENDING)) as fh:
                meta = json.load(fh)
            self._publish(tmp, final, meta, files)
            print(f"[checkpoint] step {step} committed to {final} in {time.perf_counter() - t0:.2f} s", flush=True)
        dist.barrier()

    def _publish(self, tmp: str, final: str, meta: dict, files: dict | None) -> None:
        """Rank 0: the folder committed (torchmeg.checkpoint.folder.commit_folder), old ones pruned."""
        commit_folder(tmp, final, meta, files)
        self._prune()

    def _prune(self) -> None:
        k = self.c.keep_latest_k
        if k <= 0:
            return
        for s in committed_steps(self.folder)[:-k]:
            shutil.rmtree(step_dir(self.folder, s), ignore_errors=True)

    def close(self) -> None:
        self.wait()


def _read_marker(path: str) -> tuple[str | None, dict]:
    """A committed checkpoint's marker and its files checked (this rank's share) -> (the problem, the
    same on every rank, or None; the marker's metadata)."""
    problem, meta = None, {}
    try:
        with open(os.path.join(path, MARKER)) as fh:
            meta = json.load(fh)
        problem = verify_files(path, meta.get("files"), _my_share(list(meta.get("files") or [])))
    except (OSError, ValueError) as e:
        problem = f"{MARKER}: {_first_line(e)}"
    return _agree(problem), meta


def load_model_from(model, where: str, key: str) -> str:
    """The model weights of the checkpoint `where` names (a committed step folder, or a checkpoint
    folder: its newest committed step), whatever layout saved them, into `model`; verified, and one
    line naming `key` when they cannot be used. -> the step folder loaded."""
    path = where
    if not os.path.isfile(os.path.join(path, MARKER)):
        steps = committed_steps(path) if os.path.isdir(path) else []
        if not steps:
            raise CheckpointError(f"{key} = {where!r}: neither a committed step folder nor a checkpoint folder "
                                  f"holding one")
        path = step_dir(path, steps[-1])
    problem, _ = _read_marker(path)
    if problem:
        raise CheckpointError(f"{key} = {where!r}: {path} is damaged ({problem})")
    failed = _load_checked(path, {"model": ModelState(model, base_only=True)}, lambda: list(model.parameters()))
    if failed:
        why = failed[1] if failed[0] == "load" else "non-finite values in the weights"
        raise CheckpointError(f"{key} = {where!r}: {path} cannot be loaded ({why})")
    return path


@contextlib.contextmanager
def weights_from(model, where: str, key: str):
    """The weights of the checkpoint `where` names in `model` for the block (load_model_from), the
    model's own values back after (in place, each rank its shards). -> yields the step folder."""
    own = [t.detach().clone() for t in model.state_dict().values()]
    path = load_model_from(model, where, key)
    try:
        yield path
    finally:
        with torch.no_grad():
            for t, s in zip(model.state_dict().values(), own):
                t.copy_(s)


def load_model_weights(cfg, model, tokenizer: str = "", state=None) -> tuple[int, str] | None:
    """The weights of checkpoint.load_step (or the newest committed checkpoint) into `model`, whatever
    layout saved them (DCP reshards): for using a trained model (generation, evaluation). Verified as
    a resume is; a damaged checkpoint or one that does not fit the recipe is one line naming it.
    `tokenizer`: this run's tokenizer fingerprint, checked against the one the checkpoint recorded.
    `state`: the model's Stateful when it is not ModelState(model) (inference.kv_replicas).
    -> (step, path), or None when the folder holds no checkpoint."""
    folder = resolve_folder(cfg)
    steps, want = committed_steps(folder), cfg.checkpoint.load_step
    _check_load_step(folder, steps, want)
    if not steps:
        return None
    step = want if want != -1 else steps[-1]
    path = step_dir(folder, step)
    problem, meta = _read_marker(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged ({problem}); pick another with checkpoint.load_step")
    saved = meta.get("tokenizer")
    if saved and tokenizer and saved != tokenizer:
        raise ConfigError(f"checkpoint {path} was trained with tokenizer {saved}, the recipe's data.tokenizer = "
                          f"{cfg.data.tokenizer!r} is {tokenizer}; use the tokenizer the model was trained with")
    resume.check_adapters(cfg, model, path)
    failed = _load_checked(path, {"model": state or ModelState(model)}, model.parameters)
    if failed and failed[0] == "load":
        raise CheckpointError(f"checkpoint {path}: its weights do not fit the recipe's model {cfg.model.name}/"
                              f"{cfg.model.flavor} ({failed[1]}); use the recipe (model, data.tokenizer) it was "
                              f"trained with")
    if failed:
        raise CheckpointError(f"checkpoint {path}: non-finite values in the weights")
    return step, path


def _check_load_step(folder: str, steps: list[int], want: int) -> None:
    if want != -1 and want not in steps:
        raise ConfigError(f"checkpoint.load_step = {want}: no committed checkpoint for that step in {folder} "
                          f"(have: {steps or 'none'}); use -1 for the latest")


def _load_checked(path: str, states: dict, tensors) -> tuple[str, str] | None:
    """DCP-load `states` from `path`, then check `tensors()` (what was loaded) are finite on every
    rank. -> None, or ("load", DCP's first line) / ("nonfinite", ""): the same verdict on every rank."""
    problem = None
    try:
        with collectives_in_one_thread():
            dcp.load(states, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001 - DCP raises the same CheckpointException on every rank
        problem = _first_line(e)
    problem = _agree(problem)
    if problem:
        return "load", problem
    return None if all_finite(tensors()) else ("nonfinite", "")


def _test_hook_kill_before_commit(step: int) -> None:
    """Tests: TORCHMEG_TEST_KILL_IN_SAVE=N dies after writing step N's shards, before the commit."""
    if os.environ.get("TORCHMEG_TEST_KILL_IN_SAVE") == str(step):
        os._exit(17)
