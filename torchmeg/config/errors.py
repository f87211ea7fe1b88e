"""The errors torchmeg raises for the user to read: each message is one line that names the key,
file or value at fault and what to do instead. The bottom of the import graph: imports nothing."""
from __future__ import annotations


class ConfigError(ValueError):
    """A recipe, override or input it names is invalid. The CLIs print the message and exit 2,
    before any process group exists where they can."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message names it (exit 2, like a bad recipe)."""


class StoreError(ValueError):
    """A token store on disk is damaged or is not a store; the message names the file."""


class LossSpikeError(RuntimeError):
    """training.on_loss_spike = "stop" met a spike."""


class InputError(ValueError):
    """Bad input that one rank meets on its own during a run (a user's reward function on that rank's
    completions): that rank prints the line and the job exits 2; its peers stop as after any failure."""
