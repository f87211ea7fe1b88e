"""Megatron-LM's indexed dataset (megatron.core.datasets.indexed_dataset), read and written as
megatron-core does, so a Megatron corpus trains as it is and torchmeg's stores load in Megatron.

`PREFIX.bin`: every sequence's tokens back to back. `PREFIX.idx`, little-endian:

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64    S, the number of sequences
    uint64    D, the number of document indices (documents + 1)
    int32[S]  sequence lengths (tokens)
    int64[S]  sequence pointers (byte offsets into .bin)
    int64[D]  document indices: document d is sequences [idx[d], idx[d + 1])
   (int8[S]   sequence modes, multimodal datasets only: not read here)

Nothing here holds a per-document array in memory: the index is memory-mapped and checked in
chunks, and document boundaries inside a token range are found by binary search.
"""
from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from torchmeg.data.writer import AtomicStoreWriter, read_index_header
from torchmeg.config.errors import StoreError

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_CHUNK = 1 << 24  # index entries checked per pass: bounded memory for any corpus


def is_megatron(idx_path: str) -> bool:
    try:
        with open(idx_path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def optimal_dtype(vocab_size: int):
    """megatron-core's choice (DType.optimal_dtype): uint16 below 65,500 tokens, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class MegatronStore:
    """A Megatron indexed dataset, memory-mapped and checked on open (one line naming the file)."""

    format = "megatron"

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        magic, version, code, S, D = read_index_header(prefix, _HEAD, "Megatron index")
        size = os.path.getsize(idx)
        if magic != MAGIC:
            raise StoreError(f"{idx}: not a Megatron index (bad magic {magic!r})")
        if version != 1:
            raise StoreError(f"{idx}: Megatron index version {version}; only version 1 exists")
        if code not in DTYPES:
            raise StoreError(f"{idx}: unknown token dtype code {code} (Megatron's are 1-8)")
        self.dtype = np.dtype(DTYPES[code])
        want = _HEAD.size + 4 * S + 8 * S + 8 * D
        if size == want + S and S:
            raise StoreError(f"{idx}: a multimodal Megatron index (one mode byte per sequence); torchmeg trains on "
                             f"token sequences only: write the text part as its own store")
        if size != want:
            raise StoreError(f"{idx}: {size:,} bytes, but its header's {S:,} sequences and {D:,} document indices "
                             f"need {want:,} ({'truncated' if size < want else 'trailing bytes'})")
        self.n_sequences = S
        self.lengths = np.memmap(idx, np.int32, "r", offset=_HEAD.size, shape=(S,)) if S else np.zeros(0, np.int32)
        self.pointers = np.memmap(idx, np.int64, "r", offset=_HEAD.size + 4 * S, shape=(S,)) if S else np.zeros(0, np.int64)
        self.doc_index = np.memmap(idx, np.int64, "r", offset=_HEAD.size + 12 * S, shape=(D,)) if D else np.zeros(0, np.int64)
        n_tok = self._check_index(idx)
        item = self.dtype.itemsize
        if os.path.getsize(bin_) != n_tok * item:
            raise StoreError(f"{bin_}: {os.path.getsize(bin_):,} bytes, but {idx} indexes {n_tok:,} {self.dtype.name} "
                             f"tokens = {n_tok * item:,} bytes (the pair does not belong together or was cut short)")
        self.tokens = np.memmap(bin_, self.dtype, "r", shape=(n_tok,)) if n_tok else np.zeros(0, self.dtype)
        self.vocab_size = None  # Megatron's index does not record it: ids are checked against the tokenizer

    def _check_index(self, idx: str) -> int:
        """Lengths >= 0, pointers exactly back to back from 0, document indices rising from 0 to S;
        -> the token count. Chunk by chunk, so a corpus of billions of sequences costs no memory."""
        S, item, expect = self.n_sequences, self.dtype.itemsize, 0
        for a in range(0, S, _CHUNK):
            lens = np.asarray(self.lengths[a:a + _CHUNK], dtype=np.int64)
            if (lens < 0).any():
                raise StoreError(f"{idx}: a negative sequence length near sequence {a:,} (damaged index)")
            starts = expect + np.concatenate([[0], np.cumsum(lens[:-1] * item)])
            if not np.array_equal(np.asarray(self.pointers[a:a + _CHUNK]), starts):
                raise StoreError(f"{idx}: sequence pointers near sequence {a:,} are not back to back (damaged index)")
            expect = int(starts[-1] + lens[-1] * item)
        D = len(self.doc_index)
        if D == 0 or self.doc_index[0] != 0 or self.doc_index[-1] != S:
            raise StoreError(f"{idx}: document indices must run from 0 to the {S:,} sequences (damaged index)")
        for a in range(0, D, _CHUNK):
            block = np.asarray(self.doc_index[max(a - 1, 0):a + _CHUNK])
            if (np.diff(block) < 0).any():
                raise StoreError(f"{idx}: document indices near document {a:,} fall (damaged index)")
        return expect // item

    @property
    def n_docs(self) -> int:
        return len(self.doc_index) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def _seq_start(self, s) -> int:
        return int(self.pointers[s]) // self.dtype.itemsize if s < self.n_sequences else self.n_tokens

    def doc(self, i: int) -> np.ndarray:
        a, b = self._seq_start(int(self.doc_index[i])), self._seq_start(int(self.doc_index[i + 1]))
        return np.asarray(self.tokens[a:b])

    def doc_starts(self, start: int, end: int) -> np.ndarray:
        """Token positions in [start, end) where a document begins (binary searches, no full arrays)."""
        item = self.dtype.itemsize
        s0, s1 = np.searchsorted(self.pointers, [start * item, end * item])  # sequences starting in range
        d0, d1 = np.searchsorted(self.doc_index, [s0, s1])  # documents whose first sequence is among them
        firsts = np.asarray(self.doc_index[d0:d1])
        firsts = firsts[firsts < self.n_sequences]
        return np.asarray(self.pointers[firsts]) // item


class MegatronWriter(AtomicStoreWriter):
    """Writes a Megatron indexed dataset: one sequence per document (as Megatron's preprocess_data.py
    without sentence splitting). Files appear atomically at `close()`; `abort()` removes them."""

    def __init__(self, prefix: str, vocab_size: int):
        super().__init__(prefix, vocab_size, optimal_dtype(vocab_size))
        self.lengths = array("q")
        self.n_tokens = 0

    @property
    def n_docs(self) -> int:
        return len(self.lengths)

    def add(self, tokens) -> None:
        n = self._write_tokens(tokens)
        self.lengths.append(n)
        self.n_tokens += n

    def _index_bytes(self) -> list[bytes]:
        S = len(self.lengths)
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if S else np.zeros(0, np.int64)
        if S and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document of more than 2^31 tokens does not fit Megatron's int32 sequence lengths")
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1] * self.dtype.itemsize)]).astype(np.int64) if S \
            else np.zeros(0, np.int64)
        return [_HEAD.pack(MAGIC, 1, _CODES[self.dtype], S, S + 1), lengths.astype(np.int32).tobytes(),
                pointers.tobytes(), np.arange(S + 1, dtype=np.int64).tobytes()]
