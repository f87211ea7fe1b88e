#!/usr/bin/env python
"""Kept as an alias: `python tools/convert_hf.py ARGS` is `python -m torchmeg.convert ARGS` (see its --help)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmeg.convert import main  # noqa: E402  (after the path line: the tool runs from a checkout)
from torchmeg.runtime.guard import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(main())
