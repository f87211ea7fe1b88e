"""The CPU paged decode attention kernel (torchmeg.batching.cpu_attention): each query row's attention
over its own positions, read through its block table from the pools. Judged by the textbook formula in
float64 over the positions gathered by hand, on tables users' batches make: scattered blocks, blocks
shared by rows (a cached prefix), partial last blocks, grouped-query heads, head sizes that are not a
multiple of the vector width, padded rows that read the null block; and bad tables refused by name.
"""
import random

import pytest
import torch

from tolerance import BF16_U, assert_tensor_close
from torchmeg.batching import cpu_attention

pytestmark = pytest.mark.slow  # (the kernel's build: ~10-25 s once per machine and ISA, a load after)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.load(), cpu_attention.why_not()


def reference(q, k_pool, v_pool, tables, starts, scale, block):
    """softmax(q k^T * scale) v over each row's positions 0 .. start, gathered through its table, float64."""
    out = []
    group = q.shape[1] // k_pool.shape[0]
    for r in range(q.shape[0]):
        n = int(starts[r]) + 1
        slots = (tables[r][:, None] * block + torch.arange(block)).flatten()[:n]
        k = k_pool[:, slots].double().repeat_interleave(group, 0)
        v = v_pool[:, slots].double().repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q[r].double() * scale, k), -1)
        out.append(torch.einsum("hl,hld->hd", p, v))
    return torch.stack(out)


def case(R, H, K, D, block, blocks=48, width=7, seed=0, dtype=torch.float32):
    """R rows over a pool of `blocks` blocks: row 0 and 1 share their first 3 blocks (a prefix), the
    rest scattered; starts anywhere in the table, block edges included; the last row a padded one (the
    null block 0 at start 0)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k_pool = torch.randn(K, blocks * block, D, generator=g).to(dtype)
    v_pool = torch.randn(K, blocks * block, D, generator=g).to(dtype)
    tables = [rng.sample(range(1, blocks), width) for _ in range(R)]
    if R > 2:
        tables[1][:3] = tables[0][:3]
    starts = [rng.choice([0, block - 1, block, width * block - 1, rng.randrange(width * block)]) for _ in range(R)]
    if R > 1:
        tables[-1], starts[-1] = [0] * width, 0
    q = torch.randn(R, H, D, generator=g).to(dtype)
    return q, k_pool, v_pool, torch.tensor(tables), torch.tensor(starts)


@pytest.mark.parametrize("R,H,K,D,block", [(6, 4, 2, 32, 16), (3, 2, 2, 20, 16), (1, 8, 1, 64, 8), (9, 3, 3, 128, 32),
                                           (32, 2, 2, 32, 16)])
def test_each_row_attends_over_its_own_blocks_as_the_formula(R, H, K, D, block):
    """fp32: the kernel's sums (a dot product of D terms a position, a softmax and a weighted sum over
    at most 112 positions, float32) against float64 over the same positions: FP32_PARITY, the suite's
    fp32 bound (~168 units of 2^-24, room for sums of a few hundred terms in another order)."""
    for seed in range(3):
        q, kp, vp, tables, starts = case(R, H, K, D, block, seed=seed)
        out = cpu_attention.paged_decode_attention(q, kp, vp, tables, starts, D ** -0.5, block)
        assert out.shape == q.shape and out.dtype == torch.float32
        assert_tensor_close(out, reference(q, kp, vp, tables, starts, D ** -0.5, block), what=f"R{R} H{H} K{K} D{D}")


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, BF16_U), (torch.float16, 2.0 ** -11)])
def test_reduced_precision_pools_accumulate_in_float32(dtype, unit):
    """bf16 and fp16 pools are read as floats and summed in float32; the one rounding is the output's,
    to the format: within one unit of it (2^-8 bf16, 2^-11 fp16) of the float64 formula over the same
    rounded inputs, plus the fp32 bound."""
    q, kp, vp, tables, starts = case(7, 4, 2, 32, 16, seed=5, dtype=dtype)
    out = cpu_attention.paged_decode_attention(q, kp, vp, tables, starts, 32 ** -0.5, 16)
    assert out.dtype == dtype
    assert_tensor_close(out.float(), reference(q, kp, vp, tables, starts, 32 ** -0.5, 16), rtol=unit + 1e-5)


def test_a_row_reads_only_its_own_positions():
    """Changing a position a row does not read (past its start, another row's block, a block not in its
    table) leaves its output as it was; changing one it reads moves it."""
    q, kp, vp, tables, starts = case(4, 2, 2, 32, 16, seed=7)
    starts[0] = 16 + 4  # row 0 reads its first block and 5 positions of its second
    before = cpu_attention.paged_decode_attention(q, kp, vp, tables, starts, 0.2, 16)
    kp2, vp2 = kp.clone(), vp.clone()
    second = int(tables[0, 1])
    kp2[:, second * 16 + 5:(second + 1) * 16] += 9.0  # past row 0's start, in its own block
    unread = sorted(set(range(1, 48)) - set(tables[0, :2].tolist()))[0]
    vp2[:, unread * 16:(unread + 1) * 16] -= 7.0
    after = cpu_attention.paged_decode_attention(q, kp2, vp2, tables, starts, 0.2, 16)
    assert torch.equal(after[0], before[0])
    vp2[:, second * 16 + 4] += 1.0  # the last position row 0 reads
    assert not torch.equal(cpu_attention.paged_decode_attention(q, kp2, vp2, tables, starts, 0.2, 16)[0], before[0])


def test_bad_tables_are_refused_by_name_before_any_read():
    """A block outside the pool or a start past the row's table would read out of bounds: refused, the
    row and what it asked named."""
    q, kp, vp, tables, starts = case(3, 2, 2, 32, 16, seed=2)
    bad = tables.clone()
    bad[1, 0] = 48
    with pytest.raises(RuntimeError, match="row 1 reads block 48 of a pool of 48"):
        cpu_attention.paged_decode_attention(q, kp, vp, bad, starts, 0.2, 16)
    with pytest.raises(RuntimeError, match="row 2's start 112 is past its table"):
        cpu_attention.paged_decode_attention(q, kp, vp, tables, torch.tensor([0, 0, 112]), 0.2, 16)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        cpu_attention.paged_decode_attention(q.double(), kp, vp, tables, starts, 0.2, 16)
