"""Data: tokenizers (tokenizer.py), indexed .bin/.idx stores (store.py), where tokens come from
(sources.py), packed / shuffled / blended samples (dataset.py), the stateful loader (loader.py).

Public names resolve on first use (PEP 562), so importing one submodule loads only what it needs.
"""
from __future__ import annotations


def __getattr__(name: str):
    # Each import below is lazy by design (see the docstring).
    if name == "build_tokenizer":
        from torchmeg.data.tokenizer import build_tokenizer
        return build_tokenizer
    if name in ("open_stores", "build_dataset", "build_loader"):
        from torchmeg.data import loader
        return getattr(loader, name)
    raise AttributeError(f"module 'torchmeg.data' has no attribute {name!r}")
