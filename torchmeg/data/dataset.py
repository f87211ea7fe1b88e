"""Packed, shuffled, blended samples whose content depends only on (seed, global index).

A global batch of step s is samples [s*G, (s+1)*G). Each data-parallel rank reads its own slice
of it, so every layout with the same global batch trains on the same tokens at every step.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from torchmeg.data.shuffle import Permutation, epoch_key
from torchmeg.kernels.fused_ce import IGNORE  # the label the loss skips (F.cross_entropy's ignore_index)



class PackedWindows:
    """Windows of seq_len + 1 tokens over a store's stream (documents end with EOS).

    Window j covers tokens [j*L, j*L + L + 1): inputs are its first L tokens, labels its last L.
    The last `val_fraction` of windows form the held-out split ("val"), the rest "train"; "all"
    is every window (evaluating a whole store).
    """

    def __init__(self, store, seq_len: int, split: str, val_fraction: float):
        self.store, self.seq_len = store, seq_len
        n = (store.n_tokens - 1) // seq_len
        n_val = max(1, int(n * val_fraction)) if val_fraction > 0 else 0
        self.first, self.n = {"train": (0, n - n_val), "val": (n - n_val, n_val), "all": (0, n)}[split]
        if self.n <= 0:
            raise ValueError(f"{store.prefix}: no {split} samples at seq_len {seq_len}")

    def __len__(self):
        return self.n

    def window(self, j: int) -> np.ndarray:
        start = (self.first + j) * self.seq_len
        return np.asarray(self.store.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def documents(self, j: int) -> np.ndarray:
        """[L + 1] the document number (0, 1, ...) of each token of window j, from the store's index."""
        start = (self.first + j) * self.seq_len
        starts = self.store.doc_starts(start + 1, start + self.seq_len + 1)
        return np.searchsorted(starts, np.arange(start, start + self.seq_len + 1), side="right")


class Shuffled:
    """Endless epochs over windows, each epoch a permutation keyed by (seed, epoch): a Feistel
    bijection computed per index (torchmeg.data.shuffle), so no epoch-sized array exists."""

    def __init__(self, windows, seed: int, shuffle: bool = True):
        self.w, self.seed, self.shuffle = windows, seed, shuffle
        self._epoch, self._perm = -1, None

    def index(self, i: int) -> int:
        """Which window global sample i reads."""
        n = len(self.w)
        epoch, pos = divmod(i, n)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            self._perm, self._epoch = Permutation(n, epoch_key(self.seed, epoch)), epoch
        return self._perm(pos)

    def get(self, i: int) -> np.ndarray:
        return self.w.window(self.index(i))

    def locate(self, i: int):
        """(the windows, the window index) global sample i reads."""
        return self.w, self.index(i)


class Blend:
    """Mix sources by weight in blocks of `block` samples.

    Each block holds each source's quota (largest-remainder rounding of block x weight), placed
    by a permutation seeded by (seed, block). Sample i's source and its index within that source
    are computed from block i // block alone, so no prefix of the stream needs replaying.
    """

    def __init__(self, sources: list, weights: list[float], seed: int, block: int = 1024):
        self.sources, self.seed, self.block = sources, seed, block
        w = np.asarray(weights, dtype=np.float64) / sum(weights)
        raw = w * block
        quota = np.floor(raw).astype(np.int64)
        for k in np.argsort(-(raw - quota), kind="stable")[: block - quota.sum()]:
            quota[k] += 1
        self.quota = quota
        self._b, self._src, self._idx = -1, None, None

    def _pick(self, i: int):
        """(the source global sample i comes from, its index within that source)."""
        b, j = divmod(i, self.block)
        if b != self._b:
            src = np.repeat(np.arange(len(self.sources)), self.quota)
            src = np.random.Generator(np.random.PCG64([self.seed, 7919, b])).permutation(src)
            idx = np.empty_like(src)
            for d in range(len(self.sources)):
                sel = src == d
                idx[sel] = b * self.quota[d] + np.arange(sel.sum())
            self._b, self._src, self._idx = b, src, idx
        return self.sources[int(self._src[j])], int(self._idx[j])

    def get(self, i: int) -> np.ndarray:
        source, k = self._pick(i)
        return source.get(k)

    def locate(self, i: int):
        source, k = self._pick(i)
        return source.locate(k)


class TokenDataset(Dataset):
    """Map-style view: global sample index -> (inputs [L], labels [L]), or with `documents`
    (document masking) (inputs, labels, documents [L]): the document number of every input token,
    for attention that stays within documents and positions that restart at each. `mask_eod`:
    the prediction made at a document's last token (the first token of the next one) is not a
    training target (label IGNORE; Megatron-LM's --eod-mask-loss)."""

    def __init__(self, stores: list, weights: list[float], seq_len: int, seed: int,
                 split: str = "train", val_fraction: float = 0.005, documents: bool = False,
                 mask_eod: bool = False):
        self.documents, self.mask_eod = documents, mask_eod
        shuffle = split == "train"
        parts = [Shuffled(PackedWindows(s, seq_len, split, val_fraction), seed * 1009 + k, shuffle)
                 for k, s in enumerate(stores)]
        if len(parts) == 1:
            self.src = parts[0]
        else:
            self.src = Blend(parts, weights or [float(len(PackedWindows(s, seq_len, split, val_fraction))) for s in stores], seed)
        self.n_unique = sum(len(p.w) for p in parts)

    def __getitem__(self, i: int):
        if not (self.documents or self.mask_eod):
            t = torch.from_numpy(self.src.get(int(i)))
            return t[:-1], t[1:]
        windows, j = self.src.locate(int(i))
        t, docs = torch.from_numpy(windows.window(j)), torch.from_numpy(windows.documents(j))
        labels = t[1:]
        if self.mask_eod:  # the label begins another document
            labels = labels.masked_fill(docs[1:] != docs[:-1], IGNORE)
        return (t[:-1], labels, docs[:-1]) if self.documents else (t[:-1], labels)

    def __len__(self):  # endless in principle; a large bound keeps torch's utilities happy
        return 2 ** 62


class StepSampler(Sampler):
    """Yields this dp rank's sample indices, step by step, microbatch by microbatch.

    Step s, microbatch m, dp rank r reads samples o + s*G + m*B*dp + r*B + [0, B), where the
    offset o is 0 unless a resume remapped the data position by tokens (another global batch or
    seq_len than the checkpoint's).
    """

    def __init__(self, local_batch: int, dp: int, dp_rank: int, accum: int, start_step: int, steps: int,
                 offset: int = 0):
        self.B, self.dp, self.r, self.accum = local_batch, dp, dp_rank, accum
        self.start, self.steps, self.offset = start_step, steps, offset

    @property
    def global_batch(self) -> int:
        return self.B * self.dp * self.accum

    def __iter__(self):
        for s in range(self.start, self.steps):
            for m in range(self.accum):
                base = self.offset + s * self.global_batch + m * self.B * self.dp + self.r * self.B
                yield from range(base, base + self.B)

    def __len__(self):
        return (self.steps - self.start) * self.accum * self.B
