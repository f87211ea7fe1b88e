"""The KV cache of a continuous batch: one slot per running sequence, each at its own length.

torchmeg.models.kv_cache serves one batch that starts together (left-padded, one shared length).
A server admits and retires sequences at every step, so here each slot keeps its own length and a
forward names what it runs. Two kinds of forward:

- `bind(rows, starts, n)`: `n` new tokens in each of the slots `rows` (a decode step: one token per
  running sequence, each at its own position; or the next chunk of one long prompt), attending
  over the slots' keys up to the longest one, the rest masked. The scheduler keeps the running
  sequences in slots 0..n-1 (a sequence that leaves is replaced by the last one: `move`, one copy
  of one sequence's cache per departure), so a decode step reads the buffers as a view: no copy of
  the running sequences' keys per step.
- `bind_packed(slots, lengths)`: several prompts from their first token, packed end to end in one
  row (one forward for all of them, positions restarting at each). Each prompt's keys are written
  to its slot; attention stays within each prompt: `attend` runs one causal SDPA call per prompt
  (no mask), the families that build their own attention read `owner.mask` (block-diagonal).

The model code is the same as for generation: it calls `layer(name).attend / update / append`,
`owner.mask` and `owner.query_slots` (each query's index in the keys `update` returns).

Buffers are contiguous per slot, [slots, kv heads, max_len, head dim] per layer, allocated at the
first write (so under TP each rank holds its own heads). Pages (vLLM's PagedAttention) would let
sequences share the memory of a pool instead of each reserving max_len, and a common prompt prefix
share its pages instead of being copied (`move`: the scheduler's prefix caching copies a cached
prefix into the new sequence's slot); both need attention that reads keys through a page table,
which SDPA does not.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from torchmeg.models.kv_cache import LayerCache


PER_ROW_BYTES = 256 * 1024  # padding bytes a sequence's decode would read, above which it attends alone


def per_row_pays(lengths: list[int], read_len: int, bytes_per_position: int) -> bool:
    """Decode over each sequence's own length (one SDPA call per sequence) instead of one call over
    the view padded to the longest: on CPU a decode step is bound by reading the cache, and a call
    costs ~25 us, the time to read ~256 KiB; so per sequence when the padding it saves is more than
    that per sequence. (On CUDA one kernel over the padded view: a variable-length or paged kernel is
    the GPU's answer; not built here.)"""
    waste = len(lengths) * read_len - sum(lengths)
    return waste * bytes_per_position > PER_ROW_BYTES * len(lengths)


class SlotCache:
    def __init__(self, slots: int, max_len: int, device):
        self.slots, self.max_len, self.device = slots, max_len, torch.device(device)
        self.layers: dict[str, SlotLayer] = {}
        self.model_state: dict = {}
        self.spans: list[tuple[int, int]] | None = None  # packed: each prompt's [start, end) in the row

    def layer(self, name: str) -> "SlotLayer":
        if name not in self.layers:
            self.layers[name] = SlotLayer(self)
        return self.layers[name]

    def bind(self, rows: list[int], starts: list[int], n: int) -> torch.Tensor:
        """The next forward runs `n` new tokens in each of the slots `rows`, slot rows[i] holding
        starts[i] tokens already. -> their positions [len(rows), n]."""
        if max(starts) + n > self.max_len:
            raise ValueError(f"slot cache of {self.max_len} positions is full ({max(starts) + n} needed)")
        self.spans, self.n = None, n
        self.read_len = max(starts) + n
        self.lengths = [s + n for s in starts]
        self.per_row = False  # (set by the first layer's attend: batching.slots.per_row_pays)
        self._decode = n == 1 and self.device.type == "cpu" and len(rows) > 1
        first = rows[0]
        # Slots side by side (the scheduler keeps them so) are read as a view; others gathered.
        self._contiguous = list(rows) == list(range(first, first + len(rows)))
        self._slice = slice(first, first + len(rows))
        dev = self.device
        self.rows = torch.tensor(rows, dtype=torch.long, device=dev)[:, None]
        start = torch.tensor(starts, dtype=torch.long, device=dev)
        positions = start[:, None] + torch.arange(n, device=dev)
        self.write_at = positions
        # query i of slot r may read keys j <= starts[r] + i: its own sequence, causally
        keys = torch.arange(self.read_len, device=dev)
        self._mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        return positions

    def bind_packed(self, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """The next forward runs prompts of `lengths` tokens, packed in one row, each from position 0
        into its slot. -> positions [1, sum(lengths)], restarting at each prompt."""
        if max(lengths) > self.max_len:
            raise ValueError(f"slot cache of {self.max_len} positions is full ({max(lengths)} needed)")
        dev, T = self.device, sum(lengths)
        # the spans from the lengths the host has; the device's tensors sized by it (output_size): no
        # value is read back from the device (on CUDA each read would wait for the queue)
        ends = list(itertools.accumulate(lengths))
        self.spans = [(e - n, e) for e, n in zip(ends, lengths)]
        lens = torch.tensor(lengths, device=dev)
        starts = torch.tensor([a for a, _ in self.spans], device=dev)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lens, output_size=T)
        positions = torch.arange(T, device=dev) - starts[doc]
        self.rows = torch.tensor(slots, dtype=torch.long, device=dev)[doc][None]
        self.per_row = self._decode = False
        self.write_at, self.n, self.read_len = positions[None], T, T
        self._mask = None
        self._doc = doc
        return positions[None]

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` positions to slot `dst` (the scheduler's compaction)."""
        for layer in self.layers.values():
            for buf in (layer.k, layer.v):
                if buf is not None:
                    buf[dst, :, :length] = buf[src, :, :length]

    def query_slots(self, n: int) -> torch.Tensor:
        """[rows, n] each new token's index in the keys `update` returns (kv_cache.KVCache.query_slots)."""
        return torch.arange(self.n, device=self.device)[None] if self.spans is not None else self.write_at

    def mask(self, n: int, keys: int) -> torch.Tensor:
        assert n == self.n and keys == self.read_len, (n, keys, self.n, self.read_len)
        if self._mask is None:  # packed: each prompt's tokens see their own prompt's, causally
            i = torch.arange(self.n, device=self.device)
            self._mask = ((self._doc[:, None] == self._doc[None, :]) & (i[None, :] <= i[:, None]))[None, None]
        return self._mask


class SlotLayer(LayerCache):
    """One attention layer's buffers: models.kv_cache.LayerCache's update / append / attend, each
    slot written at its own length."""

    def _write(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        c = self.owner
        buf = getattr(self, name)
        if buf is None:
            _, K, _, D = x_BKLD.shape
            buf = x_BKLD.new_zeros(c.slots, K, c.max_len, D)
            setattr(self, name, buf)
        # buf[rows[b, i], :, write_at[b, i]] = x[b, :, i]  (advanced indices first: [B, n, K, D])
        buf[c.rows, :, c.write_at] = x_BKLD.transpose(1, 2).to(buf.dtype)
        if c.spans is not None:  # packed prompts read only their own new keys
            return x_BKLD.to(buf.dtype)
        if c._contiguous:
            return buf[c._slice, :, :c.read_len]
        return buf[c.rows[:, 0], :, :c.read_len]

    def attend(self, q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> torch.Tensor:
        c = self.owner
        if c.spans is None and c._decode and self.k is not None and self is next(iter(c.layers.values())):
            c.per_row = per_row_pays(c.lengths, c.read_len, 2 * self.k[0, :, 0].numel() * self.k.element_size())
        if c.spans is None and not c.per_row:
            return super().attend(q_BHLD, k_BKLD, v_BKLD)
        k, v = self.update(k_BKLD, v_BKLD)
        gqa = q_BHLD.shape[1] != k.shape[1]
        if c.spans is None:  # one query per sequence: all its keys, no mask
            return torch.cat([F.scaled_dot_product_attention(q_BHLD[i:i + 1], k[i:i + 1, :, :L], v[i:i + 1, :, :L],
                                                             enable_gqa=gqa) for i, L in enumerate(c.lengths)])
        return torch.cat([F.scaled_dot_product_attention(q_BHLD[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                         enable_gqa=gqa) for a, b in c.spans], dim=2)
