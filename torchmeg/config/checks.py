"""What the recipe alone decides: every key's range and choices, and keys that go together.

Run by torchmeg.train.validate before the checks that need the model, the world size or the disk.
"""
from __future__ import annotations

import math
import os

from torchmeg.config.schema import Config, section_fields, sections
from torchmeg.config.errors import ConfigError


def _check_field_ranges(cfg: Config) -> None:
    for sec in sections():
        section = getattr(cfg, sec)
        for name, f in section_fields(sec).items():
            v, m = getattr(section, name), f.metadata
            key = f"{sec}.{name}"
            if m.get("choices") and v not in m["choices"]:
                shown = (str(c).lower() if isinstance(c, bool) else str(c) for c in m["choices"])  # (as TOML writes them)
                raise ConfigError(f"{key} = {v!r}: unknown choice; allowed: {', '.join(shown)}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key} = {v!r}: must be a finite number")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if m.get("lo") is not None and v < m["lo"]:
                    raise ConfigError(f"{key} = {v!r}: must be >= {m['lo']}")
                if m.get("hi") is not None and v > m["hi"]:
                    raise ConfigError(f"{key} = {v!r}: must be <= {m['hi']}")


def _check_job_name(cfg: Config) -> None:
    """Outputs go to <dump_folder>/<name>/: the name may nest folders but never leave dump_folder."""
    name = cfg.job.name
    parts = name.replace("\\", "/").split("/")
    if not name.strip() or os.path.isabs(name) or ".." in parts or any(not x for x in parts) or "\0" in name:
        raise ConfigError(f"job.name = {name!r}: must be a relative name inside job.dump_folder (no '..', no "
                          f"leading '/', no empty parts); e.g. \"my_run\" or \"sweep/lr_3e-3\"")


def _check_special(cfg: Config) -> None:
    p, t = cfg.parallelism, cfg.training
    _check_job_name(cfg)
    if cfg.profiling.enable and cfg.profiling.profile_freq < cfg.profiling.active_steps + 2:
        raise ConfigError(f"profiling.profile_freq = {cfg.profiling.profile_freq}: must be at least active_steps + 2 "
                          f"= {cfg.profiling.active_steps + 2} (one warm-up step, then the recorded ones)")
    if p.data_parallel_shard_degree == 0:
        raise ConfigError("parallelism.data_parallel_shard_degree = 0: use -1 (fill) or a degree >= 1")
    if len(cfg.optimizer.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.optimizer.betas):
        raise ConfigError(f"optimizer.betas = {cfg.optimizer.betas!r}: must be two numbers in [0, 1)")
    if t.global_batch_size == 0:
        raise ConfigError("training.global_batch_size = 0: use -1 (= local_batch_size x dp) or a positive multiple")
    sel = cfg.activation_checkpoint.selective_option
    if (isinstance(sel, str) and sel not in ("op", "op_half")) or (isinstance(sel, int) and sel < 1):
        raise ConfigError(f"activation_checkpoint.selective_option = {sel!r}: must be \"op\", \"op_half\" or an "
                          f"integer N >= 1")
    em = cfg.float8.emulate
    if isinstance(em, str) and em != "auto":
        raise ConfigError(f"float8.emulate = {em!r}: must be \"auto\", true or false")
    if cfg.lora.enable and cfg.float8.enable:
        raise ConfigError("lora.enable with float8.enable: not supported (float8 would convert the adapters' rank-r "
                          "Linears too); train LoRA in bf16 (training.mixed_precision = \"bf16\")")
    comps = cfg.compile.components
    bad = [c for c in comps if c not in ("model", "loss")]
    if bad:
        raise ConfigError(f"compile.components = {comps!r}: unknown component {bad[0]!r}; allowed: model, loss")


def _check_timeouts(cfg: Config) -> None:
    """A collective must not time out before the watchdog of the same phase reports the hang: the
    watchdog names the phase and dumps every thread's stack; a timed-out collective only says which
    collective, on the ranks that were waiting, not on the one that hung."""
    t, c = cfg.training, cfg.comm
    if t.watchdog_factor <= 0:
        return
    if c.init_timeout_seconds <= t.watchdog_startup_s:
        raise ConfigError(f"comm.init_timeout_seconds = {c.init_timeout_seconds:g}: must exceed "
                          f"training.watchdog_startup_s = {t.watchdog_startup_s:g} (a waiting rank would time out "
                          f"before the watchdog reports the hang); raise it or lower watchdog_startup_s")
    if c.train_timeout_seconds <= t.watchdog_min_s:
        raise ConfigError(f"comm.train_timeout_seconds = {c.train_timeout_seconds:g}: must exceed "
                          f"training.watchdog_min_s = {t.watchdog_min_s:g} (a waiting rank would time out before "
                          f"the watchdog reports the hang); raise it or lower watchdog_min_s")


WEIGHT_DECAY_GROUPS = ("embeddings", "head", "norms", "biases")


def _check_optimizer(cfg: Config) -> None:
    """Weight-decay groups and the warmup-stable-decay schedule's keys."""
    ex, s, t = cfg.optimizer.weight_decay_exempt, cfg.lr_scheduler, cfg.training.steps
    bad = [e for e in ex if e not in WEIGHT_DECAY_GROUPS] if isinstance(ex, list) else [ex]
    if bad:
        raise ConfigError(f"optimizer.weight_decay_exempt = {ex!r}: unknown group {bad[0]!r}; a list of any of "
                          f"{', '.join(WEIGHT_DECAY_GROUPS)}")
    if s.decay_steps != -1 and s.decay_ratio != -1:
        raise ConfigError("lr_scheduler.decay_steps and lr_scheduler.decay_ratio are both set: set one (-1 = off)")
    if s.decay_ratio != -1 and s.decay_ratio <= 0:
        raise ConfigError(f"lr_scheduler.decay_ratio = {s.decay_ratio}: must be in (0, 1], or -1 (off)")
    wsd = decay_steps(cfg)
    if wsd is not None and s.decay_type == "constant":
        raise ConfigError("lr_scheduler.decay_type = \"constant\" with a decay length: choose the decay's shape "
                          "(linear, sqrt or cosine)")
    if wsd is not None and not 1 <= wsd <= t - s.warmup_steps:
        raise ConfigError(f"lr_scheduler: a decay of {wsd} steps does not fit the {t - s.warmup_steps} steps "
                          f"after warmup (training.steps {t} - warmup_steps {s.warmup_steps}); shorten the decay "
                          f"or the warmup, or train longer")


def decay_steps(cfg: Config) -> int | None:
    """The warmup-stable-decay schedule's decay length in steps, or None (decay over all steps after warmup)."""
    s = cfg.lr_scheduler
    if s.decay_steps != -1:
        return s.decay_steps
    if s.decay_ratio != -1:
        return max(1, round(s.decay_ratio * cfg.training.steps))
    return None


def _check_fault_tolerance(cfg: Config) -> None:
    """[fault_tolerance]: the group's number, the quorum's size, and the timeouts in order: a cross-group
    collective gives up (and the step is discarded) before the hang watchdog would end the group."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.replica_id >= ft.group_size:
        raise ConfigError(f"fault_tolerance.replica_id = {ft.replica_id}: must be below fault_tolerance.group_size = "
                          f"{ft.group_size} (groups are numbered 0 .. group_size - 1)")
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size = {ft.min_replica_size}: more than the "
                          f"{ft.group_size} groups (fault_tolerance.group_size); no step could ever commit")
    if cfg.training.objective not in ("pretrain", "sft"):
        raise ConfigError(f"fault_tolerance.enable with training.objective = {cfg.training.objective!r}: only "
                          f"pretrain and sft read their data by position; train {cfg.training.objective} without "
                          f"fault tolerance")
    if cfg.parallelism.data_parallel_replicate_degree != 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = "
                          f"{cfg.parallelism.data_parallel_replicate_degree} with fault_tolerance.enable: replication "
                          f"across groups is torchft's; set it to 1 (each group shards with data_parallel_shard_degree)")
    if os.path.isabs(cfg.checkpoint.folder):
        raise ConfigError(f"checkpoint.folder = {cfg.checkpoint.folder!r} with fault_tolerance.enable: each group "
                          f"writes under its own <run>/replica_<id>/; give a relative folder")
    t = cfg.training
    if t.watchdog_factor > 0 and ft.process_group_timeout_ms / 1000 >= t.watchdog_min_s:
        raise ConfigError(f"fault_tolerance.process_group_timeout_ms = {ft.process_group_timeout_ms}: must be under "
                          f"training.watchdog_min_s = {t.watchdog_min_s:g} s (a dead peer must cost a discarded "
                          f"step, not a watchdog exit); lower it or raise watchdog_min_s")
    if t.watchdog_factor > 0 and 2 * ft.quorum_timeout_s >= t.watchdog_startup_s:
        raise ConfigError(f"fault_tolerance.quorum_timeout_s = {ft.quorum_timeout_s:g}: twice it must be under "
                          f"training.watchdog_startup_s = {t.watchdog_startup_s:g} (the watchdog's limit while a step "
                          f"waits for its quorum: a group's first step waits up to it for every group, then for the "
                          f"quorum itself); lower it or raise watchdog_startup_s")


def check_recipe(cfg: Config) -> None:
    """Everything the recipe alone decides: types and ranges of every key, choices, keys that go together."""
    _check_field_ranges(cfg)
    _check_special(cfg)
    _check_optimizer(cfg)
    _check_timeouts(cfg)
    _check_fault_tolerance(cfg)
