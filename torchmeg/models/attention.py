"""Document-aware causal attention: a window packing documents A|B|C attends within each document
only, as if each ran alone (Megatron-LM's --reset-attention-mask; torchtitan's document masking).

`documents` [B, S] numbers the documents of each row of the window (0, 0, 1, 1, 1, 2, ...). On
CUDA it runs as FlexAttention with a block mask built on the device (models.flex_documents: one
kernel per layer, no host read). Elsewhere no S x S mask is built: each document's queries attend to
its own keys through the fused SDPA kernels, one call per (row, document) piece; rows holding a
single document run as one batched call. A query block that starts inside a document (a
context-parallel chunk) sees that document's earlier keys in full and its own block causally: SDPA
with a lower-right causal bias (a mask of that piece's size on CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from torchmeg.config.errors import ConfigError
from torchmeg.models.flex_documents import document_block_mask, flex_document_attention


def repeat_kv(x_BKLD: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: each of K kv heads serves `rep` consecutive query heads -> [B, K * rep, L, D]. Where the
    kernel takes GQA itself (SDPA's enable_gqa) it is not needed; CP repeats after its exchange."""
    return x_BKLD if rep == 1 else x_BKLD.repeat_interleave(rep, dim=1)


def check_document_masking(cfg, own_attention: bool) -> None:
    """Document masking runs inside torchmeg's attention modules (their swappable `sdpa`)."""
    if cfg.data.document_masking and not own_attention:
        raise ConfigError(f"data.document_masking = true: masks attention in torchmeg's own attention modules; "
                          f"model.name = {cfg.model.name!r} has none; set it to false")


def document_positions(documents_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] each token's position within its own document (0 at a document's first token)."""
    B, S = documents_BS.shape
    idx = torch.arange(S, device=documents_BS.device).expand(B, S)
    first = torch.ones_like(documents_BS, dtype=torch.bool)
    first[:, 1:] = documents_BS[:, 1:] != documents_BS[:, :-1]
    return idx - torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=1).values


def document_spans(documents_BS: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each document (one host read of the change points)."""
    change = (documents_BS[:, 1:] != documents_BS[:, :-1]).nonzero().tolist()
    S = documents_BS.shape[1]
    cuts = [[0] for _ in range(documents_BS.shape[0])]
    for b, j in change:
        cuts[b].append(j + 1)
    return [list(zip(c, c[1:] + [S])) for c in cuts]


class DocumentBatch:
    """A batch's document numbers with their spans read once: a model wraps its `documents` in one
    at the top of its forward, and every layer's attention reuses the spans (one host read per
    forward, not per layer)."""

    def __init__(self, documents_BS: torch.Tensor):
        self.ids, self._spans, self._masks = documents_BS, None, {}

    def block_mask(self, L: int, q_start: int):
        """FlexAttention's block mask for L queries from window token q_start (built once per forward)."""
        if (L, q_start) not in self._masks:
            self._masks[(L, q_start)] = document_block_mask(self.ids, L, q_start)
        return self._masks[(L, q_start)]

    @property
    def spans(self) -> list[list[tuple[int, int]]]:
        if self._spans is None:
            self._spans = document_spans(self.ids)
        return self._spans


def document_attention(q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, documents,
                       q_start: int = 0, flex: bool = False) -> torch.Tensor:
    """Causal attention within documents (`documents`: [B, S] document numbers, or a DocumentBatch).
    The queries are tokens [q_start, q_start + L) of the window, the keys and values all its S tokens
    (S = L, q_start = 0 outside context parallel). FlexAttention on CUDA, or with `flex` (CPU:
    forward only)."""
    L = q_BHLD.shape[2]
    batch = documents if isinstance(documents, DocumentBatch) else DocumentBatch(documents)
    if q_BHLD.is_cuda or flex:
        return flex_document_attention(q_BHLD, k_BKSD, v_BKSD, batch.block_mask(L, q_start))
    gqa = q_BHLD.shape[1] != k_BKSD.shape[1]
    spans = batch.spans
    full = q_start == 0 and L == k_BKSD.shape[2]
    if full and all(len(sp) == 1 for sp in spans):  # one document per row: plain causal, no copies
        return F.scaled_dot_product_attention(q_BHLD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=gqa)
    whole = [b for b, sp in enumerate(spans) if len(sp) == 1 and full]
    rows: dict[int, torch.Tensor] = {}
    if whole:  # rows with one document: one batched causal call
        idx = torch.tensor(whole, device=q_BHLD.device)
        out = F.scaled_dot_product_attention(q_BHLD[idx], k_BKSD[idx], v_BKSD[idx], is_causal=True, enable_gqa=gqa)
        rows.update(zip(whole, out.unbind(0)))
    for b, sp in enumerate(spans):
        if b in rows:
            continue
        pieces = []
        for ds, de in sp:
            a, e = max(ds, q_start), min(de, q_start + L)
            if a >= e:
                continue  # this document has no queries in the block
            q = q_BHLD[b:b + 1, :, a - q_start:e - q_start]
            k, v = k_BKSD[b:b + 1, :, ds:e], v_BKSD[b:b + 1, :, ds:e]
            if a == ds:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(e - a, e - ds),
                                                   enable_gqa=gqa)
            pieces.append(o)
        rows[b] = torch.cat(pieces, dim=2)[0]
    return torch.stack([rows[b] for b in range(len(spans))])
