"""Init that scales: each rank computes only its own block of every parameter, and the blocks are
exactly those of the one-process init (values are a function of seed, FQN and element index)."""
import pytest
import json
import os
import sys

import torch

from launch import ROOT, run_one
from torchmeg.models.init import Constant, Normal, fill_block_, open_uniform, standard_normal


def test_blocks_equal_the_full_tensor_however_cut():
    full = fill_block_(torch.empty(37, 11, 5), Normal(0.5, 0.1), 1234, (37, 11, 5), (0, 0, 0))
    assert abs(full.mean().item() - 0.1) < 0.02 and abs(full.std().item() - 0.5) < 0.02
    for off, shape in (((3, 0, 0), (9, 11, 5)), ((0, 4, 2), (37, 3, 2)), ((36, 10, 4), (1, 1, 1))):
        block = fill_block_(torch.empty(shape), Normal(0.5, 0.1), 1234, (37, 11, 5), off)
        assert torch.equal(block, full[tuple(slice(o, o + n) for o, n in zip(off, shape))])
    other = fill_block_(torch.empty(37, 11, 5), Normal(0.5, 0.1), 1235, (37, 11, 5), (0, 0, 0))
    assert not torch.equal(other, full)  # another parameter (seed) gets other values
    assert torch.equal(fill_block_(torch.empty(4), Constant(1.0), 0, (8,), (4,)), torch.ones(4))


def test_standard_normal_is_standard_over_2_26_draws():
    """2^26 draws (the old float32 uniform hit u = 1.0, ndtri = +inf, about 4 times in this many):
    all finite, and mean, std and the mass beyond 1..5 sigma within 5 standard errors of N(0, 1).
    Standard errors at N = 2^26: mean 1/sqrt(N) = 1.2e-4; std 1/sqrt(2N) = 8.6e-5; a tail mass p,
    sqrt(p (1 - p) / N) (beyond 5 sigma: p = 5.7e-7, ~38 draws expected, +-6)."""
    n, chunk = 1 << 26, 1 << 22
    tails = {1: 0.31731050786291404, 2: 0.04550026389635842, 3: 0.0026997960632601866,
             4: 6.334248366623996e-05, 5: 5.733031437583878e-07}
    s1 = s2 = 0.0
    counts = dict.fromkeys(tails, 0)
    for start in range(0, n, chunk):
        x = standard_normal(torch.arange(start, start + chunk), key=99).double()
        assert torch.isfinite(x).all(), f"non-finite draw in [{start}, {start + chunk})"
        s1 += x.sum().item()
        s2 += x.square().sum().item()
        a = x.abs()
        for t in tails:
            counts[t] += int((a > t).sum())
    mean = s1 / n
    std = (s2 / n - mean * mean) ** 0.5
    assert abs(mean) < 5 / n ** 0.5, mean
    assert abs(std - 1) < 5 / (2 * n) ** 0.5, std
    for t, p in tails.items():
        se = (p * (1 - p) / n) ** 0.5
        assert abs(counts[t] / n - p) < 5 * se, (t, counts[t] / n, p)


def test_uniform_never_reaches_0_or_1():
    """The extreme 64-bit words (all ones, all zeros, and around the sign bit) give uniforms strictly
    inside (0, 1) and finite normals; the old float32 construction gives 1.0 for the all-ones word."""
    z = torch.tensor([-1, 0, (1 << 63) - 1, -(1 << 63), 1 << 12, -(1 << 12)])
    u = open_uniform(z.clone())
    assert ((u > 0) & (u < 1)).all(), u
    x = torch.special.ndtri(u)
    assert torch.isfinite(x).all() and x.max().item() > 8 and x.min().item() < -8, x
    old = ((z >> 40) & ((1 << 24) - 1)).to(torch.float32).add_(0.5).mul_(2.0 ** -24)
    assert old[0].item() == 1.0  # the bug this guards against, reproduced


@pytest.mark.slow
def test_each_rank_fills_only_its_shards_at_world_8():
    """A fake process group at world 8 (rank 5 of FSDP 8, TP2 x FSDP4, PP2 x TP2 x FSDP2 for Llama,
    GPT-2 and MoE): every local block equals the one-process init's block, and no full-size tensor
    of a large sharded parameter is ever created. The old full-draw path, run as a control, is seen
    to create them (so the check can fail)."""
    p = run_one([sys.executable, os.path.join(ROOT, "tests", "init_shard_worker.py"), "8", "5"], dict(os.environ), 180)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6
    for r in rows:
        assert r["same"], r
        assert r["big_sharded"] >= 3, r
        assert (r["full_tensors_made"] != []) == r["legacy"], r


@pytest.mark.slow
def test_every_shipped_flavor_initialises_finite_at_its_layout():
    """Rank 0's shards of every shipped flavor at its recipe's layout (llama3_405b: TP 8 x PP 16 x FSDP 4
    of 512; flavors no recipe ships: FSDP 8), through the trainer's build on a fake process group:
    finite, and each parameter's sample within 5 standard errors of its rule's mean and std
    (tests/flavor_init_worker.py)."""
    p = run_one([sys.executable, os.path.join(ROOT, "tests", "flavor_init_worker.py")], dict(os.environ), 240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["case"]: r for r in (json.loads(x) for x in p.stdout.splitlines() if x.startswith("{"))}
    from torchmeg.models import get_spec
    shipped = {f"{m}/{f}" for m in ("llama", "gpt2", "moe") for f in get_spec(m).flavors}
    by_recipe = {"llama/debug", "gpt2/124M", "moe/debug", "llama/8B", "llama/70B", "llama/405B"}
    assert shipped <= set(rows) | by_recipe, shipped - set(rows) - by_recipe
    assert rows["recipes/llama3_405b.toml"]["layout"] == "world 512: dp_shard=4, tp=8, pp=16"
    for r in rows.values():
        assert r["params"] > 0 and r["sampled"] > 0 and r["bad"] == [], r
