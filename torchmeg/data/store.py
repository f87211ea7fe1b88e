"""Indexed token store: `<prefix>.bin` holds all tokens back to back, `<prefix>.idx` the document
offsets. Both are read with numpy memmap, so a store far larger than RAM costs nothing to open.

.idx layout: magic b"TMIDX1\\0\\0", uint8 dtype code, 7 pad bytes, int64 n_docs, int64 vocab_size,
then int64 offsets[n_docs + 1] (token offsets into .bin; offsets[0] = 0).
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"TMIDX1\0\0"
_DTYPES = {1: np.uint16, 2: np.uint32}
_HEADER = struct.Struct("<8sB7xqq")


def dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


class StoreWriter:
    """Append documents, then `close()`; files appear atomically (written as .tmp, then renamed)."""

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix, self.vocab_size = prefix, vocab_size
        self.dtype = dtype_for(vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self.offsets = [0]

    def add(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self.offsets.append(self.offsets[-1] + len(arr))

    def close(self) -> None:
        self._bin.close()
        code = {np.uint16: 1, np.uint32: 2}[self.dtype]
        with open(self.prefix + ".idx.tmp", "wb") as fh:
            fh.write(_HEADER.pack(MAGIC, code, len(self.offsets) - 1, self.vocab_size))
            fh.write(np.asarray(self.offsets, dtype=np.int64).tobytes())
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")


class Store:
    def __init__(self, prefix: str):
        self.prefix = prefix
        with open(prefix + ".idx", "rb") as fh:
            magic, code, n_docs, self.vocab_size = _HEADER.unpack(fh.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"{prefix}.idx is not a torchmeg index (bad magic)")
        self.offsets = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=_HEADER.size, shape=(n_docs + 1,))
        self.dtype = _DTYPES[code]
        n_tok = int(self.offsets[-1])
        self.tokens = np.memmap(prefix + ".bin", dtype=self.dtype, mode="r", shape=(n_tok,)) if n_tok else np.zeros(0, self.dtype)

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
