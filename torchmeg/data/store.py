"""Indexed token stores: `<prefix>.bin` holds all tokens back to back, `<prefix>.idx` where the
documents are. Read with numpy memmap, so a store far larger than RAM costs nothing to open.

Two layouts, told apart by the .idx magic (`open_store`):
* Megatron-LM's indexed dataset (torchmeg.data.megatron): what torchmeg writes, and what
  Megatron corpora already are.
* torchmeg's first layout, kept readable for stores written by earlier versions (and writable with
  `tools/preprocess_data.py --format torchmeg`): magic b"TMIDX1\\0\\0", uint8 dtype code, 7 pad
  bytes, int64 n_docs, int64 vocab_size, then int64 offsets[n_docs + 1] (token offsets into .bin).
Why keep reading it: stores people have on disk. Why Megatron's by default: one format fewer to
move between the two tools; what it lacks (the vocabulary size) is checked against the tokenizer.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from torchmeg.data.megatron import MAGIC as MEGATRON_MAGIC
from torchmeg.data.megatron import MegatronStore, MegatronWriter, is_megatron
from torchmeg.data.writer import AtomicStoreWriter, read_index_header
from torchmeg.config.errors import StoreError

MAGIC = b"TMIDX1\0\0"
_DTYPES = {1: np.uint16, 2: np.uint32}
_HEADER = struct.Struct("<8sB7xqq")


def dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def open_store(prefix: str):
    """The store at `prefix`, in whichever layout its .idx says; checked on open (StoreError)."""
    return MegatronStore(prefix) if is_megatron(prefix + ".idx") else Store(prefix)


def make_writer(prefix: str, vocab_size: int, fmt: str = "megatron"):
    """A writer of `fmt` ("megatron", the default, or "torchmeg", the earlier layout)."""
    return MegatronWriter(prefix, vocab_size) if fmt == "megatron" else StoreWriter(prefix, vocab_size)


def check_token_ids(tokens, vocab_size: int, path: str) -> None:
    """Every token id is a whole number in [0, vocab_size): all of them up to 256M tokens, 64 evenly
    spread blocks of 1M beyond. Anything off raises StoreError naming the file."""
    n = len(tokens)
    if n <= 1 << 28:
        spans = [(0, n)]
    else:
        block = 1 << 20
        spans = [(int(s), int(s) + block) for s in np.linspace(0, n - block, 64).astype(np.int64)]
    for lo, hi in spans:
        for a in range(lo, hi, 1 << 24):
            part = np.asarray(tokens[a:min(hi, a + (1 << 24))])
            if not len(part):
                continue
            top, low = part.max(), part.min()
            if part.dtype.kind == "f" and not np.array_equal(part, np.floor(part)):
                raise StoreError(f"{path}: non-integer token values near token {a:,} (a float store that is not token ids)")
            if top >= vocab_size or low < 0:
                bad = int(top) if top >= vocab_size else int(low)
                raise StoreError(f"{path}: token id {bad} near token {a:,} is outside the vocabulary of {vocab_size} "
                                 f"(another tokenizer's store, or damaged)")


class StoreWriter(AtomicStoreWriter):
    """The earlier torchmeg layout. Append documents, then `close()`; files appear atomically
    (written as .tmp, then renamed). `abort()` (or an exception inside a `with` block) removes the
    partial files."""

    def __init__(self, prefix: str, vocab_size: int):
        super().__init__(prefix, vocab_size, dtype_for(vocab_size))
        self.offsets = [0]

    def add(self, tokens) -> None:
        self.offsets.append(self.offsets[-1] + self._write_tokens(tokens))

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return self.offsets[-1]

    def _index_bytes(self) -> list[bytes]:
        code = {np.uint16: 1, np.uint32: 2}[self.dtype.type]
        return [_HEADER.pack(MAGIC, code, len(self.offsets) - 1, self.vocab_size),
                np.asarray(self.offsets, dtype=np.int64).tobytes()]


class Store:
    """A store in the earlier torchmeg layout, checked on open: header, dtype, file sizes, offsets
    (monotone, from 0, ending at the token count) and token ids below the vocabulary size in its
    header (check_token_ids). Anything off raises StoreError naming the file."""

    format = "torchmeg"

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        magic, code, n_docs, self.vocab_size = read_index_header(prefix, _HEADER, "index",
                                                                 " from tools/preprocess_data.py")
        idx_size = os.path.getsize(idx)
        if magic != MAGIC:
            raise StoreError(f"{idx}: not a store index (magic {magic!r} is neither Megatron's {MEGATRON_MAGIC!r} "
                             f"nor torchmeg's {MAGIC!r})")
        if code not in _DTYPES:
            raise StoreError(f"{idx}: unknown token dtype code {code} (known: 1 = uint16, 2 = uint32)")
        if n_docs < 0 or self.vocab_size <= 0:
            raise StoreError(f"{idx}: header says {n_docs} documents, vocab {self.vocab_size} (damaged header)")
        want = _HEADER.size + 8 * (n_docs + 1)
        if idx_size != want:
            raise StoreError(f"{idx}: {idx_size} bytes, but its header's {n_docs:,} documents need {want:,} "
                             f"({'truncated' if idx_size < want else 'trailing bytes'})")
        self.offsets = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER.size, shape=(n_docs + 1,))
        self.dtype = _DTYPES[code]
        n_tok = int(self.offsets[-1])
        if self.offsets[0] != 0 or (n_docs and bool((np.diff(self.offsets) < 0).any())) or n_tok < 0:
            raise StoreError(f"{idx}: document offsets do not start at 0 and rise monotonically (damaged index)")
        itemsize = np.dtype(self.dtype).itemsize
        bin_size = os.path.getsize(bin_)
        if bin_size != n_tok * itemsize:
            raise StoreError(f"{bin_}: {bin_size:,} bytes, but {idx} indexes {n_tok:,} {np.dtype(self.dtype).name} "
                             f"tokens = {n_tok * itemsize:,} bytes ({'truncated' if bin_size < n_tok * itemsize else 'extra bytes'}; "
                             f"the pair does not belong together or was cut short)")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r", shape=(n_tok,)) if n_tok else np.zeros(0, self.dtype)
        check_token_ids(self.tokens, self.vocab_size, bin_)

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])

    def doc_starts(self, start: int, end: int) -> np.ndarray:
        """Token positions in [start, end) where a document begins."""
        a, b = np.searchsorted(self.offsets[:-1], [start, end])
        return np.asarray(self.offsets[a:b])


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
