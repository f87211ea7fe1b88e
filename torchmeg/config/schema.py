"""Recipe schema: the Config of every section (torchmeg.config.sections), TOML loading, CLI overrides.

The section and key names are the public contract (see RECIPES.md). Every bad input raises
`ConfigError` with ONE line naming the key, the value and what is allowed; the CLI turns that
into exit code 2 before any process group exists.

Types are checked as a recipe loads; what else the recipe alone decides (ranges, choices, keys that go
together) is torchmeg.config.checks', and the checks against the model, the world size, the data and
the disk are their owners'; `torchmeg.train.validate` runs them all. It imports only torchmeg's errors.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torchmeg.config.errors import ConfigError
from torchmeg.config.sections import (  # the sections' dataclasses (keys, types, defaults, help)
    Job, Model, Data, Training, Optimizer, LRScheduler, Parallelism, ActivationCheckpoint,
    Compile, Float8, Checkpoint, Validation, Metrics, Profiling, Comm, Plan, Dpo, Grpo, Lora, FaultTolerance)

__all__ = ["Config", "ConfigError", "coerce", "idle_overrides", "load_config", "split_overrides"]


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    plan: Plan = field(default_factory=Plan)
    comm: Comm = field(default_factory=Comm)
    dpo: Dpo = field(default_factory=Dpo)
    grpo: Grpo = field(default_factory=Grpo)
    lora: Lora = field(default_factory=Lora)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    # Where the recipe came from (for relative paths and messages); not a recipe key.
    source: str = field(default="<defaults>", repr=False)

    @property
    def run_dir(self) -> str:
        """Where the run writes (metrics, checkpoints, exports); one folder per replica group under
        fault tolerance, so groups never write into each other's."""
        base = os.path.join(self.job.dump_folder, self.job.name)
        ft = self.fault_tolerance
        return os.path.join(base, f"replica_{ft.replica_id}") if ft.enable else base


def sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config) if f.name != "source"]


def section_fields(sec: str) -> dict[str, dataclasses.Field]:
    cls = type(getattr(Config(), sec))
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "overrides"}


def _suggest(name: str, options) -> str:
    m = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{m[0]}'?" if m else f"; allowed: {', '.join(sorted(options))}"


# ---- typing ---------------------------------------------------------------------------------

_HINTS: dict = {}


def _hint(sec: str, key: str):
    cls = type(getattr(Config(), sec))
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls][key]


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            list: "a list", dict: "a table"}.get(tp, str(tp))


def coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against type `tp`; return it (ints widened to float where a float is expected)."""
    options = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    for t in options:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t in (str, list) and isinstance(value, t):
            return value
    raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")


def parse_cli_value(key: str, text: str, tp) -> Any:
    """Turn an override's text into a value of type `tp` (TOML syntax where it parses)."""
    options = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    if bool in options and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare string such as a path or a name
    fits = any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in options) \
        or (float in options and isinstance(value, int) and not isinstance(value, bool))
    if str in options and not fits:
        value = text  # e.g. --job.name=123 stays the string "123"
    return coerce(key, value, tp)


# ---- loading --------------------------------------------------------------------------------

def _apply(cfg: Config, sec: str, key: str, value: Any, origin: str) -> None:
    if sec not in sections():
        raise ConfigError(f"unknown section [{sec}] ({origin}){_suggest(sec, sections())}")
    section = getattr(cfg, sec)
    fields = section_fields(sec)
    if key in fields:
        setattr(section, key, coerce(f"{sec}.{key}", value, _hint(sec, key)))
    elif sec == "model":
        section.overrides[key] = value  # checked against the model's args in validate()
    else:
        raise ConfigError(f"unknown key '{sec}.{key}' ({origin}){_suggest(key, fields)}")


def split_overrides(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """`--section.key=value` / `--section.key value` pairs, and the remaining arguments."""
    pairs, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            if "=" in a:
                k, v = a[2:].split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"override {a} has no value; write {a}=VALUE")
                k, v = a[2:], argv[i + 1]
                i += 1
            pairs.append((k, v))
        else:
            rest.append(a)
        i += 1
    return pairs, rest


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- CLI overrides. Raises ConfigError with a one-line message."""
    cfg = Config()
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path!r}: no such file; pass a path to a .toml recipe (see recipes/)")
        cfg.source = path
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for sec, table in doc.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{sec}' must be a [section]{_suggest(sec, sections())}")
            for key, value in table.items():
                _apply(cfg, sec, key, value, path)
    pairs, rest = split_overrides(list(overrides or []))
    if rest:
        raise ConfigError(f"unrecognised argument {rest[0]!r}; overrides look like --section.key=value")
    for dotted, text in pairs:
        sec, _, key = dotted.partition(".")
        if sec not in sections():
            raise ConfigError(f"unknown section in --{dotted}{_suggest(sec, sections())}")
        if key in section_fields(sec):
            value = parse_cli_value(f"{sec}.{key}", text, _hint(sec, key))
        elif sec == "model":  # typed later against the model's own args dataclass
            if text.lower() in ("true", "false"):
                value = text.lower() == "true"
            else:
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError:
                    value = text
        else:
            raise ConfigError(f"unknown key '{dotted}' (command line){_suggest(key, section_fields(sec))}")
        _apply(cfg, sec, key, value, "command line")
    return cfg


# Sections whose other keys do nothing while `enable` is false (checkpoint's are not among them:
# initial_load_path and initial_load_hf act without it).
SWITCHED = ("validation", "profiling", "float8", "lora", "compile", "fault_tolerance")


def idle_overrides(cfg: Config, overrides: list[str]) -> list[str]:
    """One line per switched-off section whose other keys the command line sets, naming them and the
    switch (`--validation.freq=4` alone leaves validation off: the run silently never evaluates). A
    recipe's own keys are not counted: a TOML section often keeps its settings with the switch off."""
    pairs, _ = split_overrides(list(overrides))
    given: dict[str, list[str]] = {}
    for dotted, _ in pairs:
        sec, _, key = dotted.partition(".")
        if sec in SWITCHED and key != "enable" and not getattr(cfg, sec).enable:
            given.setdefault(sec, []).append(f"--{dotted}")
    return [f"{', '.join(keys)} {'does' if len(keys) == 1 else 'do'} nothing: {sec}.enable = false "
            f"(add --{sec}.enable=true)" for sec, keys in given.items()]
