"""What every store writer shares: tokens stream into PREFIX.bin.tmp, the index is written to
PREFIX.idx.tmp at `close()`, and both are renamed into place only then, so a store is whole or
absent (an interrupted preprocess never leaves a store that opens). `abort()`, or an exception
inside a `with` block, removes the partial files."""
from __future__ import annotations

import os

import numpy as np

from torchmeg.config.errors import StoreError


class AtomicStoreWriter:
    def __init__(self, prefix: str, vocab_size: int, dtype):
        self.prefix, self.vocab_size, self.dtype = prefix, vocab_size, np.dtype(dtype)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")

    def _write_tokens(self, tokens) -> int:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        return len(arr)

    def _index_bytes(self) -> list[bytes]:
        """The .idx file's contents, in order (raise here to refuse the store)."""
        raise NotImplementedError

    def close(self) -> None:
        self._bin.close()
        parts = self._index_bytes()
        with open(self.prefix + ".idx.tmp", "wb") as fh:
            for b in parts:
                fh.write(b)
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for ext in (".bin.tmp", ".idx.tmp"):
            try:
                os.remove(self.prefix + ext)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            self.abort()


def read_index_header(prefix: str, header, what: str, hint: str = "") -> tuple:
    """A store PREFIX.bin + PREFIX.idx: both files present and the index's fixed-size header read
    (`header`, a struct.Struct) -> its fields; StoreError naming the file otherwise."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for f in (idx, bin_):
        if not os.path.isfile(f):
            raise StoreError(f"{f}: missing (a store is PREFIX.bin + PREFIX.idx{hint})")
    size = os.path.getsize(idx)
    if size < header.size:
        raise StoreError(f"{idx}: {size} bytes, shorter than the {header.size}-byte {what} header (truncated?)")
    with open(idx, "rb") as fh:
        return header.unpack(fh.read(header.size))
