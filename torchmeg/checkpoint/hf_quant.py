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

import math
import os

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
    grid = scale_grid(q.shape, block)
    if tuple(s.shape) != grid:
        raise ConfigError(f"a scale grid of {list(s.shape)} for a {list(q.shape)} weight: weight_block_size {block} "
                          f"makes it {list(grid)}")
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w.mul_(s)


def scale_grid(shape, block: list[int]) -> tuple:
    """The fp8 scale grid of a weight of `shape` in [rows, cols] blocks: ceil(rows / r) x ceil(cols / c)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


FLOAT8 = ("F8_E4M3", "F8_E5M2")  # safetensors' dtype names


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

    def check(self) -> None:
        """Before anything is written: every file the folder names exists and opens, holds the tensors it
        is named for, and every quantized tensor has its scales, of the shape the quantization implies
        (read from the files' headers: no tensor is loaded). ConfigError naming the file or tensor."""
        heads = {}
        for path in sorted(set(self.files.values())):
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: model.safetensors.index.json names it, but it is missing; download "
                                  f"the folder again")
            heads[path] = header(path)
        meta = {}
        for name, path in self.files.items():
            if name not in heads[path]:
                raise ConfigError(f"{path}: holds no {name} (model.safetensors.index.json names it there)")
            meta[name] = heads[path][name]
        for base, stored in self.parts.items():
            if self.method == "fp8":
                self._check_fp8(base, stored, meta)
            elif self.method == "mxfp4" and base + "_blocks" in stored:
                blocks = meta[base + "_blocks"][1]
                if base + "_scales" not in stored:
                    raise self._no_scales(base)
                if meta[base + "_scales"][1] != blocks[:-1]:
                    raise ConfigError(f"{self.files[base + '_scales']}: {base}_scales is {meta[base + '_scales'][1]}; "
                                      f"{base}_blocks {blocks} makes it {blocks[:-1]} (one scale per 32 values)")

    def _check_fp8(self, base: str, stored: list[str], meta: dict) -> None:
        scale = base + "_scale_inv"
        if base not in meta:
            raise ConfigError(f"{self.files[scale]}: {scale} has no {base} beside it")
        dtype, shape = meta[base]
        if scale not in stored:
            if dtype in FLOAT8:
                raise self._no_scale(base, dtype)
            return
        if dtype not in FLOAT8:
            raise ConfigError(f"{self.files[base]}: {base} has a {scale} but is stored in {dtype}, not float8 "
                              f"(quantization_config.quant_method = 'fp8')")
        got = meta[scale][1]
        if self.block is None:
            if math.prod(got) != 1:
                raise ConfigError(f"{self.files[scale]}: {scale} is {got} but config.json declares no "
                                  f"weight_block_size (one scale per tensor); the release's config is incomplete")
            return
        want = list(scale_grid(shape, self.block))
        if got != want:
            raise ConfigError(f"{self.files[scale]}: {scale} is {got}; a {shape} weight in weight_block_size "
                              f"{self.block} blocks makes it {want} (a release quantized with other blocks, or a "
                              f"wrong weight_block_size in config.json)")

    def _no_scale(self, name: str, dtype) -> ConfigError:
        return ConfigError(f"{self.files[name]}: {name} is stored in {dtype} without a {name}_scale_inv "
                           f"(config.json's quantization_config does not describe it)")

    def _no_scales(self, name: str) -> ConfigError:
        return ConfigError(f"{self.files[name + '_blocks']}: {name}_blocks has no {name}_scales beside it")

    def _get(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as fh:
            return fh.get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as the model holds it (float32 where it was stored quantized)."""
        stored = self.parts[name]
        if name + "_blocks" in stored:
            if name + "_scales" not in stored:
                raise self._no_scales(name)
            return dequantize_mxfp4(self._get(name + "_blocks"), self._get(name + "_scales"))
        t = self._get(name)
        if name + "_scale_inv" in stored:
            return dequantize_fp8(t, self._get(name + "_scale_inv"), self.block)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise self._no_scale(name, t.dtype)
        return t


def header(path: str) -> dict:
    """{name: (safetensors dtype, shape)} from a file's header; ConfigError naming a file that cannot be read."""
    try:
        with safe_open(path, "pt") as fh:
            slices = {k: fh.get_slice(k) for k in fh.keys()}
            return {k: (t.get_dtype(), list(t.get_shape())) for k, t in slices.items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not a readable safetensors file ({why}); download it again") from None
