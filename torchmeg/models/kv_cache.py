"""Key/value cache for generation, in plain PyTorch.

A batch of prompts of different lengths is left-padded to one length: row b's prompt starts at
slot `pad[b]` of every layer's buffer [B, kv heads, max_len, head dim], and its tokens sit at
positions 0, 1, ... from there (RoPE and learned positions see the prompt as if alone). Attention
from the query at slot i of row b may use the keys at slots pad[b] <= j <= i; a padding query may
use its own slot only, so no row of the softmax is empty (an all-masked row is NaN, and 0 x NaN in
the value product would spread it).

The buffers are allocated at the first write from the K/V the layer produces, so under tensor
parallel each rank holds its own heads and the model code is the same.

Two modes. Eager: the write slot is a Python int and attention reads the filled prefix only.
Static (`static=True`, for torch.compile): the write slot is a tensor (`cursor`) and attention
reads the whole buffer under a mask, so one decode step has the same shapes at every position and
compiles once.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's kernels for the forwards whose shapes change at every step: a decode step reads one key more
# than the last, and a server's batch changes as requests come and go. cuDNN's attention builds an
# execution plan for each new shape: on an H200 (torch 2.11, 2026-11-29) a 32-request serving run of
# a 1B spent 4.8 ms of host time in each of its 1,040 `_cudnn_attention_forward` calls, 90% of the
# run, with the GPU busy for 2% of it (tools/serve_bench.py --profile). Flash, memory-efficient and
# math kernels build nothing per shape. Training's shapes are fixed: it keeps torch's choice.
VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def varying_shapes():
    """The context generation and serving run their forwards in (VARYING_SHAPE_BACKENDS)."""
    return sdpa_kernel(VARYING_SHAPE_BACKENDS)


def head_positions(h_BLE: torch.Tensor, last_only) -> torch.Tensor:
    """The positions the head runs on: every one (False), the last (True: a prefill), or those a
    LongTensor [n] names (a packed prefill of several prompts: each one's last token)."""
    if isinstance(last_only, torch.Tensor):
        return h_BLE[:, last_only]
    return h_BLE[:, -1:] if last_only else h_BLE


class KVCache:
    def __init__(self, batch: int, max_len: int, pad: torch.Tensor | None = None, static: bool = False,
                 device=None):
        self.batch, self.max_len, self.static = batch, max_len, static
        self.pad = (pad if pad is not None else torch.zeros(batch, dtype=torch.long)).to(device)
        self.length = 0                                            # slots written so far
        self.cursor = torch.zeros((), dtype=torch.long, device=device)  # the same, as a tensor (static mode)
        self.layers: dict[str, LayerCache] = {}
        self._mask = None  # (length, n, keys, mask): every layer of one forward shares the mask
        self.model_state: dict = {}  # a model that keeps its own cache (transformers' for `hf`) keeps it here

    def layer(self, name: str) -> "LayerCache":
        if name not in self.layers:
            self.layers[name] = LayerCache(self)
        return self.layers[name]

    def positions(self, n: int) -> torch.Tensor:
        """[B, n] positions of the next n tokens of every row (padding slots: 0)."""
        slots = self._slots(n)
        return (slots[None, :] - self.pad[:, None]).clamp_min(0)

    def advance(self, n: int) -> None:
        """After a forward over n new tokens (every layer has written them)."""
        self.length += n
        self.cursor += n

    def query_slots(self, n: int) -> torch.Tensor:
        """[1, n] the key slots the next n tokens are written at (every row alike): a windowed layer
        masks keys more than its window behind them."""
        return self._slots(n)[None]

    def _slots(self, n: int) -> torch.Tensor:
        base = self.cursor if self.static else self.length
        return base + torch.arange(n, device=self.pad.device)

    def key_mask(self, n: int) -> torch.Tensor:
        """[B, slots after n more tokens] 1 where a slot holds a token, 0 where it holds padding (the
        2-D attention mask transformers' models take)."""
        j = torch.arange(self.length + n, device=self.pad.device)
        return (j[None, :] >= self.pad[:, None]).long()

    def mask(self, n: int, keys: int) -> torch.Tensor:
        """[B, 1, n, keys] boolean: query i (of the n new tokens) may attend to key slot j."""
        if not self.static and self._mask is not None and self._mask[:3] == (self.length, n, keys):
            return self._mask[3]
        q = self._slots(n)[None, :, None]
        j = torch.arange(keys, device=self.pad.device)[None, None, :]
        allowed = (((j >= self.pad[:, None, None]) & (j <= q)) | (j == q))[:, None]
        if not self.static:
            self._mask = (self.length, n, keys, allowed)
        return allowed


class LayerCache:
    """One attention layer's buffers."""

    def __init__(self, owner: KVCache):
        # A weak reference: the owner holds its layers, and a layer that held its owner too made a
        # reference cycle, so a finished generation's buffers (every layer's K/V, on the GPU) waited
        # for the garbage collector instead of going when the cache did.
        self._owner = weakref.ref(owner)
        self.k = self.v = None

    @property
    def owner(self) -> KVCache:
        return self._owner()

    def update(self, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values at their slots -> every key/value the new queries may read."""
        return self._write("k", k_BKLD), self._write("v", v_BKLD)

    def append(self, x_BKLD: torch.Tensor) -> torch.Tensor:
        """One buffer instead of two (MLA caches a single latent per token) -> every slot so far."""
        return self._write("k", x_BKLD)

    def _write(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        c = self.owner
        buf = getattr(self, name)
        if buf is None:
            B, K, _, D = x_BKLD.shape
            buf = x_BKLD.new_zeros(B, K, c.max_len, D)
            setattr(self, name, buf)
        n = x_BKLD.shape[2]
        if c.static:
            buf.index_copy_(2, c._slots(n), x_BKLD)
            return buf
        end = c.length + n
        if end > c.max_len:
            raise ValueError(f"KV cache of {c.max_len} slots is full ({end} needed)")
        buf[:, :, c.length:end] = x_BKLD
        return buf[:, :, :end]

    def attend(self, q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> torch.Tensor:
        """Attention of the new queries over this layer's cache, new keys included."""
        k, v = self.update(k_BKLD, v_BKLD)
        mask = self.owner.mask(q_BHLD.shape[2], k.shape[2])
        # GQA inside the kernel: each kv head serves H / K query heads without a repeated copy
        # (the same values as the training kernel's repeat_interleave).
        return F.scaled_dot_product_attention(q_BHLD, k, v, attn_mask=mask, enable_gqa=q_BHLD.shape[1] != k.shape[1])
