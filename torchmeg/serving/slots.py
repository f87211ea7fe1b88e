"""The KV cache of a continuous batch: one slot per running sequence, each at its own length.

torchmeg.models.kv_cache serves one batch that starts together (left-padded, one shared length).
A server admits and retires sequences at every step, so here each slot keeps its own length and a
forward names the slots it runs (`bind`): a prefill writes one sequence's prompt into its slot; a
decode step writes one token per running slot, each at its own position, and attends over the
slots' keys up to the longest one, the rest masked. The model code is the same as for generation:
it calls `layer(name).attend / update / append`, `owner.mask` and `owner.query_slots`.

Buffers are contiguous per slot, [slots, kv heads, max_len, head dim] per layer, allocated at the
first write (so under TP each rank holds its own heads). Pages (vLLM's PagedAttention) would let
sequences share the memory of a pool instead of each reserving max_len; they pay off when max_len
is long and most requests are short, and need a paged attention kernel, which SDPA is not. With
`max_len` a server flag, contiguous slots keep SDPA and the model code unchanged.
"""
from __future__ import annotations

import torch

from torchmeg.models.kv_cache import LayerCache


class SlotCache:
    def __init__(self, slots: int, max_len: int, device):
        self.slots, self.max_len, self.device = slots, max_len, torch.device(device)
        self.layers: dict[str, SlotLayer] = {}
        self.model_state: dict = {}
        self._rows: list[int] = []

    def layer(self, name: str) -> "SlotLayer":
        if name not in self.layers:
            self.layers[name] = SlotLayer(self)
        return self.layers[name]

    def bind(self, rows: list[int], starts: list[int], n: int) -> torch.Tensor:
        """The next forward runs `n` new tokens in each of the slots `rows`, slot rows[i] holding
        starts[i] tokens already. -> their positions [len(rows), n]."""
        if max(starts) + n > self.max_len:
            raise ValueError(f"slot cache of {self.max_len} positions is full ({max(starts) + n} needed)")
        self._rows, self.n = list(rows), n
        self.read_len = max(starts) + n
        first = rows[0]
        # Slots that sit side by side are read as a view; others gathered (a copy of their keys).
        self._contiguous = list(rows) == list(range(first, first + len(rows)))
        self._slice = slice(first, first + len(rows))
        dev = self.device
        self.rows = torch.tensor(rows, dtype=torch.long, device=dev)
        start = torch.tensor(starts, dtype=torch.long, device=dev)
        positions = start[:, None] + torch.arange(n, device=dev)
        self.write_at = positions
        # query i of slot r may read keys j <= starts[r] + i: its own sequence, causally
        keys = torch.arange(self.read_len, device=dev)
        self._mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        return positions

    def query_slots(self, n: int) -> torch.Tensor:
        """[slots bound, n] each new token's position in its slot (kv_cache.KVCache.query_slots)."""
        return self.write_at

    def mask(self, n: int, keys: int) -> torch.Tensor:
        assert n == self.n and keys == self.read_len, (n, keys, self.n, self.read_len)
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
        # buf[rows[b], :, write_at[b, i]] = x[b, :, i]  (advanced indices first: [B, n, K, D])
        buf[c.rows[:, None], :, c.write_at] = x_BKLD.transpose(1, 2).to(buf.dtype)
        if c._contiguous:
            return buf[c._slice, :, :c.read_len]
        return buf[c.rows, :, :c.read_len]
