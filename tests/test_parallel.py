"""Parity harness: every layout trains exactly like one process (same seed, weights, global batch).

Each case launches the real CLI under torchrun on gloo and compares per-step loss and grad norm
with the single-process run. fp32 + deterministic: tolerance 1e-5 (reduction order differs across
shards, nothing else). bf16: see the test for its tolerance and why.
"""
import json
import os
import sys

import pytest

from conftest import BF16_U, FP32_PARITY, reference_run, assert_parity as compare, TINY, read_metrics
from launch import ROOT, run_one, run_cli

GLOBAL = 8
BASE = TINY + ["--training.steps=4", "--training.deterministic=true", f"--training.global_batch_size={GLOBAL}"]
TOL = FP32_PARITY



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(extra=()):
        key = tuple(extra)
        if key not in cache:
            cache[key] = reference_run(tmp_path_factory, BASE + [f"--training.local_batch_size={GLOBAL}"] + list(extra))
        return cache[key]
    return get


P = "--parallelism."
LAYOUTS = {
    # name: (ranks, local batch, layout args)
    "tp2": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                   P + "sequence_parallel=false", P + "loss_parallel=false"]),
    "tp2_sp": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                      P + "sequence_parallel=true", P + "loss_parallel=false"]),
    "tp2_sp_loss_parallel": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "fsdp2": (2, 4, [P + "data_parallel_shard_degree=2"]),
    "fsdp2_zero2": (2, 4, [P + "data_parallel_shard_degree=2", P + "fsdp_reshard_after_forward=false"]),
    "ddp2": (2, 4, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=1"]),
    "hsdp2x2": (4, 2, [P + "data_parallel_replicate_degree=2", P + "data_parallel_shard_degree=2"]),
    "fsdp2_tp2": (4, 4, [P + "data_parallel_shard_degree=2", P + "tensor_parallel_degree=2"]),
    "fsdp2_grad_accum": (2, 2, [P + "data_parallel_shard_degree=2"]),  # 2 microbatches per step
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_matches_single_process(name, tmp_path, reference):
    ranks, local, layout = LAYOUTS[name]
    # The README's TP2 command runs under torchrun itself; the rest use the same worker environment.
    run_cli(BASE + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks,
            torchrun=name == "tp2_sp_loss_parallel", env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    compare(reference(), read_metrics(tmp_path), TOL)
    if "tp2" in name:  # a TP that silently replicated would pass the comparison: assert it sharded
        for rank in range(ranks):
            assert_tp_sharded(json.loads((tmp_path / f"ops.rank{rank}.json").read_text())["params"], tp=2)


def assert_tp_sharded(params: dict, tp: int) -> None:
    """Every Linear weight of attention and MLP, the embedding and the head: a DTensor sharded on
    the mesh's tp dim (colwise: dim 0, rowwise: dim 1), holding 1/tp of it there; norms replicated
    over tp."""
    linears = [n for n in params if n.endswith(".weight") and len(params[n]["global"]) == 2]
    assert len(linears) >= 7 * 2 + 2, linears  # q k v o, w1 w2 w3 per layer; embedding, head
    for n in linears:
        p = params[n]
        assert "tp" in p["mesh"], (n, p)
        place = p["placements"][p["mesh"].index("tp")]
        want = "Shard(1)" if n.endswith(("wo.weight", "w2.weight")) else "Shard(0)"
        assert place == want, (n, p)
        d = int(place[-2])
        assert p["local"][d] * tp <= p["global"][d] + tp, (n, p)  # (FSDP may shard the other dim further)
    for n in params:
        if "norm" in n and "tp" in params[n]["mesh"]:
            assert params[n]["placements"][params[n]["mesh"].index("tp")] == "Replicate", (n, params[n])


@pytest.mark.slow
def test_gpt2_tied_tp2_sp_matches(tmp_path):
    """GPT-2: tied embeddings, learned positions, biases, LayerNorm under TP + SP + loss_parallel."""
    base = [a for a in BASE if not a.startswith(("--model.n_kv_heads", "--model.multiple_of"))]
    gpt2 = ["--model.name=gpt2"]
    run_cli(base + gpt2 + ["--training.local_batch_size=8", P + "tensor_parallel_degree=2",
                           P + "data_parallel_shard_degree=1"], tmp_path, nproc=2)
    d = tmp_path / "ref"
    run_cli(base + gpt2 + ["--training.local_batch_size=8"], d)
    compare(read_metrics(d), read_metrics(tmp_path), TOL)


# bf16 tolerances, from the format. bf16 carries 8 significant bits: unit roundoff u = 2^-8 = 3.9e-3
# (relative error of one rounding). Two bf16 computations of the same function agree to u, and no
# better can be asked of the format: kernels blocked differently for 4 or 8 sequences round different
# partial sums (oneDNN's AVX2, AVX-512 and AMX kernels each block their own way).
#  * loss, val_loss: computed in fp32 from bf16 logits -> |rel diff| <= u at every step.
#  * grad norm at step 1 (same weights in both runs): one process rounds each weight gradient, a sum
#    over its 8 sequences, to bf16 once; FSDP 2 rounds each rank's 4-sequence sum once and adds the
#    two in fp32: |g_fsdp - g_one| <= u (|g_a| + |g_b| + |g_a + g_b|) ~ 2u |g| -> rel diff <= 2u.
#  * later grad norms are not compared: the norm of a 4-step bf16 trajectory moves by 2% between bf16
#    and fp32 runs (measured), so a bound on it would test the chaos of training, not the layout.


def _bf16_record(tmp_path, name):
    return {"TORCHMEG_RECORD_OPS": str(tmp_path / f"{name}_ops")}


def _read_record(tmp_path, name, rank=0):
    with open(tmp_path / f"{name}_ops.rank{rank}.json") as fh:
        return json.load(fh)


@pytest.mark.slow
def test_bf16_fsdp2_matches_bf16_single_process(tmp_path, reference):
    """bf16 compute (FSDP2's MixedPrecisionPolicy), fp32 master weights and reductions, on one
    process and on FSDP 2. Asserts what ran: every matmul and attention operand in step 1 is bf16
    on every rank (a policy left in fp32 fails here), and the bf16 run is not the fp32 run (in
    deterministic fp32 two runs agree bit for bit, so equality would mean bf16 never happened)."""
    bf16 = ["--training.mixed_precision=bf16"]
    run_cli(BASE + bf16 + ["--training.local_batch_size=8"], tmp_path, name="one", env=_bf16_record(tmp_path, "one"))
    run_cli(BASE + bf16 + ["--training.local_batch_size=4", P + "data_parallel_shard_degree=2"], tmp_path, name="two",
            nproc=2, env=_bf16_record(tmp_path, "two"))
    for name, rank in (("one", 0), ("two", 0), ("two", 1)):
        mm = _read_record(tmp_path, name, rank)["matmul_dtypes"]
        assert "mm" in mm and any("attention" in k for k in mm), mm
        assert all(v == ["bfloat16"] for v in mm.values()), (name, rank, mm)
    one, two, fp32 = read_metrics(tmp_path, "one"), read_metrics(tmp_path, "two"), reference()
    assert [r["loss"] for r in one] != [r["loss"] for r in fp32], "bf16 run equals the fp32 run"
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for k in ("loss",) + (("val_loss",) if "val_loss" in a else ()):
            assert abs(a[k] - b[k]) <= BF16_U * abs(a[k]), (a["step"], k, a[k], b[k])
    assert abs(one[0]["grad_norm"] - two[0]["grad_norm"]) <= 2 * BF16_U * one[0]["grad_norm"], (one[0], two[0])
    assert "val_loss" in one[-1]


@pytest.mark.slow
def test_fsdp4_holds_a_quarter_of_the_state(tmp_path):
    """Params + grads + AdamW state per rank under dp_shard = 4 vs one process, as the planner
    builds them through the trainer's own build (tests/test_plan.py shows those bytes equal the
    trainer's measured model_state_mib, layout by layout)."""
    state = {}
    for world in (1, 4):
        out = tmp_path / f"plan{world}.json"
        p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", "recipes/debug_llama.toml", "--world",
                      str(world), "--json", str(out), P + "data_parallel_shard_degree=-1"], dict(os.environ), 120)
        assert p.returncode == 0, p.stderr[-3000:]
        state[world] = json.load(open(out))["ranks"][0]["model_state_bytes"]
    assert state[4] <= 0.27 * state[1], state


@pytest.mark.slow
def test_bad_layout_fails_before_training(tmp_path):
    p = run_cli(TINY + [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"], tmp_path, nproc=2,
                check=False, torchrun=True)
    assert p.returncode != 0 and "world size is 2" in p.stderr
    assert "step" not in p.stdout


@pytest.mark.slow
def test_qwen3_shape_tp2_sp_matches_single_process(tmp_path, reference):
    """Qwen3's attention natively (QK norm over each head, head_dim apart from dim / heads) under TP2
    with SP and loss parallel: = one process. Each rank normalises its own heads, so the norms'
    weight gradients are partial sums that must be summed over tp (replicated DTensors: asserted);
    left unsummed, the ranks' norm weights drift apart and the loss leaves the reference."""
    qwen3 = ["--model.qk_norm=true", "--model.head_dim=32"]
    ranks, local, layout = LAYOUTS["tp2_sp_loss_parallel"]
    run_cli(BASE + qwen3 + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks,
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    compare(reference(qwen3), read_metrics(tmp_path), TOL)
    params = json.loads((tmp_path / "ops.rank0.json").read_text())["params"]
    norms = [n for n in params if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 and all(params[n]["placements"] == ["Replicate"] and params[n]["global"] == [32]
                                   for n in norms), {n: params[n] for n in norms}
    assert params["layers.0.attention.wq.weight"]["global"] == [4 * 32, 64]  # n_heads x head_dim != dim


@pytest.mark.slow
def test_vocab_parallel_embedding_grads_only_its_rows():
    """TP 2 on gloo (tests/vocab_embedding_worker.py): the plan's embedding roles look tokens up and
    take gradients as one process's nn.Embedding does (odd vocabulary, a padding row on either rank,
    SP and replicated outputs), and each rank's weight gradient arrives as its own rows (Shard(0),
    vocab / 2 x dim) after the one all-gather of the output gradient SP needs. torch's RowwiseParallel
    (what a subclass with its own forward keeps) builds the whole table's gradient on every rank."""
    import os
    from launch import launch_ranks
    p = launch_ranks([sys.executable, os.path.join(ROOT, "tests", "vocab_embedding_worker.py")], 2,
                      dict(os.environ, PYTHONUNBUFFERED="1"), timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, rows in (("sp_odd_vocab", 501), ("sp_pad_rank1", 500), ("replicated_pad_rank0", 500)):
        c = got[name]
        assert c["style"] == "VocabParallelEmbedding", c
        assert c["grad_arrives"] == [["(Shard(dim=0),)", [rows, 16]]], c
        assert c["backward_collectives"] == ({"all_gather_into_tensor": 1} if name.startswith("sp") else {}), c
    for name, c in got.items():  # fp32 lookups and sums of the same values: the fp32 rule, relative
        assert c["forward_err"] <= FP32_PARITY and c["grad_err"] <= FP32_PARITY, (name, c)
    assert got["subclass"]["style"] == "RowwiseParallel"
    assert got["subclass"]["grad_arrives"] == [["(Replicate(),)", [1000, 16]]], got["subclass"]
