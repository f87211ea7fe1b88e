"""Optional packages, imported where they are used: the core install (`pip install torchmeg`) trains,
generates, evaluates, plans and converts without any of them. A job that needs one that is missing
stops before it starts with one line naming the extra that brings it (exit 2, as a bad recipe does).

The extras (pyproject.toml): serve (fastapi, uvicorn, prometheus_client: the HTTP server), data
(pyarrow: Parquet input), hf (transformers: `hf` models), tools (matplotlib: plots), ft (torchft:
[fault_tolerance]'s replica groups); test holds them
all with the outside references the suite compares against (trl, peft, openai, megatron-core).
"""
from __future__ import annotations

import importlib

from torchmeg.config.errors import ConfigError


class MissingExtra(ConfigError):
    """An optional package a job needs is not installed; the message names the extra to install."""


def need(module: str, extra: str, what: str):
    """`import module`, or one line: what needs it and the pip command that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if getattr(e, "name", None) not in (None, top) and not (e.name or "").startswith(top + "."):
            raise  # the package is there but something it imports is broken: its own traceback says what
        raise MissingExtra(f"{what} needs {top}, which is not installed: pip install 'torchmeg[{extra}]' "
                           f"(from a checkout: pip install -e '.[{extra}]')") from None
