"""Init that scales: each rank computes only its own block of every parameter, and the blocks are
exactly those of the one-process init (values are a function of seed, FQN and element index)."""
import json
import os
import subprocess
import sys

import torch

from conftest import ROOT
from torchmeg.models.init import Constant, Normal, fill_block_, standard_normal


def test_blocks_equal_the_full_tensor_however_cut():
    full = fill_block_(torch.empty(37, 11, 5), Normal(0.5, 0.1), 1234, (37, 11, 5), (0, 0, 0))
    assert abs(full.mean().item() - 0.1) < 0.02 and abs(full.std().item() - 0.5) < 0.02
    for off, shape in (((3, 0, 0), (9, 11, 5)), ((0, 4, 2), (37, 3, 2)), ((36, 10, 4), (1, 1, 1))):
        block = fill_block_(torch.empty(shape), Normal(0.5, 0.1), 1234, (37, 11, 5), off)
        assert torch.equal(block, full[tuple(slice(o, o + n) for o, n in zip(off, shape))])
    other = fill_block_(torch.empty(37, 11, 5), Normal(0.5, 0.1), 1235, (37, 11, 5), (0, 0, 0))
    assert not torch.equal(other, full)  # another parameter (seed) gets other values
    assert torch.equal(fill_block_(torch.empty(4), Constant(1.0), 0, (8,), (4,)), torch.ones(4))


def test_standard_normal_is_standard():
    x = standard_normal(torch.arange(1 << 20), key=99)
    assert abs(x.mean().item()) < 0.005 and abs(x.std().item() - 1) < 0.005
    assert abs((x.abs() < 1).float().mean().item() - 0.6827) < 0.002  # the normal's 1-sigma mass
    assert x.abs().max().item() < 5.5


def test_each_rank_fills_only_its_shards_at_world_8():
    """A fake process group at world 8 (rank 5 of FSDP 8, TP2 x FSDP4, PP2 x TP2 x FSDP2 for Llama,
    GPT-2 and MoE): every local block equals the one-process init's block, and no full-size tensor
    of a large sharded parameter is ever created. The old full-draw path, run as a control, is seen
    to create them (so the check can fail)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "init_shard_worker.py"), "8", "5"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6
    for r in rows:
        assert r["same"], r
        assert r["big_sharded"] >= 3, r
        assert (r["full_tensors_made"] != []) == r["legacy"], r
