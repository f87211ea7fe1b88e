"""`python -m torchmeg.train --config recipes/X.toml [--section.key=value ...]` (or under torchrun).

Validates the recipe (torchmeg.train.validate -> Layout), then builds the run and trains it
(torchmeg.train.trainer). Bad recipes exit 2 with one line, before any process group exists.
"""
from __future__ import annotations

import os
import sys

from torchmeg.runtime import guard
from torchmeg.config.schema import Config, idle_overrides, load_config
from torchmeg.config.errors import ConfigError, LossSpikeError
from torchmeg.train.fault_tolerance import FaultTolerantTrainer
from torchmeg.train.trainer import Trainer
from torchmeg.train.validate import validate



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


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 failed (on any rank), 2 bad recipe, 3 hang (watchdog)."""
    argv = sys.argv[1:] if argv is None else argv

    def prepare():
        cfg = parse_args(argv)
        if os.environ.get("RANK", "0") == "0":  # (a note, not an error: the run goes on)
            for line in idle_overrides(cfg, argv):  # (--config and its path are not overrides: passed over)
                print(f"torchmeg: note: {line}", flush=True)
        return cfg, validate(cfg)

    def run(prepared):
        cls = FaultTolerantTrainer if prepared[0].fault_tolerance.enable else Trainer  # one replica group of several
        trainer = cls(*prepared)
        trainer.run()
        trainer.close()
    # on_nonfinite / on_loss_spike = "stop", max_consecutive_skips: every rank stops alike
    return guard.cli_main("torchmeg", prepare, run, stops=(FloatingPointError, LossSpikeError))
