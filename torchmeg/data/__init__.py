"""Data: tokenizers (tokenizer.py), indexed .bin/.idx stores (store.py), where tokens come from
(sources.py), packed / shuffled / blended samples (dataset.py), the stateful loader (loader.py).

Public names resolve on first use (PEP 562), so importing one submodule loads only what it needs.
"""
from __future__ import annotations

from torchmeg import _facade

# Each public name and the module it lives in, imported on first use (PEP 562; see torchmeg._facade).
_PUBLIC = {'build_tokenizer': 'torchmeg.data.tokenizer',
           **dict.fromkeys(('open_stores', 'build_dataset', 'build_loader'), 'torchmeg.data.loader')}
__all__ = sorted(_PUBLIC)

__getattr__ = _facade(__name__, _PUBLIC)
