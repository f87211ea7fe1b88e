"""What a run is, before anything runs: the recipe schema and its TOML/CLI loading (schema.py), the
checks the recipe alone decides (checks.py), what this build supports (support.py), the frozen
Layout every consumer takes (layout.py; derived once by torchmeg.train.validate), and the errors
(errors.py). Imports nothing else of torchmeg: every other package may import it.

`from torchmeg.config import load_config, Config, ConfigError` keeps working: names resolve on first
use in schema.py (PEP 562).
"""
from __future__ import annotations

from torchmeg import _facade

# Each public name and the module it lives in, imported on first use (PEP 562; see torchmeg._facade).
_PUBLIC = {**dict.fromkeys(('Config', 'load_config', 'coerce', 'split_overrides'), 'torchmeg.config.schema'),
           'ConfigError': 'torchmeg.config.errors', 'Layout': 'torchmeg.config.layout'}
__all__ = sorted(_PUBLIC)

__getattr__ = _facade(__name__, _PUBLIC)
