"""`python -m torchmeg.train --config recipes/X.toml [--section.key=value ...]` (or under torchrun).

Validates the recipe (torchmeg.validate -> Layout), then builds the run and trains it
(torchmeg.trainer). Bad recipes exit 2 with one line, before any process group exists.
"""
from __future__ import annotations

import os
import sys
import time

from torchmeg import guard
from torchmeg.config import Config, load_config
from torchmeg.errors import ConfigError, LossSpikeError
from torchmeg.trainer import Trainer
from torchmeg.validate import validate



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
    try:
        cfg = parse_args(argv)
        layout = validate(cfg)
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
        trainer = Trainer(cfg, layout)
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
