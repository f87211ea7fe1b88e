"""The KV cache of a continuous batch, paged (vLLM's PagedAttention): one pool of blocks per layer,
[kv heads, num_blocks x BLOCK positions, head dim], and each sequence's positions found
through its block table (batching.blocks decides the tables; the plan carries them, so every
tensor-parallel rank reads the same blocks of its own heads).

torchmeg.models.kv_cache serves one batch that starts together. Here each sequence has its own
length and its own blocks, and a forward names what it runs. Two kinds of forward:

- `bind(tables, starts, n)`: `n` new tokens of each of the sequences whose tables are given, each at
  its own position (a decode step: one token per running sequence; a prompt's next chunk; the rest
  of a prompt after its cached prefix). The new keys are written at their blocks; attention reads
  each sequence's keys through its table, gathered into a [sequences, kv heads, longest, dim] view
  (SDPA over a gathered view: SDPA reads no block table), the positions past a sequence's length
  read from the null block and masked. A CPU decode whose lengths differ widely attends per
  sequence instead, over a slice of the pool where its blocks are consecutive (no copy).
  Heads first in the pool: each head's positions are contiguous, as SDPA reads them (a decode over
  1,000 positions on this CPU: 50 us heads first, 78 us positions first, 69 us in the per-sequence
  buffers of before).
- `bind_packed(tables, lengths)`: several prompts from their first token, packed end to end in one
  row (positions restarting at each). Each prompt's keys are written to its blocks; attention stays
  within each prompt: `attend` runs one causal SDPA call per prompt over the new keys (no gather),
  the families that build their own attention read `owner.mask` (block-diagonal).

The model code is the same as for generation: it calls `layer(name).attend / update / append`,
`owner.mask` and `owner.query_slots` (each query's index in the keys `update` returns).

The pool is allocated at the first write, from the K/V the layer produces (under TP each rank holds
its own heads). `written` counts the positions written (every layer alike): what a forward computed;
a prefix mapped from another sequence's blocks is never written, so a test can see it was not copied.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from torchmeg.batching.blocks import BLOCK, NULL, blocks_for
from torchmeg.models.kv_cache import LayerCache


PER_ROW_BYTES = 256 * 1024  # padding bytes a sequence's decode would read, above which it attends alone


def per_row_pays(lengths: list[int], read_len: int, bytes_per_position: int) -> bool:
    """Decode over each sequence's own length (one SDPA call per sequence) instead of one call over
    the view padded to the longest: on CPU a decode step is bound by reading the cache, and a call
    costs ~25 us, the time to read ~256 KiB; so per sequence when the padding it saves is more than
    that per sequence. (On CUDA one kernel over the padded view: a paged kernel is the GPU's answer.)"""
    waste = len(lengths) * read_len - sum(lengths)
    return waste * bytes_per_position > PER_ROW_BYTES * len(lengths)


class PagedCache:
    paged = True  # (a model that brings its own attention reads the cache through it: models.hf_paged)

    def __init__(self, num_blocks: int, device, block_size: int = BLOCK):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.layers: dict[str, PagedLayer] = {}
        self.model_state: dict = {}
        self.spans: list[tuple[int, int]] | None = None  # packed: each prompt's [start, end) in the row
        self.written = 0  # positions written by the forwards so far (each once, whatever the layers)

    def layer(self, name: str) -> "PagedLayer":
        if name not in self.layers:
            self.layers[name] = PagedLayer(self)
        return self.layers[name]

    def _slots(self, table: list[int], positions: range) -> list[int]:
        B = self.block_size
        return [table[p // B] * B + p % B for p in positions]

    def _check(self, tables: list[list[int]], ends: list[int]) -> None:
        for t, end in zip(tables, ends):
            if len(t) * self.block_size < end or (t and max(t) >= self.num_blocks):
                raise ValueError(f"a block table of {len(t)} blocks {t[:4]}... cannot hold {end} positions "
                                 f"in a pool of {self.num_blocks} blocks")

    def bind(self, tables: list[list[int]], starts: list[int], n: int, tokens: list[list[int]] | None = None) -> torch.Tensor:
        """The next forward runs `n` new tokens in each sequence of `tables`, sequence i holding
        starts[i] tokens already. -> their positions [len(tables), n]. `tokens` (each row's n) come up
        in the same upload, as `self.tokens` [rows, n]."""
        self._check(tables, [s + n for s in starts])
        self.spans, self.n = None, n
        self.read_len = max(starts) + n
        self.lengths = [s + n for s in starts]
        self.per_row = False  # (set by the first layer's attend: batching.paged.per_row_pays)
        self.tables, self._views = tables, None
        self._decode = n == 1 and self.device.type == "cpu" and len(tables) > 1
        dev, B = self.device, self.block_size
        blocks = blocks_for(self.read_len, B)
        # one upload: each row's start, its tokens, then its table padded with the null block
        given = tokens or [[]] * len(tables)
        host = [[s] + tk + t[:blocks] + [NULL] * (blocks - len(t[:blocks])) for s, tk, t in zip(starts, given, tables)]
        packed = torch.tensor(host, dtype=torch.long, device=dev)
        w = 1 + (n if tokens else 0)
        start, table, self.tokens = packed[:, 0], packed[:, w:], packed[:, 1:w]
        positions = start[:, None] + torch.arange(n, device=dev)
        self.write_at = positions
        every = (table[:, :, None] * B + torch.arange(B, device=dev)).flatten(1)[:, :self.read_len]
        self.read = every  # [rows, read_len] each key position's slot in the pool
        self.write = every.gather(1, positions).flatten()  # [rows * n]
        self._mask = None  # (built when a layer asks: the per-sequence decode never does)
        self.written += n * len(tables)
        return positions

    def run_start(self, table: list[int], length: int) -> int:
        """The pool position a sequence's keys start at when its first `length` positions lie in
        consecutive blocks (one slice of the pool); -1 when they do not."""
        n = blocks_for(length, self.block_size)
        first = table[0]
        return first * self.block_size if table[n - 1] - first == n - 1 and table[:n] == list(range(first, first + n)) else -1

    def bind_packed(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """The next forward runs prompts of `lengths` tokens, packed in one row, each from position 0
        into its blocks. -> positions [1, sum(lengths)], restarting at each prompt."""
        self._check(tables, lengths)
        dev, T = self.device, sum(lengths)
        # the spans from the lengths the host has; the device's tensors sized by it (output_size): no
        # value is read back from the device (on CUDA each read would wait for the queue)
        ends = list(itertools.accumulate(lengths))
        self.spans = [(e - n, e) for e, n in zip(ends, lengths)]
        slots = [s for t, n in zip(tables, lengths) for s in self._slots(t, range(n))]
        self.write = torch.tensor(slots, dtype=torch.long, device=dev)
        lens = torch.tensor(lengths, device=dev)
        starts = torch.tensor([a for a, _ in self.spans], device=dev)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lens, output_size=T)
        positions = torch.arange(T, device=dev) - starts[doc]
        self.per_row = self._decode = False
        self.write_at, self.n, self.read_len = positions[None], T, T
        self._mask = None
        self._doc = doc
        self.written += T
        return positions[None]

    def query_slots(self, n: int) -> torch.Tensor:
        """[rows, n] each new token's index in the keys `update` returns (kv_cache.KVCache.query_slots)."""
        return torch.arange(self.n, device=self.device)[None] if self.spans is not None else self.write_at

    def mask(self, n: int, keys: int) -> torch.Tensor:
        assert n == self.n and keys == self.read_len, (n, keys, self.n, self.read_len)
        if self._mask is not None:
            return self._mask
        if self.spans is None:  # query i of row r may read keys j <= starts[r] + i: its own sequence, causally
            j = torch.arange(self.read_len, device=self.device)
            self._mask = (j[None, None, :] <= self.write_at[:, :, None])[:, None]
        else:  # packed: each prompt's tokens see their own prompt's, causally
            i = torch.arange(self.n, device=self.device)
            self._mask = ((self._doc[:, None] == self._doc[None, :]) & (i[None, :] <= i[:, None]))[None, None]
        return self._mask

    def pool_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for layer in self.layers.values() for b in (layer.k, layer.v)
                   if b is not None)


class PagedLayer(LayerCache):
    """One attention layer's pools: models.kv_cache.LayerCache's update / append / attend, each
    sequence's keys written at and read through its blocks."""

    def _store(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        """Write the new keys (or values) at their slots -> the pool [K, positions, D]."""
        c = self.owner
        pool = getattr(self, name)
        _, K, _, D = x_BKLD.shape
        if pool is None:
            pool = x_BKLD.new_zeros(K, c.num_blocks * c.block_size, D)
            setattr(self, name, pool)
        pool.index_copy_(1, c.write, x_BKLD.transpose(0, 1).reshape(K, -1, D).to(pool.dtype))
        return pool

    def _write(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        c = self.owner
        pool = self._store(name, x_BKLD)
        if c.spans is not None:  # packed prompts read only their own new keys
            return x_BKLD.to(pool.dtype)
        R, L = c.read.shape
        K, _, D = pool.shape
        return pool.index_select(1, c.read.flatten()).view(K, R, L, D).transpose(0, 1)

    def attend(self, q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> torch.Tensor:
        c = self.owner
        if c.spans is None and c._decode and self is next(iter(c.layers.values())):
            c.per_row = per_row_pays(c.lengths, c.read_len, 2 * k_BKLD[0, :, 0].numel() * k_BKLD.element_size())
            if c.per_row:
                c._views = [c.run_start(t, L) for t, L in zip(c.tables, c.lengths)]
        if c.spans is None and not c.per_row:
            return super().attend(q_BHLD, k_BKLD, v_BKLD)
        gqa = q_BHLD.shape[1] != k_BKLD.shape[1]
        if c.spans is not None:  # packed prompts: each one causally over its own new keys
            k, v = self.update(k_BKLD, v_BKLD)
            return torch.cat([F.scaled_dot_product_attention(q_BHLD[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                             is_causal=True, enable_gqa=gqa) for a, b in c.spans], dim=2)
        # one query per sequence: each reads only its own positions, no mask; consecutive blocks as a
        # view of the pool (batching.blocks keeps a table's blocks consecutive where it can), others gathered
        pk, pv = self._store("k", k_BKLD), self._store("v", v_BKLD)
        out = []
        for i, (L, at) in enumerate(zip(c.lengths, c._views)):
            if at >= 0:
                k, v = pk[:, at:at + L], pv[:, at:at + L]
            else:
                k, v = pk.index_select(1, c.read[i, :L]), pv.index_select(1, c.read[i, :L])
            out.append(F.scaled_dot_product_attention(q_BHLD[i:i + 1], k[None], v[None], enable_gqa=gqa))
        return torch.cat(out)
