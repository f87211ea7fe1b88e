"""What a run is, before anything runs: the recipe schema and its TOML/CLI loading (schema.py), the
checks the recipe alone decides (checks.py), what this build supports (support.py), the frozen
Layout every consumer takes (layout.py; derived once by torchmeg.train.validate), and the errors
(errors.py). Imports nothing else of torchmeg: every other package may import it.

`from torchmeg.config import load_config, Config, ConfigError` keeps working: names resolve on first
use in schema.py (PEP 562).
"""
from __future__ import annotations


def __getattr__(name: str):
    # lazy by design (see the docstring): the schema's public names
    from torchmeg.config import schema
    try:
        return getattr(schema, name)
    except AttributeError:
        raise AttributeError(f"module 'torchmeg.config' has no attribute {name!r}") from None
