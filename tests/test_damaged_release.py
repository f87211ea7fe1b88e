"""A damaged or inconsistent Hub release is refused before anything is written: every file the index
names exists and opens, holds its tensors, and every quantized tensor has its scales in the grid the
quantization implies (read from the files' headers). Each problem is one line naming the file or the
tensor; `convert from-hf` exits 2 and leaves no `--out`. Before: a scale grid larger than the weight
implies was silently cropped (4 of 16 scales used: wrong weights), a smaller one raised a raw error,
and a missing scale or shard ended in a 56-62 line traceback from inside DCP's write."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from torchmeg.checkpoint.hf_quant import FolderReader, dequantize_fp8
from torchmeg.config.errors import ConfigError

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}


def _release(folder, tensors: dict, shards: int = 2) -> dict:
    """`tensors` written across `shards` files with an index, as the Hub's sharded releases are."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, os.path.join(folder, f))
        weight_map.update({n: f for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return {n: os.path.join(folder, f) for n, f in weight_map.items()}


def _fp8(rows=40, cols=70, grid=None):
    q = torch.randn(rows, cols).to(torch.float8_e4m3fn)
    return q, torch.rand(grid or (-(-rows // 16), -(-cols // 32)))


def _good():
    w, s = _fp8()
    u, t = _fp8(64, 64)
    return {"a.weight": w, "a.weight_scale_inv": s, "b.weight": u, "b.weight_scale_inv": t,
            "norm.weight": torch.ones(70)}


def test_a_sound_release_passes_and_reads_with_partial_edge_blocks(tmp_path):
    files = _release(tmp_path, _good())
    reader = FolderReader(files, {"quantization_config": FP8})
    reader.check()
    w = reader.read("a.weight")
    assert w.shape == (40, 70) and w.dtype == torch.float32


@pytest.mark.parametrize("case, named", [
    ("missing scale", r"a\.weight is stored in F8_E4M3 without a a\.weight_scale_inv"),
    ("grid too big", r"a\.weight_scale_inv is \[4, 4\]; a \[40, 70\] weight in weight_block_size \[16, 32\] blocks "
                     r"makes it \[3, 3\]"),
    ("grid too small", r"a\.weight_scale_inv is \[2, 3\]; .* makes it \[3, 3\]"),
    ("missing shard", r"model-00002-of-00002\.safetensors: model\.safetensors\.index\.json names it, but it is missing"),
    ("truncated shard", r"model-00001-of-00002\.safetensors: not a readable safetensors file"),
    ("tensor not in its shard", r"holds no ghost\.weight"),
    ("scale of a bf16 weight", r"norm\.weight has a norm\.weight_scale_inv but is stored in F32, not float8"),
])
def test_each_damage_is_one_line_naming_what_and_where(case, named, tmp_path):
    t = _good()
    if case == "missing scale":
        del t["a.weight_scale_inv"]
    elif case == "grid too big":
        t["a.weight_scale_inv"] = torch.rand(4, 4)  # (a release quantized with smaller blocks)
    elif case == "grid too small":
        t["a.weight_scale_inv"] = torch.rand(2, 3)
    elif case == "scale of a bf16 weight":
        t["norm.weight_scale_inv"] = torch.rand(1)
    files = _release(tmp_path, t)
    if case == "missing shard":
        os.unlink(next(f for f in set(files.values()) if f.endswith("00002-of-00002.safetensors")))
    elif case == "truncated shard":
        path = next(f for f in set(files.values()) if f.endswith("00001-of-00002.safetensors"))
        data = open(path, "rb").read()
        open(path, "wb").write(data[:len(data) // 2])
    elif case == "tensor not in its shard":
        files["ghost.weight"] = files["a.weight"]
    with pytest.raises(ConfigError, match=named) as e:
        FolderReader(files, {"quantization_config": FP8}).check()
    assert "\n" not in str(e.value)


def test_dequantize_refuses_a_grid_the_block_size_does_not_make():
    q, s = _fp8(grid=(4, 4))
    with pytest.raises(ConfigError, match=r"a scale grid of \[4, 4\] for a \[40, 70\] weight: weight_block_size "
                                          r"\[16, 32\] makes it \[3, 3\]"):
        dequantize_fp8(q, s, [16, 32])
