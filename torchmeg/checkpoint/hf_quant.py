"""Quantized Hugging Face releases read as full-precision tensors, one tensor at a time.

config.json's `quantization_config` says how the weights are stored:
  fp8    (DeepSeek-V3 / R1, Qwen3-FP8): `W.weight` float8 e4m3 (or e5m2) with `W.weight_scale_inv`, one
         float32 scale per block of weight_block_size = [rows, cols] (128 x 128 in those releases; the
         last blocks of a dimension may be partial); W = q x scale blockwise. Without weight_block_size,
         one scale for the tensor. Only "dynamic" activation scaling is read (a static scheme's
         per-tensor activation scales have no place in a bf16 / fp32 model).
  mxfp4  (gpt-oss): an experts tensor `P` stored as `P_blocks` uint8 [..., rows, G, 16] (two e2m1 values
         a byte, low nibble first: 32 values a block) and `P_scales` uint8 [..., rows, G] (an e8m0
         exponent, bias 127, per block of 32); dequantized to [..., rows, G x 32] and its last two dims
         swapped, as the module holds it (OCP Microscaling spec v1.0; transformers' mxfp4 integration).
Other methods (gptq, awq, bitsandbytes, compressed-tensors, ...) are refused in one line: their
weights are not in torchmeg's reach without their own kernels' layouts.
"""
from __future__ import annotations

import torch
from safetensors import safe_open

from torchmeg.config.errors import ConfigError

METHODS = ("fp8", "mxfp4")
# e2m1: sign, 2 exponent bits, 1 mantissa bit -> these 16 values, by nibble
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """float32 q x scale, each scale covering a [rows, cols] block of q's last two dims."""
    w = q.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None or s.numel() == 1:
        return w * s
    rows, cols = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w.mul_(s)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., cols, rows] from MXFP4 blocks [..., rows, G, 16] and e8m0 scales [..., rows, G]."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], -1).flatten(-2)  # [..., rows, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous()


class FolderReader:
    """A model folder's tensors by their logical names (a quantized weight's scales folded in)."""

    def __init__(self, files: dict[str, str], config: dict):
        q = config.get("quantization_config") or {}
        self.method = q.get("quant_method")
        if self.method is not None and self.method not in METHODS:
            raise ConfigError(f"config.json: quantization_config.quant_method = {self.method!r}: torchmeg dequantizes "
                              f"{' and '.join(METHODS)} releases as it reads them (DeepSeek-V3, Qwen3-FP8, gpt-oss); "
                              f"convert a {self.method} model to bf16 with its own tools first")
        if self.method == "fp8" and q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(f"config.json: quantization_config.activation_scheme = {q['activation_scheme']!r}: "
                              f"only \"dynamic\" FP8 releases are read (static activation scales are not weights)")
        self.block = q.get("weight_block_size")
        self.files = files
        self.parts: dict[str, list[str]] = {}  # logical name -> the stored tensors it is made of
        for name in files:
            base = name
            if self.method == "fp8" and name.endswith("_scale_inv"):
                base = name[:-len("_scale_inv")]
            elif self.method == "mxfp4" and name.endswith(("_blocks", "_scales")):
                base = name[:-len("_blocks")]
            self.parts.setdefault(base, []).append(name)

    def keys(self) -> list[str]:
        return list(self.parts)

    def _get(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as fh:
            return fh.get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as the model holds it (float32 where it was stored quantized)."""
        stored = self.parts[name]
        if name + "_blocks" in stored:
            if name + "_scales" not in stored:
                raise ConfigError(f"{self.files[name + '_blocks']}: {name}_blocks has no {name}_scales beside it")
            return dequantize_mxfp4(self._get(name + "_blocks"), self._get(name + "_scales"))
        t = self._get(name)
        if name + "_scale_inv" in stored:
            return dequantize_fp8(t, self._get(name + "_scale_inv"), self.block)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConfigError(f"{self.files[name]}: {name} is stored in {t.dtype} without a {name}_scale_inv "
                              f"(config.json's quantization_config does not describe it)")
        return t
