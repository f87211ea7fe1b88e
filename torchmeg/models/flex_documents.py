"""Document-causal attention through torch's FlexAttention: on CUDA, one fused kernel per layer over
the whole batch, its block mask built on the device from the document numbers — no host read and
no per-document kernel calls (models.attention's SDPA path reads where documents end once per
forward and calls the kernel per piece).

Why CUDA only: FlexAttention has no CPU backward in torch 2.13 ("FlexAttention does not support
backward on CPU"), so CPU training keeps the SDPA path; on CPU the same mask and kernel run forward
only, and tests/test_documents.py checks them against the SDPA path there (tests/gpu: on CUDA, with
gradients).

The mask: query i of the block (token q_start + i of the window) sees key j when both lie in the
same document and j <= q_start + i — the same rule as the SDPA path, context-parallel chunks
(q_start > 0) included.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@functools.cache
def _kernel():
    # Eager flex_attention is a dense reference implementation (an S x S score matrix); compiled,
    # it is the fused block-sparse kernel.
    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(documents_BS: torch.Tensor, L: int, q_start: int = 0) -> BlockMask:
    """The block mask of `L` queries starting at window token `q_start` over all S keys."""
    docs = documents_BS
    B, S = docs.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        q = q_idx + q_start
        return (docs[b, q] == docs[b, kv_idx]) & (q >= kv_idx)
    # (compiled on CUDA: builds the block structure without materialising a B x L x S mask)
    return create_block_mask(same_document_causal, B, None, L, S, device=docs.device, _compile=docs.is_cuda)


def flex_document_attention(q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                            block_mask: BlockMask) -> torch.Tensor:
    # torch's own switch for running flex uncompiled (_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG) is
    # honoured here too: the op recorder (TORCHMEG_RECORD_OPS) sets it while it records a step, and
    # our compiled kernel entered under its dispatch mode fails on torch 2.11 (an H200, 2026-11-29:
    # dynamo traced flex's dense reference and stopped at `torch._safe_softmax`). Uncompiled, flex is
    # the plain op, its backward included, which the mode sees.
    kernel = flex_attention if getattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False) else _kernel()
    return kernel(q_BHLD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=q_BHLD.shape[1] != k_BKSD.shape[1])
